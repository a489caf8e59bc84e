"""The phase tape (moetrain.model.phases) on a toy graph with a stand-in all-to-all: the piecewise backward gives
the gradients of one backward call, carries cut only across boundaries, and two tapes pair step by step."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.phases import Tape, boundary, carry, current_tape


class _Done:
    def wait(self) -> None:
        pass


def _fake_all_to_all(x: torch.Tensor, phase: str) -> torch.Tensor:
    """An 'all-to-all' to oneself: the identity, recorded on the tape as the dispatcher records a real one."""
    tape = current_tape()
    if tape is None:
        return x * 1.0
    out = x.detach().clone()
    out = tape.comm(x, out, lambda g: (g.clone(), _Done()), phase)
    boundary(phase)
    return out


def _toy(x, w1, w2, w3):
    h = torch.tanh(x @ w1)
    h_later = carry(h)
    assert h_later() is h  # no boundary yet: the tensor itself
    z = _fake_all_to_all(h * 2, "dispatch")
    u = torch.tanh(z @ w2)
    u_later = carry(u)
    v = _fake_all_to_all(u, "combine")
    r = h_later()
    if current_tape() is not None:
        assert r is not h and r.is_leaf  # read after a boundary: a leaf cut from h
    return ((v @ w3) * r).sum() + u_later().square().sum()


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 4, generator=g, requires_grad=True) for _ in range(3)]


def test_piecewise_backward_equals_one_backward_call():
    x = torch.randn(5, 4)
    ref = _params(0)
    _toy(x, *ref).backward()
    got = _params(0)
    tape = Tape("mb0")
    with tape.recording():
        loss = _toy(x, *got)
    tape.finish(loss)
    assert len(tape.segments) == 3
    tape.drain()
    assert tape.done
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.grad, a.grad)


def test_two_tapes_pair_one_backward_step_per_boundary():
    x0, x1 = torch.randn(5, 4), torch.randn(5, 4)
    ref = _params(1)
    (_toy(x0, *ref) + _toy(x1, *ref)).backward()
    got = _params(1)
    events: list = []
    t0 = Tape("mb0", events=events)
    with t0.recording():
        loss0 = _toy(x0, *got)
    t0.finish(loss0)
    t1 = Tape("mb1", partner=t0, events=events)
    t0.backward_step()
    with t1.recording():
        loss1 = _toy(x1, *got)
    t1.finish(loss1)
    t0.drain()
    t1.drain()
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.grad, a.grad)
    assert [e for e in events if e[0] == "mb0"][:2] == [("mb0", "issue", "dispatch"), ("mb0", "issue", "combine")]
    paired = events[2:2 + 8]
    assert paired == [("mb0", "backward", 2), ("mb0", "bwd-issue", "combine"),
                      ("mb1", "issue", "dispatch"), ("mb0", "backward", 1), ("mb0", "bwd-issue", "dispatch"),
                      ("mb1", "issue", "combine"), ("mb0", "backward", 0), ("mb1", "backward", 2)], events


def test_a_tensor_read_across_a_boundary_without_carry_fails_loudly():
    def leaky(x, w1, w2, w3):
        h = torch.tanh(x @ w1)
        z = _fake_all_to_all(h * 2, "dispatch")
        return (z @ w2).sum() + (h @ w3).sum()  # h read after the boundary, not carried
    tape = Tape("mb0")
    with tape.recording():
        loss = leaky(torch.randn(5, 4), *_params(2))
    tape.finish(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tape.drain()


def test_without_a_tape_carry_is_the_identity():
    t = torch.randn(3, requires_grad=True)
    assert carry(t)() is t and current_tape() is None
    boundary("nothing")  # a no-op
