"""The sources of a data mixture (``data.sources``), opened: what each holds, how it is named, how it is read.

A source whose ``path`` is a file or a glob is read as ``data.paths`` is (:mod:`moetrain.data.corpus`: text,
JSON lines, Parquet); a directory or a hub ``name`` is read with Hugging Face ``datasets``
(:mod:`moetrain.data.hf_datasets`). Every problem is a :class:`DataError` naming the source as
``data.sources[i] (LABEL)``, raised before any tokenizer training or tokenisation starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .config import DataConfig, DataSource
from .corpus import DataError, check_sources, iter_documents, resolve_paths

__all__ = ["OpenSource", "open_source", "open_sources"]


@dataclass
class OpenSource:
    """One source of ``data.sources``, checked and ready to read.

    Attributes:
        index: its position in ``data.sources``. label: its path or ``hub:NAME[/CONFIG]``.
        weight: its weight as given (not normalised).
        identity: JSON-serialisable description of its content (files with sizes and modification times, the
            text column, the split): it enters the preparation's cache key.
        n_bytes: bytes of text (files) or of Arrow data (datasets) when known, else None (a stream).
        documents: a function returning a fresh iterator over the source's documents, in source order.
    """

    index: int
    label: str
    weight: float
    identity: dict[str, Any]
    n_bytes: int | None
    documents: Callable[[], Iterator[str]]


def _open_files(src: DataSource, text_field: str, where: str, option: str) -> OpenSource:
    try:
        paths = resolve_paths([src.path], option)
        check_sources(paths, text_field)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    files = []
    for p in paths:
        st = p.stat()
        files.append([str(p), st.st_size, st.st_mtime_ns])
    identity = {"kind": "files", "files": files, "text_field": text_field}
    return OpenSource(0, src.label, src.weight, identity, sum(f[1] for f in files),
                      lambda: iter_documents(paths, text_field))


def open_source(src: DataSource, text_field: str, hf_cache_dir: str | None, where: str,
                option: str = "--source / data.sources") -> OpenSource:
    """Open one source: a file or glob as ``data.paths`` reads it, a directory or hub ``name`` with ``datasets``.

    Args:
        text_field: its text key / column (the source's own, else the caller's default).
        hf_cache_dir: the datasets cache of hub names (``data.hf_cache_dir``). where: how messages name the
            source, e.g. ``"data.sources[1] (hub:wikitext)"`` or ``"--data web/*.jsonl"``. option: the option
            a missing file's message tells the user to fix.

    Returns:
        the source with ``index`` 0 (:func:`open_sources` numbers them).

    Raises:
        DataError: a source that does not exist, matches nothing, cannot be read, or lacks its text column; the
            message starts with ``where``.
    """
    if src.name is not None or Path(os.path.expanduser(str(src.path))).is_dir():
        from .hf_datasets import open_hf_source

        hf = open_hf_source(src, text_field, hf_cache_dir, where)

        def documents() -> Iterator[str]:
            try:
                yield from hf.documents()
            except DataError as e:
                raise DataError(f"{where}: {e}") from None

        return OpenSource(0, src.label, src.weight, hf.identity, hf.n_bytes, documents)
    return _open_files(src, text_field, where, option)


def open_sources(cfg: DataConfig) -> list[OpenSource]:
    """Open every entry of ``cfg.sources`` (files and globs here, directories and hub names with ``datasets``).

    Raises:
        DataError: a source that does not exist, matches nothing, cannot be read, or lacks its text column; the
            message names ``data.sources[i]`` and its path or hub name, and the fix.
    """
    out = []
    for i, src in enumerate(cfg.sources):
        opened = open_source(src, src.text_field or cfg.text_field, cfg.hf_cache_dir,
                             f"data.sources[{i}] ({src.label})")
        opened.index = i
        out.append(opened)
    return out
