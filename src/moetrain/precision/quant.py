"""FP8 quantisation reference: E4M3 casts with saturation, tile/block scales, dequantisation.

This module defines the numerics every FP8 path in moetrain must reproduce. A tensor is cut into tiles of
``(tile_rows, tile_cols)`` over its last two dims (leading dims, e.g. experts, are batch); each tile gets one scale
``s`` and its elements are stored as ``e4m3(x / s)``; dequantised, an element is ``e4m3 * s``. Tiles at the edge of a
dim that is not a multiple of the tile are the remainder (as if zero-padded: zeros never raise a tile's amax), as
the released DeepSeek-V3 weights do ("zero-padded to 128 before calculating the scale", README_WEIGHTS.md; see
docs/reference.md section 13).

Two scale formats:

* ``"fp32"`` (DeepSeek-V3 blockwise, arXiv 2412.19437 sec. 3.3.2): ``s = amax / 448`` in fp32, so the tile's largest
  magnitude maps to E4M3's largest normal, 448. The released checkpoint stores this ``s`` as ``weight_scale_inv``.
* ``"e8m0"`` (OCP Microscaling Formats v1.0, sec. 6.3): ``s = 2 ** (floor(log2(amax)) - emax_elem)`` with
  ``emax_elem = 8`` for E4M3 (448 = 1.75 * 2**8), the exponent clamped to E8M0's range [-127, 127]. Elements of
  ``x / s`` can reach 2**9 - ulp, above 448: the conversion saturates them to 448 (the spec's clamp to the largest
  normal).

A tile whose elements are all zero gets scale 1 (``"fp32"``) or 2**-127 (``"e8m0"``, the smallest E8M0 value) and
zero data, never 0/0. A tile holding NaN or inf dequantises to NaN. Tile shapes used by the recipes: (1, 128) activations and gradients,
(128, 128) weights, (128, 1) token-dim tiles for the weight-gradient GEMM, (1, 32) / (32, 1) MXFP8 blocks, and
(1, WHOLE) / (WHOLE, 1) -- one scale per row / column -- for the routed experts of the blockwise recipe
(``recipe.py``). A tile dim of :data:`WHOLE` is one tile of the whole dim, by the edge-tile rule above.

Per-group scales (:func:`quantise_groups`): one scale per (group of rows, column), the groups given by a group index
per row. The routed experts' weight gradient contracts over each expert's own tokens, and the tokens of all experts
sit in one tensor; its tiles are "column c of expert e's rows", which no fixed tile shape describes.

Shape legend: M rows, N columns of the last two dims; Mt = ceil(M / tile_rows), Nt = ceil(N / tile_cols).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moetrain.devices import contiguous

#: The FP8 element format of every GEMM operand (OCP FP8 E4M3, "fn": no infinities, one NaN pattern).
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3 value (1.75 * 2**8).
E4M3_MAX = 448.0
#: Exponent of E4M3's largest normal (OCP MX v1.0, table of element formats: emax = 8 for FP8 E4M3).
E4M3_EMAX = 8
#: E8M0 scale exponent range (OCP MX v1.0 sec. 5.4.1: bias 127, exponents -127..127, 0xFF is NaN).
E8M0_MIN_EXP, E8M0_MAX_EXP, E8M0_BIAS = -127, 127, 127

ScaleFormat = Literal["fp32", "e8m0"]

#: A tile length that spans the whole dim, whatever its size: (1, WHOLE) is one scale per row, (WHOLE, 1) one per
#: column (a tile no shorter than its dim is one tile of the dim).
WHOLE = 1 << 62


@dataclass
class Quantized:
    """An FP8 tensor with one scale per tile of its last two dims.

    Attributes:
        data: float8_e4m3fn, (..., M, N), the source's shape.
        scale: fp32, (..., Mt, Nt): the dequantisation scale of each tile (element = data * scale).
        tile: (tile_rows, tile_cols).
        fmt: "fp32" (any positive fp32 scale) or "e8m0" (powers of two).
    """

    data: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int]
    fmt: ScaleFormat

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values, (..., M, N) in ``dtype`` (computed in fp32)."""
        dt, _ = _tiled(e4m3_to_float(self.data), self.tile)
        return _untiled(dt * self.scale.unsqueeze(-1).unsqueeze(-3), self.data.shape).to(dtype)

    def scale_e8m0_bits(self) -> torch.Tensor:
        """The E8M0 encoding (uint8, biased exponent) of ``scale``; only for ``fmt == "e8m0"``.

        Raises:
            ValueError: the scales are not E8M0 (``fmt == "fp32"``).
        """
        if self.fmt != "e8m0":
            raise ValueError("scale_e8m0_bits() needs fmt='e8m0' scales (powers of two)")
        return (torch.frexp(self.scale)[1] - 1 + E8M0_BIAS).to(torch.uint8)


#: fp32 value of each of the 256 float8_e4m3fn bit patterns (the two NaN codes give NaN), indexed by the byte.
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()


def e4m3_to_float(data: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32, exactly: the same values, shape and strides as ``data.float()``.

    On CPU by a gather from the 256-entry table of E4M3 values: torch's CPU fp8-to-fp32 conversion is an
    element-by-element loop about 5x slower than ``index_select`` (BENCHMARKS.md, "FP8"), and it was a quarter of
    an emulated FP8 training step. Every E4M3 value is exact in fp32, so both give the same bits. Other devices,
    layouts that are not a permutation of a contiguous tensor, and code being compiled (``precision.fused``), use
    ``data.float()``.
    """
    if data.device.type != "cpu" or data.dtype != FP8_DTYPE or torch.compiler.is_compiling():
        return data.float()
    # the dims ordered by stride: a permutation of a contiguous tensor (e.g. a transposed operand) keeps its layout
    order = sorted(range(data.dim()), key=lambda d: -data.stride(d))
    base = data.permute(order)
    if not base.is_contiguous():
        return data.float()
    table = _E4M3_VALUES
    vals = table.index_select(0, base.reshape(-1).view(torch.uint8).to(torch.int32)).view(base.shape)
    inverse = sorted(range(data.dim()), key=lambda d: order[d])
    return vals.permute(inverse)


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to float8_e4m3fn (round to nearest even) with saturation: |x| > 448 becomes +-448, NaN stays NaN.

    The clamp makes saturation explicit: the E4M3 "fn" format has no infinity, and a plain cast is not guaranteed to
    saturate on every backend. Shapes: any -> same, dtype float8_e4m3fn.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _tiled(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` (..., M, N) as a (..., Mt, tr, Nt, tc) view (zero-padded first where a dim is longer than its tile
    and not a multiple of it), and the effective tile: a dim no longer than its tile is one tile of its own size,
    which needs no padding."""
    M, N = x.shape[-2:]
    tr, tc = min(tile[0], max(M, 1)), min(tile[1], max(N, 1))
    pr, pc = (-M) % tr, (-N) % tc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    *lead, Mp, Np = x.shape
    return x.reshape(*lead, Mp // tr, tr, Np // tc, tc), (tr, tc)


def _untiled(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`_tiled`: (..., Mt, tr, Nt, tc) -> (..., M, N), dropping the padding."""
    *lead, Mt, tr, Nt, tc = t.shape
    out = t.reshape(*lead, Mt * tr, Nt * tc)
    M, N = shape[-2:]
    return out if (Mt * tr, Nt * tc) == (M, N) else out.narrow(-2, 0, M).narrow(-1, 0, N)


def _tiled_amax(xt: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each tile of a :func:`_tiled` view: (..., Mt, tr, Nt, tc) -> (..., Mt, 1, Nt, 1).
    As max(amax, -amin): two reductions and no |x| tensor; NaN propagates through both."""
    dims = (-3, -1)
    return torch.maximum(xt.amax(dim=dims, keepdim=True), xt.amin(dim=dims, keepdim=True).neg_())


def tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Largest magnitude of each tile of the last two dims: (..., M, N) -> fp32 (..., Mt, Nt). NaN propagates."""
    return _tiled_amax(_tiled(x.float(), tile)[0])[..., 0, :, 0]


def scales_from_amax(amax: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """Dequantisation scales (fp32, same shape) from tile maxima, per the format (see the module docstring).

    ``"fp32"``: amax / 448, or 1 where that is zero (an all-zero tile, or an fp32 amax so small it underflows).
    ``"e8m0"``: 2 ** clamp(floor(log2(amax)) - 8, -127, 127); 2**-127 for zero tiles. floor(log2) comes exactly from
    the fp32 exponent (frexp), never from a rounded logarithm. A tile holding NaN or +-inf gets a NaN scale in both
    formats, so its values dequantise to NaN (an overflow is never hidden as a finite number).
    """
    if fmt == "fp32":
        s = amax / E4M3_MAX
        s = torch.where((s > 0) | torch.isnan(s), s, torch.ones_like(s))
        return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))
    if fmt == "e8m0":
        exp = torch.frexp(amax)[1] - 1 - E4M3_EMAX  # frexp: amax = m * 2**e with m in [0.5, 1)
        exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP)).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        s = torch.ldexp(torch.ones_like(amax), exp)
        return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))
    raise ValueError(f"scale format {fmt!r}; allowed: 'fp32', 'e8m0'")


def expand_tiles(scale: torch.Tensor, tile: tuple[int, int], shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Broadcast per-tile values (..., Mt, Nt) to the elements (..., M, N) of the last two dims ``shape``."""
    M, N = shape
    tr, tc = min(tile[0], max(M, 1)), min(tile[1], max(N, 1))
    s = scale.repeat_interleave(tr, dim=-2) if tr > 1 else scale
    s = s.repeat_interleave(tc, dim=-1) if tc > 1 else s
    return s[..., :M, :N]


def quantise(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat = "fp32") -> Quantized:
    """Quantise ``x`` (..., M, N), any float dtype, to E4M3 with one scale per ``tile`` of its last two dims.

    Returns a :class:`Quantized` with data ``cast_e4m3(x / s)`` (row-major, x's shape) and scales ``s`` from
    :func:`scales_from_amax`. Raises ValueError for a tensor of fewer than 2 dims or a tile dim < 1.
    """
    check_tile(x, tile, "quantise")
    data, scale = quantise_tiles(x, tile, fmt)
    return Quantized(data, scale, tuple(tile), fmt)


def _block_tiles(x: torch.Tensor, tile: tuple[int, int], full_shape: tuple[int, ...], offset: tuple[int, ...]
                 ) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """``x`` (..., m, n), the block of a tensor of ``full_shape`` that starts at ``offset`` (one per dim), as an
    fp32 view of the *full* tensor's tiles that the block touches: (..., mt, tr, nt, tc), zero-padded in front and
    behind so that it starts and ends on the full tensor's tile edges. Returns the view, the (row, column) index of
    its first tile in the full grid, and the front padding."""
    M, N = full_shape[-2:]
    tr, tc = min(tile[0], max(M, 1)), min(tile[1], max(N, 1))
    m, n = x.shape[-2:]
    r0, c0 = offset[-2:]
    fr, fc = r0 % tr, c0 % tc
    br, bc = (-(fr + m)) % tr, (-(fc + n)) % tc
    xp = x.float()
    if fr or fc or br or bc:
        xp = F.pad(xp, (fc, bc, fr, br))
    *lead, mp, np_ = xp.shape
    return xp.reshape(*lead, mp // tr, tr, np_ // tc, tc), (r0 // tr, c0 // tc), (fr, fc)


def tile_grid_shape(full_shape: tuple[int, ...], tile: tuple[int, int]) -> tuple[int, ...]:
    """Shape (..., Mt, Nt) of the per-tile values of a tensor of ``full_shape`` (the edge-tile rule of the module
    docstring: a dim no longer than its tile is one tile)."""
    M, N = full_shape[-2:]
    tr, tc = min(tile[0], max(M, 1)), min(tile[1], max(N, 1))
    return (*full_shape[:-2], -(-M // tr), -(-N // tc))


def block_tile_amax(x: torch.Tensor, tile: tuple[int, int], full_shape: tuple[int, ...],
                    offset: tuple[int, ...]) -> torch.Tensor:
    """The largest magnitude of each tile of the full tensor over the elements of the block ``x`` holds (zero for
    tiles it does not touch): fp32 of :func:`tile_grid_shape`. A tile that straddles two blocks gets each block's
    part; the maximum over the blocks is the tile's :func:`tile_amax` exactly (a maximum does not depend on the
    order it is taken in). Leading dims are batch dims (tiles never span them).

    Args:
        x: (..., m, n) the block, any float dtype.
        tile: the full tensor's tile.
        full_shape: the full tensor's shape.
        offset: the block's first index in every dim of the full tensor.
    """
    grid = torch.zeros(tile_grid_shape(full_shape, tile), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return grid
    xt, (rt, ct), _ = _block_tiles(x, tile, full_shape, offset)
    part = _tiled_amax(xt)[..., 0, :, 0]
    lead = tuple(slice(o, o + s) for o, s in zip(offset[:-2], x.shape[:-2]))
    grid[(*lead, slice(rt, rt + part.shape[-2]), slice(ct, ct + part.shape[-1]))] = part
    return grid


def quantise_block(x: torch.Tensor, tile: tuple[int, int], scale_grid: torch.Tensor, full_shape: tuple[int, ...],
                   offset: tuple[int, ...]) -> torch.Tensor:
    """E4M3 data of the block ``x`` (..., m, n) of a full tensor quantised with the full tensor's tile scales
    ``scale_grid`` (:func:`tile_grid_shape`, from :func:`scales_from_amax` of the maxima over every block): bit for
    bit the block's part of ``quantise(full, tile, fmt).data`` (the same ``cast_e4m3(x / s)`` per element).
    Arguments as :func:`block_tile_amax`; returns float8_e4m3fn of x's shape, row-major."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    xt, (rt, ct), (fr, fc) = _block_tiles(x, tile, full_shape, offset)
    lead = tuple(slice(o, o + s) for o, s in zip(offset[:-2], x.shape[:-2]))
    s = scale_grid[(*lead, slice(rt, rt + xt.shape[-4]), slice(ct, ct + xt.shape[-2]))]
    q = cast_e4m3(xt / s.unsqueeze(-1).unsqueeze(-3))
    *lead_shape, mt, tr, nt, tc = q.shape
    q = q.reshape(*lead_shape, mt * tr, nt * tc).narrow(-2, fr, x.shape[-2]).narrow(-1, fc, x.shape[-1])
    return contiguous(q)


def check_tile(x: torch.Tensor, tile: tuple[int, int], caller: str) -> None:
    """Raise ValueError unless ``x`` has >= 2 dims and both tile dims are >= 1."""
    if x.dim() < 2:
        raise ValueError(f"{caller} needs a tensor of >= 2 dims, got shape {tuple(x.shape)}")
    if min(tile) < 1:
        raise ValueError(f"tile {tile} must have positive dims")


def quantise_tiles(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors of :func:`quantise`: E4M3 data (..., M, N), row-major, and fp32 scales (..., Mt, Nt). Tensor
    ops only (no checks), so that ``precision.fused`` can compile exactly this function for CUDA."""
    xt, scale = _tiled_with_scales(x, tile, fmt)
    data = contiguous(_untiled(cast_e4m3(xt / scale), x.shape))
    return data, scale.squeeze(-1).squeeze(-2)


def _tiled_with_scales(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as fp32 tiles (:func:`_tiled`) and each tile's scale, (..., Mt, 1, Nt, 1): the one definition that
    :func:`quantise` and :func:`fake_quantise` share."""
    xt, _ = _tiled(x.float(), tile)
    return xt, scales_from_amax(_tiled_amax(xt), fmt)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-448, 448] (or NaN) rounded to the nearest E4M3 value, ties to even, returned in fp32:
    bit for bit ``e4m3_to_float(v.to(float8_e4m3fn))`` (tests/precision/test_quant.py checks every rounding
    boundary), without the fp8 tensor. Shapes: any -> same; ``v`` must be fp32 and is not modified.

    Why it is exact: E4M3 keeps 3 fraction bits, so in the binade [2**e, 2**(e+1)) its step is 2**(e-3), and
    below its smallest normal 2**-6 the subnormal step is 2**-9. fp32 addition rounds to the nearest multiple of
    the sum's own step, ties to even; ``c = 1.5 * 2**(max(e, -6) + 20)`` has step 2**(max(e, -6) - 3), and
    ``v + c`` stays in c's binade, so ``(v + c) - c`` is ``v`` rounded to E4M3's grid with E4M3's tie rule (c is
    an even multiple of the step, so the parity of the sum's last bit is that of the E4M3 fraction). 2**e is the
    exponent field of v's bits (0 for zero and fp32 subnormals, which then take the subnormal step). NaN stays
    NaN (its exponent field makes c infinite). On CPU it is faster than the fp8 cast and the table back
    (BENCHMARKS.md, "FP8"); it is what the reference GEMMs multiply.
    """
    if v.dtype != torch.float32:
        raise ValueError(f"round_to_e4m3 needs fp32 values, got {v.dtype}")
    return _round_to_e4m3_(v.clone())


def _round_to_e4m3_(v: torch.Tensor) -> torch.Tensor:
    """:func:`round_to_e4m3` in place on an fp32 ``v`` (one temporary: every large allocation costs page faults
    on CPU, which made the out-of-place version 3x slower inside a training step than alone)."""
    c = (v.view(torch.int32) & 0x7F800000).view(torch.float32)
    c.clamp_min_(2.0 ** -6).mul_(1.5 * 2.0 ** 20)
    return v.add_(c).sub_(c)


def fake_quantise(x: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat = "fp32") -> torch.Tensor:
    """The fp32 values an FP8 GEMM multiplies, (..., M, N): bit for bit ``quantise(x, tile, fmt).dequantise()``,
    computed without the fp8 tensor (:func:`round_to_e4m3`). Raises ValueError as :func:`quantise` does."""
    check_tile(x, tile, "fake_quantise")
    xt, scale = _tiled_with_scales(x, tile, fmt)
    # the clamp matters for fp32 scales too: an amax below ~1e-41 gives a subnormal amax / 448, coarse enough
    # that x / s exceeds 448 by more than half a step
    v = (xt / scale).clamp_(-E4M3_MAX, E4M3_MAX)
    return _untiled(_round_to_e4m3_(v).mul_(scale), x.shape)


def group_amax(x_PK: torch.Tensor, group_P: torch.Tensor, n_groups: int, rows_per_chunk: int = 1) -> torch.Tensor:
    """Largest magnitude of each column over each group's rows: (P, K), int (P,) -> fp32 (G, K).

    ``amax[g, k] = max |x[p, k]|`` over the rows p with ``group_P[p] == g``; 0 for a group without rows. Rows whose
    group index is outside [0, G) (e.g. G for rows past the last group) belong to no group. A NaN or inf among a
    group's column gives +inf, whose scale is NaN (:func:`scales_from_amax`): such a column dequantises to NaN, as
    a tile does. ``rows_per_chunk``: every run of that many rows from row 0 lies in one group (the groups start at
    multiples of it, and P is one); the maxima are taken per chunk first (a dense reduction), then per group (a
    scatter over P / rows_per_chunk rows instead of P). Nothing leaves the device.
    """
    P, K = x_PK.shape
    c = rows_per_chunk
    xc = x_PK.view(P // c, c, K)
    # max is exact in any dtype: reduce in x's own dtype, convert the (P / c, K) maxima
    a = torch.maximum(xc.amax(dim=1), xc.amin(dim=1).neg()).float()
    # NaN as +inf: a scatter-max need not propagate NaN on every device (atomic max), +inf it keeps
    a = a.masked_fill(a.isnan(), float("inf"))
    g = _group_index(group_P.view(P // c, c).select(1, 0), n_groups)
    out = a.new_zeros(n_groups + 1, K).scatter_reduce_(0, g.unsqueeze(-1).expand(-1, K), a, "amax")
    return out.narrow(0, 0, n_groups)


def _group_index(group_P: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``group_P`` as int64 with every index outside [0, G) replaced by G (the "no group" row)."""
    g = group_P.long()
    return torch.where((g >= 0) & (g < n_groups), g, n_groups)


def _row_scales(scale_GK: torch.Tensor, group_P: torch.Tensor) -> torch.Tensor:
    """The scale of each element's (group, column): (G, K), (P,) -> (P, K); rows in no group get scale 1."""
    G, K = scale_GK.shape
    with_none = torch.cat([scale_GK, scale_GK.new_ones(1, K)])
    return with_none.index_select(0, _group_index(group_P, G))


def quantise_groups(x_PK: torch.Tensor, group_P: torch.Tensor, n_groups: int, fmt: ScaleFormat = "fp32",
                    rows_per_chunk: int = 1, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x_PK`` with one scale per (group, column): returns E4M3 data (P, K) and fp32 scales (G, K).

    ``scale[g, k]`` is :func:`scales_from_amax` of :func:`group_amax`; ``data[p, k] = cast_e4m3(x[p, k] /
    scale[group_P[p], k])``, so the values of column k of group g are exactly a tile's. Rows in no group are cast
    with scale 1 (the experts' layout makes them zero). ``column_major``: the data is laid out (K, P) row-major (the
    returned (P, K) tensor is its transpose), the layout the grouped GEMM of the weight gradient reads.
    ``rows_per_chunk`` as for :func:`group_amax`.
    """
    scale = scales_from_amax(group_amax(x_PK, group_P, n_groups, rows_per_chunk), fmt)
    data = cast_e4m3(x_PK.float() / _row_scales(scale, group_P))
    return (contiguous(data.t()).t() if column_major else data), scale


def fake_quantise_groups(x_PK: torch.Tensor, group_P: torch.Tensor, n_groups: int, fmt: ScaleFormat = "fp32",
                         rows_per_chunk: int = 1) -> torch.Tensor:
    """The fp32 values (P, K) of :func:`quantise_groups`, dequantised (bit for bit ``data * scale[group]``),
    without the fp8 tensor (:func:`round_to_e4m3`), as :func:`fake_quantise` for tiles."""
    scale = scales_from_amax(group_amax(x_PK, group_P, n_groups, rows_per_chunk), fmt)
    s = _row_scales(scale, group_P)
    v = (x_PK.float() / s).clamp_(-E4M3_MAX, E4M3_MAX)
    return _round_to_e4m3_(v).mul_(s)
