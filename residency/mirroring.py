"""Proactive mirroring: every page a forward completes is copied to the host pool right after it.

Under `hybrid` (policies whose traits mirror ahead) a completed page gets its host copy at the step that
completes it: one whole-page copy into a fresh host page, issued with the step's other copies, and the
page becomes demotable, and findable in the host prefix cache by its hash, as soon as the copy is done
(`poll`). A page still being written has no host copy (copying its rows as they come costs host work and
a launch every decode step); a request that stops running copies its tail then. Pages that complete
without a copy (reused from the GPU prefix cache, indexer pages, pages the host pool was too full for)
are caught up whole. Copies are issued through the `PoolExecutor` (one rank writes the shared host pool)
on a side stream; a ticket says when they are done, and a later ticket covers every earlier copy.

Two steps of a copy's life: `mirror_step` issues the copies of what a forward completed; `poll` completes
the finished ones. With asynchronous scheduling a page can complete while its last token is still pending
(its hash unknown): it is copied then and published at the next step, with the last copy's ticket.
"""

from __future__ import annotations

from dataclasses import dataclass

from residency.hot_buffer import PAGE_SIZE
from residency.host_pool import HostPool
from residency.interfaces import CopyTicket, PagedRequest, PoolExecutor
from residency.page_pool import PageUse
from residency.stats import ResidencyStats


@dataclass
class _PendingMirror:
    request: PagedRequest
    entries: list[tuple[PageUse, int, int, bytes]]  # (use, logical index, host page, hash)
    ticket: CopyTicket | None


def align(req: PagedRequest) -> None:
    """Keeps the host tables as long as the GPU tables (called for every running request at every step, so
    it builds no list when they already are)."""
    missing = len(req.mla_pages) - len(req.host_pages)
    if missing > 0:
        req.host_pages += [None] * missing
    missing = len(req.indexer_pages) - len(req.host_indexer_pages)
    if missing > 0:
        req.host_indexer_pages += [None] * missing


def set_host(req: PagedRequest, use: PageUse, index: int, host_page: int) -> None:
    if use is PageUse.MLA:
        req.host_pages[index] = host_page
        req.pages_changed_at(index)
    else:
        req.host_indexer_pages[index] = host_page


class Mirroring:
    """Host copies of running requests' pages, made as the pages complete."""

    def __init__(self, executor: PoolExecutor, host: HostPool, stats: ResidencyStats,
                 indexer_tokens_per_page: int) -> None:
        self.executor, self.host, self.stats = executor, host, stats
        self.indexer_tokens_per_page = indexer_tokens_per_page
        self._pending: list[_PendingMirror] = []
        self._last_ticket: CopyTicket | None = None  # of the last mirror issued
        # Completed pages copied before their hash was known (their last token was still pending):
        # (request id, page index) -> host page, published at the request's next step.
        self._unhashed: dict[tuple[str, int], int] = {}
        # Per request, (MLA pages, indexer pages) at its start that all have host copies: the
        # catch-up scan starts there, so a step costs the new pages, not the whole context.
        self._mirrored_prefix: dict[str, tuple[int, int]] = {}

    def mirror_step(self, steps: list[tuple[PagedRequest, int, int]]) -> None:
        """Mirrors the MLA pages a forward completed: for each (request, first, end) the forward wrote
        tokens [first, end), and every page those rows complete is copied whole to a fresh host page, one
        launch for all (with the catch-up's pages). It becomes demotable (and findable by its hash) once
        the copy is done, a step or so later. A step that completes no page costs a few comparisons a
        request."""
        self.poll()
        in_flight = {(id(p.request), e[0], e[1]) for p in self._pending for e in p.entries}
        whole: list[tuple[int, int]] = []
        for req, first, end in steps:
            align(req)
            start, stop = first // PAGE_SIZE, end // PAGE_SIZE
            if start and self._unhashed and (req.request_id, start - 1) in self._unhashed:
                start -= 1  # completed before its hash was known (its last token was pending): publish now
            if start >= stop:
                continue  # the rows complete no page (a decode step's, 63 steps in 64)
            completing: list[tuple[PageUse, int, int, bytes]] = []
            for i in range(start, stop):
                gpu_page = req.mla_pages[i]
                if gpu_page is None or req.host_pages[i] is not None or (id(req), PageUse.MLA, i) in in_flight:
                    continue
                host_page = self._unhashed.pop((req.request_id, i), None)
                if host_page is None:
                    if self.host.cache.num_available == 0:
                        self.stats.mirror_skipped_host_full += 1
                        continue
                    [host_page] = self.host.cache.allocate(1, PageUse.MLA)
                    whole.append((gpu_page, host_page))
                if i < len(req.page_hashes):
                    completing.append((PageUse.MLA, i, host_page, req.page_hashes[i]))
                    in_flight.add((id(req), PageUse.MLA, i))
                else:
                    self._unhashed[(req.request_id, i)] = host_page
            if completing:
                self._pending.append(_PendingMirror(req, completing, None))
        self._catch_up([req for req, _, _ in steps], whole, in_flight)
        if whole:
            self._last_ticket = self.executor.mirror_pages([w[0] for w in whole], [w[1] for w in whole])
            self.stats.pages_mirrored += len(whole)
        for pending in self._pending:
            if pending.ticket is None:  # pages copied by earlier steps (their hashes came now): the last copy
                pending.ticket = self._last_ticket
        self.poll()

    def _catch_up(self, requests: list[PagedRequest], whole: list[tuple[int, int]],
                  in_flight: set[tuple[int, PageUse, int]]) -> None:
        """Completed pages with no host copy yet (reused from the GPU prefix cache, completed indexer
        pages, pages the host pool was too full for) join `whole`, or share a host page that already
        holds the same prefix."""
        for req in requests:
            entries: list[tuple[PageUse, int, int, bytes]] = []
            for use, index, gpu_page, key in self._mirror_candidates(req):
                if (id(req), use, index) in in_flight:
                    continue
                cached = self.host.cache.lookup(use, key)
                if cached is not None:  # the same prefix is already on host: share it
                    self.host.cache.acquire(cached)
                    set_host(req, use, index, cached)
                    continue
                if self.host.cache.num_available == 0:
                    self.stats.mirror_skipped_host_full += 1
                    continue
                [host_page] = self.host.cache.allocate(1, use)
                entries.append((use, index, host_page, key))
                whole.append((gpu_page, host_page))
            if entries:
                self._pending.append(_PendingMirror(req, entries, None))

    def _mirror_candidates(self, req: PagedRequest) -> list[tuple[PageUse, int, int, bytes]]:
        """(use, index, GPU page, hash) of the completed pages of `req` that have no host copy and none in
        flight past the start that all have one; empty at once when that start covers every completed
        page (a running request's state between the steps that complete its pages)."""
        completed = min(req.num_computed_tokens // PAGE_SIZE, len(req.page_hashes))
        completed_idx = req.num_computed_tokens // self.indexer_tokens_per_page
        mla_from, idx_from = self._mirrored_prefix.get(req.request_id, (0, 0))
        if mla_from >= completed and idx_from >= completed_idx:
            return []
        while mla_from < completed and req.host_pages[mla_from] is not None:
            mla_from += 1
        while idx_from < completed_idx and req.host_indexer_pages[idx_from] is not None:
            idx_from += 1
        self._mirrored_prefix[req.request_id] = (mla_from, idx_from)
        candidates: list[tuple[PageUse, int, int, bytes]] = []
        for i in range(mla_from, completed):
            # Rows counted as computed are written by steps already launched (a continued speculative step
            # counts the row of its last known token before it is read), and a copy issued now runs after
            # them: a page complete by the count is copied whole here even before `mirror_step` sees it.
            if (req.host_pages[i] is None and req.mla_pages[i] is not None
                    and (req.request_id, i) not in self._unhashed):
                candidates.append((PageUse.MLA, i, req.mla_pages[i], req.page_hashes[i]))
        per_idx = self.indexer_tokens_per_page // PAGE_SIZE
        for j in range(idx_from, completed_idx):
            if req.host_indexer_pages[j] is None and (j + 1) * per_idx <= len(req.page_hashes):
                candidates.append((PageUse.INDEXER, j, req.indexer_pages[j], req.page_hashes[(j + 1) * per_idx - 1]))
        return candidates

    @property
    def backlog(self) -> int:
        """Completed pages whose host copy is still in flight (not yet demotable)."""
        return sum(len(p.entries) for p in self._pending)

    def host_copy_of(self, req: PagedRequest, index: int) -> int | None:
        """The host page holding the copy of MLA page `index` of `req` once its mirror is polled
        (published, or copied with its hash still unknown); None if it has none."""
        if index < len(req.host_pages) and req.host_pages[index] is not None:
            return req.host_pages[index]
        return self._unhashed.get((req.request_id, index))

    def poll(self, wait: bool = False) -> None:
        """Completes finished mirrors: their host copies become usable and findable."""
        still: list[_PendingMirror] = []
        for pending in self._pending:
            if pending.ticket is not None and not wait and not pending.ticket.done():
                still.append(pending)
                continue
            if pending.ticket is not None:
                pending.ticket.wait()
            for use, index, host_page, key in pending.entries:
                set_host(pending.request, use, index, host_page)
                self.host.cache.insert(host_page, use, key)
        self._pending = still

    def take_copies(self, req: PagedRequest) -> None:
        """Every copy mirroring made of `req`'s pages becomes its host page, published or not (the
        request stops running; its pages with no copy, the tail above all, are the caller's to copy)."""
        self.poll(wait=True)
        for key in [k for k in self._unhashed if k[0] == req.request_id]:
            req.host_pages[key[1]] = self._unhashed.pop(key)

    def restart(self, req: PagedRequest) -> None:
        """`req`'s host copies change wholesale (swap-in): the catch-up scan starts again."""
        self._mirrored_prefix.pop(req.request_id, None)

    def forget(self, req: PagedRequest) -> None:
        """Drops what mirroring holds for a released request, once its copies in flight are done (a host
        page freed while a copy into it is in flight could be handed out and overwritten)."""
        if any(p.request is req for p in self._pending):
            self.poll(wait=True)
        unhashed = [k for k in self._unhashed if k[0] == req.request_id]
        if unhashed and self._last_ticket is not None and not self._last_ticket.done():
            self._last_ticket.wait()
        for key in unhashed:
            self.host.cache.release(self._unhashed.pop(key))
        self._mirrored_prefix.pop(req.request_id, None)
