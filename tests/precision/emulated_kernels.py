"""CPU emulators of the CUDA FP8 GEMMs moetrain calls, reading operands and scales exactly where the kernels read
them: each asserts the layout (dtypes, shapes, strides) the CUDA kernel requires, then computes from the values at
the positions the kernel would take them from. Patched in where gemm.py / grouped.py call the kernels (with the
device gates patched to True), they prove by values that a scale sits on its row, column, block and group, which
the fake-CUDA tests (shapes and strides only, torch's meta checks) cannot.

* :class:`EmulatedScaledMM`: ``F`` for gemm.py, ``F.scaled_mm`` with blockwise (1x128 / 128x128) scales.
* :class:`EmulatedScaledGroupedMM`: ``torch._scaled_grouped_mm`` with row-wise fp32 scales, 2d x 3d and 2d x 2d.
"""

from __future__ import annotations

from typing import Callable

import torch

FP8 = torch.float8_e4m3fn


class EmulatedScaledMM:
    """``F`` for gemm.py with ``scaled_mm`` computed on CPU from the operands as cuBLAS reads them (blockwise
    recipes only): mat_a (M, K) row-major, mat_b (K, N) column-major; BlockWise1x128 scales of A: sa[m, kb] for
    a[m, 128 kb : 128 (kb + 1)], shape (M, K/128), strides (1, M); BlockWise128x128 scales of B: sb[kb, nb] for the
    128x128 block (kb, nb) of mat_b, shape (round_up(K/128, 4), N/128), strides (1, L4), rows past K/128 unread;
    BlockWise1x128 scales of B: sb[n, kb] for mat_b[128 kb : 128 (kb + 1), n], shape (N, K/128), strides (1, N)
    (torch/_meta_registrations.py, _check_scaled_mm_sizes_v2; the H200 runs of GPU_FACTS). Checks the strides too,
    so it reads values exactly where the kernel would."""

    ScalingType = torch.nn.functional.ScalingType

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def scaled_mm(self, a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16, **_):
        S = self.ScalingType
        self.calls += 1
        (M, K), N = a.shape, b.shape[1]
        assert a.stride() == (K, 1) and b.stride() == (1, K) and K % 128 == 0 and ra == S.BlockWise1x128
        Kb = K // 128
        assert sa.shape == (M, Kb) and (sa.stride() == (1, M) or Kb == 1)
        a_f = a.float().view(M, Kb, 128) * sa.unsqueeze(-1)
        b_f = b.float().t().reshape(N, Kb, 128)  # b_f[n, kb, i] = mat_b[128 kb + i, n]
        if rb == S.BlockWise128x128:
            assert N % 128 == 0 and sb.shape == (-(-Kb // 4) * 4, N // 128) and sb.stride() == (1, sb.shape[0])
            s = sb[:Kb].t().repeat_interleave(128, dim=0)  # (N, Kb): block (kb, n // 128)
        else:
            assert rb == S.BlockWise1x128 and sb.shape == (N, Kb) and (sb.stride() == (1, N) or Kb == 1)
            s = sb
        b_f = b_f * s.unsqueeze(-1)
        return (a_f.reshape(M, K) @ b_f.reshape(N, K).t()).to(output_dtype)


def _check_fp8_operand(name: str, mat: torch.Tensor, row_major: bool) -> None:
    """torch's checks of a ``_scaled_grouped_mm`` operand (``_meta_grouped_mm_common``): E4M3, row-major (mat_a)
    or column-major (mat_b) in the last two dims, the leading stride a multiple of 16 bytes."""
    assert mat.dtype == FP8, f"{name}: {mat.dtype}, the kernel reads E4M3"
    s = mat.stride()
    if row_major:
        assert s[-1] == 1 and s[-2] > 1 and s[-2] >= mat.shape[-1], f"{name} not row-major: strides {s}"
        lead = s[-2]
    else:
        assert s[-2] == 1 and s[-1] > 1 and s[-1] >= mat.shape[-2], f"{name} not column-major: strides {s}"
        lead = s[-1]
    assert lead % 16 == 0, f"{name}: leading stride {lead} is not a multiple of 16 bytes"


class EmulatedScaledGroupedMM:
    """``torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=..., out_dtype=bf16)`` with row-wise fp32
    scales, on CPU, reading values where the CUDA kernel reads them (layouts from torch/_meta_registrations.py,
    ``_meta_grouped_mm_common``, and torch's test_matmul_cuda.py ``test_scaled_grouped_gemm_2d_3d`` /
    ``_2d_2d``, which define the order of the scales):

    * 2d x 3d: mat_a (total_M, K) row-major, rows grouped by ``offs`` (int32 cumulative ends, one per group);
      mat_b (G, K, N) column-major in its last two dims (the (G, N, K) weights transposed); scale_a (total_M,)
      contiguous, one per row of A; scale_b (G, N) contiguous, one per (group, column). out (total_M, N):
      out[m] = sa[m] * sb[g(m)] * (a[m] @ b[g(m)]); rows past offs[-1] are not written (``unwritten``).
    * 2d x 2d: mat_a (M, total_K) row-major, mat_b (total_K, N) column-major, K grouped by ``offs``; scale_a
      (G * M,) and scale_b (G * N,) contiguous, group-major: scale_a[g * M + m], scale_b[g * N + n]. out (G, M, N):
      out[g] = sa[g] sb[g]^T * (a[:, k_g] @ b[k_g, :]); an empty group gives ``empty_group`` (0: the sum over no
      products). Each group must start 16 bytes into the contracted FP8 rows (offs multiples of 16), the alignment
      grouped.aligned_layout gives the groups for the kernel's loads.

    The products of E4M3 values are exact in fp32, summed in fp32, then scaled (the epilogue) and rounded once to
    bf16. ``perturb`` (tests only) maps (kind, scale_a, scale_b) -> (scale_a, scale_b) before they are read, kind
    "2d3d" or "2d2d": a deliberately misplaced scale, which a test must catch.
    """

    def __init__(self, unwritten: float = float("nan"), empty_group: float = 0.0,
                 perturb: Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.unwritten, self.empty_group, self.perturb = unwritten, empty_group, perturb
        self.calls: list[str] = []

    def __call__(self, mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False):
        assert bias is None and scale_result is None, "not supported by torch's kernel"
        assert out_dtype in (None, torch.bfloat16), f"out_dtype {out_dtype}: the kernel writes bf16 only"
        assert mat_a.dim() == 2 and mat_b.dim() in (2, 3), (mat_a.shape, mat_b.shape)
        _check_fp8_operand("mat_a", mat_a, row_major=True)
        _check_fp8_operand("mat_b", mat_b, row_major=False)
        assert scale_a.dtype == scale_b.dtype == torch.float32, (scale_a.dtype, scale_b.dtype)
        assert offs is not None and offs.dim() == 1 and offs.dtype == torch.int32, offs
        ends = offs.tolist()
        assert all(a <= b for a, b in zip([0] + ends, ends)), f"offs {ends} not non-decreasing"
        if mat_b.dim() == 3:
            return self._2d3d(mat_a, mat_b, scale_a, scale_b, ends)
        return self._2d2d(mat_a, mat_b, scale_a, scale_b, ends)

    def _2d3d(self, a, b, sa, sb, ends):
        self.calls.append("2d3d")
        (T, K), (G, Kb, N) = a.shape, b.shape
        assert Kb == K and len(ends) == G and ends[-1] <= T, (a.shape, b.shape, ends)
        assert sa.shape == (T,) and sa.is_contiguous(), (sa.shape, sa.stride())
        assert sb.shape == (G, N) and sb.is_contiguous(), (sb.shape, sb.stride())
        if self.perturb:
            sa, sb = self.perturb("2d3d", sa, sb)
        out = torch.full((T, N), self.unwritten, dtype=torch.bfloat16)
        for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
            acc = a[s:e].float() @ b[g].float()
            out[s:e] = (acc * sa[s:e, None] * sb[g][None, :]).bfloat16()
        return out

    def _2d2d(self, a, b, sa, sb, ends):
        self.calls.append("2d2d")
        (M, T), (Tb, N) = a.shape, b.shape
        G = len(ends)
        assert Tb == T and ends[-1] <= T, (a.shape, b.shape, ends)
        assert all(e % 16 == 0 for e in ends), f"offs {ends}: groups must start at 16-byte multiples"
        assert sa.shape == (G * M,) and sa.is_contiguous(), (sa.shape, sa.stride())
        assert sb.shape == (G * N,) and sb.is_contiguous(), (sb.shape, sb.stride())
        if self.perturb:
            sa, sb = self.perturb("2d2d", sa, sb)
        out = torch.empty(G, M, N, dtype=torch.bfloat16)
        for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
            if s == e:
                out[g] = self.empty_group
                continue
            acc = a[:, s:e].float() @ b[s:e].float()
            out[g] = (acc * sa[g * M:(g + 1) * M, None] * sb[g * N:(g + 1) * N][None, :]).bfloat16()
        return out
