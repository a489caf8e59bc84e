"""FP8 training recipes: which operand of which GEMM is quantised with which tiles.

A linear layer y = x W^T (x (M, K) tokens x in-features, W (N, K) out x in) runs three GEMMs per step, each with
both operands quantised along its contraction dim:

==========  ===================  =======================  =========================  ===========================
GEMM        product              contraction              blockwise (DeepSeek-V3)    mxfp8 (OCP MX, Blackwell)
==========  ===================  =======================  =========================  ===========================
fprop       y = x W^T            K (in-features)          x 1x128, W 128x128         x 1x32, W 1x32 (along K)
dgrad       dx = dy W            N (out-features)         dy 1x128, W 128x128        dy 1x32, W 32x1 (along N)
wgrad       dW = dy^T x          M (tokens)               dy 128x1, x 128x1          dy 32x1, x 32x1
==========  ===================  =======================  =========================  ===========================

Blockwise: DeepSeek-V3 report (arXiv 2412.19437) sec. 3.3.2 (1x128 activation tiles, 128x128 weight blocks, fp32
scales, E4M3 everywhere, fp32 accumulation), sec. 3.3.3 (the Linear's input is cached in FP8 for the backward)
and sec. 3.5.2 (the 1x128 FP8 activations are dequantised, transposed and re-quantised into 128x1 tiles for the
weight gradient). A 128x128 weight block is the same block read row- or column-wise, so one
quantised W serves fprop and dgrad. MXFP8: OCP MX v1.0 (32-element blocks, E8M0 scales); MX blocks are 1-D and
every operand is scaled along its GEMM's contraction dim, so W (and x, dy) is quantised once per direction from its
high-precision value (docs/reference.md section 13).

Routed experts (``expert_scaling``): E grouped GEMMs over rows grouped by expert, y_e = x_e W_e^T, W (E, N, K).

==========  ===========================================  ============================  ===========================
GEMM        "rowwise" (blockwise recipe)                 torch kernel (CUDA)           "tiles" (mxfp8 recipe)
==========  ===========================================  ============================  ===========================
fprop       x 1xWHOLE (per token), W 1xWHOLE (per out    ``_scaled_grouped_mm`` 2d-3d  the linear's tiles above
            row, per expert)
dgrad       dy 1xWHOLE (per token), W WHOLEx1 (per in    ``_scaled_grouped_mm`` 2d-3d  the linear's tiles above
            column over N, per expert)
wgrad       dy, x: one scale per (expert, column) over   ``_scaled_grouped_mm`` 2d-2d  the linear's tiles above
            that expert's tokens (``quant.quantise_groups``)
==========  ===========================================  ============================  ===========================

Why the blockwise recipe's experts are row-wise: torch 2.11 has no blockwise grouped FP8 GEMM on Hopper
(``F.scaled_grouped_mm`` with ``BlockWise1x128`` x ``BlockWise128x128`` raises "No gemm implementation was found"
on sm90), while the row-wise ``torch._scaled_grouped_mm`` has one, whose GEMM alone beats the bf16 grouped GEMM
(docs/fp8.md, "Routed experts", for the measurements, and for what the experts' whole forward and backward
measured). The same tiles are used on every device, CPU included, so a CPU run computes what
the GPU computes. The cost is coarser scales along the contraction: one outlier in a token row (or a weight row)
sets the scale of the whole row, where 1x128 tiles confine it to 128 elements (DeepSeek-V3 sec. 3.3.2's reason for
fine-grained tiles). The wgrad's x is quantised in the forward straight from x, per (expert, column), and kept as
FP8 for the backward; W is the parameter itself, quantised again (per column) for the dgrad. The mxfp8 recipe's
experts keep its 1x32 tiles and run the reference's GEMMs of dequantised values on every device (no MX grouped
kernel whose operands torch's checks can vet without a GPU; see ``grouped.py``).

Kept in high precision by both recipes (DeepSeek-V3 sec. 3.3.1): embedding, output head, MoE router, norms, the
attention core (softmax(QK^T)V); master weights, gradients and optimizer state are the model's own dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.precision.quant import WHOLE, ScaleFormat

RecipeName = Literal["none", "blockwise", "mxfp8"]
ExpertScaling = Literal["rowwise", "tiles"]
RECIPE_NAMES: tuple[str, ...] = ("none", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 training recipe.

    Attributes:
        name: "blockwise" or "mxfp8".
        fmt: scale format, "fp32" (any scale) or "e8m0" (powers of two).
        block: tile length along a GEMM's contraction dim for activations and gradients (128 or 32).
        weight_block: True when W uses square ``block x block`` tiles shared by fprop and dgrad (DeepSeek-V3);
            False when W is tiled 1 x block along each GEMM's contraction dim (MX).
        requantise_saved_input: the wgrad GEMM's x is the fprop's FP8 copy, dequantised and re-quantised in
            token-dim tiles (DeepSeek-V3 caches the Linear input in FP8); False: quantised from the saved input.
        group_align: rows of each expert group are padded to a multiple of this for the routed-expert grouped
            GEMM. "rowwise" experts: 16, so each group starts 16 bytes into the FP8 rows of the wgrad's operands
            (which contract over tokens; torch's grouped kernels need 16-byte aligned strides and group starts).
            "tiles": a multiple of ``block``, so the wgrad's token-dim tiles never straddle two experts.
        expert_scaling: tiling of the routed experts' grouped GEMMs (module docstring): "rowwise" (one scale per
            row / column / expert-column, the tiling of torch's FP8 grouped GEMM) or "tiles" (the linear's tiles).
    """

    name: str
    fmt: ScaleFormat
    block: int
    weight_block: bool
    requantise_saved_input: bool
    group_align: int
    expert_scaling: ExpertScaling = "tiles"

    @property
    def row_tile(self) -> tuple[int, int]:
        """Tile of an operand whose contraction dim is its last: (1, block)."""
        return (1, self.block)

    @property
    def col_tile(self) -> tuple[int, int]:
        """Tile of an operand whose contraction dim is its first (wgrad's token dim): (block, 1)."""
        return (self.block, 1)

    @property
    def weight_fprop_tile(self) -> tuple[int, int]:
        """Tile of W (N, K) in fprop (contraction over K)."""
        return (self.block, self.block) if self.weight_block else (1, self.block)

    @property
    def weight_dgrad_tile(self) -> tuple[int, int]:
        """Tile of W (N, K) in dgrad (contraction over N)."""
        return (self.block, self.block) if self.weight_block else (self.block, 1)

    @property
    def expert_row_tile(self) -> tuple[int, int]:
        """"rowwise" experts: one scale per row over the contraction (x, dy; W in fprop)."""
        return (1, WHOLE)

    @property
    def expert_col_tile(self) -> tuple[int, int]:
        """"rowwise" experts: one scale per column over the contraction (W in dgrad, which contracts over N)."""
        return (WHOLE, 1)


BLOCKWISE = Fp8Recipe("blockwise", "fp32", 128, weight_block=True, requantise_saved_input=True, group_align=16,
                      expert_scaling="rowwise")
MXFP8 = Fp8Recipe("mxfp8", "e8m0", 32, weight_block=False, requantise_saved_input=False, group_align=32,
                  expert_scaling="tiles")
RECIPES: dict[str, Fp8Recipe] = {"blockwise": BLOCKWISE, "mxfp8": MXFP8}


def get_recipe(recipe: str | Fp8Recipe | None) -> Fp8Recipe | None:
    """The recipe of an FP8 recipe name (``PLAN_PRECISION_TO_FP8`` of ``parallel.precision``): None for "none" or
    None, else the :class:`Fp8Recipe`.

    Raises:
        ValueError: an unknown name.
    """
    if recipe is None or isinstance(recipe, Fp8Recipe):
        return recipe
    if recipe == "none":
        return None
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}; allowed: {', '.join(map(repr, RECIPE_NAMES))}")
    return RECIPES[recipe]


#: ``parallel.precision`` / ``Plan.precision`` (:class:`moetrain.layout.Precision`) -> the FP8 recipe the GEMMs run:
#: "fp8" is DeepSeek-V3's blockwise recipe (the H800/H100 records), "mxfp8" the Blackwell one; the one such map.
#: ``dispatch_precision`` ("bf16" / "fp8") is the dispatcher's wire format value for value.
PLAN_PRECISION_TO_FP8: dict[str, str] = {"bf16": "none", "fp32": "none", "fp8": "blockwise", "mxfp8": "mxfp8"}
