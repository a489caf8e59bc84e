"""Configuration of the data pipeline (sources, tokenizer, packing, split, cache).

:class:`DataConfig` is a plain dataclass; :meth:`DataConfig.validate` rejects bad values with a ``ValueError`` whose
message names the field and the values it may take. Nothing here touches the file system: path problems are reported
by :func:`moetrain.data.prepare_data` (as :class:`moetrain.data.DataError`) before any expensive work starts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from moetrain.errors import ConfigError

#: Special token added to a trained byte-level BPE; it separates documents in the token stream.
BPE_EOS_TOKEN = "<|endoftext|>"
#: A trained byte-level BPE holds the 256 byte symbols plus at least the end-of-text token.
MIN_BPE_VOCAB = 256 + 1
#: Upper bound on the vocabulary of a trained BPE (token ids are stored as uint16 or uint32).
MAX_BPE_VOCAB = 2**31 - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: Prefix of a hub dataset in the compact source form (``hub:NAME``); anything else is a path.
HUB_PREFIX = "hub:"


@dataclass
class DataSource:
    """One source of a weighted data mixture (an entry of ``data.sources``).

    Attributes:
        path: local text: a file or glob of .txt/.jsonl/.parquet files (read as ``data.paths`` reads them), or a
            directory read with Hugging Face ``datasets``: a ``save_to_disk`` folder, or a folder of
            Arrow/Parquet/JSON-lines files (its split files found by ``datasets``' naming rules). Exactly one of
            ``path`` and ``name`` is given.
        name: a dataset in the local Hugging Face datasets cache (``data.hf_cache_dir``), by its hub id, e.g.
            ``"wikitext"``; read offline unless ``HF_DATASETS_OFFLINE=0`` is set.
        config: the hub dataset's configuration (subset), e.g. ``"wikitext-2-raw-v1"``; None = its only one.
        split: the ``datasets`` split to read (``"train"``); the validation documents are then drawn from it by
            ``data.val_fraction`` like any other source's. Ignored for plain files.
        text_field: the column holding the text; None = ``data.text_field``.
        weight: the source's share of the training tokens, relative to the other sources' weights (> 0; the
            weights are normalised to sum to 1).
        streaming: read a hub dataset as a stream (``streaming=True``, an ``IterableDataset``): documents are
            tokenised as they arrive, and with downloads allowed none of the corpus is copied into the datasets
            cache. A datasets folder is always streamed; a ``save_to_disk`` folder is memory-mapped.
    """

    path: str | None = None
    name: str | None = None
    config: str | None = None
    split: str = "train"
    text_field: str | None = None
    weight: float = 1.0
    streaming: bool = False

    @property
    def label(self) -> str:
        """How messages and ``moetrain prepare`` name the source: its path, or ``hub:NAME[/CONFIG]``."""
        if self.path is not None:
            return str(self.path)
        return f"{HUB_PREFIX}{self.name}" + (f"/{self.config}" if self.config else "")


_SOURCE_FIELDS = tuple(f.name for f in fields(DataSource))
_SPEC_HELP = ("a table {path = \"GLOB_OR_DIR\", weight = 2.0} or a string \"GLOB_OR_DIR,weight=2\" / "
              "\"hub:NAME,config=C,split=train,text_field=text,weight=1,streaming=true\"")


def parse_source_spec(spec: str, where: str = "data.sources") -> DataSource:
    """A :class:`DataSource` from the compact form ``WHERE[,key=value...]``: ``WHERE`` is a path (file, glob or
    directory) or ``hub:NAME``; the keys are the other fields (``weight``, ``split``, ``text_field``, ``config``,
    ``streaming``), e.g. ``"web/*.parquet,weight=3"`` or ``"hub:wikitext,config=wikitext-2-raw-v1,weight=1"``.

    Raises:
        ConfigError: an empty ``WHERE``, an item without ``=``, an unknown key, a weight that is not a number or a
            streaming flag that is not true/false (the message names ``where`` and the item).
    """
    head, *items = [x.strip() for x in str(spec).split(",")]
    if not head:
        raise ConfigError(f"{where}={spec!r}: name a path or hub:NAME first, e.g. \"web/*.jsonl,weight=2\"")
    kw: dict[str, object] = ({"name": head[len(HUB_PREFIX):]} if head.startswith(HUB_PREFIX) else {"path": head})
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _SOURCE_FIELDS or key in ("path", "name"):
            allowed = ", ".join(f for f in _SOURCE_FIELDS if f not in ("path", "name"))
            raise ConfigError(f"{where}={spec!r}: {item!r} is not KEY=VALUE with KEY one of {allowed}")
        value = value.strip()
        if key == "weight":
            try:
                kw[key] = float(value)
            except ValueError:
                raise ConfigError(f"{where}={spec!r}: weight={value!r} is not a number") from None
        elif key == "streaming":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"{where}={spec!r}: streaming={value!r} must be true or false")
            kw[key] = value.lower() in ("true", "1")
        else:
            kw[key] = value
    return DataSource(**kw)


def to_source(entry: object, where: str) -> DataSource:
    """One entry of ``data.sources`` (a :class:`DataSource`, a table or a compact string) as a DataSource.

    Raises:
        ConfigError: an entry of another type, or a table with an unknown key (naming the valid ones).
    """
    if isinstance(entry, DataSource):
        return entry
    if isinstance(entry, str):
        return parse_source_spec(entry, where)
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - set(_SOURCE_FIELDS))
        if unknown:
            raise ConfigError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(_SOURCE_FIELDS)}")
        return DataSource(**entry)
    raise ConfigError(f"{where}={entry!r} must be {_SPEC_HELP}")


@dataclass
class DataConfig:
    """Where the training text comes from and how it is turned into token shards.

    Attributes:
        paths: files or glob patterns (``**`` recurses) of the training text. Supported: plain text (``.txt``,
            ``.md``, ``.py``, ... one file = one document), JSON lines (``.jsonl``/``.ndjson``/``.json``, one
            document per record) and Parquet (``.parquet``, one document per row). Empty = the built-in corpus
            (the Python standard library's own ``.py`` sources, see :mod:`moetrain.data.corpus`).
        text_field: the JSON key / Parquet column that holds the text of a document.
        tokenizer: path to an existing Hugging Face ``tokenizer.json`` (e.g. DeepSeek-V3's). None = train a
            byte-level BPE of ``vocab_size`` tokens on the corpus.
        vocab_size: size of the trained BPE (ignored when ``tokenizer`` is given; the loaded tokenizer's own size
            is used then). In a job (``moetrain train``) it defaults to the model's vocabulary size.
        seq_len: tokens per training sequence L (each packed window holds L + 1 tokens).
        val_fraction: fraction of the documents held out for validation, in (0, 0.5].
        cache_dir: directory of the prepared tokenizers and token shards (relative = to the working directory).
        builtin_max_bytes: cap on the size of the built-in corpus in bytes (whole files are taken in sorted path
            order, skipping those that would exceed the cap).
        seed: seed of the train/validation split (the loader has its own shuffle seed).
        eos_token: end-of-document token of an existing ``tokenizer`` when none of the known ones
            (``<｜end▁of▁sentence｜>``, ``<|endoftext|>``, ``</s>``) is in its vocabulary; None = detect.
        sources: a weighted mixture of sources instead of ``paths``: ``[[data.sources]]`` tables in a job file
            (keys: path or name, weight, split, text_field, config, streaming; see DataSource), or compact
            strings ``"GLOB_OR_DIR,weight=2"`` / ``"hub:NAME,weight=1"`` (``--source SPEC``). Each source is
            tokenised into its own shards with one shared tokenizer; training draws windows from them by weight,
            deterministically and resumably. Empty = ``paths`` (or the built-in corpus).
        hf_cache_dir: the Hugging Face datasets cache that ``data.sources`` ``name`` entries are read from; None =
            ``datasets``' default (``HF_DATASETS_CACHE``, ``~/.cache/huggingface/datasets``).
    """

    paths: list[str] = field(default_factory=list)
    text_field: str = "text"
    tokenizer: str | None = None
    vocab_size: int = 4096
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str = ".cache/moetrain"
    builtin_max_bytes: int = 8_000_000
    seed: int = 0
    eos_token: str | None = None
    sources: list[DataSource] = field(default_factory=list)
    hf_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sources, (list, tuple)):  # tables / strings of a job file or --set, dicts of a saved job
            self.sources = [to_source(e, f"data.sources[{i}]") for i, e in enumerate(self.sources)]

    def validate(self) -> "DataConfig":
        """Check every field; return ``self`` so calls can be chained.

        Raises:
            ValueError: naming the field, the allowed values and the value given.
        """

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"data.{name} must be {allowed}; got {getattr(self, name)!r} (--set data.{name}=)")

        if isinstance(self.paths, (str, bytes, os.PathLike)) or not isinstance(self.paths, (list, tuple)):
            raise bad("paths", "a list of file paths or glob patterns (e.g. ['data/*.jsonl']), or [] for the "
                      "built-in corpus")
        for p in self.paths:
            if not isinstance(p, (str, os.PathLike)) or not str(p).strip():
                raise bad("paths", "a list of non-empty path strings")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise bad("text_field", "a non-empty string (the JSON key / Parquet column holding the text)")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, (str, os.PathLike))
                                           or not str(self.tokenizer).strip()):
            raise bad("tokenizer", "None (train a byte-level BPE) or the path of a tokenizer.json")
        if not _is_int(self.vocab_size) or not MIN_BPE_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB:
            raise bad("vocab_size", f"an integer in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] (256 byte tokens + "
                      f"the {BPE_EOS_TOKEN} special token at least)")
        if not _is_int(self.seq_len) or self.seq_len < 2:
            raise bad("seq_len", "an integer >= 2")
        if (not isinstance(self.val_fraction, (int, float)) or isinstance(self.val_fraction, bool)
                or not 0.0 < float(self.val_fraction) <= 0.5):
            raise bad("val_fraction", "a number in (0, 0.5]")
        if not isinstance(self.cache_dir, (str, os.PathLike)) or not str(self.cache_dir).strip():
            raise bad("cache_dir", "a non-empty directory path")
        if not _is_int(self.builtin_max_bytes) or self.builtin_max_bytes < 1:
            raise bad("builtin_max_bytes", "an integer >= 1 (bytes of the built-in corpus)")
        if not _is_int(self.seed) or self.seed < 0:
            raise bad("seed", "an integer >= 0")
        if self.eos_token is not None and (not isinstance(self.eos_token, str) or not self.eos_token):
            raise bad("eos_token", "None (detect) or a token string of the tokenizer's vocabulary")
        if not isinstance(self.sources, list):
            raise bad("sources", f"a list of sources, each {_SPEC_HELP}")
        if self.sources and self.paths:
            raise ValueError(f"data.paths={self.paths!r} and data.sources (a mixture of {len(self.sources)}) are "
                             "both given; put the paths in data.sources as one more source (--source GLOB), or "
                             "drop data.sources")
        for i, src in enumerate(self.sources):
            validate_source(src, f"data.sources[{i}]")
        if self.hf_cache_dir is not None and (not isinstance(self.hf_cache_dir, (str, os.PathLike))
                                              or not str(self.hf_cache_dir).strip()):
            raise bad("hf_cache_dir", "None (datasets' default cache) or a directory path")
        return self


def validate_source(src: DataSource, where: str) -> None:
    """Check one source's fields (as :meth:`DataConfig.validate` checks each of ``data.sources``).

    Raises:
        ValueError: naming ``where`` (e.g. ``"data.sources[1]"`` or ``"--data"``) and the field.
    """
    label = f"{where} ({src.label})" if (src.path or src.name) else where

    def nonempty(v: object) -> bool:
        return isinstance(v, (str, os.PathLike)) and bool(str(v).strip())

    if (src.path is None) == (src.name is None):
        raise ValueError(f"{where} must name exactly one of path (a file, glob or datasets folder) and name (a hub "
                         f"dataset in the local cache); got path={src.path!r}, name={src.name!r}")
    if src.path is not None and not nonempty(src.path):
        raise ValueError(f"{where}.path must be a non-empty path; got {src.path!r}")
    if src.name is not None and not nonempty(src.name):
        raise ValueError(f"{where}.name must be a non-empty dataset id; got {src.name!r}")
    w = src.weight
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
        raise ValueError(f"{label}: weight must be a positive number (a share relative to the other sources); "
                         f"got {w!r}")
    if not nonempty(src.split):
        raise ValueError(f"{label}: split must be a non-empty split name such as \"train\"; got {src.split!r}")
    for name, v in (("text_field", src.text_field), ("config", src.config)):
        if v is not None and not nonempty(v):
            raise ValueError(f"{label}: {name} must be None or a non-empty string; got {v!r}")
    if not isinstance(src.streaming, bool):
        raise ValueError(f"{label}: streaming must be true or false; got {src.streaming!r}")
