"""More local workers than visible GPUs fail before any worker starts, in one line; the count is read in one place
(``moetrain.parallel.mesh.visible_gpus``), which the tests replace."""

from __future__ import annotations

import pytest
import torch

from moetrain.cli import main
from moetrain.model.config import ConfigError
from moetrain.parallel import mesh
from moetrain.parallel.config import ParallelConfig


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(mesh, "visible_gpus", lambda: 1)


def test_nproc_above_the_visible_gpus_fails_before_launch(one_gpu, capsys, tmp_path):
    code = main(["train", "--device", "cuda", "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == ["moetrain train: error: 2 worker processes on this machine need one GPU "
                                        "each, but 1 GPU is visible; use --nproc 1 (or fewer), or "
                                        "train.device='cpu'"]
    assert not (tmp_path / "run").exists()


def test_nproc_default_is_one_per_visible_gpu(one_gpu):
    from moetrain.config import JobConfig
    from moetrain.train.config import TrainConfig
    from moetrain.train.launch import check_gpus, default_nproc

    job = JobConfig(train=TrainConfig(device="cuda"))
    assert default_nproc(job) == 1
    check_gpus(job, 1)
    with pytest.raises(ConfigError, match="2 worker processes"):
        check_gpus(job, 2)
    check_gpus(JobConfig(train=TrainConfig(device="cpu")), 8)  # CPU workers need no GPU


def test_torchrun_local_world_above_the_visible_gpus(one_gpu, monkeypatch, tmp_path):
    """Under torchrun each worker runs the checks itself, with the node's worker count in LOCAL_WORLD_SIZE."""
    from moetrain.config import JobConfig
    from moetrain.train.config import TrainConfig
    from moetrain.train.launch import preflight

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job = JobConfig(train=TrainConfig(device="cuda", out_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="4 worker processes on this machine need one GPU each, but 1 GPU is"):
        preflight(job, 8)


def test_worker_without_a_gpu_of_its_own(one_gpu, monkeypatch):
    """A worker started by hand on a local rank without a GPU fails naming it (not CUDA's "invalid device
    ordinal" from set_device)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device reached"))
    with pytest.raises(ConfigError, match=r"local rank 1 needs GPU cuda:1, but 1 GPU\(s\) are visible"):
        mesh.init_parallel(ParallelConfig(), 8, device="cuda")


def test_single_worker_gets_its_indexed_gpu(one_gpu, monkeypatch):
    """NCCL's eager init needs ``device_id`` with an index (torch.device("cuda") raises "Please use a device_id
    with index."): local rank 0 gets cuda:0."""
    import torch.distributed as dist

    seen, inits = [], []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: inits.append((backend, kw)))
    monkeypatch.setattr(mesh, "build_mesh", lambda *a: (None, None))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ctx = mesh.init_parallel(ParallelConfig(dispatcher="alltoall"), 8, device="cuda")
    assert ctx.device == torch.device("cuda", 0) and seen == [torch.device("cuda", 0)]
    (backend, kw), = inits
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 0) and kw["device_id"].index == 0
