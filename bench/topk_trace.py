"""A synthetic decode top-K trace with controlled locality, drawn for a whole batch on its device.

Each stream (a request and an IndexShare group) keeps the step at which each of its
positions was last picked. A pick is a depth into the stream's positions ordered by
recency: a share `NEAR_SHARE` of the K picks fall within the K most recent
(`NEAR_SKEW` skews them to the very recent), the rest follow a power-law tail
(`FAR_TAIL`). The newest token is always picked and the picks are topped up to K
with the most recent positions not yet picked. The constants were fitted so that an
LRU hot buffer of 1x / 2x / 4x top-K misses about 30 / 13.4 / 6.7 % of the picks
(`tests/test_topk_trace.py` measures it).

Every stream of a step is drawn at once with fixed-shape tensor operations, so the
trace costs the host the same few launches whatever the batch: a per-request draw
on the host would grow with the batch and slow the policies that run more requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

# Reuse-distance model, fitted to 30 / 13.4 / 6.7 % misses of the resolve's LRU (victims: slots not used
# this step, least recently used first) at 1x / 2x / 4x top-K for contexts of 36x top-K.
NEAR_SHARE, NEAR_SKEW, FAR_TAIL = 0.70, 2.0, 1.25


class ReuseDistanceTrace:
    """Top-K picks for many streams per call; the last-pick table lives on `device`."""

    def __init__(self, topk: int, device: torch.device | str, seed: int = 0) -> None:
        self.topk = topk
        self.device = torch.device(device)
        self._rows: dict[Hashable, int] = {}
        self._last = torch.full((0, 0), -1.0, device=self.device)  # [streams, positions] step of last pick
        self._clock = 0
        self._gen = torch.Generator(device=self.device).manual_seed(seed)

    def _row_of(self, streams: Sequence[Hashable], width: int) -> torch.Tensor:
        for s in streams:
            self._rows.setdefault(s, len(self._rows))
        rows, cols = self._last.shape
        if len(self._rows) > rows or width > cols:  # grow by doubling, keeping what was picked
            grown = torch.full((max(len(self._rows), 2 * rows), max(width, 2 * cols)), -1.0, device=self.device)
            grown[:rows, :cols] = self._last
            self._last = grown
        return torch.tensor([self._rows[s] for s in streams]).to(self.device, non_blocking=True)

    def sample(self, streams: Sequence[Hashable], context_lens: Sequence[int]) -> torch.Tensor:
        """[B, K] positions (ascending) picked for each stream, whose context holds
        `context_lens[b]` >= K tokens; marks them picked now."""
        k, dev = self.topk, self.device
        if min(context_lens) < k:
            raise ValueError(f"every context needs at least top-K = {k} tokens")
        width = max(context_lens)
        rows = self._row_of(streams, width)
        self._clock += 1
        b = len(streams)
        ctx = torch.tensor(list(context_lens)).to(dev, non_blocking=True)
        cols = torch.arange(width, device=dev)
        alive = cols[None, :] < ctx[:, None]
        last = self._last[rows, :width]
        noise = torch.rand((b, width), generator=self._gen, device=dev) * 1e-3  # ties in random order
        order = torch.argsort(torch.where(alive, last + noise, float("-inf")), dim=1, descending=True)
        u = torch.rand((b, k), generator=self._gen, device=dev)
        near = torch.rand((b, k), generator=self._gen, device=dev) < NEAR_SHARE
        depth = torch.where(near, k * u.pow(NEAR_SKEW), k * u.clamp(min=1e-9).pow(-1.0 / FAR_TAIL))
        depth = torch.minimum(depth.long(), ctx[:, None] - 1)
        taken = torch.zeros((b, width), dtype=torch.bool, device=dev)
        taken.scatter_(1, order.gather(1, depth), True)
        taken[torch.arange(b, device=dev), ctx - 1] = True  # the newest token always
        # top up with the most recent positions not yet taken
        unpicked = ~taken.gather(1, order) & alive.gather(1, order)
        short = (k - taken.sum(1)).clamp(min=0)
        fill = unpicked & (unpicked.cumsum(1) <= short[:, None])
        taken.scatter_(1, order, taken.gather(1, order) | fill)
        # K per row: the newest positions if the draws exceeded K
        picked = torch.topk(torch.where(taken, cols[None, :], -1), k, dim=1).indices.sort(dim=1).values
        self._last[rows[:, None], picked] = float(self._clock)
        return picked
