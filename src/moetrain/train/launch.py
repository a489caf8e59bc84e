"""``moetrain train``: check everything, prepare the data once, then start the workers.

Run plainly, it starts ``nproc`` local workers itself through PyTorch's elastic launcher (the engine behind
``torchrun``): one per GPU, or 2 on a CPU. Run under ``torchrun`` (RANK in the environment), each process is a
worker already and trains directly -- that is how multi-node jobs run::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m moetrain train \\
        --config job.toml

Everything that can be checked without the workers is checked first, so bad input fails in seconds with a message
naming the problem: the config, the data sources, the tokenizer's vocabulary against the model's, EP against the
experts and the world size, and a resumed checkpoint's model.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import torch

from moetrain.config import JobConfig, job_config_from_dict
from moetrain.data import prepare_data
from moetrain.data.prepare import PreparedData
from moetrain.model.config import ConfigError
from moetrain.train.checkpoint import latest_checkpoint
from moetrain.train.trainer import check_checkpoint_compatible, resolve_device, run


def default_nproc(job: JobConfig) -> int:
    if job.train.nproc:
        return job.train.nproc
    if resolve_device(job) == "cuda":
        return torch.cuda.device_count()
    return 2


def preflight(job: JobConfig, world_size: int) -> PreparedData:
    """All checks that need no worker, then data preparation (cached). Returns the prepared data.

    Raises:
        ConfigError, DataError, CheckpointError: naming the problem and the fix.
    """
    job.parallel.resolve(world_size, job.model.n_routed_experts)
    if resolve_device(job) == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible; use train.device='cpu' or 'auto'")
    if job.train.resume:
        ckpt = latest_checkpoint(job.train.out_dir)
        if ckpt is not None:
            check_checkpoint_compatible(ckpt, job)
    prep = prepare_data(job.data)
    if prep.vocab_size > job.model.vocab_size:
        raise ConfigError(f"the tokenizer has {prep.vocab_size} tokens but model.vocab_size is "
                          f"{job.model.vocab_size}; set model.vocab_size >= {prep.vocab_size} or use a smaller "
                          f"tokenizer (data.vocab_size)")
    return prep


def _worker(job_dict: dict[str, Any], prep_dict: dict[str, Any]) -> dict[str, Any]:
    job = job_config_from_dict(job_dict)
    if not job.train.threads_per_proc and job.train.device != "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return run(job, PreparedData(**prep_dict))


def train_main(job: JobConfig) -> dict[str, Any] | None:
    """Entry point of ``moetrain train``. Returns rank 0's summary (None on other torchrun ranks)."""
    if "RANK" in os.environ:  # under torchrun: this process is one worker
        world = int(os.environ["WORLD_SIZE"])
        prep = preflight(job, world)
        summary = _worker(job.to_dict(), dataclasses.asdict(prep))
        return summary if int(os.environ["RANK"]) == 0 else None
    nproc = default_nproc(job)
    prep = preflight(job, nproc)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"moetrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn")
    try:
        results = elastic_launch(config, _worker)(job.to_dict(), dataclasses.asdict(prep))
    except ChildFailedError as e:
        ckpt = latest_checkpoint(job.train.out_dir)
        hint = (f"rerun with --resume to continue from {ckpt}" if ckpt else "no checkpoint was written")
        first = next(iter(e.failures.values()))
        msg = first.message if isinstance(first.message, str) else str(first.message)
        raise RuntimeError(f"a training worker failed (rank {first.rank}, exit code {first.exitcode}): "
                           f"{msg.strip().splitlines()[-1] if msg.strip() else 'killed'}; {hint}") from None
    return results[0]
