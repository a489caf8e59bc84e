"""``moetrain train`` as one torchrun worker, with a record of what it reads: run as
``python -m torch.distributed.run --nproc-per-node N tests/train/torchrun_worker.py RECORD_DIR <train args>``.

Each rank writes its stdout and stderr to ``RECORD_DIR/rank-<RANK>.out`` (torchrun interleaves its workers' output)
and, at exit, the checkpoints whose every byte it read against their checksums
(:func:`moetrain.train.checksums.check_files`) and its exit code to ``RECORD_DIR/rank-<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moetrain import cli
from moetrain.train import checkpoint

record = Path(sys.argv[1])
rank = os.environ["RANK"]
out = open(record / f"rank-{rank}.out", "w", buffering=1)
os.dup2(out.fileno(), 1)
os.dup2(out.fileno(), 2)
sys.stdout = sys.stderr = out
verified: list[str] = []
check_files = checkpoint.check_files


def spy(ckpt, manifest, *args, **kwargs):
    verified.append(Path(ckpt).name)
    return check_files(ckpt, manifest, *args, **kwargs)


checkpoint.check_files = spy
rc = 1
try:
    rc = cli.main(["train", *sys.argv[2:]])
finally:
    (record / f"rank-{rank}.json").write_text(json.dumps({"rc": rc, "verified": verified}))
sys.exit(rc)
