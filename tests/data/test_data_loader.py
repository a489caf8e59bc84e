import json

import numpy as np
import pytest
import torch

from moetrain.data import DataError, TokenLoader, count_windows, iter_eval_batches, write_shards

L = 8


def _tokens(n_windows: int) -> np.ndarray:
    """Token i = i, so window w starts with token w * L and windows are identifiable from their first input."""
    return np.arange(n_windows * L + 1, dtype=np.int64)


def _win(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // L).tolist()


def test_shapes_dtypes_shift():
    tok = _tokens(40)
    ld = TokenLoader(tok, L, 4, seed=1)
    assert ld.n_windows == count_windows(len(tok), L) == 40
    x, y = ld.next_batch()
    assert x.shape == y.shape == (4, L) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    for row_x, row_y, w in zip(x, y, _win(x)):
        assert torch.equal(row_x, torch.from_numpy(tok[w * L: w * L + L]))
        assert torch.equal(row_y, torch.from_numpy(tok[w * L + 1: w * L + L + 1]))


def test_from_token_file(tmp_path, char_tok):
    docs = [f"doc {i}: " + "abc" * 20 for i in range(30)]
    info = write_shards(docs, char_tok, tmp_path, val_fraction=0.1)
    train = np.fromfile(info.train_path, dtype=np.uint16)
    ld = TokenLoader(info.train_path, 16, 3, seed=0)
    assert ld.n_windows == (info.n_train_tokens - 1) // 16
    x, y = ld.next_batch()
    w = ld.window_order(0)[:3]
    for b in range(3):
        assert x[b].tolist() == train[w[b] * 16: w[b] * 16 + 16].tolist()
        assert y[b].tolist() == train[w[b] * 16 + 1: w[b] * 16 + 17].tolist()


def test_ranks_disjoint_and_cover_epoch():
    n, dp, b = 50, 3, 2
    loaders = [TokenLoader(_tokens(n), L, b, dp_rank=r, dp_size=dp, seed=7) for r in range(dp)]
    order = loaders[0].window_order(0)
    per_rank = n // dp  # 16 windows each, the last n % dp = 2 positions are skipped
    seen = [[] for _ in range(dp)]
    for _ in range(per_rank // b):
        for r, ld in enumerate(loaders):
            seen[r] += _win(ld.next_batch()[0])
    for r in range(dp):
        assert seen[r] == [int(order[i]) for i in range(r, per_rank * dp, dp)]  # position i -> rank i % dp
    flat = sum(seen, [])
    assert len(set(flat)) == len(flat) == per_rank * dp
    assert all(ld.epoch == 1 and ld.position == 0 for ld in loaders)


def test_deterministic_and_reshuffled_per_epoch():
    a, b = (TokenLoader(_tokens(30), L, 5, seed=3) for _ in range(2))
    for _ in range(12):  # two epochs
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not np.array_equal(a.window_order(0), a.window_order(1))
    assert sorted(a.window_order(1).tolist()) == list(range(30))
    assert not np.array_equal(a.window_order(0), TokenLoader(_tokens(30), L, 5, seed=4).window_order(0))
    seq = TokenLoader(_tokens(30), L, 5, shuffle=False)
    assert _win(seq.next_batch()[0]) == [0, 1, 2, 3, 4]


def test_batches_span_epochs():
    ld = TokenLoader(_tokens(10), L, 4, seed=0)  # 10 windows, batches of 4
    got = sum((_win(ld.next_batch()[0]) for _ in range(5)), [])
    assert got[:10] == ld.window_order(0).tolist() and got[10:] == ld.window_order(1).tolist()
    assert (ld.epoch, ld.position) == (2, 0)


@pytest.mark.parametrize("k", [0, 3, 7, 11])
def test_resume_equals_uninterrupted(k):
    dp, b = 2, 3
    ref = [TokenLoader(_tokens(37), L, b, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)]
    for _ in range(k):
        for ld in ref:
            ld.next_batch()
    states = [ld.state_dict() for ld in ref]
    assert states[0] == states[1]
    state = json.loads(json.dumps(states[0]))  # survives a checkpoint round trip as plain JSON
    assert all(type(state[key]) is int for key in ("epoch", "position"))
    resumed = [TokenLoader(_tokens(37), L, b, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)]
    for ld in resumed:
        ld.load_state_dict(state)
    for _ in range(15):  # crosses epoch boundaries
        for a, c in zip(ref, resumed):
            xa, ya = a.next_batch()
            xc, yc = c.next_batch()
            assert torch.equal(xa, xc) and torch.equal(ya, yc)


def test_resume_with_different_dp_size():
    n, seed = 60, 11
    old = [TokenLoader(_tokens(n), L, 3, dp_rank=r, dp_size=2, seed=seed) for r in range(2)]
    consumed = []
    for _ in range(4):
        for ld in old:
            consumed += _win(ld.next_batch()[0])
    state = old[0].state_dict()
    assert state["epoch"] == 0 and state["position"] == 4 * 3 * 2  # global windows consumed
    order = old[0].window_order(0)
    assert sorted(consumed) == sorted(order[:24].tolist())

    new = [TokenLoader(_tokens(n), L, 2, dp_rank=r, dp_size=4, seed=seed) for r in range(4)]
    for ld in new:
        ld.load_state_dict(state)
        assert ld.state_dict()["position"] == 24
    first = [_win(ld.next_batch()[0]) for ld in new]
    # rank r takes positions 24 + r, 24 + r + 4: together exactly the next 8 windows of the epoch
    for r in range(4):
        assert first[r] == [int(order[24 + r]), int(order[28 + r])]
    rest = sum(first, [])
    for _ in range(3):
        for ld in new:
            rest += _win(ld.next_batch()[0])
    assert all(ld.epoch == 0 and ld.position == 56 for ld in new)
    last = [_win(ld.next_batch()[0]) for ld in new]  # 4 windows left in epoch 0: one per rank, then epoch 1
    rest += [w[0] for w in last]
    assert [w[1] for w in last] == [int(new[0].window_order(1)[r]) for r in range(4)]
    assert sorted(consumed + rest) == list(range(n))  # nothing skipped, nothing repeated
    assert new[0].state_dict()["position"] == new[1].state_dict()["position"]


def test_state_mismatch_is_rejected():
    ld = TokenLoader(_tokens(30), L, 2, seed=1)
    ld.next_batch()
    state = ld.state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        TokenLoader(_tokens(30), L, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="n_windows"):
        TokenLoader(_tokens(31), L, 2, seed=1).load_state_dict(state)
    relaxed = TokenLoader(_tokens(31), L, 2, seed=1)
    relaxed.load_state_dict(state, strict=False)
    assert relaxed.position == 2
    with pytest.raises(ValueError, match="epoch"):
        ld.load_state_dict({"position": 3})


def test_too_small_data():
    with pytest.raises(DataError, match=r"too few.*dp_size=2 needs at least 17"):
        TokenLoader(np.arange(16), L, 1, dp_rank=0, dp_size=2)
    TokenLoader(np.arange(17), L, 1, dp_rank=1, dp_size=2)
    with pytest.raises(DataError, match="seq_len"):
        list(iter_eval_batches(np.arange(10), L, 1, 0, 2))
    with pytest.raises(ValueError, match="dp_rank"):
        TokenLoader(np.arange(100), L, 1, dp_rank=2, dp_size=2)


def test_eval_batches_fixed_and_equal_across_ranks():
    tok = _tokens(23)
    dp, b = 2, 4
    runs = [list(iter_eval_batches(tok, L, b, r, dp)) for r in range(dp)]
    assert len(runs[0]) == len(runs[1]) == 3  # 11 windows per rank: 4 + 4 + 3
    assert [x.shape[0] for x, _ in runs[0]] == [x.shape[0] for x, _ in runs[1]] == [4, 4, 3]
    for r in range(dp):
        wins = sum((_win(x) for x, _ in runs[r]), [])
        assert wins == list(range(r, 22, dp))
        for x, y in runs[r]:
            assert x.dtype == torch.int64 and torch.equal(y[:, :-1], x[:, 1:])
    again = list(iter_eval_batches(tok, L, b, 0, dp))
    assert all(torch.equal(a[0], c[0]) for a, c in zip(runs[0], again))
    assert len(list(iter_eval_batches(tok, L, b, 0, dp, max_batches=2))) == 2
