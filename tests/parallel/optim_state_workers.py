"""Functions run on every rank by the optimizer-state tests (importable by spawned processes): the trainer's model
parts and optimizer at a layout and optimizer precision, trained, checkpointed and resumed."""

from __future__ import annotations

from typing import Any

import torch

from moetrain.parallel.parallelize import local_tensor
from moetrain.train.adamw import PrecisionAwareAdamW
from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moetrain.train.step import train_step

from .pipeline_workers import ACCUM, _full_params, batch, pipeline_model


def states_run(pcfg_kwargs: dict, run_dir: str, steps: range, save_at: int | None = None,
               resume: bool = False) -> dict[str, Any]:
    """Train the optimizer steps ``steps`` (resuming first from ``run_dir``'s newest checkpoint when ``resume``;
    saving one there after step ``save_at - 1``). Returns the losses, the full parameters (as held) and the fp32
    masters (the optimizer's view), and the dtypes this rank holds."""
    job, ctx, per, mp, opt = pipeline_model(pcfg_kwargs)
    if resume:
        load_checkpoint(latest_checkpoint(run_dir), mp, opt, ctx)
    grads: set[str] = set()  # the gradients' dtypes as each optimizer step finds them (train_step clears them)
    for o in opt.optimizers:
        def step(o=o, inner=o.step):
            grads.update(str(local_tensor(p.grad).dtype) for g in o.param_groups for p in g["params"]
                         if p.grad is not None)
            return inner()
        o.step = step
    losses = []
    for i in steps:
        data = batch(i, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)]
        losses.append(train_step(mp, opt, mbs, job.model, ctx).loss)
        if save_at == i + 1:
            save_checkpoint(run_dir, i + 1, mp, opt, {"model_config": job.model.to_dict()}, ctx)
    states = [st for o in opt.optimizers for st in o.state.values()]
    held = {str(local_tensor(p).dtype) for part in mp.parts for p in part.parameters()}
    moments = {str(local_tensor(st["exp_avg"]).dtype) for st in states}
    masters = [o.master(p).clone() if isinstance(o, PrecisionAwareAdamW) else local_tensor(p.detach()).clone()
               for o in opt.optimizers for g in o.param_groups for p in g["params"]]
    state_bytes = sum(local_tensor(v).numel() * local_tensor(v).element_size()
                      for st in states for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"losses": losses, "params": _full_params(mp, ctx), "held": held, "grads": grads, "moments": moments,
            "masters": masters, "state_bytes": state_bytes,
            "numel": sum(local_tensor(p).numel() for part in mp.parts for p in part.parameters())}
