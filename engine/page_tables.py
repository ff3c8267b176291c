"""Page tables sent to the ranks as changes to the step before.

A decoding request's pages change by at most a page a step, yet rebuilding its
tables whole on the driver and sending them to every rank made them most of a
step's host work at long contexts (a 64K context is 1,024 MLA pages a request,
and a request with host-only pages adds its host pages for the resolve). The
driver's `PageTableSender` sends, for each scheduled request, its MLA, indexer
and host page entries from the first one the ranks do not hold; each rank's
`PageTableStore` keeps the rows of the last step's requests and extends them in
place.

What the ranks hold is exactly the rows of the last step's requests: a request
absent from a step is forgotten there, so the sender sends it whole when it
returns. Entries that change in place (demotion, a host copy completing,
promotion, swapping, a prefix match, freeing) mark the request dirty from their
index (`Request.pages_changed_at`), and the rows are sent again from there.
Absent pages travel as -1 (the page tables read them as page 0: their slots
come from the resolve). If a launch fails, `PageTableSender.reset` makes the
next step send every row whole, whatever the ranks applied.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.request import Request
from residency.rank import NonResidentSpec

_CLEAN = sys.maxsize


@dataclass(frozen=True)
class PageTableRow:
    """One scheduled request's pages: each list from its `*_from` index on (earlier entries are the ranks'
    copy from the last step; 0: sent whole), -1 where absent."""

    request_id: str
    mla_from: int
    mla: np.ndarray  # int32
    indexer_from: int
    indexer: np.ndarray  # int32
    host_from: int
    host: np.ndarray  # int32


def _entries(pages: Sequence[int | None]) -> np.ndarray:
    return np.fromiter((-1 if p is None else p for p in pages), dtype=np.int32, count=len(pages))


class PageTableSender:
    """Driver side: how many entries of each list the ranks hold for each request of the last step."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, int, int]] = {}

    def rows(self, requests: Sequence[Request]) -> tuple[PageTableRow, ...]:
        held, self._held = self._held, {}
        out = []
        for req in requests:
            mla, idx, host = req.mla_pages, req.indexer_pages, req.host_pages
            prev = held.get(req.request_id)
            dirty = req.tables_dirty_from
            if prev is None or dirty == 0:
                start = (0, 0, 0)
            else:
                start = (min(prev[0], dirty, len(mla)), min(prev[1], len(idx)), min(prev[2], dirty, len(host)))
            out.append(PageTableRow(req.request_id, start[0], _entries(mla[start[0]:]), start[1],
                                    _entries(idx[start[1]:]), start[2], _entries(host[start[2]:])))
            self._held[req.request_id] = (len(mla), len(idx), len(host))
            req.tables_dirty_from = _CLEAN
        return tuple(out)

    def reset(self) -> None:
        """The ranks' copies are unknown (a launch failed): the next step sends every row whole."""
        self._held = {}


class _GrowingRow:
    """One list of pages with room to grow (capacity doubles), so appending a page costs no copy of the row."""

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

    @property
    def entries(self) -> np.ndarray:
        return self.data[: self.size]


class PageTableStore:
    """Rank side: the pages of the last step's requests, extended by each step's rows."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[_GrowingRow, _GrowingRow, _GrowingRow]] = {}

    def apply(self, rows: Sequence[PageTableRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (MLA, indexer) page tables [B, width] int32 in `rows` order, absent and padding entries
        page 0."""
        held, self._rows = self._rows, {}
        for row in rows:
            prev = held.get(row.request_id)
            if row.mla_from or row.indexer_from or row.host_from:
                if prev is None:
                    raise RuntimeError(f"request {row.request_id}'s page tables continue a row this rank lacks")
                for kept, start, entries in zip(prev, (row.mla_from, row.indexer_from, row.host_from),
                                                (row.mla, row.indexer, row.host)):
                    kept.extend(start, entries)
                self._rows[row.request_id] = prev
            else:
                self._rows[row.request_id] = (_GrowingRow(row.mla), _GrowingRow(row.indexer), _GrowingRow(row.host))
        lists = [self._rows[row.request_id] for row in rows]
        return _pad([m for m, _, _ in lists]), _pad([i for _, i, _ in lists])

    def nonresident(self, request_id: str, num_tokens: int) -> NonResidentSpec:
        """Where each logical page of a request with host-only pages lives (held from this step's rows)."""
        mla, _, host = self._rows[request_id]
        return NonResidentSpec(request_id, torch.from_numpy(mla.entries.copy()),
                               torch.from_numpy(host.entries.copy()), num_tokens)


def _pad(rows: list[_GrowingRow]) -> torch.Tensor:
    out = np.zeros((len(rows), max([1] + [r.size for r in rows])), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : r.size] = np.maximum(r.entries, 0)
    return torch.from_numpy(out)
