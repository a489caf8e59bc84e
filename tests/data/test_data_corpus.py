import json
import os
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrain.data import DataError, builtin_corpus_paths, check_sources, iter_documents, resolve_paths


# ------------------------------------------------------------------------------------------------ resolve_paths
def test_glob_sorted_and_deduped(text_corpus):
    (text_corpus / "sub").mkdir()
    (text_corpus / "sub" / "deep.md").write_text("deep text")
    flat = resolve_paths([str(text_corpus / "*.txt")])
    assert [p.name for p in flat] == [f"doc{i}.txt" for i in range(6)]
    assert all(p.is_absolute() for p in flat)
    both = resolve_paths([str(text_corpus / "**" / "*"), str(text_corpus / "doc0.txt"), str(text_corpus / "doc*.txt")])
    assert both == sorted(set(both))
    assert len(both) == 7 and any(p.name == "deep.md" for p in both)


def test_single_string_and_relative_path(text_corpus, monkeypatch):
    monkeypatch.chdir(text_corpus)
    assert [p.name for p in resolve_paths("doc1.txt")] == ["doc1.txt"]


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as ei:
        resolve_paths([str(missing)])
    assert str(missing) in str(ei.value)


def test_pattern_matching_nothing(tmp_path):
    pat = str(tmp_path / "*.jsonl")
    with pytest.raises(DataError, match="matched no files") as ei:
        resolve_paths([pat])
    assert pat in str(ei.value)


def test_empty_list():
    with pytest.raises(DataError, match="no data paths"):
        resolve_paths([])


def test_directory_is_rejected_with_glob_hint(text_corpus):
    with pytest.raises(DataError, match=r"is a directory.*\*\*"):
        resolve_paths([str(text_corpus)])


@pytest.mark.parametrize("name,content,fragment", [
    ("data.jsonl.gz", b"\x1f\x8b\x08\x00binary", "compressed"),
    ("weights.safetensors", b"{}", "unsupported extension"),
    ("blob.xyz", b"\x00\x01\x02\xff\xfe", "unsupported extension"),
])
def test_unsupported_extension(tmp_path, name, content, fragment):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(DataError, match=fragment) as ei:
        resolve_paths([str(f)])
    assert str(f) in str(ei.value)


def test_unknown_extension_text_is_accepted(tmp_path):
    f = tmp_path / "NOTES"
    f.write_text("plain text without an extension\n")
    assert resolve_paths([str(f)]) == [f.resolve()]


def test_unreadable_file(tmp_path):
    f = tmp_path / "secret.txt"
    f.write_text("hidden")
    f.chmod(0)
    try:
        try:
            with open(f, "rb"):
                readable = True
        except PermissionError:
            readable = False
        if readable:
            pytest.skip("running as root: chmod 000 does not make the file unreadable")
        with pytest.raises(DataError, match="cannot be read") as ei:
            resolve_paths([str(f)])
        assert str(f) in str(ei.value)
    finally:
        f.chmod(0o644)


def test_all_files_empty(tmp_path):
    for n in ("a.txt", "b.txt"):
        (tmp_path / n).write_text("")
    with pytest.raises(DataError, match="empty"):
        resolve_paths([str(tmp_path / "*.txt")])


# ------------------------------------------------------------------------------------------------ iter_documents
def test_text_files_one_document_each_and_empty_skipped(text_corpus, sample_docs):
    (text_corpus / "zz_empty.txt").write_text("")
    docs = list(iter_documents(resolve_paths([str(text_corpus / "*.txt")])))
    assert docs == sample_docs


def test_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "first", "id": 1}\n\n{"text": "second"}\n{"text": null}\n{"text": ""}\n'
                 '{"body": "x", "text": "third"}\n')
    assert list(iter_documents([f])) == ["first", "second", "third"]
    g = tmp_path / "e.jsonl"
    g.write_text('{"body": "alt field"}\n')
    assert list(iter_documents([g], text_field="body")) == ["alt field"]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok2"}\n{not json}\n')
    with pytest.raises(DataError, match=rf"{f}:3: invalid JSON"):
        list(iter_documents([f]))


def test_jsonl_missing_field_lists_fields(tmp_path):
    f = tmp_path / "nofield.jsonl"
    f.write_text('{"text": "ok"}\n{"content": "x", "meta": 1}\n')
    with pytest.raises(DataError, match=rf"{f}:2: .*no field 'text'.*'content', 'meta'.*text_field"):
        list(iter_documents([f]))


def test_jsonl_non_object_and_non_string(tmp_path):
    f = tmp_path / "arr.jsonl"
    f.write_text('["text"]\n')
    with pytest.raises(DataError, match=rf"{f}:1: expected a JSON object"):
        list(iter_documents([f]))
    g = tmp_path / "num.jsonl"
    g.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=rf"{g}:1: field 'text' must be a string"):
        list(iter_documents([g]))


def test_json_array_file(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert list(iter_documents([f])) == ["a", "b"]


def test_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["p1", None, "p2", ""], "n": [1, 2, 3, 4]}), f)
    assert list(iter_documents([f])) == ["p1", "p2"]


def test_parquet_missing_column_lists_columns(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["x"], "lang": ["en"]}), f)
    with pytest.raises(DataError, match=r"no column 'text' \(available columns: 'content', 'lang'\)") as ei:
        list(iter_documents([f]))
    assert str(f) in str(ei.value)


def test_parquet_non_string_column(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), f)
    with pytest.raises(DataError, match="expected a string column"):
        list(iter_documents([f]))


def test_invalid_utf8_text(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not valid UTF-8"):
        list(iter_documents([f]))


def test_check_sources_reads_only_first_record(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n{broken\n')  # broken later line: found by the full read, not the pre-check
    check_sources([good])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "a"}\n')
    with pytest.raises(DataError, match="no field 'text'"):
        check_sources([good, bad])


# ------------------------------------------------------------------------------------------------ built-in corpus
def test_builtin_corpus_is_deterministic_and_capped():
    # The real standard library of whichever Python runs the suite: only properties every stdlib gives.
    cap = 300_000
    a = builtin_corpus_paths(cap)
    assert a == builtin_corpus_paths(cap)
    assert 0 < sum(p.stat().st_size for p in a) <= cap
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    rels = [p.relative_to(root).as_posix() for p in a]
    assert rels == sorted(rels)
    for p in a:
        parts = set(p.relative_to(root).parts[:-1])
        assert not parts & {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings"}
        assert p.suffix == ".py"
    bigger = builtin_corpus_paths(2 * cap)
    assert sum(p.stat().st_size for p in bigger) > cap  # any stdlib holds far more than 600 kB of sources


def test_builtin_corpus_selection_rule(tmp_path, monkeypatch):
    # The rule on a standard library of known contents: sorted relative paths, whole files, greedy fill (a file
    # that does not fit is skipped and later ones may still fit), exclusions, empty and non-UTF-8 files skipped.
    files = {
        "a.py": 40, "b/big.py": 70, "b/c.py": 30, "b/d.txt": 5, "e.py": 20, "f.py": 0, "g.py": 10,
        "site-packages/x.py": 5, "test/t.py": 5, "encodings/cp.py": 5, "__pycache__/a.py": 5, "h/tests/t.py": 5,
    }
    for rel, size in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x" * size)
    (tmp_path / "latin1.py").write_bytes(b"caf\xe9")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    rels = lambda cap: [p.relative_to(tmp_path.resolve()).as_posix() for p in builtin_corpus_paths(cap)]
    assert rels(100) == ["a.py", "b/c.py", "e.py", "g.py"]  # b/big.py (70) no longer fits after a.py
    assert rels(1000) == ["a.py", "b/big.py", "b/c.py", "e.py", "g.py"]
    assert rels(25) == ["e.py"]  # the first file that fits, then g.py would exceed 25
    with pytest.raises(DataError, match="builtin_max_bytes=5"):
        builtin_corpus_paths(5)


def test_builtin_corpus_too_small_cap():
    with pytest.raises(DataError, match="builtin_max_bytes"):
        builtin_corpus_paths(1)


def test_unreadable_file_even_as_root(tmp_path, monkeypatch):
    """The permission branch, exercised with a patched open() so it also runs as root."""
    import builtins

    f = tmp_path / "locked.txt"
    f.write_text("x")
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if os.fspath(file) == str(f.resolve()):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    with pytest.raises(DataError, match="cannot be read.*Permission denied.*chmod") as ei:
        resolve_paths([str(f)])
    assert str(f) in str(ei.value)
