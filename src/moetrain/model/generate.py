"""Autoregressive decoding with a KV cache: the cached forward of a :class:`~moetrain.model.transformer.Transformer`,
greedy and temperature / top-p sampling.

Each layer's attention keeps its own cache through two methods, which is all this module asks of it
(:class:`CachedAttention`): ``new_cache(batch, max_len, device, dtype)`` and ``forward_cached(x_BLD, cos_LR, sin_LR,
cache, start)``. MLA caches its compressed latents (:class:`~moetrain.model.deepseek.attention.MLACache`), Qwen3's
grouped-query attention its normed rotated keys and values per key/value head
(:class:`~moetrain.model.qwen3.attention.GQACache`). The training forward is not used here
and not changed: the decode path is separate.

Single-device code. Shape legend: B batch, L new tokens, T cached tokens, D model dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetrain.model.moe import MoE
from moetrain.model.transformer import Block, Transformer


class CachedAttention(Protocol):
    """What the decode path needs of a layer's attention module."""

    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Any:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens."""

    def forward_cached(self, x_BLD: torch.Tensor, cos_LR: torch.Tensor, sin_LR: torch.Tensor, cache: Any,
                       start: int) -> torch.Tensor:
        """Attention of L new tokens at positions ``start ..`` over the cached ones and themselves; fills ``cache``."""


@dataclass
class KVCache:
    """The decode state of one model: one attention cache per main layer and how many tokens they hold.

    Attributes:
        layers: the caches, in layer order (whatever each layer's ``new_cache`` returned).
        max_len: room, in tokens (at most the model's ``max_seq_len``).
        length: tokens cached so far (the position of the next token).
    """

    layers: list[Any]
    max_len: int
    length: int = 0


def new_kv_cache(model: Transformer, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
    """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens, on the model's device, in
    ``dtype`` (default: the embedding's).

    Raises:
        ValueError: ``max_len`` beyond the model's ``max_seq_len`` (its RoPE table ends there).
    """
    if max_len > model.cfg.max_seq_len:
        raise ValueError(f"{max_len} tokens exceed the model's max_seq_len={model.cfg.max_seq_len}")
    w = model.embed_tokens.weight
    return KVCache([b.self_attn.new_cache(batch, max_len, w.device, dtype or w.dtype) for b in model.layers],
                   max_len)


def _block_cached(block: Block, x_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
                  start: int) -> torch.Tensor:
    """:meth:`Block._forward` with the attention's cached path."""
    x_BLD = x_BLD + block.self_attn.forward_cached(block.input_layernorm(x_BLD), cos, sin, cache, start)
    h = block.post_attention_layernorm(x_BLD)
    if isinstance(block.mlp, MoE):
        return x_BLD + block.mlp(h, None)[0]
    return x_BLD + block.mlp(h)


@torch.no_grad()
def forward_cached(model: Transformer, tokens_BL: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, L, V) fp32 of ``tokens_BL`` placed after the ``cache.length`` cached tokens; the cache then holds
    them too. A prompt goes in at once (prefill), then one token per call. The MTP modules are not run.

    Raises:
        ValueError: the cache has no room for L more tokens.
    """
    B, L = tokens_BL.shape
    start, end = cache.length, cache.length + L
    if end > cache.max_len:
        raise ValueError(f"the KV cache holds {cache.max_len} tokens; {start} cached + {L} new do not fit")
    cos, sin = model.rope(cache.max_len, tokens_BL.device)
    cos, sin = cos[start:end], sin[start:end]
    h = model.embed_tokens(tokens_BL)
    for block, layer_cache in zip(model.layers, cache.layers):
        h = _block_cached(block, h, cos, sin, layer_cache, start)
    cache.length = end
    return model.lm_head(model.norm(h)).float()


def top_p_filter(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits_BV`` with every token outside the nucleus set to -inf: the nucleus is the smallest set of most
    probable tokens whose probabilities sum to at least ``top_p`` (Holtzman et al. 2020, arXiv 1904.09751). The most
    probable token is always kept; ``top_p >= 1`` keeps all.

    Raises:
        ValueError: ``top_p`` not in (0, 1].
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_p >= 1.0:
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    probs_BV = sorted_BV.float().softmax(dim=-1)
    before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # mass of the more probable tokens
    drop_sorted = before_BV >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order_BV, drop_sorted)
    return logits_BV.masked_fill(drop, float("-inf"))


def next_token(logits_BV: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token (B,) int64: argmax at ``temperature`` 0, else a draw from softmax(logits / temperature)
    restricted to the top-p nucleus (:func:`top_p_filter`), with ``generator``.

    Raises:
        ValueError: a negative temperature, or ``top_p`` not in (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs = top_p_filter(logits_BV.float() / temperature, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The tokens that follow ``prompt`` (token ids), decoded one at a time with a :class:`KVCache`: greedy at
    ``temperature`` 0, else temperature / top-p sampling seeded by ``seed``. Stops after ``max_new_tokens`` or at
    ``eos_id`` (included).

    Raises:
        ValueError: an empty prompt, or prompt + ``max_new_tokens`` beyond the model's ``max_seq_len``; bad
            temperature or top_p (:func:`next_token`).
    """
    if not prompt:
        raise ValueError("the prompt has no tokens")
    n = len(prompt) + max_new_tokens
    if n > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed the model's "
                         f"max_seq_len={model.cfg.max_seq_len}")
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = new_kv_cache(model, 1, n)
    was_training = model.training
    model.eval()
    try:
        logits = forward_cached(model, torch.tensor([prompt], device=device), cache)[:, -1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = next_token(logits, temperature, top_p, gen)
            out.append(int(tok))
            if (eos_id is not None and out[-1] == eos_id) or len(out) == max_new_tokens:
                break
            logits = forward_cached(model, tok[:, None], cache)[:, -1]
        return out
    finally:
        model.train(was_training)

