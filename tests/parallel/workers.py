"""Functions run on every rank by the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import os
from typing import Any

import torch

from moetrain.model.config import tiny
from moetrain.model.transformer import build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import check_same_config, init_parallel
from moetrain.parallel.parallelize import full_state_dict, parallelize
from moetrain.parallel.pipeline import build_stages
from moetrain.train.optim import build_optimizer
from moetrain.train.runners import single_stage_parts
from moetrain.train.step import train_step

GLOBAL_SEQS = 8
SEQ_LEN = 32


def tiny_test_config(**overrides: Any):
    # Larger alpha and bias rate than V3's so that both mechanisms visibly act within 3 steps.
    base = dict(vocab_size=256, balance_loss_alpha=1e-2, bias_update_rate=1e-2, max_seq_len=64)
    base.update(overrides)
    return tiny().replace(**base)


def global_batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_SEQS, SEQ_LEN + 1), generator=g)


def train_run(pcfg_kwargs: dict, steps: int = 3, accum: int = 2, model_overrides: dict | None = None,
              force_one_rank: bool = False, adam_eps: float = 1e-8) -> dict:
    """Train the tiny model for ``steps`` optimizer steps on deterministic data; return losses and full params."""
    cfg = tiny_test_config(**(model_overrides or {}))
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts)
    check_same_config(ctx, {"model": cfg.to_dict(), "parallel": pcfg_kwargs})
    model = build_model(cfg, seed=0)
    if force_one_rank:
        _force_routing_to_first_experts(model, cfg)
    model = whole_model_stage(model, ctx)
    opt = build_optimizer(model, lr=3e-3, eps=adam_eps)
    mp = single_stage_parts(model, ctx)
    per_rank = GLOBAL_SEQS // ctx.world_size
    losses, stats = [], []
    for step in range(steps):
        data = global_batch(step, cfg.vocab_size)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(accum)]
        r = train_step(mp, opt, mbs, cfg, ctx)
        losses.append(r.loss)
        stats.append({"dropped": r.dropped_tokens, "loads": r.tokens_per_expert_ME})
    comm = [{"a2a": m.dispatcher.stats.a2a_seconds, "exposed": m.dispatcher.stats.exposed_seconds,
             "calls": m.dispatcher.stats.calls, "rows_sent": m.dispatcher.stats.rows_sent,
             "remote_rows_sent": m.dispatcher.stats.remote_rows_sent} for m in model.moe_layers()]
    return {"losses": losses, "params": full_state_dict(model, ctx), "stats": stats, "comm": comm}


def whole_model_stage(model, ctx):
    """``model`` as the one pipeline stage the trainer runs without pipelining, parallelized on ``ctx``."""
    stage = build_stages(model, ctx.pcfg, ctx.pp_rank)[0]
    return parallelize(stage, ctx)


def _force_routing_to_first_experts(model, cfg) -> None:
    """Bias every router so all tokens pick experts 0..K-1 (all on EP rank 0)."""
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.expert_bias.zero_()
            moe.gate.expert_bias[: cfg.top_k] = 100.0


class _OneMoE(torch.nn.Module):
    """One MoE layer as a model: parallelize() expects moe_layers(), moe_indices() and blocks()."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def moe_layers(self):
        return [self.layer]

    def moe_indices(self):
        return [0]

    def blocks(self):
        return []

    def forward(self, x):
        return self.layer(x)


def moe_layer_run(pcfg_kwargs: dict, tokens_per_rank: int = 24, routing_bias: float = 0.0, data_world: int = 2
                  ) -> dict:
    """One MoE layer forward+backward on inputs laid out for ``data_world`` ranks (a single process takes them all);
    returns outputs, input gradients and full parameter gradients (gathered)."""
    import torch.distributed as dist

    from moetrain.model.moe import MoE
    from moetrain.parallel.parallelize import full_state_dict

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts)
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    layer.gate.expert_bias.normal_(0, routing_bias) if routing_bias else None

    model = parallelize(_OneMoE(layer), ctx)
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(data_world * 2, tokens_per_rank // 2, cfg.dim, generator=g)
    w_all = torch.randn(data_world * 2, tokens_per_rank // 2, cfg.dim, generator=g)
    mine = slice(ctx.rank * 2, (ctx.rank + 1) * 2) if ctx.distributed else slice(None)
    x = x_all[mine].clone().requires_grad_(True)
    y, stats = model(x)
    (y * w_all[mine]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        gr = p.grad
        if gr is not None:
            # FSDP summed every gradient over its ranks; experts are (dp, ep)-sharded DTensors, gathered whole here
            gr = gr.full_tensor() if hasattr(gr, "full_tensor") else gr
            grads[name.replace("layer.", "")] = gr.detach().clone()
    st = layer.dispatcher.stats
    return {"y": y.detach(), "x_grad": x.grad.detach(), "grads": grads, "counts": stats.tokens_per_expert_E,
            "dropped": int(stats.dropped), "rows_sent": st.rows_sent, "remote_rows_sent": st.remote_rows_sent}


def a2a_calls_run(pcfg_kwargs: dict) -> tuple[int, int]:
    """(forward, backward) ``all_to_all_single`` calls of one MoE layer under ``pcfg_kwargs``, counted by wrapping
    torch.distributed.all_to_all_single (the only all-to-all moetrain's dispatcher uses)."""
    import torch.distributed as dist

    from moetrain.model.moe import MoE

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts)
    torch.manual_seed(0)
    layer = MoE(cfg)

    model = parallelize(_OneMoE(layer), ctx)
    calls = [0]
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        x = torch.randn(2, 6, cfg.dim, requires_grad=True)
        y, _ = model(x)
        fwd = calls[0]
        y.sum().backward()
        return fwd, calls[0] - fwd
    finally:
        dist.all_to_all_single = real


DEDUP_E, DEDUP_K, DEDUP_T, DEDUP_D = 8, 3, 12, 5


def dedup_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Crafted routing for EP = 2 over E = 8 experts (4 per rank), K = 3: tokens 0-2 have all their experts on rank
    0, tokens 3-4 all on rank 1, the rest random. Returns (x_TD, idx_TK, w_TK, expert matrices W_EDD)."""
    E, K, T, D = DEDUP_E, DEDUP_K, DEDUP_T, DEDUP_D
    g = torch.Generator().manual_seed(rank)
    idx_TK = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    idx_TK[:3] = torch.tensor([2, 0, 1])
    idx_TK[3:5] = torch.tensor([5, 7, 4])
    x_TD = torch.randn(T, D, generator=g)
    w_TK = torch.rand(T, K, generator=g)
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(99))  # same "experts" on every rank
    return x_TD, idx_TK, w_TK, W_EDD


def dedup_expert_reference(x_TD, idx_TK, w_TK, W_EDD) -> torch.Tensor:
    """y_t = sum_k w_tk * x_t @ W[idx_tk], computed directly."""
    return (w_TK.unsqueeze(-1) * torch.einsum("td,tkde->tke", x_TD, W_EDD[idx_TK])).sum(dim=1)


def dedup_rows_run(overlap: bool = True) -> dict:
    """The all-to-all dispatcher alone, both paths, on :func:`dedup_inputs` routing at EP = 2: what each sent,
    what the experts received, the combined output and the gradients of sum(y^2) w.r.t. x and the gate weights."""
    from moetrain.parallel.dispatch import AllToAllDispatcher

    ctx = init_parallel(ParallelConfig(ep=2), DEDUP_E)
    x_TD, idx_TK, w_TK, W_EDD = dedup_inputs(ctx.rank)
    out: dict[str, Any] = {}
    for dedup in (True, False):
        d = AllToAllDispatcher(DEDUP_E, 2, ctx.ep_rank, ctx.ep_group, overlap=overlap, dedup=dedup)
        assert d.dedup == dedup
        x, w = x_TD.clone().requires_grad_(True), w_TK.clone().requires_grad_(True)
        x_AD, counts_El, state = d.dispatch(x, idx_TK, w).wait()
        expert_A = torch.repeat_interleave(torch.arange(d.n_local_experts), counts_El) + d.local_expert_offset
        y_AD = torch.bmm(x_AD.unsqueeze(1), W_EDD[expert_A]).squeeze(1)
        y_TD = d.combine(y_AD, state).wait()
        gx, gw = torch.autograd.grad((y_TD * y_TD).sum(), [x, w])
        out["dedup" if dedup else "per_assignment"] = {
            "send_splits": state.send_splits, "x_AD": x_AD.detach(), "counts": counts_El, "y": y_TD.detach(),
            "x_grad": gx, "w_grad": gw, "rows_sent": d.stats.rows_sent, "remote_rows_sent": d.stats.remote_rows_sent,
            "calls": d.stats.calls, "a2a": d.stats.a2a_seconds, "exposed": d.stats.exposed_seconds}
    return out


def mismatched_config_run() -> str:
    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=1), cfg.n_routed_experts)
    lr = 1e-3 if ctx.rank == 0 else 2e-3
    check_same_config(ctx, {"model": cfg.to_dict(), "lr": lr})
    return "no error"


def hang_in_dispatch_run() -> str:
    """Rank 1 never enters the MoE layer: rank 0's dispatch must time out with an error naming the phase. On 4 ranks
    (DP=2 x EP=2) the dispatch runs on the EP sub-group (ranks 0, 1), which must carry the configured 3 s too.

    No FSDP here, so that the first collective rank 0 waits in is the dispatcher's own."""
    import time

    from moetrain.model.moe import MoE
    from moetrain.parallel.dispatch import AllToAllDispatcher
    from moetrain.parallel.parallelize import place_experts

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2, timeout_s=3), cfg.n_routed_experts)
    torch.manual_seed(0)
    layer = MoE(cfg)
    layer.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, 2, ctx.ep_rank, ctx.ep_group)
    place_experts(layer.experts, ctx)
    if ctx.rank == 1:
        time.sleep(8)
        return "slept"
    layer(torch.randn(1, 8, cfg.dim))
    return "no error"


def mesh_timeouts_run() -> dict:
    """The timeout of every group of the mesh, in seconds."""
    from moetrain.parallel.mesh import group_timeout

    ctx = init_parallel(ParallelConfig(ep=2, timeout_s=7), 8)
    groups = {"pp": ctx.mesh["pp"], "dp": ctx.edp_mesh, "ep": ctx.ep_mesh, "dp_ep": ctx.fsdp_mesh}
    return {k: group_timeout(m.get_group()).total_seconds() for k, m in groups.items()}


def meta_build_run(pcfg_kwargs: dict, init_from: str | None = None, tokens: torch.Tensor | None = None) -> dict:
    """Build the tiny model as ``moetrain train`` does (meta -> parallelize -> materialise shards -> optional HF
    weights); return its full (gathered) weights, the local parameter count and, given ``tokens``, the logits."""
    from moetrain.config import JobConfig
    from moetrain.parallel.parallelize import local_numel
    from moetrain.train.config import TrainConfig
    from moetrain.train.trainer import build_sharded_model

    if init_from:
        from moetrain.interop.hf import load_hf_config
        cfg = load_hf_config(init_from)
    else:
        cfg = tiny_test_config()
    job = JobConfig(model=cfg, parallel=ParallelConfig(**pcfg_kwargs), train=TrainConfig(seed=0))
    ctx = init_parallel(job.parallel, cfg.n_routed_experts, device="cpu")
    model = build_sharded_model(job, ctx, None, init_from=init_from)
    out = {"params": full_state_dict(model, ctx), "local_numel": local_numel(model)}
    if tokens is not None:
        model.eval()
        with torch.no_grad():
            out["logits"] = model(tokens, return_logits=True).logits_BLV
    return out


def mixed_precision_run() -> dict:
    """One forward + backward with FSDP2 mixed precision (bf16 parameters for compute, fp32 reduction): the dtypes
    each stage sees."""
    from moetrain.model.transformer import build_model as _build

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2), cfg.n_routed_experts, device="cpu")
    model = _build(cfg, seed=0)
    parallelize(model, ctx, param_dtype=torch.bfloat16)
    seen = {}

    def hook(mod, args):
        seen.setdefault("compute", str(mod.weight.dtype))
    model.layers[0].self_attn.o_proj.register_forward_pre_hook(hook)
    tokens = global_batch(0, cfg.vocab_size)[ctx.rank * 4:(ctx.rank + 1) * 4]
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.lm_loss_sum.backward()
    p = model.layers[0].self_attn.o_proj.weight
    e = model.moe_layers()[0].experts.w13_E2FD
    return {"compute": seen["compute"], "stored": str(p.dtype), "grad": str(p.grad.dtype),
            "expert_stored": str(e.dtype), "expert_grad": str(e.grad.dtype), "loss": float(out.lm_loss_sum.detach())}


def stall_in_dense_layer_run() -> str:
    """DP=2 under FSDP2: rank 1 stalls inside the first (dense) layer's forward, so rank 0 waits in the next FSDP
    parameter all-gather; its error must name the forward phase, not be a raw gloo message."""
    import time

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=1, timeout_s=3), cfg.n_routed_experts)
    model = whole_model_stage(build_model(cfg, seed=0), ctx)
    if ctx.rank == 1:
        model.layers["0"].mlp.register_forward_pre_hook(lambda *_: time.sleep(10))
    opt = build_optimizer(model, lr=1e-3)
    data = global_batch(0, cfg.vocab_size)[ctx.rank * 4:(ctx.rank + 1) * 4]
    train_step(single_stage_parts(model, ctx), opt, [(data[:, :-1], data[:, 1:])], cfg, ctx)
    return "no error"


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor requiring grad inside ``obj``, looking into tensors, tuples (NamedTuples too), lists, dicts and
    dataclass instances -- everything a module output may hold."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return []
    return [t for item in items for t in _grad_tensors(item)]


def fsdp_outputs_run(as_stage: bool) -> dict:
    """Forward + backward of the parallelized tiny model (EP=2, MTP, balance loss) with a forward hook on every
    FSDP2-wrapped module, comparing the grad-requiring tensors of its output with those
    ``torch.utils._pytree.tree_flatten`` finds: torch 2.11's FSDP2 registers its pre-backward all-gather on exactly
    those. ``as_stage``: the whole model as one ``TransformerStage`` (what the pipeline runs) instead of the
    ``Transformer``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._pytree import tree_flatten

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2), cfg.n_routed_experts)
    model = build_model(cfg, seed=0)
    part = build_stages(model, ctx.pcfg, ctx.pp_rank)[0] if as_stage else model
    parallelize(part, ctx)
    checked, missed = [], []

    def check(mod: torch.nn.Module, _args: Any, output: Any) -> None:
        want = {id(t) for t in _grad_tensors(output)}
        seen = {id(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad}
        checked.append((type(mod).__name__, len(want)))
        if want - seen:
            missed.append(f"{type(mod).__name__}: {len(want - seen)} of {len(want)} output tensors hidden in "
                          f"{type(output).__name__}")
    wrapped = [m for m in part.modules() if isinstance(m, FSDPModule)]
    for m in wrapped:
        m.register_forward_hook(check)
    data = global_batch(0, cfg.vocab_size)[ctx.rank * 4:(ctx.rank + 1) * 4]
    x, y = data[:, :-1], data[:, 1:]
    out = part(tokens_BL=x, labels_BL=y) if as_stage else part(x, y)
    loss = out.sum() if as_stage else out.loss(cfg)
    loss.backward()
    grads = sum(1 for p in part.parameters() if p.grad is not None)
    # the root, every block (main and MTP) and every MoE layer's experts
    expected = 1 + cfg.n_layers + cfg.mtp_depth + cfg.n_moe_layers + cfg.mtp_depth
    return {"wrapped": len(wrapped), "expected": expected, "checked": checked, "missed": missed, "grads": grads,
            "params": sum(1 for _ in part.parameters())}
