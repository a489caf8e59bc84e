"""Atomic, resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<run>/checkpoints``::

    step_00000050/            complete checkpoint (DCP shards + .metadata + trainer_state.json + checksums.json +
                              COMPLETE)
    .tmp-step_00000100/       a save in progress or interrupted: never read, removed by the next save

Atomicity: every rank writes into the temporary directory; after a barrier rank 0 writes ``trainer_state.json``, the
files' checksums (hashed while DCP wrote them: :mod:`moetrain.train.checksums`) and the ``COMPLETE`` marker, then
renames the directory (an atomic rename on POSIX). A crash at any moment leaves the newest *complete* checkpoint
untouched, and "latest" is simply the highest-numbered directory with a marker. Resume and export read every byte
against the checksums first (:func:`verify_checkpoint`).

Resharding without gathering: every weight and optimizer state is saved as what it is -- a DTensor (FSDP2 shards,
and routed experts sharded on the expert dim over EP and on dim 1 over DP) or a plain tensor in one process -- under
its global shape, keys ``model.<fqn>`` and ``optim.<fqn>.<state>``. DCP writes each rank's local box and, on load,
reads into each rank's box whatever layout wrote it, so a run resumes at another EP, DP (and later PP) size and no
rank ever holds more than its shard plus one saved chunk in flight. Weights are saved as fp32 masters whatever the
optimizer states (``parallel.optimizer``): bf16 weights under ``bf16`` states are saved joined with their 16-bit
remainders and split again on load, and the Adam moments load into the running run's dtype, so any optimizer
precision resumes from any other (:mod:`moetrain.train.adamw`). Checkpoints of earlier moetrain versions (one
entry per expert, ``<key>.<e>``; before that separate ``w1_EFD`` / ``w3_EFD`` halves) load too, each rank reading only
the boxes of its own experts.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from moetrain.errors import CheckpointError
from moetrain.fsutil import fsync_path
from moetrain.interop.dcp_safe import read_dcp_metadata, safe_load
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import local_tensor
from moetrain.precision.primary_weights import note_written, unwrapped
from moetrain.train.adamw import PrecisionAwareAdamW
from moetrain.train.checksums import MANIFEST, ChecksumWriter, FileSum, check_files, manifest_of, read_manifest

STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """The COMPLETE-marked ``step_<N>`` directories under ``out_dir/checkpoints``, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return sorted(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir/checkpoints``, or None."""
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None


def _barrier(ctx: ParallelContext) -> None:
    if ctx.distributed:
        dist.barrier()


def _pairs(model: Any, optimizer: Any) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """(module, optimizer) of every model part: one pair for a whole model, one per pipeline stage otherwise."""
    parts = getattr(model, "parts", None)
    if parts is None:
        return [(model, optimizer)]
    opts = getattr(optimizer, "optimizers", [optimizer])
    if len(opts) != len(parts):
        raise ValueError(f"{len(parts)} model parts but {len(opts)} optimizers")
    return list(zip(parts, opts))


#: Optimizer state entries a checkpoint leaves out: the bf16 weights' master remainders, since the checkpoint holds
#: the fp32 masters themselves under the parameters' names (any optimizer precision resumes from any other).
_DERIVED_STATE = ("master_remainder",)


class _Masters:
    """The fp32 masters of a part's bf16 parameters (optimizer states ``bf16``), as DTensors of the parameters'
    placement: what a checkpoint stores under their names, and where a load lands before :meth:`write_back`."""

    def __init__(self, part: torch.nn.Module, opt: Any):
        self.opt = opt
        self.by_fqn: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        if not isinstance(opt, PrecisionAwareAdamW):
            return
        for fqn, p in part.named_parameters():
            if p.dtype == torch.bfloat16:
                master = opt.master(p).clone()
                if isinstance(p, DTensor):
                    master = DTensor.from_local(master, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                stride=p.stride())
                self.by_fqn[fqn] = (p, master)

    def write_back(self) -> None:
        for p, master in self.by_fqn.values():
            self.opt.set_master(p, local_tensor(master))


def _flat_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], list[tuple[Any, Any, dict[str, Any]]],
                                                     list[tuple[str, Any]], list[_Masters]]:
    """DCP-ready flat dict of references to the live model and optimizer tensors (no copies but the fp32 masters of
    bf16 weights), keyed by global parameter names; the (part, optimizer, optimizer state dict) triples it was built
    from (to write loaded values back); the entries left out because another part of this rank has the same key (the
    last stage's embedding copy on the first stage's rank): they are saved once and loaded by copy; and each part's
    :class:`_Masters`."""
    flat: dict[str, Any] = {}
    built, dups, masters = [], [], []
    for part, opt in _pairs(model, optimizer):
        m = _Masters(part, opt)
        masters.append(m)
        local = {f"model.{fqn}": m.by_fqn[fqn][1] if fqn in m.by_fqn else unwrapped(t)
                 for fqn, t in part.state_dict().items()}
        osd = get_optimizer_state_dict(part, opt, options=StateDictOptions(flatten_optimizer_state_dict=False))
        for fqn, st in osd["state"].items():
            for key, val in st.items():
                if key not in _DERIVED_STATE:
                    local[f"optim.{fqn}.{key}"] = val
        for k, v in local.items():
            if k in flat:
                dups.append((k, v))
            else:
                flat[k] = v
        built.append((part, opt, osd))
    return flat, built, dups, masters


def _check_finite(flat: dict[str, Any], step: int, ctx: ParallelContext) -> None:
    """Refuse to save non-finite weights or optimizer states (a resume from them could only fail again): counted
    on every rank's shards and summed, so every rank refuses together.

    Raises:
        CheckpointError: the count and the first tensor holding one, with what to do.
    """
    keys, counts = [], []
    for k, v in flat.items():
        t = local_tensor(v) if isinstance(v, torch.Tensor) else None
        if t is not None and t.is_floating_point() and t.numel():
            keys.append(k)
            # on the device: one read for all of them below
            counts.append((t.numel() - torch.isfinite(t).sum()).to(ctx.device))
    per = torch.stack(counts) if counts else torch.zeros(0, dtype=torch.int64, device=ctx.device)
    total = per.sum().view(1)
    if ctx.distributed:
        dist.all_reduce(total)
    bad = int(total.item())
    if bad:
        mine = [k for k, n in zip(keys, per.tolist()) if n]
        raise CheckpointError(f"refusing to save step {step}: {bad:,} non-finite values in the model and optimizer "
                              f"state ({mine[0] if mine else 'on another rank'} among them); the checkpoints kept "
                              f"are finite: resume from the newest with a lower train.lr")


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
    flat, _, _, _ = _flat_state(model, optimizer)
    _check_finite(flat, step, ctx)
    try:
        writer = ChecksumWriter(tmp)
        dcp.save(flat, storage_writer=writer)
        sums = _gather_sums(writer.sums, ctx)  # also the barrier: every rank's files are written
        if ctx.is_main:
            state = dict(trainer_state, step=step, rng=torch.get_rng_state().tolist(), checksums=MANIFEST)
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            (tmp / MANIFEST).write_text(json.dumps(manifest_of(tmp, sums, ["trainer_state.json"])))
            for f in tmp.iterdir():  # data on disk before the marker that declares it complete
                fsync_path(f)
            (tmp / "COMPLETE").write_text(f"{step}\n")
            fsync_path(tmp / "COMPLETE")
    except (OSError, RuntimeError, CheckpointException) as e:
        raise _write_error(e, tmp, root) from None
    if ctx.is_main:
        if final.exists():  # same step saved again: move the old one aside, never delete before replacing
            os.replace(final, root / f".trash-{final.name}")
        os.replace(tmp, final)
        fsync_path(root)
        for old in complete_checkpoints(out_dir)[:-keep]:
            # Rename first: an interrupted delete must not leave a COMPLETE-marked directory missing shards.
            trash = root / f".trash-{old.name}"
            os.replace(old, trash)
        for trash in root.glob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)
    _barrier(ctx)
    return final


def _gather_sums(mine: dict[str, FileSum | None], ctx: ParallelContext) -> dict[str, FileSum | None]:
    """Every rank's file checksums (:class:`ChecksumWriter`), merged; each file is written by one rank."""
    if not ctx.distributed:
        return dict(mine)
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return {name: s for sums in every for name, s in sums.items()}


def _first_failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside a DCP ``CheckpointException`` (which wraps one per failed rank)."""
    if isinstance(e, CheckpointException):
        inner = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        return inner[0] if inner else e
    return e


def _write_error(e: BaseException, tmp: Path, root: Path) -> CheckpointError:
    """A failed checkpoint write as one message: how much disk is free (a full disk shows up in torch as
    "[enforce fail at inline_container.cc] unexpected pos ..."), that the previous checkpoint is intact, and what to
    do. The partial directory is removed to give the space back."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = -1
    shutil.rmtree(tmp, ignore_errors=True)
    e = _first_failure(e)
    prev = latest_checkpoint(root.parent)
    kept = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
    full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "unexpected pos" in str(e) or free < 64 * 2 ** 20
    if full:
        return CheckpointError(f"writing checkpoint {tmp.name.removeprefix('.tmp-')} failed: the disk is full "
                               f"({free / 2 ** 20:.0f} MiB free under {root}); {kept}. Free disk space (or lower "
                               f"train.keep_ckpts), then rerun with --resume")
    return CheckpointError(f"writing checkpoint {tmp.name.removeprefix('.tmp-')} under {root} failed "
                           f"({type(e).__name__}: {e}); {kept}")


def verify_checkpoint(path: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Check a complete-marked checkpoint before any tensor is loaded: the marker, a parseable trainer state, DCP
    metadata that loads, every shard file the metadata names present and long enough for the bytes it indexes (a
    missing or truncated shard is caught here, not 180 lines deep in DCP), and, with ``checksums``, every file's
    size and SHA-256 against ``checksums.json`` (:mod:`moetrain.train.checksums`; all bytes are read). A checkpoint
    of an earlier moetrain has no checksums: the sizes are all that is checked (:func:`has_checksums` tells).
    Returns the trainer state.

    Raises:
        CheckpointError: naming the file that is missing, damaged, too short or whose content changed.
    """
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is incomplete (no COMPLETE marker)")
    state = read_trainer_state(path)
    try:
        metadata = read_dcp_metadata(path)
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
        raise CheckpointError(f"{path / '.metadata'} is missing or damaged ({type(e).__name__}: {e})") from None
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"shard {f} is missing")
        if f.stat().st_size < size:
            raise CheckpointError(f"shard {f} is truncated ({f.stat().st_size} bytes, the metadata indexes {size})")
    manifest = read_manifest(path)
    if manifest is None and state.get("checksums"):
        raise CheckpointError(f"{path / MANIFEST} is missing (the trainer state says the save wrote it)")
    if checksums and manifest is not None:
        check_files(path, manifest)
    return state


def has_checksums(path: str | Path) -> bool:
    """Whether checkpoint ``path`` records its files' checksums (moetrain writes them since checkpoints verify
    their bytes; an earlier one is checked by size only)."""
    return (Path(path) / MANIFEST).is_file()


def resume_checkpoint(out_dir: str | Path, checksums: bool = True, exclude: Path | None = None
                      ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``out_dir`` that verifies (:func:`verify_checkpoint`, reading every byte
    with ``checksums``), and the newer ones skipped, each with the reason. (None, skipped) when none verifies.
    ``exclude``: a checkpoint left out (not read), e.g. one already found damaged."""
    skipped = []
    for p in reversed(complete_checkpoints(out_dir)):
        if exclude is not None and p.name == exclude.name:
            continue
        try:
            verify_checkpoint(p, checksums)
        except CheckpointError as e:
            skipped.append((p, str(e)))
            continue
        return p, skipped
    return None, skipped


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint.

    Raises:
        CheckpointError: the file is missing or not valid JSON (naming the file).
    """
    p = Path(path) / "trainer_state.json"
    if not p.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p} is damaged (not valid JSON: {e})") from None


def load_checkpoint(path: str | Path, model: Transformer, optimizer: torch.optim.Optimizer,
                    ctx: ParallelContext) -> dict[str, Any]:
    """Load model and optimizer state saved by :func:`save_checkpoint` into the current (possibly differently
    parallelized) model, in place, each rank reading its own boxes. Returns the trainer state. The caller checks
    model-config compatibility first.

    Raises:
        CheckpointError: incomplete checkpoint, or one DCP cannot read (its cause, and how to go on without it).
    """
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is incomplete (no COMPLETE marker); refusing to load it")
    for part, opt in _pairs(model, optimizer):
        _init_optimizer_state(part, opt)
    flat, built, dups, masters = _flat_state(model, optimizer)
    try:
        stored = read_dcp_metadata(path).state_dict_metadata
        legacy = {k: t for k, t in flat.items() if k not in stored and isinstance(t, torch.Tensor) and t.dim() > 0
                  and _EXPERT_KEY.search(k)}
        to_load = {k: t for k, t in flat.items() if k not in legacy}
        renamed = _legacy_scalar_keys(to_load, stored)
        safe_load(to_load, path)
        if legacy:
            _load_legacy_experts(path, legacy, stored)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, CheckpointException) as e:
        # CheckpointException derives from BaseException: uncaught, it would pass every `except Exception`
        raise _read_error(e, path) from None
    with torch.no_grad():
        loaded = {k: (legacy[k] if k in legacy else to_load[renamed.get(k, k)]) for k in flat}
        for k, t in dups:
            if isinstance(t, torch.Tensor):
                local_tensor(t).copy_(local_tensor(loaded[k]))
        for part, opt, osd in built:
            for fqn, st in osd["state"].items():
                for key in st:
                    k = f"optim.{fqn}.{key}"
                    if key in _DERIVED_STATE:
                        continue
                    if not isinstance(st[key], torch.Tensor) or k in renamed:
                        # DCP loads tensors in place but replaces non-tensor values in the dict it is given
                        st[key] = loaded[k]
            set_optimizer_state_dict(part, opt, osd,
                                     options=StateDictOptions(flatten_optimizer_state_dict=False))
        for m in masters:
            m.write_back()
        for part, _ in _pairs(model, optimizer):
            for p in part.parameters():
                note_written(p)  # DCP wrote the FP8 masters' storage directly
    state = read_trainer_state(path)
    torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
    return state


def _read_error(e: BaseException, path: Path) -> CheckpointError:
    """A checkpoint DCP could not read, as one line: which, the first rank's cause, and how to go on without it
    (resuming it again would fail the same way)."""
    cause = _first_failure(e)
    msg = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    if len(msg) > 120:  # the first sentence: torch's advice after it (weights_only=False ...) is not for this
        msg = msg.split(". ")[0]
    aside = path.with_name(f"damaged-{path.name}")
    return CheckpointError(f"checkpoint {path} cannot be read ({type(cause).__name__}: {msg}); it is damaged: move "
                           f"it aside (mv {path} {aside}) and rerun with --resume to continue from the checkpoint "
                           f"before it")


_EXPERT_KEY = re.compile(r"\.experts\.(w13_E2FD|w2_EDF)(\.|$)")


def _legacy_scalar_keys(to_load: dict[str, Any], stored: Any) -> dict[str, str]:
    """Scalar optimizer entries (AdamW's step) of the stacked w13 that a pre-stacking checkpoint keeps under w1's
    name (both were stepped together): load them from there. Returns {our key: stored key}."""
    renamed = {}
    for k in list(to_load):
        k1 = k.replace(".w13_E2FD.", ".w1_EFD.")
        if k not in stored and k1 != k and k1 in stored:
            to_load[k1] = to_load.pop(k)
            renamed[k] = k1
    return renamed


def _load_legacy_experts(path: Path, legacy: dict[str, torch.Tensor], stored: Any) -> None:
    """Fill expert tensors from a checkpoint that kept one entry per expert (``<key>.<e>``), or, older still,
    separate gate/up halves (``...w1_EFD.<e>`` rows [0, F) and ``...w3_EFD.<e>`` rows [F, 2F) of w13). Each rank reads
    only the boxes of its own local shard.

    Raises:
        CheckpointError: an expert entry is in neither layout.
    """
    from moetrain.interop.dcp_read import BoxRequest, read_boxes
    from moetrain.parallel.parallelize import shard_box

    requests = []
    for key, t in legacy.items():
        _, (e0, r0, c0), local = shard_box(t)
        F2 = t.shape[1]
        for i in range(local.shape[0]):
            e = e0 + i
            if f"{key}.{e}" in stored:
                requests.append(BoxRequest(f"{key}.{e}", (r0, c0), local[i]))
                continue
            k1, k3 = (f"{key}.{e}".replace(".w13_E2FD.", ".w1_EFD."), f"{key}.{e}".replace(".w13_E2FD.", ".w3_EFD."))
            if k1 == f"{key}.{e}" or k1 not in stored or k3 not in stored:
                raise CheckpointError(f"checkpoint {path} has no entry for {key} (expert {e}) in any known layout")
            half = F2 // 2
            rows = range(r0, r0 + local.shape[1])
            if rows.start < half:  # part of the local rows are gate rows
                n = min(rows.stop, half) - rows.start
                requests.append(BoxRequest(k1, (rows.start, c0), local[i, :n]))
            if rows.stop > half:
                start = max(rows.start, half)
                requests.append(BoxRequest(k3, (start - half, c0), local[i, start - rows.start:]))
    read_boxes(path, requests)


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
