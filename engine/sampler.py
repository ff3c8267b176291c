"""Token sampling: greedy, temperature, top-k, top-p, each request with its own generator.

A request's generator is seeded from its `seed` (or from the engine's seed
sequence), so a seeded request draws the same tokens whatever it is batched with.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of `logits` [S, V]."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = filter_logits(logits[row].float(), p).softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
