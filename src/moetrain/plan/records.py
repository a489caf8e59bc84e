"""The published DeepSeek-V3 training throughputs (docs/reference.md section 4) with the plan each one ran.

The parallel sizes, batch and precision are those of the table. The remaining plan fields (recompute, overlap,
attention precision, pipeline layout) are taken from the public recipe of each run:

* Megatron-Bridge runs: ``scripts/performance/configs/deepseek/deepseek_workload_base_configs.py`` (the MXFP8
  configs of GB300 / GB200, the FP8-SC config of H100; all three set ``moe_flex_dispatcher_backend="hybridep"``,
  the MXFP8 ones ``cuda_graph_impl="full_iteration"`` and ``cutedsl_fused_grouped_mlp=True`` (at the 26.06 summary
  commit 8f341b04f), the H100 one no CUDA graphs and ``recompute_modules = ["mla_up_proj", "mlp"]``) and the
  dry-run dump of the H100 config
  (``grad_reduce_in_fp32: false``, bf16 moments, ``moe_router_force_load_balancing: true``, group-limited routing
  8 groups / 4 kept). GB300: no recompute, a2a overlap, FP8 dot-product attention, layout ``Et*4|(t*4|)*14tmL``.
  GB200: ``mla_up_proj`` recompute, a2a overlap, BF16 attention, the same layout (Megatron-Bridge's default
  for PP4/VPP4). H100: ``mla_up_proj`` (+ dense ``mlp``)
  recompute, no a2a overlap, layout ``Et|(tt|)*30mL``.
* DeepSeek-V3 report (arXiv 2412.19437): DualPipe PP16, EP64 over 8 nodes, ZeRO-1 DP, no TP, FP8 GEMMs, FP8
  dispatch / BF16 combine, RMSNorm + MLA up-projection recompute, node-limited routing (M = 4), learned routing
  with auxiliary-loss-free balancing, fp32 master weights and gradients with bf16 moments, FP8 working weights
  (no BF16 copy); the stage split is not published -- the Megatron one above (4 layers a stage, embedding with
  the first, MTP and head with the last; DualPipe puts both on rank 0) is assumed; the batch ramps to
  15,360 sequences (used here), 2,048 H800.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.layout import Name
from moetrain.plan.plan import Plan


class Role(Name):
    """What a published row was to the performance model while it was built."""

    #: compared with while the constants and mechanisms were set (docs/performance-model.md, "How the values were
    #: reached"): the model reproducing it is no test of the model
    CALIBRATION = "calibration"
    #: never compared with while the model was built (``moetrain.plan.validation``): the model's test
    HELD_OUT = "held-out"

    @property
    def meaning(self) -> str:
        """One line for a report."""
        if self == Role.CALIBRATION:
            return ("a calibration row: the model's constants and mechanisms were set while comparing with this run, "
                    "so agreement here is no test; the held-out runs are `moetrain plan --validate`")
        return "held out: never compared with while the model was built"


@dataclass(frozen=True)
class Record:
    """One published throughput and the plan behind it."""

    key: str
    source: str
    gpu: str
    n_gpus: int
    plan: Plan
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    tolerance: float
    model: str = "deepseek-v3-671b"
    #: accepted predicted/published ratios; None = 1 -/+ tolerance. The H800 figure is a whole-run average
    #: (GPU-hours per trillion tokens), a lower bound for the steady-state step: [1, 1/0.8] (at least 80% goodput).
    band_ratio: tuple[float, float] | None = None
    framework: str = "megatron"
    #: every record is a calibration row: the constants reproduce the four (docs/performance-model.md), the GB300
    #: one being the run the Blackwell constants were first set on; the held-out rows are the validation points
    role: Role = Role.CALIBRATION

    @property
    def band(self) -> tuple[float, float]:
        """Accepted predicted TFLOP/s per GPU, (low, high)."""
        lo, hi = self.band_ratio or (1 - self.tolerance, 1 + self.tolerance)
        return lo * self.tflops_per_gpu, hi * self.tflops_per_gpu

    def in_band(self, predicted: float) -> bool:
        lo, hi = self.band
        return lo <= predicted <= hi


RECORDS: dict[str, Record] = {r.key: r for r in (
    Record(
        key="gb300", source="Megatron-Bridge 26.06", gpu="gb300", n_gpus=256,
        plan=Plan(tp=1, pp=2, vpp=8, ep=32, micro_batch=1, global_batch=4096, seq_len=4096, precision="mxfp8",
                  attn_precision="fp8", recompute="none", ep_overlap=True, routing="balanced",
                  pp_layout="Et*4|(t*4|)*14tmL", optimizer="bf16", dispatcher="flex", cuda_graphs="full",
                  fused_mlp=True, framework="megatron", name="GB300 record"),
        tokens_per_s_per_gpu=6338, tflops_per_gpu=1648, tolerance=0.05),
    Record(
        key="gb200", source="Megatron-Bridge 26.06", gpu="gb200", n_gpus=256,
        plan=Plan(tp=1, pp=4, vpp=4, ep=64, micro_batch=1, global_batch=4096, seq_len=4096, precision="mxfp8",
                  recompute="selective", recompute_modules=("mla_up_proj",), ep_overlap=True, routing="balanced",
                  pp_layout="Et*4|(t*4|)*14tmL", optimizer="bf16", dispatcher="flex", cuda_graphs="full",
                  fused_mlp=True, framework="megatron", name="GB200 record"),
        tokens_per_s_per_gpu=4969, tflops_per_gpu=1292, tolerance=0.10),
    Record(
        key="h100", source="Megatron-Bridge 25.09", gpu="h100", n_gpus=1024,
        plan=Plan(tp=2, pp=8, vpp=4, ep=64, micro_batch=1, global_batch=8192, seq_len=4096, precision="fp8",
                  recompute="selective", recompute_modules=("mla_up_proj", "mlp"), ep_overlap=False,
                  routing="balanced", pp_layout="Et|(tt|)*30mL", optimizer="bf16", dispatcher="flex",
                  cuda_graphs="none", framework="megatron", name="H100 record"),
        tokens_per_s_per_gpu=1297, tflops_per_gpu=338, tolerance=0.10),
    Record(
        key="h800", source="DeepSeek-V3 report (derived)", gpu="h800", n_gpus=2048,
        plan=Plan(tp=1, pp=16, vpp=1, ep=64, micro_batch=1, global_batch=15360, seq_len=4096, precision="fp8",
                  dispatch_precision="fp8", recompute="selective",
                  recompute_modules=("layernorm", "mla_up_proj", "moe_act"), schedule="dualpipe", ep_overlap=True,
                  routing="real", node_limit_m=4, optimizer="bf16-moments", fp8_param=True,
                  pp_layout="Et*4|(t*4|)*14tmL", dispatcher="flex", framework="deepseek",
                  name="DeepSeek-V3 H800"),
        tokens_per_s_per_gpu=1543, tflops_per_gpu=400, tolerance=0.25, band_ratio=(1.0, 1 / 0.8),
        framework="deepseek"),
)}


def get_record(key: str) -> Record:
    """Look a published row up ("gb300", "gb200", "h100", "h800").

    Raises:
        KeyError: unknown key; the message lists the rows.
    """
    try:
        return RECORDS[key.lower()]
    except KeyError:
        raise KeyError(f"unknown record {key!r}; known: {sorted(RECORDS)}") from None
