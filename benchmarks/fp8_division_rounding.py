"""How an approximate fp32 division in the FP8 quantisers moves the FP8 linear's results, on a CPU.

``python benchmarks/fp8_division_rounding.py [--json PATH]``, about a minute on 2 cores.

Why: Triton lowers an fp32 ``x / s`` to ``div.full.f32`` (up to 2 ulp off the IEEE quotient) unless inductor's
``eager_numerics.division_rounding`` is set (torch/_inductor/config.py). The first H200 run measured the FP8
linear's dW 3.3e-3 to 6.3e-3 of max |dW| off the definition at fp32 output (BENCHMARKS.md, "GPU (NVIDIA H200)"),
while the same kernel on the same operands was within 4.3e-4. This script shows that a quotient rounded another way
accounts for errors of that size at the gpu_check's shapes: it quantises the linear's operands per the definition
(``quant.fake_quantise``: IEEE division) and with the quotient taken as ``x * (1 / s)`` (a correctly rounded
reciprocal times x, within 1.5 ulp: one model of an approximate division, not Triton's own code), and prints per
preset shape:

* the share of quotients within one fp32 ulp of an E4M3 rounding midpoint (where any other rounding of x / s may
  change the code);
* how many E4M3 codes change, per operand (x for fprop; dy^T and the requantised x^T for wgrad);
* y, dx and dW of the reciprocal version against the definition's, relative to max |.| (fp32 GEMMs on both sides,
  so the difference is the operands').

It does not show what the GPU's code does; ``benchmarks/gpu_check.py``'s row "compiled quantisers equal the
definitions" does, on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetrain.precision import quant as q  # noqa: E402

#: The (M tokens, K in, N out) of benchmarks/fp8_gpu_verify.py's linear check per preset.
SHAPES = {"tiny": (1000, 128, 48), "small": (2048, 768, 288), "deepseek-v3-671b": (4096, 7168, 576)}


def fake_quantise(x: torch.Tensor, tile: tuple[int, int], reciprocal: bool) -> torch.Tensor:
    """``quant.fake_quantise`` (fp32 scales), with the quotient x / s taken as x * (1 / s) when ``reciprocal``."""
    xt, s = q._tiled_with_scales(x, tile, "fp32")
    v = xt * torch.reciprocal(s) if reciprocal else xt / s
    return q._untiled(q._round_to_e4m3_(v.clamp_(-q.E4M3_MAX, q.E4M3_MAX)).mul_(s), x.shape)


def near_midpoint_share(x: torch.Tensor, tile: tuple[int, int]) -> float:
    """Share of x / s (IEEE) within one fp32 ulp of an E4M3 rounding midpoint: rounding the next fp32 value up and
    the next one down gives different E4M3 values."""
    xt, s = q._tiled_with_scales(x, tile, "fp32")
    v = (xt / s).clamp_(-q.E4M3_MAX, q.E4M3_MAX)
    up = q.round_to_e4m3(torch.nextafter(v, torch.full_like(v, 1e9)))
    down = q.round_to_e4m3(torch.nextafter(v, torch.full_like(v, -1e9)))
    return (up != down).float().mean().item()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run(name: str, M: int, K: int, N: int) -> dict:
    torch.manual_seed(0)  # the gpu check's data: bf16 x and dy, fp32 weight
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K) * 0.05
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    out = {}
    for recip in (False, True):
        xq = fake_quantise(x, (1, 128), recip)
        ops = {"x": xq, "w": fake_quantise(w, (128, 128), recip), "dy": fake_quantise(dy, (1, 128), recip),
               "dy^T": fake_quantise(dy.t(), (1, 128), recip), "x^T": fake_quantise(xq.t(), (1, 128), recip)}
        out[recip] = ops | {"y": ops["x"] @ ops["w"].t(), "dx": ops["dy"] @ ops["w"],
                            "dW": ops["dy^T"] @ ops["x^T"].t()}
    a, b = out[False], out[True]
    return {"shape": name, "M": M, "K": K, "N": N,
            "near_midpoint_share_x": near_midpoint_share(x, (1, 128)),
            "codes_changed": {k: int((a[k] != b[k]).sum()) for k in ("x", "w", "dy", "dy^T", "x^T")},
            "rel_error": {k: rel(b[k], a[k]) for k in ("y", "dx", "dW")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    for name, (M, K, N) in SHAPES.items():
        r = run(name, M, K, N)
        rows.append(r)
        e, c = r["rel_error"], r["codes_changed"]
        print(f"{name:17s} (M,K,N)=({M},{K},{N}): {r['near_midpoint_share_x']:.2%} of x's quotients within 1 ulp of "
              f"a midpoint; codes changed {c}; y {e['y']:.1e} dx {e['dx']:.1e} dW {e['dW']:.1e} of max", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
