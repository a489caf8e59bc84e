"""FP8 dispatch at EP = 2: rows cross the wire as E4M3 + 1x128 fp32 scales, at most 0.55x the bytes of BF16 rows,
and the experts receive exactly the dequantised rows; results within the FP8 tolerance of the BF16 dispatch."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.dispatch import AllToAllDispatcher, row_wire_bytes
from moetrain.precision.quant import fake_quantise

from tests.parallel.harness import ok_values, run_ranks

from .dispatch_workers import D, fp8_dispatch_run, inputs


def test_row_wire_bytes():
    assert row_wire_bytes(7168, torch.bfloat16, "bf16") == 14336
    assert row_wire_bytes(7168, torch.bfloat16, "fp8") == 7168 + 4 * 56  # 0.516x: DeepSeek-V3's hidden size
    assert row_wire_bytes(200, torch.float32, "fp8") == 200 + 8  # an edge tile has a scale too
    with pytest.raises(ConfigError):
        ParallelConfig(dispatch_precision="fp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AllToAllDispatcher(8, 2, 0, None, dispatch_dtype="e5m2")


@pytest.mark.dist
def test_fp8_dispatch_bytes_and_results():
    ranks = ok_values(run_ranks(2, fp8_dispatch_run))
    for src, r in enumerate(ranks):
        for path in ("dedup", "per_assignment"):
            bf, f8 = r[f"{path}-bf16"], r[f"{path}-fp8"]
            assert bf["rows_sent"] == f8["rows_sent"] > 0 and f8["x_dtype"] == "torch.bfloat16"
            assert bf["bytes_sent"] == bf["rows_sent"] * 2 * D
            assert f8["bytes_sent"] == f8["rows_sent"] * (D + 8)
            assert f8["bytes_sent"] <= 0.55 * bf["bytes_sent"] and f8["remote_bytes_sent"] <= 0.55 * bf["remote_bytes_sent"]
            # The experts get the rows' 1x128-tile FP8 values, dequantised (bf16 rows of the BF16 dispatch).
            torch.testing.assert_close(f8["x_AD"], fake_quantise(bf["x_AD"], (1, 128)).bfloat16().float(),
                                       rtol=0, atol=0)
            for k in ("y", "x_grad"):
                rel = (f8[k] - bf[k]).norm() / bf[k].norm()
                assert 0 < rel < 0.05, (path, k, rel.item())
    # Both ranks routed the same tokens whatever the wire format.
    assert inputs(0)[0].shape == (96, D)
