"""Shared fixtures of the data-pipeline tests (the package is imported from src/ when it is not installed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# No test reaches the network: a hub dataset is read from a datasets cache the test builds (before any import of it).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_SRC = Path(__file__).resolve().parents[2] / "src"
try:
    import moetrain.data  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_SRC))


class CharTokenizer:
    """A fake tokenizer for exact split/packing checks: id = code point + 1, id 0 = end of document."""

    def __init__(self, vocab_size: int = 1000):
        self.vocab_size = vocab_size
        self.eos_id = 0
        self.eos_token = "<eos>"
        self.sha256 = "fake"

    def encode_batch(self, texts):
        return [[ord(c) + 1 for c in t] for t in texts]

    def decode(self, ids):
        return "".join("\n<eos>\n" if i == 0 else chr(i - 1) for i in ids)


@pytest.fixture
def char_tok():
    return CharTokenizer()


@pytest.fixture
def src_path() -> Path:
    return _SRC


SAMPLE_DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 10,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 15,
    "Unicode: café, naïve, 東京, Ελληνικά, emoji 🙂 and tabs\tand newlines\n" * 8,
    "Mixture-of-experts models route each token to a few experts. " * 12,
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n" * 9,
]


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A directory with six small .txt documents (doc0.txt .. doc5.txt)."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i, text in enumerate(SAMPLE_DOCS):
        (d / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture
def sample_docs() -> list[str]:
    return list(SAMPLE_DOCS)
