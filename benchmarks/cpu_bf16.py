"""CPU "bf16" and emulated FP8: GEMM kernels and one tiny-preset training step, best of N, round-robin.

    .venv/bin/python benchmarks/cpu_bf16.py [--reps 3]

Prints (one thread, as each rank of the 2-process tiny run has):
* GEMMs at the tiny preset's shapes: fp32, torch's bf16 kernel, and moetrain.precision.cpu_bf16's emulation;
* float8_e4m3fn -> fp32: torch's ``.float()`` against ``quant.e4m3_to_float``;
* the FP8 reference's operand: ``quantise(...).dequantise()`` (fp8 tensor, table back) against ``fake_quantise``
  (the same values by fp32 rounding, what the training GEMMs multiply), 2048 x 384 in 1x128 and 128x1 tiles;
* forward + backward of the tiny preset on 32 x 64 tokens (one rank's micro-batch): fp32, bf16 autocast with
  torch's kernels, bf16 autocast emulated (GEMMs only, and GEMMs plus the attention core, the trainer's), and both
  FP8 recipes under the trainer's emulation.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Callable

import torch

from moetrain.model.config import get_preset
from moetrain.model.transformer import build_model
from moetrain.precision import FP8_DTYPE
from moetrain.precision.apply import apply_fp8
from moetrain.precision.cpu_bf16 import EmulatedBf16Gemms
from moetrain.precision.quant import e4m3_to_float, fake_quantise, quantise


def best_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Best time of ``reps`` calls of each function, in ms, the functions interleaved (a burst of load hits all)."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            best[k] = min(best[k], (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    print("GEMM (M, K, N)        fp32 ms   torch bf16 ms   emulated bf16 ms")
    for M, K, N in [(2048, 128, 2048), (2048, 2048, 128), (2048, 128, 384), (2048, 128, 128)]:
        a, b = torch.randn(M, K), torch.randn(K, N)
        ab, bb = a.bfloat16(), b.bfloat16()
        emu = EmulatedBf16Gemms()

        def emulated() -> torch.Tensor:
            with emu:
                return ab @ bb

        t = best_ms({"fp32": lambda: a @ b, "bf16": lambda: ab @ bb, "emu": emulated}, args.reps)
        print(f"{str((M, K, N)):20s} {t['fp32']:8.2f} {t['bf16']:15.2f} {t['emu']:18.2f}")

    x8 = (torch.randn(9216, 128) * 50).clamp(-448, 448).to(FP8_DTYPE)
    t = best_ms({"float": x8.float, "table": lambda: e4m3_to_float(x8)}, args.reps * 3)
    print(f"e4m3 -> fp32, 9216 x 128: .float() {t['float']:.2f} ms, e4m3_to_float {t['table']:.2f} ms")

    dy = torch.randn(2048, 384)
    for tile in ((1, 128), (128, 1)):
        t = best_ms({"q+deq": lambda: quantise(dy, tile).dequantise(), "fake": lambda: fake_quantise(dy, tile)},
                    args.reps * 3)
        print(f"FP8 operand 2048 x 384, tile {tile}: quantise+dequantise {t['q+deq']:.2f} ms, "
              f"fake_quantise {t['fake']:.2f} ms")

    cfg = get_preset("tiny")
    base = build_model(cfg, device="cpu")
    tok = torch.randint(0, cfg.vocab_size, (32, 64))
    lab = torch.randint(0, cfg.vocab_size, (32, 64))
    models = {"fp32": (base, None, False), "bf16 torch kernels": (base, None, True),
              "bf16 emulated GEMMs": (base, None, True), "bf16 emulated": (base, None, True)}
    for r in ("blockwise", "mxfp8"):
        m = copy.deepcopy(base)
        apply_fp8(m, r)
        models[f"{r} (bf16 emulated)"] = (m, r, True)

    def step_fn(name: str) -> Callable[[], None]:
        m, _, amp = models[name]

        def step() -> None:
            if "emulated" in name:
                mode = EmulatedBf16Gemms(attention=not name.endswith("GEMMs"))
            else:
                mode = contextlib.nullcontext()
            with mode:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    out = m(tok, lab)
                out.loss(cfg).backward()
            m.zero_grad(set_to_none=True)
        return step

    t = best_ms({k: step_fn(k) for k in models}, args.reps)
    print("tiny preset, forward + backward of 32 x 64 tokens (1 thread):")
    for k, v in t.items():
        print(f"  {k:26s} {v / 1e3:6.2f} s")


if __name__ == "__main__":
    main()
