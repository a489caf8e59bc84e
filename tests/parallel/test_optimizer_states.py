"""Reduced-precision optimizer states in the trainer (``parallel.optimizer``), on 2 gloo ranks at EP 2: what each
rank holds, resume exact, and a checkpoint of one optimizer precision resumed into another."""

from __future__ import annotations

import pytest
import torch

from .harness import ok_values, run_ranks
from .optim_state_workers import states_run

EP2 = {"ep": 2}


def _run(pcfg: dict, run_dir, steps: range, save_at: int | None = None, resume: bool = False) -> list[dict]:
    return ok_values(run_ranks(2, states_run, pcfg, str(run_dir), steps, save_at, resume))


@pytest.mark.parametrize("states, held, moments, bytes_per_param", [
    pytest.param("bf16-moments", {"torch.float32"}, {"torch.bfloat16"}, 4, marks=pytest.mark.slow),
    ("bf16", {"torch.bfloat16"}, {"torch.bfloat16"}, 6),
])
def test_states_are_held_as_named_and_resume_is_exact(tmp_path, states, held, moments, bytes_per_param):
    pcfg = {**EP2, "optimizer": states}
    straight = _run(pcfg, tmp_path / "a", range(4))
    _run(pcfg, tmp_path / "b", range(2), save_at=2)
    resumed = _run(pcfg, tmp_path / "b", range(2, 4), resume=True)
    for s, r in zip(straight, resumed):
        assert s["held"] == held and s["grads"] == held and s["moments"] == moments
        # bytes beyond the weight and its gradient, per parameter element this rank holds (the planner's 8 / 6
        # less the 4-byte fp32 master that is the parameter itself for bf16-moments)
        assert s["state_bytes"] == bytes_per_param * s["numel"]
        assert s["losses"][2:] == r["losses"]
        for a, b in zip(s["masters"], r["masters"]):
            assert torch.equal(a, b)
    # it trains: the loss falls as with fp32 states
    fp32 = _run({**EP2, "optimizer": "fp32"}, tmp_path / "c", range(4))
    for s, f in zip(straight, fp32):
        assert s["losses"][0] == pytest.approx(f["losses"][0], rel=1e-2)
        assert s["losses"][3] == pytest.approx(f["losses"][3], rel=2e-2)


def test_a_checkpoint_of_fp32_states_resumes_into_bf16_states(tmp_path):
    """The fp32 masters come back exactly (bf16 weight + remainder), the moments rounded to bf16."""
    saved = _run({**EP2, "optimizer": "fp32"}, tmp_path, range(2), save_at=2)
    for states in ("bf16", "bf16-moments"):
        resumed = _run({**EP2, "optimizer": states}, tmp_path, range(0), resume=True)
        for s, r in zip(saved, resumed):
            assert len(s["masters"]) == len(r["masters"])
            for a, b in zip(s["masters"], r["masters"]):
                assert torch.equal(a, b)
