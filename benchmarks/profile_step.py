"""Where the time goes: torch.profiler over training steps of moetrain (and of the fastest peer for contrast).

Records the top operators by self time (CPU; CUDA time on a GPU) of one profiled step after warm-up, plus the
share of the step spent in matmul-class operators, so a missed goal comes with its profile.
"""

from __future__ import annotations

from typing import Any

from common import Settings, batch_tokens, run_isolated, setup_process

GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm", "aten::matmul", "aten::linear",
            "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import patches as P
    import moetrain.train.optim as optim
    from peers import hf_causal_lm, peer_optimizer

    s = Settings.from_dict(spec["settings"])
    setup_process(s)
    from peers import bench_config
    cfg = bench_config(s.preset)
    x, y = batch_tokens(s, cfg.vocab_size)
    system = spec["system"]
    if system.startswith("moetrain"):
        if system == "moetrain+patch":
            P.apply(spec.get("patches", []))
        from moetrain.model.transformer import build_model
        from moetrain.parallel.config import ParallelConfig
        from moetrain.parallel.mesh import init_parallel
        from moetrain.parallel.pipeline import build_stages
        from moetrain.train.runners import single_stage_parts
        from moetrain.train.step import train_step
        model = build_model(cfg, device=s.device, seed=0)
        ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device=s.device)
        opt = optim.build_optimizer(model, lr=s.lr)
        parts = single_stage_parts(build_stages(model, ctx.pcfg, 0)[0], ctx)  # the trainer's one stage at PP = 1
        amp = torch.bfloat16 if s.device == "cuda" else None

        def step():
            train_step(parts, opt, [(x, y)], cfg, ctx, autocast_dtype=amp)
    elif system == "torchtitan":
        import torch.nn.functional as F

        from moetrain.model.transformer import build_model
        from peers import titan_model_from_moetrain
        model = titan_model_from_moetrain(build_model(cfg, device=s.device, seed=0), cfg, s.device,
                                          fp32_experts=s.device == "cpu")
        opt = peer_optimizer(model, lr=s.lr)
        params = list(model.parameters())

        def step():
            with torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.device == "cuda"):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        if s.device == "cuda":
            from moetrain.model.transformer import build_model
            from peers import hf_causal_lm_from_moetrain
            model = hf_causal_lm_from_moetrain(build_model(cfg, device=s.device, seed=0), cfg, system[3:-1], s.device)
        else:
            model = hf_causal_lm(spec["ckpt"], system[3:-1], s.device)
        opt = peer_optimizer(model, lr=s.lr)
        params = list(model.parameters())

        def step():
            with torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.device == "cuda"):
                out = model(input_ids=x, labels=x, shift_labels=y)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if s.device == "cuda":
            torch.cuda.synchronize()
    ka = prof.key_averages()
    key = "self_device_time_total" if s.device == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in ka)
    top = sorted(ka, key=lambda e: getattr(e, key), reverse=True)[:spec.get("top", 15)]
    gemm = sum(getattr(e, key) for e in ka if e.key in GEMM_OPS)
    return {"system": system, "time_key": key, "total_ms": total / 1e3, "gemm_share": gemm / total if total else 0,
            "top": [{"op": e.key, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total if total else 0,
                     "calls": e.count} for e in top]}


def run(s: Settings, patches: list[str], ref_dir: str, systems: list[str], log=print) -> dict[str, Any]:
    from pathlib import Path
    out: dict[str, Any] = {}
    ckpt = str(Path(ref_dir) / "hf_ckpt")
    if s.device == "cpu" and any(x.startswith("hf[") for x in systems) and not Path(ckpt).exists():
        run_isolated("train_step:make_checkpoint", {"settings": s.to_dict(), "path": ckpt}, timeout=300)
    for system in systems:
        from peers import peer_site_path
        r = run_isolated("profile_step:child", {"settings": s.to_dict(), "system": system, "patches": patches,
                                                "ckpt": ckpt}, timeout=400,
                         extra_path=peer_site_path() if system == "torchtitan" else None)
        out[system] = r
        if "error" in r:
            log(f"    {system}: ERROR {r['error'][:300]}")
            continue
        log(f"    {system}: profiled step {r['total_ms']:.0f} ms (op self times), matmul-class ops "
            f"{r['gemm_share'] * 100:.0f}%")
        for e in r["top"][:8]:
            log(f"      {e['op']:<58} {e['self_ms']:9.1f} ms  {e['share'] * 100:5.1f}%  x{e['calls']}")
    return out
