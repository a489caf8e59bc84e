"""FSDP2 finds every output tensor of the modules it wraps, on every supported torch.

FSDP2 all-gathers a module's parameters for its backward from a hook it registers on the module's output tensors.
torch 2.11 finds them with ``torch.utils._pytree.tree_flatten`` (``FSDPState._register_pre_backward_hook``), which
treats a dataclass as a leaf; torch 2.13 also walks dataclasses. A module output holding a dataclass therefore got
no hook on 2.11: the root (whose ``ModelOutput`` was one) ran its backward on the freed storage of resharded
parameters ("setStorage: ... out of bounds for storage of size 0"). This test holds every FSDP-wrapped module to
the narrower of the two contracts, on whichever torch runs it.
"""

from __future__ import annotations

import pytest

from .harness import ok_values, run_ranks
from .workers import fsdp_outputs_run

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("as_stage", [False, True], ids=["transformer", "stage"])
def test_pytree_finds_every_output_tensor_of_fsdp_modules(as_stage):
    for r in ok_values(run_ranks(2, fsdp_outputs_run, as_stage)):
        assert r["wrapped"] == r["expected"] and len(r["checked"]) == r["expected"], r["checked"]
        assert all(n > 0 for _, n in r["checked"]), r["checked"]
        assert r["missed"] == [], r["missed"]
        assert r["grads"] == r["params"]
