"""FP8 GEMM: y = A B^T from two quantised operands, both tiled along the contraction dim K.

:func:`fp8_mm_reference` defines the numerics: dequantise both operands and multiply in fp32. :func:`scaled_mm_fast`
is the hardware path where one exists for the operands' tiling, else None:

* CUDA Hopper (sm90), blockwise (A 1x128; B 128x128 or 1x128; fp32 scales): ``torch.nn.functional.scaled_mm`` with
  ``BlockWise1x128`` / ``BlockWise128x128`` scaling (cuBLAS >= 12.9; docs/reference.md section 11), the scales laid
  out as torch's checks (``_check_scaled_mm_sizes_v2`` in torch/_meta_registrations.py, torch 2.11 and 2.13) demand:
  A's 1x128 scales (M, K/128) with strides (1, M); B's 128x128 scales (L4, N/128) with strides (1, L4), L4 =
  round_up(K/128, 4), the rows past K/128 ignored; B's 1x128 scales (N, K/128) with strides (1, N).
* CUDA Blackwell (sm100+), MXFP8 (both 1x32, E8M0 scales): ``scaled_mm`` with ``BlockWise1x32`` scales in the
  swizzled 32x4x4 layout.
* CPU, both operands with one tile per row (K <= the tile length): row-wise ``scaled_mm``, the only scaling
  torch's CPU kernel accepts (docs/reference.md section 11; torch 2.13 has the kernel, 2.11 none).

Shapes: torch's checks ask for K and N multiples of 16 and read the block scales as (.., K // 128) and (N // 128,
..) (floor), so a partial block of 128 would be misread. The data is therefore zero-padded to K and (for 128x128
B) N multiples of 128 (32 for MX), N to 16 otherwise, and the output sliced back: zeros are exactly what the edge
tiles' definition adds (quant.py), and they contribute nothing to the sums. No check reads M (the GPU
check, benchmarks/fp8_gpu_verify.py, includes an M that is not a multiple of 16).

Where no kernel applies on CUDA (blockwise off Hopper, MXFP8 before Blackwell), :func:`fp8_mm` warns once and
multiplies the dequantised operands with TF32 (:func:`tf32_matmul`).

Shape legend: A (M, K), B (N, K), y (M, N).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from moetrain import devices
from moetrain.precision import fused
from moetrain.precision.quant import FP8_DTYPE, Quantized, ScaleFormat, fake_quantise

#: DeepSeek-V3 report sec. 3.3.2 (docs/reference.md section 13): the FP8 GEMM of Hopper's tensor cores keeps "around
#: 14 bits" of its running sum, and the partial sums are promoted to fp32 every N_C = 128 elements of the contraction
#: (cuBLAS's blockwise kernels promote per 128-block, the scale's granularity).
HOPPER_ACCUMULATOR_BITS = 14
PROMOTION_INTERVAL = 128

#: Tolerance of an FP8 kernel with fp32 output against :func:`fp8_mm_reference` (the exact fp32 product of the same
#: FP8 values), relative to max |y|, for operands of independent zero-mean values (the tests' and gpu_check's).
#: Derivation (docs/fp8.md, "Tolerances"): inside a chunk of N_C products the running sum s_j is rounded to 14
#: significant bits at each addition, an error of at most u |s_j|, u = 2**-13 (one unit of a 14-bit significand,
#: which also covers truncation). With products of variance v, E[s_j**2] = j v; independent errors uniform in
#: +-u |s_j| give var(err) = u**2 v sum_j j / 3 = u**2 v N_C (N_C + 1) / 6 per chunk and u**2 v K (N_C + 1) / 6 over
#: the K / N_C chunks; the fp32 additions of the promoted chunk sums add K / N_C * 2**-24 (negligible). var(y) = K v,
#: so err / y ~ u sqrt((N_C + 1) / 6) = 5.7e-4, and the maxima over the same outputs keep the ratio (the H200's
#: measurements: BENCHMARKS.md, "GPU (NVIDIA H200)"). A bf16 output adds its own rounding, see :func:`fast_path_rtol`.
FAST_PATH_RTOL = 2.0 ** -(HOPPER_ACCUMULATOR_BITS - 1) * math.sqrt((PROMOTION_INTERVAL + 1) / 6)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding to ``dtype`` (round to nearest): 2**-24 for fp32, 2**-8 for bf16."""
    return torch.finfo(dtype).eps / 2


def fast_path_rtol(out_dtype: torch.dtype = torch.float32) -> float:
    """Tolerance of an FP8 kernel writing ``out_dtype`` against the fp32 reference, relative to max |y|:
    :data:`FAST_PATH_RTOL` plus the output's rounding (:func:`unit_roundoff`; 2**-8 for bf16)."""
    return FAST_PATH_RTOL + unit_roundoff(out_dtype)


def fp32_sum_rtol(k: int) -> float:
    """Tolerance of two fp32 sums of the same K exact products in different orders, relative to max |y|: the
    standard bound K * 2**-24 relative to the sum of the products' magnitudes. For zero-mean data that sum is a few
    times max |y| (about 1.6x at K = 128), and the actual error a random walk far below the bound, which the tests'
    data leaves ample room for; it is not a worst-case bound relative to max |y|."""
    return k * 2.0 ** -24


#: Use the CPU row-wise ``scaled_mm`` in training where it applies (off by default: the reference is as fast at the
#: presets' sizes on the CPUs tried, and it is the definition). Set MOETRAIN_FP8_CPU_SCALED_MM=1 to switch it on.
_CPU_FAST = os.environ.get("MOETRAIN_FP8_CPU_SCALED_MM", "0") == "1"


def fp8_mm_reference(a: Quantized, b: Quantized) -> torch.Tensor:
    """deq(A) @ deq(B)^T in fp32: A (M, K), B (N, K) -> (M, N) fp32."""
    return a.dequantise() @ b.dequantise().transpose(-2, -1)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _one_tile_per_row(q: Quantized) -> bool:
    return q.tile[1] >= q.data.shape[-1]


def _rowwise_scales(q: Quantized) -> torch.Tensor:
    """Per-row scales (rows, 1) of an operand with one tile per row (tile rows may span several rows)."""
    rows = q.data.shape[-2]
    return devices.contiguous(q.scale.repeat_interleave(min(q.tile[0], rows), dim=-2)[:rows, :1])


def _to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (rows, cols) in the 32x4x4 swizzled layout cuBLAS expects for MX GEMMs (rows padded to 128,
    cols to 4; NVIDIA cuBLAS docs, "1D block scaling factors layout"), flattened."""
    rows, cols = scale.shape
    nr, nc = math.ceil(rows / 128), math.ceil(cols / 4)
    padded = F.pad(scale, (0, nc * 4 - cols, 0, nr * 128 - rows))
    blocks = padded.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """Scales (R, C) with the same values laid out column by column: strides (1, R)."""
    return devices.contiguous(s.t()).t()


def _padded_fp8(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 ``data`` (R, C) as a row-major (rows, cols) tensor, zero-padded at the end of each dim (padded through
    a uint8 view: byte 0 is E4M3 +0, and zero-filling fp8 itself needs a kernel not every backend has)."""
    R, C = data.shape
    if (R, C) == (rows, cols):
        return devices.contiguous(data)
    return devices.contiguous(F.pad(data.view(torch.uint8), (0, cols - C, 0, rows - R))).view(FP8_DTYPE)


_CPU_ROWWISE: list[bool] = []


def cpu_rowwise_kernel() -> bool:
    """Whether this torch build has a CPU kernel for row-wise ``F.scaled_mm`` (torch 2.13 has; torch 2.11 raises
    NotImplementedError for ``aten::_scaled_mm_v2`` on CPU). Tried once on a 16x16 zero operand (not cached when
    tried under a tensor mode such as FakeTensorMode, where no kernel runs)."""
    if _CPU_ROWWISE:
        return _CPU_ROWWISE[0]
    if not hasattr(F, "scaled_mm"):
        return False
    a = torch.zeros(16, 16).to(FP8_DTYPE)
    if type(a) is not torch.Tensor:
        return False
    S = F.ScalingType
    try:
        F.scaled_mm(a, a.t(), torch.ones(16, 1), S.RowWise, torch.ones(1, 16), S.RowWise, output_dtype=torch.float32)
        _CPU_ROWWISE.append(True)
    except NotImplementedError:
        _CPU_ROWWISE.append(False)
    return _CPU_ROWWISE[0]


def blockwise_kernel(device: torch.device) -> bool:
    """Whether ``device`` has torch's blockwise (1x128 / 128x128) ``scaled_mm``: a Hopper GPU (sm90)."""
    return device.type == "cuda" and hasattr(F, "scaled_mm") and devices.cuda_capability(device)[0] == 9


def mx_kernel(device: torch.device) -> bool:
    """Whether ``device`` has torch's MXFP8 (1x32, E8M0) ``scaled_mm``: a Blackwell GPU (sm100) or newer."""
    return device.type == "cuda" and hasattr(F, "scaled_mm") and devices.cuda_capability(device)[0] >= 10


def scaled_mm_fast(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A @ B^T ((M, N) in ``out_dtype``) by a hardware scaled GEMM, or None when none applies to these operands
    and device. A and B are 2-D, any strides; their tiles must lie along K. Returns None rather than raising for
    any unsupported case (other tilings, formats, devices)."""
    if a.data.dim() != 2 or b.data.dim() != 2 or not hasattr(F, "scaled_mm"):
        return None
    dev = a.data.device
    if (a.fmt == b.fmt == "fp32" and a.tile == (1, 128) and b.tile in ((128, 128), (1, 128))
            and blockwise_kernel(dev)):
        return _blockwise_mm(a, b, out_dtype)
    if a.fmt == b.fmt == "e8m0" and a.tile == b.tile == (1, 32) and mx_kernel(dev):
        return _mx_mm(a, b, out_dtype)
    if dev.type == "cpu" and _one_tile_per_row(a) and _one_tile_per_row(b) and cpu_rowwise_kernel():
        S = F.ScalingType
        y = F.scaled_mm(devices.contiguous(a.data), devices.contiguous(b.data).t(), _rowwise_scales(a), S.RowWise,
                        _rowwise_scales(b).t(), S.RowWise, output_dtype=torch.float32)
        return y.to(out_dtype)
    return None


def _blockwise_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """A 1x128 @ (B 128x128 or 1x128)^T through ``F.scaled_mm`` (layouts in the module docstring)."""
    S = F.ScalingType
    (M, K), N = a.data.shape, b.data.shape[0]
    square = b.tile == (128, 128)
    Kp, Np = _round_up(K, 128), _round_up(N, 128 if square else 16)
    Kb = Kp // 128  # == a.scale.shape[1]: the edge tile's scale covers the padding
    sa = _outer_major(a.scale)
    if square:
        L4 = _round_up(Kb, 4)
        sb = devices.contiguous(F.pad(b.scale, (0, L4 - Kb))).t()  # b.scale is (Np / 128, Kb)
        recipe_b = S.BlockWise128x128
    else:
        sb = _outer_major(F.pad(b.scale, (0, 0, 0, Np - N), value=1.0))
        recipe_b = S.BlockWise1x128
    y = F.scaled_mm(_padded_fp8(a.data, M, Kp), _padded_fp8(b.data, Np, Kp).t(), sa, S.BlockWise1x128, sb, recipe_b,
                    output_dtype=out_dtype)
    return y if Np == N else y.narrow(1, 0, N)


def _mx_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """A 1x32 @ B 1x32^T, E8M0 scales, through ``F.scaled_mm`` with ``BlockWise1x32`` swizzled scales."""
    S = F.ScalingType
    (M, K), N = a.data.shape, b.data.shape[0]
    Kp, Np = _round_up(K, 32), _round_up(N, 16)
    e8 = torch.float8_e8m0fnu
    sa = _to_blocked(a.scale.to(e8))
    sb = _to_blocked(F.pad(b.scale, (0, 0, 0, Np - N), value=1.0).to(e8))
    sw = F.SwizzleType.SWIZZLE_32_4_4
    y = F.scaled_mm(_padded_fp8(a.data, M, Kp), _padded_fp8(b.data, Np, Kp).t(), sa, S.BlockWise1x32, sb,
                    S.BlockWise1x32, swizzle_a=sw, swizzle_b=sw, output_dtype=out_dtype)
    return y if Np == N else y.narrow(1, 0, N)


@contextlib.contextmanager
def tf32_matmul(device: torch.device) -> Iterator[None]:
    """fp32 matmuls on a CUDA ``device`` use TF32 inside the block (``torch.backends.cuda.matmul.fp32_precision =
    "tf32"``, restored after); a no-op elsewhere. For GEMMs of dequantised FP8 values: TF32 keeps 11 significant
    bits, so it rounds each operand by at most 2**-11 relative, 1/128 of the 2**-4 of E4M3 itself. Process-wide
    while inside (torch has no per-call switch). Only the per-backend setting is used, never the legacy
    ``set_float32_matmul_precision``: torch 2.13 refuses to read the legacy one once the new one was set."""
    if device.type != "cuda":
        yield
        return
    with matmul_fp32_precision("tf32"):
        yield


@contextlib.contextmanager
def matmul_fp32_precision(precision: str) -> Iterator[None]:
    """CUDA fp32 matmuls in ``precision`` ("tf32" or "ieee") inside the block, the previous setting ("none":
    follow the legacy switch) restored after. torch 2.11 and 2.13 both have ``torch.backends.cuda.matmul.
    fp32_precision``."""
    m = torch.backends.cuda.matmul
    prev = m.fp32_precision
    m.fp32_precision = precision
    try:
        yield
    finally:
        m.fp32_precision = prev


_WARNED: set[tuple] = set()


def warn_emulated(what: str, fmt: ScaleFormat, device: torch.device, why: str | None = None) -> None:
    """Warn once per (what, format, capability) that the FP8 GEMMs of ``what`` run emulated on CUDA ``device``:
    the quantised operands are multiplied in high precision (TF32 or bf16), slower than bf16 GEMMs. ``why``: the
    reason (default: the GPU generation the scaled GEMM for these scales needs)."""
    cap = devices.cuda_capability(device)
    key = (what, fmt, cap)
    if key in _WARNED:
        return
    _WARNED.add(key)
    if why is None:
        need = "Blackwell (sm100) or newer" if fmt == "e8m0" else "Hopper (sm90)"
        why = f"torch's scaled GEMM for these scales needs {need}"
    recipe = "mxfp8" if fmt == "e8m0" else "blockwise"
    warnings.warn(f"FP8 {what} ({recipe}) run emulated on this sm{cap[0]}{cap[1]} GPU: {why}; each GEMM multiplies "
                  "the dequantised FP8 values in high precision, slower than bf16 (parallel.precision=bf16 is faster)",
                  RuntimeWarning, stacklevel=3)


def fp8_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A @ B^T in ``out_dtype`` for training: the hardware path on CUDA where it applies (and on CPU when switched
    on), else the reference's product (TF32 on CUDA, with a one-time warning). A (M, K), B (N, K) -> (M, N)."""
    dev = a.data.device
    if uses_fp8_kernel(dev):
        y = scaled_mm_fast(a, b, out_dtype)
        if y is not None:
            return y
        if dev.type == "cuda":
            warn_emulated("GEMMs", a.fmt, dev)
    with tf32_matmul(dev):
        return fp8_mm_reference(a, b).to(out_dtype)


def uses_fp8_kernel(device: torch.device) -> bool:
    """Whether training GEMMs on ``device`` try a hardware scaled GEMM (CUDA; CPU only when switched on), and so
    need FP8 data and scales; otherwise the reference multiplies the dequantised values, which
    :func:`~moetrain.precision.quant.fake_quantise` gives without making the FP8 tensor."""
    return device.type == "cuda" or _CPU_FAST


#: A GEMM operand: FP8 data and scales (:class:`Quantized`) for a kernel, or its dequantised fp32 values.
Operand = Quantized | torch.Tensor


def operand(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat, kernel: bool) -> Operand:
    """``x`` (..., M, K) quantised in ``tile``: :func:`~moetrain.precision.fused.quantise` (compiled on CUDA) for
    a kernel (``kernel``), else :func:`fake_quantise`'s fp32 values (bit-equal to the dequantised
    :class:`Quantized`)."""
    return fused.quantise(x, tile, fmt) if kernel else fake_quantise(x, tile, fmt)


def operand_t(q: Operand) -> Operand:
    """The same quantised values transposed over the last two dims (tiles and scales with them); no
    requantisation."""
    if isinstance(q, Quantized):
        return Quantized(q.data.transpose(-2, -1), q.scale.transpose(-2, -1), (q.tile[1], q.tile[0]), q.fmt)
    return q.transpose(-2, -1)


def operand_mm(a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A @ B^T in ``out_dtype`` of two operands from :func:`operand`: A (M, K), B (N, K) -> (M, N). :func:`fp8_mm`
    for quantised ones, the fp32 product of the values otherwise (the reference's own GEMM), rounded once."""
    if isinstance(a, Quantized) and isinstance(b, Quantized):
        return fp8_mm(a, b, out_dtype)
    if isinstance(a, Quantized) or isinstance(b, Quantized):
        raise TypeError("operand_mm needs both operands quantised or both as values")
    return (a @ b.transpose(-2, -1)).to(out_dtype)
