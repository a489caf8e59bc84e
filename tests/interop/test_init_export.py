"""Start from released weights and give them back: ``moetrain train --init-from`` at EP=2, one step that changes
nothing (vanishing learning rate, no bias update), then ``moetrain export`` returns the original tensors exactly and
``transformers`` loads the export with the original logits; a checkpoint that does not fit the config fails before
any worker starts; the dry run reports what each rank holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

VOCAB = 1024
DATA = ["--set", "data.builtin_max_bytes=400000", "--set", f"data.vocab_size={VOCAB}", "--set", "data.seq_len=64",
        "--set", "train.micro_batch_size=4", "--set", "train.eval_every=0", "--set", "train.tensorboard=false",
        # two local workers compared with one CPU process: on CPU even where a GPU is visible
        "--set", 'train.device="cpu"']


def _moetrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                           kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                           max_position_embeddings=256, rope_scaling=None)
    m = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    d = tmp_path_factory.mktemp("hf") / "ckpt"
    m.save_pretrained(d, safe_serialization=True)
    return d


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_init_from_then_export_gives_back_the_weights_and_logits(hf_dir, tmp_path):
    cache = tmp_path / "cache"
    p = _moetrain("train", "--init-from", str(hf_dir), "--ep", "2", "--nproc", "2", "--steps", "1",
                  "--set", "train.lr=1e-30", "--set", "train.min_lr=1e-30", "--set", "train.weight_decay=0",
                  "--set", "model.bias_update_rate=0", "--set", f'data.cache_dir="{cache}"', *DATA,
                  "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no MTP weights" in p.stdout  # transformers saves DeepseekV3 without its MTP layer: said, not hidden
    assert (tmp_path / "run" / "tokenizer.json").is_file()
    p = _moetrain("export", str(tmp_path / "run"), str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "out"
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    a, b = _tensors(hf_dir), _tensors(out)
    assert set(a) <= set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the MTP layer sits where the released checkpoint keeps it
    assert any(k.startswith("model.layers.3.eh_proj") for k in b)

    from transformers import DeepseekV3ForCausalLM
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
        got = DeepseekV3ForCausalLM.from_pretrained(out).eval()(tokens).logits
    assert torch.equal(got, want)

    # bf16 export: every floating tensor but the router bias cast
    p = _moetrain("export", str(tmp_path / "run"), str(tmp_path / "bf16"), "--dtype", "bf16")
    assert p.returncode == 0, p.stdout + p.stderr
    c = _tensors(tmp_path / "bf16")
    assert all(t.dtype == (torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
               for k, t in c.items())


def test_mismatched_checkpoint_fails_before_training(hf_dir, tmp_path):
    t = time.perf_counter()
    p = _moetrain("train", "--init-from", str(hf_dir), "--ep", "2", "--nproc", "2", "--set", "model.expert_ffn_dim=48",
                  *DATA, "--out", str(tmp_path / "run"), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    # the tensor's name and both shapes (whichever expert tensor the file lists first)
    assert re.search(r"tensor 'model\.layers\.1\.mlp\.experts\.\d+\.\w+_proj\.weight' has shape \((32, 64|64, 32)\) "
                     r"in the checkpoint but .* expects \((48, 64|64, 48)\)", p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert time.perf_counter() - t < 60  # before any data preparation or worker


def test_bad_export_requests_say_what_exists(tmp_path):
    p = _moetrain("export", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert p.returncode == 2 and "no complete checkpoint" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_dry_run_of_a_layout_that_does_not_exist_here(tmp_path):
    from moetrain.accounting import count_params
    from moetrain.model.config import get_preset

    p = _moetrain("train", "--preset", "deepseek-v3-671b", "--dry-run", "--world", "256", "--ep", "64",
                  "--set", "data.seq_len=4096", "--set", "train.micro_batch_size=1", "--out", str(tmp_path / "r"),
                  "--gpu", "gb300", timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line.split() for line in p.stdout.splitlines() if line.split()[:1] == ["0"])
    held = int(row[1].replace(",", ""))
    total = count_params(get_preset("deepseek-v3-671b")).total_with_mtp
    assert abs(held - total / 256) / (total / 256) < 0.01  # rank 0's FSDP shard of everything, nothing replicated
    model = next(line.split() for line in p.stdout.splitlines() if line.startswith("model"))
    # the planner agrees on the fp32 gradients; its weights are the bf16 working copy a GPU run gathers
    assert abs(float(model[2]) - float(row[3])) / float(row[3]) < 0.01
    assert abs(float(model[1]) - float(row[2]) / 2) / float(row[2]) < 0.01
    assert "verdict: FITS on GB300 (288 GiB)" in p.stdout
    p = _moetrain("train", "--world", "8", "--out", str(tmp_path / "r2"))
    assert p.returncode == 2 and "--dry-run" in p.stderr, p.stderr


def test_dry_run_on_local_processes(tmp_path):
    p = _moetrain("train", "--dry-run", "--ep", "2", "--nproc", "2", *DATA, "--set", f'data.cache_dir="{tmp_path}"',
                  "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    from moetrain.accounting import count_params
    from moetrain.model.config import get_preset
    n = count_params(get_preset("tiny").replace(vocab_size=VOCAB)).total_with_mtp  # the tokenizer sizes the model
    assert len(rep["ranks"]) == 2 and sum(r["params"] for r in rep["ranks"]) == pytest.approx(n, rel=0.01)
    for r in rep["ranks"]:
        assert r["peak_measured"] > r["param_bytes"] and r["optim_bytes"] == 2 * r["param_bytes"]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
