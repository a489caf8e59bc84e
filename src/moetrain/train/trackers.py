"""Experiment trackers that receive the run's metric records beside ``metrics.jsonl``: TensorBoard and Weights &
Biases. Both get the same scalars under the same names (:func:`tracker_scalars`: ``<kind>/<key>``, the keys of
:data:`moetrain.train.metrics.TRAIN_METRICS`), so a figure found in one is found under its name in the others.

W&B (``train.wandb = "<project>"``) runs offline unless a key or a mode is given: with no ``WANDB_API_KEY`` and no
``WANDB_MODE`` in the environment it sets ``WANDB_MODE=offline``; the run directory is ``<out_dir>/wandb`` and
``wandb sync <out_dir>/wandb/offline-run-*`` uploads it later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from moetrain.errors import ConfigError


def tracker_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics record under their tracker names: ``<kind>/<key>`` for every number of the record
    (``step`` itself excluded; booleans are not figures), and ``a2a/moe<m>/<phase>/{total,exposed}_s`` for the
    per-layer, per-phase all-to-all times of a "train" record, ``imbalance/moe<m>/{lost_share,ep_rows_max_over_mean}``
    per MoE layer, ``<kind>/val_loss_by_source/<source label>`` per source of a mixture's validation (an absolute
    path's leading ``/`` dropped: an empty name part would make an empty group)."""
    kind = record.get("kind", "train")
    out = {f"{kind}/{k}": float(v) for k, v in record.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    for m, phases in enumerate(record.get("a2a_s_per_layer_phase", [])):
        for phase, (total, exposed) in phases.items():
            out[f"a2a/moe{m}/{phase}/total_s"] = float(total)
            out[f"a2a/moe{m}/{phase}/exposed_s"] = float(exposed)
    for m, share, rows in zip(record.get("imbalance_moe_layers", []), record.get("imbalance_lost_share_per_layer", []),
                              record.get("ep_rows_imbalance", [])):
        out[f"imbalance/moe{m}/lost_share"] = float(share)
        out[f"imbalance/moe{m}/ep_rows_max_over_mean"] = float(rows)
    for label, loss in record.get("val_loss_by_source", {}).items():
        out[f"{kind}/val_loss_by_source/{label.lstrip('/')}"] = float(loss)
    return out


class Tracker(Protocol):
    """A destination of the run's scalars."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Record ``scalars`` (:func:`tracker_scalars`) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and finish."""


class TensorBoardTracker:
    """TensorBoard event files in ``<out_dir>/tensorboard``; a resumed run purges the events logged after its
    checkpoint's step (they are logged again)."""

    def __init__(self, out_dir: Path, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, v in scalars.items():
            self.writer.add_scalar(name, v, step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode_note() -> str | None:
    """Set ``WANDB_MODE=offline`` when the environment gives neither a key nor a mode; returns the note saying why
    (None when the user's settings stand)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    os.environ["WANDB_MODE"] = "offline"
    return "no WANDB_API_KEY or WANDB_MODE set"


class WandbTracker:
    """A Weights & Biases run of project ``project`` in ``<out_dir>/wandb``, its config the job's. A resumed run
    continues the W&B run of its out_dir (the id is kept in ``<out_dir>/wandb/run-id``).

    Raises:
        ConfigError: wandb is not installed (``pip install wandb``).
    """

    def __init__(self, project: str, out_dir: Path, config: dict[str, Any] | None = None, resume: bool = False):
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"train.wandb={project!r} needs the wandb package: pip install wandb (or "
                              f"pip install 'moetrain[wandb]'), or leave train.wandb empty") from None
        self.note = wandb_mode_note()
        run_dir = out_dir / "wandb"
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "run-id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        # console="off": the trainer's own lines stay on stdout as they are (no wrapped stream under rich)
        self.run = wandb.init(project=project, dir=str(out_dir), config=config, name=out_dir.name, id=run_id,
                              resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", silent=True))
        id_file.write_text(self.run.id + "\n")
        self.mode = "offline" if self.run.offline else "online"

    @property
    def where(self) -> str:
        """Where the run went, for the start-up line (offline: how to upload it)."""
        run_dir = str(Path(self.run.dir).parent)
        return (f"W&B {self.mode} run {self.run.id} in {run_dir}" + (f" ({self.note})" if self.note else "")
                + (f"; `wandb sync {run_dir}` uploads it" if self.mode == "offline" else ""))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
