"""Redundant experts in training (``parallel.redundant_experts = R``, ``parallel.rebalance_every = N``).

Every EP rank computes El + R expert *slots*: its own El experts (their master weights, the only copy the optimizer,
gradient clipping and checkpoints see) and R copies of hot experts homed elsewhere. Per MoE layer and rank:

    every N steps  placement from the last window's loads (``moetrain.parallel.eplb.plan_replicas``), computed
                   on every rank from the same all-reduced loads: bit-identical everywhere
    dispatch       a source rank splits its own tokens of a replicated expert over the expert's holders in the
                   placement's water-filled shares (:meth:`LayerReplicas.route`); the dispatcher then moves
                   tokens to (rank, slot) pairs exactly as it moves them to experts
    first forward  the copies' weights come from their home ranks in one all-to-all over EP (only the experts
      of a step    copied; FSDP has already gathered them over EDP for the forward); later micro-batches, an
                   activation-checkpoint recompute and the validation forward of the same weights reuse them
    after the      each copy's gradient goes home in one all-to-all over EP, is summed over EDP (the ranks holding
      backward     the same experts saw other data) and added to this rank's shard of the master gradient, before
                   the gradient norm, clipping and the optimizer step

Why the copies keep no optimizer state (the brief's other choice: copies stepped identically by the same reduction):
both move the same bytes per step -- here the copies' weights out and gradients home, there the gradient all-reduce
among holders, both ways -- but here a placement change moves nothing at all (the next step fetches the new copies
in its usual all-to-all), the optimizer states are never duplicated or moved, and the optimizer, clipping, FSDP
and checkpoints (experts by global index) are untouched, so a run resumes at any EP and any placement. Training
equals the unreplicated run up to the order of fp32 sums: the same weights multiply the same tokens, and every
gradient contribution reaches the one master copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.model.moe import count_values
from moetrain.parallel.comm import all_to_all, name_collective_error
from moetrain.parallel.eplb import ReplicaPlacement, no_replicas, plan_replicas
from moetrain.parallel.hang import in_phase

__all__ = ["LayerReplicas"]


class LayerReplicas:
    """One MoE layer's redundant experts on one rank: routing to holders, the copies' weights and their gradients,
    and the placement kept from the measured loads (see the module docstring).

    Args:
        n_experts: E. ep, ep_rank, ep_group: the EP size, this rank's index and group. slots: R.
        rebalance_every: N, steps per placement window. edp_group: the ranks holding the same experts (None or a
            group of one: nothing to sum over). layer: the global MoE index (names the collectives).
    """

    def __init__(self, n_experts: int, ep: int, ep_rank: int, slots: int, rebalance_every: int, ep_group: Any,
                 edp_group: Any = None, layer: int = 0):
        self.n_experts, self.ep, self.ep_rank, self.slots = n_experts, ep, ep_rank, slots
        self.n_local = n_experts // ep
        self.rebalance_every = rebalance_every
        self.ep_group, self.edp_group, self.layer = ep_group, edp_group, layer
        self.placement: ReplicaPlacement = no_replicas(n_experts, ep, slots)
        self.window_E = [0] * n_experts
        self.steps = 0
        self.rebalances = 0
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # (w13 (R, 2F, D), w2 (R, D, F)) leaves of this step's copies, or None until the step's first forward.
        self._copies: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- routing -------------------------------------------------------------------------------------------------

    @property
    def slots_per_rank(self) -> int:
        """C = El + R."""
        return self.n_local + self.slots

    def _routing_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(holder slot (E, H) as global slot ids rank * C + local slot, cumulative shares (E, H), total share (E,))
        of the current placement; H = most holders of an expert, shorter rows padded with the home slot and the
        total (a boundary no token reaches)."""
        if self._tables is None or self._tables[0].device != device:
            p, C = self.placement, self.slots_per_rank
            holders = [p.holders(e) for e in range(self.n_experts)]
            H = max(len(h) for h in holders)
            slot_EH, cum_EH, tot_E = [], [], []
            for e, hs in enumerate(holders):
                slots = [r * C + p.slot_of(e, r) for r in hs]
                cum, acc = [], 0
                for s in p.shares[e]:
                    acc += s
                    cum.append(acc)
                slot_EH.append(slots + [slots[0]] * (H - len(hs)))
                cum_EH.append(cum + [acc] * (H - len(hs)))
                tot_E.append(acc)
            self._tables = (torch.tensor(slot_EH, dtype=torch.int64, device=device),
                            torch.tensor(cum_EH, dtype=torch.int64, device=device),
                            torch.tensor(tot_E, dtype=torch.int64, device=device))
        return self._tables

    def route(self, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """The slot each assignment goes to: (T, K) int64 global slot ids (rank * (El + R) + local slot).

        This rank's n_e assignments of expert e, in token order, split over the expert's holders at the integer
        boundaries floor(n_e * cumulative share / total share): deterministic, on the device, no host sync.
        """
        slot_EH, cum_EH, tot_E = self._routing_tables(topk_idx_TK.device)
        flat = topk_idx_TK.reshape(-1)
        if slot_EH.shape[1] == 1:
            return slot_EH[flat, 0].view_as(topk_idx_TK)
        n_E = count_values(flat, self.n_experts)
        order = torch.argsort(flat, stable=True)
        starts_E = n_E.cumsum(0) - n_E
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - starts_E[flat[order]]
        bounds_EH = n_E.unsqueeze(1) * cum_EH[:, :-1] // tot_E.unsqueeze(1)
        holder = (rank_in_expert.unsqueeze(1) >= bounds_EH[flat]).sum(dim=1)
        return slot_EH[flat, holder].view_as(topk_idx_TK)

    # -- the copies' weights and gradients -------------------------------------------------------------------------

    def _copy_sources(self) -> tuple[list[list[int]], list[list[int]]]:
        """(per destination rank: this rank's experts (local index) it copies, in its slot order; per source rank:
        the local slots (0..R-1) of this rank filled from it, in this rank's slot order)."""
        p, me, El = self.placement, self.ep_rank, self.n_local
        send = [[e - me * El for e in p.replicas[d] if p.home(e) == me] for d in range(self.ep)]
        recv = [[j for j, e in enumerate(p.replicas[me]) if p.home(e) == s] for s in range(self.ep)]
        return send, recv

    def slot_weights(self, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slot weights: its own experts (``w13_E2FD`` (El, 2F, D), ``w2_EDF`` (El, D, F), as the
        forward uses them) followed by the R copies, fetched at the step's first call (one all-to-all over EP);
        empty slots are zeros. Gradients reach the own experts through autograd and the copies' leaves for
        :meth:`return_grads`."""
        if self._copies is None:
            self._copies = self._fetch(w13_E2FD.detach(), w2_EDF.detach())
        c13, c2 = self._copies
        return torch.cat([w13_E2FD, c13.to(w13_E2FD.dtype)]), torch.cat([w2_EDF, c2.to(w2_EDF.dtype)])

    def _fetch(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, n13 = self.slots, w13[0].numel()
        out = w13.new_zeros(R, n13 + w2[0].numel())
        send, recv = self._copy_sources()
        if any(self.placement.replicas):  # the same on every rank: all call the collective, or none does
            rows = torch.cat([w13.reshape(w13.shape[0], -1), w2.reshape(w2.shape[0], -1)], dim=1)
            idx = torch.tensor([i for s in send for i in s], dtype=torch.int64, device=w13.device)
            with torch.no_grad(), in_phase(f"redundant experts (weights of the copies), MoE layer {self.layer}"):
                got, pending = all_to_all(rows[idx].contiguous(), [len(r) for r in recv], [len(s) for s in send],
                                          self.ep_group, "redundant experts (weights)")
                pending.wait()
            slot = torch.tensor([j for r in recv for j in r], dtype=torch.int64, device=w13.device)
            out[slot] = got
        c13 = out[:, :n13].reshape((R,) + tuple(w13.shape[1:])).clone().requires_grad_()
        c2 = out[:, n13:].reshape((R,) + tuple(w2.shape[1:])).clone().requires_grad_()
        return c13, c2

    def return_grads(self, w13_param: torch.Tensor, w2_param: torch.Tensor) -> None:
        """Send every copy's gradient home and add it to the master gradients ``w13_param.grad`` /
        ``w2_param.grad`` (the step's fully reduced, possibly FSDP-sharded gradients). Call once per step after
        the backward, on every rank of the EP group; clears this step's copies."""
        copies, self._copies = self._copies, None
        if not any(self.placement.replicas):
            return
        send, recv = self._copy_sources()
        El, R = self.n_local, self.slots
        shape13, shape2 = tuple(w13_param.shape[1:]), tuple(w2_param.shape[1:])
        n13, n2 = shape13[0] * shape13[1], shape2[0] * shape2[1]
        dev = w13_param.device
        grads = torch.zeros(R, n13 + n2, dtype=torch.float32, device=dev)
        if copies is not None:
            for c, lo, hi in ((copies[0], 0, n13), (copies[1], n13, n13 + n2)):
                if c.grad is not None:
                    grads[:, lo:hi] = c.grad.reshape(R, -1).float()
        # Home in the order the weights came: per source rank, its slots; received as the sender's own order.
        slot = torch.tensor([j for r in recv for j in r], dtype=torch.int64, device=dev)
        mine = [i for s in send for i in s]
        with torch.no_grad(), in_phase(f"redundant experts (gradients of the copies), MoE layer {self.layer}"):
            got, pending = all_to_all(grads[slot].contiguous(), [len(s) for s in send], [len(r) for r in recv],
                                      self.ep_group, "redundant experts (gradients)")
            pending.wait()
            # An expert copied to several ranks comes home once per copy: sum them, in a fixed order.
            experts = sorted(set(mine))
            pos = {e: i for i, e in enumerate(experts)}
            summed = grads.new_zeros(len(experts), n13 + n2).index_add_(
                0, torch.tensor([pos[e] for e in mine], dtype=torch.int64, device=dev), got)
            if self.edp_group is not None and dist.get_world_size(self.edp_group) > 1 and experts:
                try:
                    dist.all_reduce(summed, group=self.edp_group)
                except RuntimeError as e:
                    raise name_collective_error("redundant experts (gradient sum over EDP)", e) from e
            for param, lo, hi, shape in ((w13_param, 0, n13, shape13), (w2_param, n13, n13 + n2, shape2)):
                _add_to_grad(param, experts, summed[:, lo:hi].reshape((len(experts),) + shape),
                             self.ep_rank * El)

    def invalidate(self) -> None:
        """The master weights changed (an optimizer step, a checkpoint load): fetch the copies again."""
        self._copies = None

    # -- placement -----------------------------------------------------------------------------------------------

    def observe(self, load_E: list[int]) -> bool:
        """Add one step's global loads of this layer (token-expert assignments per expert, the same on every rank)
        to the window; every ``rebalance_every`` steps place the copies anew from it. Returns whether it did."""
        self.window_E = [a + int(b) for a, b in zip(self.window_E, load_E)]
        self.steps += 1
        if self.steps % self.rebalance_every:
            return False
        self.placement = plan_replicas(self.window_E, self.ep, self.slots)
        self.window_E = [0] * self.n_experts
        self._tables = None
        self._copies = None
        self.rebalances += 1
        return True


def _add_to_grad(param: torch.Tensor, experts: list[int], g_XNK: torch.Tensor, offset: int) -> None:
    """``param.grad[offset + experts[i]] += g_XNK[i]`` on the part of the gradient this rank stores: a box of the
    global (E, N, K) tensor under EP and FSDP (every placement moetrain uses keeps it one box, as
    ``moetrain.parallel.parallelize.shard_box`` reads it)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(grad, DTensor):
        _, off = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
        local = grad.to_local()
    else:
        off, local = (0, 0, 0), grad
    n0, n1, n2 = local.shape
    for i, e in enumerate(experts):
        row = offset + e - off[0]
        if 0 <= row < n0:
            local[row] += g_XNK[i, off[1]:off[1] + n1, off[2]:off[2] + n2].to(local.dtype)
