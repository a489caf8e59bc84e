"""Redundant experts (parallel.redundant_experts, parallel.rebalance_every): the placement by hand, the routing to
holders by hand, and training with copies against the same layout without them (gloo ranks on the CPU)."""

from __future__ import annotations

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.eplb import ReplicaPlacement, no_replicas, plan_replicas, water_fill
from moetrain.parallel.redundant import LayerReplicas

from .harness import run_ranks
from .redundant_workers import redundant_checkpoint_run, redundant_train_run


def ok_values(results):
    for status, value in results:
        assert status == "ok", value
    return [v for _, v in results]


# -- placement and routing, by hand ------------------------------------------------------------------------------

def test_water_fill_by_hand():
    assert water_fill(10, [0, 3]) == [7, 3]       # both rise to 6.5: 6 + 7 = 13 with the remainder to the lower
    assert water_fill(7, [5, 0, 0]) == [0, 4, 3]  # the two empty ones rise to 3.5; the loaded one takes nothing
    assert water_fill(4, [0, 10]) == [4, 0]
    assert water_fill(0, [1, 2]) == [0, 0]


def test_hot_experts_on_one_rank_move_whole():
    """All 8 hot experts on rank 0 (the acceptance setup): the 4 copies on rank 1 take whole experts' loads, so
    both ranks end with 4 hot experts' worth -- an even split of each copied expert would leave rank 0 with 6."""
    load = [100, 100, 100, 100, 100, 100, 100, 100] + [0] * 8
    p = plan_replicas(load, ep=2, slots=4)
    assert p.replicas[0] == () and sorted(p.replicas[1]) == [0, 1, 2, 3]
    for e in range(4):
        assert p.holders(e) == [0, 1] and p.shares[e] == (0, 100)
        assert p.slot_of(e, 1) == 8 + p.replicas[1].index(e)
    assert p.rank_loads(load) == [400.0, 400.0]
    assert plan_replicas(load, ep=2, slots=4) == p  # a function of the loads alone


def test_balanced_loads_place_nothing():
    assert plan_replicas([10] * 16, ep=4, slots=2) == no_replicas(16, 4, 2)
    # Rows 101 | 99: a copy would even them (100 | 100) but win 1% of the mean, under MIN_GAIN's 2%.
    assert plan_replicas([26, 25, 25, 25, 25, 25, 25, 24], ep=2, slots=1) == no_replicas(8, 2, 1)
    assert plan_replicas([29, 25, 25, 25, 25, 25, 25, 21], ep=2, slots=1) != no_replicas(8, 2, 1)  # 104 | 96
    with pytest.raises(ValueError):
        plan_replicas([1] * 6, ep=4, slots=1)


def test_placement_lowers_the_heaviest_rank():
    g = torch.Generator().manual_seed(0)
    load = torch.randint(0, 1000, (64,), generator=g).tolist()
    before = max(no_replicas(64, 8, 2).rank_loads(load))
    p = plan_replicas(load, ep=8, slots=2)
    after = p.rank_loads(load)
    assert max(after) < before and abs(sum(after) - sum(load)) < 1e-6
    assert all(len(r) <= 2 for r in p.replicas)


def test_route_splits_each_rank_s_tokens_by_shares():
    """Expert 0 (home rank 0) has a copy on rank 1 taking 3/4 of its load: of this rank's 8 assignments of
    expert 0, the first 2 (token order) go to its home slot 0, the other 6 to rank 1's first copy slot, global id
    1 * (El + R) + El = 1 * 10 + 8 = 18. Other experts go to their home slots."""
    reps = LayerReplicas(16, 2, 0, 2, 1, None)
    reps.placement = ReplicaPlacement(16, 2, 2, ((), (0,)), ((1, 3),) + ((1,),) * 15)
    idx = torch.tensor([[0, 9]] * 8 + [[15, 3]])
    slots = reps.route(idx)
    assert slots[:, 0].tolist() == [0, 0, 18, 18, 18, 18, 18, 18, 10 + 7]
    assert slots[:, 1].tolist() == [10 + 1] * 8 + [3]


def test_config_refuses_by_name():
    for kw, what in ((dict(ep=2, capacity_factor=1.0), "capacity_factor"),
                     (dict(ep=1), "ep=1"),
                     (dict(pp=2, ep=2, schedule="zbv"), "schedule='zbv'"),
                     (dict(pp=2, ep=2, schedule="dualpipev"), "schedule='dualpipev'")):
        with pytest.raises(ConfigError, match=f"redundant experts.*{what}"):
            ParallelConfig(redundant_experts=2, **kw)
    ParallelConfig(pp=2, ep=2, schedule="dualpipev", ep_overlap=True, redundant_experts=2)
    for kw in (dict(redundant_experts=-1), dict(rebalance_every=0), dict(redundant_experts=True)):
        with pytest.raises(ConfigError, match="must be an integer"):
            ParallelConfig(ep=2, **kw)


# -- training with copies equals training without ----------------------------------------------------------------

STEPS = 20


def _compare(without, with_copies, what):
    for a, b in zip(without, with_copies):
        assert len(a["losses"]) == len(b["losses"]) == STEPS
        for x, y in zip(a["losses"], b["losses"]):
            assert abs(x - y) <= 1e-5 * abs(x), (what, a["losses"], b["losses"])
        for name, want in a["params"].items():
            torch.testing.assert_close(b["params"][name], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{what} {n}: {m}")


def _check_placements(ranks, every):
    """Identical on every rank; copies placed at the first rebalance and changed later in the run."""
    by_layer: dict[int, list] = {}
    for r in ranks:
        for step, placed in enumerate(r["placements"]):
            for m, p in placed.items():
                by_layer.setdefault(m, [None] * STEPS)
                if by_layer[m][step] is None:
                    by_layer[m][step] = p
                assert by_layer[m][step] == p, f"layer {m} step {step}: ranks place differently"
    assert by_layer
    for m, seq in by_layer.items():
        assert all(reps == ((),) * 2 for reps, _ in seq[:every - 1]), m
        assert any(any(reps) for reps, _ in seq[every - 1:]), f"layer {m}: no copy was ever placed"
    assert any(len({s for s in seq[every - 1:]}) > 1 for seq in by_layer.values()), "no placement changed"


@pytest.mark.parametrize("layout,world", [({"ep": 2}, 2), ({"pp": 2, "ep": 2}, 4)],
                         ids=["ep2", "pp2-ep2"])
def test_training_with_copies_equals_training_without(layout, world):
    every = 3
    without = ok_values(run_ranks(world, redundant_train_run, layout, STEPS))
    with_copies = ok_values(run_ranks(world, redundant_train_run,
                                      dict(layout, redundant_experts=2, rebalance_every=every), STEPS))
    _compare(without, with_copies, layout)
    _check_placements(with_copies, every)


def test_resume_at_another_ep_after_rebalancing(tmp_path):
    """Saved at EP 2 with copies placed (experts stored by global index, copies not at all), resumed at EP 1 x DP 2
    without copies: the same weights, and the next step's loss equals the saving run's."""
    layout = {"ep": 2, "redundant_experts": 2, "rebalance_every": 2}
    saved = ok_values(run_ranks(2, redundant_checkpoint_run, layout, str(tmp_path), True, 4))
    assert any(any(reps) for reps, _ in saved[0]["placements"].values())
    resumed = ok_values(run_ranks(2, redundant_checkpoint_run, {"ep": 1}, str(tmp_path), False, 4))
    for name, want in saved[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], want, rtol=0, atol=0)
    assert abs(resumed[0]["loss"] - saved[0]["loss"]) <= 1e-5 * abs(saved[0]["loss"])


COMPOSE_STEPS = 6


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    ({"ep": 2, "dispatcher": "alltoall"}, 2),
    ({"ep": 2, "ep_overlap": True}, 2),
    ({"ep": 2, "recompute": "full"}, 2),
    ({"ep": 2, "dispatch_precision": "fp8"}, 2),
    ({"ep": 2, "precision": "fp8"}, 2),
    ({"ep": 2, "fsdp": False}, 2),
    ({"ep": 2}, 4),                                                     # EDP 2: copies' gradients summed over it
    ({"pp": 2, "ep": 2, "vpp": 2, "schedule": "interleaved"}, 4),
    ({"pp": 2, "ep": 2, "schedule": "dualpipev", "ep_overlap": True}, 4),
], ids=["alltoall", "ep_overlap", "recompute", "fp8-dispatch", "fp8-gemms", "no-fsdp", "edp2", "interleaved", "dualpipev-overlap"])
def test_copies_compose(layout, world):
    """Each feature the copies must compose with: the same layout with and without them, rebalanced every 2 steps."""
    without = ok_values(run_ranks(world, redundant_train_run, layout, COMPOSE_STEPS))
    with_copies = ok_values(run_ranks(world, redundant_train_run,
                                      dict(layout, redundant_experts=2, rebalance_every=2), COMPOSE_STEPS))
    # FP8 GEMMs quantise the weight gradient's operands in tiles along the tokens, and a copy changes which of an
    # expert's tokens share a tile: equal to FP8 round-off there, not fp32's.
    # Adam turns those into steps of up to lr on near-zero gradients (the router's 1-2% of its norm in 6 steps), so
    # under FP8 the losses are compared, the parameters are not.
    fp8 = layout.get("precision") == "fp8"
    for a, b in zip(without, with_copies):
        for x, y in zip(a["losses"], b["losses"]):
            assert abs(x - y) <= (1e-4 if fp8 else 1e-5) * abs(x), (layout, a["losses"], b["losses"])
        for name, want in ({} if fp8 else a["params"]).items():
            # Adam turns fp32 order differences of near-zero gradients into ~1e-5 steps (seen once in 262144
            # elements under FP8 dispatch); a copy's gradient left out moves weights by ~1e-2.
            torch.testing.assert_close(b["params"][name], want, rtol=1e-5, atol=1e-4,
                                       msg=lambda m, n=name: f"{layout} {n}: {m}")
    assert any(any(reps) for r in with_copies for placed in r["placements"] for reps, _ in placed.values())
