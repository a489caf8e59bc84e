"""FP8 fast paths on one CUDA GPU: agreement with the reference, and speed against bf16. Under a minute on an H200.

``python benchmarks/fp8_gpu_verify.py [--eager] [--json PATH]``: one line per check, printed (and flushed) the
moment it finishes, each check isolated (an exception becomes a FAIL line, the run goes on); exit status 1 if any
check failed. ``--eager`` runs the quantisers uncompiled (MOETRAIN_FP8_COMPILE=0), to compare. Checks:

* ``gemm <preset> <GEMM> (M,K,N)``: ``scaled_mm_fast`` of the linear's fprop, dgrad and wgrad operands, as
  ``Fp8LinearFunction`` builds them, against ``fp8_mm_reference`` within ``fast_path_rtol()`` of max |y| (fp32
  output), at FP8-linear shapes of the tiny, small and DeepSeek-V3 presets (unaligned ones included).
* ``linear <preset> fwd+bwd``: ``Fp8LinearFunction`` forward and backward through autograd (bf16 in, bf16 out, fp32
  weight), each of y, dx, dW against the reference's (fake-quantised operands, fp32 GEMMs) within
  ``fast_path_rtol`` of its dtype (bf16 for y and dx, fp32 for dW); with the product of the operands the
  compiled quantisers built, and their codes that differ from the definition's, beside (which side a difference
  comes from).
* ``experts <preset> fwd+bwd``: the routed experts' row-wise FP8 grouped GEMM (``grouped.fp8_grouped_mm``) with
  uneven and empty groups and capacity-padding rows, against ``grouped.grouped_reference``; an empty expert's
  weight gradient must be exactly 0 and padding rows' outputs 0.
* ``raw 2d-2d empty group``: whether ``torch._scaled_grouped_mm`` itself writes zeros for an empty group
  (information: moetrain zeroes those experts' gradients anyway).
* ``time linear`` / ``time experts``: FP8 forward+backward against bf16 at DeepSeek-V3 shapes (ms, median of 10
  after warm-up; the first call's compile time is reported apart).
* ``time expert fprop: grouped row-wise vs per-expert blockwise``: the GEMM alone on quantised operands, the
  row-wise grouped kernel against a loop of blockwise ``scaled_mm`` over the experts (DeepSeek-V3's tiles, which
  would need the per-expert counts on the host): the speed side of the choice ``recipe.py`` explains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if "--eager" in sys.argv:
    os.environ["MOETRAIN_FP8_COMPILE"] = "0"

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moetrain.model.experts import grouped_mm  # noqa: E402
from moetrain.precision import fused  # noqa: E402
from moetrain.precision.gemm import fast_path_rtol, fp8_mm_reference, operand_t, scaled_mm_fast  # noqa: E402
from moetrain.precision.grouped import aligned_layout, fp8_grouped_mm, grouped_reference, to_aligned  # noqa: E402
from moetrain.precision.linear import Fp8LinearFunction  # noqa: E402
from moetrain.precision.quant import fake_quantise, quantise  # noqa: E402
from moetrain.precision.recipe import BLOCKWISE  # noqa: E402

DEV = torch.device("cuda")
RESULTS: list[dict[str, Any]] = []
#: (M tokens, [(K, N) of FP8 linears]) per preset: MLA's kv_a (N = 576 / 288 / 48, not multiples of 128), a dense
#: or shared-expert projection, and a down projection. For the wgrad M is the contraction, padded to 128.
LINEARS = {"tiny": (1000, [(128, 48), (128, 384), (384, 128)]),  # M = 1000: not a multiple of 16
           "small": (2048, [(768, 288), (768, 3072), (256, 768)]),
           "deepseek-v3-671b": (4096, [(7168, 576), (7168, 2048), (2048, 7168)])}
#: (local experts, model dim D, expert FFN dim F) per preset (DeepSeek-V3: 8 of 256 experts per rank).
EXPERTS = {"tiny": (16, 128, 64), "small": (32, 768, 256), "deepseek-v3-671b": (8, 7168, 2048)}


def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    t = time.perf_counter()
    try:
        ok, detail = fn()
        status = "ok" if ok else "FAIL"
    except Exception as e:  # one failing check must not hide the others
        ok, status = False, "FAIL"
        detail = f"{type(e).__name__}: {str(e)[:400]} | {traceback.format_exc(limit=-2).strip().splitlines()[-3]}"
    RESULTS.append({"check": name, "ok": ok, "detail": detail, "s": round(time.perf_counter() - t, 2)})
    print(f"[{status}] {name}: {detail} ({time.perf_counter() - t:.1f}s)", flush=True)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def codes_differing(got: Any, want: Any) -> int:
    """How many E4M3 values of two quantised operands (``quant.Quantized``) differ (+0 and -0 alike: the fake
    quantisation's rounding turns -0 into +0)."""
    return int((got.data.float() != want.data.float()).sum())


def ms(fn: Callable[[], Any], iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return sorted(times)[len(times) // 2]


def gemm_checks(preset: str) -> None:
    M, shapes = LINEARS[preset]
    for K, N in shapes:
        def run(K: int = K, N: int = N) -> tuple[bool, str]:
            torch.manual_seed(0)
            x, w, dy = (torch.randn(M, K, device=DEV), torch.randn(N, K, device=DEV),
                        torch.randn(M, N, device=DEV))
            wq = quantise(w, (128, 128))
            errs = {}
            for g, (a, b) in {"fprop": (quantise(x, (1, 128)), wq),
                              "dgrad": (quantise(dy, (1, 128)), operand_t(wq)),
                              "wgrad": (quantise(dy.t(), (1, 128)), quantise(x.t(), (1, 128)))}.items():
                fast = scaled_mm_fast(a, b)
                if fast is None:
                    return False, f"{g}: no fast path"
                errs[g] = rel(fast, fp8_mm_reference(a, b))
            lim = fast_path_rtol()
            return max(errs.values()) <= lim, " ".join(f"{g} {e:.1e}" for g, e in errs.items()) + f" (limit {lim:.1e})"
        check(f"gemm {preset} (M,K,N)=({M},{K},{N})", run)


def linear_check(preset: str) -> None:
    M, shapes = LINEARS[preset]
    K, N = shapes[0]

    def run() -> tuple[bool, str]:
        torch.manual_seed(0)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(N, K, device=DEV) * 0.05).requires_grad_()
        dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
        y = Fp8LinearFunction.apply(x, w, BLOCKWISE)
        y.backward(dy)
        r, xd, wd = BLOCKWISE, x.detach(), w.detach()
        xq = fake_quantise(xd, r.row_tile)
        y_ref = xq @ fake_quantise(wd, r.weight_fprop_tile).t()
        dx_ref = fake_quantise(dy, r.row_tile) @ fake_quantise(wd, r.weight_dgrad_tile)
        dw_ref = fake_quantise(dy.t(), r.row_tile) @ fake_quantise(xq.t(), r.row_tile).t()
        errs = {"y": rel(y, y_ref), "dx": rel(x.grad, dx_ref), "dW": rel(w.grad, dw_ref)}
        # y and dx are written in bf16, dW in the fp32 master weight's dtype: each within its output's rounding
        lims = {"y": fast_path_rtol(y.dtype), "dx": fast_path_rtol(x.grad.dtype), "dW": fast_path_rtol(w.grad.dtype)}
        # which side a dW difference comes from: the kernel against the product of the operands the compiled
        # quantisers gave it, and how many of those operands' E4M3 codes differ from the definition's
        xq_k = fused.quantise(xd, r.row_tile)
        own = {"x": xq_k, "dy^T": fused.quantise(dy.t(), r.row_tile), "x^T": fused.requantise_t(xq_k, r.row_tile)}
        defn = {"x": quantise(xd, r.row_tile), "dy^T": quantise(dy.t(), r.row_tile),
                "x^T": quantise(xq.t(), r.row_tile)}
        diag = (f"; dW vs its own operands {rel(w.grad, fp8_mm_reference(own['dy^T'], own['x^T'])):.1e}, codes "
                "differing from the definition: " + ", ".join(f"{k} {codes_differing(own[k], defn[k])}" for k in own))
        return (all(errs[k] <= lims[k] for k in errs),
                " ".join(f"{k} {v:.1e} (limit {lims[k]:.1e})" for k, v in errs.items()) + diag)
    check(f"linear {preset} fwd+bwd (M,K,N)=({M},{K},{N})", run)


def expert_check(preset: str) -> None:
    E, D, F = EXPERTS[preset]

    def run() -> tuple[bool, str]:
        torch.manual_seed(0)
        counts = [(37 * e + 11) % 300 + 1 for e in range(E)]
        counts[1] = 0  # an empty expert
        S = sum(counts) + 5  # capacity-padding rows past the groups
        lay = aligned_layout(torch.tensor(counts, device=DEV), S, BLOCKWISE.group_align, counts)
        x = to_aligned(torch.randn(S, D, device=DEV, dtype=torch.bfloat16), lay).requires_grad_()
        w = (torch.randn(E, 2 * F, D, device=DEV) * 0.05).requires_grad_()
        dy = to_aligned(torch.randn(S, 2 * F, device=DEV, dtype=torch.bfloat16), lay)
        y = fp8_grouped_mm(x, w, lay.offs_E, BLOCKWISE, torch.bfloat16)
        y.backward(dy)
        y_ref, dx_ref, dw_ref = grouped_reference(x.detach(), w.detach(), lay.offs_E, dy, BLOCKWISE)
        errs = {"y": rel(y, y_ref), "dx": rel(x.grad, dx_ref), "dW": rel(w.grad, dw_ref)}
        lim = fast_path_rtol(torch.bfloat16)
        tail = y[int(lay.offs_E[-1]):]
        exact = w.grad[1].abs().max().item() == 0 and (tail == 0).all().item()
        return (max(errs.values()) <= lim and exact,
                " ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f" (limit {lim:.1e}); empty expert dW = 0 and "
                f"padding rows 0: {exact}; compiled quantisers: {fused.compiles(DEV)}")
    check(f"experts {preset} fwd+bwd (E,D,2F)=({E},{D},{2 * F})", run)


def quantiser_agreement() -> tuple[bool, str]:
    """The compiled quantisers (``precision.fused``) against quant.py's eager definitions on this GPU, element for
    element, for every operand role of the linear and the experts: how many E4M3 codes and scales differ. Compiled
    with eager's division rounding (``fused.INDUCTOR_OPTIONS``) they must be equal: any difference is a FAIL, and
    ``benchmarks/fp8_division_rounding.py`` shows what one does to the GEMMs."""
    from moetrain.precision.quant import WHOLE, quantise_groups
    torch.manual_seed(0)
    M, K, N, E = 1000, 384, 48, 4
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV)
    w3 = torch.randn(E, N, K, device=DEV)
    roles = {"x 1x128": (x, (1, 128)), "dy^T 1x128": (dy.t(), (1, 128)), "W 128x128": (w, (128, 128)),
             "expert rows": (x, (1, WHOLE)), "expert W rows": (w3, (1, WHOLE)),
             "expert W^T rows": (w3.transpose(-2, -1), (1, WHOLE))}
    worst, parts = 0.0, []
    xq = quantise(x, (1, 128))
    pairs = {name: (fused.quantise(t, tile), quantise(t, tile)) for name, (t, tile) in roles.items()}
    pairs["x^T requantised 1x128"] = (fused.requantise_t(xq, (1, 128)), quantise(xq.dequantise().t(), (1, 128)))
    for name, (got, want) in pairs.items():
        codes = codes_differing(got, want) / got.data.numel()
        scales = (got.scale != want.scale).float().mean().item()
        worst = max(worst, codes, scales)
        parts.append(f"{name} {codes:.1e}/{scales:.1e}")
    group = torch.arange(M, device=DEV) * E // M
    (d1, s1), (d0, s0) = fused.quantise_by_group(x, group, E, "fp32", 1, True), quantise_groups(x, group, E)
    codes = (d1.float() != d0.float()).float().mean().item()
    worst = max(worst, codes, (s1 != s0).float().mean().item())
    parts.append(f"per-group columns {codes:.1e}")
    return worst == 0, "share of differing codes/scales: " + ", ".join(parts) + " (allowed 0)"


def raw_empty_group() -> tuple[bool, str]:
    a = torch.randn(64, 256, device=DEV).to(torch.float8_e4m3fn)      # (N, T)
    b = torch.randn(128, 256, device=DEV).to(torch.float8_e4m3fn)     # (K, T)
    offs = torch.tensor([128, 128, 256], device=DEV, dtype=torch.int32)  # group 1 empty
    ones = torch.ones(3 * 64, device=DEV), torch.ones(3 * 128, device=DEV)
    out = torch.empty(3, 64, 128, device=DEV, dtype=torch.bfloat16).fill_(float("nan"))
    del out  # a NaN-filled block freed just before: an unwritten output would likely show it
    y = torch._scaled_grouped_mm(a, b.t(), *ones, offs=offs, out_dtype=torch.bfloat16)
    zero = bool((y[1] == 0).all().item())
    return True, f"empty group's block is {'all zeros' if zero else 'NOT zeros (moetrain zeroes it)'}"


def time_linear() -> tuple[bool, str]:
    M, K, N = 4096, 7168, 2048
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device=DEV, requires_grad=True)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    wb = w.detach().bfloat16().requires_grad_()
    t0 = time.perf_counter()
    Fp8LinearFunction.apply(x, w, BLOCKWISE).backward(dy)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t8 = ms(lambda: Fp8LinearFunction.apply(x, w, BLOCKWISE).backward(dy))
    tb = ms(lambda: torch.nn.functional.linear(x, wb).backward(dy))
    return True, (f"(M,K,N)=({M},{K},{N}) fwd+bwd: fp8 {t8:.3f} ms, bf16 {tb:.3f} ms, bf16/fp8 {tb / t8:.2f}x "
                  f"(first call {first:.1f} s)")


def time_experts() -> tuple[bool, str]:
    E, rows, D, F = 8, 2048, 7168, 2048
    counts = [rows] * E
    tpe = torch.tensor(counts, device=DEV)
    lay = aligned_layout(tpe, E * rows, BLOCKWISE.group_align)  # no host counts: the training path's layout
    x = to_aligned(torch.randn(E * rows, D, device=DEV, dtype=torch.bfloat16), lay).requires_grad_()
    w = torch.randn(E, 2 * F, D, device=DEV, requires_grad=True)
    dy = torch.randn(lay.n_rows, 2 * F, device=DEV, dtype=torch.bfloat16)
    xb = torch.randn(E * rows, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dyb = torch.randn(E * rows, 2 * F, device=DEV, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    fp8_grouped_mm(x, w, lay.offs_E, BLOCKWISE, torch.bfloat16).backward(dy)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t8 = ms(lambda: fp8_grouped_mm(x, w, lay.offs_E, BLOCKWISE, torch.bfloat16).backward(dy))
    tb = ms(lambda: grouped_mm(xb, w, tpe).backward(dyb))  # the bf16 path of model/moe.py, fp32 master weight
    f8 = ms(lambda: fp8_grouped_mm(x.detach(), w.detach(), lay.offs_E, BLOCKWISE, torch.bfloat16))
    fb = ms(lambda: grouped_mm(xb.detach(), w.detach(), tpe))
    return True, (f"(E,rows,D,2F)=({E},{rows},{D},{2 * F}) fwd+bwd: fp8 {t8:.3f} ms, bf16 {tb:.3f} ms, "
                  f"bf16/fp8 {tb / t8:.2f}x; fwd only: fp8 {f8:.3f} ms, bf16 {fb:.3f} ms (first call {first:.1f} s)")


def time_expert_tilings() -> tuple[bool, str]:
    E, rows, D, N = 8, 2048, 7168, 4096
    x = torch.randn(E * rows, D, device=DEV)
    w = torch.randn(E, N, D, device=DEV)
    xr, wr = quantise(x, (1, 1 << 62)), quantise(w, (1, 1 << 62))
    offs = (torch.arange(1, E + 1, device=DEV) * rows).to(torch.int32)
    xb = [quantise(x[e * rows:(e + 1) * rows], (1, 128)) for e in range(E)]
    wb = [quantise(w[e], (128, 128)) for e in range(E)]
    t_row = ms(lambda: torch._scaled_grouped_mm(xr.data, wr.data.transpose(-2, -1), xr.scale.squeeze(-1),
                                                wr.scale.squeeze(-1), offs=offs, out_dtype=torch.bfloat16))
    t_blk = ms(lambda: [scaled_mm_fast(a, b, torch.bfloat16) for a, b in zip(xb, wb)])
    fl = 2 * E * rows * D * N
    return True, (f"(E,rows,K,N)=({E},{rows},{D},{N}): grouped row-wise {t_row:.3f} ms ({fl / t_row / 1e9:.0f} "
                  f"TFLOP/s), per-expert blockwise loop {t_blk:.3f} ms ({fl / t_blk / 1e9:.0f} TFLOP/s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eager", action="store_true", help="quantisers uncompiled (MOETRAIN_FP8_COMPILE=0)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to verify (the CPU tests cover the definitions)")
        return 0
    cap = torch.cuda.get_device_capability()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} sm{cap[0]}{cap[1]}, "
          f"compiled quantisers: {fused.compiles(DEV)}", flush=True)
    for preset in LINEARS:
        gemm_checks(preset)
        linear_check(preset)
        expert_check(preset)
    check("compiled quantisers equal the definitions", quantiser_agreement)
    check("raw 2d-2d empty group", raw_empty_group)
    check("time linear", time_linear)
    check("time experts", time_experts)
    check("time expert fprop: grouped row-wise vs per-expert blockwise", time_expert_tilings)
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=1))
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} ok, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
