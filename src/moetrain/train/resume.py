"""Resume safety: a resumed run continues the same run or is refused with what changed and how to go on.

A checkpoint records the learning-rate schedule (its job config) and its data (tokenizer hash and vocabulary, the
prepared data's key); ``moetrain train --resume`` compares them with the new job before any worker starts.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

from moetrain.config import JobConfig, read_config_file
from moetrain.data.mixture import train_loader
from moetrain.data.prepare import PreparedData
from moetrain.data.tokenizer import file_sha256
from moetrain.model.config import ConfigError
from moetrain.train.config import TrainConfig
from moetrain.train.optim import lr_at


#: TrainConfig fields that define the learning-rate schedule (``moetrain.train.optim.lr_at``).
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "schedule")


def check_schedule_unchanged(ckpt: Path, state: dict[str, Any], job: JobConfig) -> None:
    """Refuse a resume that changes the learning-rate schedule, unless ``train.allow_schedule_change``: a changed
    lr, min_lr, warmup or schedule, or more steps under a decaying schedule (cosine and WSD stretch over
    ``train.steps``, so the LR at the resume step would jump), where the LR of a step still to run differs (a run
    extended inside its warm-up keeps every LR, and resumes).

    Raises:
        ConfigError: naming each changed field, the LR at the resume step before and after, and the two ways on.
    """
    saved = state.get("job", {}).get("train")
    if not saved or job.train.allow_schedule_change:
        return
    tc = job.train
    changed = [f"train.{f}: {saved[f]!r} -> {getattr(tc, f)!r}" for f in SCHEDULE_FIELDS
               if f in saved and saved[f] != getattr(tc, f)]
    if "steps" in saved and saved["steps"] != tc.steps and tc.schedule != "constant":
        changed.append(f"train.steps: {saved['steps']} -> {tc.steps} (the {tc.schedule} schedule stretches over it)")
    if not changed:
        return
    step = int(state.get("step", 0))

    def lrs(s: int) -> tuple[float, float]:  # the LR at step s under the checkpoint's schedule and the new one
        return (lr_at(s, lr=saved["lr"], min_lr=saved["min_lr"], warmup_steps=saved["warmup_steps"],
                      total_steps=saved["steps"], schedule=saved["schedule"]),
                lr_at(s, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps,
                      schedule=tc.schedule))

    # Only the steps still to run matter: e.g. a run still in its warm-up extended by a few steps keeps every LR
    first = next((s for s in range(step, tc.steps) if operator.ne(*lrs(s))), None)
    if first is None:
        return

    def shown(s: int) -> tuple[str, str]:
        a, b = lrs(s)
        digits = 3 if f"{a:.3g}" != f"{b:.3g}" else 7
        return f"{a:.{digits}g}", f"{b:.{digits}g}"

    if first == step:
        where = "the LR at step {} goes from {} to {}".format(step, *shown(step))
    else:
        where = (f"the LR at step {step} stays {shown(step)[0]}, but at step {first} goes from "
                 f"{' to '.join(shown(first))}")
    raise ConfigError(f"resuming {ckpt} would change the learning-rate schedule ({'; '.join(changed)}): {where}. "
                      f"Resume with the run's settings, or accept the change with --set "
                      f"train.allow_schedule_change=true")


def check_same_tokenizer_file(ckpt: Path, state: dict[str, Any], job: JobConfig) -> None:
    """The early form of :func:`check_same_data` for a given ``data.tokenizer`` file: compared by hash before the
    corpus is tokenised with it.

    Raises:
        ConfigError: the file is not the tokenizer the checkpoint was trained with.
    """
    want = (state.get("data") or {}).get("tokenizer_sha256")
    path = Path(job.data.tokenizer)
    if want and path.is_file() and file_sha256(path) != want:
        raise _tokenizer_changed(ckpt, state["data"], f"--tokenizer {path}", file_sha256(path), job)


def _tokenizer_changed(ckpt: Path, data: dict[str, Any], now: str, sha: str, job: JobConfig) -> ConfigError:
    return ConfigError(
        f"{ckpt} was trained with another tokenizer ({data.get('tokenizer_vocab_size')} tokens, sha256 "
        f"{data['tokenizer_sha256'][:12]}) than {now} (sha256 {sha[:12]}); resume with the run's own tokenizer "
        f"(--tokenizer {Path(job.train.out_dir) / 'tokenizer.json'}), or start a new run with another --out")


def check_same_data(ckpt: Path, state: dict[str, Any], prep: PreparedData, job: JobConfig) -> None:
    """Refuse a resume whose tokenizer or training data differ from the checkpoint's (the loader position would
    point into another token stream). Checkpoints written before these were recorded are not checked.

    Raises:
        ConfigError: what changed, and how to resume or start a new run.
    """
    data = state.get("data")
    if not data:
        return
    sha = file_sha256(prep.tokenizer_path)
    if data.get("tokenizer_sha256") not in (None, sha):
        raise _tokenizer_changed(ckpt, data, f"this run's ({prep.vocab_size} tokens)", sha, job)
    key = Path(prep.data_dir).name
    if data.get("data_key") not in (None, key):
        raise ConfigError(
            f"{ckpt} was trained on other data (prepared data {data['data_key']}, now {key}: the sources, their "
            f"sizes or modification times, or data.text_field changed); resume with the same data, or start a new "
            f"run with another --out")


def check_same_stream(ckpt: Path, state: dict[str, Any], prep: PreparedData, job: JobConfig) -> None:
    """Refuse, before any worker starts, a resume whose saved loader state does not continue this data's stream
    (another sequence length or seed, a mixture whose sources or weights changed, a mixture resumed on
    ``data.paths`` or the reverse): the loader's own check, run on a loader of this data.

    Raises:
        ConfigError: the loader's reason, naming the checkpoint.
    """
    saved = state.get("loader")
    if not saved:
        return
    loader = train_loader(prep, job.data.seq_len, 1, seed=job.data.seed)
    try:
        loader.load_state_dict(saved)
    except ValueError as e:
        reason = str(e).split("; ")[0]  # the loader's own advice is for its Python callers
        raise ConfigError(f"cannot resume {ckpt}: {reason}; resume with the run's data settings (data.sources, "
                          f"their weights, data.seed), or start a new run with another --out") from None


def data_fingerprint(prep: PreparedData) -> dict[str, Any]:
    """What a checkpoint records of its data, for :func:`check_same_data`."""
    return {"tokenizer_sha256": file_sha256(prep.tokenizer_path), "tokenizer_vocab_size": prep.vocab_size,
            "data_key": Path(prep.data_dir).name}


#: What beside a ``config.toml`` shows that its folder is a run directory (the trainer saves the job config there).
RUN_DIR_MARKS = ("checkpoints", "metrics.jsonl")


def check_run_config_copy(config: str | Path, out_given: bool, resume: bool) -> None:
    """Refuse ``--config RUN/config.toml`` without ``--out`` when RUN is not the run that saved it.

    The trainer saves the job, ``train.out_dir`` included, as ``config.toml`` in the run directory. A copied (or
    moved) run directory keeps the original's ``out_dir``: training from the copy's config would write into the
    original. So a ``config.toml`` that sits in a run directory (``checkpoints/`` or ``metrics.jsonl`` beside it)
    and whose ``train.out_dir`` (relative to the working directory, as the trainer reads it) is another folder is
    refused unless ``out_given`` (``--out`` or ``--set train.out_dir=``) says where to train. Other job files, and
    a run's config used from the run's own folder, are not concerned.

    Raises:
        ConfigError: naming the file, the run that saved it, and the two ``--out`` choices.
    """
    p = Path(config)
    here = p.parent
    if out_given or p.name != "config.toml" or not any((here / m).exists() for m in RUN_DIR_MARKS):
        return
    out_dir = read_config_file(p).get("train", {}).get("out_dir", TrainConfig.out_dir)
    orig = Path(out_dir).resolve()
    if orig == here.resolve():
        return
    verb = "resume" if resume else "train in"
    if not orig.exists():
        raise ConfigError(f"{p} was saved by the run in {orig} (train.out_dir), which does not exist: this folder "
                          f"was copied or moved; add --out {here} to {'resume it' if resume else 'train'} in this folder")
    raise ConfigError(f"{p} was saved by the run in {orig} (train.out_dir); this folder is a copy: add --out {here} "
                      f"to {verb} the copy, or --out {orig} to continue the original")
