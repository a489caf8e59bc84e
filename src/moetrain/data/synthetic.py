"""A learnable synthetic language for quick numerical comparisons (FP8 against BF16, the GPU check): no corpus, no
tokenizer, the same batches on every machine."""

from __future__ import annotations

import torch


def synthetic_batches(vocab: int, n: int, B: int = 4, L: int = 32, device: torch.device | str | None = None,
                      seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs_BL, labels_BL) int64 pairs in which each token is a fixed random function of the previous one,
    replaced by a uniformly random token with probability 0.1 (so the loss has a floor a model can approach)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(n):
        t = torch.empty(B, L + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (B,), generator=g)
        for i in range(L):
            noise = torch.rand(B, generator=g) < 0.1
            t[:, i + 1] = torch.where(noise, torch.randint(0, vocab, (B,), generator=g), table[t[:, i]])
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)) if device is not None else (t[:, :-1], t[:, 1:]))
    return out
