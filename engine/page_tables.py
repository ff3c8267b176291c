"""Page tables sent to the ranks as changes to the step before.

A decoding request's page tables change by at most a page a step, yet rebuilding
them whole on the driver and sending them to every rank made the tables most of a
step's host work at long contexts (a 64K context is 1,024 MLA pages a request).
The driver's `PageTableSender` sends, for each scheduled request, only the
entries past what the ranks already hold; each rank's `PageTableStore` keeps
the rows of the requests of the last step and extends them in place.

What the ranks hold is exactly the rows of the last step's requests: a request
absent from a step is forgotten there, so the sender sends it whole when it
returns. A row is also sent whole when its pages moved rather than grew
(`Request.page_epoch` changes on demotion, promotion, swapping, a prefix
match, freeing). Host-only pages (None) read as page 0, as their slots come
from the resolve. If a launch fails, `PageTableSender.reset` makes the next
step send every row whole, whatever the ranks applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.request import Request


@dataclass(frozen=True)
class PageTableRow:
    """One scheduled request's page tables: entries from `*_from` on; entries before it are the ranks' copy
    from the last step (0: the row is sent whole)."""

    request_id: str
    mla_from: int
    mla: np.ndarray  # int32
    indexer_from: int
    indexer: np.ndarray  # int32


def _entries(pages: Sequence[int | None]) -> np.ndarray:
    return np.fromiter((0 if p is None else p for p in pages), dtype=np.int32, count=len(pages))


class PageTableSender:
    """Driver side: what the ranks hold of each request of the last step (page epoch, table lengths)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, int, int]] = {}

    def rows(self, requests: Sequence[Request]) -> tuple[PageTableRow, ...]:
        held, self._held = self._held, {}
        out = []
        for req in requests:
            n_mla, n_idx = len(req.mla_pages), len(req.indexer_pages)
            prev = held.get(req.request_id)
            grew = prev is not None and prev[0] == req.page_epoch and prev[1] <= n_mla and prev[2] <= n_idx
            mla_from, idx_from = (prev[1], prev[2]) if grew else (0, 0)
            out.append(PageTableRow(req.request_id, mla_from, _entries(req.mla_pages[mla_from:]), idx_from,
                                    _entries(req.indexer_pages[idx_from:])))
            self._held[req.request_id] = (req.page_epoch, n_mla, n_idx)
        return tuple(out)

    def reset(self) -> None:
        """The ranks' copies are unknown (a launch failed): the next step sends every row whole."""
        self._held = {}


class _GrowingRow:
    """One table row with room to grow (capacity doubles), so appending a page costs no copy of the row."""

    def __init__(self, entries: np.ndarray) -> None:
        self.data = np.empty(max(16, 2 * len(entries)), dtype=np.int32)
        self.data[: len(entries)] = entries
        self.size = len(entries)

    def extend(self, start: int, entries: np.ndarray) -> None:
        if start > self.size:
            raise RuntimeError(f"a page table row continues at {start} but the rank holds {self.size} entries")
        end = start + len(entries)
        if end > len(self.data):
            grown = np.empty(2 * end, dtype=np.int32)
            grown[:start] = self.data[:start]
            self.data = grown
        self.data[start:end] = entries
        self.size = end


class PageTableStore:
    """Rank side: the page tables of the last step's requests, extended by each step's rows."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[_GrowingRow, _GrowingRow]] = {}

    def apply(self, rows: Sequence[PageTableRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (MLA, indexer) page tables [B, width] int32, padded with page 0, in `rows` order."""
        held, self._rows = self._rows, {}
        for row in rows:
            prev = held.get(row.request_id)
            if row.mla_from or row.indexer_from:
                if prev is None:
                    raise RuntimeError(f"request {row.request_id}'s page tables continue a row this rank lacks")
                mla, idx = prev
                mla.extend(row.mla_from, row.mla)
                idx.extend(row.indexer_from, row.indexer)
            else:
                mla, idx = _GrowingRow(row.mla), _GrowingRow(row.indexer)
            self._rows[row.request_id] = (mla, idx)
        tables = [self._rows[row.request_id] for row in rows]
        return _pad([m for m, _ in tables]), _pad([i for _, i in tables])


def _pad(rows: list[_GrowingRow]) -> torch.Tensor:
    out = np.zeros((len(rows), max([1] + [r.size for r in rows])), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : r.size] = r.data[: r.size]
    return torch.from_numpy(out)
