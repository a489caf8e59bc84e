"""Full training step (forward + backward + gradient clipping at 1.0 + AdamW step + zero_grad): tokens/s, TFLOP/s
and peak memory of moetrain vs HF ``DeepseekV3ForCausalLM`` (each expert implementation) vs TorchTitan's DeepSeek-V3.

Same work for all: the benchmark config (``peers.bench_config``: no MTP, plain RoPE), the same weights (moetrain's
``build_model(cfg, seed=0)``, handed to HF through ``save_hf_checkpoint`` -> ``from_pretrained`` and to TorchTitan by
name), the same batch, and the same optimizer settings: torch AdamW, lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
matrices and none on vectors, gradient clipping at norm 1.0. Each system uses its own default AdamW *implementation*:
moetrain its ``build_optimizer`` (``foreach=False`` in src), HF and TorchTitan the fused kernel (``fused=True``: the
HF Trainer default ``adamw_torch_fused`` for torch >= 2.8, TorchTitan's default ``implementation="fused"``). moetrain's step also computes its
sequence-wise balance loss and updates the router biases (HF does neither; this is extra work on moetrain's side).
TFLOP/s use one FLOP count for all systems: ``moetrain.accounting.flops_per_token(cfg, L).megatron``.

Guard: the first step's cross-entropy of every system must equal moetrain's within 1e-4 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import (MemoryProbe, Settings, autocast, batch_tokens, load1, no_gate, run_isolated, setup_process,
                    time_fn)

CHECK_RTOL = 1e-4


def make_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: build moetrain's model (seed 0) and write it as a HF checkpoint for the HF peers."""
    import torch

    from moetrain.interop.hf import save_hf_checkpoint
    from moetrain.model.transformer import build_model
    from peers import bench_config
    s = Settings.from_dict(spec["settings"])
    setup_process(s)
    cfg = bench_config(s.preset)
    model = build_model(cfg, seed=0)
    save_hf_checkpoint(model, spec["path"], overwrite=True)
    return {"path": spec["path"], "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(torch.get_default_dtype())}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import patches as P
    from moetrain.accounting import flops_per_token
    import moetrain.train.optim as optim
    from peers import (available_ram_bytes, bench_config, hf_batched_mm_bytes, hf_causal_lm, hf_causal_lm_from_moetrain,
                       peer_optimizer, titan_model_from_moetrain)

    s = Settings.from_dict(spec["settings"])
    system = spec["system"]
    setup_process(s)
    cfg = bench_config(s.preset)
    T = s.batch * s.seq_len
    if system == "hf[batched_mm]":
        need = hf_batched_mm_bytes(cfg, T, cfg.n_moe_layers)
        if need > 0.5 * available_ram_bytes(s.device):
            return {"skipped": f"HF batched_mm copies the expert weights per routed token: ~{need / 2**30:.0f} GiB "
                               f"for {cfg.n_moe_layers} MoE layers' fwd+bwd at {T} tokens, over half of this "
                               f"{s.device} memory available ({available_ram_bytes(s.device) / 2**30:.1f} GiB)"}
    if system.startswith("moetrain+patch"):
        P.apply(spec.get("patches", []))
    dev = torch.device(s.device)
    x, y = batch_tokens(s, cfg.vocab_size)
    probe = MemoryProbe(s)

    if system.startswith("moetrain"):
        from moetrain.model.transformer import build_model
        from moetrain.parallel.config import ParallelConfig
        from moetrain.parallel.mesh import init_parallel
        from moetrain.parallel.pipeline import build_stages
        from moetrain.train.runners import single_stage_parts
        from moetrain.train.step import train_step
        probe.start()
        model = build_model(cfg, device=dev, seed=0)
        if system == "moetrain[loop]":
            for m in model.moe_layers():
                m.experts.use_grouped_mm = False
        ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device=s.device)
        opt = optim.build_optimizer(model, lr=s.lr)  # moetrain's own optimizer builder (patched or not)
        parts = single_stage_parts(build_stages(model, ctx.pcfg, 0)[0], ctx)  # the trainer's one stage at PP = 1
        amp = torch.bfloat16 if (s.device == "cuda" and s.dtype == "bf16") else None

        def step() -> float:
            return train_step(parts, opt, [(x, y)], cfg, ctx, max_grad_norm=1.0, autocast_dtype=amp).lm_loss
    elif system.startswith("hf["):
        if spec.get("in_memory"):
            from moetrain.model.transformer import build_model
            ref = build_model(cfg, device=dev, seed=0)
            probe.start()
            model = hf_causal_lm_from_moetrain(ref, cfg, system[3:-1], s.device)
            del ref
        else:
            probe.start()
            model = hf_causal_lm(spec["ckpt"], system[3:-1], s.device)
        opt = peer_optimizer(model, lr=s.lr)
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> float:
            with autocast(s):
                out = model(input_ids=x, labels=x, shift_labels=y)  # shift_labels: the same next-token targets
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(out.loss)
    elif system == "torchtitan":
        from moetrain.model.transformer import build_model
        ref = build_model(cfg, device=dev, seed=0)
        probe.start()
        model = titan_model_from_moetrain(ref, cfg, s.device, fp32_experts=s.device == "cpu")
        del ref
        opt = peer_optimizer(model, lr=s.lr)
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> float:
            with autocast(s):
                logits = model(x)
                # torchtitan.components.loss.cross_entropy_loss: CE of fp32 logits (sum / tokens here = mean)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
    else:
        raise ValueError(f"unknown system {system!r}")

    first_loss = step()  # also the first warm-up step
    check: dict[str, Any] = {"first_loss": first_loss}
    ref_path = Path(spec["ref_dir"]) / "train_step_loss.txt"
    if system == "moetrain":
        ref_path.write_text(repr(first_loss))
    elif ref_path.exists():
        ref_loss = float(ref_path.read_text())
        err = abs(first_loss - ref_loss) / abs(ref_loss)
        tol = CHECK_RTOL if s.dtype == "fp32" else 2e-2
        check.update(rel_loss_diff_vs_moetrain=err, same_function=err <= tol)
    t = time_fn(step, s, warmup=max(0, s.warmup - 1))
    fpt = flops_per_token(cfg, s.seq_len).megatron
    tflops = fpt * T / t["min_s"] / 1e12
    res = {"system": system, "tokens": T, "tokens_per_s": T / t["min_s"], "tflops": tflops,
           "flops_per_token": fpt, **t, **probe.peak_mb(), **check}
    if s.device == "cuda":
        from moetrain.plan.hardware import get_gpu
        name = torch.cuda.get_device_name(0).lower()
        for key in ("h200", "h100", "b200", "a100"):
            if key in name:
                try:
                    res["mfu"] = tflops * 1e12 / get_gpu(key).peak("bf16")
                    res["mfu_peak"] = f"{key} dense bf16 {get_gpu(key).peak('bf16') / 1e12:.0f} TFLOP/s"
                except Exception:  # noqa: BLE001
                    pass
                break
    return res


def _systems(patches: list[str]) -> list[str]:
    out = ["moetrain"]
    if patches:
        out.append("moetrain+patch")
    return out + ["hf[eager]", "hf[grouped_mm]", "hf[batched_mm]", "torchtitan"]


def run(s: Settings, patches: list[str], ref_dir: str, systems: list[str] | None = None, log=print,
        gate=no_gate) -> dict[str, Any]:
    from peers import TORCHTITAN_CPU_NOTES, peer_site_path
    systems = systems or _systems(patches)
    ckpt = str(Path(ref_dir) / "hf_ckpt")
    res: dict[str, Any] = {"metric": "tokens_per_s", "rows": []}
    in_memory = s.device == "cuda"  # on GPU the HF peers get the weights in memory (see peers.hf_causal_lm_from_moetrain)
    if any(x.startswith("hf[") for x in systems) and not in_memory:
        mk = run_isolated("train_step:make_checkpoint", {"settings": s.to_dict(), "path": ckpt}, timeout=300)
        if "error" in mk:
            log(f"    checkpoint for the HF peers failed: {mk['error'][:300]}")
            systems = [x for x in systems if not x.startswith("hf[")]
            res["hf_checkpoint_error"] = mk["error"]
    for system in systems:
        spec = {"settings": s.to_dict(), "system": system, "patches": patches, "ref_dir": ref_dir, "ckpt": ckpt,
                "in_memory": in_memory}
        extra = peer_site_path() if system == "torchtitan" else None
        load = gate()
        r = run_isolated("train_step:child", spec, timeout=600, extra_path=extra)
        r["system"] = system
        r["load_at_start"], r["load_at_end"], r["quiet"] = load["load_at_start"], load1(), load["quiet"]
        res["rows"].append(r)
        log("    " + _row_line(r))
    if s.device == "cpu" and "torchtitan" in systems:
        res["notes"] = ["torchtitan adapted to run on CPU: " + " | ".join(TORCHTITAN_CPU_NOTES[:2])]
    res["ratios"] = ratios(res["rows"])
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
        return f"{r['system']:<18} ERROR {r['error'][:300]}"
    if "skipped" in r:
        return f"{r['system']:<18} skipped: {r['skipped']}"
    chk = ""
    if "rel_loss_diff_vs_moetrain" in r:
        chk = f"  loss diff {r['rel_loss_diff_vs_moetrain']:.1e}{'' if r['same_function'] else ' MISMATCH'}"
    mfu = f"  MFU {r['mfu'] * 100:.1f}%" if "mfu" in r else ""
    return (f"{r['system']:<18} {r['tokens_per_s']:>9.1f} tok/s  {r['min_s']:7.3f} s/step (median {r['median_s']:.3f})  "
            f"{r['tflops'] * 1e3:7.1f} GFLOP/s{mfu}  peak {r['peak_mem_mb']:7.0f} MiB  loss {r['first_loss']:.5f}{chk}")
