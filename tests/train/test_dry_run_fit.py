"""``moetrain train --dry-run --world N``: does the layout fit? Every pipeline rank beside the planner's, the
heaviest marked, a verdict against ``--gpu``'s memory (exit 3 when it does not fit), activations in the GPU's
precision on a CPU host, and errors that name ``--world``."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main

GiB = 2 ** 30


def _dry_run(tmp_path, capsys, *argv: str) -> tuple[int, str, str, dict | None]:
    out = tmp_path / "run"
    rc = main(["train", "--dry-run", *argv, "--out", str(out)])
    cap = capsys.readouterr()
    f = out / "dry_run.json"
    return rc, cap.out, cap.err, json.loads(f.read_text()) if f.exists() else None


def test_deepseek_v3_at_ep1_on_8_gpus_does_not_fit(tmp_path, capsys):
    rc, out, _, rep = _dry_run(tmp_path, capsys, "--preset", "deepseek-v3-671b", "--world", "8", "--ep", "1",
                               "--gpu", "b200")
    assert rc == 3
    (rank,) = rep["pipeline_ranks"]
    # FSDP over 8 ranks: each holds 1/8 of the 682,636,472,320 parameters, 16 bytes each (fp32 masters, gradients,
    # two AdamW moments) -- 1,271.5 GiB of state alone against a B200's 180
    assert rank["params"] == 682_636_472_320 // 8
    assert rank["state_gib"] == pytest.approx(682_636_472_320 // 8 * 16 / GiB)
    v = rep["verdict"]
    assert v == {**v, "gpu": "b200", "gpu_assumed": False, "memory_gib": 180, "fits": False, "heaviest_pp_rank": 0,
                 "precision": "bf16"}
    assert v["need_gib"] >= rank["state_gib"] > 180
    planned = rank["planned"]
    assert v["need_gib"] == pytest.approx(planned["total"] + max(0.0, rank["step_gib"] - planned["weights"]
                                                                 - planned["fp8_weights"] - planned["gradients"]
                                                                 - planned["optimizer"]))
    assert "verdict: DOES NOT FIT on B200 (180 GiB)" in out and f"needs {v['need_gib']:.1f} GiB" in out


def test_every_pipeline_rank_beside_the_planner_heaviest_marked(tmp_path, capsys):
    rc, out, _, rep = _dry_run(tmp_path, capsys, "--preset", "deepseek-v3-671b", "--world", "256", "--ep", "16",
                               "--pp", "16", "--gpu", "gb300")
    assert rc == 0
    rows = rep["pipeline_ranks"]
    assert [r["pp_rank"] for r in rows] == list(range(16)) and [r["stages"] for r in rows] == [[s] for s in range(16)]
    assert [r["rank"] for r in rows] == [16 * r for r in range(16)]  # (pp, edp 0, ep 0): DP = 16 ranks a stage
    for r in rows:
        assert r["state_gib"] == pytest.approx(r["params"] * 16 / GiB)  # fp32 masters, grads, two moments
    # rank 0 (embedding and the three dense layers, FSDP-sharded over its 16 ranks) holds less state than a rank of
    # four MoE layers (experts split over EP 16, not FSDP-sharded: EDP = 1)
    assert rows[0]["state_gib"] < rows[1]["state_gib"] == rows[7]["state_gib"]
    # at the step's peak (the stage's weights gathered in bf16, its gradients accumulated unsharded in fp32) every
    # pipeline rank holds what the planner counts for it, but the last, whose stage holds the embedding's copy for
    # MTP, which the planner leaves out -- and the report says so
    for r in rows[:-1]:
        m = r["planned"]
        assert r["step_gib"] == pytest.approx(m["weights"] + m["fp8_weights"] + m["gradients"] + m["optimizer"],
                                              rel=0.05), r["pp_rank"]
    assert rows[-1]["unsharded_params"] - rows[-1]["planned_params"] == 129_280 * 7168
    assert "pipeline rank 15: the run holds" in out and "the last stage's copy of the embedding for MTP" in out
    v = rep["verdict"]
    worst = max(rows, key=lambda r: r["need_gib"])
    assert v["fits"] is True and v["heaviest_pp_rank"] == worst["pp_rank"] and v["need_gib"] == worst["need_gib"]
    assert v["need_gib"] <= 288 and v["gpu"] == "gb300"
    marked = [line for line in out.splitlines() if line.endswith("<- heaviest")]
    assert len(marked) == 1 and marked[0].split()[0] == str(worst["pp_rank"])
    assert "verdict: FITS on GB300 (288 GiB)" in out
    # the planner's row under rank 0 is pipeline rank 0's, and says so
    assert rep["predicted_gib"]["pp_rank"] == 0 and "one rank of pipeline rank 0" in out
    assert rep["predicted_gib"]["optimizer"] == pytest.approx(rows[0]["planned"]["optimizer"])


def test_a_gpu_layout_trains_in_bf16_on_a_cpu_host_and_the_gpu_is_said_assumed(tmp_path, capsys):
    rc, out, _, gpu = _dry_run(tmp_path / "a", capsys, "--world", "4", "--pp", "2",
                               "--set", 'parallel.schedule="dualpipev"')
    assert rc == 0
    rows = gpu["pipeline_ranks"]
    assert [r["stages"] for r in rows] == [[0, 3], [1, 2]]  # the V: rank 0 holds the first and the last stage
    assert gpu["layout"]["precision"] == "bf16" and gpu["verdict"]["precision"] == "bf16"
    assert gpu["verdict"]["gpu"] == "h100" and gpu["verdict"]["gpu_assumed"] is True and gpu["verdict"]["fits"]
    assert "assumed: --gpu NAME judges another" in out
    rc, out, _, cpu = _dry_run(tmp_path / "b", capsys, "--world", "4", "--pp", "2",
                               "--set", 'parallel.schedule="dualpipev"', "--device", "cpu")
    assert rc == 0 and cpu["layout"]["precision"] == "fp32"
    assert cpu["verdict"]["fits"] is None and "verdict: none" in out
    for g, c in zip(rows, cpu["pipeline_ranks"]):
        assert g["state_gib"] == c["state_gib"]  # the run holds fp32 state either way
        # the GEMM inputs saved for the backward are bf16 on the GPU (half of fp32; the router's stay fp32)
        assert 0.5 < g["planned"]["activations"] / c["planned"]["activations"] < 0.7


@pytest.mark.parametrize("argv", [("--world", "6", "--pp", "4"), ("--world", "8", "--ep", "3"),
                                  ("--world", "8", "--pp", "2", "--ep", "8"),
                                  ("--world", "8", "--set", "parallel.dp=3")])
def test_impossible_world_layouts_name_world(tmp_path, capsys, argv):
    rc, _, err, rep = _dry_run(tmp_path, capsys, *argv)
    assert rc == 2 and rep is None
    assert "--world" in err and "--nproc" not in err and "Traceback" not in err


def test_gpu_is_refused_where_it_judges_nothing(tmp_path, capsys):
    rc, _, err, _ = _dry_run(tmp_path, capsys, "--world", "4", "--gpu", "h999")
    assert rc == 2 and "--gpu h999" in err and "gb300" in err
    rc, _, err, _ = _dry_run(tmp_path, capsys, "--world", "4", "--gpu", "h100", "--device", "cpu")
    assert rc == 2 and "--device cpu" in err
    assert main(["train", "--gpu", "h100", "--out", str(tmp_path / "x")]) == 2
    assert "--dry-run --world N" in capsys.readouterr().err
