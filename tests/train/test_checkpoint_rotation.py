"""Checkpoint rotation survives the leftovers of a crash in the middle of an earlier rotation."""

from __future__ import annotations

from moetrain.model import build_model, get_preset
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.checkpoint import checkpoint_dir, latest_checkpoint, save_checkpoint
from moetrain.train.optim import build_optimizer


def test_rotation_after_a_crash_between_rename_and_delete(tmp_path):
    cfg = get_preset("tiny")
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-3)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {}, ctx, keep=2)
    root = checkpoint_dir(tmp_path)
    # a crash after an earlier rotation renamed step 1 aside but before it was deleted
    (root / ".trash-step_00000001").mkdir()
    (root / ".trash-step_00000001" / "__0_0.distcp").write_bytes(b"stale shard")
    final = save_checkpoint(tmp_path, 3, model, opt, {}, ctx, keep=2)  # rotates step 1 out onto that name
    assert latest_checkpoint(tmp_path) == final
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
