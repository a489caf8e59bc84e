"""``moetrain train`` on a weighted mixture of two sources: trains, checkpoints, resumes with exactly the losses of the
uninterrupted run, and refuses a resume with other weights before any worker starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

BASE = [
    "--nproc", "1", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "data.seq_len=32",
    "--set", "train.micro_batch_size=4", "--set", "train.log_every=1", "--set", "train.eval_batches=2",
    "--set", "train.tensorboard=false", "--set", "train.warmup_steps=2", "--set", "train.threads_per_proc=1",
    "--steps", "4", "--set", "train.ckpt_every=2", "--set", "train.eval_every=2",
]


def _corpus(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "prose.jsonl", tmp_path / "code.jsonl"
    a.write_text("".join(json.dumps({"text": f"Paragraph {i}. The experts route tokens; the router balances load "
                                             f"across {i % 7 + 2} groups of devices. " * 3}) + "\n" for i in range(120)))
    b.write_text("".join(json.dumps({"body": f"def f{i}(x):\n    return x * {i} + {i % 5}\n\n" * 4}) + "\n"
                         for i in range(120)))
    return a, b


def _train(tmp_path: Path, out: Path, *extra: str, rc: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--set",
           f'data.cache_dir="{tmp_path / "cache"}"', *BASE, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == rc, p.stdout + p.stderr
    return p


def _losses(out: Path) -> dict[int, float]:
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rec if r.get("kind") == "train"}


def test_mixture_trains_and_resumes_exactly(tmp_path):
    a, b = _corpus(tmp_path)
    sources = ["--source", f"{a},weight=3", "--source", f"{b},weight=1,text_field=body"]
    out = tmp_path / "run"
    _train(tmp_path, out, *sources)
    first = _losses(out)
    assert sorted(first) == [1, 2, 3, 4]
    config = (out / "config.toml").read_text()
    assert "[[data.sources]]" in config or "sources = [" in config
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    _train(tmp_path, out, *sources, "--resume")
    again = _losses(out)
    for s in (3, 4):
        assert again[s] == first[s], s
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    p = _train(tmp_path, out, "--source", f"{a},weight=1", "--source", f"{b},weight=1,text_field=body", "--resume",
               rc=2)
    last = p.stderr.splitlines()[-1]
    assert last.startswith("moetrain train: error: cannot resume") and "Traceback" not in p.stderr
    assert "weights=[3.0, 1.0] but this run has weights=[1.0, 1.0]" in last and "another --out" in last
