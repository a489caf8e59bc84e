import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from moetrain.data import DataError, Tokenizer, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    docs = [
        "The quick brown fox jumps over the lazy dog. " * 30,
        "def add(a, b):\n    return a + b\n" * 30,
        "Mixture-of-experts models route each token to a few experts. " * 30,
    ]
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(iter(docs), 400, out), out


def test_train_bpe_vocab_and_eos(trained):
    tok, out = trained
    assert out.is_file() and not list(out.parent.glob("*.tmp"))
    assert isinstance(tok, Tokenizer)
    assert 257 <= tok.vocab_size <= 400
    assert tok.eos_token == "<|endoftext|>" and tok.eos_id == 0
    assert tok.hf.get_vocab_size() == tok.vocab_size


@pytest.mark.parametrize("text", ["The lazy fox returns a + b", "never seen: Ζ東京🙂 \t\n  spaces", ""])
def test_roundtrip(trained, text):
    tok, _ = trained
    ids = tok.encode_batch([text])[0]
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_merges_compress_training_text(trained):
    tok, _ = trained
    text = "The quick brown fox jumps over the lazy dog. "
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_encode_batch_matches_single(trained):
    tok, _ = trained
    texts = ["def f(x):", "return a + b", "fox"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_load_trained(trained):
    tok, out = trained
    again = load_tokenizer(out)
    assert again.vocab_size == tok.vocab_size and again.eos_id == tok.eos_id
    assert again.sha256 == tok.sha256
    assert load_tokenizer(out.parent).path == str(out)  # a directory holding tokenizer.json


def _vocab_tokenizer(tmp_path, specials):
    vocab = {"a": 0, "b": 1, "c": 2}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="a"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(specials)
    p = tmp_path / "tokenizer.json"
    hf.save(str(p))
    return p


def test_eos_detection_order(tmp_path):
    p = _vocab_tokenizer(tmp_path, ["</s>", "<｜end▁of▁sentence｜>"])
    tok = load_tokenizer(p)
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    assert tok.eos_id == tok.hf.token_to_id("<｜end▁of▁sentence｜>")
    assert load_tokenizer(p, eos_token="</s>").eos_id == tok.hf.token_to_id("</s>")


def test_eos_undetectable_asks_user(tmp_path):
    p = _vocab_tokenizer(tmp_path, ["<eod>"])
    with pytest.raises(DataError, match=r"eos_token.*<eod>"):
        load_tokenizer(p)
    assert load_tokenizer(p, eos_token="<eod>").eos_id == 3
    with pytest.raises(DataError, match="no token '<nope>'"):
        load_tokenizer(p, eos_token="<nope>")


def test_missing_and_invalid_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match="not a valid"):
        load_tokenizer(bad)


def test_train_rejects_tiny_vocab_and_empty_corpus(tmp_path):
    with pytest.raises(DataError, match=">= 257"):
        train_bpe(["abc"], 100, tmp_path / "t.json")
    with pytest.raises(DataError, match="no non-empty documents"):
        train_bpe(["", ""], 300, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
