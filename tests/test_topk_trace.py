"""The policy bench's synthetic top-K trace: valid picks, and the locality it claims.

The trace stands in for the model's indexer in `bench/policies.py --trace synthetic`;
its results are only meaningful if an LRU hot buffer really misses about 30 / 13.4 /
6.7 % of its picks at 1x / 2x / 4x top-K, measured here with the resolve's own
eviction rule (least recently used among the slots not used this step).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from topk_trace import ReuseDistanceTrace  # noqa: E402


def lru_miss_rate(steps: list[list[int]], slots: int) -> float:
    """Misses of a hot buffer of `slots` rows: hits refresh their stamp first, then each miss takes an
    empty slot or the least recently used one not used this step (none left: it is not kept)."""
    stamp: dict[int, int] = {}
    misses = total = 0
    for t, picks in enumerate(steps, 1):
        for p in picks:
            if p in stamp:
                stamp[p] = t
        missed = [p for p in picks if p not in stamp]
        victims = sorted((s, p) for p, s in stamp.items() if s < t)
        for p in missed:
            if len(stamp) >= slots:
                if not victims:
                    continue
                del stamp[victims.pop(0)[1]]
            stamp[p] = t
        misses += len(missed)
        total += len(picks)
    return misses / total


def test_picks_are_k_distinct_positions_with_the_newest():
    trace = ReuseDistanceTrace(16, "cpu", seed=3)
    for step in range(20):
        ctx = [16, 40 + step, 300 + 7 * step]
        picks = trace.sample([("a", 0), ("b", 0), ("b", 1)], ctx)
        assert picks.shape == (3, 16)
        for row, n in zip(picks.tolist(), ctx):
            assert row == sorted(set(row)) and len(row) == 16
            assert 0 <= row[0] and row[-1] == n - 1
    assert trace.sample([("a", 0)], [16]).tolist() == [list(range(16))]
    with pytest.raises(ValueError):
        trace.sample([("c", 0)], [15])


def test_streams_are_independent_of_their_batch():
    """A stream draws from its own history: sampled alone or beside others, its picks follow the same
    recency model (equal seeds, equal draws when it is the whole batch)."""
    alone, together = ReuseDistanceTrace(8, "cpu", seed=0), ReuseDistanceTrace(8, "cpu", seed=0)
    for step in range(5):
        a = alone.sample([("x", 0)], [50 + step])
        b = together.sample([("x", 0)], [50 + step])
        assert torch.equal(a, b)
    together.sample([("y", 0)], [500])  # another stream's draw leaves x's history alone
    assert torch.equal(alone._last[0, :55], together._last[0, :55])


def test_lru_miss_rates_match_the_published_ones():
    k = 64
    trace = ReuseDistanceTrace(k, "cpu", seed=1)
    steps = [trace.sample([("r", 0)], [36 * k + s])[0].tolist() for s in range(400)]
    rates = [100 * lru_miss_rate(steps[100:], m * k) for m in (1, 2, 4)]
    for got, published in zip(rates, (30.0, 13.4, 6.7)):
        assert got == pytest.approx(published, rel=0.2), rates
