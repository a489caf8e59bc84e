"""What data preparation shows while it works: a rich progress bar on a terminal, a few plain lines otherwise.

Preparing a corpus (training a BPE, tokenising) takes from seconds to many minutes, so :func:`moetrain.data.
prepare_data` reports every phase through a :class:`PrepProgress`: on a terminal one live bar per phase (what,
how far in MB of text, elapsed, remaining); on a pipe or a log file one line when a phase starts, one at most every
:data:`LINE_EVERY_S` seconds with its percentage, and one when it ends. Everything goes to stderr, so the results a
command prints on stdout (``moetrain prepare``'s cache path) stay clean.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterator, TextIO

__all__ = ["LINE_EVERY_S", "PrepProgress", "default_progress"]

#: Without a terminal, a running phase prints its progress at most this often.
LINE_EVERY_S = 10.0
PREFIX = "[moetrain] data:"


class PrepProgress:
    """Reports the phases of a data preparation.

    Args:
        enabled: False reports nothing.
        file: where to write (default ``sys.stderr``).
        live: a live progress bar (True), plain lines (False), or None = a bar exactly when ``file`` is a terminal.
    """

    def __init__(self, enabled: bool = True, file: TextIO | None = None, live: bool | None = None):
        self.enabled = enabled
        self.file = file
        self._live = live

    def _console(self):
        from rich.console import Console
        return Console(file=self.file or sys.stderr, highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """One line (a decision or a result), e.g. which cache directory is reused."""
        if self.enabled:
            print(f"{PREFIX} {text}", file=self.file or sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, description: str, total: float | None = None) -> Iterator[Callable[[float], None]]:
        """Report one phase; yields ``update(done)``, ``done`` in bytes of text out of ``total`` (None = no known
        total: a spinner and the elapsed time). The phase's line ends with its duration."""
        if not self.enabled:
            yield lambda done: None
            return
        console = self._console()
        live = console.is_terminal if self._live is None else self._live
        t0 = time.perf_counter()
        if live:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            columns = [SpinnerColumn(), TextColumn(f"{PREFIX} {description}", markup=False)]
            if total:
                columns += [BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f} MB"),
                            TimeRemainingColumn()]
            columns.append(TimeElapsedColumn())
            bar = Progress(*columns, console=console, transient=False)
            task = bar.add_task(description, total=total / 1e6 if total else None)
            bar.start()
            try:
                yield lambda done: bar.update(task, completed=min(done, total or done) / 1e6)
                if total:
                    bar.update(task, completed=total / 1e6)
            finally:
                bar.stop()
            return
        out = self.file or sys.stderr
        size = f" ({total / 1e6:.1f} MB)" if total else ""
        print(f"{PREFIX} {description}{size} ...", file=out, flush=True)
        last = [t0]

        def update(done: float) -> None:
            now = time.perf_counter()
            if total and now - last[0] >= LINE_EVERY_S:
                last[0] = now
                print(f"{PREFIX} {description}: {min(done / total, 1.0):.0%} ({now - t0:.0f} s)", file=out,
                      flush=True)

        yield update
        print(f"{PREFIX} {description}: done in {time.perf_counter() - t0:.1f} s", file=out, flush=True)


def default_progress() -> PrepProgress:
    """Reporting on, except in the non-first local process of a multi-process launch (``LOCAL_RANK`` > 0): under
    torchrun every rank prepares (or waits for) the same data, and one report per host is enough."""
    return PrepProgress(enabled=os.environ.get("LOCAL_RANK", "0") in ("", "0"))
