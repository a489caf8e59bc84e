"""How the trainer's validation shares ``train.eval_batches`` among a mixture's sources (hand-computed largest
remainders), and how a mixture's validation record reads in metrics.jsonl and the trackers; one stream's record is
what it was."""

from __future__ import annotations

import math

import pytest

from moetrain.train.metrics import VAL_METRICS, val_line, val_record
from moetrain.train.trackers import tracker_scalars
from moetrain.train.validation import split_eval_batches


@pytest.mark.parametrize("weights,batches,want", [
    ((3, 1), 4, [3, 1]),          # 1 each + 2 x (0.75, 0.25) = (1.5, 0.5): floors (1, 0), the tie's 1 to source 0
    ((3, 1), 8, [6, 2]),          # 1 each + 6 x (0.75, 0.25) = (4.5, 1.5) -> (5, 1) after the tie
    ((3, 1), 1, [1, 1]),          # fewer batches than sources: one each all the same
    ((2, 1), 1000, [666, 334]),   # 998 x (2/3, 1/3) = (665.33, 332.67): the larger remainder is source 1's
    ((1, 1, 1), 5, [2, 2, 1]),    # 2 x (1/3 each): the two ties to the earlier sources
    ((0.1, 0.7, 0.2), 13, [2, 8, 3]),  # 10 x w = (1, 7, 2): exact
    ((5,), 4, [4]),               # one source takes them all
])
def test_split_gives_one_each_and_the_rest_by_weight(weights, batches, want):
    got = split_eval_batches(weights, batches)
    assert got == want
    assert sum(got) == max(batches, len(weights))


@pytest.mark.parametrize("weights,batches", [((), 4), ((1, 0), 4), ((1, -2), 4), ((1, float("nan")), 4), ((1,), 0)])
def test_split_refuses_bad_weights_and_counts(weights, batches):
    with pytest.raises(ValueError, match="weight|eval_batches"):
        split_eval_batches(weights, batches)


def test_a_mixture_record_adds_the_losses_by_source_and_one_stream_stays_as_it_was():
    assert val_record(4, 2.0) == {"kind": "val", "step": 4, "val_loss": 2.0, "val_ppl": math.exp(2.0)}
    assert list(val_record(4, 2.0, {}))[2:] == [m.key for m in VAL_METRICS]
    rec = val_record(4, 2.0, {"a.jsonl": 1.5, "/data/b": 3.0})
    assert rec["val_loss_by_source"] == {"a.jsonl": 1.5, "/data/b": 3.0}
    assert tracker_scalars(rec) == {"val/val_loss": 2.0, "val/val_ppl": math.exp(2.0),
                                    "val/val_loss_by_source/a.jsonl": 1.5, "val/val_loss_by_source/data/b": 3.0}
    assert val_line(4, 10, 2.0) == "step     4/10 | val lm loss 2.0000 | val ppl 7.39"
