"""The compiled FP8 quantisers (``moetrain.precision.fused``) against two other ways to run the same functions:
eager, and compiled with the tile passed as an argument of one dynamic-shape function (how they were compiled
before: every tile size a symbolic int). ``python benchmarks/fused_quantisers.py [--rows N]``; on CUDA when there
is a GPU, else on CPU (inductor's C++ backend, which needs a compiler). Prints ms per call (best of 5 after two
warm-ups) and the ratios, for the operands of a DeepSeek-V3 linear and expert GEMM.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetrain.precision import fused  # noqa: E402
from moetrain.precision.quant import WHOLE, quantise_tiles  # noqa: E402


def best_ms(fn, *args) -> float:
    fn(*args)
    fn(*args)
    dev = args[0].device
    ts = []
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * min(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="token rows (default 16384 on CUDA, 2048 on CPU)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(2)
    rows = args.rows or (16384 if dev.type == "cuda" else 2048)
    fused.compiles = lambda device: True  # the compiled path on CPU too
    tile_as_argument = torch.compile(quantise_tiles, dynamic=True)
    cases = [("activation 1x128", torch.randn(rows, 7168, device=dev, dtype=torch.bfloat16), (1, 128)),
             ("weight 128x128", torch.randn(2048, 7168, device=dev), (128, 128)),
             ("expert rows 1xK", torch.randn(rows, 7168, device=dev, dtype=torch.bfloat16), (1, WHOLE))]
    print(f"{dev.type}, torch {torch.__version__}, {rows} rows")
    print(f"{'operand':<20} {'eager':>9} {'tile arg':>9} {'fused':>9}  tile-arg/fused  eager/fused")
    for name, x, tile in cases:
        t_eager = best_ms(quantise_tiles, x, (min(tile[0], x.shape[0]), min(tile[1], x.shape[1])), "fp32")
        t_arg = best_ms(tile_as_argument, x, (min(tile[0], x.shape[0]), min(tile[1], x.shape[1])), "fp32")
        t_fused = best_ms(fused.quantise, x, tile)
        print(f"{name:<20} {t_eager:9.3f} {t_arg:9.3f} {t_fused:9.3f}  {t_arg / t_fused:14.1f}  {t_eager / t_fused:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
