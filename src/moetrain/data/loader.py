"""Packed, shuffled, data-parallel, resumable batches from a token file.

Windows: the split's token stream ``t[0..N)`` is cut into ``W = (N - 1) // L`` windows of ``L + 1`` tokens with
stride ``L``: window ``w`` is ``t[w*L : w*L + L + 1]``, inputs = ``window[:-1]``, labels = ``window[1:]``. Adjacent
windows share one token (the last label of one is the first input of the next), so every token but the first is a
label exactly once per epoch and nothing is padded; documents are packed across window boundaries, separated by the
end-of-document token.

Order: epoch ``e`` visits the windows in ``order_e`` = a permutation drawn by ``numpy.random.default_rng([seed, e])``
(the identity with ``shuffle=False``). Position ``i`` of ``order_e`` goes to data-parallel rank ``i % dp_size``; each
rank gathers its next ``micro_batch_size`` windows into a batch. Every rank gets the same number of windows per epoch
(the last ``W % dp_size`` positions of an epoch are skipped), and a batch may continue into the next epoch, so the
stream is infinite and every batch is full.

Resume: ranks step in lockstep, so after ``s`` batches each has consumed ``s * micro_batch_size`` windows and the
job as a whole ``position = s * micro_batch_size * dp_size`` windows of the current epoch. :meth:`state_dict` stores
``epoch`` and that global ``position`` (plain ints; every rank's state is identical, saving rank 0's is enough).
:meth:`TokenLoader.load_state_dict` continues at the same global position: rank ``r`` of the resumed job takes
positions ``position + r``, ``position + r + dp_size``, ... of ``order_epoch`` - with the same ``dp_size`` exactly
the batches an uninterrupted loader would have produced. With a different ``dp_size`` (and/or micro-batch size) the
remaining windows of that epoch are dealt round-robin to the new ranks starting at the saved position, so no window
is repeated or skipped (except up to ``dp_size - 1`` at the end of the epoch); later epochs follow the plain
``i % dp_size`` rule.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import torch

from .corpus import DataError
from .shards import load_tokens

__all__ = ["TokenLoader", "iter_eval_batches", "count_windows"]


def count_windows(n_tokens: int, seq_len: int) -> int:
    """Number of packed windows of ``seq_len + 1`` tokens (stride ``seq_len``) in ``n_tokens`` tokens."""
    return max(n_tokens - 1, 0) // seq_len


def _check_args(seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    for name, v, lo in (("seq_len", seq_len, 1), ("micro_batch_size", micro_batch_size, 1), ("dp_size", dp_size, 1),
                        ("dp_rank", dp_rank, 0)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}); got {dp_rank}")


def _open(path_or_tokens: str | os.PathLike | np.ndarray) -> tuple[np.ndarray, str]:
    if isinstance(path_or_tokens, np.ndarray):
        if path_or_tokens.ndim != 1 or not np.issubdtype(path_or_tokens.dtype, np.integer):
            raise ValueError("tokens must be a 1-D integer array")
        return path_or_tokens, "<array>"
    return load_tokens(path_or_tokens), os.fspath(path_or_tokens)


def _too_small(where: str, n_tokens: int, seq_len: int, dp_size: int) -> DataError:
    need = seq_len * dp_size + 1
    return DataError(f"token file {where!r} has {n_tokens} tokens, too few for one window of seq_len+1="
                     f"{seq_len + 1} tokens per data-parallel rank (dp_size={dp_size} needs at least {need}); use a "
                     "smaller seq_len or fewer ranks, add data, or (for the validation split) raise val_fraction")


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = windows.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    buf = np.asarray(tokens[idx.reshape(-1)], dtype=np.int64).reshape(len(windows), seq_len + 1)
    return torch.from_numpy(np.ascontiguousarray(buf[:, :-1])), torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))


class TokenLoader:
    """Infinite, deterministic, resumable stream of packed (inputs, labels) micro-batches for one dp rank.

    Args:
        path: a split's token file (``PreparedData.train_path``) with its ``meta.json`` beside it, or a 1-D integer
            numpy array of tokens.
        seq_len: L, tokens per sequence. micro_batch_size: B, sequences per batch of this rank.
        dp_rank / dp_size: this rank's index and the number of data-parallel ranks.
        seed: shuffle seed (epoch ``e`` uses ``default_rng([seed, e])``). shuffle: False = windows in file order.

    Attributes:
        n_tokens, n_windows, epoch (current epoch), position (windows of the current epoch consumed by all ranks).

    Raises:
        ValueError: bad arguments. DataError: the file is missing/corrupt, or holds fewer than
        ``seq_len * dp_size + 1`` tokens (not one window per rank).

    See the module docstring for the window, order and resume semantics.
    """

    def __init__(self, path: str | os.PathLike | np.ndarray, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        _check_args(seq_len, micro_batch_size, dp_rank, dp_size)
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {seed!r}")
        self.tokens, self.path = _open(path)
        self.seq_len, self.micro_batch_size = int(seq_len), int(micro_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.n_tokens = int(len(self.tokens))
        self.n_windows = count_windows(self.n_tokens, self.seq_len)
        if self.n_windows < self.dp_size:
            raise _too_small(self.path, self.n_tokens, self.seq_len, self.dp_size)
        self.epoch = 0
        self._start = 0  # global position at which the current epoch's dealing started (0, or a resumed position)
        self._k = 0  # windows this rank consumed since then
        self._order: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------------ order
    def window_order(self, epoch: int) -> np.ndarray:
        """The window indices of ``epoch`` in visiting order: int64 array of shape (n_windows,)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n_windows)
        else:
            order = np.arange(self.n_windows, dtype=np.int64)
        self._order = (epoch, order)
        return order

    def _capacity(self) -> int:
        return (self.n_windows - self._start) // self.dp_size

    def _roll(self) -> None:
        while self._k >= self._capacity():
            self.epoch += 1
            self._start = 0
            self._k = 0

    @property
    def position(self) -> int:
        """Windows of the current epoch's order consumed by all ranks together (the next global position)."""
        return self._start + self._k * self.dp_size

    # ------------------------------------------------------------------ batches
    def next_windows(self) -> np.ndarray:
        """The window indices of this rank's next batch (int64, shape (B,)), advancing the stream."""
        out = np.empty(self.micro_batch_size, dtype=np.int64)
        for j in range(self.micro_batch_size):
            self._roll()
            order = self.window_order(self.epoch)
            out[j] = order[self._start + self.dp_rank + self._k * self.dp_size]
            self._k += 1
        self._roll()
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch.

        Returns:
            ``(inputs, labels)``: CPU int64 tensors of shape (B, L); ``labels[:, t] == inputs[:, t + 1]`` for
            ``t < L - 1`` and ``labels[:, L-1]`` is the window's last token.
        """
        return _gather(self.tokens, self.next_windows(), self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield :meth:`next_batch` forever."""
        while True:
            yield self.next_batch()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Resumable state (plain ints/bools): ``epoch`` and global ``position``, plus the settings it depends on
        (``seq_len``, ``n_windows``, ``seed``, ``shuffle``) and, for information, ``dp_size``/``micro_batch_size``."""
        return {"epoch": int(self.epoch), "position": int(self.position), "seq_len": self.seq_len,
                "n_windows": self.n_windows, "seed": self.seed, "shuffle": self.shuffle, "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from ``state`` (see the module docstring; ``dp_size`` and ``micro_batch_size`` may differ).

        Raises:
            ValueError: ``state`` lacks ``epoch``/``position``; or, with ``strict``, it was saved for a different
                ``seq_len``/``seed``/``shuffle`` or a token file with a different number of windows (the positions
                would refer to different windows). With ``strict=False`` such a state is accepted and the position
                is clamped to this file's windows.
        """
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"loader state must hold integer 'epoch' and 'position'; got {state!r}") from e
        if strict:
            for name in ("seq_len", "n_windows", "seed", "shuffle"):
                if name in state and state[name] != getattr(self, name):
                    raise ValueError(f"loader state was saved with {name}={state[name]!r} but this loader has "
                                     f"{name}={getattr(self, name)!r}; resuming would not continue the same stream "
                                     "(pass strict=False to accept it anyway)")
        if epoch < 0 or position < 0 or (strict and position > self.n_windows):
            raise ValueError(f"invalid loader state epoch={epoch}, position={position} (n_windows={self.n_windows})")
        self.epoch, self._start, self._k = epoch, min(position, self.n_windows), 0
        self._roll()


def iter_eval_batches(path: str | os.PathLike | np.ndarray, seq_len: int, micro_batch_size: int, dp_rank: int = 0,
                      dp_size: int = 1, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed-order validation batches of this rank (no shuffle; same windows as :class:`TokenLoader`).

    Rank ``r`` takes windows ``r, r + dp_size, r + 2*dp_size, ...`` (``n_windows // dp_size`` of them, so every rank
    gets the same count) in batches of ``micro_batch_size``; the last batch may be smaller but has the same size on
    every rank, so all ranks run the same number of steps with the same shapes (safe for collectives).

    Args:
        max_batches: stop after this many batches (None = the whole split).

    Yields:
        ``(inputs, labels)``: CPU int64 tensors of shape (b, L), b <= micro_batch_size.

    Raises:
        ValueError: bad arguments. DataError: fewer than ``seq_len * dp_size + 1`` tokens.
    """
    _check_args(seq_len, micro_batch_size, dp_rank, dp_size)
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 0):
        raise ValueError(f"max_batches must be None or an integer >= 0; got {max_batches!r}")
    tokens, where = _open(path)
    n_windows = count_windows(len(tokens), seq_len)
    if n_windows < dp_size:
        raise _too_small(where, len(tokens), seq_len, dp_size)
    mine = np.arange(dp_rank, (n_windows // dp_size) * dp_size, dp_size, dtype=np.int64)
    for b, lo in enumerate(range(0, len(mine), micro_batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        yield _gather(tokens, mine[lo:lo + micro_batch_size], seq_len)
