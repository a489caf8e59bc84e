"""Quantisation reference against hand-computed values: E4M3 rounding and saturation, fp32 and E8M0 tile scales,
edge tiles, zeros, subnormals, NaN."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.precision.quant import (E4M3_MAX, FP8_DTYPE, WHOLE, cast_e4m3, e4m3_to_float, expand_tiles,
                                      fake_quantise, fake_quantise_groups, group_amax, quantise, quantise_groups,
                                      round_to_e4m3, scales_from_amax, tile_amax)


def test_cast_e4m3_rounds_to_nearest_even_and_saturates():
    # E4M3: 3 mantissa bits; between 256 and 448 the step is 32, between 1 and 2 it is 1/8.
    x = torch.tensor([1.0, 1.0625, 1.1875, 300.0, 304.0, 448.0, 449.0, 464.0, 1e6, -1e6, 0.0, -0.0])
    got = cast_e4m3(x).float()
    # 1.0625 is halfway between 1 and 1.125 -> even mantissa (1.0); 1.1875 halfway 1.125/1.25 -> 1.25;
    # 300 -> 288 (nearer than 320); 304 halfway 288/320 -> 320 (even); > 448 saturates.
    want = torch.tensor([1.0, 1.0, 1.25, 288.0, 320.0, 448.0, 448.0, 448.0, 448.0, -448.0, 0.0, -0.0])
    assert torch.equal(got, want)
    assert torch.isnan(cast_e4m3(torch.tensor([float("nan")])).float()).all()
    assert cast_e4m3(x).dtype == FP8_DTYPE


def test_e4m3_to_float_is_torch_conversion_bit_for_bit():
    # all 256 codes (both NaNs, both zeros, subnormals), and the layouts dequantise meets: transposed, permuted,
    # strided (which falls back to torch's own conversion), empty
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    x = codes[torch.randint(0, 256, (3, 40, 70), generator=torch.Generator().manual_seed(0))]
    for t in (codes, x, x.transpose(-2, -1), x.permute(2, 0, 1), x[:, ::2], x[:0]):
        got, want = e4m3_to_float(t), t.float()
        assert got.dtype == torch.float32 and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # same bits, NaN payloads included


def test_cast_e4m3_subnormals():
    # Smallest normal 2**-6; subnormals are multiples of 2**-9. 0.6 * 2**-9 rounds up to 2**-9, 0.4 * 2**-9 to 0,
    # 2.5 * 2**-9 to 2 * 2**-9 (even), 3.5 * 2**-9 to 4 * 2**-9.
    u = 2.0 ** -9
    x = torch.tensor([0.6 * u, 0.4 * u, 2.5 * u, 3.5 * u, 7 * u, 2.0 ** -6])
    assert torch.equal(cast_e4m3(x).float(), torch.tensor([u, 0.0, 2 * u, 4 * u, 7 * u, 2.0 ** -6]))


def test_blockwise_scales_edge_tiles_and_zero_tiles():
    # (3, 200) in 1x128 tiles: two tiles per row, the second one 72 wide (edge tile).
    x = torch.zeros(3, 200)
    x[0, 5], x[0, 150] = -7.0, 2.0
    x[1, 127] = 896.0          # 448 * 2 -> scale 2
    # row 2 all zeros -> scale 1, data zero
    q = quantise(x, (1, 128), "fp32")
    assert q.scale.shape == (3, 2)
    want = torch.tensor([[7 / 448, 2 / 448], [2.0, 1.0], [1.0, 1.0]])
    assert torch.allclose(q.scale, want, rtol=0, atol=0)
    assert q.data.float()[0, 5] == -448.0 and q.data.float()[0, 150] == 448.0 and q.data.float()[1, 127] == 448.0
    assert torch.equal(q.dequantise()[2], torch.zeros(200))
    assert not torch.isnan(q.dequantise()).any()
    # The largest element of a tile is represented exactly (it maps to 448).
    assert q.dequantise()[0, 5] == -7.0 and q.dequantise()[1, 127] == 896.0


def test_weight_blocks_128x128_with_edges():
    # (130, 260) in 128x128 blocks: a 2 x 3 grid; the last row block has 2 rows, the last column block 4 columns.
    torch.manual_seed(0)
    w = torch.randn(130, 260)
    q = quantise(w, (128, 128), "fp32")
    assert q.scale.shape == (2, 3)
    for i, r in enumerate((slice(0, 128), slice(128, 130))):
        for j, c in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            assert q.scale[i, j] == w[r, c].abs().max() / 448.0
    # Each element's error is at most half an E4M3 step of its block: relative 2**-4 of the element.
    err = (q.dequantise() - w).abs()
    assert (err <= w.abs() * 2.0 ** -4 + q.dequantise().new_tensor(2.0 ** -10) * expand_tiles(q.scale, q.tile, w.shape)).all()


def test_e8m0_scales_follow_ocp_mx_floor_rule():
    # OCP MX v1.0 sec. 6.3: X = 2**(floor(log2(amax)) - 8). amax = 1 -> 2**-8; amax = 448 -> 2**0 (448 = 1.75*2**8);
    # amax = 511 -> 2**0 and 511 saturates to 448; amax = 512 -> 2**1; amax = 0 -> 2**-127 (smallest E8M0).
    # A subnormal fp32 amax (3e-39 < 2**-126) has floor(log2) = -128 -> clamped to -127; 1.5 * 2**126 -> 2**118.
    amax = torch.tensor([1.0, 448.0, 511.0, 512.0, 0.0, 3.0e-39, 1.5 * 2.0 ** 126])
    s = scales_from_amax(amax, "e8m0")
    want = torch.tensor([2.0 ** -8, 1.0, 1.0, 2.0, 2.0 ** -127, 2.0 ** -127, 2.0 ** 118])
    assert torch.equal(s, want)
    for fmt in ("e8m0", "fp32"):
        assert torch.isnan(scales_from_amax(torch.tensor([float("inf"), float("nan")]), fmt)).all()
    x = torch.tensor([[511.0, 1.0] + [0.0] * 30])
    q = quantise(x, (1, 32), "e8m0")
    assert q.scale.item() == 1.0 and q.data.float()[0, 0] == 448.0  # saturated, as the spec's clamp says
    assert q.scale_e8m0_bits().item() == 127  # biased exponent of 2**0


def test_mx_blocks_of_32_with_edge_block():
    # (2, 40) in 1x32 blocks: the second block of each row has 8 elements.
    x = torch.zeros(2, 40)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)   # amax 3 -> floor(log2 3) = 1 -> scale 2**-7
    x[0, 39] = 0.1                              # amax 0.1 -> floor(log2 0.1) = -4 -> 2**-12
    q = quantise(x, (1, 32), "e8m0")
    assert q.scale.shape == (2, 2)
    assert torch.equal(q.scale, torch.tensor([[2.0 ** -7, 2.0 ** -12], [2.0 ** -127, 2.0 ** -127]]))
    # Power-of-two scales: dequantised = e4m3(x / s) * s exactly, so it is e4m3 rounding of x itself (no subnormal
    # here) -> equal to the cast of the unscaled values.
    assert torch.equal(q.dequantise()[0, :32], cast_e4m3(x[0, :32]).float())
    assert torch.equal(q.dequantise()[1], torch.zeros(40))


def test_column_tiles_run_along_rows():
    # (130, 2) in 128x1 tiles (the wgrad's token-dim tiles): tiles rows 0..127 and 128..129 per column.
    x = torch.arange(260, dtype=torch.float32).view(130, 2)
    amax = tile_amax(x, (128, 1))
    assert torch.equal(amax, torch.tensor([[254.0, 255.0], [258.0, 259.0]]))


def test_nan_propagates_only_to_its_tile():
    x = torch.ones(2, 256)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    d = fake_quantise(x, (1, 128), "fp32")
    assert torch.isnan(d[1, 128:]).all() and not torch.isnan(d[1, :128]).any()
    d = d[:1]
    assert torch.isnan(d[0, :128]).all() and not torch.isnan(d[0, 128:]).any()


def test_batched_expert_blocks_do_not_cross_experts():
    w = torch.ones(3, 4, 8)
    w[1] *= 100.0
    q = quantise(w, (128, 128), "fp32")
    assert q.scale.shape == (3, 1, 1)
    assert torch.equal(q.scale.flatten(), torch.tensor([1 / 448, 100 / 448, 1 / 448]))
    assert torch.equal(q.dequantise(), w)


@pytest.mark.parametrize("fmt,tile", [("fp32", (1, 128)), ("fp32", (128, 128)), ("e8m0", (1, 32)), ("e8m0", (32, 1))])
def test_quantisation_error_bound_random(fmt: str, tile: tuple[int, int]):
    # E4M3 keeps 3 mantissa bits: every normal element is within 2**-4 relative; elements far below their tile's
    # amax fall to subnormals and keep an absolute error of at most half of 2**-9 * scale.
    torch.manual_seed(1)
    x = torch.randn(67, 300) * torch.logspace(-3, 3, 300)
    q = quantise(x, tile, fmt)  # type: ignore[arg-type]
    s = expand_tiles(q.scale, q.tile, x.shape)
    err = (q.dequantise() - x).abs()
    sat = x.abs() / s > E4M3_MAX * (1 + 2.0 ** -20)  # only under E8M0 scales (x / s reaches 2**9 - ulp): clamped to 448 * s
    assert (sat.any().item()) == (fmt == "e8m0")
    assert torch.equal(err[sat], x.abs()[sat] - E4M3_MAX * s[sat])
    assert (err[~sat] <= x.abs()[~sat] * 2.0 ** -4 + s[~sat] * 2.0 ** -10 * (1 + 1e-6)).all()
    assert (q.data.float().abs() <= E4M3_MAX).all()
    if fmt == "e8m0":
        assert torch.equal(q.scale, torch.ldexp(torch.ones_like(q.scale), torch.frexp(q.scale)[1] - 1))
    assert not math.isnan(err.max().item())


def _e4m3_grid_and_boundaries() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between neighbours (the ties), one fp32 ulp either side of each
    midpoint, and fp32 zeros and subnormals: the inputs where a rounding rule can go wrong, within [-448, 448]."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    vals = e4m3_to_float(codes)
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    return torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                      torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, 2.0 ** -126])]).clamp(-E4M3_MAX, E4M3_MAX)


def test_round_to_e4m3_is_the_cast_bit_for_bit():
    # at every tie and its neighbours (e.g. 1.0625 -> 1.0 and 1.1875 -> 1.25, to even; 0.5 * 2**-9 -> 0), and on
    # values spread over 30 binades
    v = _e4m3_grid_and_boundaries()
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1 << 18, generator=g) * torch.exp(torch.randn(1 << 18, generator=g) * 5)
    for x in (v, r.clamp(-E4M3_MAX, E4M3_MAX), torch.tensor([float("nan")])):
        got, want = round_to_e4m3(x), cast_e4m3(x).float()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
    assert round_to_e4m3(torch.tensor([1.0625, 1.1875, 0.5 * 2.0 ** -9, 304.0])).tolist() == [1.0, 1.25, 0.0, 320.0]
    with pytest.raises(ValueError, match="fp32"):
        round_to_e4m3(torch.ones(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["fp32", "e8m0"])
@pytest.mark.parametrize("tile", [(1, 128), (128, 1), (128, 128), (1, 32), (32, 1)])
def test_fake_quantise_equals_quantise_then_dequantise(fmt: str, tile: tuple[int, int]):
    # the reference GEMMs multiply fake_quantise's values: they must be the stored format's values exactly, for
    # edge tiles (dims not multiples of the tile), batched experts, zero tiles, NaN / inf tiles and bf16 input
    g = torch.Generator().manual_seed(1)
    for shape in [(130, 300), (3, 40, 70), (129, 257)]:
        x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 3)
        x[..., :1, :] = 0.0
        x.view(-1)[-1] = float("nan")
        x.view(-1)[-200] = float("-inf")
        for src in (x, x.bfloat16()):
            got, want = fake_quantise(src, tile, fmt), quantise(src, tile, fmt).dequantise()  # type: ignore[arg-type]
            assert got.shape == want.shape == src.shape and got.dtype == torch.float32
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_fake_quantise_saturates_under_a_subnormal_scale():
    # amax 6.6e-43: amax / 448 is an fp32 subnormal (one bit), so amax / s is 470, past E4M3's 448 by more than
    # half a step (464): both paths must saturate it
    x = torch.tensor([[6.5861e-43, 5e-43, -1e-43, 0.0]])
    assert (x / (x.abs().max() / E4M3_MAX)).max() > 464
    got, want = fake_quantise(x, (1, 128), "fp32"), quantise(x, (1, 128), "fp32").dequantise()
    assert torch.equal(got, want)
    assert (quantise(x, (1, 128), "fp32").data.float().abs() <= E4M3_MAX).all()


def test_whole_dim_tiles_are_one_scale_per_row_or_column():
    x = torch.tensor([[1.0, -300.0, 2.0], [0.5, 0.25, 0.0], [0.0, 0.0, 0.0]])
    rows = quantise(x, (1, WHOLE))
    assert rows.scale.shape == (3, 1)
    assert torch.equal(rows.scale[:, 0], torch.tensor([300 / 448, 0.5 / 448, 1.0]))
    cols = quantise(x, (WHOLE, 1))
    assert torch.equal(cols.scale, torch.tensor([[1 / 448, 300 / 448, 2 / 448]]))
    # a (1, WHOLE) tile over 3-D weights: one scale per row of each expert
    w = torch.randn(2, 5, 7)
    assert quantise(w, (1, WHOLE)).scale.shape == (2, 5, 1)
    assert expand_tiles(rows.scale, (1, WHOLE), x.shape).shape == x.shape
    torch.testing.assert_close(fake_quantise(x, (1, WHOLE)), rows.dequantise(), rtol=0, atol=0)


def test_group_scales_by_hand():
    # rows 0-1 group 0, rows 2-3 group 2 (group 1 empty), row 4 past the groups (index 3 = G): no group
    x = torch.tensor([[1.0, -8.0], [-4.0, 2.0], [0.5, 0.0], [0.25, -0.75], [1000.0, 1000.0]])
    g = torch.tensor([0, 0, 2, 2, 3])
    assert torch.equal(group_amax(x, g, 3), torch.tensor([[4.0, 8.0], [0.0, 0.0], [0.5, 0.75]]))
    data, scale = quantise_groups(x, g, 3)
    assert torch.equal(scale, torch.tensor([[4 / 448, 8 / 448], [1.0, 1.0], [0.5 / 448, 0.75 / 448]]))
    # each group's largest magnitude of a column maps to 448; the row in no group is cast with scale 1
    assert data.float()[1, 0] == -448.0 and data.float()[0, 1] == -448.0 and data.float()[3, 1] == -448.0
    assert torch.equal(data.float()[4], torch.tensor([448.0, 448.0]))
    deq = data.float() * torch.cat([scale, torch.ones(1, 2)])[torch.tensor([0, 0, 2, 2, 3])]
    assert torch.equal(fake_quantise_groups(x, g, 3), deq)
    # a column of a group is exactly a tile: the same values as quantising that group's rows in (WHOLE, 1) tiles
    assert torch.equal(fake_quantise_groups(x, g, 3)[:2], fake_quantise(x[:2], (WHOLE, 1)))
    assert torch.equal(data.view(torch.uint8), quantise_groups(x, g, 3, column_major=True)[0].contiguous()
                       .view(torch.uint8))


def test_group_scales_chunked_equal_unchunked_and_nan_spreads_only_in_its_group():
    torch.manual_seed(0)
    counts = [32, 0, 48, 16]
    P = sum(counts) + 16  # 16 rows past the groups
    g = torch.repeat_interleave(torch.arange(5), torch.tensor(counts + [16]))  # 4 = no group
    x = torch.randn(P, 40) * torch.logspace(-3, 3, 40)
    x[P - 16:] = 0
    for fmt in ("fp32", "e8m0"):
        one = quantise_groups(x, g, 4, fmt)
        chunked = quantise_groups(x, g, 4, fmt, rows_per_chunk=16)
        assert torch.equal(one[1], chunked[1]) and torch.equal(one[0].view(torch.uint8), chunked[0].view(torch.uint8))
        assert torch.equal(fake_quantise_groups(x, g, 4, fmt, 16), fake_quantise_groups(x, g, 4, fmt))
    x[40, 3] = float("nan")  # row 40 is in group 2
    v = fake_quantise_groups(x, g, 4, "fp32", 16)
    assert torch.isnan(v[32:80, 3]).all() and not torch.isnan(v[:32]).any() and not torch.isnan(v[32:80, :3]).any()
    x[40, 3] = float("inf")
    assert torch.isnan(fake_quantise_groups(x, g, 4, "fp32", 16)[32:80, 3]).all()
