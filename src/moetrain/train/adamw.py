"""AdamW whose states are held at the precision the layout names (:class:`moetrain.layout.OptimizerStates`).

* ``fp32``: torch's own (fused) ``torch.optim.AdamW`` on fp32 parameters (:func:`moetrain.train.optim.build_optimizer`).
* ``bf16-moments`` (DeepSeek-V3 report sec. 3.3.3, "low-precision optimizer states"): fp32 parameters (the master
  weights) and gradients, the two Adam moments stored in bf16. Each step reads the moments into fp32, updates them as
  torch's AdamW does, and rounds them back to bf16 (round to nearest even).
* ``bf16`` (Megatron-Core's precision-aware optimizer, TransformerEngine ``FusedAdam(store_param_remainders=True)``):
  bf16 parameters and gradients, bf16 moments, and the fp32 master kept exactly as the bf16 parameter (its high 16
  bits, rounded) plus a 16-bit remainder in the optimizer state (:func:`split_master`, :func:`join_master`): 2 + 2
  bytes per parameter instead of a 4-byte master beside a 2-byte weight.

The update is torch's AdamW in the order of torch's single-tensor implementation (``torch/optim/adamw.py``:
decoupled decay, ``lerp`` for the first moment, ``addcmul`` for the second, bias corrections, ``addcdiv``), so with
fp32 moments it equals ``torch.optim.AdamW(foreach=False)`` bit for bit (tested). Parameters may be DTensors (FSDP2
shards, experts over EP): the update runs on each rank's local shard, and the states are DTensors of the same
placement, so DCP checkpoints them by global name and reshards them like the parameters.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

_LOW_BITS = 16
_HALF = 1 << (_LOW_BITS - 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor as (bf16 weight, int16 remainder) that :func:`join_master` turns back into it bit for bit.

    The bf16 weight is the fp32 value rounded to nearest (ties away from zero in the bit pattern; round-to-nearest-
    even differs only at exact ties), the remainder the signed difference of the two bit patterns, which then lies
    in [-2^15, 2^15) and fits int16 (the scheme of TransformerEngine's ``store_param_remainders``).

    Args:
        master: fp32 tensor of any shape (not a DTensor).
    Returns:
        (bf16 tensor, int16 tensor), both of ``master``'s shape.
    Raises:
        TypeError: ``master`` is not fp32.
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split_master takes fp32, got {master.dtype}")
    bits = master.view(torch.int32)
    # floor((bits + 2^15) / 2^16): the high half rounded to nearest; an arithmetic shift keeps the sign half.
    high = torch.bitwise_right_shift(bits + _HALF, _LOW_BITS)
    remainder = bits - torch.bitwise_left_shift(high, _LOW_BITS)
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``weight`` and its int16 ``remainder`` (:func:`split_master`'s inverse).

    Args:
        weight: bf16 tensor; remainder: int16 tensor of the same shape (neither a DTensor).
    Returns:
        A new fp32 tensor of that shape.
    """
    high = weight.view(torch.int16).to(torch.int32)
    return (torch.bitwise_left_shift(high, _LOW_BITS) + remainder.to(torch.int32)).view(torch.float32)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter; torch's definition) with moments of ``moment_dtype``, and for bf16 parameters an
    exact fp32 master as (parameter, int16 remainder).

    Per parameter the state holds ``step`` (fp32 scalar tensor, as torch's AdamW), ``exp_avg`` and ``exp_avg_sq`` in
    ``moment_dtype`` and, for a bf16 parameter, ``master_remainder`` (int16). The state keys are torch's, so a
    checkpoint of any optimizer precision loads into any other (DCP converts the moments' dtype on load; the
    remainder is written by :meth:`set_master` from a loaded fp32 master).

    Args:
        params: parameters or parameter groups, fp32 or bf16 (DTensors allowed).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        moment_dtype: dtype the two moments are stored in (torch.bfloat16 for both reduced-precision states; fp32
            gives torch's AdamW).
    Raises:
        ValueError: a parameter neither fp32 nor bf16, or a bf16 parameter whose gradient is not bf16 or fp32.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.moment_dtype = moment_dtype
        for g in self.param_groups:
            for p in g["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"PrecisionAwareAdamW holds fp32 or bf16 parameters, got {p.dtype}")

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)
            if p.dtype == torch.bfloat16:
                st["master_remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        return st

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of ``p``'s local shard (a new tensor for bf16 parameters, ``p``'s own for fp32)."""
        w = _local(p.detach())
        if p.dtype == torch.float32:
            return w
        rem = self.state[p].get("master_remainder") if p in self.state else None
        return join_master(w, _local(rem)) if rem is not None else w.float()

    def set_master(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Write an fp32 master value into ``p``'s local shard (bf16 parameters: weight and remainder).

        Args:
            p: a parameter of this optimizer; master: fp32, the shape of ``p``'s local shard.
        """
        with torch.no_grad():
            w = _local(p.detach())
            if p.dtype == torch.float32:
                w.copy_(master)
                return
            high, rem = split_master(master.float().contiguous())
            w.copy_(high)
            _local(self._state(p)["master_remainder"]).copy_(rem)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Optimizer.load_state_dict``, keeping the states in their own dtypes: torch casts every state
        tensor but ``step`` to its parameter's dtype, which would hold bf16 moments in fp32 and round the int16
        remainders through bf16. A moment of another dtype (a checkpoint of other optimizer states) is converted."""
        kept = {i: {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq", "master_remainder")}
                for i, st in state_dict["state"].items()}
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in kept.get(i, {}).items():
                dtype = torch.int16 if k == "master_remainder" else self.moment_dtype
                self.state[p][k] = v.to(device=p.device, dtype=dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step on every parameter with a gradient. Returns ``closure()`` if given."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._state(p)
                st["step"] += 1
                step = float(st["step"])
                grad = _local(p.grad)
                m_store, v_store = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
                master = self.master(p)
                if p.dtype != torch.float32:
                    grad = grad.float()
                exp_avg = m_store if m_store.dtype == torch.float32 else m_store.float()
                exp_avg_sq = v_store if v_store.dtype == torch.float32 else v_store.float()
                master.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                master.addcdiv_(exp_avg, denom, value=-step_size)
                if exp_avg is not m_store:
                    m_store.copy_(exp_avg)
                    v_store.copy_(exp_avg_sq)
                if p.dtype != torch.float32:
                    self.set_master(p, master)
        return loss


def state_bytes_per_param(param_dtype: torch.dtype, moment_dtype: torch.dtype | None) -> int:
    """Bytes the optimizer holds per parameter element beyond the parameter and its gradient: the two moments, and
    for a bf16 parameter its 2-byte master remainder (torch's fp32 AdamW: ``moment_dtype`` None = the parameter's).
    """
    moment = (moment_dtype or param_dtype).itemsize
    return 2 * moment + (2 if param_dtype == torch.bfloat16 else 0)
