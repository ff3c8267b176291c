"""Token sampling: greedy, temperature, top-k, top-p, each request with its own generator.

A request's generator is seeded from its `seed` (or from the engine's seed
sequence), so a seeded request draws the same tokens whatever it is batched with.
Every row is sampled on its own, so a row that cannot be sampled fails only its
request. Any value `SamplingParams` accepts gives a valid distribution: the work
is in float32, the row max is subtracted before scaling (so the top token sits at
0 and nothing overflows), temperatures below `MIN_TEMPERATURE` are greedy (see
`SamplingParams.greedy`), and the top-k and top-p cuts always keep the most
probable token.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 temperature-scaled logits [V], their max at 0, with tokens outside top-k / top-p at -inf."""
    logits = logits.float()
    logits = (logits - logits.max()) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return logits


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the most probable tokens up to and including the one whose mass crosses `top_p`.

    The first token is kept unconditionally: a `top_p` below float32's smallest
    value compares as 0, and dropping every token would leave no distribution.
    """
    sorted_logits, order = logits.sort(descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[0] = False
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from the logits row [V] of one request."""
    if params.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
