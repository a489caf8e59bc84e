"""No file of a run directory is unpickled with code-running power (``moetrain.interop.dcp_safe``): a crafted DCP
``.metadata`` -- with a checksum manifest that matches it, as a crafted run would have -- runs nothing under
``--resume``, ``export`` or a checkpoint read, and the checkpoint is set aside like a damaged one."""

from __future__ import annotations

import json
import pickle

import pytest

from moetrain.errors import CheckpointError
from moetrain.interop.dcp_safe import UnsafeCheckpointError, read_dcp_metadata
from moetrain.train import checkpoint as ck
from moetrain.train.checksums import MANIFEST, file_sum
from moetrain.train.export import export_run

from .checkpoint_harness import tiny_checkpointable


class _Payload:
    """What a crafted pickle does when loaded: here, create a file (a real one would run anything)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture()
def crafted(tmp_path):
    model, opt, ctx, state = tiny_checkpointable()
    for step in (5, 10):
        ck.save_checkpoint(tmp_path, step, model, opt, state, ctx, keep=3)
    newest = ck.checkpoint_dir(tmp_path) / "step_00000010"
    marker = tmp_path / "pwned"
    (newest / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest = json.loads((newest / MANIFEST).read_text())
    n, digest = file_sum(newest / ".metadata")
    manifest["files"][".metadata"] = {"bytes": n, manifest["algorithm"]: digest}  # the crafted run's own sums
    (newest / MANIFEST).write_text(json.dumps(manifest))
    return tmp_path, newest, marker, model, opt, ctx


def test_a_real_checkpoint_metadata_reads_through_the_safe_loader(crafted):
    run, newest, _, _, _, _ = crafted
    meta = read_dcp_metadata(ck.checkpoint_dir(run) / "step_00000005")
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)


def test_a_crafted_metadata_runs_nothing_anywhere(crafted, tmp_path):
    run, newest, marker, model, opt, ctx = crafted
    with pytest.raises(UnsafeCheckpointError, match=r"names \w+\.open, which a DCP checkpoint"):
        read_dcp_metadata(newest)
    # --resume: the newest is skipped as unreadable, the one before it is taken
    chosen, skipped = ck.resume_checkpoint(run)
    assert chosen is not None and chosen.name == "step_00000005"
    assert skipped and skipped[0][0] == newest and "UnsafeCheckpointError" in skipped[0][1]
    with pytest.raises(CheckpointError):
        ck.load_checkpoint(newest, model, opt, ctx)
    with pytest.raises(Exception):
        export_run(run, tmp_path / "export", step=10)
    assert not marker.exists()
