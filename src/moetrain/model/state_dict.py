"""The state-dict adapter: what one model family's Hugging Face checkpoints look like, in both directions.

An adapter (one per family, in the family's folder: :class:`moetrain.model.deepseek.adapter.DeepSeekAdapter`,
:class:`moetrain.model.qwen3.adapter.Qwen3MoeAdapter`) translates ``config.json`` <->
:class:`~moetrain.model.config.ModelConfig` and lists, for a built model, every HF tensor and the region of the model
tensor it fills (:class:`TensorEntry`), including per-expert HF tensors cut out of our stacked expert weights and
the stacked alternatives some layouts use (:class:`StackedEntry`). Loading, saving and exporting
(:mod:`moetrain.interop.hf`, :mod:`moetrain.interop.export`) work from that list alone, so a new family is a new
adapter plus one :class:`~moetrain.model.registry.ModelSpec` in :mod:`moetrain.model.registry`. The interface
follows TorchTitan's ``StateDictAdapter``
(``to_hf``/``from_hf`` of names and layouts), but lists regions instead of converting whole state dicts, so a
process reads only the box of each tensor it holds (its FSDP shard, its experts) and no full state dict exists.

This module and the adapters import only :mod:`moetrain.model` and :mod:`moetrain.errors`, never the file I/O: they
describe names and shapes, so they live in the model layer, the adapters in their families' folders
(``moetrain.interop.adapter`` re-exports this module).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from moetrain.model.config_base import TRAINING_FIELDS, ModelConfig
from moetrain.model.layers import SwiGLU

#: A process's part of one model tensor: (global shape, offsets of the local part, local tensor); as
#: :data:`moetrain.model.init.ShardBox` returns it.
Box = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]


@dataclass
class TensorEntry:
    """One HF tensor and the region of one model tensor it fills.

    Attributes:
        hf_name: the tensor's name in the HF checkpoint. name: the model tensor's name (our parameter FQN).
        tensor: the destination parameter/buffer (plain, DTensor or meta; its *global* shape is what counts).
        expert: the global expert index within a stacked expert tensor (None = the whole tensor).
        row_offset, rows: first row and row count of that expert's slab (the up projection sits at row F of a
            fused (E, 2F, D) gate/up weight); rows None = all rows of the expert.
        n_experts: a stacked HF expert tensor: E of the config (the local tensor may hold fewer).
        copy: a duplicate of another entry's tensor (MTP's copies of the embedding and head, a tied head): written
            on save when ``saved``, only shape-checked on load.
        saved: written on save (a tied head is not; nor is a tensor the HF architecture lacks).
        keep_fp32: stored in fp32 whatever dtype the save asks for (a router bias).
        optional: may be absent from a checkpoint when *every* optional entry is absent (a layout whose HF
            architecture lacks those tensors); they then keep their initial values.
        mtp: part of a multi-token-prediction module (absent as a whole from some exports; see ``mtp_optional`` of
            :func:`moetrain.interop.hf.load_hf_checkpoint`).
        tied_to: a copy that must equal this HF tensor when the checkpoint stores both (a tied head: the loader
            refuses a checkpoint whose head differs, since loading would drop it).
    """

    hf_name: str
    name: str
    tensor: torch.Tensor
    expert: int | None = None
    row_offset: int = 0
    rows: int | None = None
    copy: bool = False
    n_experts: int | None = None
    saved: bool = True
    keep_fp32: bool = False
    optional: bool = False
    mtp: bool = False
    tied_to: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The HF tensor's shape."""
        g = tuple(self.tensor.shape)
        if self.expert is None:
            return (self.n_experts, *g[1:]) if self.n_experts else g
        return (self.rows if self.rows is not None else g[1], *g[2:])

    def region(self) -> tuple[int, ...]:
        """Offsets of the HF tensor inside the global model tensor (leading expert index included)."""
        if self.expert is None:
            return (0,) * self.tensor.dim()
        return (self.expert, self.row_offset) + (0,) * (self.tensor.dim() - 2)

    def view(self) -> torch.Tensor:
        """The region in a plain (unsharded) tensor."""
        if self.expert is None:
            return self.tensor
        return self.tensor[self.expert, self.row_offset:self.row_offset + self.shape[0]]

    def overlap(self, box: Box) -> tuple[tuple[slice, ...], torch.Tensor] | None:
        """Where this HF tensor meets a process's ``box`` of its model tensor: (slices into the HF tensor, the
        matching view of the local tensor), or None when the process holds none of it."""
        _, offsets, local = box
        region = self.region()
        lead = 1 if self.expert is not None else 0
        if lead:
            i = self.expert - offsets[0]
            if not 0 <= i < local.shape[0]:
                return None
            local = local[i]
        hf_sl, loc_sl = [], []
        for d, n in enumerate(self.shape):
            lo, hi = region[lead + d], region[lead + d] + n
            b0, b1 = offsets[lead + d], offsets[lead + d] + local.shape[d]
            a, b = max(lo, b0), min(hi, b1)
            if a >= b:
                return None
            hf_sl.append(slice(a - lo, b - lo))
            loc_sl.append(slice(a - b0, b - b0))
        return tuple(hf_sl), local[tuple(loc_sl)]


@dataclass
class StackedEntry:
    """A HF tensor holding all E experts of one layer that the loader also accepts in place of the per-expert
    tensors it ``covers`` (e.g. the transformers-v5 in-memory layout); ``entry`` is its whole-tensor region."""

    hf_name: str
    entry: TensorEntry
    covers: list[str]


@dataclass
class StateMap:
    """Every HF tensor of a model in checkpoint order (``entries``), and the stacked alternatives (``stacked``)."""

    entries: list[TensorEntry] = field(default_factory=list)
    stacked: list[StackedEntry] = field(default_factory=list)


class StateDictAdapter(ABC):
    """One model family's HF checkpoint layout (see the module docstring). Stateless: one instance serves every
    model of the family.

    Class attributes:
        model_types: the ``config.json`` ``model_type`` values this adapter reads (the first is the default name).
        architectures: the ``config.json`` ``architectures`` values it reads (for configs without ``model_type``).
        family: a short human name for error messages ("DeepSeek-V3 / DeepSeek-V2").
        ignored_suffixes: checkpoint tensors ending so are skipped on load (non-persistent buffers old exports hold).
    """

    model_types: ClassVar[tuple[str, ...]]
    architectures: ClassVar[tuple[str, ...]]
    family: ClassVar[str]
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    @abstractmethod
    def handles(self, cfg: ModelConfig) -> bool:
        """Whether models of ``cfg`` belong to this family (export and save pick the adapter by it)."""

    @abstractmethod
    def config_from_hf(self, d: dict[str, Any]) -> ModelConfig:
        """The :class:`ModelConfig` of HF ``config.json`` dict ``d``.

        Raises:
            ConfigError: a config this family's models cannot represent (naming the key and the allowed values).
        """

    @abstractmethod
    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """The HF ``config.json`` dict of ``cfg``; ``config_from_hf(config_to_hf(cfg)) == cfg``.

        Raises:
            ConfigError: ``cfg`` has no HF architecture of this family.
        """

    @abstractmethod
    def state_map(self, model: nn.Module) -> StateMap:
        """The HF tensors of ``model`` (a whole model, or a pipeline stage: only what it holds, layers under their
        global indices), in checkpoint order, with the stacked alternatives the loader accepts."""

    @abstractmethod
    def is_fp8_weight(self, hf_name: str) -> bool:
        """Whether this family's block-FP8 checkpoints store HF tensor ``hf_name`` in FP8
        (:mod:`moetrain.interop.fp8_blocks`); the loader reads either form of every weight."""


def training_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that steer training (:data:`~moetrain.model.config_base.TRAINING_FIELDS`), by value:
    the ``"moetrain"`` block of a written ``config.json``, which HF has no names for."""
    d = cfg.to_dict()
    return {name: d[name] for name in TRAINING_FIELDS}


#: (our name, HF name) of the three linears of a SwiGLU FFN (dense FFN, shared experts, one expert).
SWIGLU_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def add_attention_entries(out: StateMap, block: nn.Module, hf: str, ours: str, mtp: bool) -> nn.Module:
    """Add the tensors a block of every family names alike: its two norms, its attention's parameters under their
    own names (``self_attn.<name>``), and a dense SwiGLU FFN (``mlp.{gate,up,down}_proj``). Returns the block's FFN
    (an MoE layer is left to the family's adapter)."""
    for n in ("input_layernorm", "post_attention_layernorm"):
        out.entries.append(TensorEntry(hf + f"{n}.weight", ours + f"{n}.weight", getattr(block, n).weight, mtp=mtp))
    for pname, p in block.self_attn.named_parameters():
        out.entries.append(TensorEntry(hf + "self_attn." + pname, ours + "self_attn." + pname, p, mtp=mtp))
    mlp = block.mlp
    if isinstance(mlp, SwiGLU):
        for a, b in SWIGLU_NAMES:
            out.entries.append(TensorEntry(hf + f"mlp.{b}.weight", ours + f"mlp.{a}.weight", getattr(mlp, a).weight,
                                           mtp=mtp))
    return mlp


def add_expert_entries(out: StateMap, experts: nn.Module, hf: str, ours: str, n_experts: int, mtp: bool) -> None:
    """Add the routed experts of one layer (a :class:`~moetrain.model.experts.GroupedExperts` named ``ours`` here and
    ``hf`` in HF) as one tensor per expert, ``{hf}{e}.{gate,up,down}_proj.weight`` (the released layout), and the
    stacked transformers-v5 layout as the alternative the loader accepts: ``{hf}gate_up_proj`` (E, 2F, D), exactly
    ``w13_E2FD``, and ``{hf}down_proj`` (E, D, F), exactly ``w2_EDF``."""
    w13, w2 = experts.w13_E2FD, experts.w2_EDF
    E, F = n_experts, w13.shape[1] // 2
    w13_name, w2_name = ours + "w13_E2FD", ours + "w2_EDF"
    gate_up, down = [], []
    for e in range(E):
        x = hf + f"{e}."
        gate_up += [TensorEntry(x + "gate_proj.weight", w13_name, w13, e, 0, F, mtp=mtp),
                    TensorEntry(x + "up_proj.weight", w13_name, w13, e, F, F, mtp=mtp)]
        down.append(TensorEntry(x + "down_proj.weight", w2_name, w2, e, mtp=mtp))
    out.entries.extend(t for e in range(E) for t in (gate_up[2 * e], gate_up[2 * e + 1], down[e]))
    for hf_part, name, t, covered in (("gate_up_proj", w13_name, w13, gate_up), ("down_proj", w2_name, w2, down)):
        whole = TensorEntry(hf + hf_part, name, t, n_experts=E, mtp=mtp)
        out.stacked.append(StackedEntry(whole.hf_name, whole, [c.hf_name for c in covered]))


def indexed(mods: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global index, module) of a ModuleList, or of a pipeline stage's ModuleDict keyed by global index."""
    if isinstance(mods, nn.ModuleDict):
        return [(int(k), m) for k, m in mods.items()]
    return list(enumerate(mods))
