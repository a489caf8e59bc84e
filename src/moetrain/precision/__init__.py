"""FP8 training (``parallel.precision`` fp8 / mxfp8): quantisation reference, FP8 linear and grouped GEMMs, recipes.

These are the kernels the model's modules call, below the model in the layers (tools/import_graph.py).
:func:`moetrain.precision.apply.apply_fp8`, which swaps them into a built model, sits above it and is not
re-exported here: importing this package must not import the model.

* :mod:`~moetrain.precision.quant` -- E4M3 casts, tile/block scales (fp32 and E8M0), dequantisation.
* :mod:`~moetrain.precision.gemm` -- FP8 GEMM reference (fp32 GEMM of dequantised operands), fast paths and their
  tolerance (``FAST_PATH_RTOL``, ``fast_path_rtol``).
* :mod:`~moetrain.precision.fused` -- the quantisers of the kernels' operands, ``torch.compile``d on CUDA.
* :mod:`~moetrain.precision.linear` -- autograd FP8 linear (fprop, dgrad, wgrad) and :class:`Fp8Linear`.
* :mod:`~moetrain.precision.grouped` -- aligned expert groups and the FP8 grouped GEMM of the routed experts
  (``fp8_grouped_mm``; ``grouped_reference``, its definition, for checks on a GPU).
* :mod:`~moetrain.precision.recipe` -- the "blockwise" (DeepSeek-V3) and "mxfp8" (OCP MX) recipes.
* :mod:`~moetrain.precision.primary_weights` -- FP8 primary weights (``parallel.fp8_param``): weights held in FP8,
  quantised once per optimizer step, all-gathered by FSDP2 as FP8 bytes.

See docs/fp8.md for the recipes and their sources.
"""

from moetrain.precision.quant import E4M3_MAX, FP8_DTYPE, Quantized, cast_e4m3, fake_quantise, quantise
from moetrain.precision.recipe import BLOCKWISE, MXFP8, RECIPE_NAMES, RECIPES, Fp8Recipe, get_recipe

__all__ = ["E4M3_MAX", "FP8_DTYPE", "Quantized", "cast_e4m3", "fake_quantise", "quantise", "BLOCKWISE",
           "MXFP8", "RECIPE_NAMES", "RECIPES", "Fp8Recipe", "get_recipe"]
