"""``moetrain sample RUN_DIR --prompt TEXT``: text from a run's checkpoint, greedy or temperature / top-p sampled with
a KV cache of MLA's compressed latents (:mod:`moetrain.model.generate`), in one process on a CPU or a GPU."""

from __future__ import annotations

import os

from moetrain.errors import ConfigError
from moetrain.model.generate import generate
from moetrain.train.load import load_run_model, open_run


def sample_run(run_dir: str | os.PathLike, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, step: int | None = None, device: str = "cpu",
               stop_at_eos: bool = True) -> str:
    """The text ``run_dir``'s newest checkpoint (or ``step``) continues ``prompt`` with: at most ``max_new_tokens``
    tokens, greedy at ``temperature`` 0, else sampled (``top_p`` nucleus, ``seed``); ends at the end-of-document
    token when ``stop_at_eos`` (not included in the text).

    Raises:
        ConfigError: an empty prompt, a prompt longer than the model's max_seq_len with the new tokens, a negative
            temperature or a top_p outside (0, 1]. CheckpointError: no (verifiable) checkpoint.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(f"--temperature {temperature} must be >= 0 (0: greedy) and --top-p {top_p} in (0, 1]")
    run = open_run(run_dir, step)
    tok = run.tokenizer()
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("--prompt is empty; give the text to continue")
    room = run.job.model.max_seq_len
    if len(ids) + max_new_tokens > room:
        raise ConfigError(f"the prompt ({len(ids)} tokens) and --max-new-tokens {max_new_tokens} exceed the model's "
                          f"max_seq_len of {room} tokens; shorten one")
    model = load_run_model(run, device)
    new = generate(model, ids, max_new_tokens, temperature, top_p, seed, tok.eos_id if stop_at_eos else None)
    if stop_at_eos and new and new[-1] == tok.eos_id:
        new = new[:-1]
    # decoded after the prompt, not alone: a byte-level token may complete a character the prompt began
    whole, head = tok.decode(ids + new), tok.decode(ids)
    return whole[len(head):] if whole.startswith(head) else tok.decode(new)
