"""Tokenizers: train a byte-level BPE with Hugging Face ``tokenizers``, or load an existing ``tokenizer.json``.

The trained tokenizer is GPT-2-style byte-level BPE: every UTF-8 byte is a base symbol (so any text encodes and
decodes losslessly), plus one special token, ``<|endoftext|>``, which separates documents in the token stream.

For an existing ``tokenizer.json`` the end-of-document token is the first of ``<｜end▁of▁sentence｜>`` (DeepSeek),
``<|endoftext|>`` (GPT-2 style), ``</s>`` (Llama/T5 style) found in its vocabulary, unless one is named explicitly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Sequence

from .config import BPE_EOS_TOKEN, MIN_BPE_VOCAB
from .corpus import DataError

__all__ = ["EOS_CANDIDATES", "Tokenizer", "file_sha256", "load_tokenizer", "train_bpe"]

#: End-of-document tokens looked for, in order, in an existing tokenizer.
EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """Thin wrapper of a ``tokenizers.Tokenizer`` with the end-of-document id resolved.

    Attributes:
        vocab_size: ``max token id + 1`` over the base vocabulary and the added tokens (the size an embedding table
            needs; it can exceed the count of tokens when ids are sparse).
        eos_id: id of the end-of-document token; ``eos_token`` is its string.
        path: the ``tokenizer.json`` it was loaded from / saved to (None when built in memory).
        sha256: hex SHA-256 of that file (None when ``path`` is None).
        hf: the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf_tokenizer, eos_token: str | None = None, path: str | os.PathLike | None = None):
        """Wrap ``hf_tokenizer``; ``eos_token`` None = detect from :data:`EOS_CANDIDATES`.

        Raises:
            DataError: the end-of-document token is not in the vocabulary or cannot be detected.
        """
        self.hf = hf_tokenizer
        self.path = None if path is None else str(path)
        self.sha256 = None if path is None else file_sha256(path)
        where = f"tokenizer {self.path!r}" if self.path else "tokenizer"
        if eos_token is None:
            for cand in EOS_CANDIDATES:
                if hf_tokenizer.token_to_id(cand) is not None:
                    eos_token = cand
                    break
            else:
                specials = [t.content for t in hf_tokenizer.get_added_tokens_decoder().values() if t.special][:20]
                raise DataError(f"{where} has none of the known end-of-document tokens {list(EOS_CANDIDATES)}; say "
                                f"which token separates documents with --set data.eos_token=\"TOKEN\" (its special "
                                f"tokens: {specials or 'none'})")
        eos_id = hf_tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"{where} has no token {eos_token!r} (data.eos_token); give a token of its vocabulary "
                            "with --set data.eos_token=\"TOKEN\", or leave it unset to detect one")
        self.eos_token: str = eos_token
        self.eos_id: int = int(eos_id)
        ids = list(hf_tokenizer.get_vocab(with_added_tokens=True).values())
        self.vocab_size: int = (max(ids) + 1) if ids else 0

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no special tokens added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, computed in parallel by the Rust backend (no BOS/EOS or other specials added).

        Args:
            texts: N strings.
        Returns:
            N lists of int ids, each id in ``[0, vocab_size)``.
        """
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of a sequence of ids (ints, or a 1-D integer array/tensor); special tokens are kept by default."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}/{self.eos_id}, path={self.path!r})"


def _atomic_save(hf_tokenizer, out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + f".{os.getpid()}.tmp")
    try:
        hf_tokenizer.save(str(tmp))
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()


def train_bpe(docs: Iterable[str], vocab_size: int, out_path: str | os.PathLike) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``docs`` and save it as ``out_path`` (JSON).

    The vocabulary holds ``<|endoftext|>`` (id 0), the 256 byte symbols, then the learnt merges; it is smaller than
    ``vocab_size`` when the corpus runs out of pairs to merge. The file is written atomically (temp file + rename).

    Raises:
        DataError: ``vocab_size`` < 257, or ``docs`` holds no text.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"vocab_size must be >= {MIN_BPE_VOCAB} for a byte-level BPE (256 bytes + {BPE_EOS_TOKEN}); "
                        f"got {vocab_size}")
    seen = [0]

    def counted(it):
        for d in it:
            if d:
                seen[0] += 1
                yield d

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(counted(docs), trainer=trainer)
    if seen[0] == 0:
        raise DataError("cannot train a tokenizer: the corpus has no non-empty documents")
    out_path = Path(out_path)
    _atomic_save(tok, out_path)
    return Tokenizer(tok, BPE_EOS_TOKEN, out_path)


def load_tokenizer(path: str | os.PathLike, eos_token: str | None = None) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json`` and resolve its end-of-document token.

    Args:
        path: the ``tokenizer.json`` file (a directory holding one is accepted too).
        eos_token: the token separating documents; None = the first of :data:`EOS_CANDIDATES` in the vocabulary.

    Raises:
        DataError: the file is missing or not a valid tokenizer.json; no end-of-document token can be determined.
    """
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"tokenizer file {os.fspath(path)!r} does not exist (looked for {str(p.absolute())!r}); give "
                        "a tokenizer.json with --tokenizer FILE (--set data.tokenizer=), or leave it unset to train a "
                        "BPE")
    try:
        hf = HFTokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise DataError(f"tokenizer file {str(p)!r} is not a valid Hugging Face tokenizer.json ({e})") from e
    return Tokenizer(hf, eos_token, p)
