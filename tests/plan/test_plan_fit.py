"""`moetrain plan` without --ep picks the best plan that fits the GPUs given (and says so) instead of predicting EP 1;
with --ep the plan is predicted as given."""

from __future__ import annotations

import json

from moetrain.plan.cli import main as plan_main
from moetrain.plan.plan import Plan
from moetrain.plan.search import search

DSV3_256_GB300 = ["--model", "deepseek-v3-671b", "--gpu", "gb300", "--gpus", "256"]


def test_without_ep_the_best_plan_that_fits_is_chosen(capsys):
    assert plan_main([*DSV3_256_GB300, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["chosen"]["found"] is True
    assert out["plan"]["ep"] > 1 and out["plan"]["tp"] == 1 and out["plan"]["micro_batch"] == 1
    # the best of the search over the same space (TP, CP and micro-batch as given)
    ranked = search("deepseek-v3-671b", "gb300", 256, Plan(), tp=[1], cp=[1], micro_batch=[1]).ranked
    assert out["tflops_per_gpu"] == max(p.tflops_per_gpu for p in ranked) == ranked[0].tflops_per_gpu
    assert out["chosen"]["fitting"] == len(ranked)
    assert plan_main(DSV3_256_GB300) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("moetrain plan: no --ep given: the best plan that fits 256 GB300, "
                            f"TP1/PP{out['plan']['pp']}/VPP{out['plan']['vpp']}/EP{out['plan']['ep']}/")


def test_an_explicit_ep_is_predicted_as_given(capsys):
    assert plan_main([*DSV3_256_GB300, "--ep", "1", "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert "chosen" not in out and out["fits"] is False and out["plan"]["ep"] == 1 and out["plan"]["pp"] == 1


def test_flags_given_are_kept_by_the_choice(capsys):
    assert plan_main([*DSV3_256_GB300, "--pp", "4", "--recompute", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"]["found"] and out["fits"]
    assert (out["plan"]["pp"], out["plan"]["recompute"]) == (4, "full") and out["plan"]["ep"] > 1


def test_no_plan_fits_says_so_and_exits_3(capsys):
    # 671B parameters on 8 H100s: no EP / PP split fits in 8 x 80 GiB
    assert plan_main(["--model", "deepseek-v3-671b", "--gpu", "h100", "--gpus", "8"]) == 3
    cap = capsys.readouterr()
    assert "no --ep given, and no plan for 8 H100 fits" in cap.err and "does not fit" in cap.out


def test_records_mark_calibration_rows_and_held_out_ones(capsys):
    from moetrain.plan import validation
    from moetrain.plan.records import RECORDS

    assert plan_main(["--records", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in out["records"]] == list(RECORDS) and {r["role"] for r in out["records"]} == {"calibration"}
    dsv3 = {p.key: p for p in validation.POINTS if p.model == "deepseek-v3-671b"}
    assert len(dsv3) == len(out["held_out"]) > 0
    for h in out["held_out"]:
        assert h["role"] == "held-out" and h["key"] not in RECORDS
        assert h["published_tflops_per_gpu"] == dsv3[h["key"]].tflops_per_gpu
    assert set(out["roles"]) == {"calibration", "held-out"}
    assert plan_main(["--records"]) == 0
    table = capsys.readouterr().out
    cells = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert cells.count("calibration") == len(RECORDS) and cells.count("held-out") == len(dsv3)
    assert plan_main(["--record", "gb300", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["record"]
    assert rec["role"] == "calibration" and "no test" in rec["role_meaning"]
    assert plan_main(["--record", "gb300"]) == 0
    assert "a calibration row" in capsys.readouterr().out
