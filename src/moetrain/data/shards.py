"""Token shards: documents -> one flat token file per split (``train.bin``, ``val.bin``) plus ``meta.json``.

Layout of a shard directory::

    train.bin   flat array of token ids (dtype in meta.json: uint16 if vocab_size <= 65536, else uint32), the
                documents of the train split in corpus order, each followed by the end-of-document id
    val.bin     the same for the validation split
    meta.json   {"format", "dtype", "vocab_size", "eos_id", "tokenizer_sha256", "n_docs",
                 "split": {"mode", "val_fraction", "seed"},
                 "splits": {"train": {"file", "n_tokens", "n_docs"}, "val": {...}},
                 "sources": [{"path", "size", "mtime_ns"}, ...], ...}

Split: document ``i`` goes to validation iff ``u(seed, i) < val_fraction``, where ``u`` is a uniform number in
[0, 1) from BLAKE2b of ``"{seed}:{i}"`` (``i`` counts the non-empty documents in corpus order) - deterministic, and
every document lands in exactly one split. Both splits are made non-empty: if no document was drawn for validation,
the train document with the smallest ``u`` moves there (and symmetrically for an empty train split); a corpus of a
single document is split by tokens instead, at the ``floor((1 - val_fraction) * n)`` point (``split.mode`` =
``"tokens"`` in meta.json). Because documents differ in length, the drawn validation documents may hold far fewer
tokens than ``val_fraction`` of them; when they hold less than half of that share, train documents with the next
smallest ``u`` (among those with ``u < 4 * val_fraction``, and in any case the :data:`TOP_UP_MIN_CANDIDATES` train
documents of smallest ``u``, so that a corpus of a few dozen documents has candidates too) are moved to validation as
long as it stays under twice its share, until it reaches half (``split.topped_up_docs`` in meta.json counts them; they follow the drawn ones in
``val.bin``). The rule depends only on the corpus, ``seed`` and ``val_fraction``.

Writes are atomic: the ``.bin`` files are written as ``*.tmp`` and renamed into place, and ``meta.json`` is renamed
into place last, so a directory with a ``meta.json`` whose sizes match the ``.bin`` files is complete.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .corpus import DataError
from .tokenizer import Tokenizer

__all__ = ["META_NAME", "SPLITS", "ShardInfo", "doc_split", "load_tokens", "read_meta", "token_dtype",
           "write_shards"]

log = logging.getLogger("moetrain.data")

META_NAME = "meta.json"
SPLITS = ("train", "val")
FORMAT_VERSION = 1
#: Train documents of smallest ``u`` always considered for the validation top-up, beyond those with
#: ``u < 4 * val_fraction``: a corpus of a few dozen documents (a small built-in corpus) has none of the latter to
#: spare. Only a top-up that used to fall short of half its share changes (a corpus prepared before keeps its split).
TOP_UP_MIN_CANDIDATES = 64
#: Characters of text handed to one ``encode_batch`` call (also the granularity of the progress report; 1 M was
#: measured as fast as 4 M on 2 cores: 6.2-6.8 s against 8.3-10.0 s for the 8 MB built-in corpus).
BATCH_CHARS = 1 << 20
#: Documents longer than this are encoded in line-aligned pieces (cut after a newline followed by a non-space).
PIECE_CHARS = 1 << 20
_CUT = re.compile(r"\n(?=\S)")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``.

    Raises:
        DataError: ``vocab_size`` > 2**32.
    """
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise DataError(f"vocab_size {vocab_size} does not fit in uint32 token shards")


def _doc_u(index: int, seed: int) -> float:
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def doc_split(index: int, seed: int, val_fraction: float) -> str:
    """``"val"`` or ``"train"``: the split document ``index`` is drawn for (before the non-empty fix-up)."""
    return "val" if _doc_u(index, seed) < val_fraction else "train"


@dataclass
class ShardInfo:
    """Result of :func:`write_shards`: paths (``str``) and token/document counts of each split."""

    dir: str
    train_path: str
    val_path: str
    meta_path: str
    dtype: str
    n_train_tokens: int
    n_val_tokens: int
    n_train_docs: int
    n_val_docs: int


def _pieces(text: str, max_chars: int = PIECE_CHARS) -> Iterator[str]:
    pos, n = 0, len(text)
    while n - pos > max_chars:
        window = text[pos + max_chars // 2: pos + max_chars]
        cut = None
        for m in _CUT.finditer(window):
            cut = pos + max_chars // 2 + m.end()
        if cut is None:
            m = _CUT.search(text, pos + max_chars)
            if m is None:
                break
            cut = m.end()
        yield text[pos:cut]
        pos = cut
    yield text[pos:]


def _move_ranges(src: Path, dst: Path, ranges: list[tuple[int, int]], dtype: np.dtype) -> None:
    """Append token ranges ``[start, end)`` (disjoint) of file ``src`` to ``dst`` in the given order, and remove
    them from ``src``; works in 16 M-token chunks through a memory map."""
    n = os.path.getsize(src) // dtype.itemsize
    arr = np.memmap(src, dtype=dtype, mode="r", shape=(n,))
    chunk = 1 << 24

    def copy(f, lo: int, hi: int) -> None:
        for a in range(lo, hi, chunk):
            np.asarray(arr[a:min(a + chunk, hi)]).tofile(f)

    with open(dst, "ab") as f:
        for lo, hi in ranges:
            copy(f, lo, hi)
    keep, pos = [], 0
    for lo, hi in sorted(ranges):
        keep.append((pos, lo))
        pos = hi
    keep.append((pos, n))
    tmp2 = src.with_name(src.name + "2")
    try:
        with open(tmp2, "wb") as f:
            for lo, hi in keep:
                copy(f, lo, hi)
        del arr
        os.replace(tmp2, src)
    finally:
        tmp2.unlink(missing_ok=True)


def write_shards(docs: Iterable[str], tokenizer: Tokenizer, out_dir: str | os.PathLike, *, val_fraction: float,
                 seed: int = 0, sources: list[dict[str, Any]] | None = None,
                 extra_meta: dict[str, Any] | None = None,
                 on_progress: Callable[[int], None] | None = None) -> ShardInfo:
    """Tokenise ``docs`` into ``out_dir/train.bin``, ``out_dir/val.bin`` and ``out_dir/meta.json``.

    Documents are encoded in batches of about 4 M characters with ``tokenizer.encode_batch`` (parallel in Rust);
    each document's ids are followed by ``tokenizer.eos_id``. See the module docstring for the split rule.

    Args:
        docs: the documents, in corpus order (empty strings are skipped and not counted).
        tokenizer: gives ``encode_batch``, ``eos_id``, ``vocab_size`` (-> dtype) and ``sha256``.
        out_dir: created if missing; existing shard files there are replaced.
        val_fraction: in (0, 1); seed: split seed.
        sources: recorded in meta.json (e.g. ``[{"path", "size", "mtime_ns"}]``); extra_meta: merged into it.
        on_progress: called after each encoded batch with the characters of text tokenised so far.

    Returns:
        :class:`ShardInfo`.

    Raises:
        DataError: no non-empty document (and whatever reading ``docs`` raises). On any error the ``*.tmp`` files
        are removed and no ``meta.json`` is left, so the directory is not mistaken for a complete one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = int(tokenizer.eos_id)
    meta_path = out / META_NAME
    meta_path.unlink(missing_ok=True)
    final = {s: out / f"{s}.bin" for s in SPLITS}
    tmp = {s: out / f"{s}.bin.{os.getpid()}.tmp" for s in SPLITS}
    n_tok = {s: 0 for s in SPLITS}
    n_doc = {s: 0 for s in SPLITS}
    # Fix-up candidates: (u, start, end) of the train doc with the smallest u / the val doc with the largest u.
    best_for_val: tuple[float, int, int] | None = None
    best_for_train: tuple[float, int, int] | None = None
    # Top-up candidates: train docs with u < 4 * val_fraction (about 4x as many as the val split holds), and the
    # TOP_UP_MIN_CANDIDATES train docs of smallest u (a max-heap on u), which a small corpus may need.
    top_up: list[tuple[float, int, int]] = []
    smallest_u: list[tuple[float, int, int]] = []
    first_doc: tuple[str, int, int] | None = None
    n_docs = 0
    t0 = time.perf_counter()
    files = {}
    try:
        files = {s: open(tmp[s], "wb") for s in SPLITS}
        texts: list[str] = []
        owners: list[int] = []
        pending: dict[int, tuple[str, float]] = {}
        chars = done_chars = 0

        def flush() -> None:
            nonlocal best_for_val, best_for_train, first_doc, chars, done_chars
            if not texts:
                return
            encoded = tokenizer.encode_batch(texts)
            per_split: dict[str, list[list[int]]] = {s: [] for s in SPLITS}
            offset = dict(n_tok)
            i = 0
            while i < len(encoded):
                idx = owners[i]
                j = i
                while j < len(encoded) and owners[j] == idx:
                    j += 1
                split, u = pending.pop(idx)
                ids = list(chain.from_iterable(encoded[i:j]))
                ids.append(eos)
                start = offset[split]
                end = offset[split] = start + len(ids)
                per_split[split].append(ids)
                n_doc[split] += 1
                if idx == 0:
                    first_doc = (split, start, end)
                if split == "train" and (best_for_val is None or u < best_for_val[0]):
                    best_for_val = (u, start, end)
                if split == "train" and u < 4 * val_fraction:
                    top_up.append((u, start, end))
                elif split == "train":
                    heapq.heappush(smallest_u, (-u, start, end))
                    if len(smallest_u) > TOP_UP_MIN_CANDIDATES:
                        heapq.heappop(smallest_u)
                if split == "val" and (best_for_train is None or u > best_for_train[0]):
                    best_for_train = (u, start, end)
                i = j
            for s in SPLITS:
                if per_split[s]:
                    total = sum(len(x) for x in per_split[s])
                    arr = np.fromiter(chain.from_iterable(per_split[s]), dtype=dtype, count=total)
                    arr.tofile(files[s])
                    n_tok[s] += total
            texts.clear()
            owners.clear()
            done_chars += chars
            chars = 0
            if on_progress is not None:
                on_progress(done_chars)

        for doc in docs:
            if not doc:
                continue
            u = _doc_u(n_docs, seed)
            pending[n_docs] = ("val" if u < val_fraction else "train", u)
            for piece in _pieces(doc):
                texts.append(piece)
                owners.append(n_docs)
                chars += len(piece)
            n_docs += 1
            if chars >= BATCH_CHARS:
                flush()
                log.debug("tokenised %d documents, %d tokens", n_docs, n_tok["train"] + n_tok["val"])
        flush()
        for f in files.values():
            f.close()
        if n_docs == 0:
            raise DataError("the corpus has no non-empty documents; there is nothing to tokenise")

        mode = "documents"
        n_topped_up = 0
        if n_docs == 1:
            mode = "tokens"
            split, start, end = first_doc
            k = min(max(int((1.0 - val_fraction) * (end - start)), 1), end - start - 1)
            if split == "train":
                _move_ranges(tmp["train"], tmp["val"], [(start + k, end)], dtype)
            else:
                _move_ranges(tmp["val"], tmp["train"], [(start, start + k)], dtype)
            moved = (end - start - k) if split == "train" else k
            other = "val" if split == "train" else "train"
            n_tok[split] -= moved
            n_tok[other] += moved
            n_doc["train"] = n_doc["val"] = 1
        elif n_doc["train"] == 0:
            _, start, end = best_for_train
            _move_ranges(tmp["val"], tmp["train"], [(start, end)], dtype)
            n_tok["val"] -= end - start
            n_tok["train"] += end - start
            n_doc["val"] -= 1
            n_doc["train"] += 1
        else:
            # Empty validation split -> move the most val-like train doc; then, while validation holds fewer than
            # half of its share of the tokens, move train docs in increasing u that keep it under twice its share.
            chosen = [best_for_val] if n_doc["val"] == 0 else []
            total = n_tok["train"] + n_tok["val"]
            val_tok = n_tok["val"] + sum(e - s_ for _, s_, e in chosen)
            low, high = 0.5 * val_fraction * total, 2.0 * val_fraction * total
            for cand in sorted(top_up + [(-nu, s_, e) for nu, s_, e in smallest_u]):
                if val_tok >= low or n_doc["train"] - len(chosen) <= 1:
                    break
                size = cand[2] - cand[1]
                if cand not in chosen and val_tok + size <= high:
                    chosen.append(cand)
                    val_tok += size
            if chosen:
                n_topped_up = len(chosen) - (1 if n_doc["val"] == 0 else 0)
                moved = sum(e - s_ for _, s_, e in chosen)
                _move_ranges(tmp["train"], tmp["val"], sorted((s_, e) for _, s_, e in chosen), dtype)
                n_tok["train"] -= moved
                n_tok["val"] += moved
                n_doc["train"] -= len(chosen)
                n_doc["val"] += len(chosen)

        for s in SPLITS:
            os.replace(tmp[s], final[s])
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": int(tokenizer.vocab_size),
            "eos_id": eos,
            "tokenizer_sha256": getattr(tokenizer, "sha256", None),
            "n_docs": n_docs,
            "split": {"mode": mode, "val_fraction": float(val_fraction), "seed": int(seed),
                      "topped_up_docs": n_topped_up},
            "splits": {s: {"file": final[s].name, "n_tokens": n_tok[s], "n_docs": n_doc[s]} for s in SPLITS},
            "sources": sources or [],
        }
        meta.update(extra_meta or {})
        _atomic_write_text(meta_path, json.dumps(meta, indent=1, ensure_ascii=False))
    finally:
        for f in files.values():
            f.close()
        for s in SPLITS:
            tmp[s].unlink(missing_ok=True)
    log.info("tokenised %d documents into %d train + %d val tokens (%s) in %.1f s", n_docs, n_tok["train"],
             n_tok["val"], dtype.name, time.perf_counter() - t0)
    return ShardInfo(str(out), str(final["train"]), str(final["val"]), str(meta_path), dtype.name,
                     n_tok["train"], n_tok["val"], n_doc["train"], n_doc["val"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_meta(shard_dir: str | os.PathLike, check_files: bool = True) -> dict[str, Any]:
    """The ``meta.json`` of a shard directory; with ``check_files`` also verify each ``.bin`` has the recorded size.

    Raises:
        DataError: meta.json missing or unreadable, or a ``.bin`` file missing or of the wrong size (an incomplete
            or corrupted preparation: delete the directory and prepare again).
    """
    d = Path(shard_dir)
    p = d / META_NAME
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
        itemsize = np.dtype(meta["dtype"]).itemsize
        splits = meta["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"shard directory {str(d)!r} has no valid {META_NAME} ({e}); prepare the data again") from e
    if check_files:
        for s, info in splits.items():
            f = d / info["file"]
            want = int(info["n_tokens"]) * itemsize
            size = f.stat().st_size if f.is_file() else None
            if size != want:
                raise DataError(f"token file {str(f)!r} is {'missing' if size is None else f'{size} bytes'}, "
                                f"meta.json says {want} bytes; delete {str(d)!r} and prepare the data again")
    return meta


def load_tokens(path: str | os.PathLike) -> np.memmap:
    """Memory-map a split's token file read-only, with the dtype recorded in the ``meta.json`` beside it.

    Returns:
        1-D ``np.memmap`` of shape (n_tokens,), dtype uint16 or uint32.

    Raises:
        DataError: no meta.json beside the file, the file is not listed in it, or its size does not match.
    """
    p = Path(path)
    meta = read_meta(p.parent, check_files=False)
    for info in meta["splits"].values():
        if info["file"] == p.name:
            break
    else:
        raise DataError(f"token file {str(p)!r} is not listed in {str(p.parent / META_NAME)!r}")
    dtype = np.dtype(meta["dtype"])
    n = int(info["n_tokens"])
    size = p.stat().st_size if p.is_file() else None
    if size != n * dtype.itemsize:
        raise DataError(f"token file {str(p)!r} is {'missing' if size is None else f'{size} bytes'}, expected "
                        f"{n * dtype.itemsize}; prepare the data again")
    if n == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map an empty file
    return np.memmap(p, dtype=dtype, mode="r", shape=(n,))
