"""``moetrain eval RUN_DIR [--data SPEC ...]``: next-token loss and perplexity of a run's checkpoint on held-out
text, per source and token-weighted over all.

Each ``--data`` is one source in the vocabulary of training's ``--source`` (:func:`moetrain.data.parse_source_spec`,
opened by :func:`moetrain.data.open_source`): a file or glob of .txt / .jsonl / .parquet, a Hugging Face ``datasets``
folder (``save_to_disk``, or Arrow/Parquet/JSON-lines files), or ``hub:NAME`` from the run's ``data.hf_cache_dir``,
with ``,split=``, ``,config=``, ``,text_field=`` as training takes them (a ``weight`` is ignored). Its documents are
tokenised with the run's tokenizer, each followed by the end-of-document token as in training, concatenated and cut
into the run's ``data.seq_len`` windows (:func:`moetrain.data.iter_eval_batches`' windows: the tail shorter than a
window is not scored); the loss is the main model's mean cross-entropy over every scored token, the quantity the
trainer's validation reports (no MTP, no balance term), and perplexity is exp(loss).

Without ``--data`` the run's own validation split is scored, read from the prepared data its checkpoint records
(:func:`moetrain.data.prepared_data`): one row per source of a mixture (each source's held-out documents), one row for
``data.paths`` / the built-in corpus.

One process by default (the checkpoint read whole, :mod:`moetrain.train.load`); with ``nproc`` the same windows run on
that many local workers at the EP / PP the user chooses, through the trainer's model parts and step runner (its
validation path, ``runner.eval_sums``), each rank reading its own boxes of the checkpoint. Both compute in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.config import JobConfig
from moetrain.data import (Tokenizer, count_windows, load_tokens, open_source, parse_source_spec, prepared_data,
                           validate_source)
from moetrain.data.corpus import DataError
from moetrain.errors import ConfigError
from moetrain.layout import Precision, Schedule
from moetrain.model.transformer import IGNORE_INDEX, Transformer
from moetrain.train.load import RunCheckpoint, load_run_model, open_run

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SourceLoss:
    """The loss of one source (or of all, token-weighted).

    Attributes:
        name: the ``--data`` argument, or "all".
        tokens: scored tokens (labels counted).
        loss: mean next-token cross-entropy in nats per token.
    """

    name: str
    tokens: int
    loss: float

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(self.loss) if self.loss < 700 else math.inf


@dataclass
class EvalReport:
    """What ``moetrain eval`` reports: the checkpoint, how it was run, and the loss per source and over all."""

    run_dir: str
    checkpoint: str
    step: int
    seq_len: int
    layout: str
    sources: list[SourceLoss] = field(default_factory=list)

    @property
    def total(self) -> SourceLoss:
        """All sources together, weighted by their scored tokens."""
        n = sum(s.tokens for s in self.sources)
        return SourceLoss("all", n, sum(s.loss * s.tokens for s in self.sources) / max(n, 1))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, each source and the total with its perplexity."""
        rows = [{**dataclasses.asdict(s), "perplexity": s.perplexity} for s in [*self.sources, self.total]]
        return {"run_dir": self.run_dir, "checkpoint": self.checkpoint, "step": self.step, "seq_len": self.seq_len,
                "layout": self.layout, "sources": rows[:-1], "total": rows[-1]}

    def table(self) -> str:
        """The report as a text table, one row per source and the total."""
        width = max(len(s.name) for s in [*self.sources, self.total])
        lines = [f"{self.checkpoint} (step {self.step}), {self.seq_len}-token windows, {self.layout}",
                 f"{'source':<{width}}  {'tokens':>10}  {'loss':>8}  {'perplexity':>11}"]
        for s in [*self.sources, self.total]:
            lines.append(f"{s.name:<{width}}  {s.tokens:>10,}  {s.loss:>8.4f}  {s.perplexity:>11.3f}")
        return "\n".join(lines)


def source_tokens(spec: str, tokenizer: Tokenizer, text_field: str = "text",
                  hf_cache_dir: str | None = None) -> np.ndarray:
    """The token stream of one ``--data`` source: every document's ids followed by the end-of-document id, in
    source order.

    Args:
        spec: a source as training's ``--source`` takes it (see the module docstring).
        text_field: the text key / column unless ``spec`` names its own. hf_cache_dir: where ``hub:`` names are read.

    Raises:
        ConfigError: a malformed spec. DataError: a source that does not exist, matches nothing or cannot be read
            (the message starts with ``--data SPEC``).
    """
    src = parse_source_spec(spec, "--data")
    try:
        validate_source(src, "--data")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    opened = open_source(src, src.text_field or text_field, hf_cache_dir, f"--data {spec}", "--data")
    ids: list[int] = []
    for doc in opened.documents():
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=np.int64)


def run_validation(run: RunCheckpoint) -> list[tuple[str, np.ndarray]]:
    """(row name, tokens) of the run's own validation split: each mixture source's held-out tokens, or the one
    validation file of ``data.paths`` / the built-in corpus, read from the preparation the checkpoint records.

    Raises:
        DataError: the checkpoint records no prepared data, or it is no longer in the run's ``data.cache_dir``
            (the message names ``--data``).
    """
    folder = run.data.get("data_key")
    if not folder:
        raise DataError(f"{run.path} records no validation data (written by an older moetrain); name held-out text "
                        "with --data PATH_OR_DIR_OR_hub:NAME")
    try:
        prep = prepared_data(run.job.data, folder)
    except DataError as e:
        raise DataError(f"{e}: {_cache_hint(run, folder)}, or name held-out text with --data "
                        "PATH_OR_DIR_OR_hub:NAME") from None
    if prep.sources:
        return [(f"{s.label} (validation)", np.asarray(load_tokens(s.val_path), dtype=np.int64))
                for s in prep.sources]
    label = ", ".join(map(str, run.job.data.paths)) or "built-in corpus"
    return [(f"{label} (validation)", np.asarray(load_tokens(prep.val_path), dtype=np.int64))]


def trained_in(run: RunCheckpoint) -> Path | None:
    """The directory the run was trained in, absolute: ``run_dir`` less the ``train.out_dir`` its job records,
    when that was relative and ``run_dir`` still ends with it; None when it cannot be told (an absolute
    ``out_dir``, or a run directory moved or renamed since)."""
    out = Path(os.path.expanduser(run.job.train.out_dir))
    here = run.run_dir.absolute().parts
    n = len(out.parts)
    if out.is_absolute() or ".." in out.parts or n == 0 or n >= len(here) or here[-n:] != out.parts:
        return None
    return Path(*here[:-n])


def _cache_hint(run: RunCheckpoint, folder: str) -> str:
    """Where the run's prepared data ``folder`` should be and how to evaluate there: the absolute
    ``data.cache_dir`` when the job records one, else the one of the directory the run was trained in."""
    cache = Path(os.path.expanduser(run.job.data.cache_dir))
    if cache.is_absolute():
        return f"the run was trained with data.cache_dir {cache}; restore {cache / folder}"
    origin = trained_in(run)
    if origin is None:
        return (f"the run was trained with data.cache_dir {str(cache)!r}, relative to the directory it was trained "
                f"in (which its recorded train.out_dir {run.job.train.out_dir!r} does not tell); run moetrain eval "
                f"from that directory")
    there = origin / cache / folder
    if there.is_dir():
        return (f"the run was trained in {origin}, whose cache holds it ({there}): cd {origin} and run moetrain "
                f"eval there")
    return f"nor is it in {origin / cache}, the cache of {origin} where the run was trained; restore {there}"


def rank_batches(tokens: np.ndarray, seq_len: int, micro_batch_size: int, rank: int = 0, size: int = 1,
                 max_batches: int | None = None) -> MicroBatches:
    """Rank ``rank`` of ``size``'s micro-batches (tokens_BL, labels_BL), each of exactly ``micro_batch_size`` rows:
    the source's windows dealt round-robin, every rank given the same number of batches, rows beyond the windows
    filled with ignored labels (pipeline stages need static shapes, expert parallelism the same number of forwards
    on every rank). Together the ranks score each window once, as one process does.

    ``max_batches``: score at most this many batches of one process's windows (the first ones)."""
    n = count_windows(len(tokens), seq_len)
    if max_batches is not None:
        n = min(n, max_batches * micro_batch_size)
    mine = list(range(rank, n, size))
    per_rank = -(-n // size)  # windows of the busiest rank
    out = []
    for lo in range(0, per_rank, micro_batch_size):
        x = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        y = torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        for row, w in enumerate(mine[lo:lo + micro_batch_size]):
            window = torch.from_numpy(tokens[w * seq_len: w * seq_len + seq_len + 1].astype(np.int64))
            x[row], y[row] = window[:-1], window[1:]
        out.append((x, y))
    return out


@torch.no_grad()
def model_loss_sums(model: Transformer, batches: MicroBatches) -> tuple[float, int]:
    """(cross-entropy sum in nats, scored tokens) of a single-process ``model`` over ``batches``."""
    device = model.embed_tokens.weight.device
    ce, n = 0.0, 0
    for x, y in batches:
        out = model(x.to(device), y.to(device))
        ce += float(out.lm_loss_sum)
        n += int(out.n_loss_tokens)
    return ce, n


def _sources(run: RunCheckpoint, data: list[str] | None, text_field: str | None) -> list[tuple[str, np.ndarray]]:
    """(row name, tokens) of each source: the ``--data`` specs, else the run's validation split."""
    if data:
        tok = run.tokenizer()
        named = [(src, source_tokens(src, tok, text_field or run.job.data.text_field, run.job.data.hf_cache_dir))
                 for src in data]
        fix = "give more text"
    else:
        if text_field is not None:
            raise ConfigError("--text-field names the text of --data sources; the run's validation split is "
                              "tokenised already: leave it out, or add --data")
        named = run_validation(run)
        fix = "evaluate on more text with --data"
    for name, tokens in named:
        if count_windows(len(tokens), run.job.data.seq_len) < 1:
            raise DataError(f"{'--data ' if data else ''}{name}: {len(tokens)} tokens, fewer than one "
                            f"{run.job.data.seq_len + 1}-token window of the run's data.seq_len; {fix}")
    return named


def evaluate_run(run_dir: str | os.PathLike, data: list[str] | None = None, step: int | None = None,
                 device: str = "cpu", micro_batch_size: int | None = None, max_batches: int | None = None,
                 nproc: int | None = None, ep: int | None = None, pp: int | None = None,
                 text_field: str | None = None) -> EvalReport:
    """Loss and perplexity of ``run_dir``'s newest checkpoint (or ``step``) on each source of ``data``.

    Args:
        data: source specs as training's ``--source`` takes them (see the module docstring), one report row each;
            None or empty: the run's own validation split, one row per source.
        micro_batch_size: sequences per forward (default: the run's ``train.micro_batch_size``).
        max_batches: score at most this many micro-batches per source (default: every full window).
        nproc, ep, pp: run on ``nproc`` local workers with that expert- and pipeline-parallel layout (the trainer's
            model parts and evaluation path); ``nproc`` defaults to ep x pp when either is given; all None: one
            process.
        text_field: the JSON-lines key / column holding the text of ``data`` (default: the run's ``data.text_field``).

    Raises:
        CheckpointError: no (verifiable) checkpoint. DataError: a source that cannot be read, or shorter than one
        window; no ``data`` and no recorded validation split. ConfigError: a malformed source spec; a layout that
        does not fit the model or the processes; ``max_batches``, ``micro_batch_size``, ``nproc``, ``ep`` or ``pp``
        below 1.
    """
    # Checked before anything is read: 0 batches reported loss 0 and perplexity 1 over 0 tokens, and a micro-batch
    # size of 0 silently meant the run's.
    for flag, v, unset in (("--max-batches", max_batches, "every window"),
                           ("--micro-batch-size", micro_batch_size, "the run's"),
                           ("--nproc", nproc, "one process"), ("--ep", ep, "1"), ("--pp", pp, "1")):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be >= 1 (leave it out for {unset})")
    run = open_run(run_dir, step)
    seq_len = run.job.data.seq_len
    mbs = micro_batch_size or run.job.train.micro_batch_size
    named = _sources(run, data, text_field)
    tokens = [t for _, t in named]
    if nproc is None and (ep or pp):
        nproc = (ep or 1) * (pp or 1)
    if nproc is None:
        model = load_run_model(run, device)
        sums = [model_loss_sums(model, rank_batches(t, seq_len, mbs, max_batches=max_batches)) for t in tokens]
        layout = f"one process on {device}"
    else:
        from moetrain.train.launch import launch_local
        job = _layout_job(run.job, nproc, ep, pp, device, mbs)
        sums = launch_local(job, _eval_worker, job.to_dict(), str(run.path), tokens, mbs, max_batches)
        layout = f"{nproc} processes, EP={job.parallel.ep} PP={job.parallel.pp} on {device}"
    report = EvalReport(str(run_dir), str(run.path), run.step, seq_len, layout)
    report.sources = [SourceLoss(name, n, ce / max(n, 1)) for (name, _), (ce, n) in zip(named, sums)]
    return report


def _layout_job(job: JobConfig, nproc: int, ep: int | None, pp: int | None, device: str, mbs: int) -> JobConfig:
    """The run's job at the layout of an evaluation: ``nproc`` local processes, ``ep`` / ``pp`` (default 1); the
    pipeline split is recomputed for the new ``pp``, which runs the plain 1F1B schedule over at least ``pp``
    micro-batches (an evaluation is forward-only: the schedule does not change its numbers). It computes in fp32 like
    the one-process path: FP8 GEMMs, FP8 primary weights and FP8 dispatch of a run trained with them are not used.

    Raises:
        ConfigError: sizes that do not fit the processes or the model, a pipeline that does not fit."""
    from moetrain.config import job_config_from_dict
    from moetrain.parallel.pipeline import check_pipeline

    d = job.to_dict()
    d["parallel"].update(ep=ep or 1, pp=pp or 1, dp=None, vpp=1, pp_layout=None, ep_overlap=False,
                         precision=Precision.FP32, dispatch_precision=Precision.BF16, fp8_param=False)
    d["train"].update(nproc=nproc, device=device, micro_batch_size=mbs, resume=False, init_from=None)
    if (pp or 1) > 1:
        d["parallel"]["schedule"] = Schedule.ONE_F_ONE_B
        d["train"]["grad_accum"] = max(d["train"]["grad_accum"], pp)
    out = job_config_from_dict(d)
    out.parallel.resolve(nproc, out.model.n_routed_experts)
    check_pipeline(out.model, out.parallel, out.train.grad_accum)
    return out


def _eval_worker(job_dict: dict[str, Any], ckpt: str, sources: list[np.ndarray], mbs: int,
                 max_batches: int | None) -> list[tuple[float, int]]:
    """One worker of a parallel evaluation: the trainer's model parts at the job's layout, the checkpoint's boxes of
    this rank, then each source's batches of this data rank through the runner's ``eval_sums``, summed over all
    ranks (only the last stage counts)."""
    import torch.distributed as dist

    from moetrain.config import job_config_from_dict
    from moetrain.interop.dcp_safe import safe_load
    from moetrain.parallel.mesh import init_parallel, shutdown
    from moetrain.train.trainer import build_model_parts, resolve_device

    job = job_config_from_dict(job_dict)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, resolve_device(job))
    try:
        model = build_model_parts(job, ctx, amp=None)
        for part in model.parts:  # each part's own keys: the embedding copy of a last stage is read like the first's
            safe_load({f"model.{k}": v for k, v in part.state_dict().items()}, ckpt)
        model.train(False)
        out = []
        for tokens in sources:
            batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in
                       rank_batches(tokens, job.data.seq_len, mbs, ctx.data_rank, ctx.stage_size, max_batches)]
            with torch.no_grad():
                total = model.runner.eval_sums(batches)
            if ctx.distributed:
                dist.all_reduce(total)
            out.append((float(total[0]), int(total[1])))
        return out
    finally:
        shutdown()


def check_json_path(path: str) -> None:
    """Refuse a ``--json`` file that could not be written, before an evaluation is run for it: its folder missing
    or not writable, or the path a directory ("-", standard output, passes).

    Raises:
        ConfigError: as above, naming the path and the fix.
    """
    if path == "-":
        return
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise ConfigError(f"--json {path} is a directory; name a file in it, e.g. --json {Path(path) / 'eval.json'}")
    if not p.parent.is_dir():
        raise ConfigError(f"--json {path}: the folder {p.parent} does not exist; create it (mkdir -p) or name a file "
                          f"in an existing folder")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"--json {path}: {p if p.exists() else p.parent} is not writable; name a file in a folder "
                          f"you can write")


def write_json(report: EvalReport, path: str) -> None:
    """The report as JSON to ``path`` ("-": standard output)."""
    text = json.dumps(report.to_dict(), indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
