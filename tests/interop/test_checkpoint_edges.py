"""The edges a new user hit with released weights and exports: DeepSeek-V2 checkpoints (no expert bias) load and
export as V2; a damaged safetensors file, an FP8 weight without a fitting scale, or a distinct head under a tied
config fail with the file or tensor named; an export never replaces the run it reads, refuses a damaged
checkpoint, and sweeps what a killed export left; --init-from brings the checkpoint's own tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.config import load_job_config
from moetrain.errors import CheckpointError
from moetrain.train.export import export_run
from moetrain.interop.hf import check_hf_checkpoint, load_hf_checkpoint, load_hf_config, save_hf_checkpoint
from moetrain.model import build_model, get_preset
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.checkpoint import save_checkpoint
from moetrain.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")


def _hf_v2(tmp_path):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                           num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                           num_experts_per_tok=2, max_position_embeddings=128, topk_method="greedy")
    m = DeepseekV2ForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "v2", safe_serialization=True)
    return m, tmp_path / "v2"


def test_v2_checkpoint_loads_and_exports_as_v2(tmp_path):
    from transformers import DeepseekV2ForCausalLM
    hf, path = _hf_v2(tmp_path)
    cfg = load_hf_config(path)
    ours = build_model(cfg, seed=1).eval()
    load_hf_checkpoint(ours, path)  # no e_score_correction_bias in a V2 checkpoint: the biases stay zero
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits
        torch.testing.assert_close(ours(tokens).logits_BLV, want, atol=1e-4, rtol=0)
    out = save_hf_checkpoint(ours, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert not any(k.endswith("e_score_correction_bias") for k in load_file(next(out.glob("*.safetensors"))))
    with torch.no_grad():
        again = DeepseekV2ForCausalLM.from_pretrained(out).eval()(tokens).logits
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)


def test_damaged_safetensors_file_is_named(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    out = save_hf_checkpoint(build_model(cfg), tmp_path / "ck")
    shard = next(out.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=shard.name):
        check_hf_checkpoint(cfg, out)


def test_fp8_weight_without_a_fitting_scale_fails_from_the_headers(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    out = save_hf_checkpoint(build_model(cfg), tmp_path / "ck")
    shard = next(out.glob("*.safetensors"))
    t = load_file(shard)
    key = "model.layers.0.self_attn.o_proj.weight"
    w = t[key]
    t[key] = w.to(torch.float8_e4m3fn)
    t[key + "_scale_inv"] = torch.ones(math.ceil(w.shape[0] / 128) + 1, math.ceil(w.shape[1] / 128))
    save_file(t, str(shard))
    with pytest.raises(CheckpointError, match="scale_inv of shape"):
        check_hf_checkpoint(cfg, out)
    del t[key + "_scale_inv"]
    save_file(t, str(shard))
    with pytest.raises(CheckpointError, match="has no"):
        check_hf_checkpoint(cfg, out)


def test_a_distinct_head_under_a_tied_config_is_refused(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    out = save_hf_checkpoint(build_model(cfg), tmp_path / "ck")  # untied: head and embedding differ
    with pytest.raises(CheckpointError, match="tie_embeddings"):
        load_hf_checkpoint(build_model(cfg.replace(tie_embeddings=True)), out)


@pytest.fixture()
def run(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    save_checkpoint(tmp_path / "run", 4, model, build_optimizer(model, 1e-3), {"model_config": cfg.to_dict()}, ctx)
    return tmp_path / "run"


def test_export_never_replaces_the_run_it_reads(run):
    for target in (run, run.parent):
        with pytest.raises(CheckpointError, match="would contain"):
            export_run(run, target, overwrite=True)
    assert (run / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


def test_export_refuses_a_damaged_checkpoint_and_sweeps_a_killed_one(run, tmp_path):
    stale = tmp_path / ".out.tmp-deadbeef"
    stale.mkdir()
    export_run(run, tmp_path / "out")
    assert not stale.exists() and (tmp_path / "out" / "config.json").is_file()
    shard = sorted((run / "checkpoints" / "step_00000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated"):
        export_run(run, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_init_from_brings_its_own_tokenizer(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    out = save_hf_checkpoint(build_model(cfg), tmp_path / "ck")
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(26)} | {"<|endoftext|>": 26}, merges=[]))
    tok.save(str(out / "tokenizer.json"))
    job = load_job_config(None, [f'train.init_from="{out}"', "data.seq_len=32"])
    assert job.data.tokenizer == str(out / "tokenizer.json")
    assert job.model.vocab_size == 256  # the checkpoint's, not re-derived from the tokenizer
