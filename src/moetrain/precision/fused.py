"""Quantisers for the FP8 kernels' operands: quant.py's definitions, compiled by ``torch.compile`` on CUDA.

Eager, one quantisation is about ten full passes over its operand (float copy, tile maxima, scale, divide, clamp,
cast, copy out); on a GPU that costs more than the FP8 GEMM saves. Compiled, inductor fuses it into a reduction
and one pointwise pass (BENCHMARKS.md, "GPU (NVIDIA H200)"). The compiled
functions are quant.py's own (:func:`~moetrain.precision.quant.quantise_tiles`,
:func:`~moetrain.precision.quant.quantise_groups`), compiled with eager's division rounding and subnormals
(:data:`INDUCTOR_OPTIONS`), so they compute the same codes and scales as a CPU run, which stays eager.

What is compiled, and what stays a constant: each call site (role) and each value of its non-tensor arguments (tile,
scale format, group count, chunk, layout) gets its own compiled function, with those values as constants of the
traced code, and its own code object (so its own dynamo cache and recompile limit). Only the row count of an
operand is a symbolic size (``torch._dynamo.maybe_mark_dynamic``: tokens per micro-batch and rows per expert vary);
its other dims are static: with the tile an argument of one dynamic-shape function, every tile size would be
symbolic, and inductor's reductions of a symbolic size are far slower than of a constant one (BENCHMARKS.md, "GPU
(NVIDIA H200)"; ``benchmarks/fused_quantisers.py`` compares them). Where compiling is off (CPU, fake tensors on a CPU-only build,
``MOETRAIN_FP8_COMPILE=0``) or fails (warned once), the eager functions run.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from moetrain.precision import quant
from moetrain.precision.quant import Quantized, ScaleFormat, check_tile, quantise_groups, quantise_tiles

#: Compile the quantisers on CUDA (set MOETRAIN_FP8_COMPILE=0 to run them eagerly, e.g. to compare).
_COMPILE = os.environ.get("MOETRAIN_FP8_COMPILE", "1") != "0"
#: torch.compile backend (tests/precision/test_fused.py uses "eager" to check tracing and recompiles on a CPU).
BACKEND = "inductor"
#: Inductor options of the compiled quantisers: eager's numerics. Triton lowers an fp32 ``x / s`` to the
#: approximate ``div.full.f32`` (up to 2 ulp) and flushes subnormals unless told otherwise; either moves some x / s
#: across an E4M3 rounding midpoint. Those midpoints are common here (0.6% of the quotients of bf16 randn data are
#: exactly one, measured), so an approximate quotient changes 1e-4 to 1e-3 of the codes, and at small
#: contraction sizes one changed code is several 1e-3 of max |dW| (``benchmarks/fp8_division_rounding.py``).
#: With IEEE division and no flushing the compiled code computes quant.py's definitions bit for bit, at the cost of
#: a few more instructions per element in kernels bound by memory.
INDUCTOR_OPTIONS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}
_failed: list[str] = []


def compiles(device: torch.device) -> bool:
    """Whether the quantisers of tensors on ``device`` run compiled: a CUDA device that exists (not a fake one on a
    CPU-only build), compiling not switched off and not failed before."""
    return device.type == "cuda" and _COMPILE and not _failed and torch.cuda.is_available()


@functools.cache
def _compiled(fn: Callable[..., Any], consts: tuple, layout: tuple, backend: str) -> Callable[..., Any]:
    """``torch.compile`` (static shapes but for the dims marked dynamic) of ``tensors -> fn(*tensors, *consts)``:
    ``consts`` are constants of the traced code, and the function is a fresh code object (dynamo keeps its graphs
    and its recompile limit per code object), one per (fn, consts, layout). ``layout`` (the tensors' dtypes, static
    dims and strides' order) only keys the cache: each call site keeps one graph instead of recompiling, past
    dynamo's limit, for every layer shape that shares its constants."""
    def call(*tensors: torch.Tensor) -> Any:
        return fn(*tensors, *consts)

    own = types.FunctionType(call.__code__.replace(), call.__globals__, f"{fn.__name__}_fp8", None, call.__closure__)
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(own, dynamic=False, backend=backend, options=options)


def _run(fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], consts: tuple, rows_dynamic: bool) -> Any:
    """``fn(*tensors, *consts)`` through its compiled copy; ``rows_dynamic`` marks dim 0 of every tensor (the rows
    of a 2-D operand, and of its per-row companions) as a size that varies between calls."""
    if rows_dynamic:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    layout = tuple((t.dtype, tuple(t.shape[1:]), t.dim(), t.is_contiguous()) for t in tensors)
    try:
        return _compiled(fn, consts, layout, BACKEND)(*tensors)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler or toolchain failure must not stop training: warn once, run eagerly
        _failed.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"torch.compile of the FP8 quantisers failed ({_failed[0][:300]}); they run eagerly from "
                      "now on (correct, slower)", RuntimeWarning, stacklevel=3)
        return fn(*tensors, *consts)


def quantise(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat = "fp32") -> Quantized:
    """:func:`~moetrain.precision.quant.quantise` (same values, shapes and scales), compiled on CUDA.

    x (..., M, N) -> :class:`Quantized` with data (..., M, N) and scales (..., Mt, Nt). On the compiled path an
    operand whose dims are not multiples of the tile is zero-padded first (zeros are what the edge tile's
    definition adds) and the data returned is the (..., M, N) view of the padded result. Raises ValueError as
    :func:`~moetrain.precision.quant.quantise` does.
    """
    if not compiles(x.device):
        return quant.quantise(x, tile, fmt)
    check_tile(x, tile, "quantise")
    M, N = x.shape[-2:]
    tr, tc = min(tile[0], max(M, 1)), min(tile[1], max(N, 1))
    pr, pc = (-M) % tr, (-N) % tc
    xp = F.pad(x, (0, pc, 0, pr)) if pr or pc else x
    # 2-D operands are activations, gradients or a linear's weight: their row count varies between call sites and
    # steps; a stacked expert weight (3-D) has one shape
    data, scale = _run(quantise_tiles, (xp,), ((tr, tc), fmt), rows_dynamic=x.dim() == 2)
    if pr or pc:
        data = data.narrow(-2, 0, M).narrow(-1, 0, N)
    return Quantized(data, scale, tuple(tile), fmt)


def quantise_by_group(x_PK: torch.Tensor, group_P: torch.Tensor, n_groups: int, fmt: ScaleFormat = "fp32",
                      rows_per_chunk: int = 1, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~moetrain.precision.quant.quantise_groups` (same arguments and results), compiled on CUDA."""
    if not compiles(x_PK.device):
        return quantise_groups(x_PK, group_P, n_groups, fmt, rows_per_chunk, column_major)
    return _run(quantise_groups, (x_PK, group_P), (n_groups, fmt, rows_per_chunk, column_major), rows_dynamic=True)


def _requant_t(data: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat,
               new_tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantise_tiles(Quantized(data, scale, tile, fmt).dequantise().transpose(-2, -1), new_tile, fmt)


def requantise_t(q: Quantized, tile: tuple[int, int]) -> Quantized:
    """The values of ``q`` (..., M, N) transposed and quantised again in ``tile``: ``quantise(q.dequantise()^T,
    tile)``, (..., N, M) row-major data. DeepSeek-V3's wgrad operand from the fprop's cached FP8 input (sec. 3.5.2:
    dequantise, transpose, re-quantise), in one compiled function on CUDA where the operand is whole tiles."""
    M, N = q.data.shape[-2:]
    whole = not (N % min(tile[0], max(N, 1)) or M % min(tile[1], max(M, 1)))  # the tiles cover (N, M)
    if not compiles(q.data.device) or not whole:
        return quantise(q.dequantise().transpose(-2, -1), tile, q.fmt)
    data, scale = _run(_requant_t, (q.data, q.scale), (q.tile, q.fmt, tile), rows_dynamic=q.data.dim() == 2)
    return Quantized(data, scale, tuple(tile), q.fmt)
