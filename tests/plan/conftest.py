"""Shared fixtures of the performance-model tests."""

from __future__ import annotations

import pytest
import torch

from moetrain.plan.model import predict
from moetrain.plan.records import RECORDS


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # the model is arithmetic; one thread keeps the few torch calls fast on a shared 2-core machine
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def record_predictions():
    return {k: predict(r.model, r.gpu, r.n_gpus, r.plan) for k, r in RECORDS.items()}
