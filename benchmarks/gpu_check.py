"""One prepared GPU validation run: ``python benchmarks/gpu_check.py`` (one NVIDIA GPU, under 8 minutes).

Prints one table and writes it as JSON (``--json PATH``):

* bf16 training-step MFU of the tiny and small presets and of the preset named by ``--gpu-preset`` (default
  ``small``; pick one that fits the GPU's memory, nothing searches for it);
* the grouped GEMM (``torch._grouped_mm``, bf16) rate against one plain bf16 matmul of the same FLOPs;
* FP8 GEMM rates: blockwise (1x128 x 128x128, Hopper) and MXFP8 (1x32 E8M0, Blackwell) through
  ``moetrain.precision.gemm.scaled_mm_fast``, each checked against the reference within ``FAST_PATH_RTOL``;
  skipped with the reason where the GPU or build has none;
* the attention kernel SDPA picks for MLA's head dims (tiny and DeepSeek-V3 shapes);
* host-device synchronisations in one training step (``torch.cuda.set_sync_debug_mode``);
* the FP8-vs-BF16 loss gap of the tiny model after ``--steps`` (default 50) steps, both recipes.

Without a GPU it runs every check it can on CPU at a small size (``--quick`` is implied: a few steps, small GEMMs)
and names what it skipped, so the test suite exercises it (tests/precision/test_gpu_check.py). No result here is a
pass/fail verdict except the fast-path checks against the reference (exit status 1 when one fails).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moetrain.accounting import flops_per_token  # noqa: E402
from moetrain.data.synthetic import synthetic_batches  # noqa: E402
from moetrain.model.config import get_preset  # noqa: E402
from moetrain.model.transformer import build_model  # noqa: E402
from moetrain.precision import apply_fp8, quantise  # noqa: E402
from moetrain.precision.gemm import FAST_PATH_RTOL, fp8_mm_reference, scaled_mm_fast  # noqa: E402
from moetrain.precision.recipe import BLOCKWISE, MXFP8  # noqa: E402
from moetrain.train.metrics import device_peak  # noqa: E402

Row = dict[str, Any]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], Any], dev: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after one warm-up."""
    fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def _amp(dev: torch.device) -> torch.dtype | None:
    return torch.bfloat16 if dev.type == "cuda" else None


def _train(model: torch.nn.Module, cfg: Any, batches: list, dev: torch.device, amp: torch.dtype | None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for tok, lab in batches:
        with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(tok, lab)
        out.loss(cfg).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((out.lm_loss_sum / out.n_loss_tokens).item())
    return losses


def check_mfu(preset: str, dev: torch.device, B: int, L: int, iters: int) -> Row:
    """Training-step MFU of ``preset`` on one device (one process, bf16 autocast on CUDA, fp32 on CPU)."""
    cfg = get_preset(preset)
    amp = _amp(dev)
    model = build_model(cfg, device=dev)
    batch = synthetic_batches(cfg.vocab_size, 1, B, L, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        tok, lab = batch[0]
        with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(tok, lab)
        out.loss(cfg).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = _time(step, dev, iters)
    peak, label = device_peak(dev, amp)
    tflops = flops_per_token(cfg, L).megatron * B * L / t / 1e12
    return {"check": f"train step MFU ({preset}, {B}x{L})", "value": f"{tflops / peak:.1%}",
            "detail": f"{t * 1e3:.1f} ms/step, {tflops:.3f} TFLOP/s of {peak:.3f} ({label})"}


def check_grouped_gemm(dev: torch.device, E: int, rows: int, K: int, N: int, iters: int) -> Row:
    """``torch._grouped_mm`` over E equal groups against one matmul of the same FLOPs (bf16)."""
    name = f"grouped GEMM vs matmul (E={E}, {rows}x{K}x{N} per expert, bf16)"
    if not hasattr(torch, "_grouped_mm"):
        return {"check": name, "value": "skipped", "detail": "this torch has no torch._grouped_mm"}
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return {"check": name, "value": "skipped", "detail": "torch._grouped_mm needs sm90+"}
    x = torch.randn(E * rows, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    t_g = _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), dev, iters)
    w2 = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    t_m = _time(lambda: x @ w2, dev, iters)
    fl = 2 * E * rows * K * N
    return {"check": name, "value": f"{t_m / t_g:.2f}x matmul rate",
            "detail": f"grouped {fl / t_g / 1e12:.3f} TFLOP/s, matmul {fl / t_m / 1e12:.3f} TFLOP/s"}


def check_fp8_gemm(dev: torch.device, M: int, K: int, N: int, iters: int) -> tuple[list[Row], bool]:
    """FP8 GEMM rates of both recipes (hardware path where present) and their agreement with the reference."""
    rows, ok = [], True
    x, w = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev)
    for r in (BLOCKWISE, MXFP8):
        name = f"FP8 GEMM {r.name} ({M}x{K}x{N})"
        a, b = quantise(x, r.row_tile, r.fmt), quantise(w, r.weight_fprop_tile, r.fmt)
        fast = scaled_mm_fast(a, b)
        t_ref = _time(lambda: fp8_mm_reference(a, b), dev, iters)
        ref_rate = 2 * M * K * N / t_ref / 1e12
        if fast is None:
            why = ("no FP8 scaled_mm for these scales on CPU (row-wise only)" if dev.type == "cpu" else
                   f"no {r.name} scaled_mm on {torch.cuda.get_device_name(dev)} (blockwise: Hopper sm90 + CUDA 12.9;"
                   f" MXFP8: Blackwell sm100) or shapes not multiples of 128")
            rows.append({"check": name, "value": "skipped", "detail": f"{why}; reference (emulated) "
                                                                       f"{ref_rate:.3f} TFLOP/s"})
            continue
        ref = fp8_mm_reference(a, b)
        err = ((fast - ref).abs().max() / ref.abs().max()).item()
        ok &= err <= FAST_PATH_RTOL
        t = _time(lambda: scaled_mm_fast(a, b), dev, iters)
        rows.append({"check": name, "value": f"{2 * M * K * N / t / 1e12:.1f} TFLOP/s",
                     "detail": f"max error vs reference {err:.1e} of max|y| (limit {FAST_PATH_RTOL:.0e}): "
                               f"{'ok' if err <= FAST_PATH_RTOL else 'FAIL'}"})
    if dev.type == "cpu":  # the one CPU fast path: both operands with one scale per row (K <= 128)
        a, b = quantise(x[:, :128], BLOCKWISE.row_tile), quantise(w[:, :128], BLOCKWISE.weight_fprop_tile)
        fast, ref = scaled_mm_fast(a, b), fp8_mm_reference(a, b)
        if fast is not None:
            err = ((fast - ref).abs().max() / ref.abs().max()).item()
            ok &= err <= FAST_PATH_RTOL
            rows.append({"check": f"FP8 GEMM row-wise CPU ({M}x128x{N})", "value": f"error {err:.1e}",
                         "detail": f"limit {FAST_PATH_RTOL:.0e}: {'ok' if err <= FAST_PATH_RTOL else 'FAIL'}"})
    return rows, ok


def check_sdpa(dev: torch.device) -> list[Row]:
    """Which fused attention kernel SDPA picks for MLA's q/k/v head dims (padded to one multiple of 8, as
    ``moetrain.model.attention`` pads them)."""
    from torch.nn.attention import SDPBackend

    rows = []
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for label, preset in (("tiny", "tiny"), ("DeepSeek-V3", "deepseek-v3-671b")):
        cfg = get_preset(preset)
        P = -(-max(cfg.qk_head_dim, cfg.v_head_dim) // 8) * 8
        q = torch.randn(1, min(cfg.n_heads, 16), 128, P, device=dev, dtype=dtype)
        if not hasattr(torch, "_fused_sdp_choice"):
            rows.append({"check": f"SDPA kernel, MLA {label}", "value": "unknown", "detail": "no _fused_sdp_choice"})
            continue
        choice = torch._fused_sdp_choice(q, q, q, None, 0.0, True, scale=cfg.softmax_scale)
        rows.append({"check": f"SDPA kernel, MLA {label} (head dim {cfg.qk_head_dim}/{cfg.v_head_dim} -> {P})",
                     "value": SDPBackend(choice).name, "detail": f"{dev.type}, {str(dtype).removeprefix('torch.')}"})
    return rows


def check_syncs(dev: torch.device, B: int, L: int) -> Row:
    """Host-device synchronisations in one training step of the tiny model (one process, EP = 1)."""
    name = "host-device syncs per training step (tiny, EP 1)"
    if dev.type != "cuda":
        return {"check": name, "value": "skipped", "detail": "no CUDA device: host and device are one on CPU"}
    cfg = get_preset("tiny")
    model = build_model(cfg, device=dev)
    tok, lab = synthetic_batches(cfg.vocab_size, 1, B, L, dev)[0]
    _train(model, cfg, [(tok, lab)], dev, _amp(dev))  # warm-up (lazy inits sync)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(tok, lab)
            out.loss(cfg).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(w.message) for w in caught)
    return {"check": name, "value": str(n), "detail": "forward + backward, counted by torch.cuda.set_sync_debug_mode"}


def check_loss_gap(dev: torch.device, steps: int, B: int, L: int) -> list[Row]:
    """FP8 (both recipes) vs BF16 autocast (fp32 on CPU): mean lm loss of the last 5 steps, same data and init."""
    cfg = get_preset("tiny")
    cfg.vocab_size = 256
    amp = _amp(dev)
    base = build_model(cfg, device=dev)
    batches = synthetic_batches(cfg.vocab_size, steps, B, L, dev)
    ref = _train(copy.deepcopy(base), cfg, batches, dev, amp)
    tail = min(5, steps)
    ref_tail = sum(ref[-tail:]) / tail
    rows = []
    for recipe in ("blockwise", "mxfp8"):
        m = copy.deepcopy(base)
        apply_fp8(m, recipe)
        got = _train(m, cfg, batches, dev, amp)
        gap = sum(got[-tail:]) / tail / ref_tail - 1
        rows.append({"check": f"FP8 {recipe} vs {'bf16' if amp else 'fp32'} loss after {steps} steps (tiny)",
                     "value": f"{gap:+.2%}", "detail": f"{sum(got[-tail:]) / tail:.4f} vs {ref_tail:.4f} "
                                                       f"(mean of last {tail}; start {ref[0]:.3f})"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps of the FP8 loss-gap check")
    ap.add_argument("--gpu-preset", default="small", help="the preset sized to one GPU for the MFU row")
    ap.add_argument("--quick", action="store_true", help="small sizes (implied without a GPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table here as JSON")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or dev.type == "cpu"
    if dev.type == "cpu":
        torch.set_num_threads(1)  # small ops on a possibly shared CPU
    rows: list[Row] = []
    skipped: list[str] = []
    presets = [("tiny", 4, 64)] if quick else [("tiny", 32, 256), ("small", 8, 1024), (args.gpu_preset, 4, 2048)]
    for preset, B, L in dict.fromkeys(presets):
        rows.append(check_mfu(preset, dev, B, L, iters=2 if quick else 5))
    if quick:
        skipped.append("MFU of the small preset and of the one-GPU preset (no GPU / --quick)")
    rows.append(check_grouped_gemm(dev, 8, 64 if quick else 4096, 128 if quick else 2048,
                                   128 if quick else 1408, iters=3 if quick else 20))
    fp8_rows, ok = check_fp8_gemm(dev, *((256, 256, 256) if quick else (8192, 7168, 2048)), iters=3 if quick else 20)
    rows += fp8_rows
    rows += check_sdpa(dev)
    rows.append(check_syncs(dev, 4, 64))
    rows += check_loss_gap(dev, min(args.steps, 6) if quick else args.steps, 4 if quick else 16, 64)
    skipped += [f"{r['check']}: {r['detail']}" for r in rows if r["value"] == "skipped"]
    w = max(len(r["check"]) for r in rows)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"moetrain GPU check on {name} (torch {torch.__version__}{', quick' if quick else ''})")
    for r in rows:
        print(f"{r['check']:<{w}}  {r['value']:>18}  {r['detail']}")
    if skipped:
        print("skipped:\n" + "\n".join(f"  - {s}" for s in skipped))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "quick": quick, "rows": rows, "skipped": skipped,
                                         "fast_paths_ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
