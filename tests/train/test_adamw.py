"""The reduced-precision optimizer states (``moetrain.train.adamw``): fp32 moments are torch's AdamW bit for bit,
bf16 moments are torch's update with the moments rounded to bf16 after each step, and a bf16 weight with its 16-bit
remainder is its fp32 master exactly."""

from __future__ import annotations

import pytest
import torch

from moetrain.train.adamw import PrecisionAwareAdamW, join_master, split_master, state_bytes_per_param


def _problem(seed: int = 0, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(7, 5, generator=g), torch.randn(11, generator=g) * 3]
    grads = [[torch.randn(w.shape, generator=g) * (10.0 ** -k) for w in w0] for k in range(n)]
    return w0, grads


def _run(opt_cls, w0, grads, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = opt_cls([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone().to(p.dtype)
        opt.step()
    return params, opt


def test_fp32_moments_are_torchs_adamw_bit_for_bit():
    w0, grads = _problem()
    ref, _ = _run(torch.optim.AdamW, w0, grads, foreach=False)
    ours, _ = _run(PrecisionAwareAdamW, w0, grads, moment_dtype=torch.float32)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)


def test_bf16_moments_round_the_moments_after_each_step():
    """Reference: torch's AdamW with its moments replaced by their bf16 rounding after every step."""
    w0, grads = _problem(1)
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        ref.step()
        for p in params:
            for k in ("exp_avg", "exp_avg_sq"):
                ref.state[p][k].copy_(ref.state[p][k].bfloat16().float())
    params2 = [torch.nn.Parameter(w.clone()) for w in w0]
    opt2 = PrecisionAwareAdamW(params2, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for gs in grads:
        for p, g in zip(params2, gs):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[b][k].dtype == torch.bfloat16
            assert torch.equal(opt2.state[b][k].float(), ref.state[a][k])


@pytest.mark.parametrize("values", [
    [0.0, -0.0, 1.0, -1.0, 1e-30, -3.3e-38, 1e38, -1e38, 0.1, -0.1, 3.14159265],
    "random",
])
def test_split_and_join_master_are_exact(values):
    if values == "random":
        g = torch.Generator().manual_seed(0)
        x = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 10)
        # ties: the low 16 bits exactly 0x8000
        ties = (torch.randint(0, 2 ** 15, (1000,), generator=g, dtype=torch.int32) << 16) | 0x8000
        x = torch.cat([x, ties.view(torch.float32), -ties.view(torch.float32)])
    else:
        x = torch.tensor(values, dtype=torch.float32)
    w, r = split_master(x)
    assert w.dtype == torch.bfloat16 and r.dtype == torch.int16
    assert torch.equal(join_master(w, r).view(torch.int32), x.view(torch.int32))
    # the weight is the master rounded to nearest: as close as torch's own (round-to-nearest-even) conversion
    # (NaN bit patterns among the ties only need to come back whole, checked above)
    finite = torch.isfinite(x)
    assert torch.equal((w.float() - x).abs()[finite], (x.bfloat16().float() - x).abs()[finite])


def test_bf16_weights_keep_the_exact_fp32_master():
    """bf16 parameters + remainder follow the fp32-parameter run with bf16 moments exactly (same master values),
    from the same bf16-representable start, given the same (bf16) gradients."""
    w0, grads = _problem(2)
    w0 = [w.bfloat16().float() for w in w0]
    grads = [[g.bfloat16().float() for g in gs] for gs in grads]
    fp32, _ = _run(PrecisionAwareAdamW, w0, grads, moment_dtype=torch.bfloat16)
    params = [torch.nn.Parameter(w.bfloat16()) for w in w0]
    opt = PrecisionAwareAdamW([{"params": params[:1], "weight_decay": 0.1},
                               {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.bfloat16()
        opt.step()
    for ref, p in zip(fp32, params):
        assert p.dtype == torch.bfloat16
        assert torch.equal(opt.master(p), ref.detach())
        assert torch.equal(p.detach(), split_master(ref.detach())[0])
    # without the remainder the bf16 weights would have drifted from the master
    assert not all(torch.equal(p.detach().float(), r.detach()) for p, r in zip(params, fp32))


def test_state_bytes_per_param_are_the_planners():
    """plan/model/memory.py: fp32 states 12 bytes (4 master + 8 moments), bf16-moments 8, bf16 6."""
    assert 4 + state_bytes_per_param(torch.float32, None) == 12
    assert 4 + state_bytes_per_param(torch.float32, torch.bfloat16) == 8
    assert state_bytes_per_param(torch.bfloat16, torch.bfloat16) == 6


def test_unsupported_parameter_dtype_is_refused():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        PrecisionAwareAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])
