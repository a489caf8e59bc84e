"""Expert compute efficiency: moetrain's routed-expert GEMMs against the practical limit of this machine.

Work: the routed experts of one MoE layer of the preset (``GroupedExperts``: w1 and w3 (D -> F), SiLU*mul, w2
(F -> D)) on the S = T*K rows one micro-batch routes to them, grouped by expert with realistic counts (the counts
moetrain's router produces for random hidden states at init, learned routing; also perfectly balanced counts).

Limit: ONE plain matmul with the same total FLOPs, (S x D) @ (D x 3F), forward and forward+backward (autograd;
backward = two more matmuls of the same size). A dense SwiGLU of width F on the same S rows (three plain matmuls
and the same elementwise work) is reported too. Ratio = achieved FLOP/s of the experts / FLOP/s of the matmul.

Systems: ``grouped_mm`` (torch._grouped_mm, moetrain's default), ``loop`` (moetrain's exact per-expert loop,
``use_grouped_mm=False``), ``patched`` (with the proposed patches of :mod:`patches`).
"""

from __future__ import annotations

from typing import Any

from common import Settings, autocast, run_isolated, setup_process, time_fn


def _counts(cfg, T: int, balanced: bool, device: str):
    import torch

    from moetrain.model.moe import Router
    E = cfg.n_routed_experts
    if balanced:
        S = T * cfg.top_k
        return torch.full((E,), S // E, dtype=torch.int64, device=device)
    torch.manual_seed(0)
    r = Router(cfg)
    with torch.no_grad():
        r.weight.normal_(0.0, cfg.init_std)
        x = torch.randn(T, cfg.dim)
        idx = r(x).topk_idx_TK
    return torch.bincount(idx.reshape(-1), minlength=E).to(device)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import patches as P
    from moetrain.model.layers import SwiGLU
    from moetrain.model.moe import GroupedExperts
    from peers import bench_config

    s = Settings.from_dict(spec["settings"])
    setup_process(s)
    if spec.get("patches"):
        P.apply(spec["patches"])
    cfg = bench_config(s.preset)
    dev = s.device
    T = s.batch * s.seq_len
    E, D, Fh = cfg.n_routed_experts, cfg.dim, cfg.expert_ffn_dim
    min_time = 0.3 if s.quick else 1.5
    out: dict[str, Any] = {"E": E, "D": D, "F": Fh, "tokens": T, "top_k": cfg.top_k, "rows": []}

    torch.manual_seed(0)
    experts = GroupedExperts(E, D, Fh).to(dev)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, cfg.init_std)

    def bench(label: str, fwd, inputs, flops_fwd: float) -> None:
        x = inputs
        g = torch.randn_like(x)

        def f_only():
            with torch.no_grad(), autocast(s):
                fwd(x)

        def f_b():
            x.grad = None
            for p in params:
                p.grad = None
            with autocast(s):
                y = fwd(x)
            y.backward(g if y.shape == g.shape else torch.ones_like(y))
        tf = time_fn(f_only, s, warmup=2, iters=5, min_time=min_time)
        x.requires_grad_(True)
        tb = time_fn(f_b, s, warmup=2, iters=5, min_time=min_time)
        x.requires_grad_(False)
        out["rows"].append({"label": label, "fwd_s": tf["median_s"], "fwd_bwd_s": tb["median_s"],
                            "fwd_flops_per_s": flops_fwd / tf["median_s"],
                            "fwd_bwd_flops_per_s": 3 * flops_fwd / tb["median_s"], "flops_fwd": flops_fwd})

    for balanced in (False, True):
        counts = _counts(cfg, T, balanced, dev)
        S = int(counts.sum())
        flops = 2.0 * S * D * Fh * 3
        tag = "balanced" if balanced else "routed"
        x = torch.randn(S, D, device=dev)
        params = list(experts.parameters())
        for mode in spec["modes"]:
            experts.use_grouped_mm = mode != "loop"
            bench(f"experts[{mode}] {tag}", lambda t: experts(t, counts), x, flops)
        experts.use_grouped_mm = True
        if balanced:
            continue
        out["counts_routed"] = counts.tolist()
        out["S"] = S
        # The limit: one plain matmul of the same FLOPs, and a dense SwiGLU of width F on the same rows.
        w = torch.randn(D, 3 * Fh, device=dev) * cfg.init_std
        w.requires_grad_(True)
        params = [w]
        bench("plain matmul (S x D)@(D x 3F)", lambda t: t @ w, x, flops)
        swiglu = SwiGLU(D, Fh).to(dev)
        params = list(swiglu.parameters())
        bench("dense SwiGLU width F", swiglu, x, flops)
    rows = {r["label"]: r for r in out["rows"]}
    limit = rows["plain matmul (S x D)@(D x 3F)"]
    out["ratios"] = {}
    for r in out["rows"]:
        if r["label"].startswith("experts["):
            key = r["label"]
            out["ratios"][f"{key} fwd"] = r["fwd_flops_per_s"] / limit["fwd_flops_per_s"]
            out["ratios"][f"{key} fwd+bwd"] = r["fwd_bwd_flops_per_s"] / limit["fwd_bwd_flops_per_s"]
    return out


def run(s: Settings, patches: list[str], log=print) -> dict[str, Any]:
    modes = ["grouped_mm", "loop"]
    res: dict[str, Any] = {}
    base = run_isolated("grouped_gemm:child", {"settings": s.to_dict(), "modes": modes}, timeout=300)
    res["baseline"] = base
    _log(base, log)
    if patches:
        p = run_isolated("grouped_gemm:child", {"settings": s.to_dict(), "modes": ["grouped_mm"],
                                                "patches": patches}, timeout=300)
        res["patched"] = p
        log("    with proposed patches:")
        _log(p, log, only_experts=True)
    return res


def _log(r: dict[str, Any], log, only_experts: bool = False) -> None:
    if "error" in r:
        log(f"    ERROR {r['error'][:300]}")
        return
    for row in r["rows"]:
        if only_experts and not row["label"].startswith("experts["):
            continue
        log(f"    {row['label']:<34} fwd {row['fwd_flops_per_s'] / 1e9:8.1f} GFLOP/s   "
            f"fwd+bwd {row['fwd_bwd_flops_per_s'] / 1e9:8.1f} GFLOP/s")
