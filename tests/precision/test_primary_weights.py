"""FP8 primary weights (``parallel.fp8_param``, ``moetrain.precision.primary_weights``): a weight quantised in
blocks (FSDP shards, tiles straddling them) equals it quantised whole; the FP8 copy is made once per change of the
weight; the FP8 GEMMs reading it compute what they compute without it (bit for bit where the backward reads the
forward's tiles); under FSDP2 on 2 gloo ranks the all-gather moves FP8 bytes (half of bf16's) and the ranks compute
what one process computes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.precision.apply import hold_weights_in_fp8
from moetrain.precision.linear import Fp8Linear
from moetrain.precision.primary_weights import (Fp8MasterWeight, HeldFormat, held_quantised, note_written,
                                                unwrapped, weight_operand)
from moetrain.precision.quant import WHOLE, block_tile_amax, quantise, quantise_block, scales_from_amax, tile_amax
from moetrain.precision.recipe import BLOCKWISE, MXFP8

from tests.parallel.harness import ok_values, run_ranks
from tests.parallel.pipeline_workers import pipeline_train_run
from tests.precision.primary_weight_workers import fsdp_linears_run

TILES = [(128, 128), (1, 32), (32, 1), (1, WHOLE), (WHOLE, 1)]


@pytest.mark.parametrize("fmt", ["fp32", "e8m0"])
@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_weight_quantised_in_blocks_equals_it_quantised_whole(tile, fmt, dim):
    """Three blocks along ``dim`` at offsets that cut through tiles: the maximum over the blocks' partial tile maxima
    is each tile's maximum, and each block quantised with the resulting scales is its part of the whole."""
    torch.manual_seed(0)
    full = torch.randn(3, 200, 150) * torch.logspace(-2, 2, 150)  # columns of very different magnitudes
    cuts = {0: [0, 1, 2, 3], 1: [0, 77, 130, 200], 2: [0, 45, 101, 150]}[dim]
    blocks = [(full.narrow(dim, a, b - a), tuple(a if d == dim else 0 for d in range(3)))
              for a, b in zip(cuts, cuts[1:])]
    amax = torch.stack([block_tile_amax(x, tile, tuple(full.shape), off) for x, off in blocks]).amax(0)
    assert torch.equal(amax, tile_amax(full, tile))
    scale = scales_from_amax(amax, fmt)
    whole = quantise(full, tile, fmt)
    assert torch.equal(scale, whole.scale)
    data = torch.cat([quantise_block(x, tile, scale, tuple(full.shape), off) for x, off in blocks], dim=dim)
    assert torch.equal(data.view(torch.uint8), whole.data.view(torch.uint8))


def _held_linear(recipe, n: int = 160, k: int = 192) -> tuple[Fp8Linear, Fp8Linear]:
    torch.manual_seed(1)
    plain = nn.Linear(k, n, bias=False)
    plain.__class__ = Fp8Linear
    plain.fp8_recipe = recipe
    held = copy.deepcopy(plain)
    assert hold_weights_in_fp8(nn.ModuleList([held])) == ["0.weight"]
    return plain, held


def test_the_fp8_copy_is_made_once_per_change_of_the_weight():
    _, lin = _held_linear(BLOCKWISE)
    w = lin.weight
    assert isinstance(w, Fp8MasterWeight) and isinstance(w, nn.Parameter) and w.dtype == torch.float32
    first = held_quantised(w)
    assert held_quantised(w).data is first.data  # read again: the same FP8 tensor, not a new quantisation
    x = torch.randn(8, 192)
    lin(x).sum().backward()
    assert held_quantised(w).data is first.data and type(w.grad) is torch.Tensor
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    opt.step()  # an optimizer step writes the weight: the FP8 copy follows it
    after = held_quantised(w)
    assert after.data is not first.data
    assert torch.equal(after.data.view(torch.uint8), quantise(unwrapped(w).detach(), (128, 128)).data.view(torch.uint8))
    with torch.no_grad():
        unwrapped(w).mul_(2)  # a write past the wrapper (a checkpoint load) is noted by the caller
    note_written(w)
    assert torch.equal(held_quantised(w).scale, 2 * after.scale)


@pytest.mark.parametrize("recipe", [BLOCKWISE, MXFP8], ids=["blockwise", "mxfp8"])
def test_an_fp8_linear_reading_its_held_weight(recipe):
    """Blockwise: the dgrad reads the 128x128 blocks of the forward, so all three GEMMs are bit-identical. MXFP8:
    the forward and the wgrad are; the dgrad's 32x1 weight tiles are quantised again from the held 1x32 FP8 values
    (the second quantisation, docs/fp8.md), so dx moves by about E4M3's rounding."""
    plain, held = _held_linear(recipe)
    x = torch.randn(48, 192, requires_grad=True)
    y0 = plain(x)
    y0.square().sum().backward()
    dx0, x.grad = x.grad, None
    y1 = held(x)
    y1.square().sum().backward()
    assert torch.equal(y0, y1) and torch.equal(plain.weight.grad, held.weight.grad)
    if recipe is BLOCKWISE:
        assert torch.equal(dx0, x.grad)
    else:
        err = ((dx0 - x.grad).norm() / dx0.norm()).item()
        assert 0 < err < 2 ** -4, err
        second = weight_operand(held.weight, recipe.weight_dgrad_tile, recipe.fmt, kernel=False)
        assert torch.equal(second, quantise(held_quantised(held.weight).dequantise(), (32, 1), "e8m0").dequantise())


def test_hold_leaves_a_model_without_fp8_gemms_and_refuses_a_second_hold():
    assert hold_weights_in_fp8(nn.Sequential(nn.Linear(4, 4))) == []
    with pytest.raises(ConfigError, match="set parallel.precision to fp8 or mxfp8"):
        ParallelConfig(fp8_param=True)
    _, lin = _held_linear(BLOCKWISE)
    with pytest.raises(TypeError, match="held in FP8 already"):
        hold_weights_in_fp8(nn.ModuleList([lin]))


def test_fsdp_gathers_half_the_bytes_and_the_ranks_compute_what_one_process_computes():
    """Two FP8 linears (160 x 192: FSDP's 80-row shards cut a 128x128 block; 100 x 160: uneven shards, one padded)
    under FSDP2 with bf16 parameters on 2 ranks, with and without fp8_param: each rank's forward and input
    gradient equal one process's bit for bit, the reduced weight gradient the sum of the ranks' within fp32
    rounding, and the all-gathers carry one byte per weight element instead of bf16's two."""
    runs = ok_values(run_ranks(2, fsdp_linears_run))
    for r in runs:
        for held in (False, True):
            got = r[held]
            assert torch.equal(got["y"], got["y_ref"]) and torch.equal(got["dx"], got["dx_ref"])
            for g, ref in zip(got["dw"], got["dw_ref"]):
                torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)
        assert r[False]["gathered"] == 2 * r[True]["gathered"] > 0
        assert r[False]["scale_bytes"] == 0 < r[True]["scale_bytes"] < r[True]["gathered"] / 1000
        assert r[True]["held"] == [True, True] and r[False]["held"] == [False, False]


@pytest.mark.parametrize("precision", ["fp8", pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_the_trainer_with_fp8_primary_weights_follows_fp8_without(precision):
    """EP 2 on 2 ranks, the trainer's model parts and step: the first step's loss is bit-identical (the same
    forward); later steps differ by the routed experts' (and MXFP8's linears') second dgrad quantisation, which
    measured a 0.11% / 0.13% largest gap over 20 steps against 0.04-0.05% for a change of summation order alone
    (docs/fp8.md, "FP8 primary weights")."""
    runs = {held: ok_values(run_ranks(2, pipeline_train_run, {"ep": 2, "precision": precision,
                                                              "fp8_param": held}, 3))[0]["losses"]
            for held in (False, True)}
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[False][1:], runs[True][1:]):
        assert b == pytest.approx(a, rel=2e-3)


def test_an_fp8_param_run_is_evaluated_at_another_layout_in_fp32_and_planned_only_with_fp8():
    """``moetrain eval --nproc N`` computes in fp32, so it drops the run's FP8 primary weights with its FP8 GEMMs
    (a run of them was refused); the planner refuses fp8_param with a precision that has no FP8 GEMMs."""
    from moetrain.config import JobConfig
    from moetrain.plan import Plan, PlanError, predict
    from moetrain.train.evaluate import _layout_job

    job = JobConfig(parallel=ParallelConfig(precision="fp8", fp8_param=True, ep=2))
    evaluated = _layout_job(job, nproc=2, ep=2, pp=None, device="cpu", mbs=2)
    assert evaluated.parallel.precision == "fp32" and evaluated.parallel.fp8_param is False
    for precision in ("bf16", "fp32"):
        with pytest.raises(PlanError, match="fp8_param .* needs precision 'fp8' or 'mxfp8'"):
            predict("small", "h100", 64, Plan(ep=8, precision=precision, fp8_param=True))


@pytest.mark.slow
@pytest.mark.dist
def test_the_trainer_logs_the_bytes_gathered_per_step_whatever_the_evaluation(tmp_path):
    """``param_gather_bytes_per_step`` from FSDP2's all-gathers (2 ranks, EP 2, evaluation after every step, which
    reshards what it gathered): the same every step up to the FP8 scale exchange (which follows an optimizer step
    and so lands in the evaluation after it), and with fp8_param the FP8-held weights move a quarter of their fp32
    bytes (CPU parameters are fp32)."""
    per_step = {}
    for held in (False, True):
        out = tmp_path / str(held)
        cmd = [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--out", str(out), "--nproc", "2",
               "--ep", "2", "--steps", "3", "--set", "parallel.precision=fp8", "--set",
               f"parallel.fp8_param={str(held).lower()}", "--set", "train.eval_every=1", "--set",
               "train.eval_batches=1", "--set", "train.log_every=1", "--set", "train.ckpt_every=0", "--set",
               "train.tensorboard=false", "--set", "train.threads_per_proc=1", "--set",
               f'data.cache_dir="{tmp_path / "cache"}"', "--set", "data.builtin_max_bytes=200000"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        per_step[held] = [r["param_gather_bytes_per_step"] for r in rows if r.get("kind") == "train"]
    for b in per_step.values():
        assert len(b) == 3 and max(b) - min(b) < 1000, b
    # the held weights' share of the fp32 bytes: (off - on) = 3/4 of their fp32 bytes, so on < off and the
    # embedding, head, norms and router (fp32 either way) are the rest
    assert 0.4 * per_step[False][0] < per_step[True][0] < 0.6 * per_step[False][0]
