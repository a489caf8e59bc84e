"""Communication and pipeline timing that measures device time: the CUDA-event path run on a CPU through a stand-in
stream/event API (tests/parallel/fake_events.py), and the host clock of gloo checked against known delays."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.moe import DispatchStats
from moetrain.parallel import timing
from moetrain.parallel.comm import issue
from moetrain.parallel.timing import Clock, EventCommTimer, WallCommTimer

from .fake_events import FakeApi, FakeWork
from .harness import ok_values, run_ranks
from .timing_workers import event_timing_layer_run, event_timing_train_run, wall_timing_run

CPU = torch.device("cpu")


@pytest.fixture
def host_time():
    """A host clock the test moves by hand: [now]."""
    return [0.0]


@pytest.fixture
def api(host_time):
    api = FakeApi(clock=lambda: host_time[0])
    prev = timing.install_device_api("cpu", api)
    yield api
    timing.install_device_api("cpu", prev)


def test_event_timer_duration_and_exposed_follow_the_streams(api, host_time):
    timer = EventCommTimer(CPU, api)
    # Issued at t=0, the transfer ends at t=5; the compute reaches the wait at t=3: it stands still 2 s of the 5.
    token = timer.issue(lambda: FakeWork(api, done_at=5.0))
    assert api.compute.ready == float("-inf")  # issuing never makes the compute stream wait
    host_time[0] = 3.0
    read = timer.wait(token, exposed_from_issue=False)
    assert api.elapsed_reads == 0  # nothing is read at the wait: only when the step's events are known to be done
    assert read() == pytest.approx((5.0, 2.0))
    # Compute that outlasts the transfer hides it: issued at 10, done at 12, waited for at 20.
    host_time[0] = 10.0
    token = timer.issue(lambda: FakeWork(api, done_at=12.0))
    host_time[0] = 20.0
    assert timer.wait(token, False)() == pytest.approx((2.0, 0.0))
    # A synchronous use: all of it exposed.
    host_time[0] = 30.0
    token = timer.issue(lambda: FakeWork(api, done_at=31.5))
    assert timer.wait(token, True)() == pytest.approx((1.5, 1.5))


def test_event_timer_starts_when_the_compute_reaches_the_issue_point(api, host_time):
    """The host runs ahead of the device: the collective cannot start before the compute queued ahead of it."""
    timer = EventCommTimer(CPU, api)
    api.compute.ready = 8.0  # the compute stream is busy until t=8; the host issues at t=1
    host_time[0] = 1.0
    token = timer.issue(lambda: FakeWork(api, done_at=9.0))
    host_time[0] = 2.0
    assert timer.wait(token, False)() == pytest.approx((1.0, 1.0))  # 8 -> 9; the compute at 8 waits until 9


def test_event_timer_order_of_operations(api, host_time):
    timer = EventCommTimer(CPU, api)
    side = timer.stream.name
    token = timer.issue(lambda: FakeWork(api, done_at=1.0))
    timer.wait(token, False)()
    ops = [(op, stream) for op, stream, _ in api.log]
    # On the communication stream: wait for the compute, start, the collective's wait, end. On the compute stream:
    # w0, wait for end, w1.
    assert ops == [("wait_stream", side), ("record", side), ("work.wait", side), ("record", side),
                   ("record", "compute"), ("wait_event", "compute"), ("record", "compute")]
    end_id = api.log[3][2]
    assert api.log[5][2] == end_id


def test_event_timer_reuses_events(api):
    timer = EventCommTimer(CPU, api)
    for _ in range(3):
        timer.wait(timer.issue(lambda: FakeWork(api, done_at=0.0)), False)()
    assert api.events_made == 4  # one set of start, end, w0, w1, returned to the pool at every read


def test_pending_defers_device_readings_to_settle(api, host_time):
    stats = DispatchStats(layer=3)
    pending = issue(lambda: FakeWork(api, done_at=4.0), "dispatch", stats, CPU)
    host_time[0] = 1.0
    pending.wait()
    assert stats.a2a_seconds == 0 and len(stats.unsettled) == 1 and api.elapsed_reads == 0
    stats.settle()
    assert stats.a2a_seconds == pytest.approx(4.0) and stats.exposed_seconds == pytest.approx(3.0)
    assert stats.by_phase == {"dispatch": [pytest.approx(4.0), pytest.approx(3.0)]} and not stats.unsettled
    # Not recording (validation): nothing is kept.
    stats.recording = False
    issue(lambda: FakeWork(api, done_at=5.0), "combine", stats, CPU).wait()
    assert not stats.unsettled


def test_clock_points_on_the_device_are_read_later(api, host_time):
    clock = Clock(CPU, api)
    a = clock.mark()
    host_time[0] = 2.5
    b = clock.mark()
    assert api.elapsed_reads == 0
    assert clock.seconds(a, b) == pytest.approx(2.5)
    assert Clock(CPU, None).seconds(1.0, 3.0) == 2.0  # the host clock


def test_timers_by_device():
    assert isinstance(timing.comm_timer(CPU), WallCommTimer)
    assert timing.device_api(torch.device("cuda")) is torch.cuda
    assert timing.device_api(CPU) is None


@pytest.mark.dist
def test_gloo_host_clock_measures_the_transfer_and_the_wait():
    """The claim behind keeping the host clock on gloo: a gloo all-to-all runs on gloo's threads while the caller
    computes, so issue -> completion is the transfer (here: until the late peer joins) and the blocked wait is the
    part the compute did not hide."""
    delay = 0.6
    exposed_all = ok_values(run_ranks(2, wall_timing_run, delay, 0.0))[0]
    assert delay * 0.8 <= exposed_all["a2a"] < delay + 1.0
    assert exposed_all["exposed"] >= 0.8 * delay
    hidden = ok_values(run_ranks(2, wall_timing_run, delay, 2 * delay))[0]
    assert delay * 0.8 <= hidden["a2a"] < delay + 1.0
    assert hidden["exposed"] < 0.25 * delay
    assert torch.equal(hidden["out"][2:], torch.ones(2, 16))  # rank 1's rows arrived


class _DoneWork:
    """A gloo-like work that completed during its issue call (its future's callbacks run at once)."""

    def get_future(self):
        return self

    def then(self, callback):
        callback(self)

    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("compute_between", [False, True])
def test_a_slow_issue_call_is_launch_time_not_exposed_all_to_all(compute_between):
    """Guard for the all-to-all overlap's regression (issue "exposed share 20% -> 27%"): the host clock counted the
    issue call of every collective (gloo enqueues its work there: ~0.05-0.3 ms of host time, no transfer) as exposed
    all-to-all, ~14 ms per step of the EP 2 overlap check. It is the collective's launch, reported apart
    (``launch_seconds``, the metrics' ``a2a_launch_s_per_step``), as a GPU's events leave a kernel launch out of a
    collective's device time; the all-to-all's own seconds start when the launch returns."""
    import time

    stats = DispatchStats()
    slow_launch = 0.05

    def launch():
        time.sleep(slow_launch)
        return _DoneWork()

    pending = issue(launch, "dispatch", stats, CPU)
    if compute_between:
        time.sleep(0.01)
    pending.wait()
    assert stats.launch_seconds >= slow_launch
    assert stats.exposed_seconds < slow_launch / 2 and stats.a2a_seconds < slow_launch / 2
    assert stats.by_phase["dispatch"][1] == stats.exposed_seconds


@pytest.mark.dist
def test_event_path_through_the_dispatcher_reads_events_once_settled():
    for r in ok_values(run_ranks(2, event_timing_layer_run)):
        assert r["before"] == {"a2a": 0.0, "unsettled": r["before"]["unsettled"], "reads": 0}
        assert r["before"]["unsettled"] >= 8  # 5 forward (counts, weights, ids, rows, combine) + 3 backward
        assert r["a2a"] > 0 and 0 <= r["exposed"] <= r["a2a"]
        assert r["phases"] == sorted(DispatchStats.PHASES)
        # one read per collective waited for at once (the backward ones), two for the others
        assert r["before"]["unsettled"] < r["reads"] < 2 * r["before"]["unsettled"]


@pytest.mark.dist
def test_training_step_settles_event_timers_and_never_synchronizes():
    for r in ok_values(run_ranks(2, event_timing_train_run, {"ep": 2})):
        assert r["reads"] > 0
        assert all(layer["a2a"] > 0 for layer in r["comm"])


@pytest.mark.dist
def test_pipeline_compute_and_bubble_from_events():
    for r in ok_values(run_ranks(2, event_timing_train_run, {"pp": 2})):
        assert r["reads"] > 0
        for total, bubble in r["bubbles"]:
            assert total > 0 and 0 <= bubble <= total
        compute_marks = [e for e in r["log"] if e[:2] == ("record", "compute")]
        # per step: the schedule's two points and two per chunk pass (4 micro-batches, forward and backward)
        assert len(compute_marks) == 2 * (2 + 2 * 4 * 2)


class _CudaStageStandIn:
    """What the timed stage sees of torch's ``PipelineStage`` on a GPU: ``device`` of type "cuda" and the three
    chunk calls, each taking a known time on the stand-in device (it moves the host clock the events read)."""

    CHUNK_S = {"forward": 0.010, "backward": 0.020, "weight": 0.005}

    def __init__(self, host_time: list[float], calls: list[str]):
        self.device = torch.device("cuda", 0)  # constructible without CUDA; nothing is allocated on it
        self.host_time, self.calls = host_time, calls

    def _run(self, kind: str) -> None:
        self.calls.append(kind)
        self.host_time[0] += self.CHUNK_S[kind]

    def forward_one_chunk(self, chunk: int, *a, **k) -> None:
        self._run("forward")

    def backward_one_chunk(self, chunk: int, *a, **k) -> None:
        self._run("backward")

    def backward_weight_one_chunk(self, chunk: int, *a, **k) -> None:
        self._run("weight")


@pytest.mark.parametrize("ep_overlap", [False, True])
def test_pipeline_stage_on_cuda_never_synchronizes_per_chunk(monkeypatch, host_time, ep_overlap):
    """The old timer synchronised the device around every chunk, but only when the stage's device type was "cuda",
    so CPU runs never met it. Here the stage class ``build_schedule`` uses sees a CUDA device, with the stand-in
    event API installed for "cuda": a step's chunks (4 micro-batches, forward, input and weight backward, and one
    OVERLAP_F_B pair) call ``torch.cuda.synchronize`` zero times, and the compute time is read from events only
    after the step (whose end-of-step read is the trainer's, not the stage's)."""
    from moetrain.parallel.pipeline import stage_class

    syncs: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
    api = FakeApi(clock=lambda: host_time[0])
    prev = timing.install_device_api("cuda", api)
    try:
        calls: list[str] = []
        stage = stage_class(_CudaStageStandIn, ep_overlap)(host_time, calls)
        for mb in range(4):
            stage.forward_one_chunk(mb)
        for mb in range(4):
            stage.backward_one_chunk(mb)
            stage.backward_weight_one_chunk(mb)
        # OVERLAP_F_B: a forward run inside a backward is part of the backward's interval, not a second one
        stage._time(lambda: (stage.backward_one_chunk(0), stage.forward_one_chunk(1)))
        assert syncs == []  # not one during the step's chunks
        assert calls == ["forward"] * 4 + ["backward", "weight"] * 4 + ["backward", "forward"]
        assert api.elapsed_reads == 0  # nothing read before the step ended
        records = [e for e in api.log if e[:2] == ("record", "compute")]
        assert len(records) == 2 * (4 + 4 * 2 + 1)  # two events per timed interval, on the compute stream
        # after the step (whose one host read of the device, the trainer's loss and norm read, is allowed): the
        # events are read, still without a synchronize of their own
        expected = 4 * (0.010 + 0.020 + 0.005) + (0.020 + 0.010)
        assert stage.compute_seconds() == pytest.approx(expected, rel=1e-12)
        assert api.elapsed_reads == 4 + 4 * 2 + 1
        assert syncs == []
        assert stage.spans == []
    finally:
        timing.install_device_api("cuda", prev)
