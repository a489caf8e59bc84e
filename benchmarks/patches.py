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


_SAVED: list[tuple[object, str, object]] = []


def _set(obj: object, attr: str, value: object) -> None:
    """setattr that remembers the original, so :func:`restore` can undo every patch."""
    _SAVED.append((obj, attr, obj.__dict__[attr] if attr in vars(obj) else getattr(obj, attr)))
    setattr(obj, attr, value)


def apply(names: list[str]) -> None:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}")
    for n in names:
        PATCHES[n]()


def restore() -> None:
    """Undo every applied patch (latest first)."""
    while _SAVED:
        obj, attr, value = _SAVED.pop()
        setattr(obj, attr, value)


class patched:
    """``with patched(names): ...`` applies the patches for the block only."""

    def __init__(self, names: list[str]):
        self.names = names

    def __enter__(self) -> None:
        restore()
        apply(self.names)

    def __exit__(self, *exc: object) -> None:
        restore()


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

    _set(moe._GroupedMM, "backward", staticmethod(backward))


@patch("cpu_experts_bmm", "moetrain.model.moe.GroupedExperts.forward, CPU only: place each expert's rows in a "
       "slot padded to the largest group ONCE, run the SwiGLU as three batched GEMMs (torch.bmm over (E, C, D)) and "
       "gather the real rows back ONCE, instead of three torch._grouped_mm calls, whose CPU kernel is a loop of "
       "separately threaded small per-expert mm calls. Weight gradients are computed in the parameters' own layout "
       "(no transposed copy in AccumulateGrad). Equal groups need no copy at all (a view). If padding would add more "
       "than 25% rows (a skewed router) it keeps torch._grouped_mm but skips the full-size torch.where that zeroes "
       "rows past offs[-1] when there are none (moetrain's dispatchers never produce any). CUDA is unchanged")
def _cpu_experts_bmm() -> None:
    import torch
    import torch.nn.functional as F

    from moetrain.model import moe

    if getattr(moe.GroupedExperts.forward, "_bench_patch", False):
        return
    original_forward = moe.GroupedExperts.forward
    original_grouped_mm = moe.grouped_mm
    max_pad = 1.25

    class _BmmT(torch.autograd.Function):
        """y_ECN = x_ECK @ w_ENK^T, with the weight gradient produced in w_ENK's (stored) layout."""

        @staticmethod
        def forward(ctx, x_ECK, w_ENK):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x_ECK, w_ENK)
            return torch.bmm(x_ECK, w_ENK.transpose(1, 2))

        @staticmethod
        def backward(ctx, g_ECN):  # type: ignore[no-untyped-def]
            x_ECK, w_ENK = ctx.saved_tensors
            g_ECN = g_ECN.contiguous()
            gx = torch.bmm(g_ECN, w_ENK) if ctx.needs_input_grad[0] else None
            gw = torch.bmm(g_ECN.transpose(1, 2), x_ECK) if ctx.needs_input_grad[1] else None
            return gx, gw

    def forward(self, x_SD, tokens_per_expert_E):  # type: ignore[no-untyped-def]
        if x_SD.device.type != "cpu" or not self.use_grouped_mm:
            return original_forward(self, x_SD, tokens_per_expert_E)
        counts = tokens_per_expert_E.tolist()  # free: the tensor is in host memory
        E, n, S, D = len(counts), sum(counts), x_SD.shape[0], x_SD.shape[-1]
        C = max(counts) if counts else 0
        if n != S or n == 0 or E * C > max_pad * n:
            return original_forward(self, x_SD, tokens_per_expert_E)
        if min(counts) == C:
            slot_S = None
            x_ECD = x_SD.reshape(E, C, D)
        else:
            starts_E = tokens_per_expert_E.cumsum(0) - tokens_per_expert_E
            expert_S = torch.repeat_interleave(torch.arange(E), tokens_per_expert_E, output_size=n)
            slot_S = expert_S * C + (torch.arange(n) - starts_E[expert_S])
            x_ECD = x_SD.new_zeros(E * C, D).index_copy(0, slot_S, x_SD).view(E, C, D)
        h_ECF = F.silu(_BmmT.apply(x_ECD, self.w1_EFD)) * _BmmT.apply(x_ECD, self.w3_EFD)
        y_ECD = _BmmT.apply(h_ECF, self.w2_EDF)  # padding rows stay zero and are never read
        y = y_ECD.reshape(E * C, D)
        return y if slot_S is None else y.index_select(0, slot_S)

    def grouped_mm(x_SK, w_EKN, tokens_per_expert_E, counts=None, use_grouped_mm=True):  # type: ignore[no-untyped-def]
        n_rows = x_SK.shape[0]
        if (x_SK.device.type == "cpu" and use_grouped_mm
                and moe._grouped_mm_supported(x_SK, x_SK.shape[-1], w_EKN.shape[-1])):
            offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
            y = moe._GroupedMM.apply(x_SK, w_EKN.to(x_SK.dtype), offs_E)
            if int(offs_E[-1]) == n_rows:
                return y  # no rows past offs[-1]: nothing to zero
            return torch.where((torch.arange(n_rows) < offs_E[-1]).unsqueeze(-1), y, 0)
        return original_grouped_mm(x_SK, w_EKN, tokens_per_expert_E, counts, use_grouped_mm)

    forward._bench_patch = True  # type: ignore[attr-defined]
    _set(moe.GroupedExperts, "forward", forward)
    _set(moe, "grouped_mm", grouped_mm)


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

    _set(step, "grad_norm_and_clip", grad_norm_and_clip)


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

    _set(optim, "build_optimizer", build_optimizer)


DEFAULT: list[str] = ["cpu_experts_bmm", "wgrad_layout", "grad_norm_foreach", "fused_adamw"]
