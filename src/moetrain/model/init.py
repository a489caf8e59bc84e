"""Layout-independent weight initialisation: every value is a function of (seed, parameter name, position).

A distributed run materialises only its own shard of each parameter and must still hold exactly the numbers a
single process would draw, whatever the layout (1 process, DP x EP of any shape, later PP). So nothing is drawn
from a global random stream: a tensor of global shape (d0, ...) is cut along dim 0 into blocks of
``block_rows(shape)`` rows -- a function of the global shape only -- and block b is drawn from its own generator,
seeded by sha256(seed, name, b). For routed experts (E, ., .) a row is one expert, so each expert is drawn from a
generator seeded by its global expert index. A shard (a box of the global tensor) draws only the blocks it
intersects, so the transient buffer is one block (<= ``BLOCK_ELEMS`` elements, or one row if a row is larger).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

#: Target elements per generator block. Changing it changes every initial weight: keep it fixed.
BLOCK_ELEMS = 1 << 20

#: ``shard_box(t) -> (global_shape, offsets, local)``: where this process's part of ``t`` sits in the global tensor.
ShardBox = Callable[[torch.Tensor], tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]


def full_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """The single-process box: the whole tensor at offset 0."""
    return tuple(t.shape), (0,) * t.dim(), t


def block_rows(shape: Sequence[int]) -> int:
    """Rows of dim 0 drawn from one generator for a tensor of global ``shape``."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMS // max(row, 1))


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of parameter ``name`` (63-bit, from sha256)."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def normal_box_(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], name: str, seed: int,
                std: float) -> torch.Tensor:
    """Fill ``local`` -- the box [offsets, offsets + local.shape) of a global (``global_shape``) tensor called
    ``name`` -- with its N(0, std^2) values under the block scheme above. Drawn in fp32 on the CPU, then copied
    (so the numbers do not depend on the device or dtype of ``local``). Returns ``local``.

    Raises:
        ValueError: the box does not fit inside ``global_shape``.
    """
    if len(global_shape) != local.dim() or any(o < 0 or o + n > g for o, n, g in
                                                zip(offsets, local.shape, global_shape)):
        raise ValueError(f"{name}: box at {tuple(offsets)} of shape {tuple(local.shape)} is outside the global shape "
                         f"{tuple(global_shape)}")
    if local.numel() == 0:
        return local
    if local.dim() == 0:
        g = torch.Generator().manual_seed(block_seed(seed, name, 0))
        return local.copy_(torch.empty(()).normal_(0.0, std, generator=g))
    rows_per = block_rows(global_shape)
    r0, r1 = offsets[0], offsets[0] + local.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:]))
    for b in range(r0 // rows_per, (r1 - 1) // rows_per + 1):
        b0, b1 = b * rows_per, min((b + 1) * rows_per, global_shape[0])
        g = torch.Generator().manual_seed(block_seed(seed, name, b))
        block = torch.empty((b1 - b0, *global_shape[1:])).normal_(0.0, std, generator=g)
        lo, hi = max(b0, r0), min(b1, r1)
        local[lo - r0:hi - r0].copy_(block[(slice(lo - b0, hi - b0), *inner)])
    return local
