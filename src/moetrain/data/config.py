"""Configuration of the data pipeline (sources, tokenizer, packing, split, cache).

:class:`DataConfig` is a plain dataclass; :meth:`DataConfig.validate` rejects bad values with a ``ValueError`` whose
message names the field and the values it may take. Nothing here touches the file system: path problems are reported
by :func:`moetrain.data.prepare_data` (as :class:`moetrain.data.DataError`) before any expensive work starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: Special token added to a trained byte-level BPE; it separates documents in the token stream.
BPE_EOS_TOKEN = "<|endoftext|>"
#: A trained byte-level BPE holds the 256 byte symbols plus at least the end-of-text token.
MIN_BPE_VOCAB = 256 + 1
#: Upper bound on the vocabulary of a trained BPE (token ids are stored as uint16 or uint32).
MAX_BPE_VOCAB = 2**31 - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        return self
