"""The pieces of the training loop: the one step-metrics record (its JSONL keys are a contract: plots, benchmarks and
the tests of the trainer read them), the sink of the ranks that write nothing, and the step runner chosen once from
the configuration."""

from __future__ import annotations

import inspect
import json

import pytest

from moetrain.model.config import tiny
from moetrain.model.transformer import build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.parallel.pipeline import build_stages
from moetrain.train.metrics import MemoryKind, MetricsSink, NullSink, StepMetrics
from moetrain.train.runners import PairedRunner, SequentialRunner, single_stage_parts

TRAIN_KEYS = ["kind", "step", "loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr",
              "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "step_time_s", "a2a_s_per_step",
              "a2a_exposed_s_per_step", "a2a_exposed_share", "a2a_launch_s_per_step", "a2a_share_of_step",
              "a2a_s_per_layer",
              "a2a_exposed_s_per_layer", "a2a_s_per_layer_phase", "dispatch_bytes_per_step",
              "dispatch_remote_bytes_per_step", "param_gather_bytes_per_step", "pp_bubble_s_per_step",
              "pp_bubble_share", "pp_bubble_formula",
              "load_imbalance_max", "load_imbalance", "dropped_tokens", "peak_mem_gb", "expert_load", "total_steps",
              "mtp_term", "balance_term", "eta_s", "peak_mem_kind", "ep_rows_imbalance_max", "ep_rows_imbalance",
              "ep_rows_imbalance_step", "ep_rows_per_rank", "imbalance_lost_ms", "imbalance_lost_share",
              "imbalance_lost_share_per_layer", "imbalance_expert_ms", "imbalance_combine_wait_ms",
              "imbalance_moe_layers"]


def _metrics(**kw) -> StepMetrics:
    base = dict(step=7, loss=9.5, lm_loss=7.25, mtp_loss=7.5, balance_loss=4.125, grad_norm=1.25, lr=1e-3,
                tokens_per_s_per_gpu=1234.5, tflops_per_gpu=0.0125, mfu=0.25, step_time_s=0.5, a2a_s_per_step=0.002,
                a2a_exposed_s_per_step=0.001, a2a_exposed_share=0.5, a2a_launch_s_per_step=0.0004,
                a2a_share_of_step=0.002, a2a_s_per_layer=[0.001, 0.001], a2a_exposed_s_per_layer=[0.0005, 0.0005],
                a2a_s_per_layer_phase=[{"dispatch": [0.001, 0.0005]}, {}], dispatch_bytes_per_step=10.0,
                dispatch_remote_bytes_per_step=5.0, param_gather_bytes_per_step=6.0, pp_bubble_s_per_step=0.1,
                pp_bubble_share=0.2,
                pp_bubble_formula=0.25, load_imbalance_max=1.5, load_imbalance=[1.5, 1.25], dropped_tokens=3,
                peak_mem_gb=0.75, expert_load=[[1, 2], [3, 4]], total_steps=400, mtp_term=2.25,
                balance_term=4.125e-4, eta_s=3725.0, peak_mem_kind=MemoryKind.CPU_PEAK_RSS, ep_rows_imbalance_max=1.5,
                ep_rows_imbalance=[1.5, 1.0], ep_rows_imbalance_step=1.25, ep_rows_per_rank=[[6, 2], [4, 4]],
                imbalance_lost_ms=12.5, imbalance_lost_share=0.125, imbalance_lost_share_per_layer=[0.1, 0.025],
                imbalance_expert_ms=10.0, imbalance_combine_wait_ms=4.0, imbalance_moe_layers=[0, 1])
    base.update(kw)
    return StepMetrics(**base)


def test_step_metrics_record_has_the_jsonl_keys_in_order():
    rec = _metrics().record()
    assert list(rec) == TRAIN_KEYS
    assert rec["kind"] == "train" and rec["expert_load"] == [[1, 2], [3, 4]]
    assert rec["peak_mem_kind"] == "cpu_peak_rss"
    assert json.loads(json.dumps(rec)) == rec


def test_step_metrics_console_line():
    m = _metrics()
    line = m.console_line(pipelined=False)
    assert line == ("step     7/400 | loss 9.5000 = lm 7.2500 + mtp 2.2500 + bal 0.0004 | gnorm 1.25 | lr 1.00e-03 | "
                    "step time 500 ms | tok/s/gpu 1,234 | TFLOP/s/gpu 0.0125 | MFU 25.0% | ETA 1h02m05s | "
                    "a2a 2.0 ms/step (50% exposed = 0.2% of step) | load max/mean 1.50 | lost 12% (imb) | drop 3 | "
                    "mem 0.75 GB peak RSS")
    assert m.console_line(pipelined=True) == line + " | bubble 20% (formula 25%)"


def test_the_null_sink_has_every_method_of_the_sink():
    public = {n for n, f in inspect.getmembers(MetricsSink, inspect.isfunction) if not n.startswith("_")}
    assert public <= {n for n in dir(NullSink) if not n.startswith("_")}
    sink = NullSink()
    sink.log_step(_metrics(), True)
    sink.write({"kind": "val"})
    sink.close()


def test_metrics_sink_writes_the_record_and_the_line(tmp_path, capsys):
    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.log_step(_metrics(), False)
    sink.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert list(json.loads(line)) == TRAIN_KEYS
    assert capsys.readouterr().out.strip() == _metrics().console_line(False)


@pytest.mark.parametrize("overlap, runner", [(False, SequentialRunner), (True, PairedRunner)])
def test_the_step_runner_is_chosen_from_the_configuration(overlap, runner):
    cfg = tiny().replace(vocab_size=64)
    ctx = init_parallel(ParallelConfig(ep_overlap=overlap), cfg.n_routed_experts, device="cpu")
    stage = build_stages(build_model(cfg, seed=0), ctx.pcfg, 0)[0]
    parts = single_stage_parts(stage, ctx)
    assert type(parts.runner) is runner
    assert parts.parts == [stage] and stage.spec.embed and stage.spec.head
