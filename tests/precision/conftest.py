"""One CPU thread for these tests: their many small ops only contend for a shared CPU when threaded (the FP8
training test measured 6x slower with 2 threads on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
