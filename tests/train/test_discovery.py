"""Defaults and discovery: presets bring training defaults that fit them, the tokenizer sizes the vocabulary, EP fits
the world, every setting is listed by ``moetrain train --help-config``, and messages use the ``--set`` spelling."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import moetrain
from moetrain.cli import build_parser, job_from_args, main
from moetrain.config import SECTIONS, JobConfig, load_job_config
from moetrain.model.config import PRESETS, ConfigError

SRC = Path(moetrain.__file__).resolve().parent


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def pad_vocab(n: int) -> int:
    return -(-n // 64) * 64


def _section_classes() -> dict[str, type]:
    from moetrain.config import SECTION_CLASSES
    return SECTION_CLASSES


# ---- presets that fit their size ---------------------------------------------------------------------------------

def test_the_demo_job_is_unchanged():
    """`moetrain train` with no arguments: tiny, EP 2 over 2 CPU workers, a 2,048-token BPE, 64-token sequences and
    the demo's training values, exactly as before."""
    for job in (load_job_config(), load_job_config(None, [], world=2), JobConfig()):
        assert job.preset == "tiny" and job.parallel.ep == 2 and job.data.paths == []
        assert job.data.vocab_size == job.model.vocab_size == 2048 and job.data.seq_len == 64
        t = job.train
        assert (t.steps, t.micro_batch_size, t.grad_accum, t.lr, t.min_lr, t.warmup_steps) == (400, 32, 1, 4e-3,
                                                                                              4e-4, 20)
        assert not job.notes
    assert JobConfig().to_dict() == load_job_config(None, [], world=2).to_dict()


def test_small_preset_brings_its_own_training_defaults():
    job = load_job_config(None, ['model.preset="small"'])
    assert job.data.seq_len == 1024 and job.train.micro_batch_size == 8
    assert job.train.lr == 6e-4 and job.train.min_lr == 6e-5
    assert job.data.vocab_size == job.model.vocab_size == 32_768  # the BPE fits the embedding
    assert load_job_config(None, ['model.preset="small"'], world=8).parallel.ep == 8
    assert load_job_config(None, ['model.preset="small"'], world=2).parallel.ep == 2
    # files and --set still override the preset's defaults
    job = load_job_config(None, ['model.preset="small"', "data.seq_len=512", "train.lr=1e-3", "parallel.ep=4"],
                          world=8)
    assert (job.data.seq_len, job.train.lr, job.parallel.ep) == (512, 1e-3, 4)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_has_valid_job_defaults(preset):
    from moetrain.model.config import PRESET_JOB_DEFAULTS

    assert preset in PRESET_JOB_DEFAULTS
    job = load_job_config(None, [f'model.preset="{preset}"'])
    assert job.data.seq_len <= job.model.max_seq_len
    assert job.model.vocab_size % 64 == 0 and job.data.vocab_size <= job.model.vocab_size
    for section, values in PRESET_JOB_DEFAULTS[preset].items():
        for name, value in values.items():
            assert getattr(getattr(job, section), name) == value, (section, name)


def test_trained_bpe_size_sets_the_vocabulary():
    job = load_job_config(None, ["data.vocab_size=1000"])
    assert job.model.vocab_size == 1024 == pad_vocab(1000)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A real tokenizer.json of 300 tokens (trained on a few short documents)."""
    from moetrain.data import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    docs = [f"def function_{i}(value):\n    return value * {i} + {i * i}\n" * 5 for i in range(60)]
    tok = train_bpe(docs, 300, path)
    assert tok.vocab_size > 256
    return path, tok.vocab_size


def test_given_tokenizer_sets_the_vocabulary(tokenizer_file):
    path, n = tokenizer_file
    job = load_job_config(None, [f'data.tokenizer="{path}"'])
    assert job.model.vocab_size == pad_vocab(n) and job.model.vocab_size % 64 == 0
    # an explicit model.vocab_size wins when it holds the tokenizer
    job = load_job_config(None, [f'data.tokenizer="{path}"', "model.vocab_size=4096"])
    assert job.model.vocab_size == 4096


def test_tokenizer_larger_than_an_explicit_vocab_fails_before_any_data_work(capsys, tmp_path, tokenizer_file):
    path, n = tokenizer_file
    cache = tmp_path / "cache"
    code = main(["train", "--tokenizer", str(path), "--set", "model.vocab_size=256", "--set",
                 f'data.cache_dir="{cache}"', "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"has {n} tokens" in err and "model.vocab_size is 256" in err
    assert f"--set model.vocab_size={pad_vocab(n)}" in err
    assert not cache.exists()  # caught from the config, not after tokenising the corpus


def test_nproc_1_lowers_the_default_ep_and_says_so(capsys):
    job = job_from_args(_args("--nproc", "1"))
    assert job.parallel.ep == 1
    assert "parallel.ep=1" in capsys.readouterr().out


def test_an_explicit_ep_that_does_not_fit_names_the_fix(capsys, tmp_path):
    code = main(["train", "--ep", "2", "--nproc", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "parallel.ep=2" in err and "--ep 1" in err, err


def test_dry_run_world_sizes_the_default_ep():
    assert job_from_args(_args("--preset", "deepseek-v3-671b", "--dry-run", "--world", "256")).parallel.ep == 64
    assert job_from_args(_args("--preset", "deepseek-v3-671b", "--dry-run", "--world", "24")).parallel.ep == 8


# ---- discoverable settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("section", SECTIONS)
def test_every_field_has_a_meaning_in_its_docstring(section):
    from moetrain.config import field_docs

    cls = _section_classes()[section]
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{section} fields without an Attributes entry: {missing}"


def test_field_docs_parses_grouped_and_inline_entries():
    from moetrain.config import field_docs
    from moetrain.model.config import ModelConfig

    @dataclasses.dataclass
    class Grouped:
        """Parsed like the sections' docstrings.

        Attributes:
            a / b: one text for two,
                continued.
            c, d: another. e: inline entry.
        """

        a: int = 0
        b: int = 0
        c: int = 0
        d: int = 0
        e: int = 0

    docs = field_docs(Grouped)
    assert docs["a"] == docs["b"] == "one text for two, continued."
    assert docs["c"] == docs["d"] == "another." and docs["e"] == "inline entry."
    model = field_docs(ModelConfig)
    assert model["norm_eps"] == "RMSNorm epsilon." and "normal init" in model["init_std"]


def test_help_config_lists_every_section_and_field(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    for name in ("data.seq_len", "train.lr", "parallel.ep", "model.top_k", "train.grad_accum"):
        assert re.search(rf"^  {re.escape(name)} ", out, re.M), name
    from moetrain.config import format_value

    job = JobConfig()
    for section in SECTIONS:
        assert f"[{section}]" in out
        for f in dataclasses.fields(_section_classes()[section]):
            line = next(line for line in out.splitlines() if line.startswith(f"  {section}.{f.name} "))
            value = format_value(getattr(getattr(job, section), f.name))
            assert value in line, line
    assert re.search(r"^  train\.grad_accum\s+int\s+1\s+micro-batches per optimizer step", out, re.M)


def test_every_field_has_its_own_one_line_description(capsys):
    """Each --help-config row says what its own field is: no two rows share a text, no row is a bare symbol or
    points at a constant (``one of PP_SCHEDULES``) instead of naming the values."""
    assert main(["train", "--help-config"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"  ((?:model|parallel|data|train)\.\w+) +(.+)$", line)
        if m:
            cols = re.split(r"\s{2,}", m.group(2))
            rows[m.group(1)] = cols[-1] if len(cols) >= 3 else ""
    # the model rows are the default family's fields (DeepSeek-V3's: the common ones and MLA's)
    classes = {**_section_classes(), "model": type(JobConfig().model)}
    assert len(rows) == sum(len(dataclasses.fields(c)) for c in classes.values()) + 2  # preset, hf_config
    by_text: dict[str, list[str]] = {}
    for key, text in rows.items():
        by_text.setdefault(re.sub(r"\s*\[[^]]*\]$", "", text), []).append(key)
    shared = {t: keys for t, keys in by_text.items() if len(keys) > 1}
    assert not shared, shared
    for key, text in rows.items():
        bare = re.sub(r"\[[^]]*\]|[^a-zA-Z ]", " ", text).split()
        assert len(bare) >= 2, (key, text)
        assert not re.search(r"\b(one|any) of [A-Z][A-Z0-9_]{2,}\b", text), (key, text)


def test_help_config_shows_the_presets_values_and_full_text_per_section(capsys):
    assert main(["train", "--preset", "small", "--help-config", "train"]) == 0
    out = capsys.readouterr().out
    assert "  train.lr: float = 0.0006" in out and "[model]" not in out
    assert main(["train", "--help-config", "data"]) == 0
    out = capsys.readouterr().out
    assert "Supported:" in out  # the whole meaning of data.paths, not just its first sentence


def test_train_help_shows_each_shortcuts_default_and_set_spelling(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, key in (("--preset", "model.preset"), ("--data", "data.paths"), ("--tokenizer", "data.tokenizer"),
                      ("--steps", "train.steps"), ("--ep", "parallel.ep"), ("--nproc", "train.nproc"),
                      ("--out", "train.out_dir"), ("--resume", "train.resume"), ("--device", "train.device"),
                      ("--init-from", "train.init_from")):
        helptext = out[out.index(f" {flag} "):][:400]
        assert f"--set {key}=" in helptext and "default" in helptext, (flag, helptext)
    assert "--help-config" in out and "config.py" not in out


def test_unknown_field_uses_the_set_spelling_and_guesses(capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, ["train.warmup=5"])
    msg = str(e.value)
    assert "train.warmup" in msg and "did you mean train.warmup_steps" in msg
    assert "--set train.FIELD=VALUE" in msg and "--help-config" in msg


def _raise_texts(path: Path) -> list[tuple[int, str]]:
    """The string pieces of every raise statement's exception arguments in one source file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            text = "".join(c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
            out.append((node.lineno, text))
    return out


def test_error_messages_name_fields_by_their_set_spelling():
    bad = re.compile(r"\b(?:Data|Train|Parallel|Model|Job)Config\.[a-z_]+")
    assert len(list(SRC.rglob("*.py"))) > 20
    found = [f"{p.relative_to(SRC)}:{line}: {bad.search(text).group()}" for p in sorted(SRC.rglob("*.py"))
             for line, text in _raise_texts(p) if bad.search(text)]
    assert not found, found


def test_a_missing_text_field_names_the_set_option(tmp_path):
    from moetrain.data import DataConfig, DataError, prepare_data

    f = tmp_path / "docs.jsonl"
    f.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"--set data\.text_field=NAME"):
        prepare_data(DataConfig(paths=[str(f)], cache_dir=str(tmp_path / "cache")))
