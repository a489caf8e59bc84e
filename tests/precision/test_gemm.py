"""FP8 GEMMs: the linear's fprop, dgrad and wgrad and the grouped expert GEMM against hand-computed values and the
reference formulation (quantise with the recipe's tiles, fp32 GEMM of the dequantised operands); fast paths against
the reference."""

from __future__ import annotations

import pytest
import torch

from moetrain.precision.gemm import fast_path_rtol, fp32_sum_rtol, fp8_mm_reference, operand_t, scaled_mm_fast
from moetrain.precision.grouped import aligned_layout, fp8_expert_swiglu, fp8_grouped_mm, to_aligned
from moetrain.precision.linear import Fp8LinearFunction, fp8_linear
from moetrain.precision.quant import fake_quantise, quantise
from moetrain.precision.recipe import BLOCKWISE, MXFP8, Fp8Recipe
from tests.precision.emulated_kernels import EmulatedScaledMM

RECIPES = [BLOCKWISE, MXFP8]


def test_fprop_hand_computed():
    # x = [1, 300]: tile amax 300 -> s = 300/448; 1/s = 1.4933 rounds to 1.5 (E4M3 step 1/8 in [1, 2)), so x is
    # read as [1.5 * 300/448, 300]. W = [[1, 1]] is exact. y = 1.5 * 300 / 448 + 300.
    x = torch.tensor([[1.0, 300.0]])
    w = torch.tensor([[1.0, 1.0]])
    y = fp8_linear(x, w, BLOCKWISE)
    assert y.item() == pytest.approx(1.5 * 300 / 448 + 300, rel=1e-7)
    # MXFP8: amax 300 -> 2**(8 - 8) = 1; 300 rounds to 288 (step 32 in [256, 512)), 1 stays 1: y = 289.
    assert fp8_linear(x, w, MXFP8).item() == 289.0


def _reference_grads(x, w, dy, r: Fp8Recipe):
    """The three GEMMs written out from the recipe table (docs/fp8.md)."""
    wf = fake_quantise(w, r.weight_fprop_tile, r.fmt)
    wd = fake_quantise(w, r.weight_dgrad_tile, r.fmt)
    xf = fake_quantise(x, r.row_tile, r.fmt)
    y = xf @ wf.t()
    dx = fake_quantise(dy, r.row_tile, r.fmt) @ wd
    x_w = xf if r.requantise_saved_input else x  # DeepSeek re-quantises its cached FP8 copy of x
    dw = fake_quantise(dy, r.col_tile, r.fmt).t() @ fake_quantise(x_w, r.col_tile, r.fmt)
    return y, dx, dw


@pytest.mark.parametrize("r", RECIPES, ids=lambda r: r.name)
def test_linear_forward_and_both_backward_gemms_equal_reference(r: Fp8Recipe):
    torch.manual_seed(0)
    M, K, N = 200, 300, 136  # none a multiple of 128: edge tiles in every dim
    x = (torch.randn(M, K) * torch.logspace(-2, 2, K)).requires_grad_()
    w = (torch.randn(N, K) * 0.05).requires_grad_()
    dy = torch.randn(M, N) * torch.logspace(-6, -2, M).unsqueeze(1)
    y = Fp8LinearFunction.apply(x, w, r)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _reference_grads(x.detach(), w.detach(), dy, r)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-5, atol=1e-5 * dx_ref.abs().max().item())
    torch.testing.assert_close(w.grad, dw_ref, rtol=1e-5, atol=1e-5 * dw_ref.abs().max().item())
    # Close to the exact GEMMs (E4M3 keeps ~2**-4 relative per element; the errors average out in a sum).
    for got, exact in ((y, x.detach() @ w.detach().t()), (x.grad, dy @ w.detach()), (w.grad, dy.t() @ x.detach())):
        assert (got - exact).norm() / exact.norm() < 0.05


def test_wgrad_tiles_run_along_tokens():
    # One token with a huge gradient in column 0: with token-dim (128x1) tiles it coarsens only column 0 of the
    # other tokens; a per-token (1x128) tiling would instead coarsen the rest of that token's row.
    torch.manual_seed(0)
    M, K, N = 128, 8, 4
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    dy = torch.randn(M, N) * 1e-3
    dy[0, 0] = 1e4
    Fp8LinearFunction.apply(x, w, BLOCKWISE).backward(dy)
    x_w = fake_quantise(x.detach(), BLOCKWISE.row_tile, "fp32")
    col = fake_quantise(dy, (128, 1), "fp32").t() @ fake_quantise(x_w, (128, 1), "fp32")
    row = fake_quantise(dy, (1, 128), "fp32").t() @ fake_quantise(x_w, (128, 1), "fp32")
    torch.testing.assert_close(w.grad, col, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(w.grad, row, rtol=1e-3, atol=0)


def test_linear_under_autocast_returns_bf16_and_fp32_weight_grad():
    x = torch.randn(4, 16, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, BLOCKWISE)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 16, 32)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_aligned_layout_places_groups_at_multiples():
    counts = [5, 0, 33, 32]
    tpe = torch.tensor(counts)
    n_rows = sum(counts) + 3  # 3 capacity-padding rows past the groups
    for host in (counts, None):
        lay = aligned_layout(tpe, n_rows, 32, host)
        assert lay.offs_E.tolist() == [32, 32, 32 + 64, 32 + 64 + 32]
        dest = lay.dest_S.tolist()
        assert dest[:5] == list(range(5)) and dest[5:38] == list(range(32, 65)) and dest[38:70] == list(range(96, 128))
        assert dest[70:] == [128, 129, 130] and lay.valid_S.tolist() == [True] * 70 + [False] * 3
        assert lay.n_rows >= 131 and lay.n_rows % 32 == 0 and len(set(dest)) == n_rows
    assert aligned_layout(tpe, n_rows, 32, counts).n_rows == 160  # 131 with host counts, rounded up to 32
    assert aligned_layout(tpe, n_rows, 32).n_rows == 73 + 4 * 31 + 27  # static bound, rounded up to 32


def _expert_reference(xe, we, dye, r: Fp8Recipe):
    """One expert's three GEMMs written out from the recipe table (recipe.py): "rowwise" experts scale x and dy
    per token row and W per output row (fprop) / per input column (dgrad), the wgrad's dy and x per column over the
    expert's own tokens; "tiles" experts are the FP8 linear's GEMMs."""
    if r.expert_scaling == "tiles":
        xe, we = xe.clone().requires_grad_(), we.clone().requires_grad_()
        ye = Fp8LinearFunction.apply(xe, we, r)
        ye.backward(dye)
        return ye.detach(), xe.grad, we.grad
    row, col = r.expert_row_tile, r.expert_col_tile
    ye = fake_quantise(xe, row, r.fmt) @ fake_quantise(we, row, r.fmt).t()
    dxe = fake_quantise(dye, row, r.fmt) @ fake_quantise(we, col, r.fmt)
    dwe = fake_quantise(dye, col, r.fmt).t() @ fake_quantise(xe, col, r.fmt)
    return ye, dxe, dwe


@pytest.mark.parametrize("r", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("host_counts", [True, False])
def test_grouped_gemm_equals_per_expert_gemms(r: Fp8Recipe, host_counts: bool):
    torch.manual_seed(0)
    counts = [70, 0, 130, 3]
    E, K, N = len(counts), 96, 40
    S = sum(counts) + 5  # trailing capacity-padding rows, which must give zero and carry no gradient
    x = torch.randn(S, K) * 3
    x[sum(counts):] = float("nan")  # padding rows' contents never reach a result
    w = torch.randn(E, N, K) * 0.1
    dy = torch.randn(S, N)
    tpe = torch.tensor(counts)
    lay = aligned_layout(tpe, S, r.group_align, counts if host_counts else None)
    xa = to_aligned(x, lay).requires_grad_()
    wg = w.clone().requires_grad_()
    y = fp8_grouped_mm(xa, wg, lay.offs_E, r)
    assert not torch.isnan(y).any()
    y.backward(to_aligned(dy, lay))
    assert not torch.isnan(xa.grad).any() and not torch.isnan(wg.grad).any()
    start = 0
    for e, c in enumerate(counts):
        ye, dxe, dwe = _expert_reference(x[start:start + c], w[e], dy[start:start + c], r)
        rows = lay.dest_S[start:start + c]
        torch.testing.assert_close(y[rows], ye, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xa.grad[rows], dxe, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wg.grad[e], dwe, rtol=1e-5, atol=1e-6)
        start += c
    assert wg.grad[1].abs().max() == 0  # the empty expert
    pad = torch.ones(lay.n_rows, dtype=torch.bool)
    pad[lay.dest_S[:sum(counts)]] = False
    assert (y[pad] == 0).all() and (xa.grad[pad] == 0).all()


def test_expert_swiglu_padding_rows_are_zero_and_finite():
    torch.manual_seed(0)
    counts = [10, 0, 50]
    S = sum(counts) + 4
    x = torch.randn(S, 64, requires_grad=True)
    w13 = torch.randn(3, 2 * 32, 64, requires_grad=True)
    w2 = torch.randn(3, 64, 32, requires_grad=True)
    y = fp8_expert_swiglu(x, w13, w2, torch.tensor(counts), BLOCKWISE, torch.float32)
    assert y.shape == (S, 64) and (y[sum(counts):] == 0).all() and not torch.isnan(y).any()
    y.sum().backward()
    assert (x.grad[sum(counts):] == 0).all() and torch.isfinite(w13.grad).all() and torch.isfinite(w2.grad).all()


def test_cpu_rowwise_fast_path_equals_reference():
    from moetrain.precision.gemm import cpu_rowwise_kernel

    if not cpu_rowwise_kernel():
        assert scaled_mm_fast(quantise(torch.randn(8, 96), (1, 128)), quantise(torch.randn(8, 96), (1, 128))) is None
        pytest.skip("this torch has no CPU kernel for row-wise scaled_mm (torch 2.11); scaled_mm_fast returns None")
    torch.manual_seed(0)
    a = quantise(torch.randn(64, 96), (1, 128), "fp32")  # K = 96 <= 128: one scale per row
    b = quantise(torch.randn(40, 96), (128, 128), "fp32")
    fast = scaled_mm_fast(a, b)
    assert fast is not None
    ref = fp8_mm_reference(a, b)
    assert (fast - ref).abs().max() <= fp32_sum_rtol(96) * ref.abs().max()  # fp32 accumulation on CPU
    # Block scales along K are not row-wise: no CPU kernel, so no fast path.
    assert scaled_mm_fast(quantise(torch.randn(64, 256), (1, 128)), quantise(torch.randn(40, 256), (128, 128))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("r", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("M,K,N", [(256, 512, 384), (1024, 768, 768), (300, 200, 136)])
def test_cuda_fast_path_equals_reference_in_all_three_gemms(r: Fp8Recipe, M: int, K: int, N: int):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x, w, dy = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev), torch.randn(M, N, device=dev)
    wq = quantise(w, r.weight_fprop_tile, r.fmt)
    wd = wq if r.weight_block else quantise(w, r.weight_dgrad_tile, r.fmt)
    gemms = {"fprop": (quantise(x, r.row_tile, r.fmt), wq),
             "dgrad": (quantise(dy, r.row_tile, r.fmt), operand_t(wd)),
             "wgrad": (quantise(dy.t(), r.row_tile, r.fmt), quantise(x.t(), r.row_tile, r.fmt))}
    for name, (a, b) in gemms.items():
        fast = scaled_mm_fast(a, b)
        if fast is None:
            pytest.skip(f"no {r.name} scaled_mm on {torch.cuda.get_device_name(dev)}")
        ref = fp8_mm_reference(a, b)
        assert (fast - ref).abs().max() <= fast_path_rtol() * ref.abs().max(), name


@pytest.mark.parametrize("M,K,N", [(64, 768, 768), (64, 128, 384), (48, 200, 136), (32, 384, 576)])
def test_blockwise_scale_layouts_put_each_scale_on_its_block(monkeypatch, M, K, N):
    # The fake-CUDA tests check shapes and strides; this reads the scale values where cuBLAS reads them, so a
    # scale put on the wrong block (right shape, wrong place) fails. Scales vary per block and per row.
    from moetrain.precision import gemm

    emu = EmulatedScaledMM()
    monkeypatch.setattr(gemm, "F", emu)
    monkeypatch.setattr(gemm, "blockwise_kernel", lambda device: True)
    torch.manual_seed(0)
    x = torch.randn(M, K) * torch.logspace(-2, 2, K)
    w = torch.randn(N, K) * torch.logspace(1, -1, N).unsqueeze(1)
    dy = torch.randn(M, N) * torch.logspace(-3, 1, M).unsqueeze(1)
    wq = quantise(w, (128, 128))
    for a, b in ((quantise(x, (1, 128)), wq), (quantise(dy, (1, 128)), operand_t(wq)),
                 (quantise(dy.t(), (1, 128)), quantise(x.t(), (1, 128)))):
        fast = scaled_mm_fast(a, b)
        ref = fp8_mm_reference(a, b)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert emu.calls == 3


def test_grouped_reference_is_the_autograd_path_on_cpu():
    # grouped_reference (what a GPU check compares the kernels with) against the CPU autograd function
    from moetrain.precision.grouped import grouped_reference

    torch.manual_seed(0)
    counts = [40, 0, 7, 100]
    lay = aligned_layout(torch.tensor(counts), sum(counts), BLOCKWISE.group_align, counts)
    x = to_aligned(torch.randn(sum(counts), 64), lay).requires_grad_()
    w = torch.randn(4, 48, 64, requires_grad=True)
    dy = to_aligned(torch.randn(sum(counts), 48), lay)
    y = fp8_grouped_mm(x, w, lay.offs_E, BLOCKWISE)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = grouped_reference(x.detach(), w.detach(), lay.offs_E, dy, BLOCKWISE)
    for got, want in ((y, y_ref), (x.grad, dx_ref), (w.grad, dw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
