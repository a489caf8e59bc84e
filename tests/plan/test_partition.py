"""``balanced_partition``: the pipeline stage split is the optimum of its definition, computed exactly.

The reference is the definition itself -- every split of the items into contiguous non-empty ranges, enumerated,
with range sums in exact rational arithmetic -- so no float summation order enters what the test expects.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from moetrain.plan.plan import PlanError, balanced_partition


def _best_bottleneck(costs: list[float], n_parts: int) -> Fraction:
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), n_parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(map(Fraction, costs[a:b])) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def _check(costs: list[float], n_parts: int, parts: list[tuple[int, int]]) -> Fraction:
    assert len(parts) == n_parts
    assert parts[0][0] == 0 and parts[-1][1] == len(costs)
    assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
    return max(sum(map(Fraction, costs[a:b])) for a, b in parts)


def test_one_stage_holds_everything_whatever_the_float_sum_says():
    # 0.1 + 0.2 + 0.3 accumulated left to right is 0.6000000000000001; Python 3.12's sum() (compensated) gives 0.6.
    # A bound taken from one and checked against the other split the single stage in two.
    costs = [0.1, 0.2, 0.3]
    assert balanced_partition(costs, 1) == [(0, 3)]
    assert balanced_partition([0.1] * 10, 1) == [(0, 10)]


def test_split_is_the_exact_optimum():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 8)
        costs = [rng.choice([0.0, 0.1, 0.2, 0.3, 1e-8, 1e8]) * rng.random() for _ in range(n)]
        for n_parts in range(1, n + 1):
            parts = balanced_partition(costs, n_parts)
            assert _check(costs, n_parts, parts) == _best_bottleneck(costs, n_parts), (trial, costs, n_parts)


def test_equal_items_split_evenly():
    assert balanced_partition([0.1] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    # more stages than the bound needs: ranges are split until every stage has an item
    assert balanced_partition([0.0] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("costs,n_parts,match", [
    ([1.0, 2.0], 3, "cannot split 2 pipeline items into 3 stages"),
    ([1.0, 2.0], 0, "cannot split"),
    ([1.0, -2.0], 1, "finite and non-negative"),
    ([1.0, float("nan")], 1, "finite and non-negative"),
    ([float("inf")], 1, "finite and non-negative"),
])
def test_bad_input_is_named(costs, n_parts, match):
    with pytest.raises(PlanError, match=match):
        balanced_partition(costs, n_parts)
