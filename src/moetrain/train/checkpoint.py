"""Atomic, resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<run>/checkpoints``::

    step_00000050/            complete checkpoint (DCP shards + .metadata + trainer_state.json + COMPLETE)
    .tmp-step_00000100/       a save in progress or interrupted: never read, removed by the next save

Atomicity: every rank writes into the temporary directory; after a barrier rank 0 writes ``trainer_state.json`` and
the ``COMPLETE`` marker, then renames the directory (an atomic rename on POSIX). A crash at any moment leaves the
newest *complete* checkpoint untouched, and "latest" is simply the highest-numbered directory with a marker.

Resharding: non-expert weights and their optimizer states are FSDP2 DTensors, which DCP reshards to any world size.
Expert weights live in per-rank slices (E/EP experts each), so they are saved one tensor per expert
(``...experts.w13_E2FD.<e>``, ``...experts.w2_EDF.<e>``); a run with another EP size loads exactly the experts it
holds. Hence resuming with a different EP (or DP) size works. Checkpoints written before the gate and up
projections were stacked (separate ``w1_EFD.<e>`` / ``w3_EFD.<e>`` keys) load into the stacked parameter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moetrain.fsutil import fsync_path
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import is_expert_param

STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or belongs to a different model."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir/checkpoints``, or None."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return max(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)


def _barrier(ctx: ParallelContext) -> None:
    if ctx.distributed:
        dist.barrier()


def _expert_info(model: Transformer) -> dict[str, tuple[int, int]]:
    """FQN prefix of each GroupedExperts -> (first global expert, number held here)."""
    info = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "dispatcher") and hasattr(mod, "experts"):
            info[f"{name}.experts"] = (mod.dispatcher.local_expert_offset, mod.dispatcher.n_local_experts)
    return info


def _owner(fqn: str, info: dict[str, tuple[int, int]]) -> tuple[int, int]:
    return info[fqn.rsplit(".", 1)[0]]


def _full_local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _split_experts(key: str, t: torch.Tensor, offset: int, n: int) -> dict[str, torch.Tensor]:
    """One entry per expert held here: ``<key>.<global expert id>`` -> that expert's (unsharded) slice."""
    full = _full_local(t.detach())
    return {f"{key}.{offset + i}": full[i].clone() for i in range(n)}


def _flat_state(model: Transformer, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP-ready flat dict plus the optimizer state dict it was built from (to write loaded values back)."""
    info = _expert_info(model)
    flat: dict[str, Any] = {}
    for fqn, t in model.state_dict().items():
        if is_expert_param(fqn):
            flat.update(_split_experts(f"model.{fqn}", t, *_owner(fqn, info)))
        else:
            flat[f"model.{fqn}"] = t
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    for fqn, st in osd["state"].items():
        for key, val in st.items():
            if is_expert_param(fqn) and isinstance(val, torch.Tensor) and val.dim() > 0:
                flat.update(_split_experts(f"optim.{fqn}.{key}", val, *_owner(fqn, info)))
            else:
                flat[f"optim.{fqn}.{key}"] = val
    return flat, osd


def save_checkpoint(out_dir: str | Path, step: int, model: Transformer, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], ctx: ParallelContext, keep: int = 2) -> Path:
    """Write ``step_<step>`` atomically (see module docstring); keep the newest ``keep`` complete checkpoints.

    ``trainer_state`` is JSON-serialisable (step, data-loader state, model config, ...), written by rank 0.
    Returns the final directory.
    """
    root = checkpoint_dir(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        # leftovers of an interrupted save or rotation: a stale trash directory would also make the rename of an
        # old checkpoint onto the same name fail ("directory not empty") after the new one is complete
        for stale in [*root.glob(".tmp-step_*"), *root.glob(".trash-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(ctx)
    flat, _ = _flat_state(model, optimizer)
    dcp.save(flat, checkpoint_id=str(tmp))
    _barrier(ctx)
    if ctx.is_main:
        state = dict(trainer_state, step=step, rng=torch.get_rng_state().tolist())
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        for f in tmp.iterdir():  # data on disk before the marker that declares it complete
            fsync_path(f)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        fsync_path(tmp / "COMPLETE")
        if final.exists():  # same step saved again: move the old one aside, never delete before replacing
            os.replace(final, root / f".trash-{final.name}")
        os.replace(tmp, final)
        fsync_path(root)
        done = sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()),
                      key=lambda p: p.name)
        for old in done[:-keep]:
            # Rename first: an interrupted delete must not leave a COMPLETE-marked directory missing shards.
            trash = root / f".trash-{old.name}"
            os.replace(old, trash)
        for trash in root.glob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)
    _barrier(ctx)
    return final


def check_checkpoint_files(path: str | Path) -> None:
    """Raise CheckpointError if a complete-marked checkpoint lacks its DCP metadata or a shard file."""
    path = Path(path)
    if not (path / ".metadata").is_file() or not list(path.glob("*.distcp")):
        raise CheckpointError(f"checkpoint {path} is damaged (DCP metadata or shards missing); delete that directory "
                              f"to resume from the previous one")


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "trainer_state.json"
    if not p.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    return json.loads(p.read_text())


def load_checkpoint(path: str | Path, model: Transformer, optimizer: torch.optim.Optimizer,
                    ctx: ParallelContext) -> dict[str, Any]:
    """Load model and optimizer state saved by :func:`save_checkpoint` into the current (possibly differently
    parallelized) model. Returns the trainer state. The caller checks model-config compatibility first.

    Raises:
        CheckpointError: incomplete checkpoint.
    """
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is incomplete (no COMPLETE marker); refusing to load it")
    _init_optimizer_state(model, optimizer)
    flat, osd = _flat_state(model, optimizer)
    to_load, source_key = _with_legacy_expert_keys(flat, path)
    dcp.load(to_load, checkpoint_id=str(path))
    for key, t in flat.items():  # DCP loads tensors in place but replaces non-tensor values in the dict it is given
        if not isinstance(t, torch.Tensor):
            flat[key] = to_load[source_key.get(key, key)]
    info = _expert_info(model)
    with torch.no_grad():
        msd = model.state_dict()
        for fqn, t in msd.items():
            if is_expert_param(fqn):
                offset, n = _owner(fqn, info)
                _copy_into(t, torch.stack([flat[f"model.{fqn}.{offset + i}"] for i in range(n)]))
            elif not isinstance(t, DTensor) and flat[f"model.{fqn}"] is not t:
                t.copy_(flat[f"model.{fqn}"])
        for fqn, st in osd["state"].items():
            for key, val in st.items():
                if is_expert_param(fqn) and isinstance(val, torch.Tensor) and val.dim() > 0:
                    offset, n = _owner(fqn, info)
                    _copy_into(val, torch.stack([flat[f"optim.{fqn}.{key}.{offset + i}"] for i in range(n)]))
                else:
                    st[key] = flat[f"optim.{fqn}.{key}"]
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(flatten_optimizer_state_dict=False))
    state = read_trainer_state(path)
    torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
    return state


def _copy_into(dst: torch.Tensor, full_local: torch.Tensor) -> None:
    """Copy this rank's full expert slice into ``dst`` (a DTensor sharded over DP, or a plain tensor)."""
    if isinstance(dst, DTensor):
        src = distribute_tensor(full_local.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None)
        dst.to_local().copy_(src.to_local())
    else:
        dst.copy_(full_local)


def _with_legacy_expert_keys(flat: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """What to ask DCP for: ``flat``, except that every stacked-expert entry the checkpoint lacks is mapped to the two
    entries an older moetrain wrote for it -- ``...w13_E2FD.<e>`` (2F, D) <- ``...w1_EFD.<e>`` (F, D) into rows
    [0, F) and ``...w3_EFD.<e>`` into rows [F, 2F), as views, so DCP loads straight into the stacked tensors; the
    optimizer's step count of w13 comes from w1's (both were stepped together). Also returns, for each remapped
    scalar, the key it is loaded under."""
    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    out: dict[str, Any] = {}
    source_key: dict[str, str] = {}
    for key, t in flat.items():
        k1, k3 = key.replace(".w13_E2FD.", ".w1_EFD."), key.replace(".w13_E2FD.", ".w3_EFD.")
        if key in stored or k1 == key or k1 not in stored:
            out[key] = t
        elif not isinstance(t, torch.Tensor) or t.dim() == 0:
            out[k1], source_key[key] = t, k1
        else:
            half = t.shape[0] // 2
            out[k1], out[k3] = t[:half], t[half:]
    return out, source_key


def _init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's lazily-built state (zeros) so DCP has tensors to load into; parameters are unchanged."""
    if optimizer.state:
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    wds = [g.get("weight_decay", 0.0) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr, wd in zip(optimizer.param_groups, saved, wds):
        g["lr"], g["weight_decay"] = lr, wd
