"""Counting what moetrain's model code launches (moetrain.plan.counts) and how the local cost model charges it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.config import get_preset
from moetrain.plan.counts import _tally_mode, count_code, counting_config


def test_tally_charges_non_gemm_bytes_and_softmax_elements_only():
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    w = torch.randn(32, 16)
    t = _tally_mode()()
    with t:
        _ = a * b                        # 3 tensors of 64x32 fp32 move
        _ = a.t()                        # a view: nothing moves
        _ = torch.mm(a, w)               # a GEMM: timed from its FLOPs, not counted here
        _ = F.log_softmax(a, dim=-1)     # read + write, and 64x32 exponentials
    n = 64 * 32 * 4
    assert t.ops == 4
    assert t.bytes == 3 * n + 2 * n
    assert t.softmax == 64 * 32


def test_counting_config_keeps_one_block_of_each_kind():
    c = counting_config(get_preset("deepseek-v3-671b"))
    assert (c.n_layers, c.n_dense_layers, c.n_moe_layers, c.mtp_depth) == (2, 1, 1, 1)


def test_counted_softmax_elements_and_weight_sized_bytes_follow_from_the_shapes():
    """Exact, from first principles: each query's attention softmax covers L keys per head (causal attention is
    masked, not shortened), each token's logits one log-softmax over the vocabulary; the embedding gradient is a
    dense V x D tensor written once per micro-batch whatever the batch."""
    cfg = get_preset("tiny").replace(routing="balanced")
    L = 64
    c = count_code(cfg, L)
    assert c.softmax_per_token["d"] == c.softmax_per_token["t"] == cfg.n_heads * L
    assert c.softmax_per_token["L"] == cfg.vocab_size
    assert c.softmax_per_token["m"] == cfg.vocab_size + cfg.n_heads * L
    assert c.mem_bytes_per_micro_batch["L"] >= cfg.vocab_size * cfg.dim * 4
    # the loss reads the logits and writes log-probabilities, and the backward writes their gradient
    assert c.mem_bytes_per_token["L"] >= 3 * cfg.vocab_size * 4
    assert c.a2a_calls == 8 and min(c.ops.values()) >= 0 and c.ops["t"] > c.ops["d"]


def test_the_local_memory_bound_time_is_the_counted_traffic():
    from moetrain.plan.local import predict_local_train
    from tests.plan.test_local import BENCH

    cfg = get_preset("tiny").replace(routing="balanced")
    mb, L = 8, 64
    pred = predict_local_train(cfg, L, mb, 1, world=2, ep=2, bench_json=BENCH).prediction
    c = count_code(cfg, L)
    bw, rate, n = BENCH["memory_bandwidth_gbps"] * 1e9, BENCH["cross_entropy_gelem_s"] * 1e9, mb * L
    for kind in ("d", "t", "m", "L"):
        want = (n * (c.mem_bytes_per_token[kind] / bw + c.softmax_per_token[kind] / rate)
                + c.mem_bytes_per_micro_batch[kind] / bw)
        assert pred.details["item_cost_s"][kind]["memory_bound"] == pytest.approx(want, rel=1e-12)


def test_counting_refuses_a_model_that_cannot_train_here():
    with pytest.raises(ValueError, match="--gpu"):
        count_code(get_preset("deepseek-v3-671b"), 4096)


def test_plan_on_the_local_gpu_reports_a_model_that_does_not_fit_without_building_it(tmp_path, capsys):
    import json

    from moetrain.plan.cli import main
    from tests.plan.test_local import BENCH

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    rc = main(["plan", "--gpu", "local", "--bench-file", str(bench), "--gpus", "2", "--model",
               "deepseek-v2-lite-16b", "--ep", "2", "--mbs", "1", "--gbs", "2", "--seq", "512", "--fsdp"])
    assert rc == 3
    assert "does not fit" in capsys.readouterr().out


def test_counting_refuses_a_sequence_the_trainer_refuses():
    cfg = get_preset("tiny")
    for bad in (0, cfg.max_seq_len + 1):
        with pytest.raises(ValueError, match="max_seq_len"):
            count_code(cfg, bad)


def _cli(tmp_path, *flags: str, bench: dict | None = None) -> tuple[int, str]:
    import contextlib
    import io
    import json

    from moetrain.plan.cli import main
    from tests.plan.test_local import BENCH

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench or BENCH))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["plan", "--gpu", "local", "--bench-file", str(path), *flags])
    return rc, err.getvalue()


def test_plan_on_the_local_gpu_defaults_to_the_trainers_own_run(tmp_path):
    """No flags: the built-in `moetrain train` job (tiny, 64-token sequences, 32 per micro-batch, EP 2, fp32, FSDP2,
    learned routing) on the bench's 2 processes -- the same prediction as predict_local_train."""
    import json

    from moetrain.config import JobConfig
    from moetrain.plan.local import predict_local_train
    from tests.plan.test_local import BENCH

    out = tmp_path / "p.json"
    rc, _ = _cli(tmp_path, "--json-out", str(out))
    assert rc == 0
    job = JobConfig()
    ref = predict_local_train(job.model, job.data.seq_len, job.train.micro_batch_size, job.train.grad_accum,
                              world=2, ep=job.parallel.ep, bench_json=BENCH)
    assert json.loads(out.read_text())["step_s"]["step"] == pytest.approx(ref.step_s, rel=1e-9)


def test_plan_on_the_local_gpu_refuses_what_the_bench_did_not_measure(tmp_path):
    rc, err = _cli(tmp_path, "--gpus", "4")
    assert rc == 2 and "moetrain bench --procs 4" in err
    rc, err = _cli(tmp_path, "--search")
    assert rc == 2 and "--search and --scale plan GPU clusters" in err
    rc, err = _cli(tmp_path, "--seq", "5000")
    assert rc == 2 and "max_seq_len" in err


def test_local_processes_share_the_machines_memory():
    from moetrain.plan.hardware import gpu_from_bench
    from tests.plan.test_local import BENCH

    g = gpu_from_bench({**BENCH, "memory_gb": 24, "procs": 3})
    assert g.hbm_gb == 8 and g.host_procs == 3
