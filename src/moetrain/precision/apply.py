"""``apply_fp8``: switch a model's GEMMs to an FP8 recipe in place, keeping every parameter as it is;
``hold_weights_in_fp8``: hold their weights in FP8 (``parallel.fp8_param``)."""

from __future__ import annotations

from torch import nn

from moetrain.model.layers import Attention, Linear, SwiGLU
from moetrain.model.experts import GroupedExperts
from moetrain.precision.linear import Fp8Linear
from moetrain.precision.primary_weights import HeldFormat, ParamTraffic, hold_in_fp8
from moetrain.precision.recipe import PLAN_PRECISION_TO_FP8, Fp8Recipe, get_recipe

#: SwiGLU (dense FFN and shared experts) linears.
SWIGLU_LINEARS = ("w1", "w2", "w3")


def _fp8_linear(module: nn.Module, recipe: Fp8Recipe) -> None:
    if type(module) not in (nn.Linear, Linear, Fp8Linear):
        raise TypeError(f"apply_fp8 needs the un-parallelized model: found a {type(module).__name__} where an "
                        "nn.Linear was expected (call it before parallelize)")
    module.__class__ = Fp8Linear
    module.fp8_recipe = recipe  # type: ignore[attr-defined]


def apply_fp8(model: nn.Module, recipe: str | Fp8Recipe | None) -> list[str]:
    """Run ``model``'s FP8-eligible GEMMs with ``recipe`` ("none", "blockwise", "mxfp8" or an :class:`Fp8Recipe`).

    In FP8: the dense and shared-expert SwiGLU linears, the attention projections (each family's
    ``Attention.projections``), MTP's ``eh_proj``
    and the routed experts' grouped GEMMs, forward and both backward GEMMs. Kept in high precision, as DeepSeek-V3
    keeps them (report sec. 3.3.1): the embedding, ``lm_head``, the router, norms and the attention core.

    Works in place on an un-parallelized model on any device, ``meta`` included; a linear becomes an
    :class:`Fp8Linear` by a class change, so parameter names, shapes, dtypes and state-dict keys are unchanged
    (checkpoints, HF loading and FSDP2/DTensor experts see the same parameters). "none" changes nothing.

    Returns the qualified names of the modules switched (sorted). Raises TypeError if a target linear is no
    longer a plain ``nn.Linear`` (e.g. already wrapped by ``fully_shard``), ValueError for an unknown recipe.
    """
    from moetrain.model.transformer import MTPModule  # the transformer module imports the layers above

    r = get_recipe(recipe)
    if r is None:
        return []
    done: list[str] = []
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        children: tuple[str, ...] = ()
        if isinstance(mod, SwiGLU):
            children = SWIGLU_LINEARS
        elif isinstance(mod, Attention):
            children = mod.projections
        elif isinstance(mod, MTPModule):
            children = ("eh_proj",)
        elif isinstance(mod, GroupedExperts):
            mod.fp8_recipe = r
            done.append(name)
        for child in children:
            lin = getattr(mod, child, None)
            if lin is not None:
                _fp8_linear(lin, r)
                done.append(prefix + child)
    return sorted(done)


def apply_precision(model: nn.Module, precision: str) -> list[str]:
    """The FP8 GEMMs of ``parallel.precision`` (fp8 / mxfp8: :data:`~moetrain.precision.recipe.
    PLAN_PRECISION_TO_FP8`; "auto", bf16 and fp32 run none) swapped into the single-device (meta) model before it is
    parallelized; returns :func:`apply_fp8`'s names."""
    return apply_fp8(model, PLAN_PRECISION_TO_FP8.get(str(precision), "none"))


def held_format(module: nn.Module) -> HeldFormat | None:
    """How ``fp8_param`` holds the weights of ``module``: the fprop tile of an FP8 linear's weight or of FP8 routed
    experts' stacked weights (``recipe.py``'s tables), None for a module that runs no FP8 GEMM."""
    if not isinstance(module, (Fp8Linear, GroupedExperts)):
        return None
    r = module.fp8_recipe
    if r is None:
        return None
    if isinstance(module, GroupedExperts) and r.expert_scaling == "rowwise":
        return HeldFormat(r.expert_row_tile, r.fmt)
    return HeldFormat(r.weight_fprop_tile, r.fmt)


def hold_weights_in_fp8(model: nn.Module, traffic: ParamTraffic | None = None) -> list[str]:
    """FP8 primary weights (``parallel.fp8_param``, ``moetrain.precision.primary_weights``): wrap the weight of
    every module :func:`apply_fp8` switched as an FP8 master, in place, before FSDP2 shards the model (on meta or
    materialised). Parameter names, shapes and dtypes are unchanged; ``traffic`` counts their scale exchange.
    Returns the qualified parameter names held: none where no module runs FP8 GEMMs (``apply_fp8`` first; a
    pipeline stage of only the embedding has none). ``parallel.fp8_param`` without an FP8 precision is refused by
    the config.
    """
    done: list[str] = []
    for name, mod in model.named_modules():
        fmt = held_format(mod)
        if fmt is None:
            continue
        names = ("weight",) if isinstance(mod, Fp8Linear) else ("w13_E2FD", "w2_EDF")
        for pname in names:
            p = getattr(mod, pname)
            setattr(mod, pname, nn.Parameter(hold_in_fp8(p.detach(), fmt, traffic), requires_grad=p.requires_grad))
            done.append(f"{name}.{pname}" if name else pname)
    return sorted(done)
