"""The hang monitor names the phase a rank is stuck in before a collective timeout ends the process."""

from __future__ import annotations

import io
import threading
from types import SimpleNamespace

import pytest

from moetrain.parallel.hang import HangMonitor, in_phase, last_stall

from .harness import ok_values, run_ranks
from .timing_workers import hang_in_counts_run


def _monitor(now: list[float], **kw) -> HangMonitor:
    """A monitor on the fake clock ``now`` whose thread never looks by itself (the tests call check())."""
    return HangMonitor(3, report_after_s=10, timeout_s=20, out=io.StringIO(), clock=lambda: now[0], poll_s=3600,
                       **kw)


def test_reports_the_open_phases_once_per_stall_then_the_progress():
    now = [0.0]
    m = _monitor(now)
    m.start()
    try:
        with in_phase("forward"):
            with in_phase("dispatch (counts), MoE layer 2"):
                with in_phase("dispatch (counts), MoE layer 2"):  # the wait inside the marked exchange
                    now[0] = 9.0
                    assert m.check() is None
                    now[0] = 12.0
                    line = m.check()
                    assert line.startswith("[moetrain] rank 3 stuck in forward > dispatch (counts), MoE layer 2 "
                                           "for 12 s;")
                    assert "parallel.timeout_s = 20 s" in line
                    now[0] = 30.0
                    assert m.check() is None  # once per stall
            assert m.check() == "[moetrain] rank 3: progress again after 30 s in forward > dispatch (counts), MoE " \
                                "layer 2"
            now[0] = 45.0
            assert "stuck in forward for 15 s" in m.check()  # a new stall in the outer phase
    finally:
        m.stop()
    assert len(m.reports) == 3 and m.out.getvalue().count("\n") == 3


def test_no_report_without_an_open_phase_or_without_a_monitor():
    now = [0.0]
    m = _monitor(now)
    now[0] = 100.0
    assert m.check() is None
    with in_phase("not monitored"):  # no monitor running: a no-op
        pass
    assert m.open_phases() == []


def test_phases_of_other_threads_are_reported_in_order(tmp_path):
    """The autograd engine runs CUDA backward on a thread of its own: its phase nests under the main thread's."""
    now = [0.0]
    log = tmp_path / "logs" / "rank-3.log"
    m = _monitor(now, log_path=log)
    with m:
        with in_phase("backward / gradient sync"):
            now[0] = 1.0
            entered = threading.Event()
            leave = threading.Event()

            def backward_thread():
                with in_phase("combine backward, MoE layer 0"):
                    entered.set()
                    leave.wait()
            t = threading.Thread(target=backward_thread)
            t.start()
            entered.wait()
            assert m.open_phases() == ["backward / gradient sync", "combine backward, MoE layer 0"]
            now[0] = 20.0
            line = m.check()
            leave.set()
            t.join()
    assert "rank 3 stuck in backward / gradient sync > combine backward, MoE layer 0 for 19 s" in line
    assert last_stall(log) == line.removeprefix("[moetrain] ")
    assert last_stall(tmp_path / "missing.log") is None


def test_one_monitor_per_process():
    a, b = _monitor([0.0]), _monitor([0.0])
    with a:
        with pytest.raises(RuntimeError, match="already running"):
            b.start()


@pytest.mark.dist
def test_a_rank_waiting_for_a_late_peer_names_the_count_exchange():
    """Rank 1 joins the MoE layer 3 s late: rank 0, blocked in the dispatch's count exchange (on gloo in the wait,
    on NCCL at the split sizes' host read), reports it with its layer after 1 s, and the progress when it comes."""
    r0, r1 = ok_values(run_ranks(2, hang_in_counts_run, 1.0, 3.0, timeout=120))
    stuck = [line for line in r0["reports"] if "stuck in" in line]
    assert len(stuck) == 1, r0["reports"]
    assert stuck[0].startswith("[moetrain] rank 0 stuck in forward (FSDP parameter all-gather or expert dispatch) > "
                               "dispatch (counts), MoE layer 0 for ")
    assert any("progress again" in line for line in r0["reports"])
    assert r0["printed"].splitlines() == r0["reports"]
    assert r1["reports"] == []  # its sleep was outside any phase


def test_launcher_names_the_phase_of_a_worker_killed_by_the_watchdog(tmp_path):
    """NCCL's watchdog aborts a timed-out worker (SIGABRT): the one-line failure quotes the monitor's last report."""
    from moetrain.train.launch import _failure_message

    log = tmp_path / "logs" / "rank-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("[moetrain] rank 1 stuck in step end (waits ...) for 150 s; the collective timeout ...\n")
    failure = SimpleNamespace(message="", exitcode=-6, timestamp=1.0)
    e = SimpleNamespace(failures={1: failure})
    job = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path)))
    msg = _failure_message(e, job)
    assert msg.startswith("a training worker failed: rank 1 was killed by signal 6, after: rank 1 stuck in step end")
    assert "no checkpoint was written" in msg


def test_a_stall_that_ended_or_belongs_to_an_earlier_run_is_not_quoted(tmp_path):
    """A slow checkpoint save reported as stuck, then "progress again", did not kill the process; nor did a stall
    of an earlier run appended to the same rank log (logs are kept over runs and resumes)."""
    from moetrain.train.launch import _failure_message, _rank_log_sizes

    now = [0.0]
    log = tmp_path / "logs" / "rank-0.log"
    m = _monitor(now, log_path=log)
    with m:
        with in_phase("checkpoint save"):
            now[0] = 160.0
            assert "stuck in checkpoint save" in m.check()
        now[0] = 170.0
        assert "progress again" in m.check()
    assert last_stall(log) is None
    job = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path)))
    e = SimpleNamespace(failures={0: SimpleNamespace(message="", exitcode=-9, timestamp=1.0)})
    assert _failure_message(e, job).startswith("a training worker failed: rank 0 was killed by signal 9; ")
    # an earlier run's unresolved stall, then this run's start: not this run's cause
    log.write_text("[moetrain] rank 0 stuck in step end (waits ...) for 150 s\n")
    sizes = _rank_log_sizes(job, 1)
    assert last_stall(log) is not None and last_stall(log, sizes[0]) is None
    assert ", after:" not in _failure_message(e, job, sizes)
    with open(log, "a") as f:  # this run's own stall is quoted
        f.write("[moetrain] rank 0 stuck in dispatch (counts), MoE layer 2 for 150 s\n")
    assert _failure_message(e, job, sizes).endswith(
        "rank 0 was killed by signal 9, after: rank 0 stuck in dispatch (counts), MoE layer 2 for 150 s; "
        "no checkpoint was written")
