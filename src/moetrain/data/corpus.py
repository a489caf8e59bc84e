"""Text sources: the built-in corpus, path/glob resolution, and document iteration.

Built-in corpus
---------------
When :attr:`DataConfig.paths` is empty the pipeline trains on the Python standard library's own ``.py`` source files,
found at ``sysconfig.get_paths()["stdlib"]``. The choice: it is real, varied text (code, docstrings, comments, the
~750 kB of English in ``pydoc_data/topics.py``) that nobody on this project wrote, it exists on every machine that
runs Python, needs no network, and its licence (the PSF License Agreement, a permissive BSD-style licence) allows
this use. Excluded: ``site-packages``/``dist-packages`` (third-party code), ``test``/``tests``/``idle_test``
directories (test suites, some deliberately mis-encoded), ``idlelib``, ``encodings`` (mostly generated
character-map tables) and ``__pycache__``. The selection is deterministic for a given Python installation: files are
sorted by their path relative to the stdlib root and taken whole, in that order, skipping any file that would take
the total over ``builtin_max_bytes`` (so the budget is filled greedily); files that are empty or not valid UTF-8 are
skipped. A different Python version gives a
different (but equally deterministic) corpus; the preparation cache is keyed on the exact files, so it notices.

Sources
-------
* plain text (``.txt``, ``.md``, ``.py``, ... and any file whose first 64 KiB are NUL-free UTF-8): one file = one
  document;
* JSON lines (``.jsonl``, ``.ndjson``, ``.json``): one document per record, the text under ``text_field``; a ``.json``
  file whose first non-blank character is ``[`` is read as one JSON array of records;
* Parquet (``.parquet``, ``.pq``): one document per row of the string column ``text_field``.

Empty documents (``""`` or a null value) are skipped. Every problem is raised as :class:`DataError` (a
``ValueError``) whose message names the file (and line) and says what to do.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Literal

__all__ = [
    "DataError",
    "SourceKind",
    "builtin_corpus_paths",
    "check_sources",
    "iter_documents",
    "resolve_paths",
    "source_kind",
]


class DataError(ValueError):
    """The data sources or the data configuration cannot be used; the message names the path and the fix."""


SourceKind = Literal["text", "jsonl", "parquet"]

TEXT_EXTENSIONS = frozenset(
    ".txt .text .md .markdown .rst .py .pyi .c .h .cc .cpp .hpp .rs .go .java .js .ts .sh .tex .html .htm .xml "
    ".csv .tsv .yaml .yml .toml .ini .cfg".split()
)
JSONL_EXTENSIONS = frozenset({".jsonl", ".ndjson", ".json"})
PARQUET_EXTENSIONS = frozenset({".parquet", ".pq"})
_COMPRESSED = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".tgz", ".7z", ".lz4", ".br"})
_BINARY = frozenset({".arrow", ".feather", ".bin", ".npy", ".npz", ".pt", ".pth", ".safetensors", ".pkl", ".pickle",
                     ".pdf", ".doc", ".docx", ".png", ".jpg", ".jpeg", ".gif", ".so", ".pyc", ".db", ".sqlite"})
_SUPPORTED_MSG = ("supported: plain UTF-8 text (.txt, .md, .py, ...; one file = one document), JSON lines "
                  "(.jsonl/.ndjson/.json) and Parquet (.parquet)")
_SNIFF_BYTES = 64 * 1024

_BUILTIN_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                                    "encodings", "__pycache__"})


# ------------------------------------------------------------------------------------------------ classification
def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # A multi-byte character cut by the sniff window is fine.
        return len(head) == _SNIFF_BYTES and e.start >= len(head) - 3
    return True


def source_kind(path: str | os.PathLike) -> SourceKind:
    """How a file is read: ``"text"``, ``"jsonl"`` or ``"parquet"``, from its extension (or content).

    Files with an unknown extension are accepted as plain text when their first 64 KiB are NUL-free UTF-8.

    Raises:
        DataError: compressed/binary or otherwise unsupported file (the message names it and what to do).
    """
    p = Path(path)
    ext = p.suffix.lower()
    if ext in PARQUET_EXTENSIONS:
        return "parquet"
    if ext in JSONL_EXTENSIONS:
        return "jsonl"
    if ext in TEXT_EXTENSIONS:
        return "text"
    if ext in _COMPRESSED:
        raise DataError(f"data file {str(p)!r} is compressed ({ext}); decompress it first "
                        f"(e.g. 'gunzip -k'). {_SUPPORTED_MSG}")
    if ext in _BINARY:
        raise DataError(f"data file {str(p)!r} has unsupported extension {ext!r}; convert it to one of the "
                        f"supported formats ({_SUPPORTED_MSG})")
    if _looks_like_text(p):
        return "text"
    raise DataError(f"data file {str(p)!r} has unsupported extension {ext or '(none)'!r} and is not UTF-8 text; "
                    f"{_SUPPORTED_MSG}")


# ---------------------------------------------------------------------------------------------------- resolution
def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def resolve_paths(patterns: Iterable[str | os.PathLike] | str | os.PathLike,
                  option: str = "--data / --set data.paths=") -> list[Path]:
    """Expand files and glob patterns into a sorted, de-duplicated list of readable, supported files.

    Args:
        patterns: file paths and/or glob patterns (``*``, ``?``, ``[..]``, recursive ``**``); ``~`` is expanded;
            relative ones are relative to the working directory. A single string is accepted too.
        option: how messages name the option that gave the paths (``moetrain eval``: ``--data``).

    Returns:
        absolute, symlink-resolved ``Path`` s, sorted and without duplicates (a file matched twice is kept once).

    Raises:
        DataError: no pattern given; a pattern matches no file; a file does not exist; a path is a directory;
            a file cannot be read; a file has an unsupported extension; every file is empty. The message names
            the offending path or pattern and what to do.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise DataError("no data paths given; pass files or glob patterns (--data 'data/**/*.jsonl', or --set "
                        "data.paths='[\"data/**/*.jsonl\"]'), or leave data.paths empty to use the built-in corpus")
    found: dict[Path, None] = {}
    for pat in patterns:
        s = os.path.expanduser(os.fspath(pat))
        if os.path.exists(s):
            if os.path.isdir(s):
                raise DataError(f"data path {os.fspath(pat)!r} is a directory; give files or a glob pattern such "
                                f"as {os.path.join(s, '**', '*.jsonl')!r}, or read a Hugging Face datasets folder "
                                f"with --source {os.fspath(pat)!r} (data.sources)")
            files = [s]
        elif _has_magic(s):
            files = [m for m in sorted(glob.glob(s, recursive=True)) if os.path.isfile(m)]
            if not files:
                raise DataError(f"data pattern {os.fspath(pat)!r} matched no files (working directory "
                                f"{os.getcwd()!r}); check the pattern, or use '**' to search subdirectories")
        else:
            raise DataError(f"data file {os.fspath(pat)!r} does not exist (looked for {os.path.abspath(s)!r}); "
                            f"check the path given to {option}")
        for f in files:
            found[Path(f).resolve()] = None
    paths = sorted(found)
    for p in paths:
        try:
            with open(p, "rb") as fh:
                fh.read(1)
        except OSError as e:
            raise DataError(f"data file {str(p)!r} cannot be read ({e.strerror or e}); fix its permissions "
                            f"(e.g. 'chmod a+r') or remove it from {option}") from e
        source_kind(p)
    if all(p.stat().st_size == 0 for p in paths):
        listed = ", ".join(repr(str(p)) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        raise DataError(f"all {len(paths)} data file(s) are empty ({listed}); there is no text in them; point {option} at files with text")
    return paths


def builtin_corpus_paths(max_bytes: int = 8_000_000) -> list[Path]:
    """The built-in corpus: Python standard-library ``.py`` files, deterministic, at most ``max_bytes`` in total.

    See the module docstring for what is included and why.

    Raises:
        DataError: the stdlib sources cannot be found, or ``max_bytes`` is smaller than every file.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    if not root.is_dir():
        raise DataError(f"the built-in corpus needs the Python standard library sources, but {str(root)!r} is not a "
                        "directory; give your own text files with --data GLOB (--set data.paths=)")
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _BUILTIN_EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                f = Path(dirpath) / name
                if f.is_file():
                    candidates.append((f.relative_to(root).as_posix(), f))
    candidates.sort()
    out: list[Path] = []
    total = 0
    for _, f in candidates:
        try:
            if total + f.stat().st_size > max_bytes:
                continue  # too big for what is left of the budget; smaller files later may still fit
            data = f.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data.strip():
            continue
        if total + len(data) > max_bytes:
            continue
        total += len(data)
        out.append(f)
    if not out:
        raise DataError(f"no built-in corpus file fits in data.builtin_max_bytes={max_bytes} (stdlib at "
                        f"{str(root)!r}); raise it with --set data.builtin_max_bytes=N, or give your own text with "
                        "--data GLOB")
    return out


# ------------------------------------------------------------------------------------------------------ reading
def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not valid UTF-8 (byte offset {e.start}); convert it to UTF-8 "
                        "(e.g. 'iconv -f latin1 -t utf-8')") from e


def _doc_from_record(rec: object, text_field: str, where: str) -> str:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object with a {text_field!r} field, got {type(rec).__name__}")
    if text_field not in rec:
        keys = ", ".join(repr(k) for k in list(rec)[:20]) or "none"
        raise DataError(f"{where}: record has no field {text_field!r} (fields present: {keys}); name the key "
                        "that holds the text with --set data.text_field=NAME (moetrain eval: --text-field NAME)")
    text = rec[text_field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return text


def _iter_jsonl(path: Path, text_field: str, limit: int | None = None) -> Iterator[str]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        try:
            records = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise DataError(f"{str(path)}:{e.lineno}: invalid JSON ({e.msg}); a .json file must hold one JSON "
                            "array of records or one JSON object per line") from e
        for i, rec in enumerate(records):
            if limit is not None and i >= limit:
                return
            yield _doc_from_record(rec, text_field, f"{str(path)} (record {i})")
        return
    n = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{str(path)}:{lineno}"
            try:
                rec = json.loads(raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: line is not valid UTF-8; convert the file to UTF-8") from e
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                                "object") from e
            yield _doc_from_record(rec, text_field, where)
            n += 1
            if limit is not None and n >= limit:
                return


def _iter_parquet(path: Path, text_field: str, limit: int | None = None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {str(path)!r} is not a readable Parquet file ({e})") from e
    schema = pf.schema_arrow
    if text_field not in schema.names:
        cols = ", ".join(repr(c) for c in schema.names) or "none"
        raise DataError(f"Parquet file {str(path)!r} has no column {text_field!r} (available columns: {cols}); name "
                        "the column that holds the text with --set data.text_field=NAME (moetrain eval: "
                        "--text-field NAME)")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
        raise DataError(f"Parquet file {str(path)!r}: column {text_field!r} has type {typ}, expected a string column")
    n = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield "" if text is None else text
            n += 1
            if limit is not None and n >= limit:
                return


def _iter_file(path: Path, text_field: str, limit: int | None = None) -> Iterator[str]:
    kind = source_kind(path)
    if kind == "text":
        yield _read_text(path)
    elif kind == "jsonl":
        yield from _iter_jsonl(path, text_field, limit)
    else:
        yield from _iter_parquet(path, text_field, limit)


def iter_documents(paths: Iterable[str | os.PathLike], text_field: str = "text") -> Iterator[str]:
    """Yield the documents of ``paths`` in order (files in the given order, records in file order).

    A plain-text file is one document; a JSON-lines file gives one per non-blank line (its ``text_field``); a
    Parquet file one per row of column ``text_field``. Empty documents (``""`` or null) are skipped.

    Raises:
        DataError: unsupported file; invalid UTF-8; a JSON line that is not valid JSON, not an object, lacks
            ``text_field`` or holds a non-string there (message ``file:line``); a Parquet file without the column
            (the message lists the available columns) or whose column is not a string column.
    """
    for p in paths:
        for doc in _iter_file(Path(p), text_field):
            if doc:
                yield doc


def check_sources(paths: Iterable[str | os.PathLike], text_field: str = "text") -> None:
    """Cheap pre-flight check: every file can be classified and its first record (or schema) is usable.

    Reads at most the first non-blank JSON line / the Parquet schema and first batch of each file, and only the
    first 64 KiB of plain-text files, so malformed inputs fail before tokenizer training starts.

    Raises:
        DataError: as :func:`iter_documents` would for the first record of a file.
    """
    for p in paths:
        p = Path(p)
        kind = source_kind(p)
        if kind == "text":
            continue
        for _ in _iter_file(p, text_field, limit=1):
            break
