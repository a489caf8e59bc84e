"""Rows past sum(tokens_per_expert) (capacity padding) give zero output, so their input gradient must be zero too.

Found in review: ``_GroupedMM.backward`` computed grad_x with ``torch._grouped_mm``, which leaves rows past the last
offset unwritten, so those rows of x.grad held uninitialised memory (often huge values or NaN); the exact loop path
gives zeros. No caller in ``src`` passes trailing padding rows today (``pad_to_capacity`` pads per expert), so this
is latent, but it breaks the documented contract of ``grouped_mm`` / ``GroupedExperts.forward``.
``_GroupedMM.backward`` now zeroes those rows as the forward does; this test keeps it that way.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.model.experts import grouped_mm


@pytest.mark.parametrize("counts, pad", [([3, 3, 3, 3], 4), ([0, 0, 0, 0], 3), ([5, 0, 2, 1], 6)])
def test_padding_rows_get_zero_input_gradient(counts, pad):
    torch.manual_seed(0)
    n = sum(counts)
    ok = True
    for _ in range(5):  # uninitialised memory is sometimes zero by chance: retry with freed NaN memory around
        junk = torch.full((1 << 16,), float("nan"))
        del junk
        x = torch.randn(n + pad, 16, requires_grad=True)
        w = torch.randn(len(counts), 8, 16, requires_grad=True)
        y = grouped_mm(x, w, torch.tensor(counts), counts)
        assert torch.equal(y[n:], torch.zeros_like(y[n:]))  # forward contract holds
        y.sum().backward()
        ok &= bool(torch.equal(x.grad[n:], torch.zeros_like(x.grad[n:])))
    assert ok, "input gradient of padding rows is not zero"
