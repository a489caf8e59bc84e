"""A pipeline stage of the transformer: the model contract that pipelines.

A :class:`TransformerStage` holds a contiguous run of the model's layers, plus the embedding on the first stage and
the final norm, output head, loss and MTP modules on the last. Only the hidden state passes between stages (what
``torch.distributed.pipelining`` sends); the token ids and labels of the micro-batch reach every stage as keyword
arguments, which the schedule splits into micro-batches like the positional ones and hands to every stage's forward
(the ranks of one pipeline read the same batch):

    first stage          (tokens_BL=, labels_BL=)         -> h_BLD
    middle stage         (h_BLD, tokens_BL=, labels_BL=)  -> h_BLD
    last stage           (h_BLD, tokens_BL=, labels_BL=)  -> sums_S  (fp32: [CE sum, MTP CE sum per depth ...])
    the whole model      (tokens_BL=, labels_BL=)         -> sums_S

Every stage needs the labels to count real tokens in its MoE statistics, and the last stage needs the tokens for the
MTP modules' embedding. Integer tensors are not sent between stages: torch 2.11's pipeline stages mark every
received buffer as requiring gradients, which an int64 tensor cannot ("only Tensors of floating point dtype can
require gradients"), and Megatron-LM too has every stage take the batch tensors it needs from the data rather than
from its neighbour. Losses are *sums*; the trainer's loss function divides them by the global counts (``moetrain.train.step``).

Layers are keyed by their global index (``layers.<i>``, ``mtp.<k>``), so parameter names -- and with them HF names,
the name-seeded initialisation and checkpoint keys -- are the same for every split. Single-device code: it knows
nothing about ranks.

**The embedding on the last stage.** MTP depth k embeds token i+k with the main model's embedding (DeepSeek-V3
report, sec. 2.2). When the last stage is not the first, it holds its *own copy* of the embedding under the same
name ``embed_tokens.weight``; both copies start equal (the init is seeded by name), the trainer sums their
gradients before the optimizer step (:func:`moetrain.parallel.pipeline.sync_embedding_grads`, as Megatron does for
embeddings shared by its first and last stages), so identical updates keep them equal. Checkpoints store the name
once.

**The balance loss.** Each MoE layer's sequence-wise balance loss reaches the backward of its own stage through
:class:`AttachLoss` (the loss rides on the hidden state's autograd graph with gradient ``alpha / N_sequences``, as
Megatron's ``MoEAuxLossAutoScaler``): no global list, no pipeline message. The values and the expert loads of
each step accumulate in the stage's own :class:`StageStats`, which the trainer reads and resets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moetrain.model.config_base import ModelConfig
from moetrain.model.moe import MoE, MoEStats
from moetrain.model.phases import carry
from moetrain.model.transformer import (Block, RopeCache, Transformer, ce_sum, loss_mask, mtp_ce_sums,
                                       run_layers)


@dataclass(frozen=True)
class StageSpec:
    """What one (virtual) pipeline stage holds.

    Attributes:
        index: stage index in 0..n_stages-1 (model order).
        n_stages: PP * VPP stages in all.
        layers: global indices of its transformer layers, ascending.
        mtp: MTP depths (0-based) it holds: only the last stage may hold any.
        embed: it holds the embedding and takes the tokens as input (the first stage).
        head: it holds the final norm, output head and the losses (the last stage).
    """

    index: int
    n_stages: int
    layers: tuple[int, ...]
    mtp: tuple[int, ...] = ()
    embed: bool = False
    head: bool = False

    @property
    def needs_embedding_copy(self) -> bool:
        """The last stage's MTP modules need the embedding, which the stage does not otherwise hold."""
        return bool(self.mtp) and not self.embed


@dataclass
class StageStats:
    """One optimizer step's MoE statistics of a stage, accumulated over micro-batches (owned by the stage).

    Attributes:
        loads: global MoE-layer index -> int64 (E,) assignments per expert (real tokens only).
        balance_sum: fp64 sum over micro-batches and MoE layers of the balance loss summed over sequences (no alpha).
        dropped: fp64 token-expert assignments dropped by a capacity limit.
    """

    loads: dict[int, torch.Tensor] = field(default_factory=dict)
    balance_sum: torch.Tensor | None = None
    dropped: torch.Tensor | None = None

    def add(self, moe_index: int, s: MoEStats) -> None:
        c = s.tokens_per_expert_E.detach()
        self.loads[moe_index] = self.loads[moe_index] + c if moe_index in self.loads else c.clone()
        b = s.balance_loss_sum.detach().double()
        self.balance_sum = b if self.balance_sum is None else self.balance_sum + b
        # A Python count is written with a fill, not copied from the host (a blocking copy on a GPU, per layer).
        d = s.dropped.detach().double() if isinstance(s.dropped, torch.Tensor) else b.new_full((), s.dropped)
        self.dropped = d if self.dropped is None else self.dropped + d


class AttachLoss(torch.autograd.Function):
    """forward(h, loss) -> h; backward gives ``loss`` the gradient 1 (and passes h's gradient through).

    Adds ``loss`` to the objective from inside the graph: its backward runs when the backward reaches h, i.e. in
    this stage's own backward (Megatron-Core ``MoEAuxLossAutoScaler``). ``loss`` must already carry its weight.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def moe_index_of(cfg: ModelConfig) -> tuple[dict[int, int], int]:
    """Global MoE-layer indices: ({layer index: MoE index}, MoE index of MTP depth 0). Main-model MoE layers come
    first in layer order, then the MTP modules (the order of ``Transformer.moe_layers``)."""
    idx = {}
    for i in range(cfg.n_layers):
        if cfg.is_moe_layer(i):
            idx[i] = len(idx)
    return idx, len(idx)


class TransformerStage(nn.Module):
    """The part of a :class:`~moetrain.model.transformer.Transformer` that one pipeline stage runs (see module
    docstring for the forward contract). Built from a model (usually on the meta device) by sharing its modules;
    the embedding copy of a last stage is a new module.

    Attributes:
        balance_scale: weight of the balance-loss sums in the objective, alpha / N_sequences (global), set by the
            trainer before each step; 0 attaches nothing.
        act_dtype: dtype of the hidden state sent to the next stage (fixed, so the pipeline's message shapes can be
            declared up front).
        stats: this step's :class:`StageStats`.
    """

    def __init__(self, model: Transformer, spec: StageSpec):
        super().__init__()
        cfg = model.cfg
        self.cfg, self.spec = cfg, spec
        if spec.mtp and not spec.head:
            raise ValueError(f"stage {spec.index}: MTP modules must sit on the last stage, with the head")
        if spec.embed:
            self.embed_tokens = model.embed_tokens
        elif spec.needs_embedding_copy:
            with torch.device(model.embed_tokens.weight.device):
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        else:
            self.embed_tokens = None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        self.norm = model.norm if spec.head else None
        self.lm_head = model.lm_head if spec.head else None
        self.mtp = nn.ModuleDict({str(k): model.mtp[k] for k in spec.mtp})
        moe_idx, mtp0 = moe_index_of(cfg)
        self._moe_index = {i: moe_idx[i] for i in spec.layers if i in moe_idx}
        self._mtp_moe_index = {k: mtp0 + k for k in spec.mtp}
        self.rope = RopeCache(cfg)
        self.balance_scale = 0.0
        self.act_dtype = torch.float32
        self.stats = StageStats()

    # -- what the stage holds -------------------------------------------------------------------------------
    def blocks(self) -> list[Block]:
        """Every transformer block of the stage (main layers, then MTP blocks)."""
        return list(self.layers.values()) + [m.block for m in self.mtp.values()]

    def moe_layers(self) -> list[MoE]:
        """The stage's MoE FFNs, in global MoE order (see :meth:`moe_indices`)."""
        return [b.mlp for b in self.blocks() if isinstance(b.mlp, MoE)]

    def moe_indices(self) -> list[int]:
        """Global MoE-layer index of each entry of :meth:`moe_layers`."""
        return list(self._moe_index.values()) + list(self._mtp_moe_index.values())

    def shared_embedding_copy(self) -> bool:
        """True when this stage's ``embed_tokens`` is a copy whose gradient must be summed with the first stage's."""
        return self.spec.needs_embedding_copy

    def start_step(self, balance_scale: float) -> None:
        """Begin an optimizer step (or an evaluation): fresh :class:`StageStats`, and each MoE layer's balance
        loss weighted ``balance_scale`` (alpha / N_sequences of the step; 0 attaches nothing)."""
        self.stats = StageStats()
        self.balance_scale = balance_scale

    def _account(self, moe_index: int, s: MoEStats, h: torch.Tensor) -> torch.Tensor:
        self.stats.add(moe_index, s)
        if self.balance_scale and torch.is_grad_enabled() and s.balance_loss_sum.requires_grad:
            h = AttachLoss.apply(h, s.balance_loss_sum * self.balance_scale)
        return h

    def _account_layer(self, layer: int, s: MoEStats, h: torch.Tensor) -> torch.Tensor:
        return self._account(self._moe_index[layer], s, h)

    def _account_mtp(self, depth: int, s: MoEStats, h: torch.Tensor) -> torch.Tensor:
        return self._account(self._mtp_moe_index[depth], s, h)

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, *hidden: torch.Tensor, tokens_BL: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
        """The stage's part of the model on one micro-batch (see the module docstring for the contract).

        Args:
            hidden: nothing on the first stage; the previous stage's output h_BLD on any other.
            tokens_BL: int64 token ids of the micro-batch.
            labels_BL: int64 next-token labels (IGNORE_INDEX where no loss is wanted).

        Returns:
            h_BLD in ``act_dtype`` (not the last stage), or the (1 + MTP depth,) fp32 loss sums (the last stage).

        Raises:
            TypeError: a hidden state given to the first stage, or none to another stage.
            ValueError: a sequence longer than ``max_seq_len``.
        """
        if self.spec.embed != (len(hidden) == 0) or len(hidden) > 1:
            raise TypeError(f"stage {self.spec.index} takes {'no' if self.spec.embed else 'one'} hidden state "
                            f"positionally (and tokens_BL=, labels_BL=), got {len(hidden)}")
        rope = self.rope(tokens_BL.shape[1], tokens_BL.device)
        h = self.embed_tokens(tokens_BL) if self.spec.embed else hidden[0]
        # A stage holding the embedding and the MTP modules (the whole model) reads its embedding again after every
        # layer's all-to-alls (moetrain.model.phases); a last stage without it embeds with its copy there.
        emb = carry(h) if self.spec.embed and self.mtp else None
        layers = ((i, self.layers[str(i)]) for i in self.spec.layers)
        h = run_layers(layers, h, rope, loss_mask(labels_BL), self._account_layer)
        if not self.spec.head:
            # No view leaves a stage (FSDP: an in-place op on a view output would skip its backward hook): the
            # schedule hands in micro-batches as views of the step's batch, and AttachLoss returns its input.
            h = h.to(self.act_dtype)
            return h.clone() if h._is_view() else h
        # Each sum (and the embedding) is read after the MTP modules' all-to-alls (moetrain.model.phases).
        sums = [carry(ce_sum(self.lm_head, self.norm, h, labels_BL))]
        if self.mtp:
            if emb is None:
                emb = carry(self.embed_tokens(tokens_BL))
            mtp = ((int(key), module) for key, module in self.mtp.items())
            sums += [get for get, _ in mtp_ce_sums(mtp, h, emb, labels_BL, rope, self.lm_head, self._account_mtp)]
        return torch.stack([get() for get in sums])


__all__ = ["AttachLoss", "StageSpec", "StageStats", "TransformerStage", "moe_index_of"]
