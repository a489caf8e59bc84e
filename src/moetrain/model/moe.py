"""Mixture-of-Experts layer: router, token dispatch (local permutation), shared experts; the routed experts'
grouped GEMMs are in :mod:`moetrain.model.experts`.

The router decides, the dispatcher moves, the experts compute. This file is single-device code: it knows nothing
about processes. :class:`LocalDispatcher` is the EP = 1 permutation; ``moetrain.parallel.dispatch`` provides the
all-to-all dispatcher with the same interface, plugged in from outside by ``parallelize``.

Shape legend (suffixes on tensor names):
    B batch, L sequence length, T tokens (= B*L), D model dim, E routed experts (all), El experts held locally,
    K top-k, F expert FFN dim, G expert groups, S dispatched rows (token-expert assignments after dropping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.layout import RecomputeModule
from moetrain.model.config_base import BalanceLoss, ModelConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.layers import SwiGLU
from moetrain.model.phases import carry, current_tape
from moetrain.model.recompute import Recomputable, checkpointed

DropPolicy = Literal["probs", "position"]


# ----------------------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class RouterOutput:
    """What the router decided for T tokens.

    Attributes:
        topk_idx_TK: selected expert ids (int64).
        topk_weight_TK: gate weights, fp32, computed from the *unbiased* scores (normalised and scaled as configured).
        scores_TE: fp32 affinity scores (sigmoid or softmax of the logits), used by the balance loss.
    """

    topk_idx_TK: torch.Tensor
    topk_weight_TK: torch.Tensor
    scores_TE: torch.Tensor


class Router(nn.Module):
    """DeepSeek-V3 gate: fp32 scores, group-limited top-k, auxiliary-loss-free bias (arXiv 2412.19437, sec. 2.1.2).

    The ``expert_bias`` buffer (HF ``e_score_correction_bias``) is added to the scores only to *select* experts; gate
    weights use the unbiased scores. With ``n_expert_groups > 1``, a group is scored by the sum of its top-2 biased
    scores and only the best ``n_limited_groups`` groups are eligible; with :attr:`node_limit`, only the experts of
    the best M nodes (:func:`node_limited`). ``routing="balanced"`` replaces the selection
    with a round-robin one (every expert gets the same number of tokens) for benchmarks, as the published records do;
    the gate weights still come from the scores so the router keeps receiving gradients.

    forward(x_TD) -> RouterOutput.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.top_k
        self.n_groups = cfg.n_expert_groups
        self.n_limited_groups = cfg.n_limited_groups
        self.score_func = cfg.score_func
        self.norm_topk = cfg.norm_topk
        self.route_scale = cfg.route_scale
        self.routing = cfg.routing
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        #: node-limited routing, set by ``moetrain.parallel.parallelize`` from the EP placement: (N nodes holding
        #: E / N consecutive experts each, M): a token's experts lie on at most M of them; None = unlimited
        self.node_limit: tuple[int, int] | None = None

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        if self.score_func == "sigmoid":
            scores_TE = logits_TE.sigmoid()
        else:
            scores_TE = logits_TE.softmax(dim=-1)
        T = scores_TE.shape[0]
        if self.routing == "balanced":
            topk_idx_TK = balanced_assignment(T, self.top_k, self.n_experts, scores_TE.device)
        else:
            with torch.no_grad():
                choice_TE = scores_TE + self.expert_bias
                if self.n_groups > 1:
                    choice_TGe = choice_TE.view(T, self.n_groups, -1)
                    group_scores_TG = choice_TGe.topk(2, dim=-1).values.sum(dim=-1)
                    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
                    keep_TG.scatter_(1, group_scores_TG.topk(self.n_limited_groups, dim=-1).indices, True)
                    choice_TE = choice_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, -1)
                if self.node_limit is not None:
                    choice_TE = node_limited(choice_TE, *self.node_limit, self.top_k)
                topk_idx_TK = choice_TE.topk(self.top_k, dim=-1).indices
        weight_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk:
            weight_TK = weight_TK / (weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(topk_idx_TK, weight_TK * self.route_scale, scores_TE)


def node_limited(choice_TE: torch.Tensor, n_nodes: int, m: int, top_k: int) -> torch.Tensor:
    """Node-limited routing (DeepSeek-V3 report sec. 2.1.2, "node-limited routing"; its V2 predecessor's
    device-limited routing): the E experts lie on ``n_nodes`` nodes, E / n_nodes consecutive ones each (the EP
    placement); each node is scored by the sum of its ``max(1, top_k // m)`` highest selection scores ("the sum of
    the highest K_r / M affinity scores of the experts distributed on each node") and only the experts of the best
    ``m`` nodes stay eligible. Returns ``choice_TE`` (T, E) with the others set to -inf.

    Raises:
        ValueError: ``n_nodes`` does not divide E, or ``m`` not in [1, n_nodes].
    """
    T, E = choice_TE.shape
    if E % n_nodes or not 1 <= m <= n_nodes:
        raise ValueError(f"node-limited routing of {E} experts on {n_nodes} nodes with M={m}")
    if m == n_nodes:
        return choice_TE
    choice_TNe = choice_TE.view(T, n_nodes, E // n_nodes)
    per = min(max(1, top_k // m), E // n_nodes)
    node_scores_TN = choice_TNe.topk(per, dim=-1).values.sum(dim=-1)
    keep_TN = torch.zeros_like(node_scores_TN, dtype=torch.bool)
    keep_TN.scatter_(1, node_scores_TN.topk(m, dim=-1).indices, True)
    return choice_TNe.masked_fill(~keep_TN.unsqueeze(-1), float("-inf")).view(T, E)


def balanced_assignment(T: int, K: int, E: int, device: torch.device | None = None) -> torch.Tensor:
    """Round-robin routing: token t gets experts (t*K + j) mod E, j < K. Returns (T, K) int64.

    Every expert receives floor or ceil of T*K/E assignments and no token gets an expert twice (K <= E).
    """
    return (torch.arange(T * K, device=device) % E).view(T, K)


def sequence_balance_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, n_seqs: int,
                          valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-wise balance loss, summed over sequences (DeepSeek-V3 report, eqs. 17-20), without alpha.

    For each sequence of L tokens: f_i = E / (K L) * #{t : i in topk(t)}, P_i = mean_t s_{i,t} / sum_j s_{j,t},
    loss = sum_i f_i P_i. The selection counted is the final one (after group limiting and bias). Returns a scalar
    fp32 tensor: the sum over the ``n_seqs`` sequences (tokens are laid out sequence-major, T = n_seqs * L), so the
    caller can normalise by the global number of sequences. ``valid_T`` (bool): only these tokens count -- L is then
    a sequence's number of valid tokens, and a sequence without any contributes 0 (padding is not text, and the
    report's statistics are over a sequence's tokens).
    """
    T, E = scores_TE.shape
    K = topk_idx_TK.shape[1]
    L = T // n_seqs
    w_T = (torch.ones(T, device=scores_TE.device) if valid_T is None else valid_T.to(torch.float32))
    n_B = w_T.view(n_seqs, L).sum(dim=1, keepdim=True).clamp(min=1)
    sel_BE = torch.zeros(n_seqs, E, device=scores_TE.device, dtype=torch.float32)
    sel_BE.scatter_add_(1, topk_idx_TK.view(n_seqs, L * K), w_T.view(n_seqs, L, 1).expand(n_seqs, L, K)
                        .reshape(n_seqs, L * K))
    f_BE = sel_BE * (E / K) / n_B
    p_BE = (scores_TE / scores_TE.sum(dim=-1, keepdim=True) * w_T.unsqueeze(-1)).view(n_seqs, L, E).sum(dim=1) / n_B
    return (f_BE * p_BE).sum()


def batch_balance_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, n_seqs: int,
                       valid_T: torch.Tensor | None = None,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Balance loss over a whole batch (Switch Transformer eqs. 4-6, as transformers' ``load_balancing_loss_func``
    computes it for one layer), times the number of sequences it covers, without alpha.

    loss = E * sum_i f_i P_i with f_i = #{(t, k) : topk(t)_k = i} / T (the share of tokens sent to expert i; the
    f_i sum to K) and P_i = mean_t s_{i,t} / sum_j s_{j,t}, over the T counted tokens (``valid_T``; all by default).
    With ``reduce`` (a sum over the data-parallel group of the detached counts [#i..., T, sequences]) the f_i and
    the means are those of the global batch and this rank's share is returned: summed over the group, the shares
    are exactly the single-process loss of the global batch (global-batch balance, arXiv 2501.11817; gradients flow
    through this rank's scores only, the counts are constants). Returns an fp32 scalar: the loss times the batch's
    sequences (global with ``reduce``), so that dividing the sum over micro-batches and ranks by the global number
    of sequences (as the trainer does for every balance loss) gives the sequence-weighted mean of the batch losses.
    """
    T, E = scores_TE.shape
    w_T = (torch.ones(T, device=scores_TE.device) if valid_T is None else valid_T.to(torch.float32))
    K = topk_idx_TK.shape[1]
    counts_E = torch.zeros(E, device=scores_TE.device, dtype=torch.float32).scatter_add_(
        0, topk_idx_TK.reshape(-1), w_T.unsqueeze(1).expand(T, K).reshape(-1))
    p_sum_E = (scores_TE / scores_TE.sum(dim=-1, keepdim=True) * w_T.unsqueeze(-1)).sum(dim=0)
    stats = torch.cat([counts_E, w_T.sum().view(1), w_T.new_full((1,), float(n_seqs))]).detach()
    if reduce is not None:
        stats = reduce(stats)
    counts_E, n_tok, n_seq = stats[:E], stats[E].clamp(min=1), stats[E + 1]
    return n_seq * E * (counts_E / n_tok * p_sum_E / n_tok).sum()


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class CapacityConfig:
    """Token dropping. ``factor=None`` is dropless (the default, as DeepSeek-V3 trains).

    capacity per expert = ceil(factor * T * K / E) for the T tokens of one micro-batch on one rank (Megatron-Core
    convention, sub-sequence level). policy "probs" drops an expert's lowest-gate-weight assignments first,
    "position" its latest tokens first. ``pad`` pads every local expert to its full capacity (static shapes).
    """

    factor: float | None = None
    policy: DropPolicy = "probs"
    pad: bool = False

    def __post_init__(self) -> None:
        if self.factor is not None and not self.factor > 0:
            raise ValueError(f"capacity factor={self.factor} must be > 0, or None for dropless")
        if self.policy not in ("probs", "position"):
            raise ValueError(f"capacity drop policy={self.policy!r}; allowed: 'probs', 'position'")


def count_values(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ``idx`` (int64, values in [0, n)): int64 (n,), the result of
    ``torch.bincount(idx, minlength=n)`` without its host synchronisation -- CUDA's bincount reads the input's
    minimum and maximum on the host, which would stop the host at every MoE layer."""
    flat = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


def capacity_keep_mask(topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, n_experts: int,
                       cap: CapacityConfig) -> tuple[torch.Tensor | None, int]:
    """Which assignments survive the capacity limit. Returns (keep_TK bool or None when dropless, capacity)."""
    if cap.factor is None:
        return None, 0
    T, K = topk_idx_TK.shape
    capacity = math.ceil(cap.factor * T * K / n_experts)
    flat_e = topk_idx_TK.reshape(-1)
    if cap.policy == "probs":
        priority = -topk_weight_TK.detach().reshape(-1)  # higher weight first
    else:
        priority = torch.arange(T * K, device=flat_e.device, dtype=torch.float32)  # earlier position first
    # Sort by (expert, priority); rank within expert = position - start of expert's run.
    order = torch.argsort(priority, stable=True)
    order = order[torch.argsort(flat_e[order], stable=True)]
    counts_E = count_values(flat_e, n_experts)
    starts_E = counts_E.cumsum(0) - counts_E
    rank_in_expert = torch.empty_like(flat_e)
    rank_in_expert[order] = torch.arange(T * K, device=flat_e.device) - starts_E[flat_e[order]]
    return (rank_in_expert < capacity).view(T, K), capacity


@dataclass
class PermuteState:
    """Bookkeeping to undo a local permutation. row_token_S: source token of each dispatched row; row_weight_S: its
    fp32 gate weight; n_tokens: T."""

    row_token_S: torch.Tensor
    row_weight_S: torch.Tensor
    n_tokens: int
    extra: Any = None
    dropped: torch.Tensor | int = 0  # token-expert assignments dropped by the capacity limit


def permute(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, n_experts: int,
            keep_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, PermuteState]:
    """Sort token copies by expert. Returns x_SD (rows grouped by expert id, stable in token order),
    tokens_per_expert_E (int64), and the state for :func:`unpermute`. Dropped assignments (keep=False) are left out."""
    T, K = topk_idx_TK.shape
    flat_e = topk_idx_TK.reshape(-1)
    if keep_TK is not None:
        flat_e = torch.where(keep_TK.reshape(-1), flat_e, torch.full_like(flat_e, n_experts))
    order_S = torch.argsort(flat_e, stable=True)
    counts_E = count_values(flat_e, n_experts + 1)[:n_experts]
    if keep_TK is not None:
        order_S = order_S[: int(keep_TK.sum())]  # host sync: number of kept rows (capacity mode only)
    row_token_S = order_S // K
    row_weight_S = topk_weight_TK.reshape(-1)[order_S]
    return x_TD[row_token_S], counts_E, PermuteState(row_token_S, row_weight_S, T)


def unpermute(y_SD: torch.Tensor, state: PermuteState, out_dtype: torch.dtype) -> torch.Tensor:
    """Weight each expert output row by its gate weight in fp32 and sum rows back into their tokens: (T, D)."""
    y32 = y_SD.float() * state.row_weight_S.unsqueeze(-1)
    out_TD = y32.new_zeros(state.n_tokens, y_SD.shape[-1])
    out_TD.index_add_(0, state.row_token_S, y32)
    return out_TD.to(out_dtype)


class DispatchHandle(Protocol):
    def wait(self) -> tuple[torch.Tensor, torch.Tensor, Any]: ...


class CombineHandle(Protocol):
    def wait(self) -> torch.Tensor: ...


class Dispatcher(Protocol):
    """Moves tokens to the experts that hold them and back.

    ``dispatch(x_TD, topk_idx_TK, topk_weight_TK, meanwhile=None)`` starts the move and returns a handle (calling
    ``meanwhile()`` once, while its count exchange is in flight, or at once without one); ``handle.wait()`` gives
    (x_SD rows grouped by *local* expert, tokens_per_local_expert_El, state). ``combine(y_SD, state)`` starts the
    way back; its handle's ``wait()`` gives y_TD, gate-weighted in fp32 and summed per token. Splitting start and
    wait lets the MoE layer compute the shared experts (or another chunk) while a collective is in flight.
    ``n_local_experts`` and ``local_expert_offset`` say which experts this process holds.
    """

    n_local_experts: int
    local_expert_offset: int
    capacity: CapacityConfig

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                 meanwhile: Callable[[], Any] | None = None) -> DispatchHandle: ...

    def combine(self, y_SD: torch.Tensor, state: Any) -> CombineHandle: ...


class _Done:
    def __init__(self, *value: Any):
        self.value = value if len(value) > 1 else value[0]

    def wait(self) -> Any:
        return self.value


@dataclass
class DispatchStats:
    """Per-layer communication timers a dispatcher accumulates until the trainer resets them (metrics only; token
    counts travel in :class:`MoEStats` so that activation recomputation cannot count them twice)."""

    a2a_seconds: float = 0.0
    exposed_seconds: float = 0.0
    # Host seconds spent in the collectives' issue calls (their launch; not part of a2a_seconds).
    launch_seconds: float = 0.0
    calls: int = 0
    # Rows this rank put into dispatch all-to-alls (all destinations, itself included), and the part of them
    # addressed to other EP ranks (what crosses the wire). Per dispatch call: a recomputed forward counts again.
    rows_sent: int = 0
    remote_rows_sent: int = 0
    # Bytes of those rows on the wire (values, plus scales under FP8 dispatch; metadata not included).
    bytes_sent: int = 0
    remote_bytes_sent: int = 0
    # The same timers by phase (PHASES): {phase: [a2a seconds, exposed seconds]}.
    by_phase: dict[str, list[float]] = field(default_factory=dict)
    # Global MoE-layer index of the owning dispatcher (names its collectives in hang reports), when known.
    layer: int | None = None
    # False while the trainer runs a forward that is not training (validation): nothing is counted then.
    recording: bool = True
    # Device-timed collectives of the current step, read by settle(): (phase, () -> (a2a s, exposed s)).
    unsettled: list[tuple[str, Callable[[], tuple[float, float]]]] = field(default_factory=list)
    # Exposed seconds of the combine and of the dispatch's backward (where ranks wait for the slowest rank's
    # experts), since the imbalance telemetry last took them (moetrain.parallel.imbalance).
    combine_wait_s: float = 0.0

    #: Phases of an MoE layer's all-to-alls: the count exchange, the dispatch (token rows and their metadata), the
    #: combine, and the backward of dispatch and combine.
    PHASES = ("counts", "dispatch", "combine", "dispatch backward", "combine backward")

    def add(self, phase: str, a2a_s: float, exposed_s: float) -> None:
        """Record one collective named ``phase`` (e.g. "dispatch (gate weights) backward") under its PHASES key."""
        self.a2a_seconds += a2a_s
        self.exposed_seconds += exposed_s
        key = phase_key(phase)
        t = self.by_phase.setdefault(key, [0.0, 0.0])
        t[0] += a2a_s
        t[1] += exposed_s
        if key in ("combine", "dispatch backward"):
            self.combine_wait_s += exposed_s

    def add_later(self, phase: str, read: Callable[[], tuple[float, float]]) -> None:
        """Record a collective whose times are read later (CUDA events, ``moetrain.parallel.timing``): ``read()``
        runs in :meth:`settle`, once the step's work has executed."""
        self.unsettled.append((phase, read))

    def settle(self) -> None:
        """Add the collectives recorded with :meth:`add_later`. Call after a host synchronisation with the compute
        stream (the end of a training step); their events must have completed."""
        pending, self.unsettled = self.unsettled, []
        for phase, read in pending:
            self.add(phase, *read())

    def reset_timers(self) -> None:
        self.a2a_seconds = self.exposed_seconds = self.launch_seconds = 0.0
        self.by_phase = {}


def phase_key(phase: str) -> str:
    """The :attr:`DispatchStats.PHASES` key of a collective's name: "dispatch (counts)" -> "counts",
    "dispatch (expert ids)" -> "dispatch", "combine backward" -> "combine backward"."""
    if "(counts)" in phase:
        return "counts"
    base = "combine" if phase.startswith("combine") else "dispatch"
    return f"{base} backward" if phase.endswith("backward") else base


class LocalDispatcher:
    """EP = 1: a permutation by expert on this process (no communication). Optional capacity dropping/padding."""

    def __init__(self, n_experts: int, capacity: CapacityConfig | None = None):
        self.n_experts = n_experts
        self.n_local_experts = n_experts
        self.local_expert_offset = 0
        self.capacity = capacity or CapacityConfig()
        self.stats = DispatchStats()

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
                 meanwhile: Callable[[], Any] | None = None) -> _Done:
        if meanwhile is not None:
            meanwhile()  # no count exchange to hide: run it now
        keep_TK, capacity = capacity_keep_mask(topk_idx_TK, topk_weight_TK, self.n_experts, self.capacity)
        x_SD, counts_E, state = permute(x_TD, topk_idx_TK, topk_weight_TK, self.n_experts, keep_TK)
        if keep_TK is not None:
            state.dropped = (~keep_TK).sum()
        if keep_TK is not None and self.capacity.pad:
            x_SD, counts_E, state.extra = pad_to_capacity(x_SD, counts_E, capacity)
        return _Done(x_SD, counts_E, state)

    def combine(self, y_SD: torch.Tensor, state: PermuteState) -> _Done:
        if state.extra is not None:
            y_SD = y_SD[state.extra]
        return _Done(unpermute(y_SD, state, y_SD.dtype))


def pad_to_capacity(x_SD: torch.Tensor, counts_E: torch.Tensor, capacity: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place each expert's rows in a fixed slot of ``capacity`` rows (zeros after them). Returns the padded rows
    (E*capacity, D), counts of ``capacity`` per expert, and the index of every real row in the padded layout."""
    E = counts_E.shape[0]
    starts = counts_E.cumsum(0) - counts_E
    # output_size: the row count is known on the host (without it, CUDA reads the counts' sum there)
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=x_SD.device), counts_E, output_size=x_SD.shape[0])
    slot_S = expert_of_row * capacity + (torch.arange(x_SD.shape[0], device=x_SD.device) - starts[expert_of_row])
    padded = x_SD.new_zeros(E * capacity, x_SD.shape[-1]).index_copy(0, slot_S, x_SD)
    return padded, torch.full_like(counts_E, capacity), slot_S


# ----------------------------------------------------------------------------------------------------------------
# The MoE layer
# ----------------------------------------------------------------------------------------------------------------

class MoEStats(NamedTuple):
    """Returned by every MoE forward (never kept in globals).

    A NamedTuple, not a dataclass: it leaves FSDP2-wrapped blocks inside their output, and FSDP2 hooks its
    pre-backward all-gather onto the output tensors it finds -- torch 2.11 through ``torch.utils._pytree``, which
    does not look inside dataclasses, so a gradient reaching the block through ``balance_loss_sum`` alone would not
    trigger it; every supported torch looks inside tuples (see :class:`moetrain.model.transformer.ModelOutput`).

    Attributes:
        tokens_per_expert_E: int64 counts of assignments per routed expert (all E, before capacity drops) -- the
            load used by auxiliary-loss-free balancing and the load-imbalance metrics.
        balance_loss_sum: the balance loss times the sequences it covers (fp32 scalar, no alpha): the sequence-wise
            loss summed over this micro-batch's sequences, or :func:`batch_balance_loss`.
        dropped: token-expert assignments dropped by the capacity limit (int64 scalar; 0 when dropless).
    """

    tokens_per_expert_E: torch.Tensor
    balance_loss_sum: torch.Tensor
    dropped: torch.Tensor | int = 0


class MoE(Recomputable, nn.Module):
    """DeepSeekMoE FFN: routed experts chosen by :class:`Router` plus always-on shared experts (none in Qwen3-MoE).
    The balance loss is counted over the tokens ``cfg.balance_loss`` names (per sequence, micro-batch or global batch).

    forward(x_BLD, valid_BL=None) -> (y_BLD, MoEStats); ``valid_BL`` (bool) marks the tokens that count in the expert
    loads and the balance loss (padding, label -100, does not). ``dispatcher`` defaults to :class:`LocalDispatcher`; ``n_chunks > 1`` splits
    the tokens into chunks whose dispatch/combine overlap the other chunks' expert GEMMs (useful with an
    asynchronous all-to-all dispatcher). Dropless results are identical to n_chunks = 1; in capacity mode each chunk
    is a dispatch of its own, so capacity is computed per chunk, as it is per micro-batch.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared_experts = (SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.expert_ffn_dim)
                               if cfg.n_shared_experts else None)
        self.dispatcher: Dispatcher = LocalDispatcher(cfg.n_routed_experts)
        self.n_chunks = 1
        self.compute_balance_loss = cfg.balance_loss_alpha > 0
        self.balance_loss = cfg.balance_loss
        # BalanceLoss.GLOBAL_BATCH: sums the detached expert counts over the data-parallel group (set by
        # moetrain.parallel.parallelize; None in a single process, where the micro-batch is the global batch).
        self.reduce_balance_counts: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x_BLD: torch.Tensor, valid_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        r = self.gate(x_TD)
        valid_T = valid_BL.reshape(B * L) if valid_BL is not None else None
        with torch.no_grad():
            idx = r.topk_idx_TK.reshape(-1)
            if valid_T is None:
                counts_E = count_values(idx, self.gate.n_experts)
            else:  # padding is routed (shapes stay static) but not counted in the loads that steer the biases
                keep = valid_T.unsqueeze(1).expand_as(r.topk_idx_TK).reshape(-1).long()
                counts_E = torch.zeros(self.gate.n_experts, dtype=torch.long, device=idx.device).scatter_add_(
                    0, idx, keep)
        if self.compute_balance_loss and self.balance_loss == BalanceLoss.SEQUENCE:
            balance = sequence_balance_loss(r.scores_TE, r.topk_idx_TK, B, valid_T)
        elif self.compute_balance_loss:
            reduce = self.reduce_balance_counts if self.balance_loss == BalanceLoss.GLOBAL_BATCH else None
            balance = batch_balance_loss(r.scores_TE, r.topk_idx_TK, B, valid_T, reduce)
        else:
            balance = x_TD.new_zeros((), dtype=torch.float32)

        # Read again after a dispatch or combine was issued: under a phase tape (EP overlap across micro-batches,
        # moetrain.model.phases) those reads are cut from this segment's graph.
        x_later, weight_later, balance_later = carry(x_TD), carry(r.topk_weight_TK), carry(balance)
        n_chunks = max(1, min(self.n_chunks, B))
        chunks = [slice(i * B // n_chunks * L, (i + 1) * B // n_chunks * L) for i in range(n_chunks)]
        # The shared experts run while a transfer is in flight: normally the dispatch's token rows; under EP
        # overlap across micro-batches (a phase tape records) the other micro-batch's backward hides those, and
        # the shared experts hide the count exchange the rows wait for instead.
        shared: list[Callable[[], torch.Tensor]] = []  # getter of the shared experts' output (carry)

        def run_shared() -> None:
            if RecomputeModule.SHARED_EXPERTS in self.recompute_modules:
                shared.append(carry(checkpointed(self.shared_experts, x_later())))
            else:
                shared.append(carry(self.shared_experts(x_later())))
        early = self.shared_experts is not None and current_tape() is not None
        pending = [self.dispatcher.dispatch(x_later()[c], r.topk_idx_TK[c], weight_later()[c],
                                            run_shared if early and i == 0 else None) for i, c in enumerate(chunks)]
        if self.shared_experts is not None and not shared:
            run_shared()
        shared_later = shared[0] if shared else None
        combines = []
        dropped: torch.Tensor | int = 0
        for handle in pending:
            x_SD, tokens_per_expert, state = handle.wait()
            dropped = dropped + state.dropped
            y_SD = self.experts(x_SD, tokens_per_expert)
            combines.append(self.dispatcher.combine(y_SD, state))
        routed_TD = torch.cat([c.wait() for c in combines], dim=0).to(x_BLD.dtype)
        out_TD = routed_TD if shared_later is None else routed_TD + shared_later()
        return out_TD.view(B, L, D), MoEStats(counts_E, balance_later(), dropped)
