"""Proposed speed patches to ``src/moetrain``, applied by monkeypatching so the suite can measure them (rows
``moetrain+patch``) before anyone edits ``src/``. Each patch replaces one function with the body proposed for it;
BENCHMARKS.md carries the same changes as diffs. Nothing here changes results beyond floating-point rounding.
"""

from __future__ import annotations

from typing import Callable

PATCHES: dict[str, Callable[[], None]] = {}
DESCRIPTIONS: dict[str, str] = {}


def patch(name: str, description: str):
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        PATCHES[name] = fn
        DESCRIPTIONS[name] = description
        return fn
    return deco


def apply(names: list[str]) -> None:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}")
    for n in names:
        PATCHES[n]()


@patch("wgrad_layout", "moetrain.model.moe._GroupedMM.backward: compute the weight gradient directly in the "
       "parameter's (E, N, K) layout (grad^T @ x per expert) and hand autograd its transposed view, so the "
       "gradient of w1_EFD / w3_EFD / w2_EDF arrives contiguous; today it arrives as a transposed (E, K, N) tensor "
       "that AccumulateGrad copies into a new contiguous tensor (3 strided copies of every expert weight per step)")
def _wgrad_layout() -> None:
    import torch

    from moetrain.model import moe

    def backward(ctx, grad_SN):  # type: ignore[no-untyped-def]
        x_SK, w_EKN, offs_E = ctx.saved_tensors
        grad_SN = grad_SN.contiguous()
        grad_x = torch._grouped_mm(grad_SN, w_EKN.transpose(-2, -1), offs=offs_E) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            # (E, N, K) = grad_e^T @ x_e: the layout of the stored parameter (w_EKN is its transposed view).
            grad_w = torch._grouped_mm(grad_SN.t(), x_SK, offs=offs_E).transpose(-2, -1)
        return grad_x, grad_w, None

    moe._GroupedMM.backward = staticmethod(backward)


@patch("skip_row_mask", "moetrain.model.moe.grouped_mm: zero the rows past offs[-1] only when there are any. "
       "moetrain's dispatchers never produce such rows (capacity padding fills each expert's slot and counts it), "
       "yet every grouped GEMM paid a full-size torch.where in forward and another in backward. On the CPU the "
       "check is free (offs is in host memory); on CUDA the torch.where stays, to keep the path free of syncs")
def _skip_row_mask() -> None:
    import torch

    from moetrain.model import moe

    original = moe.grouped_mm

    def grouped_mm(x_SK, w_EKN, tokens_per_expert_E, counts=None, use_grouped_mm=True):  # type: ignore[no-untyped-def]
        n_rows = x_SK.shape[0]
        if (x_SK.device.type == "cpu" and use_grouped_mm
                and moe._grouped_mm_supported(x_SK, x_SK.shape[-1], w_EKN.shape[-1])):
            offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
            y = moe._GroupedMM.apply(x_SK, w_EKN.to(x_SK.dtype), offs_E)
            if int(offs_E[-1]) == n_rows:
                return y
            return torch.where((torch.arange(n_rows, device=y.device) < offs_E[-1]).unsqueeze(-1), y, 0)
        return original(x_SK, w_EKN, tokens_per_expert_E, counts, use_grouped_mm)

    moe.grouped_mm = grouped_mm


@patch("grad_norm_foreach", "moetrain.train.step.grad_norm_and_clip: torch._foreach_norm + torch._foreach_mul_ "
       "instead of g.float().pow(2).sum() and g.mul_(scale) per parameter (no full-size temporary per parameter; "
       "squaring tiny gradients into subnormal floats made pow() up to 10x slower on x86)")
def _grad_norm_foreach() -> None:
    import math

    import torch

    from moetrain.parallel.parallelize import local_tensor
    from moetrain.train import step

    def grad_norm_and_clip(params, max_norm, ctx):  # type: ignore[no-untyped-def]
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        device = grads[0].device if grads else ctx.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            sq = torch.stack(norms).square().sum()
        total = math.sqrt(float(step._all_reduce(sq, ctx, "gradient-norm all-reduce")))
        if max_norm > 0 and total > max_norm and grads:
            torch._foreach_mul_(grads, max_norm / (total + 1e-6))
        return total

    step.grad_norm_and_clip = grad_norm_and_clip


@patch("fused_adamw", "moetrain.train.optim.build_optimizer: fused=True (one fused kernel per parameter group, "
       "CPU and CUDA) instead of the for-loop implementation (foreach=False); parameter groups additionally split "
       "into expert / non-expert weights so that every group lives on one device mesh under expert parallelism")
def _fused_adamw() -> None:
    import torch

    from moetrain.train import optim

    def build_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8):  # type: ignore[no-untyped-def]
        buckets: dict[tuple[bool, bool], list] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                buckets.setdefault((p.ndim >= 2, ".experts.w" in name), []).append(p)
        groups = [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
                  for (decay, _expert), ps in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
        fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused, foreach=False if not fused else None)

    optim.build_optimizer = build_optimizer


DEFAULT: list[str] = ["wgrad_layout", "skip_row_mask", "grad_norm_foreach", "fused_adamw"]
