"""Per-GEMM error of the FP8 recipes: which GEMMs of the tiny (or any) preset lose most to FP8.

``python benchmarks/fp8_gemm_errors.py [--preset tiny] [--recipe blockwise] [--checkpoint RUN_DIR]``

Runs one forward and backward of the high-precision model on a batch of the built-in-style synthetic data while
recording every FP8-eligible linear's input x, weight W and output gradient dy, then computes for each linear the
relative Frobenius error ||FP8 - exact|| / ||exact|| of its three GEMMs with the recipe's quantisation
(fprop x W^T, dgrad dy W, wgrad dy^T x; ``moetrain.precision.quant.fake_quantise`` with the recipe's tiles, as
``precision.linear`` computes them). Routed experts are reported per layer for their fprop through
``precision.grouped.fp8_expert_swiglu`` against the exact SwiGLU. Prints the table sorted by the largest error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moetrain.model.config import get_preset  # noqa: E402
from moetrain.model.experts import GroupedExperts, _swiglu  # noqa: E402
from moetrain.model.transformer import build_model  # noqa: E402
from moetrain.precision.apply import MLA_PROJECTIONS, SWIGLU_LINEARS  # noqa: E402
from moetrain.precision.grouped import fp8_expert_swiglu  # noqa: E402
from moetrain.precision.quant import fake_quantise  # noqa: E402
from moetrain.precision.recipe import get_recipe  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def gemm_errors(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, recipe_name: str
                ) -> list[tuple[str, float, float, float]]:
    """(module name, fprop, dgrad, wgrad relative errors) of every FP8-eligible linear; experts: (name, fprop, nan,
    nan). ``model`` is the high-precision model (not converted); one fp32 forward and backward is run."""
    r = get_recipe(recipe_name)
    assert r is not None
    names = set(SWIGLU_LINEARS) | set(MLA_PROJECTIONS) | {"eh_proj"}
    seen: dict[str, dict[str, torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in names:
            rec = seen.setdefault(name, {})
            hooks.append(mod.register_forward_hook(lambda m, i, o, rec=rec: rec.update(x=i[0].detach())))
            hooks.append(mod.register_full_backward_hook(lambda m, gi, go, rec=rec: rec.update(dy=go[0].detach())))
        if isinstance(mod, GroupedExperts):
            rec = seen.setdefault(name, {"experts": torch.ones(())})
            hooks.append(mod.register_forward_hook(lambda m, i, o, rec=rec: rec.update(x=i[0].detach(), tpe=i[1])))
    out = model(tokens, labels)
    out.loss(model.cfg).backward()
    for h in hooks:
        h.remove()
    rows = []
    mods = dict(model.named_modules())
    for name, rec in seen.items():
        mod = mods[name]
        if "experts" in rec:
            x, tpe = rec["x"].float(), rec["tpe"]
            w13, w2 = mod.w13_E2FD.detach(), mod.w2_EDF.detach()
            exact = torch.cat([_swiglu(xe @ w13[e].t()) @ w2[e].t()
                               for e, xe in enumerate(torch.split(x, tpe.tolist()))])
            fp8 = fp8_expert_swiglu(x, w13, w2, tpe, r, torch.float32, tpe.tolist())
            rows.append((name, _rel(fp8[: exact.shape[0]], exact), float("nan"), float("nan")))
            continue
        x = rec["x"].reshape(-1, rec["x"].shape[-1]).float()
        dy = rec["dy"].reshape(-1, rec["dy"].shape[-1]).float()
        w = mod.weight.detach().float()
        xq = fake_quantise(x, r.row_tile, r.fmt)
        fprop = _rel(xq @ fake_quantise(w, r.weight_fprop_tile, r.fmt).t(), x @ w.t())
        dgrad = _rel(fake_quantise(dy, r.row_tile, r.fmt) @ fake_quantise(w, r.weight_dgrad_tile, r.fmt), dy @ w)
        x_w = xq if r.requantise_saved_input else x
        wgrad = _rel(fake_quantise(dy, r.col_tile, r.fmt).t() @ fake_quantise(x_w, r.col_tile, r.fmt), dy.t() @ x)
        rows.append((name, fprop, dgrad, wgrad))
    return sorted(rows, key=lambda t: -max(v for v in t[1:] if v == v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--recipe", default="blockwise", choices=("blockwise", "mxfp8"))
    ap.add_argument("--checkpoint", default=None, help="a HF export directory to load weights from (default: init)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    model = build_model(cfg, device="cpu")
    if args.checkpoint:
        from moetrain.interop.hf import load_hf_checkpoint
        load_hf_checkpoint(model, args.checkpoint)
    tok = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
    rows = gemm_errors(model, tok[:, :-1], tok[:, 1:], args.recipe)
    w = max(len(r[0]) for r in rows)
    print(f"FP8 {args.recipe} per-GEMM relative error, {args.preset}, {args.batch}x{args.seq_len} tokens")
    print(f"{'module':<{w}}  {'fprop':>8}  {'dgrad':>8}  {'wgrad':>8}")
    for name, f, d, g in rows:
        print(f"{name:<{w}}  {f:8.4f}  {d:8.4f}  {g:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
