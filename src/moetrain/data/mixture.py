"""A weighted mixture of token sources: which source each packed window comes from, and the resumable loader.

The mixture is one global stream of windows (``seq_len + 1`` tokens, stride ``seq_len``, as in
:mod:`moetrain.data.loader`). Position ``p`` of the stream (counted over all data-parallel ranks together; rank
``r`` takes positions ``r, r + dp_size, ...`` in batches of ``micro_batch_size``, as :class:`TokenLoader` does) comes
from source

    ``s(p) = the s with  C[s-1] <= u(p) < C[s]``,   ``u(p) = frac(p * g + h(seed))``,

where ``C`` are the cumulative normalised weights and ``g = 0.6180339887...`` (the golden ratio's fractional part;
computed exactly in 64-bit integers, ``u`` wraps modulo 2**64). ``u`` is a Weyl sequence: it fills [0, 1) with the
lowest discrepancy of its kind (Kuipers & Niederreiter, *Uniform Distribution of Sequences*, ch. 1 and 2), so after
``n`` positions every source has had its share of the windows to within ``O(log n)`` windows, and the same holds for
the positions of each rank (``dp_size * g`` is irrational too) and for each micro-batch's neighbours. Megatron-LM's
``BlendedDataset`` reaches the same exactness with a greedy error-minimising schedule; the Weyl form is a closed
formula of ``p``, so any position can be found without replaying the ones before it.

Within a source the ``k``-th window drawn is position ``k % W`` of epoch ``k // W`` of that source's own order:
``numpy.random.default_rng([seed, index, epoch]).permutation(W)`` for its ``W`` windows (a small source is repeated,
reshuffled each epoch, as often as its weight asks).

Resume: the state is the global ``position`` and how many windows each source gave up to it (``taken``); a resumed
loader continues the same global stream exactly, with any ``dp_size`` or micro-batch size.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .corpus import DataError
from .loader import TokenLoader, _check_args, _gather, _open, count_windows
from .prepare import PreparedData

__all__ = ["Loader", "MixtureLoader", "mixture_counts", "mixture_report", "mixture_schedule", "train_loader"]

#: round(2**64 / golden ratio), odd: the step of the Weyl sequence in 64-bit fixed point.
WEYL_STEP = 0x9E3779B97F4A7C15


def _offset(seed: int) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(f"mixture:{seed}".encode(), digest_size=8).digest(), "little"))


def _thresholds(weights: Sequence[float]) -> np.ndarray:
    """uint64 upper bounds of each source's interval of [0, 2**64), from the normalised cumulative weights."""
    w = np.asarray(weights, dtype=np.float64)
    cum = np.cumsum(w / w.sum())[:-1]
    return np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)


def mixture_schedule(positions: np.ndarray, weights: Sequence[float], seed: int) -> np.ndarray:
    """The source of each global window position (see the module docstring).

    Args:
        positions: int64 array of any shape, global positions >= 0. weights: one positive weight per source (need
            not sum to 1). seed: the data seed.

    Returns:
        int64 array of ``positions``' shape with values in ``[0, len(weights))``.
    """
    p = np.asarray(positions).astype(np.uint64)
    with np.errstate(over="ignore"):  # the sequence is defined modulo 2**64
        u = p * np.uint64(WEYL_STEP) + _offset(seed)
    return np.searchsorted(_thresholds(weights), u, side="right").astype(np.int64)


def mixture_counts(n_positions: int, weights: Sequence[float], seed: int, chunk: int = 1 << 20) -> np.ndarray:
    """Windows each source gives to the first ``n_positions`` positions of the stream (int64, shape (S,))."""
    counts = np.zeros(len(weights), dtype=np.int64)
    for lo in range(0, n_positions, chunk):
        src = mixture_schedule(np.arange(lo, min(lo + chunk, n_positions), dtype=np.int64), weights, seed)
        counts += np.bincount(src, minlength=len(weights))
    return counts


class MixtureLoader:
    """Infinite, deterministic, resumable (inputs, labels) micro-batches drawn from several token files by weight.

    Args:
        paths: each source's training token file (with its ``meta.json``), or 1-D integer arrays.
        weights: one positive weight per source. labels: names for messages (default ``source 0`` ...).
        seq_len, micro_batch_size, dp_rank, dp_size, seed: as for :class:`moetrain.data.TokenLoader`.

    Attributes:
        position: windows of the global stream consumed by all ranks. taken: windows each source gave up to it.

    Raises:
        ValueError: bad arguments. DataError: a source holds fewer than ``seq_len + 1`` tokens (not one window),
        named by its label.
    """

    def __init__(self, paths: Sequence[str | os.PathLike | np.ndarray], weights: Sequence[float], seq_len: int,
                 micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 labels: Sequence[str] | None = None):
        _check_args(seq_len, micro_batch_size, dp_rank, dp_size)
        if len(paths) != len(weights) or not paths:
            raise ValueError(f"need one weight per source; got {len(paths)} source(s), {len(weights)} weight(s)")
        if any(not np.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be positive numbers; got {list(weights)}")
        self.labels = list(labels) if labels is not None else [f"source {i}" for i in range(len(paths))]
        self.seq_len, self.micro_batch_size = int(seq_len), int(micro_batch_size)
        self.dp_rank, self.dp_size, self.seed = int(dp_rank), int(dp_size), int(seed)
        self.weights = [float(w) for w in weights]
        self.tokens = [_open(p)[0] for p in paths]
        self.n_windows = [count_windows(len(t), self.seq_len) for t in self.tokens]
        for label, t, w in zip(self.labels, self.tokens, self.n_windows):
            if w < 1:
                raise DataError(f"source {label} has {len(t)} training tokens, too few for one window of "
                                f"seq_len+1={self.seq_len + 1} tokens; add data to it, drop it from data.sources, "
                                "or lower data.seq_len")
        self.position = 0
        self.taken = np.zeros(len(paths), dtype=np.int64)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def window_order(self, source: int, epoch: int) -> np.ndarray:
        """The window indices of ``source``'s ``epoch`` in drawing order: int64, shape (n_windows[source],)."""
        cached = self._orders.get(source)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = np.random.default_rng([self.seed, source, int(epoch)]).permutation(self.n_windows[source])
        self._orders[source] = (epoch, order)
        return order

    def next_windows(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each sequence of this rank's next batch (int64, shape (B,) each), advancing."""
        n = self.micro_batch_size * self.dp_size
        src = mixture_schedule(np.arange(self.position, self.position + n, dtype=np.int64), self.weights, self.seed)
        k = np.empty(n, dtype=np.int64)  # how many windows the position's source gave before it
        for s in range(len(self.weights)):
            at = np.flatnonzero(src == s)
            k[at] = self.taken[s] + np.arange(len(at))
        mine = np.arange(self.dp_rank, n, self.dp_size)
        windows = np.empty(len(mine), dtype=np.int64)
        for j, i in enumerate(mine):
            s, w = int(src[i]), self.n_windows[int(src[i])]
            windows[j] = self.window_order(s, int(k[i]) // w)[int(k[i]) % w]
        self.taken += np.bincount(src, minlength=len(self.weights))
        self.position += n
        return src[mine], windows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: ``(inputs, labels)``, CPU int64 tensors of shape (B, L) (see
        :meth:`moetrain.data.TokenLoader.next_batch`)."""
        src, windows = self.next_windows()
        x = torch.empty(len(windows), self.seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        for s in np.unique(src):
            rows = np.flatnonzero(src == s)
            xs, ys = _gather(self.tokens[int(s)], windows[rows], self.seq_len)
            x[torch.from_numpy(rows)], y[torch.from_numpy(rows)] = xs, ys
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield :meth:`next_batch` forever."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Resumable state (plain ints/floats/strings): the global ``position`` and per-source ``taken``, with the
        settings they depend on (``seq_len``, ``seed``, ``weights``, ``n_windows``) and, for information, the
        source labels, ``dp_size`` and ``micro_batch_size``."""
        return {"kind": "mixture", "position": int(self.position), "taken": [int(t) for t in self.taken],
                "seq_len": self.seq_len, "seed": self.seed, "weights": list(self.weights),
                "n_windows": list(self.n_windows), "sources": list(self.labels), "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue the global stream at ``state``'s position (``dp_size`` and micro-batch size may differ).

        Raises:
            ValueError: ``state`` is not a mixture state of as many sources (e.g. saved by a single-source run);
                or, with ``strict``, it was saved with another ``seq_len``, ``seed``, ``weights`` or source sizes
                (the position would then continue a different stream).
        """
        try:
            position, taken = int(state["position"]), [int(t) for t in state["taken"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError("loader state is not a data-mixture state (it has no 'position' and per-source "
                             "'taken'; was the run trained on data.paths?); resume with the run's own data "
                             "settings") from e
        if len(taken) != len(self.weights):
            raise ValueError(f"loader state is of a mixture of {len(taken)} sources, this run has "
                             f"{len(self.weights)} sources; resume with the run's data.sources")
        if strict:
            for name, mine in (("seq_len", self.seq_len), ("seed", self.seed), ("weights", self.weights),
                               ("n_windows", self.n_windows)):
                if name in state and state[name] != mine:
                    raise ValueError(f"loader state was saved with {name}={state[name]!r} but this run has "
                                     f"{name}={mine!r}; resuming would not continue the same mixture "
                                     "(load_state_dict(state, strict=False) accepts it anyway)")
        if position < 0 or min(taken) < 0 or sum(taken) != position:
            raise ValueError(f"invalid mixture state position={position}, taken={taken}")
        self.position, self.taken = position, np.asarray(taken, dtype=np.int64)


#: A training loader: one token file, or a weighted mixture of several.
Loader = TokenLoader | MixtureLoader


def train_loader(prep: PreparedData, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0) -> Loader:
    """The training loader of prepared data: a :class:`MixtureLoader` over ``prep.sources`` when the data is a
    mixture (``data.sources``), else a :class:`TokenLoader` over ``prep.train_path``.

    Raises:
        ValueError / DataError: as the loader's constructor.
    """
    if prep.sources:
        return MixtureLoader([s.train_path for s in prep.sources], [s.weight for s in prep.sources], seq_len,
                             micro_batch_size, dp_rank, dp_size, seed, labels=[s.label for s in prep.sources])
    return TokenLoader(prep.train_path, seq_len, micro_batch_size, dp_rank, dp_size, seed=seed)


def mixture_report(prep: PreparedData, seq_len: int, n_sequences: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per source of a prepared mixture: its size, its weight, and what the first ``n_sequences`` training
    sequences of the stream take from it.

    Returns:
        one dict per source: ``label``, ``docs``, ``train_tokens``, ``val_tokens``, ``token_share`` (its share of
        the prepared training tokens), ``weight`` (normalised), ``drawn`` (windows among the first
        ``n_sequences``), ``share`` (``drawn / n_sequences``, the realised mixture) and ``epochs`` (``drawn`` over
        the source's windows: above 1 it repeats).
    """
    weights = [s.weight for s in prep.sources]
    drawn = mixture_counts(n_sequences, weights, seed)
    total_w, total_t = sum(weights), max(prep.n_train_tokens, 1)
    out = []
    for s, d in zip(prep.sources, drawn):
        windows = max(count_windows(s.n_train_tokens, seq_len), 1)
        out.append({"label": s.label, "docs": s.n_docs, "train_tokens": s.n_train_tokens,
                    "val_tokens": s.n_val_tokens, "token_share": s.n_train_tokens / total_t,
                    "weight": s.weight / total_w, "drawn": int(d), "share": int(d) / max(n_sequences, 1),
                    "epochs": int(d) / windows})
    return out
