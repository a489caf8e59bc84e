import json

import numpy as np
import pytest

from moetrain.data import DataError, doc_split, load_tokens, read_meta, token_dtype, write_shards
from moetrain.data.shards import _pieces


def _docs_of(tokens) -> list[str]:
    """Split a char-tokenised stream (id 0 = eos) back into documents."""
    out, cur = [], []
    for t in np.asarray(tokens).tolist():
        if t == 0:
            out.append("".join(chr(i - 1) for i in cur))
            cur = []
        else:
            cur.append(t)
    assert not cur, "stream must end with eos"
    return out


def test_token_dtype():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65537) == np.uint32
    assert token_dtype(129_280) == np.uint32
    with pytest.raises(DataError):
        token_dtype(2**33)


def test_write_shards_split_meta_atomic(tmp_path, char_tok):
    docs = [f"document number {i} " * (1 + i % 5) for i in range(200)]
    info = write_shards(iter(docs), char_tok, tmp_path, val_fraction=0.1, seed=3,
                        sources=[{"path": "x", "size": 1, "mtime_ns": 2}], extra_meta={"note": "hi"})
    assert not list(tmp_path.glob("*.tmp*"))
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == read_meta(tmp_path)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 1000 and meta["eos_id"] == 0
    assert meta["tokenizer_sha256"] == "fake" and meta["note"] == "hi" and meta["sources"][0]["path"] == "x"
    assert meta["split"] == {"mode": "documents", "val_fraction": 0.1, "seed": 3, "topped_up_docs": 0}
    train, val = load_tokens(info.train_path), load_tokens(info.val_path)
    assert train.dtype == np.uint16 and len(train) == info.n_train_tokens == meta["splits"]["train"]["n_tokens"]
    assert len(val) == info.n_val_tokens > 0
    tr_docs, va_docs = _docs_of(train), _docs_of(val)
    assert len(tr_docs) == info.n_train_docs and len(va_docs) == info.n_val_docs > 0
    # every document in exactly one split, in corpus order, as decided by doc_split
    expect_val = [d for i, d in enumerate(docs) if doc_split(i, 3, 0.1) == "val"]
    assert va_docs == expect_val
    assert tr_docs == [d for i, d in enumerate(docs) if doc_split(i, 3, 0.1) == "train"]
    assert 5 <= len(va_docs) <= 40
    # deterministic; a different seed gives a different split
    again = write_shards(iter(docs), char_tok, tmp_path / "again", val_fraction=0.1, seed=3)
    assert np.array_equal(load_tokens(again.val_path), val)
    other = write_shards(iter(docs), char_tok, tmp_path / "other", val_fraction=0.1, seed=4)
    assert _docs_of(load_tokens(other.val_path)) != va_docs


def test_uint32_for_large_vocab(tmp_path, char_tok):
    char_tok.vocab_size = 129_280
    info = write_shards(["hello", "world", "again"], char_tok, tmp_path, val_fraction=0.4)
    assert info.dtype == "uint32"
    assert (tmp_path / "train.bin").stat().st_size == 4 * info.n_train_tokens
    assert load_tokens(info.train_path).dtype == np.uint32


def test_val_never_empty_with_few_docs(tmp_path, char_tok):
    docs = ["alpha", "beta", "gamma"]
    assert all(doc_split(i, 0, 0.001) == "train" for i in range(3))
    info = write_shards(docs, char_tok, tmp_path, val_fraction=0.001)
    tr, va = _docs_of(load_tokens(info.train_path)), _docs_of(load_tokens(info.val_path))
    assert len(va) == 1 and len(tr) == 2 and sorted(tr + va) == sorted(docs)


def test_val_topped_up_to_half_its_token_share(tmp_path, char_tok):
    # every doc drawn for validation is tiny, so the drawn val split is far below its token share
    vf, seed = 0.1, 0
    docs = ["vv" if doc_split(i, seed, vf) == "val" else "t" * 50 for i in range(120)]
    info = write_shards(docs, char_tok, tmp_path, val_fraction=vf, seed=seed)
    total = info.n_train_tokens + info.n_val_tokens
    drawn = sum(doc_split(i, seed, vf) == "val" for i in range(120))
    assert 0.5 * vf * total <= info.n_val_tokens <= 2 * vf * total
    meta = read_meta(tmp_path)
    assert meta["split"]["topped_up_docs"] == info.n_val_docs - drawn > 0
    tr, va = _docs_of(load_tokens(info.train_path)), _docs_of(load_tokens(info.val_path))
    assert sorted(tr + va) == sorted(docs)
    assert va[:drawn] == ["vv"] * drawn  # drawn docs first, in corpus order, then the topped-up ones


def test_small_corpus_is_topped_up_beyond_the_4x_candidates(tmp_path, char_tok):
    # 30 documents and a seed for which none is drawn for validation nor falls below u = 4 * val_fraction, apart
    # from the one of smallest u (moved to validation as the split may not be empty): the 4x candidates alone
    # left validation with that one short document (a small built-in corpus on Python 3.12 met this).
    from moetrain.data.shards import _doc_u
    vf, n = 0.02, 30
    seed = next(s for s in range(10_000) if sorted(_doc_u(i, s) for i in range(n))[1] >= 4 * vf)
    first = min(range(n), key=lambda i: _doc_u(i, seed))
    docs = ["v" if i == first else f"document {i} " * 4 for i in range(n)]
    info = write_shards(docs, char_tok, tmp_path, val_fraction=vf, seed=seed)
    total = info.n_train_tokens + info.n_val_tokens
    assert 0.5 * vf * total <= info.n_val_tokens <= 2 * vf * total
    assert read_meta(tmp_path)["split"]["topped_up_docs"] == info.n_val_docs - 1 > 0
    tr, va = _docs_of(load_tokens(info.train_path)), _docs_of(load_tokens(info.val_path))
    assert sorted(tr + va) == sorted(docs) and "v" in va


def test_train_never_empty(tmp_path, char_tok):
    # with val_fraction 0.5 and two docs, find a seed that draws both for validation
    seed = next(s for s in range(1000) if doc_split(0, s, 0.5) == doc_split(1, s, 0.5) == "val")
    info = write_shards(["first doc", "second doc"], char_tok, tmp_path, val_fraction=0.5, seed=seed)
    assert info.n_train_docs == 1 and info.n_val_docs == 1
    assert sorted(_docs_of(load_tokens(info.train_path)) + _docs_of(load_tokens(info.val_path))) == \
        ["first doc", "second doc"]


def test_single_document_split_by_tokens(tmp_path, char_tok):
    doc = "x" * 99  # 99 tokens + eos = 100
    info = write_shards([doc], char_tok, tmp_path, val_fraction=0.2)
    assert (info.n_train_tokens, info.n_val_tokens) == (80, 20)
    both = np.concatenate([load_tokens(info.train_path), load_tokens(info.val_path)])
    assert both.tolist() == [ord("x") + 1] * 99 + [0]
    assert read_meta(tmp_path)["split"]["mode"] == "tokens"


def test_no_documents(tmp_path, char_tok):
    with pytest.raises(DataError, match="no non-empty documents"):
        write_shards(["", ""], char_tok, tmp_path, val_fraction=0.1)
    assert not list(tmp_path.iterdir())


def test_failure_leaves_no_partial_output(tmp_path, char_tok):
    write_shards(["old one", "old two", "old three"], char_tok, tmp_path, val_fraction=0.3)

    def broken():
        yield "fine"
        raise DataError("boom while reading")

    with pytest.raises(DataError, match="boom"):
        write_shards(broken(), char_tok, tmp_path, val_fraction=0.3)
    assert not (tmp_path / "meta.json").exists()  # the old, now inconsistent preparation is not "complete"
    assert not list(tmp_path.glob("*.tmp*"))


def test_corrupt_shard_detected(tmp_path, char_tok):
    info = write_shards(["a" * 50, "b" * 50, "c" * 50], char_tok, tmp_path, val_fraction=0.3)
    with open(info.train_path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="prepare the data again"):
        read_meta(tmp_path)
    with pytest.raises(DataError, match="prepare the data again"):
        load_tokens(info.train_path)


def test_long_documents_are_split_at_line_starts():
    text = "".join(f"line {i}\n    indented {i}\n" for i in range(20000))
    pieces = list(_pieces(text, max_chars=10_000))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) <= 10_000 for p in pieces)
    assert all(p.endswith("\n") and not p[-2].isspace() for p in pieces[:-1])
    assert all(not p[0].isspace() for p in pieces)


def test_long_document_tokens_equal_whole_encoding(tmp_path):
    """Encoding a long document in pieces gives the same ids as encoding it whole (byte-level BPE)."""
    from moetrain.data import train_bpe

    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(3000))
    tok = train_bpe([text], 300, tmp_path / "tok.json")
    pieces = list(_pieces(text, 5000))
    assert len(pieces) > 5
    assert sum(tok.encode_batch(pieces), []) == tok.encode(text)
