"""MoE layer forward + backward: tokens/s and peak memory of moetrain's MoE vs HF ``DeepseekV3MoE`` (each expert
implementation) vs TorchTitan's MoE, all holding the same weights and fed the same input and output gradient.

Work per step: router, dropless top-k dispatch, routed experts, shared expert, combine; then the backward of
``(y * g).sum()`` for a fixed random ``g`` (gradients of input and all weights). Guard: every system's output must
match moetrain's within 1e-4 relative (max-abs error / max-abs value), else the row is marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import MemoryProbe, Settings, autocast, load1, no_gate, run_isolated, setup_process, time_fn

CHECK_RTOL = 1e-4


def _systems(s: Settings, patches: list[str]) -> list[str]:
    out = ["moetrain", "moetrain[loop]"]
    if patches:
        out.append("moetrain+patch")
    out += [f"hf[{i}]" for i in ("eager", "grouped_mm", "batched_mm")]
    out.append("torchtitan")
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import patches as P
    from moetrain.accounting import flops_breakdown
    from moetrain.model.moe import MoE
    from peers import (available_ram_bytes, bench_config, copy_moe_weights, hf_batched_mm_bytes,
                       hf_moe_from_moetrain, init_moe_reference, titan_moe_from_moetrain)

    s = Settings.from_dict(spec["settings"])
    system = spec["system"]
    setup_process(s)
    cfg = bench_config(s.preset)
    T = s.batch * s.seq_len
    if system == "hf[batched_mm]":
        need = hf_batched_mm_bytes(cfg, T, 1)
        if need > 0.5 * available_ram_bytes(s.device):
            return {"skipped": f"HF batched_mm copies the expert weights per routed token: ~{need / 2**30:.1f} GiB "
                               f"for one layer's fwd+bwd at {T} tokens, over half of this machine's available "
                               f"{available_ram_bytes(s.device) / 2**30:.1f} GiB"}
    dev = s.device
    ref = init_moe_reference(cfg, dev)  # from the unpatched class: the same weights for every system
    if system.startswith("moetrain+patch"):
        P.apply(spec.get("patches", []))
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(s.batch, s.seq_len, cfg.dim, generator=g).to(dev)
    gy = torch.randn(s.batch, s.seq_len, cfg.dim, generator=g).to(dev)

    probe = MemoryProbe(s)
    probe.start()
    if system.startswith("moetrain"):
        with torch.device(dev):
            mod = MoE(cfg)  # the (possibly patched) class
        copy_moe_weights(mod, ref)
        if system == "moetrain[loop]":
            mod.experts.use_grouped_mm = False
        fwd = lambda x: mod(x)[0]  # noqa: E731
    elif system.startswith("hf["):
        impl = system[3:-1]
        mod = hf_moe_from_moetrain(ref, cfg, impl, dev).train()
        fwd = mod
    elif system == "torchtitan":
        mod = titan_moe_from_moetrain(ref, cfg, fp32_experts=s.device == "cpu", device=dev)
        fwd = mod
    else:
        raise ValueError(f"unknown system {system!r}")
    params = [p for p in mod.parameters() if p.requires_grad]
    x = x0.clone().requires_grad_(True)

    def step() -> torch.Tensor:
        x.grad = None
        for p in params:
            p.grad = None
        with autocast(s):
            y = fwd(x)
        y.backward(gy)
        return y

    y = step().detach()
    check: dict[str, Any] = {}
    ref_path = Path(spec["ref_dir"]) / "moe_layer_y.pt"
    if system == "moetrain":
        torch.save(y.float().cpu(), ref_path)
    elif ref_path.exists():
        y_ref = torch.load(ref_path)
        err = (y.float().cpu() - y_ref).abs().max().item() / max(y_ref.abs().max().item(), 1e-30)
        check = {"max_rel_err_vs_moetrain": err, "same_function": err <= (CHECK_RTOL if s.dtype == "fp32" else 2e-2)}
    t = time_fn(step, s, min_time=0.0 if s.quick else (0.5 if s.device == "cuda" else 1.0))
    b = flops_breakdown(cfg, s.seq_len)
    flops = T * (b.routed + b.shared)  # Megatron counting: routed + shared experts, fwd + bwd (router not counted)
    return {"system": system, "tokens": T, "tokens_per_s": T / t["min_s"], "tflops": flops / t["min_s"] / 1e12,
            **t, **probe.peak_mb(), **check}


def run(s: Settings, patches: list[str], ref_dir: str, systems: list[str] | None = None, log=print,
        gate=no_gate) -> dict[str, Any]:
    from peers import TORCHTITAN_CPU_NOTES, peer_site_path
    rows = []
    systems = systems or _systems(s, patches)
    for system in systems:
        spec = {"settings": s.to_dict(), "system": system, "patches": patches, "ref_dir": ref_dir}
        extra = peer_site_path() if system == "torchtitan" else None
        load = gate()
        r = run_isolated("moe_layer:child", spec, timeout=300, extra_path=extra)
        r["system"] = system
        r["load_at_start"], r["load_at_end"], r["quiet"] = load["load_at_start"], load1(), load["quiet"]
        rows.append(r)
        log("    " + _row_line(r))
    res: dict[str, Any] = {"rows": rows, "metric": "tokens_per_s"}
    if s.device == "cpu" and "torchtitan" in systems:
        res["notes"] = ["torchtitan: " + n for n in TORCHTITAN_CPU_NOTES[1:2]]
    res["ratios"] = ratios(rows)
    return res


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = {r["system"]: r for r in rows if "tokens_per_s" in r and r.get("same_function", True)}
    peers = {k: v for k, v in ok.items() if not k.startswith("moetrain")}
    out: dict[str, Any] = {}
    if not peers:
        return out
    best = max(peers, key=lambda k: peers[k]["tokens_per_s"])
    out["fastest_peer"] = best
    for name in ("moetrain", "moetrain+patch"):
        if name in ok:
            out[f"{name}/fastest_peer"] = ok[name]["tokens_per_s"] / peers[best]["tokens_per_s"]
    return out


def _row_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['system']:<18} ERROR {r['error'][:200]}"
    if "skipped" in r:
        return f"{r['system']:<18} skipped: {r['skipped']}"
    chk = ""
    if "max_rel_err_vs_moetrain" in r:
        chk = f"  err {r['max_rel_err_vs_moetrain']:.1e}{'' if r['same_function'] else ' MISMATCH'}"
    return (f"{r['system']:<18} {r['tokens_per_s']:>10.0f} tok/s  {r['min_s'] * 1e3:8.1f} ms (median {r['median_s'] * 1e3:.1f})  "
            f"{r['tflops'] * 1e3:7.1f} GFLOP/s  peak {r['peak_mem_mb']:7.0f} MiB{chk}")
