"""Every published row of REFERENCE.md section 4, predicted with ONE set of constants.

Target (the issue): within +-10% of the published TFLOP/s per GPU, +-5% for the GB300 record. Rows the model does
not reach are marked xfail(strict) with the reason -- see docs/performance-model.md, "Where the model misses":
the constants are not tuned per row, so a row outside the band is reported, not fitted. If a model change brings
one inside, the strict xfail turns into a failure so the marker gets removed.
"""

from __future__ import annotations

import pytest

from moetrain.plan import constants
from moetrain.plan.records import RECORDS

#: rows outside their band with the current physics and constants, and why (numbers in the assertion message)
KNOWN_OUTSIDE = {
    "gb200": "the plan differences GB300 vs GB200 (FP8 vs BF16 attention, MLA up-projection recompute, PP4 bubble, "
             "EP64) explain ~12% of the published 28% gap; the rest is not in the datasheets",
    "h800": "DeepSeek's figure is the whole-run average (GPU-hours for 14.8T tokens); the model predicts the "
            "steady-state step with DualPipe hiding the all-to-all",
}


def _table(preds) -> str:
    lines = []
    for k, r in RECORDS.items():
        p = preds[k]
        if p.fits:
            lines.append(f"{k}: predicted {p.tflops_per_gpu:.1f} vs published {r.tflops_per_gpu} TFLOP/s/GPU "
                         f"({p.tflops_per_gpu / r.tflops_per_gpu - 1:+.1%}, band +-{r.tolerance:.0%})")
        else:
            lines.append(f"{k}: does not fit ({p.message})")
    return "\n".join(lines)


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=KNOWN_OUTSIDE[k]))
                                 if k in KNOWN_OUTSIDE else k for k in RECORDS])
def test_record_within_band(key, record_predictions):
    r, p = RECORDS[key], record_predictions[key]
    assert p.fits, f"{key} predicted not to fit: {p.message}\n{_table(record_predictions)}"
    err = p.tflops_per_gpu / r.tflops_per_gpu - 1
    assert abs(err) <= r.tolerance, (f"{key}: {err:+.1%} outside +-{r.tolerance:.0%}\n"
                                     f"{_table(record_predictions)}")


def test_all_records_fit_and_are_in_the_right_order(record_predictions):
    """Weaker checks that hold for every row: each published plan fits in memory, and the ranking of the four
    systems (GB300 > GB200 > H800 > H100 per GPU) is reproduced."""
    table = _table(record_predictions)
    for k, p in record_predictions.items():
        assert p.fits, table
        assert p.tflops_per_gpu > 0
    tf = {k: p.tflops_per_gpu for k, p in record_predictions.items()}
    assert tf["gb300"] > tf["gb200"] > tf["h800"] > tf["h100"], table


def test_gb300_record_is_the_headline(record_predictions):
    p = record_predictions["gb300"]
    assert abs(p.flops_per_token / 260.0e9 - 1) < 1e-3  # the accounting of `moetrain count`
    assert abs(p.tflops_per_gpu / 1648 - 1) <= 0.05, _table(record_predictions)
    assert abs(p.tokens_per_s_per_gpu / 6338 - 1) <= 0.05


def test_one_set_of_constants_per_generation(record_predictions):
    """The constants used for a row are those of its GPU generation, shared by every GPU of it."""
    gens = {"gb300": "blackwell", "gb200": "blackwell", "h100": "hopper", "h800": "hopper"}
    for k, p in record_predictions.items():
        assert p.details["efficiency"] == constants.efficiency_for(gens[k]).to_dict()
