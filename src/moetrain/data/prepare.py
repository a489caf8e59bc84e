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
is per host and unreliable on some network file systems: on multi-host jobs prepare on one rank (the trainer does it
on rank 0 before it launches its workers) or give every host its own ``cache_dir``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .config import DataConfig
from .corpus import DataError, builtin_corpus_paths, check_sources, iter_documents, resolve_paths
from .progress import PrepProgress, default_progress
from .shards import FORMAT_VERSION, read_meta, write_shards
from .tokenizer import Tokenizer, file_sha256, load_tokenizer, train_bpe

__all__ = ["PreparedData", "prepare_data", "BPE_TRAIN_MAX_CHARS"]

log = logging.getLogger("moetrain.data")

#: A trained BPE learns its merges from at most this many characters of the corpus (whole documents, in corpus
#: order); all documents are tokenised regardless.
BPE_TRAIN_MAX_CHARS = 200_000_000
TOKENIZER_NAME = "tokenizer.json"


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
    builtin = not cfg.paths
    paths = builtin_corpus_paths(cfg.builtin_max_bytes) if builtin else resolve_paths(cfg.paths)
    check_sources(paths, cfg.text_field)
    sources = []
    for p in paths:
        st = p.stat()
        sources.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})

    given: Tokenizer | None = None
    if cfg.tokenizer is not None:
        given = load_tokenizer(cfg.tokenizer, cfg.eos_token)
        tok_key = {"kind": "file", "sha256": given.sha256, "eos": given.eos_token}
    else:
        tok_key = {"kind": "bpe", "vocab_size": cfg.vocab_size, "max_chars": BPE_TRAIN_MAX_CHARS}
    key_obj = {"format": FORMAT_VERSION, "sources": sources, "text_field": cfg.text_field, "tokenizer": tok_key,
               "val_fraction": float(cfg.val_fraction), "seed": cfg.seed}
    key = hashlib.sha256(json.dumps(key_obj, sort_keys=True).encode()).hexdigest()[:16]

    root = Path(os.path.expanduser(cfg.cache_dir)).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache directory {str(root)!r} ({e.strerror or e}); set "
                        "--set data.cache_dir=\"DIR\" to a writable directory") from e
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
            if given is None:
                t1 = time.perf_counter()
                with progress.phase(f"training a {cfg.vocab_size:,}-token BPE",
                                    total=min(n_bytes, BPE_TRAIN_MAX_CHARS)) as update:
                    docs = _limit_chars(iter_documents(paths, cfg.text_field), BPE_TRAIN_MAX_CHARS, update)
                    tokenizer = train_bpe(docs, cfg.vocab_size, tok_path)
                log.info("trained a byte-level BPE of %d tokens in %.1f s", tokenizer.vocab_size,
                         time.perf_counter() - t1)
            else:
                tmp = tok_path.with_name(TOKENIZER_NAME + f".{os.getpid()}.tmp")
                shutil.copyfile(given.path, tmp)
                os.replace(tmp, tok_path)
                tokenizer = load_tokenizer(tok_path, given.eos_token)
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
