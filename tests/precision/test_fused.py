"""The compiled quantisers (precision.fused) trace our quant.py functions without thrashing dynamo: traced on a
CPU with the "eager" backend (no GPU, no C++ compiler needed), over the operands of a training step at several
token counts, they give quant.py's results bit for bit, never hit the recompile limit, and compile a bounded number
of graphs."""

from __future__ import annotations

import logging

import pytest
import torch

from moetrain.precision import fused
from moetrain.precision.quant import WHOLE, quantise, quantise_groups

torch._dynamo = pytest.importorskip("torch._dynamo")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def test_compiled_quantisers_equal_the_definitions_without_recompiling(monkeypatch, caplog):
    torch._dynamo.reset()
    fused._compiled.cache_clear()
    monkeypatch.setattr(fused, "compiles", lambda device: True)
    monkeypatch.setattr(fused, "BACKEND", "eager")
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="torch._dynamo")
    E, D, F = 4, 256, 128
    w13, w2 = torch.randn(E, 2 * F, D), torch.randn(E, D, F)
    lin_w = [torch.randn(n, k) for k, n in ((256, 384), (384, 256), (256, 48), (200, 136))]
    for tokens in (512, 640, 1024):  # token counts change from step to step
        x = torch.randn(tokens, D, dtype=torch.bfloat16)
        for w in lin_w:  # the linear's operands: x, W, dy and the wgrad's transposes
            xk = torch.randn(tokens, w.shape[1], dtype=torch.bfloat16)
            dy = torch.randn(tokens, w.shape[0], dtype=torch.bfloat16)
            for t, tile in ((xk, (1, 128)), (w, (128, 128)), (dy, (1, 128)), (dy.t(), (1, 128))):
                got, want = fused.quantise(t, tile), quantise(t, tile)
                assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)
            xq = fused.quantise(xk, (1, 128))
            got, want = fused.requantise_t(xq, (1, 128)), quantise(xq.dequantise().t(), (1, 128))
            assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)
        # the routed experts': rows of x, dy and W, W's columns, per-group columns
        for t in (x, w13, w2, w13.transpose(-2, -1)):
            got, want = fused.quantise(t, (1, WHOLE)), quantise(t, (1, WHOLE))
            assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)
        group = torch.arange(tokens) * E // tokens
        for col in (False, True):
            (d1, s1), (d0, s0) = fused.quantise_by_group(x, group, E, "fp32", 16, col), quantise_groups(x, group, E)
            assert _same(d1.contiguous(), d0) and torch.equal(s1, s0)
    assert "recompile_limit" not in caplog.text and "cache_size_limit" not in caplog.text
    assert not fused._failed and not torch._dynamo.utils.counters["graph_break"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 40, graphs


def test_tiles_and_formats_are_constants_of_the_traced_code_and_only_rows_vary(monkeypatch):
    """The tile sizes must be constants in the graph inductor compiles (a symbolic tile size made its reduction
    kernels 12-30x slower, BENCHMARKS.md "FP8 quantisers compiled"), and the token count the only symbolic size:
    one graph serves every token count."""
    torch._dynamo.reset()
    fused._compiled.cache_clear()
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(fused, "compiles", lambda device: True)
    monkeypatch.setattr(fused, "BACKEND", record)
    for tokens in (384, 640, 1024):
        x = torch.randn(tokens, 256, dtype=torch.bfloat16)
        got, want = fused.quantise(x, (1, 128)), quantise(x, (1, 128))
        assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert len(graphs) == 1, [g.code for g in graphs]  # the rows marked dynamic from the first call
    last = graphs[-1]
    symbolic = [n for n in last.graph.nodes if n.op == "placeholder" and not isinstance(n.meta.get("example_value"),
                                                                                       torch.Tensor)]
    assert len(symbolic) == 1, [n.name for n in symbolic]  # the row count, nothing else
    assert "128" in last.code and "256" in last.code  # the tile and the static width are literals


def test_inductor_compiles_the_quantisers_with_eager_division_and_subnormals(monkeypatch):
    """Triton's fp32 division is approximate unless inductor is told otherwise, and about 0.5% of the quotients x / s
    of bf16 data lie within one ulp of an E4M3 rounding midpoint (benchmarks/fp8_division_rounding.py): the
    compiled quantisers must be built with eager's numerics, under option names this torch knows (an unknown one
    makes torch.compile raise at the first call, which fused.py would turn into an eager fallback)."""
    import torch._inductor.config as inductor_config

    assert set(fused.INDUCTOR_OPTIONS) <= set(inductor_config.get_config_copy())
    assert fused.INDUCTOR_OPTIONS == {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}
    seen: list[dict | None] = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw.get("options"))
        return real(fn, **{**kw, "backend": "eager", "options": None})

    fused._compiled.cache_clear()
    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr(fused, "compiles", lambda device: True)
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    got, want = fused.quantise(x, (1, 128)), quantise(x, (1, 128))
    assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert seen == [fused.INDUCTOR_OPTIONS]
    fused._compiled.cache_clear()
