"""EP 1 with the local dispatcher moves no token: the console line leaves out the all-to-all and the time lost to
imbalance (both 0 by construction; metrics.jsonl keeps the keys) and ``moetrain plot`` draws no flat imbalance.png,
saying so; EP 1 with the all-to-all dispatcher still moves tokens over its one rank and keeps both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.train.plot import build_figures, not_drawn
from tests.train.test_loop_parts import _metrics

pytestmark = pytest.mark.dist


def test_the_console_omits_a2a_and_imbalance_when_no_token_moves():
    m = _metrics()
    moving = [f.label for f in m.console_fields(False, moves_tokens=True)]
    local = [f.label for f in m.console_fields(False, moves_tokens=False)]
    assert "a2a" in moving and "lost" in moving
    assert local == [label for label in moving if label not in ("a2a", "lost")]
    assert "load max/mean" in local and "(imb)" not in m.console_line(False, moves_tokens=False)


def _train(d: Path, out: str, *extra: str) -> str:
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", out, "--nproc", "1", "--steps", "2",
           "--set", 'data.cache_dir="cache"', "--set", "data.builtin_max_bytes=100000", "--set", "data.vocab_size=512",
           "--set", "model.vocab_size=512", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=2",
           "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--set", "train.tensorboard=false",
           "--set", "train.threads_per_proc=1", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=d)
    assert p.returncode == 0, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("step     2/2 | loss")]
    return line


def test_ep1_runs_console_and_plots(tmp_path, capsys):
    local = _train(tmp_path, "local")
    assert " | a2a " not in local and "(imb)" not in local and " | load max/mean " in local, local
    a2a = _train(tmp_path, "a2a", "--set", 'parallel.dispatcher="alltoall"')
    assert " | a2a " in a2a and "% exposed" in a2a and "(imb)" in a2a, a2a
    recs = [json.loads(x) for x in (tmp_path / "local/metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert train and all(r["a2a_s_per_step"] == 0.0 and r["imbalance_lost_share"] == 0.0 for r in train)
    assert [r["dispatcher"] for r in recs if r["kind"] == "run"] == ["local"]

    assert main(["plot", str(tmp_path / "local")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [Path(x).name for x in out[:-1]] == ["loss.png", "expert_load.png", "expert_share.png"]
    assert out[-1].startswith("not drawn: imbalance.png (EP 1 with the local dispatcher"), out
    assert not (tmp_path / "local/imbalance.png").exists()
    assert main(["plot", str(tmp_path / "a2a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [Path(x).name for x in out] == ["loss.png", "expert_load.png", "expert_share.png", "imbalance.png"]


def test_not_drawn_reads_the_last_run_record():
    recs = [{"kind": "run", "step": 0, "dispatcher": "local"},
            {"kind": "train", "step": 1, "loss": 1.0, "lm_loss": 1.0, "grad_norm": 1.0, "lr": 1e-3,
             "imbalance_moe_layers": [0], "imbalance_lost_share_per_layer": [0.0], "imbalance_lost_share": 0.0}]
    assert set(not_drawn(recs)) == {"imbalance.png"} and "imbalance.png" not in build_figures(recs)
    resumed_at_ep2 = [*recs, {"kind": "run", "step": 1, "dispatcher": "alltoall"}]
    assert not_drawn(resumed_at_ep2) == {} and "imbalance.png" in build_figures(resumed_at_ep2)
    assert not_drawn(recs[1:]) == {}  # no run record (an older run): drawn as before
