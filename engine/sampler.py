"""Token sampling for a whole batch at once, on the device the logits live on.

Greedy rows take the argmax. Sampled rows use the Gumbel-max trick: the token
is argmax(logits / T + g) over the tokens top-k and top-p keep, with g =
-log(-log(u)) and u uniform, which draws exactly from softmax(logits / T)
restricted to those tokens. u comes from a counter-based hash of (request
seed, position of the token in the output, vocabulary index) computed with
64-bit integer arithmetic, so a seeded request draws the same tokens whatever
it is batched with, after a preemption, and on a CPU or a GPU alike. The
whole batch costs a fixed number of tensor operations (a sort only when some
row asks for top-k or top-p) and one read back of the token ids.

Numerically safe for every value `SamplingParams` accepts: temperatures below
`MIN_TEMPERATURE` are greedy, the work is in float32, and top-k and top-p
always keep the most probable token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplications wrap modulo 2**64)."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def row_keys(seeds: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """One int64 key per row from its request seed and the output position being drawn."""
    keys = [_signed(((seed & _MASK64) * _GOLDEN + position) & _MASK64) for seed, position in zip(seeds, positions)]
    return _splitmix64(torch.tensor(keys, dtype=torch.int64, device=device))


def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 uniforms in (0, 1), a pure function of each row's key and the vocabulary index."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)
    bits = _shr(_splitmix64(keys[:, None] + index[None, :]), 40)  # the top 24 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _floors(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool) -> torch.Tensor:
    """Per row, the smallest scaled logit that top-k, then top-p over the top-k survivors, keep."""
    rows, vocab = scaled.shape
    ordered = scaled.sort(dim=-1, descending=True).values
    floor = torch.full((rows,), float("-inf"), device=scaled.device)
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        floor = ordered.gather(1, (k - 1)[:, None]).squeeze(1)
        ordered = ordered.masked_fill(ordered < floor[:, None], float("-inf"))
    if use_p:
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # the token that crosses top_p is kept
        by_p = ordered.gather(1, (keep - 1)[:, None]).squeeze(1)
        floor = torch.where(top_p < 1.0, torch.maximum(floor, by_p), floor)
    return floor


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` [S, V]; row i follows params[i], drawing with seeds[i] at positions[i]."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        device = logits.device
        rows = torch.tensor(sampled, dtype=torch.long, device=device)
        chosen = [params[i] for i in sampled]
        scaled = logits.index_select(0, rows).float()
        inv_t = torch.tensor([1.0 / p.temperature for p in chosen], dtype=torch.float32, device=device)
        scaled = (scaled - scaled.amax(dim=-1, keepdim=True)) * inv_t[:, None]
        use_k = any(0 < p.top_k < logits.shape[-1] for p in chosen)
        use_p = any(p.top_p < 1.0 for p in chosen)
        if use_k or use_p:
            top_k = torch.tensor([p.top_k for p in chosen], dtype=torch.long, device=device)
            top_p = torch.tensor([p.top_p for p in chosen], dtype=torch.float32, device=device)
            floor = _floors(scaled, top_k, top_p, use_k, use_p)
            scaled = scaled.masked_fill(scaled < floor[:, None], float("-inf"))
        keys = row_keys([seeds[i] for i in sampled], [positions[i] for i in sampled], device)
        gumbel = -torch.log(-torch.log(uniforms(keys, logits.shape[-1])))
        tokens = tokens.index_copy(0, rows, (scaled + gumbel).argmax(dim=-1))
    return tokens.tolist()
