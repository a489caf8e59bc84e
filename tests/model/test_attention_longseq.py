"""MLA attention runs on SDPA's fused (flash) kernel, so its memory is linear in the sequence length, and it computes
exactly the causal softmax attention of the unpadded q, k, v with the configured softmax scale."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moetrain.model.deepseek.attention import MLA
from moetrain.model.config import get_preset, tiny
from moetrain.model.layers import apply_rope, rope_cos_sin

# (q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim): tiny's dims (qk 48 != v 32), plain q_proj,
# qk == v (32, no pad), and qk 20 / v 16 (neither a multiple of 8).
CONFIGS = [(64, 32, 16, 32), (0, 32, 16, 32), (64, 16, 16, 32), (0, 12, 8, 16)]


def _mla(q_lora: int, nope: int, rope: int, v: int) -> tuple[MLA, object]:
    cfg = tiny().replace(q_lora_rank=q_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    torch.manual_seed(0)
    return MLA(cfg), cfg


def _reference(mla: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The MLA forward in float64 with an explicit masked softmax over the unpadded heads."""
    B, L, _ = x.shape
    H, Dn, R, Dv = mla.n_heads, mla.nope_dim, mla.rope_dim, mla.v_dim
    if mla.q_lora_rank:
        q = mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x)))
    else:
        q = mla.q_proj(x)
    q_nope, q_rope = q.view(B, L, H, Dn + R).split([Dn, R], dim=-1)
    q = torch.cat([q_nope, apply_rope(q_rope, cos, sin, mla.interleave)], dim=-1)
    kv_lat, k_rope = mla.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, R], dim=-1)
    k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, mla.interleave).expand(B, L, H, R)
    k_nope, v = mla.kv_b_proj(mla.kv_a_layernorm(kv_lat)).view(B, L, H, Dn + Dv).split([Dn, Dv], dim=-1)
    k = torch.cat([k_nope, k_rope], dim=-1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * mla.softmax_scale
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return mla.o_proj(out.reshape(B, L, H * Dv))


@pytest.mark.parametrize("dims", CONFIGS, ids=lambda d: "q%d-qk%d-v%d" % (d[0], d[1] + d[2], d[3]))
@pytest.mark.parametrize("L", [1, 13, 64])
def test_mla_matches_explicit_softmax_attention(dims: tuple[int, int, int, int], L: int) -> None:
    mla, cfg = _mla(*dims)
    ref = _mla(*dims)[0].double()
    cos, sin = rope_cos_sin(cfg, L)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, L, cfg.dim, generator=gen)
    g = torch.randn(2, L, cfg.dim, generator=gen)

    x1 = x.clone().requires_grad_()
    out = mla(x1, cos, sin)
    (out * g).sum().backward()
    x2 = x.double().requires_grad_()
    expect = _reference(ref, x2, cos.double(), sin.double())
    (expect * g.double()).sum().backward()

    assert mla.softmax_scale == cfg.softmax_scale != cfg.qk_head_dim ** -0.5  # YaRN mscale: not SDPA's default
    torch.testing.assert_close(out, expect.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad.float(), rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(mla.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad.float(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("preset", ["tiny", "small", "deepseek-v3-671b"])
def test_mla_runs_on_the_flash_kernel(preset: str) -> None:
    # The preset's head dims on a narrow model; with the math kernel excluded SDPA raises "No available kernel".
    cfg = get_preset(preset).replace(dim=64, n_heads=2, q_lora_rank=32, kv_lora_rank=32, max_seq_len=64)
    assert cfg.qk_head_dim != cfg.v_head_dim
    mla = MLA(cfg)
    cos, sin = rope_cos_sin(cfg, 24)
    x = torch.randn(1, 24, cfg.dim, requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        mla(x, cos, sin).sum().backward()
    assert x.grad is not None


_MEMORY_PROBE = textwrap.dedent("""
    import json, torch
    from moetrain.model.deepseek.attention import MLA
    from moetrain.model.config import tiny
    from moetrain.model.layers import rope_cos_sin
    torch.set_num_threads(2)
    L = {L}
    cfg = tiny().replace(max_seq_len=L)
    mla = MLA(cfg)
    cos, sin = rope_cos_sin(cfg, L)
    x = torch.randn(1, L, cfg.dim, requires_grad=True)
    def status(key):  # kiB -> bytes
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    mla(x[:, :64], cos[:64], sin[:64]).sum().backward()  # warm up at a short length
    before = status("VmRSS:")
    mla(x, cos, sin).sum().backward()
    print(json.dumps({{"growth": status("VmHWM:") - before}}))
""")


def test_mla_memory_is_far_below_the_score_matrix() -> None:
    # In a fresh process, and VmHWM rather than ru_maxrss: a child's ru_maxrss starts at the forking parent's RSS.
    L, H = 4096, tiny().n_heads
    # One fp32 B x H x L x L tensor (B = 1): 256 MiB. The math kernel grows RSS by ~3 of them, the flash kernel by
    # ~40 MiB (activations linear in L).
    scores = L * L * H * 4
    res = subprocess.run([sys.executable, "-c", _MEMORY_PROBE.format(L=L)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    growth = json.loads(res.stdout.strip().splitlines()[-1])["growth"]
    assert growth < scores / 2, f"fwd+bwd of one MLA layer at L={L} grew RSS by {growth / 2**20:.0f} MiB"
