"""One call from a :class:`DataConfig` to token shards on disk: resolve, tokenizer, tokenise, cache.

Cache layout (under ``cfg.cache_dir``)::

    data-<key>/         tokenizer.json  train.bin  val.bin  meta.json
    data-<key>.lock     fcntl lock file serialising preparations of the same key

``<key>`` is the first 16 hex digits of the SHA-256 of the *sources identity* (absolute path, size and mtime of
every source file, in order, plus ``text_field``), the *tokenizer settings* (trained BPE: ``vocab_size``; an existing
tokenizer: the SHA-256 of its file and its end-of-document token - ``vocab_size`` does not enter the key then, it is
ignored), ``val_fraction``, ``seed`` and the shard format version. ``seq_len`` does not enter it (packing happens in
the loader). Touching or editing a source file therefore gives a fresh preparation; old directories are never deleted
automatically (remove ``cache_dir`` to reclaim the space).

Concurrency: the whole check-or-build runs under an exclusive ``fcntl.flock`` on ``data-<key>.lock``, so concurrent
callers (several processes, or ranks on one host) build once and the others wait and then reuse the result. flock
is per host and unreliable on some network file systems: on multi-host jobs prepare on one rank or give every host
its own ``cache_dir``. ``moetrain train`` does: its launcher prepares before it starts the workers, and under torchrun
global rank 0 prepares before the other ranks look (``moetrain.train.rank0``), who then reuse its result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .config import DataConfig
from .corpus import DataError, builtin_corpus_paths, check_sources, iter_documents, resolve_paths
from .progress import PrepProgress, default_progress
from .shards import FORMAT_VERSION, META_NAME, _atomic_write_text, load_tokens, read_meta, write_shards
from .sources import OpenSource, open_sources
from .tokenizer import Tokenizer, file_sha256, load_tokenizer, train_bpe

__all__ = ["PreparedData", "PreparedSource", "prepare_data", "prepared_data", "BPE_TRAIN_MAX_CHARS"]

log = logging.getLogger("moetrain.data")

#: A trained BPE learns its merges from at most this many characters of the corpus (whole documents, in corpus
#: order); all documents are tokenised regardless.
BPE_TRAIN_MAX_CHARS = 200_000_000
TOKENIZER_NAME = "tokenizer.json"


@dataclass
class PreparedSource:
    """One source of a prepared mixture (``data.sources``).

    Attributes:
        label: its path or ``hub:NAME[/CONFIG]``. weight: its weight as configured (not normalised).
        train_path / val_path: its own token files. n_train_tokens / n_val_tokens / n_docs: its counts.
    """

    label: str
    weight: float
    train_path: str
    val_path: str
    n_train_tokens: int
    n_val_tokens: int
    n_docs: int


@dataclass
class PreparedData:
    """Where the prepared data is and what a model needs to know about it.

    Attributes:
        tokenizer_path: the ``tokenizer.json`` (a copy inside the cache directory; load it with
            :func:`moetrain.data.load_tokenizer`).
        vocab_size: the tokenizer's actual vocabulary size (max id + 1; for a trained BPE it can be smaller than
            ``DataConfig.vocab_size`` on a small corpus). The model's embedding needs at least this many rows.
        eos_id: the end-of-document token id that separates documents in the token stream.
        train_path / val_path: token files for :class:`moetrain.data.TokenLoader` / :func:`iter_eval_batches`.
        n_train_tokens / n_val_tokens: tokens in each split (end-of-document tokens included).
        data_dir: the cache directory of this preparation.
        reused: True when an existing complete preparation was reused (nothing was tokenised).
        sources: for a mixture (``data.sources``), each source's shards and weight; ``train_path`` is then empty
            (training draws from the sources, :func:`moetrain.data.train_loader`) and ``val_path`` holds every
            source's validation tokens, one after the other. Empty for ``data.paths`` / the built-in corpus.
    """

    tokenizer_path: str
    vocab_size: int
    eos_id: int
    train_path: str
    val_path: str
    n_train_tokens: int
    n_val_tokens: int
    data_dir: str = ""
    reused: bool = False
    sources: list[PreparedSource] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sources = [s if isinstance(s, PreparedSource) else PreparedSource(**s) for s in self.sources]


@contextlib.contextmanager
def _flock(path: Path, progress: PrepProgress) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing the same data (lock %s)", path)
            progress.note(f"waiting for another process preparing the same data (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _result(d: Path, meta: dict, reused: bool) -> PreparedData:
    sp = meta["splits"]
    return PreparedData(
        tokenizer_path=str(d / TOKENIZER_NAME),
        vocab_size=int(meta["vocab_size"]),
        eos_id=int(meta["eos_id"]),
        train_path=str(d / sp["train"]["file"]),
        val_path=str(d / sp["val"]["file"]),
        n_train_tokens=int(sp["train"]["n_tokens"]),
        n_val_tokens=int(sp["val"]["n_tokens"]),
        data_dir=str(d),
        reused=reused,
    )


def _complete(d: Path, key: str) -> dict | None:
    """meta.json of a complete preparation with this key, or None."""
    if not (d / "meta.json").is_file():
        return None
    try:
        meta = read_meta(d)
    except DataError as e:
        log.warning("ignoring incomplete preparation: %s", e)
        return None
    tok = d / TOKENIZER_NAME
    if meta.get("cache_key") != key or not tok.is_file() or file_sha256(tok) != meta.get("tokenizer_sha256"):
        return None
    return meta


def _tokenizer_key(cfg: DataConfig) -> tuple[Tokenizer | None, dict[str, Any]]:
    """(the given tokenizer or None, its part of the cache key)."""
    if cfg.tokenizer is not None:
        given = load_tokenizer(cfg.tokenizer, cfg.eos_token)
        return given, {"kind": "file", "sha256": given.sha256, "eos": given.eos_token}
    return None, {"kind": "bpe", "vocab_size": cfg.vocab_size, "max_chars": BPE_TRAIN_MAX_CHARS}


def _cache_key(key_obj: dict) -> str:
    """The cache folder's key: 16 hex digits of the SHA-256 of ``key_obj`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(key_obj, sort_keys=True).encode()).hexdigest()[:16]


def _cache_root(cfg: DataConfig) -> Path:
    root = Path(os.path.expanduser(cfg.cache_dir)).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache directory {str(root)!r} ({e.strerror or e}); set "
                        "--set data.cache_dir=\"DIR\" to a writable directory") from e
    return root


def _make_tokenizer(cfg: DataConfig, given: Tokenizer | None, documents, n_bytes: int | None, tok_path: Path,
                    progress: PrepProgress) -> Tokenizer:
    """Train a BPE on ``documents()`` (at most BPE_TRAIN_MAX_CHARS of them) or copy the given tokenizer to
    ``tok_path``; returns it loaded from there."""
    if given is None:
        t1 = time.perf_counter()
        total = None if n_bytes is None else min(n_bytes, BPE_TRAIN_MAX_CHARS)
        with progress.phase(f"training a {cfg.vocab_size:,}-token BPE", total=total) as update:
            docs = _limit_chars(documents(), BPE_TRAIN_MAX_CHARS, update)
            tokenizer = train_bpe(docs, cfg.vocab_size, tok_path)
        log.info("trained a byte-level BPE of %d tokens in %.1f s", tokenizer.vocab_size, time.perf_counter() - t1)
        return tokenizer
    tmp = tok_path.with_name(TOKENIZER_NAME + f".{os.getpid()}.tmp")
    shutil.copyfile(given.path, tmp)
    os.replace(tmp, tok_path)
    return load_tokenizer(tok_path, given.eos_token)


def _limit_chars(docs: Iterator[str], max_chars: int, on_progress=None) -> Iterator[str]:
    total = 0
    for d in docs:
        if total and total + len(d) > max_chars:
            return
        total += len(d)
        if on_progress is not None:
            on_progress(total)
        yield d


def prepare_data(cfg: DataConfig, progress: PrepProgress | None = None) -> PreparedData:
    """Prepare (or reuse) the tokenizer and the train/validation token shards described by ``cfg``.

    Steps: validate ``cfg``; resolve the sources (``cfg.paths`` or the built-in corpus) and pre-check the first
    record of each; load the given tokenizer (or plan to train a BPE); take the cache lock; reuse a complete cache
    directory for this key, else train/copy the tokenizer and write the shards (see :mod:`moetrain.data.shards`).
    ``progress`` reports each step on stderr (default :func:`moetrain.data.progress.default_progress`: a progress
    bar on a terminal, plain lines otherwise; ``PrepProgress(enabled=False)`` is silent).

    Returns:
        :class:`PreparedData` (``reused`` tells whether the cache was hit).

    Raises:
        ValueError: an invalid ``cfg`` field (from :meth:`DataConfig.validate`).
        DataError: bad sources or tokenizer, detected before any tokenizer training or tokenisation; a corpus with
            no text; a cache directory that cannot be created.
    """
    cfg.validate()
    t0 = time.perf_counter()
    progress = progress if progress is not None else default_progress()
    if cfg.sources:
        return _prepare_mixture(cfg, progress, t0)
    builtin = not cfg.paths
    paths = builtin_corpus_paths(cfg.builtin_max_bytes) if builtin else resolve_paths(cfg.paths)
    check_sources(paths, cfg.text_field)
    sources = []
    for p in paths:
        st = p.stat()
        sources.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})

    given, tok_key = _tokenizer_key(cfg)
    key_obj = {"format": FORMAT_VERSION, "sources": sources, "text_field": cfg.text_field, "tokenizer": tok_key,
               "val_fraction": float(cfg.val_fraction), "seed": cfg.seed}
    key = _cache_key(key_obj)

    root = _cache_root(cfg)
    d = root / f"data-{key}"
    with _flock(root / f"data-{key}.lock", progress):
        meta = _complete(d, key)
        if meta is not None:
            log.info("reusing prepared data %s (%.2f s)", d, time.perf_counter() - t0)
            progress.note(f"reusing {d} ({meta['splits']['train']['n_tokens']:,} training tokens, prepared before)")
            return _result(d, meta, reused=True)

        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        tok_path = d / TOKENIZER_NAME
        n_bytes = sum(s["size"] for s in sources)
        what = "the built-in corpus" if builtin else "data.paths"
        log.info("preparing data from %d file(s), %.1f MB (%s) into %s", len(paths), n_bytes / 1e6, what, d)
        progress.note(f"preparing {len(paths)} file(s), {n_bytes / 1e6:.1f} MB ({what}) into {d}")
        try:
            tokenizer = _make_tokenizer(cfg, given, lambda: iter_documents(paths, cfg.text_field), n_bytes,
                                        tok_path, progress)
            extra = {"cache_key": key, "builtin_corpus": builtin, "text_field": cfg.text_field,
                     "tokenizer": tok_key, "eos_token": tokenizer.eos_token}
            with progress.phase("tokenising", total=n_bytes) as update:
                write_shards(iter_documents(paths, cfg.text_field), tokenizer, d, val_fraction=cfg.val_fraction,
                             seed=cfg.seed, sources=sources, extra_meta=extra, on_progress=update)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)  # leave no half-built directory behind
            raise
        meta = read_meta(d)
        log.info("prepared data in %.1f s", time.perf_counter() - t0)
        sp = meta["splits"]
        progress.note(f"prepared {sp['train']['n_tokens']:,} training + {sp['val']['n_tokens']:,} validation "
                      f"tokens in {time.perf_counter() - t0:.1f} s")
        return _result(d, meta, reused=False)


def prepared_data(cfg: DataConfig, folder: str) -> PreparedData:
    """A finished preparation read back, nothing tokenised: ``cfg.cache_dir/folder``, the ``data-<key>`` or
    ``mix-<key>`` folder a run's checkpoints record (``data_key``). For a mixture, ``cfg.sources`` (the run's)
    label and weigh its :class:`PreparedSource` s.

    Raises:
        DataError: the folder is not there, incomplete, or a mixture of another number of sources.
    """
    root = Path(os.path.expanduser(cfg.cache_dir)).absolute()
    kind, _, key = folder.partition("-")
    d = root / folder
    meta = _complete_mixture(d, key) if kind == "mix" else _complete(d, key)
    if meta is None or kind not in ("data", "mix"):
        raise DataError(f"the prepared data {folder} is not in data.cache_dir {str(root)!r} (or is incomplete)")
    if kind == "data":
        return _result(d, meta, reused=True)
    if len(meta["mixture"]) != len(cfg.sources):
        raise DataError(f"the prepared data {d} holds {len(meta['mixture'])} sources, data.sources "
                        f"{len(cfg.sources)}")
    return _mixture_result(d, meta, cfg, reused=True)


# ------------------------------------------------------------------------------------------------------ mixtures
def _round_robin(iterators: list[Iterator[str]]) -> Iterator[str]:
    """One document of each source in turn (a source that runs out drops out): the BPE's training text, so that a
    large first source does not take the whole character budget."""
    live = list(iterators)
    while live:
        for it in list(live):
            doc = next(it, None)
            if doc is None:
                live.remove(it)
            else:
                yield doc


def _mixture_result(d: Path, meta: dict, cfg: DataConfig, reused: bool) -> PreparedData:
    out = []
    for entry, src in zip(meta["mixture"], cfg.sources):
        sp = read_meta(d / entry["dir"])["splits"]
        out.append(PreparedSource(label=src.label, weight=float(src.weight),
                                  train_path=str(d / entry["dir"] / sp["train"]["file"]),
                                  val_path=str(d / entry["dir"] / sp["val"]["file"]),
                                  n_train_tokens=int(sp["train"]["n_tokens"]), n_val_tokens=int(sp["val"]["n_tokens"]),
                                  n_docs=int(sp["train"]["n_docs"]) + int(sp["val"]["n_docs"])))
    return PreparedData(tokenizer_path=str(d / TOKENIZER_NAME), vocab_size=int(meta["vocab_size"]),
                        eos_id=int(meta["eos_id"]), train_path="", val_path=str(d / meta["splits"]["val"]["file"]),
                        n_train_tokens=sum(s.n_train_tokens for s in out),
                        n_val_tokens=sum(s.n_val_tokens for s in out), data_dir=str(d), reused=reused, sources=out)


def _complete_mixture(d: Path, key: str) -> dict | None:
    meta = _complete(d, key)
    if meta is None:
        return None
    for entry in meta.get("mixture", []):
        try:
            read_meta(d / entry["dir"])
        except DataError as e:
            log.warning("ignoring incomplete preparation: %s", e)
            return None
    return meta


def _write_mixture(cfg: DataConfig, opened: list[OpenSource], given: Tokenizer | None, tok_key: dict[str, Any],
                   key: str, d: Path, progress: PrepProgress) -> None:
    """The tokenizer (trained on the sources in turn), each source's shards in ``d/source-<i>``, every source's
    validation tokens one after the other in ``d/val.bin``, and ``d/meta.json`` last."""
    sizes = [o.n_bytes for o in opened]
    n_bytes = None if None in sizes else sum(sizes)
    tokenizer = _make_tokenizer(cfg, given, lambda: _round_robin([o.documents() for o in opened]), n_bytes,
                                d / TOKENIZER_NAME, progress)
    entries = []
    for o in opened:
        sub = d / f"source-{o.index}"
        extra = {"cache_key": key, "source": o.label, "tokenizer": tok_key, "eos_token": tokenizer.eos_token}
        with progress.phase(f"tokenising {o.label}", total=o.n_bytes) as update:
            try:
                info = write_shards(o.documents(), tokenizer, sub, val_fraction=cfg.val_fraction, seed=cfg.seed,
                                    sources=[o.identity], extra_meta=extra, on_progress=update)
            except DataError as e:
                if str(e).startswith("data.sources["):
                    raise
                raise DataError(f"data.sources[{o.index}] ({o.label}): {e}") from None
        entries.append({"dir": sub.name, "label": o.label, "n_train_tokens": info.n_train_tokens,
                        "n_val_tokens": info.n_val_tokens})
    tmp = d / f"val.bin.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        for e in entries:
            np.asarray(load_tokens(d / e["dir"] / "val.bin")).tofile(f)
    os.replace(tmp, d / "val.bin")
    n_val = sum(e["n_val_tokens"] for e in entries)
    meta = {"format": FORMAT_VERSION, "kind": "mixture", "dtype": read_meta(d / entries[0]["dir"])["dtype"],
            "vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id),
            "tokenizer_sha256": tokenizer.sha256, "cache_key": key, "tokenizer": tok_key,
            "eos_token": tokenizer.eos_token, "splits": {"val": {"file": "val.bin", "n_tokens": n_val}},
            "mixture": entries}
    _atomic_write_text(d / META_NAME, json.dumps(meta, indent=1, ensure_ascii=False))


def _prepare_mixture(cfg: DataConfig, progress: PrepProgress, t0: float) -> PreparedData:
    """:func:`prepare_data` for ``data.sources``: one tokenizer, shards per source, cached under ``mix-<key>``.
    The key holds each source's identity (not its weight: weights are applied when training draws windows, so
    changing them reuses the shards)."""
    opened = open_sources(cfg)
    given, tok_key = _tokenizer_key(cfg)
    key_obj = {"format": FORMAT_VERSION, "mixture": [o.identity for o in opened], "tokenizer": tok_key,
               "val_fraction": float(cfg.val_fraction), "seed": cfg.seed}
    key = _cache_key(key_obj)
    root = _cache_root(cfg)
    d = root / f"mix-{key}"
    with _flock(root / f"mix-{key}.lock", progress):
        meta = _complete_mixture(d, key)
        if meta is not None:
            log.info("reusing prepared data %s (%.2f s)", d, time.perf_counter() - t0)
            prep = _mixture_result(d, meta, cfg, reused=True)
            progress.note(f"reusing {d} ({prep.n_train_tokens:,} training tokens of {len(opened)} sources, "
                          "prepared before)")
            return _check_windows(prep, cfg)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        progress.note(f"preparing a mixture of {len(opened)} sources into {d}")
        try:
            _write_mixture(cfg, opened, given, tok_key, key, d, progress)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)  # leave no half-built directory behind
            raise
        prep = _mixture_result(d, read_meta(d), cfg, reused=False)
        log.info("prepared data in %.1f s", time.perf_counter() - t0)
        progress.note(f"prepared {prep.n_train_tokens:,} training + {prep.n_val_tokens:,} validation tokens of "
                      f"{len(opened)} sources in {time.perf_counter() - t0:.1f} s")
        return _check_windows(prep, cfg)


def _check_windows(prep: PreparedData, cfg: DataConfig) -> PreparedData:
    """Every source must give at least one training window of ``seq_len + 1`` tokens."""
    for i, s in enumerate(prep.sources):
        if s.n_train_tokens < cfg.seq_len + 1:
            raise DataError(f"data.sources[{i}] ({s.label}) has {s.n_train_tokens} training tokens, too few for one "
                            f"window of data.seq_len+1={cfg.seq_len + 1} tokens; add data to it, drop it, or lower "
                            "data.seq_len")
    return prep
