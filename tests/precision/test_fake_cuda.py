"""The CUDA-only code paths on fake CUDA tensors, on a machine without a GPU.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` tensors made on "cuda" carry shapes, strides and dtypes, and
every op runs torch's own meta checks: those of ``scaled_mm`` (``_check_scaled_mm_sizes_v2``), ``_scaled_grouped_mm``
and ``_grouped_mm`` (``_meta_grouped_mm_common``) are the checks the CUDA kernels make. The operands here are the
ones our code builds (``Fp8LinearFunction``, ``RowwiseFp8GroupedMM``, ``GroupedExperts``, ``MLA``), at the shapes of
the tiny, small and DeepSeek-V3 671B presets. A dispatch log records which kernels ran, so a silent fallback fails.

What cannot be faked, and how these tests get around it or name it:

* The device's compute capability: ``moetrain.devices.cuda_capability`` is patched to pose as sm90 / sm100.
* The autograd engine (building a graph over fake CUDA leaves aborts the process on torch 2.13 CPU; torch 2.11's
  CUDA build without a driver raises "hasPrimaryContext"): the tests call the autograd Functions' ``forward`` and
  ``backward`` with a stand-in ctx, and keep every fake tensor out of autograd (``requires_grad`` False).
* Python indexing, ``.contiguous()`` and ``.copy_()`` on a CPU-only build (device guard, ``moetrain.devices``): the
  precision and expert code avoid them; the model code that indexes (MLA, RoPE) runs only where torch is built
  with CUDA (skip named otherwise).
* Values: a fake tensor has none. The kernels' handling of uneven and empty groups (data in ``offs``) and the
  numbers they compute are checked on a GPU (benchmarks/fp8_gpu_verify.py) and, for the definitions, on CPU.
* SDPA backend choice (C++, CUDA only): under fake tensors SDPA takes its math path; the MLA test checks the
  operands against the constraints of the flash kernel and runs the flash op's meta forward and backward on them.
* FSDP2: ``fully_shard`` reads ``torch.cuda.current_device()`` (needs the CUDA runtime); see its skip.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain import devices
from moetrain.model.config import get_preset
from moetrain.model.experts import GroupedExperts, _GroupedMM, _grouped_mm_supported
from moetrain.model.transformer import build_model
from moetrain.precision import fused, gemm
from moetrain.precision.apply import apply_fp8
from moetrain.precision.gemm import operand_t, scaled_mm_fast
from moetrain.precision.grouped import RowwiseFp8GroupedMM, aligned_layout
from moetrain.precision.linear import Fp8Linear, Fp8LinearFunction
from moetrain.precision.primary_weights import Fp8HeldWeight
from moetrain.precision.quant import FP8_DTYPE, quantise
from moetrain.precision.recipe import BLOCKWISE, MXFP8, Fp8Recipe

aten = torch.ops.aten
PRESETS = ("tiny", "small", "deepseek-v3-671b")
HOPPER, BLACKWELL = (9, 0), (10, 0)
#: Tokens per micro-batch and local experts (DeepSeek-V3: 8 of 256 per rank, EP 32) used with each preset.
TOKENS = {"tiny": 1024, "small": 2048, "deepseek-v3-671b": 4096}
LOCAL_EXPERTS = {"tiny": 16, "small": 32, "deepseek-v3-671b": 8}


class Ctx:
    """Stand-in for an autograd Function's ctx: what our Functions use of it."""

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (True,) * n_inputs
        self.saved_tensors: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


class KernelLog(TorchDispatchMode):
    """Counts the GEMM kernels dispatched (inside FakeTensorMode, so each one went through its meta check)."""

    KERNELS = {aten._scaled_mm_v2.default: "scaled_mm", aten._scaled_grouped_mm.default: "scaled_grouped_mm",
               aten._grouped_mm.default: "grouped_mm", aten.mm.default: "mm", aten.bmm.default: "bmm"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.mm_precisions: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = self.KERNELS.get(func)
        if name:
            self.calls.append(name)
            if name == "mm":
                self.mm_precisions.append(torch.backends.cuda.matmul.fp32_precision)
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.calls.count(name)


@pytest.fixture
def gpu(monkeypatch):
    """Pose as a GPU of the given capability; the quantisers stay eager (compiling fake tensors is not the point)."""
    monkeypatch.setattr(fused, "compiles", lambda device: False)
    monkeypatch.setattr(gemm, "_WARNED", set())

    def pose(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(devices, "cuda_capability", lambda device=None: cap)
    return pose


def _cuda(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _linear_shapes(preset: str) -> list[tuple[int, int]]:
    """(K, N) of every FP8 linear of the preset's model (MLA projections, dense and shared-expert SwiGLU, MTP)."""
    cfg = get_preset(preset)
    cfg.n_layers = cfg.n_dense_layers + 1
    model = build_model(cfg, device="meta")
    apply_fp8(model, "blockwise")
    return sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, Fp8Linear)})


def _run_linear(x: torch.Tensor, w: torch.Tensor, r: Fp8Recipe) -> tuple[torch.Tensor, ...]:
    ctx = Ctx(3)
    y = Fp8LinearFunction.forward(ctx, x, w, r)
    dx, dw, _ = Fp8LinearFunction.backward(ctx, torch.empty_like(y))
    return y, dx, dw


# ---- the scale layouts of scaled_mm ------------------------------------------------------------------------------

#: (M, K, N): the two shapes the H200 rejected with the old layout (K / 128 not a multiple of 4), DeepSeek-V3's
#: kv_a_proj (N = 576, not a multiple of 128), an odd shape (no dim a multiple of 128) and a DeepSeek-V3 one.
LAYOUT_SHAPES = [(1024, 768, 768), (1024, 128, 384), (4096, 7168, 576), (300, 200, 136), (4096, 7168, 2048)]


@pytest.mark.parametrize("M,K,N", LAYOUT_SHAPES)
def test_blockwise_operands_of_all_three_gemms_pass_torchs_scaled_mm_check(gpu, M, K, N):
    gpu(HOPPER)
    with FakeTensorMode(), KernelLog() as log:
        x, w, dy = _cuda(M, K, dtype=torch.bfloat16), _cuda(N, K), _cuda(M, N, dtype=torch.bfloat16)
        wq = quantise(w, (128, 128))
        y = scaled_mm_fast(quantise(x, (1, 128)), wq)                            # fprop: x 1x128, W 128x128
        dx = scaled_mm_fast(quantise(dy, (1, 128)), operand_t(wq))               # dgrad: dy 1x128, W^T's blocks
        dw = scaled_mm_fast(quantise(dy.t(), (1, 128)), quantise(x.t(), (1, 128)))  # wgrad: both 1x128 on tokens
        assert y is not None and dx is not None and dw is not None
        assert (y.shape, dx.shape, dw.shape) == ((M, N), (M, K), (N, K))
    assert log.count("scaled_mm") == 3


def test_the_old_weight_scale_layout_is_rejected_by_torchs_check():
    # The layout gemm.py had (scale_b = W's block scales transposed, (K/128, N/128)): torch's own check refuses it
    # at K = 768, which is what the H200 reported. The test above would fail the same way on that code.
    S = F.ScalingType
    with FakeTensorMode():
        a, w = quantise(_cuda(1024, 768), (1, 128)), quantise(_cuda(768, 768), (128, 128))
        sa = a.scale.t().clone(memory_format=torch.contiguous_format).t()
        with pytest.raises(Exception, match="blockwise scaling"):
            F.scaled_mm(a.data, w.data.t(), sa, S.BlockWise1x128, w.scale.t(), S.BlockWise128x128,
                        output_dtype=torch.float32)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("r,cap", [(BLOCKWISE, HOPPER), (MXFP8, BLACKWELL)], ids=["blockwise-sm90", "mxfp8-sm100"])
def test_fp8_linear_fprop_dgrad_wgrad_reach_scaled_mm_at_preset_shapes(gpu, preset, r, cap):
    gpu(cap)
    M = TOKENS[preset]
    with FakeTensorMode():
        for K, N in _linear_shapes(preset):
            with KernelLog() as log:
                y, dx, dw = _run_linear(_cuda(M, K, dtype=torch.bfloat16), _cuda(N, K), r)
            assert log.calls == ["scaled_mm"] * 3, (K, N, log.calls)  # no fallback GEMM
            assert (y.shape, y.dtype, dx.shape, dx.dtype) == ((M, N), torch.bfloat16, (M, K), torch.bfloat16)
            assert (dw.shape, dw.dtype) == ((N, K), torch.float32)


@pytest.mark.parametrize("r,cap,needs", [(BLOCKWISE, BLACKWELL, "Hopper (sm90)"),
                                         (MXFP8, HOPPER, "Blackwell (sm100) or newer")],
                         ids=["blockwise-sm100", "mxfp8-sm90"])
def test_fp8_linear_without_its_kernel_warns_once_and_runs_tf32(gpu, r, cap, needs):
    gpu(cap)
    with FakeTensorMode(), warnings.catch_warnings(record=True) as caught, KernelLog() as log:
        warnings.simplefilter("always")
        for _ in range(2):
            _run_linear(_cuda(256, 256, dtype=torch.bfloat16), _cuda(384, 256), r)
    emulated = [w for w in caught if "emulated" in str(w.message)]
    assert len(emulated) == 1 and issubclass(emulated[0].category, RuntimeWarning)
    # the reason: this GPU's generation and the one the recipe's scaled GEMM needs (gemm.warn_emulated)
    msg = str(emulated[0].message)
    assert f"on this sm{cap[0]}{cap[1]} GPU: torch's scaled GEMM for these scales needs {needs};" in msg, msg
    assert log.count("scaled_mm") == 0 and log.count("mm") == 6
    assert set(log.mm_precisions) == {"tf32"} and torch.backends.cuda.matmul.fp32_precision == "none"


# ---- routed experts ----------------------------------------------------------------------------------------------

def _expert_gemms(preset: str) -> tuple[int, int, list[tuple[int, int]]]:
    """(local experts E, rows S, [(K, N) of w13 and w2])."""
    cfg = get_preset(preset)
    S = TOKENS[preset] * cfg.top_k * LOCAL_EXPERTS[preset] // cfg.n_routed_experts
    return LOCAL_EXPERTS[preset], S, [(cfg.dim, 2 * cfg.expert_ffn_dim), (cfg.expert_ffn_dim, cfg.dim)]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32-master", "bf16-fsdp-param"])
def test_fp8_experts_run_scaled_grouped_mm_and_save_fp8(gpu, preset, w_dtype):
    # bf16 weights are what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) hands the experts (see the FSDP2 skip)
    gpu(HOPPER)
    E, S, gemms = _expert_gemms(preset)
    with FakeTensorMode():
        lay = aligned_layout(_cuda(E, dtype=torch.int64), S, BLOCKWISE.group_align)
        for K, N in gemms:
            x, w = _cuda(lay.n_rows, K, dtype=torch.bfloat16), _cuda(E, N, K, dtype=w_dtype)
            ctx = Ctx(5)
            with KernelLog() as log:
                y = RowwiseFp8GroupedMM.forward(ctx, x, w, lay.offs_E, BLOCKWISE, torch.bfloat16)
                dx, dw, *_ = RowwiseFp8GroupedMM.backward(ctx, _cuda(lay.n_rows, N, dtype=torch.bfloat16))
            assert log.calls == ["scaled_grouped_mm"] * 3, log.calls  # fprop and dgrad 2d-3d, wgrad 2d-2d
            assert (y.shape, y.dtype, dx.shape, dx.dtype) == ((lay.n_rows, N), torch.bfloat16, (lay.n_rows, K),
                                                              torch.bfloat16)
            assert (dw.shape, dw.dtype) == ((E, N, K), w_dtype)
            xg, sxg, w_saved = ctx.saved_tensors[:3]
            # x for the wgrad as FP8 data (K, P) row-major plus (E, K) scales; W is the parameter, not a copy
            assert xg.dtype == FP8_DTYPE and xg.shape == (lay.n_rows, K) and xg.stride() == (1, lay.n_rows)
            assert sxg.shape == (E, K) and w_saved is w
            assert all(t.dtype != torch.float32 or t.numel() <= E * max(N, K) for t in ctx.saved_tensors
                       if t is not w)


def test_fp8_experts_with_dims_not_multiples_of_16_run_emulated_with_one_warning(gpu):
    # torch's FP8 grouped GEMM reads FP8 rows of 16-byte multiples: a model dim of 100 made it raise ("Expected
    # mat_a stride along 0 dim to be multiple of 16 bytes") on fake CUDA before this fell back; the fallback's bf16
    # _grouped_mm needs 16-byte bf16 rows, so K and N reach it zero-padded to multiples of 8
    gpu(HOPPER)
    E, K, N = 4, 100, 200
    with FakeTensorMode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lay = aligned_layout(_cuda(E, dtype=torch.int64), 256, BLOCKWISE.group_align)
        for _ in range(2):
            ctx = Ctx(5)
            with KernelLog() as log:
                y = RowwiseFp8GroupedMM.forward(ctx, _cuda(lay.n_rows, K, dtype=torch.bfloat16), _cuda(E, N, K),
                                                lay.offs_E, BLOCKWISE, torch.bfloat16)
                dx, dw, *_ = RowwiseFp8GroupedMM.backward(ctx, _cuda(lay.n_rows, N, dtype=torch.bfloat16))
            assert log.calls == ["grouped_mm"] * 3, log.calls
            assert (y.shape, dx.shape, dw.shape) == ((lay.n_rows, N), (lay.n_rows, K), (E, N, K))
    warned = [w for w in caught if "emulated" in str(w.message)]
    assert len(warned) == 1 and "multiples of 16" in str(warned[0].message)


@pytest.mark.parametrize("preset", PRESETS)
def test_grouped_experts_module_calls_the_fp8_and_bf16_grouped_kernels(gpu, preset):
    # the call site in model/moe.py, both ways: FP8 recipe set (two scaled grouped GEMMs) and bf16 (_grouped_mm)
    gpu(HOPPER)
    E, S, _ = _expert_gemms(preset)
    cfg = get_preset(preset)
    with FakeTensorMode(), torch.device("cuda"):
        experts = GroupedExperts(E, cfg.dim, cfg.expert_ffn_dim).requires_grad_(False)
        x, tpe = _cuda(S, cfg.dim, dtype=torch.bfloat16), _cuda(E, dtype=torch.int64)
        with KernelLog() as log:
            y = experts(x, tpe)
        assert log.calls == ["grouped_mm"] * 2 and (y.shape, y.dtype) == ((S, cfg.dim), torch.bfloat16)
        experts.fp8_recipe = BLOCKWISE
        with KernelLog() as log:
            y = experts(x, tpe)
        assert log.calls == ["scaled_grouped_mm"] * 2 and (y.shape, y.dtype) == ((S, cfg.dim), torch.bfloat16)


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_grouped_mm_forward_and_backward_at_preset_shapes(gpu, preset):
    # Uneven and empty groups are values of offs, which fake tensors do not have: torch's meta check reads only
    # shapes, so here only the operands are checked; the H200 ran uneven and empty groups (GPU_FACTS: works, an
    # empty group's weight gradient exactly 0) and tests/model/test_moe_ops.py checks the values on CPU.
    gpu(HOPPER)
    E, S, gemms = _expert_gemms(preset)
    with FakeTensorMode():
        offs = _cuda(E, dtype=torch.int32)
        for K, N in gemms:
            x, w = _cuda(S, K, dtype=torch.bfloat16), _cuda(E, N, K, dtype=torch.bfloat16)
            assert _grouped_mm_supported(x, K, N)
            ctx = Ctx(4)
            with KernelLog() as log:
                y = _GroupedMM.forward(ctx, x, w, offs, True)
                # an expanded (stride-0) gradient, as sum() gives: the backward makes it contiguous itself
                dx, dw, *_ = _GroupedMM.backward(ctx, _cuda(1, N, dtype=torch.bfloat16).expand(S, N))
            assert log.calls == ["grouped_mm"] * 3
            assert (y.shape, dx.shape, dw.shape, dw.dtype) == ((S, N), (S, K), (E, N, K), torch.bfloat16)
        # rows of 100 bf16 (200 bytes) are not 16-byte multiples: the kernel's "strides should be multiple of 16
        # bytes" (H200), so our check sends such shapes to the per-expert loop
        assert not _grouped_mm_supported(_cuda(64, 100, dtype=torch.bfloat16), 100, 48)


def test_mxfp8_experts_run_the_reference_with_one_warning(gpu):
    gpu(BLACKWELL)
    E, S, gemms = _expert_gemms("tiny")
    (K, N), _ = gemms
    with FakeTensorMode(), warnings.catch_warnings(record=True) as caught, KernelLog() as log:
        warnings.simplefilter("always")
        lay = aligned_layout(_cuda(E, dtype=torch.int64), S, MXFP8.group_align)
        for _ in range(2):
            from moetrain.precision.grouped import fp8_grouped_mm
            fp8_grouped_mm(_cuda(lay.n_rows, K, dtype=torch.bfloat16), _cuda(E, N, K), lay.offs_E, MXFP8)
    assert log.calls == ["grouped_mm"] * 2
    assert len([w for w in caught if "emulated" in str(w.message)]) == 1


# ---- attention, autocast, FSDP2 ------------------------------------------------------------------------------------

class SdpaArgs(TorchFunctionMode):
    """Records the operands of every ``F.scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls.append((args, dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


class CudaAutocast:
    """bf16 autocast on "cuda": ``torch.autocast("cuda")`` disables itself without a CUDA device, so this sets
    the same state (the autocast dispatch key's switch and dtype) directly."""

    def __enter__(self) -> None:
        self.prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)

    def __exit__(self, *exc: Any) -> None:
        torch.set_autocast_enabled("cuda", self.prev[0])
        torch.set_autocast_dtype("cuda", self.prev[1])


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="MLA and RoPE index tensors (t[...]); on a CPU-only torch build Python indexing of a fake "
                           "CUDA tensor needs a CUDA device guard it does not have ('PyTorch is not linked with "
                           "support for cuda devices'); runs with a CUDA build of torch (no GPU needed)")
@pytest.mark.parametrize("preset", PRESETS)
def test_mla_under_bf16_autocast_feeds_sdpa_and_fp8_projections(gpu, preset):
    from moetrain.model.deepseek.attention import MLA
    from moetrain.model.layers import rope_cos_sin

    gpu(HOPPER)
    cfg = get_preset(preset)
    B, L = 1, min(TOKENS[preset], cfg.max_seq_len)
    with FakeTensorMode(), torch.device("cuda"):
        mla = MLA(cfg).requires_grad_(False)
        n_proj = len(apply_fp8(mla, "blockwise"))
        cos, sin = rope_cos_sin(cfg, L, torch.device("cuda"))
        with CudaAutocast(), SdpaArgs() as sdpa, KernelLog() as log:
            out = mla(_cuda(B, L, cfg.dim), cos, sin)
        assert (out.shape, out.dtype) == ((B, L, cfg.dim), torch.bfloat16)
        assert log.count("scaled_mm") == n_proj  # every projection in FP8, none fell back
        (q, k, v), kw = sdpa.calls[0][0][:3], sdpa.calls[0][1]
        # what torch's flash kernel needs (sdp_utils: one head dim for q, k, v, a multiple of 8, at most 256;
        # fp16/bf16; unit stride in the head dim), which its backend choice cannot check here
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and kw["is_causal"]
        o, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=kw["scale"])
        grads = aten._scaled_dot_product_flash_attention_backward(torch.empty_like(o), q, k, v, o, lse, *rest[:4],
                                                                   0.0, True, *rest[4:6], scale=kw["scale"])
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.skip(reason="FSDP2 mixed precision cannot be faked: fully_shard reads torch.cuda.current_device() and "
                         "makes CUDA streams and events (the CUDA runtime, not tensors); its effect on our code, bf16 "
                         "weights (MixedPrecisionPolicy(param_dtype=bf16)) reaching the FP8 GEMMs, is tested above "
                         "(bf16-fsdp-param) and in test_fp8_linear_with_bf16_weights")
def test_fsdp2_mixed_precision_on_fake_cuda():
    raise AssertionError("skipped")


def test_fp8_linear_with_bf16_weights(gpu):
    gpu(HOPPER)
    with FakeTensorMode(), KernelLog() as log:
        y, dx, dw = _run_linear(_cuda(1024, 7168, dtype=torch.bfloat16), _cuda(2048, 7168, dtype=torch.bfloat16),
                                BLOCKWISE)
    assert log.calls == ["scaled_mm"] * 3 and dw.dtype == torch.bfloat16 and y.dtype == torch.bfloat16


# ---- FP8 primary weights (parallel.fp8_param) --------------------------------------------------------------------

def _held(w: torch.Tensor, tile: tuple[int, int], r: Fp8Recipe) -> Fp8HeldWeight:
    """What FSDP2 hands the GEMMs under fp8_param: the gathered FP8 data and the full weight's scales."""
    q = quantise(w, tile, r.fmt)
    return Fp8HeldWeight(q, torch.bfloat16)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3-671b"])
def test_held_fp8_weights_reach_the_kernels_without_a_weight_quantisation(gpu, preset, monkeypatch):
    """The blockwise linear's three GEMMs and the row-wise experts' three grouped GEMMs take a held weight's FP8
    data and scales as torch's checks demand: the linear quantises only x and dy (never W, whose 128x128 blocks
    serve fprop and dgrad); the experts quantise W once, for the dgrad's per-column scales."""
    gpu(HOPPER)
    calls: list[tuple[int, ...]] = []
    real = fused.quantise
    monkeypatch.setattr(fused, "quantise", lambda x, tile, fmt="fp32": calls.append(tuple(x.shape)) or
                        real(x, tile, fmt))
    M = TOKENS[preset]
    E, S, gemms = _expert_gemms(preset)
    with FakeTensorMode():
        for K, N in _linear_shapes(preset)[:3]:
            calls.clear()
            with KernelLog() as log:
                y, dx, dw = _run_linear(_cuda(M, K, dtype=torch.bfloat16),
                                        _held(_cuda(N, K), BLOCKWISE.weight_fprop_tile, BLOCKWISE), BLOCKWISE)
            assert log.calls == ["scaled_mm"] * 3 and (N, K) not in calls, (K, N, log.calls, calls)
            assert (y.shape, dx.shape, dw.shape, dw.dtype) == ((M, N), (M, K), (N, K), torch.bfloat16)
        lay = aligned_layout(_cuda(E, dtype=torch.int64), S, BLOCKWISE.group_align)
        for K, N in gemms:
            calls.clear()
            w = _held(_cuda(E, N, K), BLOCKWISE.expert_row_tile, BLOCKWISE)
            ctx = Ctx(5)
            with KernelLog() as log:
                RowwiseFp8GroupedMM.forward(ctx, _cuda(lay.n_rows, K, dtype=torch.bfloat16), w, lay.offs_E,
                                            BLOCKWISE, torch.bfloat16)
                RowwiseFp8GroupedMM.backward(ctx, _cuda(lay.n_rows, N, dtype=torch.bfloat16))
            assert log.calls == ["scaled_grouped_mm"] * 3, log.calls
            assert [c for c in calls if len(c) == 3] == [(E, K, N)], calls  # W^T for the dgrad only
