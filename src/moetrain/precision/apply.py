"""``apply_fp8``: switch a model's GEMMs to an FP8 recipe in place, keeping every parameter as it is."""

from __future__ import annotations

from torch import nn

from moetrain.model.layers import Attention, Linear, SwiGLU
from moetrain.model.experts import GroupedExperts
from moetrain.precision.linear import Fp8Linear
from moetrain.precision.recipe import Fp8Recipe, get_recipe

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
