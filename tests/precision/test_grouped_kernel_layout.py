"""The routed experts' kernel path (grouped.RowwiseFp8GroupedMM with ``torch._scaled_grouped_mm``) on CPU, the
kernel replaced by an emulator that reads operands and scales where the CUDA kernel reads them
(tests/precision/emulated_kernels.py): fprop, dgrad and wgrad must equal ``grouped.grouped_reference`` by value,
so a scale put on the wrong row, column or expert (right shape, wrong place) fails, which the fake-CUDA tests
(shapes and strides only) cannot see. Scales vary over orders of magnitude per row, column and expert, so any
misplaced one moves a result far past the tolerance; the negative controls misplace them on purpose."""

from __future__ import annotations

import pytest
import torch

from moetrain.precision import grouped
from moetrain.precision.gemm import fp32_sum_rtol
from moetrain.precision.grouped import aligned_layout, fp8_grouped_mm, grouped_reference, to_aligned
from moetrain.precision.recipe import BLOCKWISE
from tests.precision.emulated_kernels import EmulatedScaledGroupedMM

COUNTS = [37, 0, 5, 130, 16, 1]  # uneven, one empty expert, groups not multiples of the 16-row alignment
E, K, N = len(COUNTS), 96, 48
S = sum(COUNTS) + 5  # capacity-padding rows past the groups
U = 2.0 ** -8  # bf16 unit roundoff: the kernel rounds its fp32 result to bf16 once


@pytest.fixture()
def kernel(monkeypatch):
    """Patch the emulator in where grouped.py calls the kernel, and the device gate to True; returns a factory
    taking EmulatedScaledGroupedMM's arguments."""
    def patch(**kw) -> EmulatedScaledGroupedMM:
        emu = EmulatedScaledGroupedMM(**kw)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", emu, raising=False)
        monkeypatch.setattr(grouped, "grouped_kernel", lambda device: True)
        return emu
    return patch


def _inputs():
    torch.manual_seed(0)
    lay = aligned_layout(torch.tensor(COUNTS), S, BLOCKWISE.group_align, COUNTS)
    x = torch.randn(S, K) * torch.logspace(-3, 3, S).unsqueeze(1) * torch.logspace(-2, 2, K)
    x[sum(COUNTS):] = 1e6  # capacity padding: dropped by to_aligned, must reach nothing
    w = torch.randn(E, N, K) * torch.logspace(-2, 2, E * N).view(E, N, 1) * torch.logspace(1, -1, K)
    dy = torch.randn(S, N) * torch.logspace(2, -2, S).unsqueeze(1) * torch.logspace(-1, 1, N)
    return lay, to_aligned(x, lay), w, to_aligned(dy, lay)


def _run(lay, x, w, dy):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(xg, wg, lay.offs_E, BLOCKWISE, torch.float32)
    y.backward(dy)
    return {"y": y.detach(), "dx": xg.grad, "dW": wg.grad}


def _excess(lay, x, w, dy, got) -> dict[str, float]:
    """max |got - ref| / bound per result; <= 1 passes. bound = U |ref| (the kernel's one bf16 rounding) + (1 + U)
    * 2 fp32_sum_rtol(P) * (the same sum over the magnitudes of the products, ``grouped_reference`` of |x|, |W|,
    |dy|: quantising commutes with abs), so a zero reference (padding rows, the empty expert) needs an exact 0."""
    ref = dict(zip(("y", "dx", "dW"), grouped_reference(x, w, lay.offs_E, dy, BLOCKWISE)))
    mag = dict(zip(("y", "dx", "dW"), grouped_reference(x.abs(), w.abs(), lay.offs_E, dy.abs(), BLOCKWISE)))
    out = {}
    for k in ref:
        bound = U * ref[k].abs() + (1 + U) * 2 * fp32_sum_rtol(x.shape[0]) * mag[k]
        err = (got[k] - ref[k]).abs()
        out[k] = (err / bound.clamp_min(1e-38)).max().item() if (err[bound == 0] == 0).all() else float("inf")
    return out


@pytest.mark.parametrize("empty_group", [0.0, float("nan")], ids=["empty-zero", "empty-unwritten"])
def test_rowwise_kernel_path_puts_every_scale_on_its_row_column_and_expert(kernel, empty_group):
    # empty-unwritten: were the kernel to leave an empty expert's block unwritten, grouped.py still gives dW = 0
    emu = kernel(empty_group=empty_group)
    lay, x, w, dy = _inputs()
    got = _run(lay, x, w, dy)
    assert emu.calls == ["2d3d", "2d3d", "2d2d"]  # fprop, dgrad, wgrad: no fallback GEMM
    excess = _excess(lay, x, w, dy, got)
    assert max(excess.values()) <= 1, excess
    assert (got["dW"][1] == 0).all()  # the empty expert
    tail = int(lay.offs_E[-1])  # rows past the groups: the emulator leaves them NaN, as the kernel leaves them
    assert (got["y"][tail:] == 0).all() and (got["dx"][tail:] == 0).all()


def _swap_groups_2d2d(sa, sb):
    # scale_a[g * M + m] read as scale_a[m * G + g]: (group, row) order taken for (row, group)
    return sa.view(-1, E).t().reshape(-1), sb.view(-1, E).t().reshape(-1)


MISPLACED = {
    "fprop/dgrad token-row scales reversed": ("2d3d", lambda sa, sb: (sa.flip(0), sb), ("y", "dx")),
    "fprop/dgrad weight scales, experts reversed": ("2d3d", lambda sa, sb: (sa, sb.flip(0)), ("y", "dx")),
    "fprop/dgrad weight scales, columns reversed": ("2d3d", lambda sa, sb: (sa, sb.flip(1)), ("y", "dx")),
    "wgrad scales (row, expert)-major": ("2d2d", _swap_groups_2d2d, ("dW",)),
    "wgrad x scales, experts shifted by one": ("2d2d", lambda sa, sb: (sa, sb.view(E, -1).roll(1, 0).reshape(-1)),
                                               ("dW",)),
}


@pytest.mark.parametrize("name", list(MISPLACED))
def test_a_misplaced_scale_fails_the_check(kernel, name):
    # negative control: the check above must see each way of putting a scale in the wrong place
    kind, perm, hit = MISPLACED[name]
    kernel(perturb=lambda k, sa, sb: perm(sa, sb) if k == kind else (sa, sb))
    lay, x, w, dy = _inputs()
    excess = _excess(lay, x, w, dy, _run(lay, x, w, dy))
    for k in ("y", "dx", "dW"):
        assert (excess[k] > 100) if k in hit else (excess[k] <= 1), (name, excess)
