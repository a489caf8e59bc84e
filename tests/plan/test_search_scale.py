"""--search and --scale."""

from __future__ import annotations

from moetrain.plan.records import RECORDS
from moetrain.plan.search import parse_counts, plan_changes, scale, search


def test_search_beats_the_gb300_record_and_says_what_changed(record_predictions):
    r = RECORDS["gb300"]
    res = search(r.model, r.gpu, r.n_gpus, r.plan)
    rec = record_predictions["gb300"]
    assert res.baseline is not None and res.baseline.tflops_per_gpu == rec.tflops_per_gpu
    assert res.best is not None and res.best.fits
    assert res.best.tflops_per_gpu >= rec.tflops_per_gpu
    assert res.best.memory.total <= 0.95 * res.best.memory_limit_gib
    changes = res.changes()
    assert changes, "the best plan should differ from the record plan"
    assert all("->" in c for c in changes)
    # ranked best first, all fitting
    tf = [p.tflops_per_gpu for p in res.ranked]
    assert tf == sorted(tf, reverse=True)
    assert res.evaluated > 100


def test_plan_changes_lists_fields():
    r = RECORDS["gb300"].plan.replace(dp=128)
    ch = plan_changes(r, r.replace(pp=4, vpp=4, ep=64, dp=64))
    assert "pp: 2 -> 4" in ch and "vpp: 8 -> 4" in ch and "ep: 32 -> 64" in ch


def test_scale_keep_and_search():
    r = RECORDS["gb300"]
    pts = scale(r.model, r.gpu, [256, 512, 1024], r.plan, mode="keep")
    assert [p.n_gpus for p in pts] == [256, 512, 1024]
    assert pts[0].prediction is not None
    tf = [p.prediction.tflops_per_gpu for p in pts if p.prediction]
    assert tf == sorted(tf, reverse=True)  # fixed global batch: fewer micro-batches per pipeline at larger scale
    days = [p.days(14.8e12) for p in pts if p.prediction]
    assert days == sorted(days, reverse=True)  # but more GPUs still finish sooner
    pts = scale(r.model, r.gpu, [64, 8192], r.plan, mode="search", batch="per-gpu", base_gpus=256)
    assert all(p.prediction is not None for p in pts), [p.note for p in pts]


def test_parse_counts():
    assert parse_counts("64-512") == [64, 128, 256, 512]
    assert parse_counts("64,100") == [64, 100]
