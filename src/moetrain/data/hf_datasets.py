"""Hugging Face ``datasets`` as a text source: ``save_to_disk`` folders, folders of data files, the local hub cache.

A :class:`moetrain.data.config.DataSource` whose ``path`` is a directory, or that gives a hub ``name``, is read here:

* a ``save_to_disk`` folder (it holds ``state.json`` or ``dataset_dict.json``) -> ``datasets.load_from_disk``: the
  Arrow files are memory-mapped where they lie, nothing is copied (``streaming`` changes nothing);
* any other directory -> ``datasets.load_dataset(DIR, split=..., streaming=True)``: its Arrow/Parquet/JSON-lines/CSV
  files and their splits are found by ``datasets``' own naming rules (``train-*.parquet``, ``data/test.jsonl``, ...)
  and always streamed: documents are read (and tokenised) as they arrive, and no Arrow copy of the folder is written
  to the datasets cache, so a folder larger than that cache can be prepared;
* a ``name`` -> ``datasets.load_dataset(NAME, CONFIG, split=..., streaming=..., cache_dir=data.hf_cache_dir)``; with
  ``streaming`` an ``IterableDataset`` (with ``HF_DATASETS_OFFLINE=0``: nothing of the corpus is downloaded into the
  cache, it is read as a stream).

``datasets`` is an optional dependency (``pip install datasets``), imported on first use. moetrain reads it offline:
unless ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set, it sets ``HF_DATASETS_OFFLINE=1`` before the import, so a
hub dataset must already be in the local cache (a training job should not download its corpus on every rank); set
``HF_DATASETS_OFFLINE=0`` to let ``datasets`` download it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .config import DataSource
from .corpus import DataError

__all__ = ["HFSource", "import_datasets", "is_saved_dataset", "open_hf_source"]

#: Rows read from a dataset per ``iter`` call while tokenising.
ROWS_PER_BATCH = 1000
_INSTALL = "pip install datasets (or pip install 'moetrain[datasets]')"


def import_datasets() -> Any:
    """The ``datasets`` module, imported offline by default (see the module docstring).

    Raises:
        DataError: ``datasets`` is not installed (the message says how to install it).
    """
    if "HF_DATASETS_OFFLINE" not in os.environ and "HF_HUB_OFFLINE" not in os.environ:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"data.sources with a datasets folder or a hub name need Hugging Face datasets: {_INSTALL}") \
            from e
    datasets.disable_progress_bars()  # moetrain's own progress report covers the preparation
    return datasets


def is_saved_dataset(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` folder."""
    p = Path(path)
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and
                                                   (p / "dataset_info.json").is_file())


@dataclass
class HFSource:
    """A ``datasets`` split opened for reading.

    Attributes:
        dataset: the ``datasets.Dataset`` (memory-mapped) or ``datasets.IterableDataset`` (streaming).
        text_field: the string column holding the documents.
        identity: what names this source's content in the preparation cache key (JSON-serialisable): the files
            it is read from with their sizes and modification times, or for a streamed hub dataset its recorded
            split sizes.
        n_bytes: bytes of Arrow data behind the split when known (the progress report's total), else None.
    """

    dataset: Any
    text_field: str
    identity: dict[str, Any]
    n_bytes: int | None

    def documents(self) -> Iterator[str]:
        """The split's documents in row order; null and empty texts are skipped.

        Raises:
            DataError: a value of the text column that is not a string.
        """
        for batch in self.dataset.select_columns([self.text_field]).iter(batch_size=ROWS_PER_BATCH):
            for text in batch[self.text_field]:
                if text is None or text == "":
                    continue
                if not isinstance(text, str):
                    raise DataError(f"column {self.text_field!r} holds a {type(text).__name__}, not text; name the "
                                    "text column with text_field")
                yield text


def _files_identity(root: Path) -> list[list[Any]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith(".lock"):
                continue
            f = Path(dirpath) / name
            st = f.stat()
            out.append([f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    return out


def _cache_files_identity(ds: Any) -> list[list[Any]]:
    out = []
    for entry in ds.cache_files:
        st = os.stat(entry["filename"])
        out.append([entry["filename"], st.st_size, st.st_mtime_ns])
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _check_column(ds: Any, field: str, where: str) -> None:
    features = ds.features
    if features is None:  # a stream whose schema is known only from its first record
        return
    if field not in features:
        cols = ", ".join(repr(c) for c in features) or "none"
        raise DataError(f"{where}: has no column {field!r} (columns: {cols}); name the column that holds the text "
                        "with text_field (or data.text_field)")
    feat = features[field]
    if getattr(feat, "dtype", None) not in ("string", "large_string"):  # a foreign (datasets) object
        raise DataError(f"{where}: column {field!r} is {feat}, not a string column; name the text column with "
                        "text_field")


def open_hf_source(src: DataSource, text_field: str, cache_dir: str | None, where: str) -> HFSource:
    """Open ``src`` (a directory ``path`` or a hub ``name``) with ``datasets``; see the module docstring.

    Args:
        src: the source. text_field: its text column (the source's own, else ``data.text_field``).
        cache_dir: ``data.hf_cache_dir`` (None = ``datasets``' default). where: how messages name the source,
            e.g. ``"data.sources[1] (hub:wikitext)"``.

    Raises:
        DataError: ``datasets`` missing; the folder, dataset, configuration or split cannot be found (a hub name
            not in the local cache says how to fetch it); the text column is missing or not a string column.
    """
    datasets = import_datasets()
    cache = None if cache_dir is None else os.path.expanduser(os.fspath(cache_dir))
    identity: dict[str, Any] = {"split": src.split, "config": src.config, "text_field": text_field}
    try:
        if src.path is not None:
            root = Path(os.path.expanduser(src.path)).resolve()
            if is_saved_dataset(root):
                ds = datasets.load_from_disk(str(root))
                if isinstance(ds, datasets.DatasetDict):
                    if src.split not in ds:
                        raise DataError(f"{where}: the saved DatasetDict has no split {src.split!r} (splits: "
                                        f"{', '.join(map(repr, ds))}); choose one with split=")
                    ds = ds[src.split]
                identity["kind"] = "saved"
            else:  # always streamed: the files are read where they lie, no Arrow copy is made of them
                ds = datasets.load_dataset(str(root), src.config, split=src.split, streaming=True, cache_dir=cache)
                identity["kind"] = "folder"
            identity["files"] = _files_identity(root)
        else:
            ds = datasets.load_dataset(src.name, src.config, split=src.split, streaming=src.streaming,
                                       cache_dir=cache)
            identity["kind"] = "hub"
            identity["name"] = src.name
            if isinstance(ds, datasets.Dataset):
                identity["files"] = _cache_files_identity(ds)
            else:
                info = ds.info.splits.get(src.split) if ds.info.splits else None
                identity["split_info"] = None if info is None else [info.num_examples, info.num_bytes]
                identity["version"] = str(ds.info.version)
    except DataError:
        raise
    except ConnectionError as e:  # offline, and not in the cache
        raise DataError(f"{where}: not in the local Hugging Face datasets cache "
                        f"({cache or datasets.config.HF_DATASETS_CACHE}) ({_first_line(e)}); moetrain reads hub "
                        f"datasets offline: fetch it once where there is a network (datasets.load_dataset"
                        f"({src.name!r}, {src.config!r}, cache_dir=...)) and point data.hf_cache_dir at that cache, "
                        "or set HF_DATASETS_OFFLINE=0 to let datasets download it") from e
    except datasets.data_files.EmptyDatasetError as e:  # a folder without a file datasets reads
        raise DataError(f"{where}: the folder holds no data file datasets reads ({type(e).__name__}); point it at a "
                        "save_to_disk folder or one holding .parquet / .arrow / .jsonl / .csv / .txt files") from e
    except Exception as e:  # datasets raises FileNotFoundError, ValueError (unknown split/config), its own errors
        raise DataError(f"{where}: datasets cannot read it ({type(e).__name__}: {_first_line(e)})") from e
    _check_column(ds, text_field, where)
    n_bytes = None
    if isinstance(ds, datasets.Dataset):
        n_bytes = int(ds.data.nbytes)
    elif ds.info.splits and src.split in ds.info.splits:
        n_bytes = ds.info.splits[src.split].num_bytes or None
    return HFSource(ds, text_field, identity, n_bytes)
