"""What "bf16" means on a CPU: bf16 GEMMs run as fp32 GEMMs of the same bf16 values, rounded to bf16 once.

A bf16 GEMM on a GPU (tensor cores, cuBLAS) multiplies bf16 operands, accumulates in fp32 and rounds the result to
bf16. The product of two bf16 values is exact in fp32 (8 + 8 significant bits fit in fp32's 24), so an fp32 GEMM of
the bf16 operands, rounded to bf16 at the end, computes the same thing up to the order of the fp32 additions.
torch's own CPU bf16 GEMM also accumulates in fp32, but on a CPU without bf16 instructions (no AVX512-BF16 or
AMX; this project's machines are AVX2) it is a fallback 10-100x slower than fp32 at the tiny preset's shapes
(BENCHMARKS.md, "FP8"), which made a CPU bf16-autocast run of the tiny preset 9x slower per step than fp32.

:class:`EmulatedBf16Gemms` swaps the kernel and nothing else. It is a ``TorchDispatchMode``: it sits below autocast
and autograd, so autocast still casts the same operands to bf16, every GEMM still returns bf16, autograd still
saves the bf16 tensors and runs the same backward GEMMs (which the mode sees too: the backward runs on the thread
that entered it), and every other op (softmax, norms, casts) runs as torch runs it. Only the ops in
:data:`EMULATED_GEMMS` whose floating-point operands are all bf16 dense CPU tensors are rerouted; anything else
(fp32 GEMMs, such as the FP8 reference GEMMs, which run with autocast off; tensor subclasses; other devices) passes
through untouched.

The attention core's fused kernel (:data:`EMULATED_ATTENTION`, SDPA's CPU flash attention, forward and backward)
is rerouted the same way: with bf16 q, k, v it runs torch's fp32 kernel on the same bf16 values and returns bf16
outputs and gradients (the logsumexp stays fp32, as torch's bf16 kernel returns it). A GPU flash-attention kernel
takes bf16 inputs, accumulates QK^T and PV in fp32 and writes bf16; it also rounds the probabilities P to bf16 before
the PV GEMM, which the fp32 kernel does not: the emulation differs from it by that one rounding of P (2**-9
relative), as torch's CPU bf16 kernel differs from it in its own block order.

Agreement with torch's bf16 GEMM: both are fp32 sums of the same exact products, in different orders, each
rounded to bf16 once, so elementwise |emulated - torch| <= :data:`EMULATION_RTOL` * max(|emulated|, |torch|) +
2 K 2**-24 (|A| @ |B|) for a contraction of length K (tests/precision/test_cpu_bf16.py checks this bound).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import torch
# torch has no public way to lift one dispatch mode for a region; these are the helpers its own modes use
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

aten = torch.ops.aten
_F = TypeVar("_F", bound=Callable[..., Any])

#: The GEMM kernels rerouted: what ``F.linear`` / ``matmul`` / ``@`` lower to on CPU, forward and backward, and
#: the routed experts' ``_grouped_mm`` / ``bmm``.
EMULATED_GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                            aten.addbmm.default, aten._grouped_mm.default})

#: The attention core's fused CPU kernels (two GEMMs around a softmax), forward and backward: on AVX2 torch's bf16
#: flash-attention backward was about a third of a BF16 tiny-preset step, 2-3x its fp32 time (BENCHMARKS.md, "FP8").
#: Per kernel: (position of the query among its arguments, how many leading outputs are bf16). Forward returns
#: (output, logsumexp), the logsumexp in fp32 as torch's bf16 kernel returns it; backward returns the three
#: gradients in the inputs' bf16.
EMULATED_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1),
                      aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 3)}

#: Two bf16 roundings of sums of the same products: at most one bf16 unit in the last place (2**-7 relative to
#: the larger result) apart, plus the fp32 accumulation-order term stated in the module docstring.
EMULATION_RTOL = 2.0 ** -7


def _is_cpu_bf16(t: Any) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def _up(a: Any) -> Any:
    return a.float() if _is_cpu_bf16(a) else a


class EmulatedBf16Gemms(TorchDispatchMode):
    """While active, CPU bf16 GEMMs (:data:`EMULATED_GEMMS`) compute in fp32 on the bf16 values and return bf16.

    Shapes, dtypes and autograd are those of the op it replaces: e.g. ``mm`` of bf16 (M, K) and (K, N) gives
    bf16 (M, N); ``_grouped_mm``'s ``out_dtype`` is honoured (bf16 when unset). Results agree with torch's bf16
    kernel within the bound in the module docstring.
    Thread-local, like every dispatch mode: enter it on the thread that runs forward and ``backward()``.

    Args:
        attention: also reroute the attention core (:data:`EMULATED_ATTENTION`); False leaves it to torch's bf16
            kernel (tests compare the GEMM emulation alone against torch's kernels with it).
    """

    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.attention = attention

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in EMULATED_GEMMS:
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if floats and all(_is_cpu_bf16(a) for a in floats):
                out_dtype = torch.bfloat16
                if func is aten._grouped_mm.default:
                    # schema: (self, mat2, offs=None, bias=None, out_dtype=None)
                    if len(args) > 4:
                        args, kwargs = args[:4], {**kwargs, "out_dtype": args[4]}
                    out_dtype = kwargs.pop("out_dtype", None) or torch.bfloat16
                y = func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
                return y.to(out_dtype)
        if self.attention and func in EMULATED_ATTENTION:
            q_arg, n_bf16 = EMULATED_ATTENTION[func]
            if _is_cpu_bf16(args[q_arg]):
                outs = func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
                return tuple(o.to(torch.bfloat16) if i < n_bf16 else o for i, o in enumerate(outs))
        return func(*args, **kwargs)


def cpu_bf16_gemms(device: torch.device | str, amp_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The context a training or evaluation loop on ``device`` under ``amp_dtype`` autocast runs in:
    :class:`EmulatedBf16Gemms` for bf16 on CPU, else a no-op context (GPUs have native bf16 GEMMs)."""
    if torch.device(device).type == "cpu" and amp_dtype == torch.bfloat16:
        return EmulatedBf16Gemms()
    return contextlib.nullcontext()


def suspended() -> contextlib.AbstractContextManager:
    """Lift the active :class:`EmulatedBf16Gemms` for a region that runs no bf16 GEMM (the FP8 reference: fp32
    GEMMs with autocast off), so that its many small quantisation ops do not each pass through Python (about 20 us
    an op under a dispatch mode; 15-30% of an emulated FP8 training step of the tiny preset). Results are the
    same with or without it. A no-op unless the innermost dispatch mode is an :class:`EmulatedBf16Gemms` (another
    mode entered inside it, e.g. a FLOP counter, keeps seeing every op)."""
    if isinstance(_get_current_dispatch_mode(), EmulatedBf16Gemms):
        return _pop_mode_temporarily()
    return contextlib.nullcontext()


def runs_no_bf16_gemm(fn: _F) -> _F:
    """Decorator: ``fn`` runs under :func:`suspended` (for FP8 autograd functions' forward and backward)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with suspended():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
