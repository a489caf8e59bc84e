"""What moetrain's own model code launches in one forward + backward, counted (never timed) for local predictions.

A measured local machine (``moetrain bench``) runs PyTorch eager: every operator is a separate kernel that
streams its inputs and outputs through memory, and the GPU-style byte formulas of :mod:`moetrain.plan.model`
(fused kernels, BF16 activations) undercount that traffic about twofold. So for moetrain's own model the cost
model does not estimate the memory-bound work, it counts it: a ``TorchDispatchMode`` sees every aten operator of
one forward + backward at the run's sequence length and sorts it into

* **GEMMs** (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``_grouped_mm``): not counted here, the model times them
  from their FLOPs at the measured matmul rate;
* **views** (``view``, ``t``, ``expand`` ... and ``detach``, ``empty``): no data moves;
* **softmax family** (``_softmax``, ``_safe_softmax``, ``_log_softmax`` and their backward): exponential-bound
  on CPUs; the elements of the forwards are counted (charged at the bench's measured cross-entropy rate, which is
  per logit forward + backward), and their bytes like any other operator's. A fused (flash) attention forward
  counts the B x H x Lq x Lk scores it takes the softmax of, as the unfused math path did, and its bytes are its
  inputs and outputs: the scores never reach memory;
* **everything else** (elementwise, reductions, copies, gathers, scatters, fills): the bytes of all tensor
  inputs and outputs, charged at the measured memory bandwidth.

Counts are per pipeline item kind (``"d"`` dense block, ``"t"`` MoE block, ``"m"`` MTP module with its head and
loss, ``"L"`` the rest: embedding, final norm, head, loss), taken on a copy of the model cut to one block of each
kind, so counting costs a few small forward + backward passes whatever the depth. The passes run two and four
sequences: bytes grow linearly with the batch, and the difference separates the per-token traffic from the
per-micro-batch traffic of weight-sized operators (the embedding's gradient, weight layouts), which a per-token
figure taken at a small batch would multiply by the batch. Per-token figures hold at the counted sequence length
(attention's L x L terms); operator counts are per micro-batch. The code runs in fp32 (the trainer's CPU default).
The expert path counted is the single-process one (LocalDispatcher); the all-to-all dispatcher's own permutes
differ a little and its calls are counted separately
(:data:`moetrain.parallel.dispatch.AllToAllDispatcher.CALLS_DEDUP`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from moetrain.model.config import ModelConfig

GEMM_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "_grouped_mm"})
SOFTMAX_OPS = frozenset({"_softmax", "_safe_softmax", "_log_softmax"})
FUSED_ATTENTION_OPS = frozenset({"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})
NO_DATA_OPS = frozenset({"detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_like", "empty_strided",
                         "new_empty", "new_empty_strided", "_to_copy_meta"})
KINDS = ("E", "d", "t", "m", "L")
#: Sequences per counted pass: two batch sizes separate per-token from per-micro-batch bytes. Not 1: on tiny the
#: batch-1 pass moved less than the line through batches 2 and 4 predicts (batch-1 code paths differ in places),
#: which put ~5% extra per-token bytes on the dense block and a negative intercept on it.
COUNT_BATCHES = (2, 4)


@dataclass(frozen=True)
class CodeCounts:
    """Per item kind (``"E"``, ``"d"``, ``"t"``, ``"m"``, ``"L"``), what one forward + backward launches.

    Attributes:
        ops: aten operators per micro-batch (dispatch overhead is per operator, whatever its size).
        mem_bytes_per_token: bytes read + written by non-GEMM, non-view operators, per token.
        mem_bytes_per_micro_batch: the part of those bytes that does not grow with the batch (weight-sized).
        softmax_per_token: elements through softmax / log-softmax forwards, per token.
        a2a_calls: all-to-all calls per MoE layer of the dispatcher (forward + backward, recomputation included).
        seq_len: the sequence length counted at.
    """

    ops: dict[str, float]
    mem_bytes_per_token: dict[str, float]
    mem_bytes_per_micro_batch: dict[str, float]
    softmax_per_token: dict[str, float]
    a2a_calls: float
    seq_len: int


def counting_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` cut to one block of each kind: one dense layer (if any), one MoE layer, MTP depth <= 1."""
    n_dense = min(1, cfg.n_dense_layers)
    return cfg.replace(n_layers=n_dense + (1 if cfg.n_moe_layers else 0), n_dense_layers=n_dense,
                       mtp_depth=min(1, cfg.mtp_depth))


def counting_memory_bytes(cfg: ModelConfig, seq_len: int) -> float:
    """A generous estimate of the peak memory of counting (bytes): fp32 weights, gradients and slack of the cut
    model (4 x 4 bytes per parameter), plus the activations of the larger counted batch -- the logits (about four
    copies: logits, log-probabilities, their gradients) and ~200 model-width and the experts' vectors per token.
    Attention runs the flash kernel (linear in L, :class:`moetrain.model.deepseek.attention.MLA`), so no L x L term."""
    from moetrain.accounting import count_params

    B, L = COUNT_BATCHES[1], seq_len
    params = count_params(counting_config(cfg)).total_with_mtp * 16.0
    per_token = 4.0 * (4 * cfg.vocab_size + 200 * cfg.dim + 4 * cfg.top_k * (2 * cfg.expert_ffn_dim + cfg.dim))
    return params + B * L * per_token


def _check_fits_for_counting(cfg: ModelConfig, seq_len: int) -> None:
    need = counting_memory_bytes(cfg, seq_len)
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return
    if need > have / 2:
        raise ValueError(f"counting moetrain's operators for a local prediction runs one block of each kind of this "
                         f"model at sequence length {seq_len} (about {need / 2**30:.0f} GiB in fp32), more than half "
                         f"of this machine's {have / 2**30:.0f} GiB; a model or sequence this large does not train "
                         f"here -- predict it on a GPU type (--gpu) instead of --gpu local")


@lru_cache(maxsize=16)
def _count_cached(cfg_items: tuple, seq_len: int, batch: int) -> tuple[tuple[str, float, float, float], ...]:
    import torch

    cfg = ModelConfig.from_dict(dict(cfg_items))
    _check_fits_for_counting(cfg, seq_len)
    try:
        with torch.random.fork_rng(devices=[]):  # CPU only: never initialise CUDA to predict a CPU run
            rows = _count(counting_config(cfg), batch, seq_len)
    except RuntimeError as e:  # an allocation the estimate did not foresee
        raise ValueError(f"counting moetrain's operators at sequence length {seq_len} failed ({e}); the run is "
                         f"likely too large for this machine -- predict it on a GPU type (--gpu)") from None
    return tuple((k, *rows[k]) for k in KINDS)


def _tally_mode() -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def nbytes(xs: Any) -> int:
        return sum(x.numel() * x.element_size() for x in tree_flatten(xs)[0] if isinstance(x, torch.Tensor))

    class Tally(TorchDispatchMode):
        """Operators, non-GEMM bytes and softmax elements of everything run under it."""

        def __init__(self) -> None:
            super().__init__()
            self.ops, self.bytes, self.softmax = 0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.ops += 1
            name = func.overloadpacket.__name__
            if name in GEMM_OPS or func.is_view or name in NO_DATA_OPS:
                return out
            if name in SOFTMAX_OPS:
                self.softmax += args[0].numel()
            elif name in FUSED_ATTENTION_OPS:  # q (B, H, Lq, Dqk), k (B, H, Lk, Dqk)
                self.softmax += args[0].numel() // args[0].shape[-1] * args[1].shape[-2]
            self.bytes += nbytes((args, kwargs)) + nbytes(out)
            return out

    return Tally


def _count(cfg: ModelConfig, B: int, L: int) -> dict[str, tuple[float, float, float]]:
    """{kind: (ops, bytes, softmax elements)} of one forward + backward of ``B`` sequences of length ``L``.

    Blocks are counted alone (their input and output gradient made outside the count). What lies outside the
    blocks is counted on the whole model with every block swapped for a pass-through, so no routing decision
    (which varies with the data under learned routing) enters a difference: ``"L"`` without the MTP module,
    the MTP module's own glue, head and loss as the difference with it.
    """
    import torch
    from torch import nn

    from moetrain.model.transformer import build_model

    Tally = _tally_mode()

    def tally(fn: Any) -> tuple[float, float, float]:
        t = Tally()
        with t:
            fn()
        return float(t.ops), float(t.bytes), float(t.softmax)

    class PassThrough(nn.Module):
        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    valid: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
            return x, None

    torch.manual_seed(0)
    model = build_model(cfg, device="cpu", seed=0)
    cos, sin = model.rope(L, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (B, L))
    out: dict[str, tuple[float, float, float]] = {k: (0.0, 0.0, 0.0) for k in KINDS}

    blocks = [(("t" if cfg.is_moe_layer(i) else "d"), blk) for i, blk in enumerate(model.layers)]
    blocks += [("mtp-block", m.block) for m in model.mtp]
    counted: dict[str, tuple[float, float, float]] = {}
    for kind, blk in blocks:
        x = torch.randn(B, L, cfg.dim, requires_grad=True)
        g = torch.ones(B, L, cfg.dim)
        counted[kind] = tally(lambda blk=blk, x=x, g=g: blk(x, cos, sin)[0].backward(g))
    out["d"] = counted.get("d", out["d"])
    out["t"] = counted.get("t", out["t"])

    def whole() -> None:
        o = model(tokens, tokens)
        sum(o.mtp_loss_sums, o.lm_loss_sum).backward()

    model.layers = nn.ModuleList([PassThrough() for _ in model.layers])
    for m in model.mtp:
        m.block = PassThrough()
    with_mtp = tally(whole)
    model.mtp = nn.ModuleList()
    out["L"] = tally(whole)
    if cfg.mtp_depth:
        out["m"] = tuple(b + w - r for b, w, r in zip(counted["mtp-block"], with_mtp, out["L"]))  # type: ignore
    return out


def count_code(cfg: ModelConfig, seq_len: int, activation_checkpointing: bool = False) -> CodeCounts:
    """Count one forward + backward of moetrain's model code (see the module docstring) and the dispatcher's
    all-to-all calls per MoE layer (dropless with token dedup, the trainer's default; activation checkpointing
    repeats the forward calls).

    Args:
        cfg: the model; its ``routing`` selects the code path whose operators are counted (forced balance skips
            the top-k selection). Bytes are counted under forced balance (see the comment in the code).
        seq_len: the run's sequence length, 1 to ``cfg.max_seq_len`` (the trainer's limit too).
        activation_checkpointing: the trainer's ``parallel.recompute`` "full".

    Raises:
        ValueError: a sequence length outside 1..max_seq_len, or counting would need more than half of this
            machine's memory (:func:`counting_memory_bytes`) or failed to allocate.
    """
    from moetrain.parallel.dispatch import AllToAllDispatcher

    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"sequence length {seq_len!r} is outside 1..{cfg.max_seq_len} (model.max_seq_len); "
                         f"moetrain train refuses such a run too -- use a shorter --seq or a model with a larger "
                         f"max_seq_len")

    def rows(c: ModelConfig, batch: int) -> dict[str, list[float]]:
        return {k: r for k, *r in _count_cached(tuple(sorted(c.to_dict().items())), seq_len, batch)}

    # bytes at forced-balanced load: under learned routing the padded expert GEMMs' traffic follows the
    # (random, at init) loads of the counting batch; load imbalance is the cost model's to add
    balanced = cfg.replace(routing="balanced")
    lo, hi = rows(balanced, COUNT_BATCHES[0]), rows(balanced, COUNT_BATCHES[1])
    ops = rows(cfg, COUNT_BATCHES[0]) if cfg.routing != "balanced" else lo
    L = seq_len
    dB = COUNT_BATCHES[1] - COUNT_BATCHES[0]
    # bytes(B) = fixed + B * per_seq; softmax elements are all per token
    per_seq = {k: max(0.0, (hi[k][1] - lo[k][1]) / dB) for k in KINDS}
    fwd, bwd = AllToAllDispatcher.CALLS_DEDUP
    return CodeCounts(ops={k: ops[k][0] for k in KINDS},
                      mem_bytes_per_token={k: per_seq[k] / L for k in KINDS},
                      mem_bytes_per_micro_batch={k: max(0.0, lo[k][1] - COUNT_BATCHES[0] * per_seq[k]) for k in KINDS},
                      softmax_per_token={k: lo[k][2] / (COUNT_BATCHES[0] * L) for k in KINDS},
                      a2a_calls=fwd * (2 if activation_checkpointing else 1) + bwd, seq_len=L)
