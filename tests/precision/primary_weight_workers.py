"""Run on every rank by the FP8 primary-weight tests (importable by spawned processes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moetrain.parallel.parallelize import CountingAllGather
from moetrain.precision.apply import hold_weights_in_fp8
from moetrain.precision.linear import Fp8Linear
from moetrain.precision.primary_weights import Fp8HeldWeight, ParamTraffic
from moetrain.precision.recipe import BLOCKWISE

#: (in, out) of the two linears: 160 rows split 80 / 80 cut a 128x128 block; 100 rows split 50 / 50 cut one too
SHAPES = [(192, 160), (160, 100)]


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    layers = []
    for k, n in SHAPES:
        lin = nn.Linear(k, n, bias=False)
        lin.__class__ = Fp8Linear
        lin.fp8_recipe = BLOCKWISE
        layers.append(lin)
    return nn.Sequential(*layers)


def _x(rank: int) -> torch.Tensor:
    return torch.randn(24, SHAPES[0][0], generator=torch.Generator().manual_seed(10 + rank))


def _reference(model: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One process, the weights and the input in bf16 as FSDP's param_dtype hands them to the GEMMs."""
    ref = copy.deepcopy(model).to(torch.bfloat16)
    x = x.clone().requires_grad_(True)
    y = ref(x.to(torch.bfloat16))
    y.square().sum().backward()
    return y.detach(), x.grad, [lin.weight.grad.float() for lin in ref]


def fsdp_linears_run() -> dict[bool, dict[str, Any]]:
    """Per fp8_param (False, True): this rank's output and input gradient beside one process's, the reduced weight
    gradients beside the sum of both ranks' single-process ones, the bytes gathered and exchanged, and whether the
    forward saw FP8-held weights."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    out: dict[bool, dict[str, Any]] = {}
    for held in (False, True):
        base = _model()
        y_ref, dx_ref, _ = _reference(base, _x(rank))
        dw_ref = [a + b for a, b in zip(_reference(base, _x(0))[2], _reference(base, _x(1))[2])]
        model = copy.deepcopy(base)
        traffic = ParamTraffic()
        if held:
            hold_weights_in_fp8(model, traffic)
        seen: list[bool] = []
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for lin in model:
            lin.register_forward_pre_hook(lambda m, a: seen.append(isinstance(m.weight, Fp8HeldWeight)))
            fully_shard(lin, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        gather = CountingAllGather(traffic)
        for mod in model.modules():
            if hasattr(mod, "set_custom_all_gather"):  # as moetrain.parallel.parallelize sets them
                mod.set_custom_all_gather(gather)
                mod.set_gradient_divide_factor(1.0)
                mod.set_force_sum_reduction_for_comms(True)
        x = _x(rank).requires_grad_(True)
        y = model(x)
        y.square().sum().backward()
        dw = [lin.weight.grad.full_tensor() if isinstance(lin.weight.grad, DTensor) else lin.weight.grad
              for lin in model]
        out[held] = {"y": y.detach(), "y_ref": y_ref, "dx": x.grad, "dx_ref": dx_ref, "dw": dw, "dw_ref": dw_ref,
                     "gathered": traffic.gathered_bytes, "scale_bytes": traffic.scale_bytes, "held": seen}
    return out

