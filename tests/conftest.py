"""Suite-wide markers: a test marked ``gpu`` needs a CUDA device and is skipped, with one stated reason, where there
is none (CI, laptops); ``make gpu-test`` hides the GPUs from the multi-process suite, so those run only when pytest
is run on a GPU machine by hand or by ``benchmarks/gpu_check.py``."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device, and this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
