"""Expert-parallel token dispatcher: dropless uneven all-to-all over ``torch.distributed``.

The flow for one micro-batch (or chunk) on one rank, EP ranks each holding El = E/EP experts::

    dispatch:  permute rows by global expert id (grouped by destination rank, then local expert)
               all-to-all the per-expert counts                      <- host sync #1 (splits must be python ints)
               all-to-all the rows (async)                           ... shared experts run meanwhile
               regroup received rows from (source, local expert) to (local expert, source) order
    experts:   grouped GEMM over El experts
    combine:   undo the regroup, all-to-all back (async, splits swapped), unpermute, gate-weight in fp32, sum per token

Host-device synchronisations, and why they are unavoidable: the split sizes of the token all-to-all must be known
on the host (one ``tolist()`` of the exchanged count matrix per dispatch); in capacity mode the number of kept rows
is read once. Everything else stays on the device. The grouped GEMM needs no host counts when
``torch._grouped_mm`` is available.

Gate weights never travel: expert outputs come back unweighted and are weighted at the source in fp32, so the
router's gradient is computed locally.

Shape legend: T tokens, D dim, K top-k, E all experts, El local experts, R = EP ranks, S rows sent, N rows received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetrain.model.moe import (CapacityConfig, DispatchStats, PermuteState, capacity_keep_mask, pad_to_capacity,
                                permute, unpermute)
from moetrain.parallel.comm import Pending, all_to_all, all_to_all_counts


@dataclass
class _A2AState:
    permute_state: PermuteState
    send_splits: list[int]
    recv_splits: list[int]
    regroup_N: torch.Tensor  # received row -> position in local-expert order
    pad_slots: torch.Tensor | None
    out_dtype: torch.dtype
    dropped: torch.Tensor | int = 0


class _DispatchHandle:
    def __init__(self, owner: "AllToAllDispatcher", rows_N: torch.Tensor, pending: Pending, state: _A2AState,
                 recv_counts_RE: torch.Tensor, capacity: int):
        self.owner, self.rows_N, self.pending, self.state = owner, rows_N, pending, state
        self.recv_counts_RE, self.capacity = recv_counts_RE, capacity

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, _A2AState]:
        self.pending.wait()
        x_local = self.rows_N[self.state.regroup_N]
        tokens_per_local_expert = self.recv_counts_RE.sum(dim=0)
        if self.owner.capacity.pad and self.capacity:
            # A local expert can receive up to `capacity` rows from each of the R source ranks.
            x_local, tokens_per_local_expert, self.state.pad_slots = pad_to_capacity(
                x_local, tokens_per_local_expert, self.capacity * self.owner.ep_size)
        return x_local, tokens_per_local_expert, self.state


class _CombineHandle:
    def __init__(self, rows_S: torch.Tensor, pending: Pending, state: _A2AState):
        self.rows_S, self.pending, self.state = rows_S, pending, state

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        return unpermute(self.rows_S, self.state.permute_state, self.state.out_dtype)


class AllToAllDispatcher:
    """Dropless (or capacity-limited) expert-parallel dispatcher. See the module docstring for the flow.

    Args:
        n_experts: E (all routed experts).
        ep_size: R; rank ``ep_rank`` of the EP group holds experts [ep_rank*El, (ep_rank+1)*El).
        ep_rank: this rank's index in the EP group.
        group: the EP process group.
        capacity: dropping/padding policy (default dropless).
        overlap: if False, every all-to-all is waited for as soon as it is issued (nothing overlaps it).
    """

    def __init__(self, n_experts: int, ep_size: int, ep_rank: int, group: Any,
                 capacity: CapacityConfig | None = None, overlap: bool = True):
        if n_experts % ep_size:
            raise ValueError(f"EP size {ep_size} must divide the number of experts {n_experts}")
        self.n_experts, self.ep_size, self.ep_rank, self.group = n_experts, ep_size, ep_rank, group
        self.n_local_experts = n_experts // ep_size
        self.local_expert_offset = ep_rank * self.n_local_experts
        self.capacity = capacity or CapacityConfig()
        self.overlap = overlap
        self.stats = DispatchStats()

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor
                 ) -> _DispatchHandle:
        R, El = self.ep_size, self.n_local_experts
        keep_TK, capacity = capacity_keep_mask(topk_idx_TK, topk_weight_TK, self.n_experts, self.capacity)
        x_SD, counts_E, pstate = permute(x_TD, topk_idx_TK, topk_weight_TK, self.n_experts, keep_TK)
        send_counts_RE = counts_E.view(R, El)
        recv_counts_RE = all_to_all_counts(send_counts_RE, self.group, "dispatch (counts)", self.stats)
        splits = torch.stack([send_counts_RE.sum(dim=1), recv_counts_RE.sum(dim=1)]).tolist()  # host sync #1
        send_splits, recv_splits = splits
        rows_N, pending = all_to_all(x_SD, recv_splits, send_splits, self.group, "dispatch", self.stats)
        if not self.overlap:
            pending.wait(exposed_from_issue=True)
        regroup_N = _regroup_index(recv_counts_RE, sum(recv_splits))
        self.stats.calls += 1
        state = _A2AState(pstate, send_splits, recv_splits, regroup_N, None, x_TD.dtype,
                          (~keep_TK).sum() if keep_TK is not None else 0)
        return _DispatchHandle(self, rows_N, pending, state, recv_counts_RE, capacity)

    def combine(self, y_local: torch.Tensor, state: _A2AState) -> _CombineHandle:
        if state.pad_slots is not None:
            y_local = y_local[state.pad_slots]
        # Back from local-expert order to (source rank, local expert) order, then home.
        inverse_N = torch.empty_like(state.regroup_N)
        inverse_N[state.regroup_N] = torch.arange(state.regroup_N.numel(), device=state.regroup_N.device)
        rows_N = y_local[inverse_N]
        rows_S, pending = all_to_all(rows_N, state.send_splits, state.recv_splits, self.group, "combine", self.stats)
        if not self.overlap:
            pending.wait(exposed_from_issue=True)
        return _CombineHandle(rows_S, pending, state)


def _regroup_index(recv_counts_RE: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Index that reorders received rows from (source rank, local expert) order to (local expert, source) order.

    Row j of the result is the received row placed j-th when rows are grouped by local expert. No host sync:
    ``n_rows`` is already on the host (sum of the receive splits).
    """
    R, El = recv_counts_RE.shape
    dev = recv_counts_RE.device
    starts_RE = (recv_counts_RE.flatten().cumsum(0) - recv_counts_RE.flatten()).view(R, El)
    counts_ER = recv_counts_RE.t().flatten()
    starts_ER = starts_RE.t().flatten()
    seg_N = torch.repeat_interleave(torch.arange(R * El, device=dev), counts_ER, output_size=n_rows)
    seg_start_in_target = counts_ER.cumsum(0) - counts_ER
    return starts_ER[seg_N] + (torch.arange(n_rows, device=dev) - seg_start_in_target[seg_N])
