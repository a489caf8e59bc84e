"""FP8 GEMM: y = A B^T from two quantised operands, both tiled along the contraction dim K.

:func:`fp8_mm_reference` defines the numerics: dequantise both operands and multiply in fp32. :func:`scaled_mm_fast`
is the hardware path where one exists for the operands' tiling, else None:

* CUDA, blockwise (A 1x128, B 128x128 or 1x128, fp32 scales): ``torch.nn.functional.scaled_mm`` with
  ``BlockWise1x128`` / ``BlockWise128x128`` scaling (cuBLAS >= 12.9 on Hopper; docs/reference.md section 11).
* CUDA, MXFP8 (both 1x32, E8M0 scales): ``scaled_mm`` with ``BlockWise1x32`` scales in the swizzled 32x4x4 layout
  (Blackwell, SM100+).
* CPU, both operands with one tile per row (K <= the tile length): row-wise ``scaled_mm``, the only scaling
  torch's CPU kernel accepts (docs/reference.md section 11).

Every fast path must equal the reference within ``FAST_PATH_RTOL`` of the output's magnitude (tests/precision).
Shape legend: A (M, K), B (N, K), y (M, N).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from moetrain.precision.quant import Quantized, ScaleFormat, fake_quantise, quantise

#: Tolerance of a fast path against the reference, relative to max |y|: both multiply the same FP8 values exactly
#: and accumulate in fp32, so only the order of the additions differs (fp32 rounding, ~K * 2**-24).
FAST_PATH_RTOL = 1e-5

#: Use the CPU row-wise ``scaled_mm`` in training where it applies (off by default: the reference is as fast at the
#: presets' sizes on the CPUs tried, and it is the definition). Set MOETRAIN_FP8_CPU_SCALED_MM=1 to switch it on.
_CPU_FAST = os.environ.get("MOETRAIN_FP8_CPU_SCALED_MM", "0") == "1"


def fp8_mm_reference(a: Quantized, b: Quantized) -> torch.Tensor:
    """deq(A) @ deq(B)^T in fp32: A (M, K), B (N, K) -> (M, N) fp32."""
    return a.dequantise() @ b.dequantise().transpose(-2, -1)


def _one_tile_per_row(q: Quantized) -> bool:
    return q.tile[1] >= q.data.shape[-1]


def _rowwise_scales(q: Quantized) -> torch.Tensor:
    """Per-row scales (rows, 1) of an operand with one tile per row (tile rows may span several rows)."""
    rows = q.data.shape[-2]
    return q.scale.repeat_interleave(q.tile[0], dim=-2)[:rows, :1].contiguous()


def _to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (rows, cols) in the 32x4x4 swizzled layout cuBLAS expects for MX GEMMs (rows padded to 128,
    cols to 4; NVIDIA cuBLAS docs, "1D block scaling factors layout"), flattened."""
    rows, cols = scale.shape
    nr, nc = math.ceil(rows / 128), math.ceil(cols / 4)
    padded = F.pad(scale, (0, nc * 4 - cols, 0, nr * 128 - rows))
    blocks = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def scaled_mm_fast(a: Quantized, b: Quantized) -> torch.Tensor | None:
    """A @ B^T (fp32, (M, N)) by a hardware scaled GEMM, or None when none applies to these operands and device.

    A and B are 2-D; their tiles must lie along K. Returns None rather than raising for any unsupported case.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or not hasattr(F, "scaled_mm"):
        return None
    S = F.ScalingType
    (M, K), N = a.data.shape, b.data.shape[0]
    dev = a.data.device
    a_data = a.data.contiguous()
    b_t = b.data.contiguous().t()  # (K, N) column-major, as scaled_mm wants its second operand
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if (a.fmt == b.fmt == "fp32" and a.tile == (1, 128) and b.tile in ((128, 128), (1, 128)) and cap[0] == 9
                and M % 128 == 0 and N % 128 == 0 and K % 128 == 0):
            sa = a.scale.t().contiguous().t()  # 1x128 scales must be outer-dim-major
            sb = b.scale.t() if b.tile == (128, 128) else b.scale.t().contiguous().t()
            rb = S.BlockWise128x128 if b.tile == (128, 128) else S.BlockWise1x128
            return F.scaled_mm(a_data, b_t, sa, S.BlockWise1x128, sb, rb, output_dtype=torch.float32)
        if (a.fmt == b.fmt == "e8m0" and a.tile == b.tile == (1, 32) and cap[0] >= 10
                and M % 128 == 0 and N % 128 == 0 and K % 128 == 0):
            e8 = torch.float8_e8m0fnu
            sa, sb = _to_blocked(a.scale.to(e8)), _to_blocked(b.scale.to(e8))
            sw = F.SwizzleType.SWIZZLE_32_4_4
            return F.scaled_mm(a_data, b_t, sa, S.BlockWise1x32, sb, S.BlockWise1x32, swizzle_a=sw, swizzle_b=sw,
                               output_dtype=torch.float32)
    if dev.type == "cpu" and _one_tile_per_row(a) and _one_tile_per_row(b):
        return F.scaled_mm(a_data, b_t, _rowwise_scales(a), S.RowWise, _rowwise_scales(b).t(), S.RowWise,
                           output_dtype=torch.float32)
    return None


def fp8_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """A @ B^T in fp32 for training: the hardware path on CUDA where it applies (and on CPU when switched on),
    else the reference. A (M, K), B (N, K) -> (M, N)."""
    if uses_fp8_kernel(a.data.device):
        y = scaled_mm_fast(a, b)
        if y is not None:
            return y
    return fp8_mm_reference(a, b)


def uses_fp8_kernel(device: torch.device) -> bool:
    """Whether training GEMMs on ``device`` try a hardware scaled GEMM (CUDA; CPU only when switched on), and so
    need FP8 data and scales; otherwise the reference multiplies the dequantised values, which
    :func:`~moetrain.precision.quant.fake_quantise` gives without making the FP8 tensor."""
    return device.type == "cuda" or _CPU_FAST


#: A GEMM operand: FP8 data and scales (:class:`Quantized`) for a kernel, or its dequantised fp32 values.
Operand = Quantized | torch.Tensor


def operand(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat, kernel: bool) -> Operand:
    """``x`` (..., M, K) quantised in ``tile``: :func:`quantise` for a kernel (``kernel``), else
    :func:`fake_quantise`'s fp32 values (bit-equal to the dequantised :class:`Quantized`)."""
    return quantise(x, tile, fmt) if kernel else fake_quantise(x, tile, fmt)


def operand_t(q: Operand) -> Operand:
    """The same quantised values transposed over the last two dims (tiles and scales with them); no
    requantisation."""
    if isinstance(q, Quantized):
        return Quantized(q.data.transpose(-2, -1), q.scale.transpose(-2, -1), (q.tile[1], q.tile[0]), q.fmt)
    return q.transpose(-2, -1)


def operand_mm(a: Operand, b: Operand) -> torch.Tensor:
    """A @ B^T in fp32 of two operands from :func:`operand`: A (M, K), B (N, K) -> (M, N). :func:`fp8_mm` for
    quantised ones, the fp32 product of the values otherwise (the reference's own GEMM)."""
    if isinstance(a, Quantized) and isinstance(b, Quantized):
        return fp8_mm(a, b)
    if isinstance(a, Quantized) or isinstance(b, Quantized):
        raise TypeError("operand_mm needs both operands quantised or both as values")
    return a @ b.transpose(-2, -1)
