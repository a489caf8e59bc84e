"""Analytical performance model of MoE pre-training: ``moetrain plan`` and ``moetrain bench``.

Entry points:

* :func:`predict` -- step time breakdown, tokens/s and TFLOP/s per GPU, MFU and memory per GPU of a
  :class:`Plan` for a model on ``n`` GPUs of a :class:`GPUSpec` (catalogue: :func:`get_gpu`).
* :func:`search` -- rank valid plans by predicted TFLOP/s per GPU within the memory limit.
* :func:`scale` -- the same across GPU counts, with time to train a token budget.
* :data:`RECORDS` -- the published DeepSeek-V3 throughputs (docs/reference.md section 4) with their plans.
* :func:`predict_local_train` -- tokens/s of a local ``moetrain train`` run from ``moetrain bench`` measurements.

Efficiency constants: :mod:`moetrain.plan.constants`. Documentation: ``docs/performance-model.md``.
"""

from moetrain.plan.constants import BLACKWELL, CPU, HOPPER, Efficiency, efficiency_for
from moetrain.plan.hardware import CATALOGUE, GPUSpec, HardwareError, get_gpu, gpu_from_bench, load_gpu_file
from moetrain.plan.model import MemoryBreakdown, Prediction, StepBreakdown, predict
from moetrain.plan.plan import Plan, PlanError, validate
from moetrain.plan.records import RECORDS, Record, get_record
from moetrain.plan.search import ScalePoint, SearchResult, scale, search
from moetrain.plan.shape import ModelShape, ShapeError, load_shape, shape_from_hf

__all__ = [
    "BLACKWELL", "CATALOGUE", "CPU", "HOPPER", "RECORDS", "Efficiency", "GPUSpec", "HardwareError",
    "MemoryBreakdown", "ModelShape", "Plan", "PlanError", "Prediction", "Record", "ScalePoint", "SearchResult",
    "ShapeError", "StepBreakdown", "efficiency_for", "get_gpu", "get_record", "gpu_from_bench", "load_gpu_file",
    "load_shape", "predict", "predict_local_train", "scale", "search", "shape_from_hf", "validate",
]


def predict_local_train(*args, **kwargs):  # noqa: D103 - thin lazy wrapper, see moetrain.plan.local
    from moetrain.plan.local import predict_local_train as f

    return f(*args, **kwargs)
