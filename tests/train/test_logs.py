"""Logs that read anywhere and trackers that agree: the step line's labelled fields (step time, throughput, MFU, ETA,
the loss as the sum of its labelled terms, which memory), one table of metric names shared by the console, JSONL,
TensorBoard and W&B (offline, for real), the end-of-run summary, the profiler's one line."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.callbacks import LoopState, Profiler
from moetrain.train.metrics import (TRAIN_METRICS, VAL_METRICS, LogField, MemoryKind, MetricsSink, NullSink,
                                    StepMetrics, format_duration, format_step_time, peak_memory_gb, val_line,
                                    val_record)
from moetrain.train.trackers import WandbTracker, tracker_scalars, wandb_mode_note

from tests.train.test_loop_parts import _metrics


# ---- the step line -------------------------------------------------------------------------------------------------

def test_the_metric_table_names_every_field_of_the_record_once():
    assert [m.key for m in TRAIN_METRICS] == [f.name for f in dataclasses.fields(StepMetrics)]
    labels = [m.label for m in TRAIN_METRICS + VAL_METRICS]
    assert len(set(labels)) == len(labels), labels
    assert all(m.doc for m in TRAIN_METRICS + VAL_METRICS)


def test_validation_is_labelled_lm_with_its_perplexity():
    assert val_line(10, 20, 2.0) == "step    10/20 | val lm loss 2.0000 | val ppl 7.39"
    assert val_record(10, 2.0) == {"kind": "val", "step": 10, "val_loss": 2.0, "val_ppl": math.exp(2.0)}
    assert list(val_record(10, 2.0))[2:] == [m.key for m in VAL_METRICS]


def test_every_console_field_is_labelled_from_the_table():
    fields = _metrics().console_fields(pipelined=True)
    table = {m.label for m in TRAIN_METRICS}
    assert all(f.label in table for f in fields), [f.label for f in fields if f.label not in table]
    labels = [f.label for f in fields]
    for want in ("step time", "tok/s/gpu", "TFLOP/s/gpu", "MFU", "ETA", "a2a", "mem", "bubble"):
        assert want in labels, want


def test_one_more_field_is_one_more_entry():
    m = _metrics()
    line = " | ".join(map(str, [*m.console_fields(False), LogField("lost to imbalance", "12%")]))
    assert line == m.console_line(False) + " | lost to imbalance 12%"


def test_the_loss_reads_as_the_sum_of_its_labelled_terms():
    m = _metrics(loss=7.25 + 2.25 + 4.125e-4)
    loss = next(f for f in m.console_fields(False) if f.label == "loss").value
    total, lm, mtp, bal = map(float, re.fullmatch(r"(\S+) = lm (\S+) \+ mtp (\S+) \+ bal (\S+)", loss).groups())
    assert (lm, mtp, bal) == (7.25, 2.25, 0.0004) and total == pytest.approx(lm + mtp + bal, abs=1e-4)


def test_memory_says_which_memory():
    gb, kind = peak_memory_gb(torch.device("cpu"))
    assert kind is MemoryKind.CPU_PEAK_RSS and gb > 0.01
    assert "mem 0.75 GB peak RSS" in _metrics().console_line(False)
    assert "mem 0.75 GB peak allocated" in _metrics(peak_mem_kind=MemoryKind.GPU_PEAK_ALLOCATED).console_line(False)


def test_durations_and_step_times():
    assert [format_duration(s) for s in (4.2, 65, 3725.0)] == ["4s", "1m05s", "1h02m05s"]
    assert [format_step_time(s) for s in (0.5123, 12.34)] == ["512 ms", "12.3 s"]


# ---- trackers ----------------------------------------------------------------------------------------------------

def read_wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of an offline W&B run file (``run-<id>.wandb``: a ``:W&B`` header, then LevelDB log blocks
    of 32 KiB holding protobuf ``Record`` messages), without the ``_step/_runtime/_timestamp`` bookkeeping."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        buf += data[pos:pos + n]
        pos += n
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(buf)
            buf = b""
    rows = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item
                         if not (i.key or "/".join(i.nested_key)).startswith("_")})
    return rows


@pytest.fixture
def no_wandb_env(monkeypatch):
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.setenv(k, "")  # recorded, so the WANDB_MODE the sink sets is undone after the test
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_jsonl_tensorboard_and_wandb_offline_hold_the_same_names(tmp_path, no_wandb_env, capsys):
    pytest.importorskip("wandb")  # an optional extra (moetrain[wandb]); CI installs it through [dev]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path, tensorboard=True, wandb="moetrain-test", run_config={"train": {"steps": 4}})
    out = capsys.readouterr().out
    assert re.search(r"W&B offline run \w+ in \S+/wandb/offline-run-\S+ \(no WANDB_API_KEY or WANDB_MODE set\); "
                     r"`wandb sync \S+/wandb/offline-run-\S+` uploads it", out), out
    sink.write({"kind": "run", "step": 0, "world": 2, "peak_tflops": 0.1, "pp_schedule": "1f1b"})
    sink.write(val_record(0, 7.5))
    sink.log_step(_metrics(step=2), pipelined=False)
    sink.log_step(_metrics(step=4, loss=8.0), pipelined=False)
    sink.write({"kind": "summary", "step": 4, "tokens": 4096, "mfu": 0.25})
    sink.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = set().union(*(tracker_scalars(r) for r in records))
    numeric = {f"{r['kind']}/{k}" for r in records for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    assert numeric <= want and {"train/lm_loss", "train/mtp_term", "train/eta_s", "train/mfu", "val/val_loss",
                                "a2a/moe0/dispatch/total_s", "summary/tokens"} <= want

    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    events = [(f.name, f.stat().st_size) for f in tmp_path.glob("tensorboard/*")]
    assert set(ea.Tags()["scalars"]) == want, events
    assert [e.value for e in ea.Scalars("train/loss")] == [9.5, 8.0]

    assert (tmp_path / "wandb" / "run-id").is_file()
    import wandb

    wandb.teardown()  # run.finish() returns before wandb-core has written the run file; teardown waits for it
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = read_wandb_history(run_file)
    assert set().union(*rows) == want
    assert [r["train/loss"] for r in rows if "train/loss" in r] == [9.5, 8.0]
    assert WandbTracker is not None and wandb_mode_note() is None  # the sink set WANDB_MODE=offline


def test_wandb_keeps_the_users_mode(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode_note() is None and __import__("os").environ["WANDB_MODE"] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode_note() is None and "WANDB_MODE" not in __import__("os").environ
    monkeypatch.delenv("WANDB_API_KEY")
    assert wandb_mode_note() == "no WANDB_API_KEY or WANDB_MODE set"
    assert __import__("os").environ["WANDB_MODE"] == "offline"


def test_missing_wandb_says_how_to_install_it(tmp_path, monkeypatch):
    from moetrain.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"train.wandb='proj' needs the wandb package: pip install wandb"):
        MetricsSink(tmp_path, tensorboard=False, wandb="proj")


def test_train_wandb_must_be_a_project_name():
    from moetrain.config import load_job_config
    from moetrain.errors import ConfigError

    assert load_job_config(None, ["train.wandb=my-proj"]).train.wandb == "my-proj"
    with pytest.raises(ConfigError, match="train.wandb=1 must be a string"):
        load_job_config(None, ["train.wandb=1"])


# ---- the profiler's line -------------------------------------------------------------------------------------------

class _Lines(NullSink):
    def __init__(self):
        self.lines: list[str] = []

    def print(self, text: str) -> None:
        self.lines.append(text)


def test_profile_steps_say_where_the_trace_went_and_nothing_else(tmp_path, capfd):
    ctx = init_parallel(ParallelConfig(), 16, device="cpu")
    sink = _Lines()
    loop = LoopState(steps=3, start_step=0, sink=sink)
    prof = Profiler((2,), str(tmp_path), ctx)
    for step in range(3):
        with prof.around_step(loop):
            torch.randn(64, 64) @ torch.randn(64, 64)
        loop.step = step + 1
    trace = tmp_path / "profile" / "step2-rank0.json"
    assert json.loads(trace.read_text())["traceEvents"]
    assert sink.lines == [f"[moetrain] profile of step 2: trace {trace} (open in https://ui.perfetto.dev or "
                          f"chrome://tracing)"]
    out = capfd.readouterr()
    assert "profiler_start" not in out.err + out.out and "Warning" not in out.err, out


# ---- the end of a run, fresh and resumed ---------------------------------------------------------------------------

BASE = [
    "--nproc", "1", "--set", "data.builtin_max_bytes=200000", "--set", "data.vocab_size=512",
    "--set", "model.vocab_size=512", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=4",
    "--set", "train.log_every=2", "--set", "train.eval_every=2", "--set", "train.eval_batches=2",
    "--set", "train.ckpt_every=2", "--set", "train.tensorboard=false", "--set", "train.warmup_steps=2",
]


def _train(out: Path, cache: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--set", f'data.cache_dir="{cache}"',
           *BASE, *extra]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("WANDB_")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env, "WANDB_SILENT": "true"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _summary_line(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith("[moetrain] done: "))


@pytest.mark.dist
def test_a_log_file_has_the_fields_and_a_resumed_run_its_summary(tmp_path):
    pytest.importorskip("wandb")  # an optional extra (moetrain[wandb]); CI installs it through [dev]
    cache, out = tmp_path / "cache", tmp_path / "run"
    log = _train(out, cache, "--steps", "4", "--set", "train.wandb=moetrain-test")
    start = next(line for line in log.splitlines() if " ranks on " in line)
    for part in ("precision fp32 (FP8 off)", "dispatcher ", "overlap shared experts on, EP overlap off",
                 "schedule none (PP=1)", "recompute none", "loss lm + mtp (0.3 x MTP CE)"):
        assert part in start, (part, start)
    steps = [line for line in log.splitlines() if re.match(r"step +\d+/4 \| loss", line)]
    assert len(steps) == 2
    for line in steps:
        for part in (r"step time [\d,.]+ m?s", r"tok/s/gpu [\d,]+", r"TFLOP/s/gpu [\d.]+", r"MFU [\d.]+%", r"ETA \d+",
                     r"mem [\d.]+ GB peak RSS", r"loss [\d.]+ = lm [\d.]+ \+ mtp [\d.]+ \+ bal [\d.]+"):
            assert re.search(part, line), (part, line)
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in rec if r["kind"] == "train"):
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["mtp_term"] + r["balance_term"], rel=1e-12)
        assert r["mtp_term"] == pytest.approx(0.3 * r["mtp_loss"], rel=1e-12)
    val = {r["step"]: r["val_loss"] for r in rec if r["kind"] == "val"}
    assert re.search(rf"step +4/4 \| val lm loss {val[4]:.4f}", log)
    summary = _summary_line(log)
    assert f"checkpoint {out}/checkpoints/step_00000004" in summary and f"metrics {out}/metrics.jsonl" in summary
    assert "4 steps (0 -> 4)" in summary and "tok/s/gpu, MFU" in summary
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    names = set().union(*read_wandb_history(run_file))
    assert names == set().union(*(tracker_scalars(r) for r in rec))

    log = _train(out, cache, "--steps", "6", "--resume", "--set", "train.allow_schedule_change=true")
    summary = _summary_line(log)
    assert summary in log.splitlines()[-3:]
    assert "2 steps (4 -> 6)" in summary and f"checkpoint {out}/checkpoints/step_00000006" in summary
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "summary" and last["step"] == 6 and last["checkpoint"].endswith("step_00000006")
    assert f"val lm loss {last['val_loss']:.4f} (step 6)" in summary


def test_a_stopped_run_ends_with_its_summary_too(tmp_path):
    """A stop signal (or the stop file) ends the run early: the summary line still comes, saying so, with the
    throughput of the steps run and the checkpoint written at the stop."""
    from moetrain.accounting import flops_per_token
    from moetrain.config import JobConfig
    from moetrain.train.trainer import _summary, _tokens_per_step

    job = JobConfig()
    job.train.out_dir = str(tmp_path)
    ctx = init_parallel(ParallelConfig(ep=1), job.model.n_routed_experts, device="cpu")
    sink = _Lines()
    ckpt = tmp_path / "checkpoints" / "step_00000012"
    loop = LoopState(steps=400, start_step=10, sink=sink, step=12, last_checkpoint=ckpt, train_s=2.0,
                     train_lm=[(12, 6.5)], val=[(10, 6.75)],
                     stopped={"signal": "SIGTERM", "exit_code": 143, "step": 12, "checkpoint": str(ckpt)})
    summary = _summary(job, ctx, loop, peak_tflops=0.1)
    tokens = 2 * _tokens_per_step(job, ctx)
    assert summary["tokens"] == tokens and summary["tokens_per_s_per_gpu"] == tokens / 2.0
    assert summary["end_step"] == 12 and summary["checkpoint"] == str(ckpt)
    fpt = flops_per_token(job.model, job.data.seq_len).megatron
    assert summary["mfu"] == pytest.approx(tokens / 2.0 * fpt / 1e12 / 0.1, rel=1e-12)
    (line,) = sink.lines
    assert line.startswith("[moetrain] stopped (SIGTERM) at step 12 of 400 | 2 steps (10 -> 12) in ")
    assert f"{tokens:,} tokens" in line and f"mean {tokens / 2.0:,.0f} tok/s/gpu" in line
    assert "train lm 6.5000 (step 12) | val lm loss 6.7500 (step 10)" in line
    assert line.endswith(f"checkpoint {ckpt} | metrics {tmp_path}/metrics.jsonl")


def test_the_start_up_line_names_every_recipe_choice():
    from moetrain.config import load_job_config
    from moetrain.train.trainer import _recipe_fields

    job = load_job_config(None, ['parallel.precision="fp8"', 'parallel.recompute="full"', "parallel.n_chunks=2",
                                 'train.schedule="wsd"'], world=1)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, device="cpu")
    fields = {f.label: f.value for f in _recipe_fields(job, ctx)}
    assert fields["precision"] == "fp8 (FP8 blockwise)"
    assert fields["recompute"] == "full" and fields["schedule"] == "none (PP=1)"
    assert fields["overlap"] == "shared experts on, EP overlap off, chunks 2"
    assert fields["dispatcher"] == "local (bf16 rows)"  # EP 1: a permutation, nothing moves
    assert fields["lr"] == "wsd 0.004 -> 0.0004, warm-up 20"
    assert fields["loss"] == "lm + mtp (0.3 x MTP CE) + bal (0.0001 x balance); val is lm"
