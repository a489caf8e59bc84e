"""Expert-parallel token dispatcher: dropless uneven all-to-all over ``torch.distributed``.

Two paths behind one :class:`AllToAllDispatcher`, both with the :class:`moetrain.model.moe.Dispatcher` interface.

**Deduplicated** (the default when dropless; ``ParallelConfig.dedup``). A token whose top-k experts include several
on the same EP rank crosses the wire once to that rank, not once per expert -- the idea of DeepSeek's DeepEP
(``Buffer.get_dispatch_layout`` -> ``is_token_in_rank``) and of Megatron-Core's flex token dispatcher
(``MoEFlexTokenDispatcher``, over DeepEP or HybridEP). With top-6 of 32 experts over EP = 2 and uniform routing
a token has 6 assignments, 3 of them on the other rank on average, but reaches the other rank with one row
(probability 0.99): ~3x fewer cross-rank rows::

    dispatch:  mark the (rank, token) pairs where the token has at least one expert on that rank
               all-to-all one count matrix per rank pair: [rows, assignments per local expert]   <- the one host sync
               all-to-all each row's gate weights (fp32, differentiable) and local expert ids (async)
               all-to-all the rows, one per (token, destination rank) (async)   ... shared experts run meanwhile
               expand received rows to their local experts, grouped by local expert
    experts:   grouped GEMM over El experts
    combine:   gate-weight in fp32 and sum each row's local expert outputs (one row per token and rank), cast to
               the expert output dtype, all-to-all back (async), sum each token's rows over ranks in fp32

**Per assignment** (``dedup=False``, and always in capacity mode: dropping and padding are per expert)::

    dispatch:  permute rows by global expert id (grouped by destination rank, then local expert)
               all-to-all the per-expert counts                      <- host sync (splits must be python ints)
               all-to-all the rows (async)                           ... shared experts run meanwhile
               regroup received rows from (source, local expert) to (local expert, source) order
    experts:   grouped GEMM over El experts
    combine:   undo the regroup, all-to-all back (async, splits swapped), unpermute, gate-weight in fp32, sum per token

Both paths give the experts the same rows in the same order (grouped by local expert, then source rank, then
token); the deduplicated path sums a token's gate-weighted expert outputs in two stages (per rank, then over ranks)
instead of one, so results agree to fp32 round-off (and, under bf16 autocast, to one bf16 rounding of each per-rank
partial sum, as with DeepEP's bf16 combine).

Host-device synchronisations, and why they are unavoidable: the split sizes of the token all-to-all must be known
on the host (one ``tolist()`` of the exchanged count matrix per dispatch); in capacity mode the number of kept rows
is read once. Everything else stays on the device: the deduplicated path selects its rows with a stable sort whose
first entries are the selected ones (their number comes from the same ``tolist()``) rather than ``nonzero()``, whose
output size would be a second sync. The grouped GEMM needs no host counts when ``torch._grouped_mm`` is available.

Gate weights: in the per-assignment path they never travel (expert outputs come back unweighted and are weighted at
the source in fp32). In the deduplicated path they must travel, since a rank sends back one summed row per token:
they go with the rows through the differentiable all-to-all, so the router's gradient comes back the same way.

FP8 dispatch (``dispatch_dtype="fp8"``): the token rows of either path are quantised to E4M3 in 1x128 tiles before
their all-to-all and travel as FP8 bytes plus fp32 scales (D + 4 ceil(D / 128) bytes a row instead of 2 D in BF16);
the destination dequantises them before the experts. The gradient of the dispatch goes back in high precision,
as the combine does (straight-through: the quantisation's gradient is taken as the identity). ``stats.bytes_sent``
counts the row payload sent (values and scales; gate weights, expert ids and counts are not included).

Shape legend: T tokens, D dim, K top-k, E all experts, El local experts, R = EP ranks, C = El + 1 count columns,
S rows sent, N rows received, A local assignments (rows after expansion at the destination).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from moetrain.model.moe import (CapacityConfig, DispatchStats, PermuteState, capacity_keep_mask, pad_to_capacity,
                                permute, unpermute)
from moetrain.model.experts import ExpertReplicas
from moetrain.model.phases import carry, current_tape
from moetrain.parallel.comm import Pending, all_to_all, all_to_all_counts, issue
from moetrain.parallel.hang import in_phase
from moetrain.parallel.imbalance import ExpertTimer
from moetrain.precision.quant import FP8_DTYPE, Quantized, quantise

#: Wire formats of the dispatched token rows (``parallel.dispatch_dtype``): "bf16" sends the rows in the
#: activations' own dtype (BF16 under GPU mixed precision); "fp8" sends E4M3 values with one fp32 scale per 1x128
#: tile of each row (DeepSeek-V3 sec. 3.3.3, docs/reference.md section 13) and dequantises them on arrival. The
#: combine and every gradient all-to-all stay in high precision.
DISPATCH_DTYPES = ("bf16", "fp8")
#: Tile of the FP8 dispatch: one scale per 128 elements of a row.
FP8_DISPATCH_TILE = (1, 128)


# ----------------------------------------------------------------------------------------------------------------
# Per-assignment path
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class _A2AState:
    permute_state: PermuteState
    send_splits: list[int]
    recv_splits: list[int]
    regroup_N: torch.Tensor  # received row -> position in local-expert order
    pad_slots: torch.Tensor | None
    out_dtype: torch.dtype
    dropped: torch.Tensor | int = 0
    weight_later: Any = None  # getter of permute_state.row_weight_S, read at the combine (moetrain.model.phases)


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
        return self.owner.expert_timer.start(x_local), tokens_per_local_expert, self.state


class _CombineHandle:
    def __init__(self, rows_S: torch.Tensor, pending: Pending, state: _A2AState):
        self.rows_S, self.pending, self.state = rows_S, pending, state

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        ps = self.state.permute_state
        if self.state.weight_later is not None:
            ps.row_weight_S = self.state.weight_later()
        return unpermute(self.rows_S, ps, self.state.out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Deduplicated path
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class _DedupState:
    """Bookkeeping of one deduplicated dispatch, from both ends.

    Source side: ``token_S`` (token of each sent row; rows grouped by destination rank, token order within one),
    ``n_tokens`` (T), ``out_dtype``. Destination side: ``row_A`` (received row of each local assignment,
    assignments grouped by local expert), ``weight_A`` (its fp32 gate weight, attached to the autograd graph),
    ``n_recv`` (N). Splits as sent (``send_splits``) and received (``recv_splits``) in the dispatch.
    """

    token_S: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    n_tokens: int
    out_dtype: torch.dtype
    row_A: torch.Tensor | None = None
    weight_A: torch.Tensor | None = None
    n_recv: int = 0
    dropped: int = 0  # dropless: nothing is dropped


class _DedupDispatchHandle:
    def __init__(self, rows_ND: torch.Tensor, weight_NK: torch.Tensor, local_NK: torch.Tensor,
                 pendings: list[Pending], recv_counts_RC: torch.Tensor, n_assign: int, state: _DedupState,
                 expert_timer: ExpertTimer):
        self.rows_ND, self.weight_NK, self.local_NK, self.pendings = rows_ND, weight_NK, local_NK, pendings
        self.expert_timer = expert_timer
        self.recv_counts_RC, self.n_assign, self.state = recv_counts_RC, n_assign, state

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, _DedupState]:
        # In issue order: the small metadata transfers finished before the rows, so waiting on them first blocks
        # for nothing and their timers do not span the rows' transfer.
        for p in self.pendings:
            p.wait()
        K = self.local_NK.shape[1]
        # Expand every received row to its local experts. A stable sort of the (row, slot) local expert ids puts the
        # A real assignments first (slots for experts elsewhere carry id El, sorted last), grouped by local expert
        # and, within an expert, in (source rank, token) order: the order of the per-assignment path. A is known on
        # the host from the count exchange, so the slice costs no sync.
        order_A = torch.argsort(self.local_NK.reshape(-1), stable=True)[:self.n_assign]
        row_A = order_A // K
        st = self.state
        st.row_A, st.weight_A, st.n_recv = row_A, self.weight_NK.reshape(-1)[order_A], self.rows_ND.shape[0]
        tokens_per_local_expert_El = self.recv_counts_RC[:, 1:].sum(dim=0)
        return self.expert_timer.start(self.rows_ND[row_A]), tokens_per_local_expert_El, st


class _DedupCombineHandle:
    def __init__(self, rows_SD: torch.Tensor, pending: Pending, state: _DedupState):
        self.rows_SD, self.pending, self.state = rows_SD, pending, state

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        st = self.state
        # Each token got one partial sum per rank holding any of its experts: add them in fp32.
        out_TD = self.rows_SD.new_zeros(st.n_tokens, self.rows_SD.shape[-1], dtype=torch.float32)
        out_TD.index_add_(0, st.token_S, self.rows_SD.float())
        return out_TD.to(st.out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# FP8 rows on the wire
# ----------------------------------------------------------------------------------------------------------------

class _Fp8Pending:
    """The two in-flight all-to-alls of FP8 rows (values, scales); ``wait()`` also dequantises the received rows
    into the output buffer the dispatch returned."""

    def __init__(self, values: Pending, scales: Pending, recv_u8: torch.Tensor, recv_scale: torch.Tensor,
                 out: torch.Tensor):
        self.values, self.scales, self.recv_u8, self.recv_scale, self.out = values, scales, recv_u8, recv_scale, out
        self.waited = False

    def wait(self, exposed_from_issue: bool = False) -> None:
        if self.waited:
            return
        self.values.wait(exposed_from_issue)
        self.scales.wait(exposed_from_issue)
        q = Quantized(self.recv_u8.view(FP8_DTYPE), self.recv_scale, FP8_DISPATCH_TILE, "fp32")
        with torch.no_grad():
            self.out.copy_(q.dequantise(self.out.dtype))
        self.waited = True


class _Fp8AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows quantised to FP8 (1x128 tiles, fp32 scales), dequantised on arrival into x's
    dtype. Backward: the reverse all-to-all of the gradient in its own dtype (straight-through the quantisation)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, box: list,
                phase: str, stats: Any) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.phase, ctx.stats = group, out_splits, in_splits, phase, stats
        q = quantise(x.detach(), FP8_DISPATCH_TILE, "fp32")
        # As bytes: not every backend's all-to-all takes float8 tensors.
        send_u8, send_scale = q.data.view(torch.uint8).contiguous(), q.scale.contiguous()
        N = sum(out_splits)
        recv_u8 = send_u8.new_empty((N,) + tuple(send_u8.shape[1:]))
        recv_scale = send_scale.new_empty((N,) + tuple(send_scale.shape[1:]))
        pendings = []
        for recv, send, name in ((recv_u8, send_u8, phase), (recv_scale, send_scale, f"{phase} (FP8 scales)")):
            pendings.append(issue(lambda r=recv, s=send: dist.all_to_all_single(r, s, out_splits, in_splits,
                                                                                group=group, async_op=True),
                                  name, stats, x.device, keep=(send, recv)))
        out = x.new_empty((N,) + tuple(x.shape[1:]))
        box.append(_Fp8Pending(pendings[0], pendings[1], recv_u8, recv_scale, out))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        out, pending = all_to_all(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group,
                                  f"{ctx.phase} backward", ctx.stats)
        pending.wait(exposed_from_issue=True)
        return out, None, None, None, None, None, None


def fp8_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, phase: str,
                   stats: Any = None) -> tuple[torch.Tensor, _Fp8Pending]:
    """Start an uneven all-to-all of the rows of ``x`` (S, D) in FP8; returns (output (N, D) in x's dtype, pending).
    Read the output only after ``pending.wait()``. Differentiable (straight-through). Raises CollectiveError."""
    box: list[_Fp8Pending] = []
    out = _Fp8AllToAll.apply(x, out_splits, in_splits, group, box, phase, stats)
    return out, box[0]


def row_wire_bytes(n_cols: int, dtype: torch.dtype, dispatch_dtype: str) -> int:
    """Bytes one dispatched row of ``n_cols`` elements puts on the wire: values (+ fp32 scales under "fp8")."""
    if dispatch_dtype == "fp8":
        return n_cols + 4 * -(-n_cols // FP8_DISPATCH_TILE[1])
    return n_cols * dtype.itemsize


# ----------------------------------------------------------------------------------------------------------------
# The dispatcher
# ----------------------------------------------------------------------------------------------------------------

class AllToAllDispatcher:
    """Dropless (or capacity-limited) expert-parallel dispatcher. See the module docstring for both flows.

    Args:
        n_experts: E (all routed experts).
        ep_size: R; rank ``ep_rank`` of the EP group holds experts [ep_rank*El, (ep_rank+1)*El).
        ep_rank: this rank's index in the EP group.
        group: the EP process group.
        capacity: dropping/padding policy (default dropless).
        overlap: if False, every all-to-all is waited for as soon as it is issued (nothing overlaps it).
        dedup: send a token once per destination rank rather than once per expert (DeepEP / Megatron flex
            dispatcher). Applies in dropless mode only; with a capacity factor the per-assignment path runs, since
            dropping and padding act on single assignments. ``self.dedup`` says which path runs.
        dispatch_dtype: wire format of the dispatched rows, one of ``DISPATCH_DTYPES`` ("fp8": E4M3 + 1x128 fp32
            scales, see the module docstring).

    Raises:
        ValueError: EP size not dividing the experts, or an unknown ``dispatch_dtype``.
    """

    #: ``all_to_all_single`` calls of one MoE layer, (forward, backward), on the token-dedup path: forward = the
    #: tokens-per-expert counts, gate weights, local expert ids, token rows, combine; backward = the gradients of
    #: the token rows, gate weights and combine (expert ids carry none). Counted on a real run in
    #: tests/parallel/test_dedup_dispatch.py; the performance model charges one call latency each for local runs.
    CALLS_DEDUP = (5, 3)
    #: The same for the per-assignment path: counts, token rows, combine | token rows, combine.
    CALLS_PER_ASSIGNMENT = (3, 2)

    def __init__(self, n_experts: int, ep_size: int, ep_rank: int, group: Any,
                 capacity: CapacityConfig | None = None, overlap: bool = True, dedup: bool = True,
                 dispatch_dtype: str = "bf16"):
        if n_experts % ep_size:
            raise ValueError(f"EP size {ep_size} must divide the number of experts {n_experts}")
        if dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_dtype={dispatch_dtype!r}; allowed: {', '.join(DISPATCH_DTYPES)}")
        self.dispatch_dtype = dispatch_dtype
        self.n_experts, self.ep_size, self.ep_rank, self.group = n_experts, ep_size, ep_rank, group
        self.n_local_experts = n_experts // ep_size
        self.local_expert_offset = ep_rank * self.n_local_experts
        self.capacity = capacity or CapacityConfig()
        self.overlap = overlap
        self.dedup = dedup and self.capacity.factor is None
        self.stats = DispatchStats(layer=0)
        # Rows and compute time of this rank's experts, for the imbalance telemetry (moetrain.parallel.imbalance).
        self.expert_timer = ExpertTimer(self.stats)
        # Redundant experts (``moetrain.parallel.redundant``): tokens go to (rank, slot) pairs, El + R slots a rank.
        self.replicas: ExpertReplicas | None = None

    def _slots(self, topk_idx_TK: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(destination slot of every assignment (T, K), slots over all ranks, slots per rank): the expert ids,
        E and El without redundant experts; with them, the holder slot each assignment goes to (``route``), and
        EP x (El + R), El + R."""
        if self.replicas is None:
            return topk_idx_TK, self.n_experts, self.n_local_experts
        C = self.n_local_experts + self.replicas.slots
        return self.replicas.route(topk_idx_TK), self.ep_size * C, C

    @property
    def layer(self) -> int:
        """Global MoE index of this layer (set by parallelize), for phase labels; kept in ``stats``."""
        return self.stats.layer or 0

    @layer.setter
    def layer(self, index: int) -> None:
        self.stats.layer = index

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                 meanwhile: Callable[[], Any] | None = None) -> _DispatchHandle | _DedupDispatchHandle:
        """Start the dispatch (see the module docstring); ``meanwhile`` runs while the count exchange is in
        flight (the one exchange the rows wait for)."""
        if self.dedup:
            return self._dispatch_dedup(x_TD, topk_idx_TK, topk_weight_TK, meanwhile)
        topk_idx_TK, E, El = self._slots(topk_idx_TK)
        R = self.ep_size
        keep_TK, capacity = capacity_keep_mask(topk_idx_TK, topk_weight_TK, E, self.capacity)
        x_SD, counts_E, pstate = permute(x_TD, topk_idx_TK, topk_weight_TK, E, keep_TK)
        x_later, weight_later = carry(x_SD), carry(pstate.row_weight_S)  # read after the count exchange
        send_counts_RE = counts_E.view(R, El)
        with in_phase(f"dispatch (counts), MoE layer {self.layer}"):
            recv_counts_RE = self._exchange_counts(send_counts_RE, meanwhile)
            splits = torch.stack([send_counts_RE.sum(dim=1), recv_counts_RE.sum(dim=1)]).tolist()  # host sync #1
        send_splits, recv_splits = splits
        rows_N, pending = self._all_to_all(x_later(), recv_splits, send_splits, "dispatch", rows=True)
        regroup_N = _regroup_index(recv_counts_RE, sum(recv_splits))
        self._count_rows(send_splits, x_SD)
        state = _A2AState(pstate, send_splits, recv_splits, regroup_N, None, x_TD.dtype,
                          (~keep_TK).sum() if keep_TK is not None else 0, weight_later)
        self._boundary("dispatch")
        return _DispatchHandle(self, rows_N, pending, state, recv_counts_RE, capacity)

    def combine(self, y_local: torch.Tensor, state: _A2AState | _DedupState
                ) -> _CombineHandle | _DedupCombineHandle:
        y_local = self.expert_timer.stop(y_local)
        if isinstance(state, _DedupState):
            return self._combine_dedup(y_local, state)
        if state.pad_slots is not None:
            y_local = y_local[state.pad_slots]
        # Back from local-expert order to (source rank, local expert) order, then home.
        inverse_N = torch.empty_like(state.regroup_N)
        inverse_N[state.regroup_N] = torch.arange(state.regroup_N.numel(), device=state.regroup_N.device)
        rows_N = y_local[inverse_N]
        rows_S, pending = self._all_to_all(rows_N, state.send_splits, state.recv_splits, "combine")
        self._boundary("combine")
        return _CombineHandle(rows_S, pending, state)

    # -- deduplicated path ---------------------------------------------------------------------------------------

    def _dispatch_dedup(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                        meanwhile: Callable[[], Any] | None = None) -> _DedupDispatchHandle:
        """Send each token once to every rank holding at least one of its experts, with the gate weights and local
        expert ids of the experts it has there. x_TD (T, D), topk_idx_TK (T, K) int64, topk_weight_TK (T, K) fp32."""
        topk_idx_TK, E, El = self._slots(topk_idx_TK)
        R = self.ep_size
        T, K = topk_idx_TK.shape
        dev = topk_idx_TK.device
        x_later, weight_later = carry(x_TD), carry(topk_weight_TK)  # read after the count exchange
        # mask_RT[r, t]: token t has at least one expert on rank r, so it sends rank r one row.
        mask_RT = torch.zeros(R, T, dtype=torch.bool, device=dev)
        mask_RT.scatter_(0, (topk_idx_TK // El).t(), True)
        # One count matrix per rank pair, (R, C): column 0 the rows, columns 1.. the assignments per local expert.
        # Rows size the all-to-alls, assignments size the expansion at the destination and feed the grouped GEMM;
        # carrying both in one exchange keeps a single host sync per dispatch.
        # (scatter_add rather than bincount: CUDA's bincount reads the input's max on the host, a sync.)
        assign_E = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(
            0, topk_idx_TK.reshape(-1), torch.ones(T * K, dtype=torch.int64, device=dev))
        counts_RC = torch.cat([mask_RT.sum(dim=1, keepdim=True), assign_E.view(R, El)], dim=1)
        # A hang in the exchange stops the host at this sync on NCCL (on gloo in its wait): the phase it names.
        with in_phase(f"dispatch (counts), MoE layer {self.layer}"):
            recv_counts_RC = self._exchange_counts(counts_RC, meanwhile)
            send_splits, recv_splits, recv_assign = torch.stack(
                [counts_RC[:, 0], recv_counts_RC[:, 0], recv_counts_RC[:, 1:].sum(dim=1)]).tolist()  # the host sync
        S = sum(send_splits)
        # Rows in (destination rank, token) order without nonzero(): a stable sort of the negated mask puts the S
        # selected pairs first, in their original rank-major order; S is already on the host.
        pair_S = torch.argsort((~mask_RT).reshape(-1).to(torch.uint8), stable=True)[:S]
        dest_S = pair_S // T
        token_S = pair_S - dest_S * T
        # Per row and top-k slot: the expert's id on the destination rank, or El where it lives on another rank
        # (El sorts last in the expansion); the gate weight, or 0 there (never read: the expansion drops the slot).
        local_SK = topk_idx_TK[token_S] - (dest_S * El).unsqueeze(1)
        on_dest_SK = (local_SK >= 0) & (local_SK < El)
        local_SK = torch.where(on_dest_SK, local_SK, El).to(torch.int32)
        weight_SK = torch.where(on_dest_SK, weight_later()[token_S].float(), 0.0)
        x_SD = x_later()[token_S]
        # Metadata first (tiny): it completes before the rows, so overlapping it costs nothing and its timers do not
        # include the rows' transfer. The weights go through the differentiable all-to-all: the router's gradient
        # comes back through its backward.
        weight_NK, pend_w = self._all_to_all(weight_SK, recv_splits, send_splits, "dispatch (gate weights)")
        local_NK, pend_l = self._all_to_all(local_SK, recv_splits, send_splits, "dispatch (expert ids)")
        rows_ND, pend_x = self._all_to_all(x_SD, recv_splits, send_splits, "dispatch", rows=True)
        self._count_rows(send_splits, x_SD)
        state = _DedupState(token_S, send_splits, recv_splits, T, x_TD.dtype)
        self._boundary("dispatch")
        return _DedupDispatchHandle(rows_ND, weight_NK, local_NK, [pend_w, pend_l, pend_x], recv_counts_RC,
                                    sum(recv_assign), state, self.expert_timer)

    def _combine_dedup(self, y_AD: torch.Tensor, state: _DedupState) -> _DedupCombineHandle:
        """Gate-weight every local assignment's output and sum them per received row, so each (token, rank) pair
        sends one row back. y_AD (A, D): expert outputs in the order ``wait()`` gave the inputs."""
        assert state.row_A is not None and state.weight_A is not None, "combine before the dispatch was waited for"
        # fp32 accumulation as in the per-assignment path; one cast to the expert output dtype for the wire.
        y32_AD = y_AD.float() * state.weight_A.unsqueeze(-1)
        rows_ND = y32_AD.new_zeros(state.n_recv, y_AD.shape[-1]).index_add_(0, state.row_A, y32_AD).to(y_AD.dtype)
        rows_SD, pending = self._all_to_all(rows_ND, state.send_splits, state.recv_splits, "combine")
        self._boundary("combine")
        return _DedupCombineHandle(rows_SD, pending, state)

    def _exchange_counts(self, counts: torch.Tensor, meanwhile: Callable[[], Any] | None) -> torch.Tensor:
        """The count exchange the token rows wait for (its result sizes their all-to-all); ``meanwhile`` runs while
        it is in flight. Under a phase tape the exchange also ends a segment, so the paired micro-batch's backward
        step hides it (a latency-bound transfer the shared experts alone would not cover)."""
        if current_tape() is None:
            return all_to_all_counts(counts, self.group, "dispatch (counts)", self.stats, meanwhile)

        def then() -> None:
            self._boundary("counts")
            if meanwhile is not None:
                meanwhile()
        return all_to_all_counts(counts, self.group, "dispatch (counts)", self.stats, then)

    def _all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], phase: str,
                    rows: bool = False) -> tuple[torch.Tensor, Pending | _Fp8Pending]:
        """Start one named all-to-all on the EP group; with overlap off, wait for it at once (all of it exposed).
        ``rows``: the dispatched token rows, which travel in ``dispatch_dtype``.

        While a phase tape records (EP overlap across micro-batches, ``moetrain.model.phases``), the all-to-all is
        issued outside autograd and recorded on the tape with its reverse, which the tape issues asynchronously
        when its backward reaches this point."""
        tape = current_tape()
        src = x
        if tape is not None:
            x = x.detach()
        if rows and self.dispatch_dtype == "fp8":
            out, pending = fp8_all_to_all(x, out_splits, in_splits, self.group, phase, self.stats)
        else:
            out, pending = all_to_all(x, out_splits, in_splits, self.group, phase, self.stats)
        if tape is not None and src.requires_grad:
            group, stats = self.group, self.stats

            def reverse(grad: torch.Tensor) -> tuple[torch.Tensor, Pending]:
                # Straight-through for FP8 rows: the gradient goes back in its own dtype.
                return all_to_all(grad.contiguous(), in_splits, out_splits, group, f"{phase} backward", stats)
            out = tape.comm(src, out, reverse, phase)
        if not self.overlap:
            pending.wait(exposed_from_issue=True)
        return out, pending

    def _boundary(self, phase: str) -> None:
        """The all-to-alls of ``phase`` are issued: under a phase tape this ends a segment (the paired micro-batch
        runs a backward step while they are in flight)."""
        tape = current_tape()
        if tape is not None:
            tape.boundary(f"layer{self.layer} {phase}")

    def _count_rows(self, send_splits: list[int], x_SD: torch.Tensor) -> None:
        if not self.stats.recording:
            return
        self.stats.calls += 1
        self.stats.rows_sent += sum(send_splits)
        self.stats.remote_rows_sent += sum(send_splits) - send_splits[self.ep_rank]
        row = row_wire_bytes(x_SD.shape[-1], x_SD.dtype, self.dispatch_dtype)
        self.stats.bytes_sent += row * sum(send_splits)
        self.stats.remote_bytes_sent += row * (sum(send_splits) - send_splits[self.ep_rank])


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
