"""Process groups at a glance: one N-D device mesh, built once from the parallel config.

World of W = PP x DP ranks, DP = EDP x EP (Megatron's DP: EP carved out of it, ``moetrain.layout``), laid out
EP-fastest so an EP group is a run of consecutive ranks (one node's NVLink domain on a GPU cluster)::

    rank = (pp_idx * EDP + edp_idx) * EP + ep_idx

    mesh (pp, edp, ep)       e.g. W=4, PP=1, DP=4, EP=2:   [[[0, 1],
                                                            [2, 3]]]
    "ep"     a row     ranks that exchange tokens in the all-to-all; each holds E/EP experts
    "edp"    a column  ranks holding the same experts: expert weights are FSDP-sharded over it
    "dp"     edp x ep flattened: all ranks of a pipeline stage; every non-expert weight is FSDP-sharded over it and
             every rank reads different data
    "pp"     one pipeline: the ranks of the same (edp, ep) coordinate in every stage; they send activations and
             gradients to each other (point-to-point) and read the same data (room is kept for tp/cp likewise)

Every group of every dimension carries ``parallel.timeout_s`` (``backend_override`` options): torch would otherwise
give sub-groups its global default (30 minutes) while only the world group had the configured timeout.
gloo on CPU, NCCL on CUDA, picked automatically. Without torchrun (no RANK in the environment) everything runs as a
single process with no process group.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.precision.primary_weights import ParamTraffic

MESH_DIMS = ("pp", "edp", "ep")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which routed experts this rank holds: a property of the layout (EP size and this rank's EP index).

    Expert e lives on EP rank e // (E / EP); rank r holds experts [r * El, (r + 1) * El), El = E / EP.
    """

    n_experts: int
    ep: int
    ep_rank: int

    @property
    def n_local(self) -> int:
        return self.n_experts // self.ep

    @property
    def offset(self) -> int:
        return self.ep_rank * self.n_local

    def local_range(self) -> range:
        return range(self.offset, self.offset + self.n_local)


@dataclass
class ParallelContext:
    """Everything that knows about ranks. ``mesh`` is None in a single process.

    Sub-meshes (each a DeviceMesh of the one root mesh, so FSDP2 can compose them with the experts' EP sharding):
    ``ep_mesh``, ``edp_mesh`` (ranks holding the same experts), ``fsdp_mesh`` (edp x ep flattened, "dp": all ranks
    of a stage), ``expert_mesh`` ((edp, ep), 2-D).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    pcfg: ParallelConfig
    mesh: DeviceMesh | None = None
    flat_mesh: DeviceMesh | None = None  # "dp", kept here: slicing a flattened dim from the root is deprecated
    #: bytes received for the parameters (FSDP2's all-gathers, the FP8 weights' scale exchange), for the metrics
    param_traffic: ParamTraffic = field(default_factory=ParamTraffic)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.pcfg.ep

    @property
    def edp_rank(self) -> int:
        """This rank's index among the ranks holding the same experts."""
        return (self.rank // self.pcfg.ep) % self.pcfg.edp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (DP, EP included): the data-parallel world."""
        return self.pcfg.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.stage_size

    @property
    def data_rank(self) -> int:
        """This rank's index among the stage's ranks: the ranks of one pipeline read the same data."""
        return self.rank % self.stage_size

    @property
    def pp_group(self) -> Any:
        return self.mesh["pp"].get_group() if self.mesh is not None else None

    @property
    def stage_group(self) -> Any:
        """The process group of this rank's pipeline stage (edp x ep = dp): global loss normalisers are summed over it."""
        return self.flat_mesh.get_group() if self.flat_mesh is not None else None

    def _sub(self, *dims: str) -> DeviceMesh | None:
        return self.mesh[dims if len(dims) > 1 else dims[0]] if self.mesh is not None else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self._sub("ep")

    @property
    def edp_mesh(self) -> DeviceMesh | None:
        return self._sub("edp")

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        return self.flat_mesh

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        return self._sub("edp", "ep")

    @property
    def ep_group(self) -> Any:
        return self.mesh["ep"].get_group() if self.mesh is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def expert_placement(self, n_experts: int) -> ExpertPlacement:
        return ExpertPlacement(n_experts, self.pcfg.ep, self.ep_rank)


def visible_gpus() -> int:
    """The CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` applied). The one place moetrain reads the
    count (the launcher's checks and default worker count, the workers' device choice)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Backend options carrying ``timeout``, for every group the mesh creates."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    return opts


def build_mesh(device_type: str, pp: int, edp: int, ep: int, timeout_s: float | None
               ) -> tuple[DeviceMesh, DeviceMesh]:
    """The (pp, edp, ep) mesh and its flattened "dp" dimension (edp x ep), every group with ``timeout_s`` (None: the
    backend's own options, for the "fake" backend of ``--dry-run --world``).

    Needs an initialised default process group of pp * edp * ep ranks."""
    if timeout_s is None:
        mesh = init_device_mesh(device_type, (pp, edp, ep), mesh_dim_names=MESH_DIMS)
        return mesh, mesh["edp", "ep"]._flatten("dp")
    opts = _group_options(backend_for(torch.device(device_type)), datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (pp, edp, ep), mesh_dim_names=MESH_DIMS,
                            backend_override={d: opts for d in MESH_DIMS})
    return mesh, mesh["edp", "ep"]._flatten("dp", backend_override=opts)


def group_timeout(group: Any) -> datetime.timedelta:
    """The timeout a process group was created with (for tests and diagnostics)."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    return group._get_backend(device).options._timeout


def init_parallel(pcfg: ParallelConfig, n_routed_experts: int, device: str | None = None) -> ParallelContext:
    """Initialise the process group (if launched by torchrun) and the mesh.

    Args:
        pcfg: parallel settings; sizes are checked against the world here, before any model is built.
        n_routed_experts: E, to check that EP divides it.
        device: "cpu", "cuda" or None (cuda when available).

    Raises:
        ConfigError: sizes inconsistent with the world (see ParallelConfig.resolve); on CUDA, a local rank without
            a GPU of its own.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    pcfg = pcfg.resolve(world, n_routed_experts)
    dev = join_process_group(pcfg.timeout_s, device)
    if "RANK" not in os.environ:
        return ParallelContext(0, 1, 0, dev, pcfg)
    mesh, flat = build_mesh(dev.type, pcfg.pp, pcfg.edp, pcfg.ep, pcfg.timeout_s)
    return ParallelContext(rank, world, local_rank, dev, pcfg, mesh, flat)


def join_process_group(timeout_s: float, device: str | None = None) -> torch.device:
    """This worker's device (on CUDA the GPU of its local rank, made current), after joining torchrun's default
    process group with collective timeout ``timeout_s`` (seconds) unless joined already; without torchrun (no RANK)
    no group is joined. Called by :func:`init_parallel`, and earlier by ``moetrain train``'s preflight, whose rank 0
    checks the checkpoints for every rank.

    Raises:
        ConfigError: on CUDA, a local rank without a GPU of its own.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # One GPU per local rank, with its index: NCCL's eager init refuses a device_id without one.
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        n_gpus = visible_gpus()
        if local_rank >= n_gpus:
            raise ConfigError(f"local rank {local_rank} needs GPU cuda:{local_rank}, but {n_gpus} GPU(s) are "
                              f"visible on this machine; start at most {n_gpus} worker processes per machine "
                              f"(--nproc / torchrun --nproc-per-node)")
        torch.cuda.set_device(dev)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend_for(dev), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return dev


def fake_parallel(pcfg: ParallelConfig, world: int, n_routed_experts: int) -> ParallelContext:
    """Rank 0 of a ``world``-rank layout that does not exist here, on torch's "fake" process group (collectives are
    no-ops): enough to build the mesh, place experts and FSDP-shard a meta-device model, so every rank-0 shard size
    is the real one. For ``moetrain train --dry-run --world N``.

    Raises:
        ConfigError: sizes inconsistent with ``world``.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    pcfg = pcfg.resolve(world, n_routed_experts, dry_run_world=True)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh, flat = build_mesh("cpu", pcfg.pp, pcfg.edp, pcfg.ep, None)
    return ParallelContext(0, world, 0, torch.device("cpu"), pcfg, mesh, flat)


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
