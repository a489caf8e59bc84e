"""Block-scaled FP8 weights in safetensors checkpoints, the format of the released DeepSeek-V3 weights and of HF's
"fine-grained FP8" (``quantization_config.quant_method = "fp8"``, ``weight_block_size = [128, 128]``): a 2-D weight
is stored as float8_e4m3fn beside ``<name>_scale_inv`` (fp32, one value per 128x128 block, edge blocks cropped) and
W = W_fp8 * scale_inv. Which weights a model stores this way is its state-dict adapter's choice
(:meth:`moetrain.interop.adapter.StateDictAdapter.is_fp8_weight`); this module knows no model.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from moetrain.errors import CheckpointError
from moetrain.interop.safetensors_io import HFSpec, ShardFetch, fmt_shape
from moetrain.precision.quant import quantise

FP8_BLOCK = 128
#: Suffix of the tensor that holds an FP8 weight's block scales (``<name>_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
#: safetensors dtype names of FP8 tensors (``safe_open(...).get_slice(k).get_dtype()``).
FP8_ST_DTYPES = ("F8_E4M3", "F8_E5M2")
#: config.json's ``quantization_config`` of the release (README_WEIGHTS.md; docs/reference.md section 13).
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def dequantize_fp8_blockwise(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """W = W_fp8 * scale_inv per ``block`` x ``block`` tile (edge tiles cropped). Returns fp32 (out, in).

    ``scale_inv`` has shape (ceil(out/block), ceil(in/block)), as in the released DeepSeek-V3 FP8 weights.

    Raises:
        CheckpointError: the weight is not 2-D, or the scale's shape does not fit it.
    """
    if w_fp8.dim() != 2:
        raise CheckpointError(f"FP8 block dequantisation needs a 2-D weight, got shape {tuple(w_fp8.shape)}")
    rows, cols = w_fp8.shape
    want = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"scale_inv of shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} weight "
                              f"in {block}x{block} blocks (expected {want})")
    s = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w_fp8.float() * s


def check_scale_shape(key: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """Check, from headers alone, that FP8 tensor ``key`` of ``shape`` has a scale of the 128x128-block shape.

    Raises:
        CheckpointError: the weight is not 2-D or the scale has another shape.
    """
    want = tuple(math.ceil(n / FP8_BLOCK) for n in shape)
    if len(shape) != 2 or scale_shape != want:
        raise CheckpointError(f"FP8 tensor {key!r} of shape {fmt_shape(shape)} has a {key}{SCALE_SUFFIX} of shape "
                              f"{fmt_shape(scale_shape)}; {FP8_BLOCK}x{FP8_BLOCK} blocks need {fmt_shape(want)}")


def fp8_specs(specs: list[HFSpec], is_fp8_weight: Callable[[str], bool]) -> tuple[list[HFSpec], dict[str, HFSpec]]:
    """The tensors of the FP8 export of ``specs``: each 2-D floating weight that ``is_fp8_weight(hf_name)`` selects
    as float8_e4m3fn, followed by its ``<name>_scale_inv`` (fp32, (ceil(out/128), ceil(in/128))); the rest unchanged.
    Also returns the original spec of each FP8 weight and scale, by HF name, to read its source values."""
    out: list[HFSpec] = []
    source: dict[str, HFSpec] = {}
    for sp in specs:
        if not (is_fp8_weight(sp.hf_name) and len(sp.shape) == 2 and sp.dtype.is_floating_point):
            out.append(sp)
            continue
        rows, cols = sp.shape
        scale = HFSpec(sp.hf_name + SCALE_SUFFIX, (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), torch.float32,
                       sp.name, sp.region)
        out += [HFSpec(sp.hf_name, sp.shape, torch.float8_e4m3fn, sp.name, sp.region), scale]
        source[sp.hf_name] = source[scale.hf_name] = sp
    return out, source


def fp8_fetch(fetch: ShardFetch, source: dict[str, HFSpec]) -> ShardFetch:
    """Wrap a shard ``fetch`` of high-precision tensors into one of the FP8 specs of :func:`fp8_specs`: each FP8
    weight is read in its source dtype and quantised per 128x128 block (``moetrain.precision.quantise``: E4M3 of
    W / s, s = block amax / 448, which the loader's W_fp8 * weight_scale_inv dequantises back exactly)."""

    def fetch_fp8(shard: list[HFSpec]) -> dict[str, torch.Tensor]:
        plain = [sp for sp in shard if sp.hf_name not in source]
        wanted = list(dict.fromkeys(source[sp.hf_name].hf_name for sp in shard if sp.hf_name in source))
        got = fetch(plain + [source[n] for n in wanted])
        out: dict[str, torch.Tensor] = {}
        for n in wanted:
            q = quantise(got.pop(n), (FP8_BLOCK, FP8_BLOCK), "fp32")
            out[n], out[n + SCALE_SUFFIX] = q.data, q.scale
        return {sp.hf_name: (out[sp.hf_name] if sp.hf_name in source else got[sp.hf_name]) for sp in shard}

    return fetch_fp8
