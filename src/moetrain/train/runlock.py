"""One training run per run directory: ``RUN_DIR/.moetrain.lock``.

Two ``moetrain train --out D`` at once would delete each other's in-progress checkpoint saves (each save clears the
leftovers of an interrupted one) and rewrite each other's metrics, and a ``--resume`` started while the original
still trains would read a directory that changes under it. So the process that owns a training run (moetrain's own
launcher, or global rank 0 under torchrun) creates the lock file atomically (``O_CREAT | O_EXCL``) before it touches
the directory, writes who holds it, and removes it when the run ends however it ends (an exception, a stop
signal). A lock whose holder is gone -- a process of this host that no longer runs, after a SIGKILL or a reboot --
is taken over, with a note; one held by a live process, or by another host (whose processes this one cannot see),
refuses the run in one line naming the holder. Dry runs take no lock (they start no training).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from moetrain.errors import ConfigError

LOCK_NAME = ".moetrain.lock"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (signal 0 probes it; a permission error means it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The lock of one run directory, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.held = False
        self.made: list[Path] = []

    def acquire(self, note: Callable[[str], Any] = print) -> "RunLock":
        """Take the lock, or take over a stale one (``note`` says so).

        Raises:
            ConfigError: the directory is in use by a live run (or by a run on another host), naming it; or the
                directory cannot hold a lock file (not a directory, not writable).
        """
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise ConfigError(f"--out {self.path.parent} is a file, not a run directory; choose another --out")
        # the folders this lock makes, removed again with it if the run leaves them empty (a run refused for bad
        # input leaves no directory behind)
        self.made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {self.path.parent}: cannot use it as the run directory ({e.strerror or e}); "
                              f"choose another --out") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": " ".join(sys.argv)}
        for _ in range(3):  # a stale lock removed between two tries, or a race with another taker
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # vanished between the two calls: try again
                    continue
                if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) \
                        and not _alive(holder["pid"]):
                    note(f"[moetrain] {self.path.parent}: took over the lock of process {holder['pid']} (started "
                         f"{holder.get('started', '?')}), which no longer runs")
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(self._in_use(holder)) from None
            except OSError as e:
                raise ConfigError(f"--out {self.path.parent}: cannot create its lock file {self.path} "
                                  f"({e.strerror or e}); choose a directory this user can write") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            atexit.register(self.release)
            return self
        raise ConfigError(f"--out {self.path.parent}: its lock {self.path} keeps changing hands; is another run "
                          f"starting in it?")

    def _holder(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            d = json.loads(text)
        except ValueError:
            return {}
        return d if isinstance(d, dict) else {}

    def _in_use(self, holder: dict[str, Any]) -> str:
        who = (f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
               f"{holder.get('started', '?')}: {holder.get('argv', '?')}") if holder else "a lock it cannot read"
        return (f"--out {self.path.parent} is in use by another training run ({who}); two runs in one directory "
                f"delete each other's checkpoints and metrics: wait for it to end, or use another --out (if no run "
                f"holds it any more -- it ran on another machine -- remove {self.path})")

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
        for d in self.made:  # innermost first
            try:
                d.rmdir()
            except OSError:  # not empty: the run wrote into it
                break

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
