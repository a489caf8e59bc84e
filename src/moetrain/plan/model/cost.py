"""The cost record of one pipeline item (forward + backward of one micro-batch on one GPU) and how its parts add
up into time: plainly, or with expert-parallel overlap, where the all-to-all of one micro-batch runs under the
compute of another (:meth:`ItemCost.time`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ItemCost:
    """Forward + backward of one pipeline item for one micro-batch on one GPU (seconds, bytes, FLOPs).

    ``flops`` is the model FLOPs (Megatron accounting) done on this GPU; recomputation is extra time, not FLOPs.
    """

    kind: str
    flops: float = 0.0
    gemm_s: float = 0.0
    grouped_s: float = 0.0
    attn_s: float = 0.0
    head_s: float = 0.0
    mem_s: float = 0.0
    recompute_s: float = 0.0
    overhead_s: float = 0.0
    a2a_s: float = 0.0
    tp_s: float = 0.0
    cp_s: float = 0.0
    host_s: float = 0.0  # host launch time the GPU waits for (eager launches slower than the kernels run)
    attn_share: float = 1.0  # share of the compute before the dispatch (attention, norms, router), for overlap
    #: the all-to-all passes of one micro-batch: dispatch fwd, combine fwd, combine bwd, dispatch bwd (seconds);
    #: extra passes (recompute) and metadata exchanges in a2a_extra_s
    a2a_passes: tuple[float, ...] = ()
    a2a_extra_s: float = 0.0
    attn_wgrad_s: float = 0.0  # weight-gradient GEMMs of the attention projections (a part of gemm_s)
    act_bytes: float = 0.0
    params_dense: float = 0.0
    params_expert: float = 0.0

    @property
    def compute_s(self) -> float:
        """GPU time of the item on the compute stream (everything but the all-to-all, TP and CP), seconds."""
        return (self.gemm_s + self.grouped_s + self.attn_s + self.head_s + self.mem_s + self.recompute_s
                + self.overhead_s + self.host_s)

    def time(self, overlap: bool, sm_share: float) -> tuple[float, float]:
        """(time of the item, exposed all-to-all part), communication outside the a2a included."""
        c, a = self.compute_s, self.a2a_s
        if overlap and a > 0 and len(self.a2a_passes) == 4:
            t = self.paired_time(sm_share)
        elif overlap and a > 0:
            # forward a2a (half of the volume) under the partner's backward compute (2/3 of the compute), backward
            # a2a under the partner's forward compute (1/3); compute runs on the SMs the a2a kernels leave free
            t = max(a / 2, 2 * c / 3 + sm_share * a / 2) + max(a / 2, c / 3 + sm_share * a / 2)
        else:
            t = c + a
        return t + self.tp_s + self.cp_s, t - c

    def paired_time(self, sm_share: float) -> float:
        """Steady-state time of this item for one forward (micro-batch i+1) paired with one backward (micro-batch i),
        the all-to-all of each hidden only behind the compute that runs beside it.

        The windows are those of Megatron-Core's combined 1F1B (docs/reference.md section 9): the communication stream
        runs ``combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd`` while the compute stream runs
        ``pre_dispatch_fwd | mlp_bwd -> mlp_dW -> mlp_fwd | pre_dispatch_bwd``; with the data dependencies (the
        backward MLP needs the combine gradient, the forward MLP the dispatched tokens) this gives five slots:

            combine_bwd(B)  || attention fwd (F)
            dispatch_fwd(F) || MLP data gradient (B)
            dispatch_bwd(B) || MLP weight gradient (B)
                               MLP fwd (F), alone
            combine_fwd(F)  || attention bwd (B)

        Each slot takes max(comm, compute + share x comm) (the compute runs on the SMs the communication kernels leave
        free). Forward, data gradient and weight gradient are a third of each part's compute (the model's convention
        for GEMMs); DualPipe's F&B chunk pairs overlap the same four transfers with the same segments (DeepSeek-V3
        report sec. 3.2.1).
        """
        c = self.compute_s
        ca, cm = c * self.attn_share, c * (1 - self.attn_share)
        df, cf, cb, db = self.a2a_passes
        s = sm_share
        return (max(cb, ca / 3 + s * cb) + max(df, cm / 3 + s * df) + max(db, cm / 3 + s * db) + cm / 3
                + max(cf, 2 * ca / 3 + s * cf) + self.a2a_extra_s)

    def solo_time(self, sm_share: float) -> float:
        """Time of this item for a forward and backward with no partner micro-batch (the first forward and the last
        backward of a step under moetrain's paired schedule), with the weight gradients delayed until the reverse
        all-to-all is issued (``moetrain.model.phases.weight_grad``): the forward's transfers are exposed, the
        backward's combine hides behind the attention part's weight gradient and its dispatch behind the MLP's.
        Same thirds as :meth:`paired_time`."""
        c = self.compute_s
        ca, cm = c * self.attn_share, c * (1 - self.attn_share)
        df, cf, cb, db = self.a2a_passes
        s = sm_share
        return (ca / 3 + df + cm / 3 + cf + ca / 3 + max(cb, ca / 3 + s * cb) + cm / 3 + max(db, cm / 3 + s * db)
                + self.a2a_extra_s)
