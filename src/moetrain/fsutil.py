"""File-system helpers shared by everything that writes atomically (checkpoints, HF exports)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush ``path`` (a file, or a directory's entries after a rename) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
