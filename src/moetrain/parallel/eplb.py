"""Redundant-expert placement from measured loads: which experts get extra copies on which EP ranks, and how much of
each replicated expert's load each holder takes. Pure Python on integers, no process: every rank computes the same
placement from the same all-reduced loads, bit for bit.

The method is DeepSeek's EPLB (``eplb.py`` of deepseek-ai/EPLB, "replicate the heaviest, pack onto the lightest"),
taken to training with the experts' home ranks fixed (the master weights and optimizer states never move):

    loads per rank = each expert's load split over its holders by water-filling (:func:`water_fill`)
    repeat while a replica slot is free:
        the heaviest rank; of the experts it carries, the one with the largest share there;
        a copy of it on the least-loaded rank with a free slot that does not hold it yet;
        keep it if the heaviest rank's load went down by at least MIN_GAIN of the mean, else stop

Water-filling (not an even split) matters: when all hot experts live on one rank, an even split of each over two
holders leaves that rank with half of every hot expert -- the copies must take whole experts' loads off it.

Units: a load is a count of token-expert assignments (the step statistics' ``tokens_per_expert``); a rank's load is
the rows its grouped GEMMs compute.
"""

from __future__ import annotations

from dataclasses import dataclass


#: Smallest drop of the heaviest rank's load, as a share of the mean rank load, that a copy must bring: each copy
#: costs its weights' and gradient's transfer every step and splits its tokens over more ranks (more dispatched
#: rows), which a nearly balanced layer does not win back.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where the copies of one MoE layer's experts are and how each expert's tokens split over its holders.

    Attributes:
        n_experts: E; expert e's home (its master weights) is EP rank e // (E / ep).
        ep: EP ranks.
        slots: replica slots per rank (``parallel.redundant_experts``).
        replicas: per EP rank, the experts copied into its slots, slot order (at most ``slots`` each).
        shares: per expert, the integer share of its load each holder takes, holders in the order home rank, then
            the copies in increasing rank; an expert without copies has the one share ``(1,)``. Only the ratios
            count (a source rank splits its own tokens of the expert in these proportions).
    """

    n_experts: int
    ep: int
    slots: int
    replicas: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[int, ...], ...]

    @property
    def n_local(self) -> int:
        """El: experts homed on each rank."""
        return self.n_experts // self.ep

    def home(self, e: int) -> int:
        return e // self.n_local

    def holders(self, e: int) -> list[int]:
        """EP ranks holding expert ``e``: its home first, then the ranks with a copy, in increasing rank."""
        return [self.home(e)] + [r for r in range(self.ep) if e in self.replicas[r]]

    def slot_of(self, e: int, rank: int) -> int:
        """The local slot of expert ``e`` on ``rank`` (a holder): its home index, or El + its replica slot."""
        if rank == self.home(e):
            return e - rank * self.n_local
        return self.n_local + self.replicas[rank].index(e)

    def rank_loads(self, load_E: list[int]) -> list[float]:
        """Rows each rank computes when every expert's ``load_E`` splits over its holders by ``shares``."""
        out = [0.0] * self.ep
        for e, load in enumerate(load_E):
            total = sum(self.shares[e])
            for r, s in zip(self.holders(e), self.shares[e]):
                out[r] += load * s / total
        return out


def no_replicas(n_experts: int, ep: int, slots: int) -> ReplicaPlacement:
    """The placement before any load was measured: every expert on its home rank only."""
    return ReplicaPlacement(n_experts, ep, slots, ((),) * ep, ((1,),) * n_experts)


def water_fill(amount: int, levels: list[int]) -> list[int]:
    """Split the integer ``amount`` over holders at ``levels`` (their loads so far) so the lowest rise together:
    returns each holder's integer share (sum = amount), the lowest levels filled first, a remainder of the integer
    division going to the lowest-loaded holders (ties: earlier holder first)."""
    order = sorted(range(len(levels)), key=lambda i: (levels[i], i))
    total, k = amount, 0
    for k in range(1, len(order) + 1):
        total = amount + sum(levels[i] for i in order[:k])
        if k == len(order) or total // k <= levels[order[k]]:
            break
    base, rem = divmod(total, k)
    shares = [0] * len(levels)
    for j, i in enumerate(order[:k]):
        shares[i] = base - levels[i] + (1 if j < rem else 0)
    return shares


def split_loads(load_E: list[int], ep: int, replicas: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Each expert's shares over its holders (home, then copies in increasing rank) and the resulting integer load
    per rank. Experts without copies stay home; the replicated ones are water-filled on top, heaviest first (ties:
    lower index), so each lands where the ranks are lowest at its turn."""
    E = len(load_E)
    El = E // ep
    rank_load = [0] * ep
    holders = {e: [e // El] for e in range(E)}
    for r, reps in enumerate(replicas):
        for e in reps:
            holders[e].append(r)
    for e in holders:
        holders[e] = [holders[e][0]] + sorted(holders[e][1:])
    shares: list[tuple[int, ...]] = [(1,)] * E
    for e in range(E):
        if len(holders[e]) == 1:
            rank_load[holders[e][0]] += load_E[e]
    for e in sorted((e for e in range(E) if len(holders[e]) > 1), key=lambda e: (-load_E[e], e)):
        s = water_fill(load_E[e], [rank_load[r] for r in holders[e]])
        for r, x in zip(holders[e], s):
            rank_load[r] += x
        # An expert with no load yet still needs a valid split: an even one.
        shares[e] = tuple(s) if load_E[e] > 0 else (1,) * len(s)
    return shares, rank_load


def plan_replicas(load_E: list[int], ep: int, slots: int) -> ReplicaPlacement:
    """The greedy placement of the module docstring for one MoE layer.

    Args:
        load_E: token-expert assignments per expert over the last window, summed over all ranks (ints >= 0).
        ep: EP ranks (must divide len(load_E)).
        slots: replica slots per rank (>= 0).

    Returns:
        A :class:`ReplicaPlacement`; a function of the arguments alone (integer arithmetic, fixed tie-breaks).

    Raises:
        ValueError: ep does not divide the experts, or a negative load or slot count.
    """
    E = len(load_E)
    if ep < 1 or E % ep:
        raise ValueError(f"ep={ep} must divide the {E} experts")
    if slots < 0 or any(x < 0 for x in load_E):
        raise ValueError(f"slots={slots} and loads must be >= 0")
    load_E = [int(x) for x in load_E]
    replicas: list[list[int]] = [[] for _ in range(ep)]
    shares, rank_load = split_loads(load_E, ep, replicas)
    El = E // ep
    while True:
        heaviest = max(range(ep), key=lambda r: (rank_load[r], -r))
        best = max(rank_load)
        # What each expert puts on the heaviest rank.
        on_heavy = []
        for e in range(E):
            hs = [e // El] + sorted(r for r in range(ep) if e in replicas[r])
            if heaviest in hs and load_E[e] > 0:
                total = sum(shares[e])
                on_heavy.append((-load_E[e] * shares[e][hs.index(heaviest)] / total, e, hs))
        placed = False
        for _, e, hs in sorted(on_heavy):
            free = [r for r in range(ep) if len(replicas[r]) < slots and r not in hs]
            if not free:
                continue
            target = min(free, key=lambda r: (rank_load[r], r))
            trial = [list(x) for x in replicas]
            trial[target].append(e)
            t_shares, t_load = split_loads(load_E, ep, trial)
            if max(t_load) < best - MIN_GAIN * sum(load_E) / ep:
                replicas, shares, rank_load, placed = trial, t_shares, t_load, True
            break
        if not placed:
            break
    return ReplicaPlacement(E, ep, slots, tuple(tuple(x) for x in replicas), tuple(shares))
