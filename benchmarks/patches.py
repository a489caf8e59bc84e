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


_ABSENT = object()


def _set(obj: object, attr: str, value: object) -> None:
    """setattr that remembers the original, so :func:`restore` can undo every patch."""
    _SAVED.append((obj, attr, vars(obj).get(attr, getattr(obj, attr, _ABSENT))))
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
        if value is _ABSENT:
            delattr(obj, attr)
        else:
            setattr(obj, attr, value)
    _EXPERT_FLAGS.update(bmm=False, w13=False)


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


_EXPERT_FLAGS = {"bmm": False, "w13": False}


def _install_experts_forward() -> None:
    """One replacement of GroupedExperts.forward serving both expert patches; each patch switches its flag on."""
    import torch
    import torch.nn.functional as F

    from moetrain.model import moe

    if getattr(moe.GroupedExperts.forward, "_bench_patch", False):
        return
    original_forward = moe.GroupedExperts.forward
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

    def swiglu_in(self, mm, x):  # type: ignore[no-untyped-def]
        """silu(x w1^T) * (x w3^T) with ``mm(x, w_ENK)`` one grouped/batched GEMM; fused: one GEMM on [w1; w3]."""
        if _EXPERT_FLAGS["w13"] and hasattr(self, "w13_E2FD"):
            h13 = mm(x, self.w13_E2FD)
            h1, h3 = h13.chunk(2, dim=-1)
            return F.silu(h1) * h3
        return F.silu(mm(x, self.w1_EFD)) * mm(x, self.w3_EFD)

    def forward(self, x_SD, tokens_per_expert_E):  # type: ignore[no-untyped-def]
        dtype = moe._compute_dtype(x_SD)
        x_SD = x_SD.to(dtype)
        cpu = x_SD.device.type == "cpu"
        if not self.use_grouped_mm or not (_EXPERT_FLAGS["bmm"] and cpu or _EXPERT_FLAGS["w13"]):
            return original_forward(self, x_SD, tokens_per_expert_E)
        E, S, D = tokens_per_expert_E.shape[0], x_SD.shape[0], x_SD.shape[-1]
        if _EXPERT_FLAGS["bmm"] and cpu:
            counts = tokens_per_expert_E.tolist()  # free: the tensor is in host memory
            n = sum(counts)
            C = max(counts) if counts else 0
            if n == S and n > 0 and E * C <= max_pad * n:
                if min(counts) == C:
                    slot_S = None
                    x_ECD = x_SD.reshape(E, C, D)
                else:
                    starts_E = tokens_per_expert_E.cumsum(0) - tokens_per_expert_E
                    expert_S = torch.repeat_interleave(torch.arange(E), tokens_per_expert_E, output_size=n)
                    slot_S = expert_S * C + (torch.arange(n) - starts_E[expert_S])
                    x_ECD = x_SD.new_zeros(E * C, D).index_copy(0, slot_S, x_SD).view(E, C, D)
                mm = lambda a, w: _BmmT.apply(a, w.to(dtype))  # noqa: E731
                y = mm(swiglu_in(self, mm, x_ECD), self.w2_EDF).reshape(E * C, D)  # padding rows are never read
                return y if slot_S is None else y.index_select(0, slot_S)
        if not moe._grouped_mm_supported(x_SD, self.w1_EFD.shape[1], self.w1_EFD.shape[2]):
            return original_forward(self, x_SD, tokens_per_expert_E)
        offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        mm = lambda a, w: moe._GroupedMM.apply(a, w.to(dtype).transpose(1, 2), offs_E)  # noqa: E731
        y = mm(swiglu_in(self, mm, x_SD), self.w2_EDF)
        if cpu and int(offs_E[-1]) == S:
            return y  # no rows past offs[-1] (free to check on the CPU): nothing to zero
        return torch.where((torch.arange(S, device=y.device) < offs_E[-1]).unsqueeze(-1), y, 0)

    forward._bench_patch = True  # type: ignore[attr-defined]
    _set(moe.GroupedExperts, "forward", forward)


@patch("cpu_experts_bmm", "moetrain.model.moe.GroupedExperts.forward, CPU only: place each expert's rows in a "
       "slot padded to the largest group ONCE, run the SwiGLU as batched GEMMs (torch.bmm over (E, C, D)) and "
       "gather the real rows back ONCE, instead of torch._grouped_mm calls, whose CPU kernel is a loop of "
       "separately threaded small per-expert mm calls. Weight gradients are computed in the parameters' own layout "
       "(no transposed copy in AccumulateGrad). Equal groups need no copy at all (a view). If padding would add more "
       "than 25% rows (a skewed router) it keeps torch._grouped_mm but skips the full-size torch.where that zeroes "
       "rows past offs[-1] when there are none (moetrain's dispatchers never produce any). CUDA is unchanged")
def _cpu_experts_bmm() -> None:
    _install_experts_forward()
    _EXPERT_FLAGS["bmm"] = True


@patch("fused_gate_up", "moetrain.model.moe.GroupedExperts: store the gate and up projections as ONE parameter "
       "w13_E2FD = [w1; w3] (E, 2F, D), as HF's gate_up_proj, and compute them with one grouped GEMM of N = 2F "
       "instead of two of N = F: a third fewer per-expert GEMM calls in forward and backward, each twice as wide. "
       "w1_EFD / w3_EFD stay available as views (so init, slicing and the loss are unchanged); the parameter name "
       "changes, so interop/checkpoint name tables need the split (see BENCHMARKS.md)")
def _fused_gate_up() -> None:
    import torch
    from torch import nn

    from moetrain.model import moe
    _install_experts_forward()
    _EXPERT_FLAGS["w13"] = True
    if "w13_E2FD" in getattr(moe.GroupedExperts, "_bench_fused", ()):
        return

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:  # type: ignore[no-untyped-def]
        nn.Module.__init__(self)
        self.n_experts = n_experts
        self._hidden = hidden_dim
        self.w13_E2FD = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.use_grouped_mm = True

    original_normal = torch.nn.init.normal_

    def normal_(tensor, mean=0.0, std=1.0, generator=None):  # type: ignore[no-untyped-def]
        # The views w1_EFD / w3_EFD are strided; fill a contiguous buffer so that init_weights draws exactly the
        # numbers it draws for separate parameters (the fused model then computes the same function).
        if tensor.is_contiguous():
            return original_normal(tensor, mean, std, generator)
        with torch.no_grad():
            tensor.copy_(original_normal(torch.empty_like(tensor, memory_format=torch.contiguous_format), mean, std,
                                         generator))
        return tensor

    from moetrain.parallel import parallelize
    original_keep = parallelize._keep_local_experts

    def _keep_local_experts(experts, offset, n_local):  # type: ignore[no-untyped-def]
        if not hasattr(experts, "w13_E2FD"):
            return original_keep(experts, offset, n_local)
        if n_local == experts.n_experts:
            return
        for name in ("w13_E2FD", "w2_EDF"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full.detach()[offset:offset + n_local].clone()))
        experts.n_experts = n_local

    _set(parallelize, "_keep_local_experts", _keep_local_experts)
    _set(torch.nn.init, "normal_", normal_)
    _set(moe.GroupedExperts, "__init__", __init__)
    _set(moe.GroupedExperts, "w1_EFD", property(lambda self: self.w13_E2FD[:, :self._hidden]))
    _set(moe.GroupedExperts, "w3_EFD", property(lambda self: self.w13_E2FD[:, self._hidden:]))
    _set(moe.GroupedExperts, "_bench_fused", ("w13_E2FD",))


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


DEFAULT: list[str] = ["cpu_experts_bmm", "fused_gate_up", "wgrad_layout", "grad_norm_foreach", "fused_adamw"]
