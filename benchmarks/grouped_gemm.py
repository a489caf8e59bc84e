"""Expert compute efficiency: moetrain's routed-expert GEMMs against the practical limit of this machine.

Work: the routed experts of one MoE layer of the preset (``GroupedExperts``: w1 and w3 (D -> F), SiLU*mul, w2
(F -> D)) on the S = T*K rows one micro-batch routes to them, grouped by expert with realistic counts (the counts
moetrain's router produces for random hidden states at init, learned routing; also perfectly balanced counts).

Limit: ONE plain matmul with the same total FLOPs, (S x D) @ (D x 3F), forward and forward+backward (autograd;
backward = two more matmuls of the same size). A dense SwiGLU of width F on the same S rows (three plain matmuls
and the same elementwise work) is reported too. Ratio = achieved FLOP/s of the experts / FLOP/s of the matmul.

Variants: ``grouped_mm`` (torch._grouped_mm, moetrain's default), ``+patch`` (the same with the proposed patches of
:mod:`patches`), ``loop`` (moetrain's exact per-expert loop, ``use_grouped_mm=False``). All variants live in one
process and are timed round-robin (one sample of each per round, median over rounds), so that a burst of load from
another process hits every variant alike.
"""

from __future__ import annotations

from typing import Any

from common import Settings, autocast, run_isolated, setup_process


def _counts(cfg, s, kind: str):
    """Rows per expert for one micro-batch of T tokens.

    "balanced": T*K/E each. "routed": moetrain's router (learned routing, init weights) on random hidden states.
    "model-init": the most skewed MoE layer of the whole preset model at init on the suite's token batch -- what a
    first training step meets (hidden states of real tokens are correlated, so a few experts take 2-4x the mean).
    """
    import torch

    from moetrain.model.moe import Router
    E, T, device = cfg.n_routed_experts, s.batch * s.seq_len, s.device
    if kind == "balanced":
        return torch.full((E,), T * cfg.top_k // E, dtype=torch.int64, device=device)
    torch.manual_seed(0)
    if kind == "routed":
        r = Router(cfg)
        with torch.no_grad():
            r.weight.normal_(0.0, cfg.init_std)
            idx = r(torch.randn(T, cfg.dim)).topk_idx_TK
        return torch.bincount(idx.reshape(-1), minlength=E).to(device)
    from common import batch_tokens
    from moetrain.model.transformer import build_model
    model = build_model(cfg, seed=0)
    x, _ = batch_tokens(s.__class__.from_dict({**s.to_dict(), "device": "cpu"}), cfg.vocab_size)
    with torch.no_grad():
        stats = model(x).moe_stats
    worst = max((st.tokens_per_expert_E for st in stats), key=lambda c: int(c.max()))
    return worst.to(torch.int64).to(device)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import statistics
    import time

    import torch

    import patches as P
    from common import sync
    from moetrain.model.layers import SwiGLU
    from moetrain.model.experts import GroupedExperts
    from peers import bench_config

    s = Settings.from_dict(spec["settings"])
    setup_process(s)
    patch_names = spec.get("patches", [])
    cfg = bench_config(s.preset)
    dev = s.device
    T = s.batch * s.seq_len
    E, D, Fh = cfg.n_routed_experts, cfg.dim, cfg.expert_ffn_dim
    out: dict[str, Any] = {"E": E, "D": D, "F": Fh, "tokens": T, "top_k": cfg.top_k, "rows": [],
                           "method": "round-robin: every variant timed once per round, median over rounds"}
    torch.manual_seed(0)
    with torch.device(dev):
        experts = GroupedExperts(E, D, Fh)
        swiglu = SwiGLU(D, Fh)
    with torch.no_grad():
        for p in list(experts.parameters()) + list(swiglu.parameters()):
            p.normal_(0.0, cfg.init_std)
    experts_p = experts
    if patch_names:  # the patched module (a patch may change the parameter layout), same weights
        with P.patched(patch_names), torch.device(dev):
            experts_p = GroupedExperts(E, D, Fh)
            with torch.no_grad():
                for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
                    getattr(experts_p, name).copy_(getattr(experts, name))
    w = (torch.randn(D, 3 * Fh, device=dev) * cfg.init_std).requires_grad_(True)
    kinds = ("routed", "balanced", "model-init")
    counts = {k: _counts(cfg, s, k) for k in kinds}
    S = int(counts["routed"].sum())
    flops = 2.0 * S * D * Fh * 3  # forward FLOPs of the three expert GEMMs; fwd+bwd = 3x
    x = torch.randn(S, D, device=dev)
    g = torch.randn(S, D, device=dev)
    gw = torch.randn(S, 3 * Fh, device=dev)

    def experts_fwd(mode: str, tag: str, module=experts):
        def f(t):
            module.use_grouped_mm = mode != "loop"
            return module(t, counts[tag])
        return f

    # (label, forward, parameters, patches, output gradient)
    variants = []
    for tag in kinds:
        variants.append((f"experts[grouped_mm] {tag}", experts_fwd("grouped_mm", tag), experts, [], g))
        if patch_names:
            variants.append((f"experts[grouped_mm] {tag} +patch", experts_fwd("grouped_mm", tag, experts_p),
                             experts_p, patch_names, g))
        variants.append((f"experts[loop] {tag}", experts_fwd("loop", tag), experts, [], g))
    variants.append(("plain matmul (S x D)@(D x 3F)", lambda t: t @ w, [w], [], gw))
    variants.append(("dense SwiGLU width F", swiglu, swiglu, [], g))

    def make(fwd, params, grad, backward: bool):
        plist = list(params.parameters()) if hasattr(params, "parameters") else list(params)

        def run():
            if not backward:
                with torch.no_grad(), autocast(s):
                    fwd(x)
                return
            xx = x.detach().requires_grad_(True)
            for p in plist:
                p.grad = None
            with autocast(s):
                y = fwd(xx)
            y.backward(grad)
        return run

    jobs = []
    for label, fwd, params, pn, grad in variants:
        for bwd in (False, True):
            jobs.append({"label": label, "bwd": bwd, "fn": make(fwd, params, grad, bwd), "patches": pn, "t": []})
    # warm up and calibrate: repeat each job k times per sample so that a sample lasts >= ~30 ms
    for j in jobs:
        with P.patched(j["patches"]):
            for _ in range(2):
                j["fn"]()
            sync(s)
            t0 = time.perf_counter()
            j["fn"]()
            sync(s)
            j["k"] = max(1, int(0.03 / max(time.perf_counter() - t0, 1e-6)))
    rounds = 5 if s.quick else 15
    for _ in range(rounds):
        for j in jobs:
            with P.patched(j["patches"]):
                sync(s)
                t0 = time.perf_counter()
                for _ in range(j["k"]):
                    j["fn"]()
                sync(s)
                j["t"].append((time.perf_counter() - t0) / j["k"])
    by = {}
    for j in jobs:
        by.setdefault(j["label"], {})["fwd_bwd_s" if j["bwd"] else "fwd_s"] = statistics.median(j["t"])
    for label, r in by.items():
        out["rows"].append({"label": label, **r, "fwd_flops_per_s": flops / r["fwd_s"],
                            "fwd_bwd_flops_per_s": 3 * flops / r["fwd_bwd_s"], "flops_fwd": flops})
    out["counts"] = {k: c.tolist() for k, c in counts.items()}
    out["counts_routed"] = counts["routed"].tolist()
    out["S"] = S
    limit = by["plain matmul (S x D)@(D x 3F)"]
    out["ratios"] = {}
    for label, r in by.items():
        if label.startswith("experts["):
            out["ratios"][f"{label} fwd"] = limit["fwd_s"] / r["fwd_s"]
            out["ratios"][f"{label} fwd+bwd"] = limit["fwd_bwd_s"] / r["fwd_bwd_s"]
    return out


def run(s: Settings, patches: list[str], log=print) -> dict[str, Any]:
    r = run_isolated("grouped_gemm:child", {"settings": s.to_dict(), "patches": patches}, timeout=300)
    _log(r, log)
    return {"baseline": r}


def _log(r: dict[str, Any], log, only_experts: bool = False) -> None:
    if "error" in r:
        log(f"    ERROR {r['error'][:300]}")
        return
    for row in r["rows"]:
        if only_experts and not row["label"].startswith("experts["):
            continue
        log(f"    {row['label']:<40} fwd {row['fwd_flops_per_s'] / 1e9:8.1f} GFLOP/s   "
            f"fwd+bwd {row['fwd_bwd_flops_per_s'] / 1e9:8.1f} GFLOP/s")
