"""Selective recompute under the distributed layouts: the same layout with and without recomputation trains bit for
bit alike (losses, every parameter after the steps: fp32 on gloo), with EP overlap pairing the recomputed modules,
and ``moe`` recompute rerunning the all-to-alls in the backward."""

from __future__ import annotations

import pytest
import torch

from moetrain.layout import RecomputeModule as RM

from .harness import ok_values, run_ranks
from .pipeline_workers import pipeline_train_run

ALL_BUT_MOE = [m.value for m in RM if m != RM.MOE]


def _same(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        assert ra["params"].keys() == rb["params"].keys()
        for name, t in ra["params"].items():
            assert torch.equal(t, rb["params"][name]), name


@pytest.mark.dist
@pytest.mark.parametrize("layout, modules", [
    ({"ep": 2, "ep_overlap": True}, ALL_BUT_MOE),
    ({"ep": 2}, ["moe", "layernorm"]),
    ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, ALL_BUT_MOE + ["moe"]),
    pytest.param({"pp": 2, "schedule": "1f1b", "ep_overlap": True}, ALL_BUT_MOE, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "schedule": "dualpipev", "ep_overlap": True}, ALL_BUT_MOE, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "schedule": "zbv"}, ALL_BUT_MOE + ["moe"], marks=pytest.mark.slow),
], ids=["ep2-overlap", "ep2-moe", "pp2-interleaved", "pp2-1f1b-overlap", "pp2-dualpipev-overlap", "pp2-zbv"])
def test_recompute_trains_bit_for_bit_as_without(layout, modules):
    world = layout.get("pp", 1) * layout.get("ep", 1)
    keep = ok_values(run_ranks(world, pipeline_train_run, layout, 3))
    recompute = ok_values(run_ranks(world, pipeline_train_run,
                                    {**layout, "recompute": "selective", "recompute_modules": modules}, 3))
    _same(keep, recompute)


def test_moe_recompute_with_ep_overlap_is_refused_by_name():
    from moetrain.errors import ConfigError
    from moetrain.parallel.config import ParallelConfig

    with pytest.raises(ConfigError, match=r"recompute_modules=\[\.\.\., 'moe'\]"):
        ParallelConfig(ep=2, ep_overlap=True, recompute="selective", recompute_modules=("moe",))
    ParallelConfig(ep=2, ep_overlap=True, recompute="selective")  # the default set pairs
    with pytest.raises(ConfigError, match="unknown 'attn'"):
        ParallelConfig(recompute="selective", recompute_modules=("attn",))
    assert ParallelConfig(recompute="selective", recompute_modules="norm,moe_act").recompute_modules == (
        "layernorm", "moe_act")
