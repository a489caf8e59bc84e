"""The DeepSeek-V3 transformer: blocks, multi-token prediction modules, and losses returned in a result object.

Single-device code; ``moetrain.parallel.parallelize`` distributes it from outside.

Shape legend: B batch, L sequence, D model dim, V vocab, E routed experts, M MoE layers (main + MTP).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.layout import RecomputeModule
from moetrain.model.config_base import ModelConfig
from moetrain.model.init import ShardBox, full_box, normal_box_
from moetrain.model.layers import Linear, RMSNorm, SwiGLU, rope_cos_sin
from moetrain.model.moe import MoE, MoEStats
from moetrain.model.phases import carry
from moetrain.model.recompute import DroppedOutputs, Recomputable, checkpointed

IGNORE_INDEX = -100


class Block(Recomputable, nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)) (the family's: ``cfg.build_attention()``), then
    + FFN(norm(x)) with a dense SwiGLU or an MoE FFN.

    forward(x_BLD, cos, sin, valid_BL=None) -> (x_BLD, MoEStats or None); ``valid_BL`` marks the tokens that count in
    an MoE layer's statistics. Names match the released checkpoint (``self_attn``,
    ``mlp``, ``input_layernorm``, ``post_attention_layernorm``).

    ``recompute`` (full: the whole block from its input) and ``recompute_modules`` (selective,
    :mod:`moetrain.model.recompute`: here ``layernorm``, ``mlp`` and ``moe``; the attention and MoE modules read the
    rest) are switched on by ``moetrain.parallel.parallelize``.
    """

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = cfg.build_attention()
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if moe else SwiGLU(cfg.dim, cfg.dense_ffn_dim)
        self.recompute = False  # activation checkpointing, switched on by parallelize()

    def forward(self, x_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                valid_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats | None]:
        if self.recompute:
            # Non-reentrant checkpoint: MoE stats come from this first forward; the recomputation in backward is
            # discarded, so expert loads are counted once (auxiliary-loss-free balancing is unaffected).
            return checkpointed(self._forward, x_BLD, cos, sin, valid_BL)
        return self._forward(x_BLD, cos, sin, valid_BL)

    def _forward(self, x_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 valid_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats | None]:
        rc = self.recompute_modules
        x_BLD = x_BLD + self._after_norm(self.input_layernorm, x_BLD, lambda h: self.self_attn(h, cos, sin))
        if isinstance(self.mlp, MoE):
            residual = carry(x_BLD)  # read after the MoE's all-to-alls (moetrain.model.phases)
            moe = (lambda h: checkpointed(self.mlp, h, valid_BL)) if RecomputeModule.MOE in rc else (
                lambda h: self.mlp(h, valid_BL))
            y, stats = self._after_norm(self.post_attention_layernorm, x_BLD, moe)
            return residual() + y, stats
        mlp = (lambda h: checkpointed(self.mlp, h)) if RecomputeModule.MLP in rc else self.mlp
        return x_BLD + self._after_norm(self.post_attention_layernorm, x_BLD, mlp), None

    def _after_norm(self, norm: RMSNorm, x_BLD: torch.Tensor, consumer: Callable[[torch.Tensor], Any]) -> Any:
        """``consumer(norm(x))``; with ``layernorm`` recompute the norm's output is not kept by the consumer's
        saved tensors but recomputed from ``x`` in the backward."""
        if RecomputeModule.LAYERNORM not in self.recompute_modules:
            return consumer(norm(x_BLD))
        with DroppedOutputs(lambda: (norm(x_BLD),)) as drop:
            return consumer(drop.add(checkpointed(norm, x_BLD)))


class MTPModule(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3 report, sec. 2.2).

    h' = Block(eh_proj(concat[enorm(emb(t_{i+k})), hnorm(h_{i}^{k-1})])); logits = head(norm(h')). The embedding and
    output head are the main model's; ``norm`` is the module's own (``shared_head.norm`` in the release).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, moe=True)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BLD: torch.Tensor, emb_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                valid_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats | None]:
        x = self.eh_proj(torch.cat([self.enorm(emb_BLD), self.hnorm(h_BLD)], dim=-1))
        return self.block(x, cos, sin, valid_BL)


class ModelOutput(NamedTuple):
    """Everything a forward returns; losses are *sums* so the caller can normalise over any split of the batch.

    A NamedTuple (holding lists), not a dataclass: FSDP2 registers the all-gather that precedes a wrapped module's
    backward as a hook on the output tensors it finds. torch 2.11 finds them with ``torch.utils._pytree.tree_flatten``,
    which treats a dataclass as one opaque leaf: the root's hook was never registered, and with its parameters
    resharded after forward the backward read the freed storage of the output head ("setStorage: ... out of bounds
    for storage of size 0"). torch 2.13 also walks dataclasses; tuples, lists and NamedTuples are walked by every
    supported version (tested in tests/parallel/test_fsdp_outputs.py).

    Attributes:
        logits_BLV: main-model logits (only when requested; None otherwise).
        lm_loss_sum: next-token cross-entropy summed over loss tokens (fp32 scalar).
        n_loss_tokens: number of labels != IGNORE_INDEX (int64 scalar).
        mtp_loss_sums: per MTP depth k, CE summed over its valid positions (the last k positions have no target).
        mtp_n_tokens: per depth, the number of those positions.
        balance_loss_sum: sequence-wise balance loss summed over sequences and MoE layers (no alpha).
        n_sequences: B.
        moe_stats: one :class:`MoEStats` per MoE layer, main-model layers first, then MTP layers.
    """

    logits_BLV: torch.Tensor | None
    lm_loss_sum: torch.Tensor
    n_loss_tokens: torch.Tensor
    mtp_loss_sums: list[torch.Tensor]
    mtp_n_tokens: list[torch.Tensor]
    balance_loss_sum: torch.Tensor | None
    n_sequences: int
    moe_stats: list[MoEStats]

    def loss(self, cfg: ModelConfig) -> torch.Tensor:
        """The training objective normalised over *this* batch only (single-process use):
        CE mean + mtp_weight * mean_k(MTP CE mean) + alpha * balance per sequence."""
        total = self.lm_loss_sum / self.n_loss_tokens.clamp(min=1)
        if self.mtp_loss_sums:
            mtp = sum(s / n.clamp(min=1) for s, n in zip(self.mtp_loss_sums, self.mtp_n_tokens))
            total = total + cfg.mtp_loss_weight * mtp / len(self.mtp_loss_sums)
        if self.balance_loss_sum is not None and cfg.balance_loss_alpha > 0:
            total = total + cfg.balance_loss_alpha * self.balance_loss_sum / max(self.n_sequences, 1)
        return total


def ce_sum(lm_head: nn.Module, norm: nn.Module, h_BLD: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of head(norm(h)) against ``labels_BL``, summed over the labels != IGNORE_INDEX (fp32 scalar)."""
    logits = lm_head(norm(h_BLD))
    return F.cross_entropy(logits.float().flatten(0, 1), labels_BL.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def mtp_targets(emb_BLD: torch.Tensor, labels_BL: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of MTP depth k (1-based): the embedding of token i+k and the label of position i+k
    (token i+k+1); the last k positions have no target (IGNORE_INDEX). Rolling keeps shapes static; causal attention
    keeps the wrapped-around tail from influencing earlier positions."""
    L = labels_BL.shape[1]
    emb_k = torch.roll(emb_BLD, shifts=-k, dims=1)
    labels_k = torch.roll(labels_BL, shifts=-k, dims=1)
    labels_k[:, L - k:] = IGNORE_INDEX
    return emb_k, labels_k


def loss_mask(labels_BL: torch.Tensor) -> torch.Tensor:
    """The padding mask (B, L) bool: True where a position has a label (not IGNORE_INDEX). Expert loads and the
    balance loss count only these tokens: a padded position is computed but not counted (DeepSeek-V3's statistics
    are over a sequence's tokens)."""
    return labels_BL != IGNORE_INDEX


class RopeCache:
    """The RoPE cos/sin tables (``rope_cos_sin``) of one model per (sequence length, device), computed once.

    Calling it checks the sequence length: ``ValueError`` naming ``max_seq_len`` when L exceeds it."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len={self.cfg.max_seq_len}")
        key = (L, str(device))
        if key not in self._tables:
            self._tables[key] = rope_cos_sin(self.cfg, L, device)
        return self._tables[key]

    def clear(self) -> None:
        """Forget the tables (after the model moved to another device, e.g. materialised from meta)."""
        self._tables.clear()


#: What a forward does with an MoE layer's statistics: ``(index, stats, h) -> h``. ``index`` is the layer's index
#: (main layers) or the MTP depth (0-based); the returned hidden state continues the forward, so a pipeline stage
#: can attach the layer's balance loss to it (``moetrain.model.stage.AttachLoss``).
MoEAccount = Callable[[int, MoEStats, torch.Tensor], torch.Tensor]


def run_layers(layers: Iterable[tuple[int, Block]], h_BLD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               valid_BL: torch.Tensor | None, account: MoEAccount) -> torch.Tensor:
    """The transformer layers ``(index, block)`` in order over h (B, L, D); each MoE layer's statistics go to
    ``account``. Returns the last hidden state."""
    cos, sin = rope
    for i, block in layers:
        h_BLD, s = block(h_BLD, cos, sin, valid_BL)
        if s is not None:
            h_BLD = account(i, s, h_BLD)
    return h_BLD


def mtp_ce_sums(mtp: Iterable[tuple[int, MTPModule]], h_BLD: torch.Tensor, emb: Callable[[], torch.Tensor],
                  labels_BL: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lm_head: nn.Module,
                  account: MoEAccount) -> list[tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """The multi-token-prediction modules ``(depth d, module)`` in order, chained from the main model's last hidden
    state (DeepSeek-V3 report, sec. 2.2): depth k = d + 1 predicts token i+k+1 from h^{k-1}_i and the embedding of
    token i+k (:func:`mtp_targets`), through the shared output head and the module's own norm.

    Args:
        emb: returns the (B, L, D) embedding of the tokens (a :func:`~moetrain.model.phases.carry` getter: it is
            read after the main layers' all-to-alls).
        account: receives each MTP block's MoE statistics, indexed by depth d.

    Returns:
        Per depth: a getter of its CE sum over the valid positions (fp32 scalar; read it after the later depths'
        all-to-alls) and its (B, L) mask of positions with a target (the last k have none).
    """
    out = []
    cos, sin = rope
    for d, module in mtp:
        emb_k, labels_k = mtp_targets(emb(), labels_BL, d + 1)
        valid_k = loss_mask(labels_k)
        h_BLD, s = module(h_BLD, emb_k, cos, sin, valid_k)
        if s is not None:
            h_BLD = account(d, s, h_BLD)
        out.append((carry(ce_sum(lm_head, module.norm, h_BLD, labels_k)), valid_k))
    return out


class Transformer(nn.Module):
    """DeepSeek-V3-architecture causal LM with optional MTP modules: the single-device reference (HF parity,
    export, logits). The trainer runs it as :class:`~moetrain.model.stage.TransformerStage` parts sharing its
    modules; both forwards are built from the same pieces (:class:`RopeCache`, :func:`loss_mask`,
    :func:`run_layers`, :func:`mtp_ce_sums`).

    forward(tokens_BL, labels_BL=None, return_logits=False) -> ModelOutput. ``labels_BL`` are the next tokens
    (IGNORE_INDEX where no loss is wanted); without labels only logits are produced.
    Attribute names mirror the released layout: ``embed_tokens``, ``layers``, ``norm``, ``lm_head``, ``mtp``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = nn.ModuleList([MTPModule(cfg) for _ in range(cfg.mtp_depth)])
        self.rope = RopeCache(cfg)

    # -- helpers ---------------------------------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        """MoE FFNs in the order their stats appear in ModelOutput.moe_stats (main layers, then MTP)."""
        mods = [b.mlp for b in self.layers if isinstance(b.mlp, MoE)]
        return mods + [m.block.mlp for m in self.mtp]

    def moe_indices(self) -> list[int]:
        """Global MoE-layer index of each entry of :meth:`moe_layers` (the whole model: 0, 1, ...)."""
        return list(range(len(self.moe_layers())))

    def blocks(self) -> list[Block]:
        """Every transformer block (main layers, then MTP blocks)."""
        return list(self.layers) + [m.block for m in self.mtp]

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, tokens_BL: torch.Tensor, labels_BL: torch.Tensor | None = None,
                return_logits: bool = False) -> ModelOutput:
        B, L = tokens_BL.shape
        rope = self.rope(L, tokens_BL.device)
        emb_BLD = self.embed_tokens(tokens_BL)
        emb_later = carry(emb_BLD)  # the MTP modules read it again, after every layer's all-to-alls
        stats: list[MoEStats] = []

        def account(_index: int, s: MoEStats, h: torch.Tensor) -> torch.Tensor:
            stats.append(s)
            return h
        valid = loss_mask(labels_BL) if labels_BL is not None else None
        h = run_layers(enumerate(self.layers), emb_BLD, rope, valid, account)

        zero = torch.zeros((), device=tokens_BL.device)
        logits = self.lm_head(self.norm(h)) if (return_logits or labels_BL is None) else None
        lm_loss_sum, n_loss_tokens = zero, zero.long()
        mtp_loss_sums: list[torch.Tensor] = []
        mtp_n_tokens: list[torch.Tensor] = []
        if labels_BL is not None:
            if logits is not None:
                lm_loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels_BL.flatten(),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
            else:
                lm_loss_sum = ce_sum(self.lm_head, self.norm, h, labels_BL)
            n_loss_tokens = valid.sum()
            # Each sum is read after the later MTP modules' all-to-alls (moetrain.model.phases).
            lm_later = carry(lm_loss_sum)
            mtp = mtp_ce_sums(enumerate(self.mtp), h, emb_later, labels_BL, rope, self.lm_head, account)
            lm_loss_sum = lm_later()
            mtp_loss_sums = [get() for get, _ in mtp]
            mtp_n_tokens = [valid_k.sum() for _, valid_k in mtp]
        balance = torch.stack([s.balance_loss_sum for s in stats]).sum() if stats else None
        return ModelOutput(logits_BLV=logits, lm_loss_sum=lm_loss_sum, n_loss_tokens=n_loss_tokens,
                           mtp_loss_sums=mtp_loss_sums, mtp_n_tokens=mtp_n_tokens, balance_loss_sum=balance,
                           n_sequences=B, moe_stats=stats)


@torch.no_grad()
def init_weights(model: Transformer, std: float | None = None, seed: int = 0,
                 shard_box: ShardBox = full_box) -> None:
    """Initialise as published: every weight matrix (embedding, projections, router, experts) ~ N(0, std) with
    std = cfg.init_std (0.006 for DeepSeek-V3, report sec. 4.2); norms to one; expert biases to zero. No depth
    scaling of output projections: the report gives a single std and says nothing more, so none is applied.

    Values depend only on (seed, parameter name, position in the global tensor) (:mod:`moetrain.model.init`), so a
    sharded model initialised shard by shard holds exactly the single-process weights. ``shard_box`` says where each
    (possibly sharded) tensor's local part sits; the default is the whole tensor (single process).

    Raises:
        ValueError: a 1-D parameter that is not a norm weight (its init would be unspecified).
    """
    std = model.cfg.init_std if std is None else std
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        shape, offsets, local = shard_box(p)
        if id(p) in norms:
            local.fill_(1.0)
        elif p.dim() >= 2:
            normal_box_(local, shape, offsets, name, seed, std)
        else:
            raise ValueError(f"no initialisation rule for the {p.dim()}-D parameter {name}")
    for name, b in model.named_buffers():
        shard_box(b)[2].zero_()  # the expert biases (auxiliary-loss-free balancing starts unbiased)


def build_model(cfg: ModelConfig, device: torch.device | str | None = None, seed: int | None = 0) -> Transformer:
    """Build and initialise a model on one device. On ``device="meta"`` nothing is allocated: the model is then
    parallelized and materialised shard by shard (``moetrain.parallel.parallelize.materialize``).

    ``seed`` feeds the name-seeded init (:func:`init_weights`), so the weights are the same for any layout; None
    leaves the parameters uninitialised (``torch.empty``)."""
    with torch.device(device or "cpu"):
        model = Transformer(cfg)
    if str(device) != "meta" and seed is not None:
        init_weights(model, seed=seed)
    return model
