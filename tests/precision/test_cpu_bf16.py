"""CPU "bf16" GEMMs (moetrain.precision.cpu_bf16): fp32 GEMMs of the bf16 operands rounded to bf16 once agree with
torch's own bf16 kernels within the stated bound, keep bf16 outputs and autograd, reach the backward GEMMs, and
leave fp32 GEMMs (the FP8 reference included) untouched."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from moetrain.model.config import get_preset
from moetrain.model.transformer import build_model
from moetrain.precision import BLOCKWISE
from moetrain.precision.cpu_bf16 import (EMULATED_GEMMS, EMULATION_RTOL, EmulatedBf16Gemms, cpu_bf16_gemms,
                                         suspended)
from moetrain.precision.linear import Fp8Linear

BF = torch.bfloat16


def _assert_within_bound(got: torch.Tensor, want: torch.Tensor, abs_prod: torch.Tensor, K: int) -> None:
    """|got - want| <= EMULATION_RTOL * max(|got|, |want|) + 2 K 2**-24 (|A| @ |B|), elementwise."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    bound = EMULATION_RTOL * torch.maximum(g.abs(), w.abs()) + 2 * K * 2.0 ** -24 * abs_prod
    assert ((g - w).abs() <= bound).all(), ((g - w).abs() - bound).max()


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF)


@pytest.mark.parametrize("M,K,N", [(48, 32, 40), (33, 2048, 17), (64, 130, 96)])
def test_mm_addmm_match_torch_bf16(M, K, N):
    torch.manual_seed(0)
    a, b, bias = _bf16(M, K), _bf16(K, N), _bf16(N)
    abs_prod = a.double().abs() @ b.double().abs()
    with EmulatedBf16Gemms():
        mm, addmm = torch.mm(a, b), torch.addmm(bias, a, b)
        mm_t = torch.mm(a, b.t().contiguous().t())  # a strided operand, as backward GEMMs get them
    # the definition: one fp32 GEMM of the bf16 values, one rounding
    assert torch.equal(mm, (a.float() @ b.float()).to(BF))
    _assert_within_bound(mm, torch.mm(a, b), abs_prod, K)
    _assert_within_bound(mm_t, torch.mm(a, b), abs_prod, K)
    _assert_within_bound(addmm, torch.addmm(bias, a, b), abs_prod + bias.double().abs(), K + 1)


def test_bmm_baddbmm_match_torch_bf16():
    torch.manual_seed(1)
    a, b, c = _bf16(4, 24, 256), _bf16(4, 256, 20), _bf16(4, 24, 20)
    abs_prod = a.double().abs() @ b.double().abs()
    with EmulatedBf16Gemms():
        bmm, baddbmm = torch.bmm(a, b), torch.baddbmm(c, a, b)
    _assert_within_bound(bmm, torch.bmm(a, b), abs_prod, 256)
    _assert_within_bound(baddbmm, torch.baddbmm(c, a, b), abs_prod + c.double().abs(), 257)


def test_grouped_mm_matches_torch_bf16():
    torch.manual_seed(2)
    E, K, N = 4, 128, 64
    counts = [5, 0, 17, 10]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w, dy = _bf16(sum(counts), K), _bf16(E, N, K), _bf16(sum(counts), N)
    with EmulatedBf16Gemms():
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        dw = torch._grouped_mm(dy.t(), x, offs=offs)  # the routed experts' weight gradient: contraction over rows
        y32 = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.float32)
    want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    groups = torch.split(torch.arange(sum(counts)), counts)
    abs_y = torch.cat([x[g].double().abs() @ w[e].double().abs().t() for e, g in enumerate(groups)])
    _assert_within_bound(y, want, abs_y, K)
    assert y32.dtype == torch.float32 and torch.allclose(y32.to(BF).float(), y.float())
    abs_dw = torch.stack([dy[g].double().abs().t() @ x[g].double().abs() for g in groups])
    _assert_within_bound(dw, torch._grouped_mm(dy.t(), x, offs=offs), abs_dw, max(counts))


class _Counting(EmulatedBf16Gemms):
    """Records the GEMMs it reroutes (those whose result comes back from an fp32 GEMM)."""

    def __init__(self):
        super().__init__()
        self.gemms: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in EMULATED_GEMMS:
            floats = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)
                      and a.is_floating_point()]
            if all(a.dtype == BF for a in floats):
                self.gemms.append(func.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_linear_under_autocast_keeps_dtypes_and_reaches_backward_gemms():
    torch.manual_seed(3)
    lin = nn.Linear(256, 96)
    x = torch.randn(40, 256, requires_grad=True)

    def run(mode):
        lin.zero_grad()
        x.grad = None
        with mode:  # around the backward too, as the trainer enters it
            with torch.autocast("cpu", dtype=BF):
                y = lin(x)
            y.float().pow(2).sum().backward()
        return y, x.grad.clone(), lin.weight.grad.clone()

    counting = _Counting()
    y_e, dx_e, dw_e = run(counting)
    y_t, dx_t, dw_t = run(contextlib.nullcontext())  # torch's bf16 kernels
    assert y_e.dtype == BF and dx_e.dtype == torch.float32 and dw_e.dtype == torch.float32
    # forward addmm, then dgrad and wgrad mm: all three GEMMs ran emulated
    assert counting.gemms == ["addmm.default", "mm.default", "mm.default"]
    assert (y_e.float() - y_t.float()).abs().max() <= 2 * EMULATION_RTOL * y_t.float().abs().max()
    for e, t in ((dx_e, dx_t), (dw_e, dw_t)):
        assert (e - t).abs().max() <= 2 * EMULATION_RTOL * t.abs().max()


def test_fp32_and_fp8_gemms_pass_through_bit_for_bit():
    torch.manual_seed(4)
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    lin = nn.Linear(128, 64, bias=False)
    fp8 = copy.deepcopy(lin)
    fp8.__class__ = Fp8Linear
    fp8.fp8_recipe = BLOCKWISE
    x = torch.randn(16, 128)
    with torch.autocast("cpu", dtype=BF):
        ref8 = fp8(x)
    counting = _Counting()
    with counting:
        mm = a @ b
        with torch.autocast("cpu", dtype=BF):
            got8 = fp8(x)
    assert torch.equal(mm, torch.mm(a, b)) and torch.equal(got8, ref8) and got8.dtype == BF
    assert counting.gemms == []


def test_suspended_lifts_only_an_innermost_emulation():
    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    a = _bf16(8, 8)
    with EmulatedBf16Gemms() as emu:
        with suspended():
            assert _get_current_dispatch_mode() is None
            assert torch.equal(a @ a, torch.mm(a, a))  # torch's own kernel while lifted
        assert _get_current_dispatch_mode() is emu
        with Spy() as spy, suspended():
            torch.ones(2).add(1)
            assert _get_current_dispatch_mode() is spy
    assert "add.Tensor" in seen
    with suspended():  # no mode at all
        assert _get_current_dispatch_mode() is None


def test_cpu_bf16_gemms_only_for_cpu_bf16():
    assert isinstance(cpu_bf16_gemms("cpu", torch.bfloat16), EmulatedBf16Gemms)
    for dev, dt in (("cpu", None), ("cpu", torch.float32), ("cuda", torch.bfloat16)):
        assert not isinstance(cpu_bf16_gemms(dev, dt), EmulatedBf16Gemms)


def test_tiny_model_step_matches_torch_bf16():
    """A forward and backward of the tiny model (MLA, routed experts' grouped GEMMs, MTP) under bf16 autocast.
    The GEMM emulation alone gives torch's bf16 loss and gradients to bf16 accuracy; with the attention core
    emulated too (the default), the loss still does, and the gradients are as close to the fp32 step's as
    torch's bf16 kernels' are (bf16 at initialisation is itself ~11% from fp32 here, so the two bf16 runs
    differ by more than the GEMM emulation alone does)."""
    torch.manual_seed(5)
    cfg = get_preset("tiny")
    cfg.vocab_size = 256
    model = build_model(cfg, device="cpu")
    tok = torch.randint(0, 256, (2, 32))
    lab = torch.randint(0, 256, (2, 32))

    def run(mode, amp=True):
        m = copy.deepcopy(model)
        with mode:
            with torch.autocast("cpu", dtype=BF, enabled=amp):
                out = m(tok, lab)
            out.loss(cfg).backward()
        return out.loss(cfg).item(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    _, g_32 = run(contextlib.nullcontext(), amp=False)
    loss_t, g_t = run(contextlib.nullcontext())
    loss_g, g_g = run(EmulatedBf16Gemms(attention=False))
    assert abs(loss_g - loss_t) <= 1e-3 * abs(loss_t)
    assert (g_g - g_t).norm() <= 2e-2 * g_t.norm()
    loss_e, g_e = run(EmulatedBf16Gemms())
    assert abs(loss_e - loss_t) <= 1e-3 * abs(loss_t)
    assert (g_e - g_32).norm() <= 1.25 * (g_t - g_32).norm()


def test_attention_core_matches_torch_bf16():
    """SDPA's CPU flash kernel under the mode: fp32 kernel on the bf16 values, bf16 out and gradients, fp32
    logsumexp; within bf16 accuracy of torch's own bf16 kernel (they differ by where the probabilities round)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 40, 24).to(BF).requires_grad_() for _ in range(3))
    attn = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with EmulatedBf16Gemms():
        out_e, lse_e = attn(q, k, v, 0.0, True, scale=0.2)
    out_t, lse_t = attn(q, k, v, 0.0, True, scale=0.2)
    assert out_e.dtype == BF and lse_e.dtype == lse_t.dtype == torch.float32
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           scale=0.2)
    # one bf16 rounding of the output each (2**-8 of |out| <= max |v|), plus fp32 accumulation
    tol = 2.0 ** -8 * v.detach().abs().max().item()
    assert (out_e.double() - ref).abs().max() <= tol and (out_t.double() - ref).abs().max() <= 2 * tol
    assert torch.allclose(lse_e, lse_t, rtol=1e-2, atol=1e-2)

    g = torch.randn_like(out_e)

    def grads(mode):
        with mode:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
            return torch.autograd.grad(out, (q, k, v), g)

    ge, gt = grads(EmulatedBf16Gemms()), grads(contextlib.nullcontext())
    for a, b in zip(ge, gt):
        assert a.dtype == BF
        assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()
