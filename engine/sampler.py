"""Token sampling for a whole batch at once, on the device the logits live on.

Greedy rows take the argmax. Sampled rows use the Gumbel-max trick: the token
is argmax(logits / T + g) over the tokens top-k and top-p keep, with g =
-log(-log(u)) and u uniform, which draws exactly from softmax(logits / T)
restricted to those tokens. u comes from a counter-based hash of (request
seed, position of the token in the output, vocabulary index) computed with
64-bit integer arithmetic, so a seeded request draws the same numbers whatever
it is batched with, after a preemption, and on a CPU or a GPU alike (its logits
can still differ in their last bits with the step's row count, which can turn a
near-tie). The whole batch costs a fixed number of tensor operations (a sort
only when some row asks for top-k or top-p), with no host synchronisation: it
runs on the rank that computes the logits, inside the decode step's CUDA graph,
and the token ids are read back once per step.

Numerically safe for every value `SamplingParams` accepts: temperatures below
`MIN_TEMPERATURE` are greedy, the work is in float32, and top-k and top-p
always keep the most probable token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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


def draw_keys(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One int64 per row from its request seed and the output position being drawn (host side; the
    sampler mixes it on the device)."""
    keys = [_signed(((seed & _MASK64) * _GOLDEN + position) & _MASK64) for seed, position in zip(seeds, positions)]
    return torch.tensor(keys, dtype=torch.int64)


def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 uniforms in (0, 1), a pure function of each row's key and the vocabulary index."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)
    bits = _shr(_splitmix64(keys[:, None] + index[None, :]), 40)  # the top 24 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _floors(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest scaled logit that top-k, then top-p over the top-k survivors, keep (a row
    without a cut keeps every token)."""
    vocab = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    floor = ordered.gather(1, (k - 1)[:, None]).squeeze(1)
    ordered = ordered.masked_fill(ordered < floor[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    keep = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # the token that crosses top_p is kept
    by_p = ordered.gather(1, (keep - 1)[:, None]).squeeze(1)
    return torch.where(top_p < 1.0, torch.maximum(floor, by_p), floor)


SamplerMode = Literal["greedy", "random", "filtered"]


@dataclass(frozen=True)
class SamplingBatch:
    """What the sampler needs of each sampled row, as tensors of fixed shape: built on the host, moved
    to the rank that samples, copied into a captured graph's buffers there. `mode` is the only host
    decision, the least work that serves every row: argmax only, Gumbel draws, or draws after the
    top-k / top-p cut (a sort over the vocabulary)."""

    inv_temperature: torch.Tensor  # [S] float32, 1/T; 1.0 on greedy rows
    greedy: torch.Tensor  # [S] bool
    top_k: torch.Tensor  # [S] int64, 0 = no cut
    top_p: torch.Tensor  # [S] float32, 1.0 = no cut
    keys: torch.Tensor  # [S] int64 draw keys (`draw_keys`)
    mode: SamplerMode

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              vocab_size: int) -> SamplingBatch:
        """Row i follows params[i], drawing with seeds[i] at output position positions[i]."""
        sampled = [p for p in params if not p.greedy]
        if not sampled:
            mode: SamplerMode = "greedy"
        elif any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in sampled):
            mode = "filtered"
        else:
            mode = "random"
        return cls(
            inv_temperature=torch.tensor([1.0 if p.greedy else 1.0 / p.temperature for p in params],
                                         dtype=torch.float32),
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            keys=draw_keys(seeds, positions),
            mode=mode,
        )

    @property
    def num_rows(self) -> int:
        return int(self.keys.shape[0])

    def to(self, device: torch.device) -> SamplingBatch:
        move = {name: getattr(self, name).to(device, non_blocking=True)
                for name in ("inv_temperature", "greedy", "top_k", "top_p", "keys")}
        return SamplingBatch(**move, mode=self.mode)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token id per row of `logits` [S, V] (int64, on the logits' device), following `batch`.

    A fixed sequence of tensor operations for a given mode, free of host synchronisation, so it can be
    captured in a CUDA graph with the forward. Greedy rows of a sampling batch take the argmax."""
    tokens = logits.argmax(dim=-1)
    if batch.mode == "greedy":
        return tokens
    scaled = logits.float()
    scaled = (scaled - scaled.amax(dim=-1, keepdim=True)) * batch.inv_temperature[:, None]
    if batch.mode == "filtered":
        floor = _floors(scaled, batch.top_k, batch.top_p)
        scaled = scaled.masked_fill(scaled < floor[:, None], float("-inf"))
    gumbel = -torch.log(-torch.log(uniforms(_splitmix64(batch.keys), logits.shape[-1])))
    return torch.where(batch.greedy, tokens, (scaled + gumbel).argmax(dim=-1))
