"""Process groups at a glance.

World of W = DP x EP ranks, laid out EP-fastest so an EP group is a run of consecutive ranks (one node's NVLink
domain on a GPU cluster)::

    rank = dp_idx * EP + ep_idx

    mesh "ep_mesh" (dp, ep)      e.g. W=4, DP=2, EP=2:   [[0, 1],
                                                          [2, 3]]
    ep group      = a row     (ranks that exchange tokens in the all-to-all; each holds E/EP experts)
    dp group      = a column  (ranks holding the same experts: expert weights are FSDP-sharded over it)
    "world_mesh"  = all ranks (every non-expert weight is FSDP-sharded over it; every rank reads different data)

gloo on CPU, NCCL on CUDA, picked automatically. Without torchrun (no RANK in the environment) everything runs as a
single process with no process group.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.parallel.config import ParallelConfig


@dataclass
class ParallelContext:
    """Everything that knows about ranks. ``world_mesh``/``ep_mesh`` are None in a single process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    pcfg: ParallelConfig
    world_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_mesh is not None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.pcfg.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pcfg.ep

    @property
    def ep_group(self) -> Any:
        return self.ep_mesh.get_group("ep") if self.ep_mesh is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(pcfg: ParallelConfig, n_routed_experts: int, device: str | None = None) -> ParallelContext:
    """Initialise the process group (if launched by torchrun) and the meshes.

    Args:
        pcfg: parallel settings; sizes are checked against the world here, before any model is built.
        n_routed_experts: E, to check that EP divides it.
        device: "cpu", "cuda" or None (cuda when available).

    Raises:
        ConfigError: sizes inconsistent with the world (see ParallelConfig.resolve).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    pcfg = pcfg.resolve(world, n_routed_experts)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if "RANK" not in os.environ:
        return ParallelContext(0, 1, 0, dev, pcfg)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(dev), timeout=datetime.timedelta(seconds=pcfg.timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    world_mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("world",))
    ep_mesh = init_device_mesh(dev.type, (pcfg.dp, pcfg.ep), mesh_dim_names=("dp", "ep"))
    return ParallelContext(rank, world, local_rank, dev, pcfg, world_mesh, ep_mesh)


def check_same_config(ctx: ParallelContext, config: dict[str, Any]) -> None:
    """Fail on every rank, before any training step, if the ranks were given different configs.

    Raises:
        RuntimeError: naming the ranks whose config hash differs from rank 0's.
    """
    if not ctx.distributed:
        return
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    digests: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(digests, digest)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise RuntimeError(f"ranks {bad} were started with a different config than rank 0 (config hashes {digests});"
                           f" every rank must get the same config file and command-line overrides")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
