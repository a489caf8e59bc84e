"""``parallel.dp_overlap = false`` (Megatron without ``--overlap-grad-reduce``): the gradient reduce-scatters run
after the whole backward; training is bit for bit that of the overlapped reduction (EP 2 on gloo, with FSDP's
resharding and with the parameters kept gathered), and under pipelining it is refused by name."""

from __future__ import annotations

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig

from .harness import ok_values, run_ranks
from .pipeline_workers import pipeline_train_run


@pytest.mark.dist
@pytest.mark.parametrize("fsdp", [pytest.param(True, marks=pytest.mark.slow), False])
def test_reductions_after_the_backward_train_as_the_overlapped_ones(fsdp):
    layout = {"ep": 2, "fsdp": fsdp}
    a = ok_values(run_ranks(2, pipeline_train_run, layout, 3))
    b = ok_values(run_ranks(2, pipeline_train_run, {**layout, "dp_overlap": False}, 3))
    for ra, rb in zip(a, b):
        assert ra["losses"] == rb["losses"]
        for name, t in ra["params"].items():
            assert torch.equal(t, rb["params"][name]), name


def test_dp_overlap_false_under_pipelining_is_refused():
    with pytest.raises(ConfigError, match="dp_overlap=false with pp > 1"):
        ParallelConfig(pp=2, dp_overlap=False)
    ParallelConfig(ep=2, dp_overlap=False)
