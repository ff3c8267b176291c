"""Residency of each request's pages: mirroring, demotion, promotion, swapping, hot rows.

Mechanism only; the pressure policies (policies.py) decide when to use it.
A request's page table maps each logical MLA page to a GPU page, a host page,
or both (`mla_pages[i]` / `host_pages[i]`, None where absent). Derived state:
full (every page on GPU), mixed (some pages host-only, hot buffer leased),
none (every completed page host-only). Indexer pages of running requests stay
on the GPU. Under `hybrid` every forward's new rows are mirrored to the host
copy of their page right after it, so completed pages are always demotable
without a copy. Every transition keeps both pools' reference counts exact.

Decisions are made here, once per replica; the bytes move through a
`PoolExecutor`: the engine's executor, which has every tensor-parallel rank
copy pages in its own replica of the GPU pool (mirrors into the one shared
host pool are done by one rank) and keep its own copy of each request's
hot-buffer LRU tables, keyed by request id, opened and closed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from residency.config import HiSparseConfig
from residency.hot_buffer import PAGE_SIZE, HotLease
from residency.host_pool import HostPool
from residency.interfaces import CopyTicket, PagedRequest, PoolExecutor
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache
from residency.stats import ResidencyStats, ResolveCounts


@dataclass
class _PendingMirror:
    request: PagedRequest
    entries: list[tuple[PageUse, int, int, bytes]]  # (use, logical index, host page, hash)
    ticket: CopyTicket | None


class ResidencyManager:
    def __init__(
        self,
        config: HiSparseConfig,
        gpu_cache: PrefixCache,
        executor: PoolExecutor,
        host: HostPool,
        index_topk: int,
        indexer_tokens_per_page: int,
    ) -> None:
        self.config = config
        self.gpu_cache, self.executor, self.host = gpu_cache, executor, host
        self.page_bytes = host.data.shape[1]
        self.index_topk = index_topk
        self.hot_rows = config.hot_rows_for(index_topk)
        self.hot_pages_per_lease = self.hot_rows // PAGE_SIZE
        self.indexer_tokens_per_page = indexer_tokens_per_page
        self.stats = ResidencyStats()
        self._pending: list[_PendingMirror] = []
        self._last_ticket: CopyTicket | None = None  # of the last mirror issued
        # Host copies of pages still being written: (request id, page index) -> host page.
        self._partial: dict[tuple[str, int], int] = {}
        # Per request, (MLA pages, indexer pages) at its start that all have host copies: the
        # catch-up scan starts there, so a step costs the new pages, not the whole context.
        self._mirrored_prefix: dict[str, tuple[int, int]] = {}
        # Indexer pages of parked requests live in the host pool within their own budget.
        self.offload_budget_pages = int(config.offload_pool_gib * 2**30) // self.page_bytes
        self.parked_indexer_pages = 0

    # --- states --------------------------------------------------------------------

    @staticmethod
    def state(req: PagedRequest) -> str:
        completed = req.mla_pages[: req.num_computed_tokens // PAGE_SIZE]
        if None not in completed:
            return "full"
        return "none" if completed.count(None) == len(completed) else "mixed"

    @staticmethod
    def align(req: PagedRequest) -> None:
        """Keeps the host tables as long as the GPU tables."""
        req.host_pages += [None] * (len(req.mla_pages) - len(req.host_pages))
        req.host_indexer_pages += [None] * (len(req.indexer_pages) - len(req.host_indexer_pages))

    # --- proactive mirroring -------------------------------------------------------

    def mirror_step(self, steps: list[tuple[PagedRequest, int, int]]) -> None:
        """Mirrors what a forward wrote: for each (request, first, end) the rows of tokens
        [first, end) of every layer go to the host copy of their page, one launch for all; a page
        whose host copy starts now is copied whole once. A page that completes with its host copy
        becomes demotable (and findable by its hash) as soon as the copy is done, with nothing
        left to copy on the critical path."""
        self.poll()
        whole: list[tuple[int, int]] = []
        rows: list[tuple[int, int, int]] = []
        for req, first, end in steps:
            self.align(req)
            completing: list[tuple[PageUse, int, int, bytes]] = []
            start = first // PAGE_SIZE
            if start and (req.request_id, start - 1) in self._partial:
                start -= 1  # completed before its hash was known (its last token was pending): publish now
            for i in range(start, -(-end // PAGE_SIZE)):
                gpu_page = req.mla_pages[i]
                if gpu_page is None or req.host_pages[i] is not None:
                    continue
                host_page = self._partial.get((req.request_id, i))
                if host_page is None:
                    if self.host.cache.num_available == 0:
                        self.stats.mirror_skipped_host_full += 1
                        continue
                    [host_page] = self.host.cache.allocate(1, PageUse.MLA)
                    self._partial[(req.request_id, i)] = host_page
                    whole.append((gpu_page, host_page))
                else:
                    rows += [(gpu_page, host_page, t % PAGE_SIZE)
                             for t in range(max(first, i * PAGE_SIZE), min(end, (i + 1) * PAGE_SIZE))]
                if i < end // PAGE_SIZE and i < len(req.page_hashes):  # complete now: publish once copied
                    del self._partial[(req.request_id, i)]
                    completing.append((PageUse.MLA, i, host_page, req.page_hashes[i]))
            if completing:
                self._pending.append(_PendingMirror(req, completing, None))
        self._catch_up([req for req, _, _ in steps], whole)
        ticket = None  # of the last copy issued: the others are done no later (rows are copied in order)
        if rows:
            ticket = self.executor.mirror_rows(*zip(*rows))
            self.stats.rows_mirrored += len(rows)
        if whole:
            ticket = self.executor.mirror_pages([w[0] for w in whole], [w[1] for w in whole])
            self.stats.pages_mirrored += len(whole)
        self._last_ticket = ticket or self._last_ticket
        for pending in self._pending:
            if pending.ticket is None:  # a page whose rows were all copied by earlier steps: the last copy
                pending.ticket = self._last_ticket
        self.poll()

    def _catch_up(self, requests: list[PagedRequest], whole: list[tuple[int, int]]) -> None:
        """Completed pages with no host copy yet (reused from the GPU prefix cache, completed indexer
        pages, pages the host pool was too full for) join `whole`, or share a host page that already
        holds the same prefix."""
        in_flight = {(id(p.request), e[0], e[1]) for p in self._pending for e in p.entries}
        for req in requests:
            entries: list[tuple[PageUse, int, int, bytes]] = []
            for use, index, gpu_page, key in self._mirror_candidates(req):
                if (id(req), use, index) in in_flight:
                    continue
                cached = self.host.cache.lookup(use, key)
                if cached is not None:  # the same prefix is already on host: share it
                    self.host.cache.acquire(cached)
                    self._set_host(req, use, index, cached)
                    continue
                if self.host.cache.num_available == 0:
                    self.stats.mirror_skipped_host_full += 1
                    continue
                [host_page] = self.host.cache.allocate(1, use)
                entries.append((use, index, host_page, key))
                whole.append((gpu_page, host_page))
            if entries:
                self._pending.append(_PendingMirror(req, entries, None))

    def _mirror_candidates(self, req: PagedRequest):  # noqa: ANN202 - iterator of tuples
        completed = min(req.num_computed_tokens // PAGE_SIZE, len(req.page_hashes))
        completed_idx = req.num_computed_tokens // self.indexer_tokens_per_page
        mla_from, idx_from = self._mirrored_prefix.get(req.request_id, (0, 0))
        while mla_from < completed and req.host_pages[mla_from] is not None:
            mla_from += 1
        while idx_from < completed_idx and req.host_indexer_pages[idx_from] is not None:
            idx_from += 1
        self._mirrored_prefix[req.request_id] = (mla_from, idx_from)
        for i in range(mla_from, completed):
            if req.host_pages[i] is None and req.mla_pages[i] is not None:
                yield PageUse.MLA, i, req.mla_pages[i], req.page_hashes[i]
        per_idx = self.indexer_tokens_per_page // PAGE_SIZE
        for j in range(idx_from, completed_idx):
            if req.host_indexer_pages[j] is None and (j + 1) * per_idx <= len(req.page_hashes):
                yield PageUse.INDEXER, j, req.indexer_pages[j], req.page_hashes[(j + 1) * per_idx - 1]

    @property
    def mirror_backlog(self) -> int:
        """Completed pages whose host copy is still in flight (not yet demotable)."""
        return sum(len(p.entries) for p in self._pending)

    def host_copy_of(self, req: PagedRequest, index: int) -> int | None:
        """The host page mirroring MLA page `index` of `req`, complete or still being written."""
        if index < len(req.host_pages) and req.host_pages[index] is not None:
            return req.host_pages[index]
        return self._partial.get((req.request_id, index))

    @staticmethod
    def _set_host(req: PagedRequest, use: PageUse, index: int, host_page: int) -> None:
        if use is PageUse.MLA:
            req.host_pages[index] = host_page
        else:
            req.host_indexer_pages[index] = host_page

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
                self._set_host(pending.request, use, index, host_page)
                self.host.cache.insert(host_page, use, key)
        self._pending = still

    # --- demotion and promotion ----------------------------------------------------

    def demotable(self, req: PagedRequest) -> list[int]:
        """Completed pages with a finished host copy whose GPU page can be dropped now.

        The last completed page stays: with the page being written it is the request's
        tail, the most recent tokens, which the indexer selects most often.
        """
        completed = req.num_computed_tokens // PAGE_SIZE
        return [i for i in range(completed - 1) if req.mla_pages[i] is not None and req.host_pages[i] is not None]

    def demotion_gain(self, req: PagedRequest) -> int:
        """GPU pages a demotion of `req` would free, net of the hot buffer it must lease."""
        lease = 0 if req.hot is not None else self.hot_pages_per_lease
        return len(self.demotable(req)) - lease

    def demote(self, req: PagedRequest) -> int:
        """full/mixed -> mixed: drops mirrored GPU pages, leases a hot buffer; returns pages freed net."""
        pages = self.demotable(req)
        if not pages or self.demotion_gain(req) <= 0:
            return 0
        for i in pages:
            self.gpu_cache.release(req.mla_pages[i])
            req.mla_pages[i] = None
        leased = 0 if req.hot is not None else self.lease_hot(req)
        self.stats.pages_demoted += len(pages)
        return len(pages) - leased

    @staticmethod
    def host_only_tokens(req: PagedRequest) -> int:
        return PAGE_SIZE * sum(1 for p in req.mla_pages if p is None)

    def rows_per_step(self, req: PagedRequest) -> int:
        """Query rows `req` may compute in one step with its hot buffer: every miss of the step needs
        a slot no earlier row of the step used, and a step misses each host-only token at most once."""
        rows = req.hot.num_rows if req.hot is not None else 0
        if rows >= self.host_only_tokens(req):
            return 1 << 30
        return max(1, rows // self.index_topk)

    def size_hot_for(self, req: PagedRequest, rows: int, spare_pages: int) -> None:
        """Fits the hot buffer of a request with host-only pages to `rows` query rows per step: an
        extend grows it (with at most `spare_pages` free pages) so a turn's new tokens take few
        steps; back at one row it returns to the configured size. The slots of the pages that stay
        keep their rows, so the decode after an extend finds the rows it held before."""
        if req.hot is None:
            return
        want_rows = min(rows * self.index_topk, self.host_only_tokens(req))
        want = max(self.hot_pages_per_lease, -(-want_rows // PAGE_SIZE))
        have = list(req.hot.pages)
        if want > len(have):
            have += self.gpu_cache.allocate(min(want - len(have), max(spare_pages, 0)), PageUse.HOT)
        else:
            for page in have[want:]:
                self.gpu_cache.release(page)
            have = have[:want]
        if len(have) != len(req.hot.pages):
            req.hot = HotLease(tuple(have))
            self.executor.resize_lease(req.request_id, have, req.num_tokens + PAGE_SIZE)

    def lease_hot(self, req: PagedRequest) -> int:
        pages = self.gpu_cache.allocate(self.hot_pages_per_lease, PageUse.HOT)
        req.hot = HotLease(tuple(pages))
        self.executor.open_lease(req.request_id, pages, req.num_tokens + PAGE_SIZE)
        return len(pages)

    def promotion_cost(self, req: PagedRequest) -> int:
        return sum(1 for p in req.mla_pages if p is None)

    def promote(self, req: PagedRequest) -> bool:
        """mixed/none -> full: copies host-only pages back and returns the hot buffer."""
        missing = [i for i, p in enumerate(req.mla_pages) if p is None]
        if len(missing) > self.gpu_cache.num_available:
            return False
        if missing:
            fresh = self.gpu_cache.allocate(len(missing), PageUse.MLA)
            self.load_pages([req.host_pages[i] for i in missing], fresh)
            for i, page in zip(missing, fresh):
                req.mla_pages[i] = page
            req.pages_replaced_from(missing[0])
            self.stats.pages_promoted += len(missing)
        self.return_hot(req)
        return True

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> None:
        """Copies host pages into GPU pages on every rank (promotion, swap-in, host prefix reuse)."""
        if not gpu_ids:
            return
        self.executor.load_pages(host_ids, gpu_ids)
        self.stats.bytes_h2d += len(gpu_ids) * self.page_bytes

    def return_hot(self, req: PagedRequest) -> None:
        if req.hot is not None:
            for page in req.hot.pages:
                self.gpu_cache.release(page)
            req.hot = None
            self.executor.close_lease(req.request_id)

    # --- whole-request swap (the offload baseline) ----------------------------------

    def swap_out(self, req: PagedRequest) -> bool:
        """Copies every page of `req` not yet on host there and frees its GPU pages; False if host is short.

        `offload` swaps a request this way; `hybrid` parks one (its completed pages are mostly
        mirrored already, so only the tail and the indexer pages move, the latter within the
        separate `offload_pool_gib` budget).
        """
        self.align(req)
        self.poll(wait=True)
        for key in [k for k in self._partial if k[0] == req.request_id]:  # current up to the last step
            req.host_pages[key[1]] = self._partial.pop(key)
        todo = [(PageUse.MLA, i, p) for i, p in enumerate(req.mla_pages) if req.host_pages[i] is None]
        todo += [(PageUse.INDEXER, j, p) for j, p in enumerate(req.indexer_pages) if req.host_indexer_pages[j] is None]
        indexer = sum(1 for use, _, _ in todo if use is PageUse.INDEXER)
        if len(todo) > self.host.cache.num_available or not self._indexer_budget_allows(indexer):
            return False
        host_ids = [self.host.cache.allocate(1, use)[0] for use, _, _ in todo]
        if todo:
            self.executor.mirror_pages([t[2] for t in todo], host_ids).wait()
        for (use, index, _), host_page in zip(todo, host_ids):
            self._set_host(req, use, index, host_page)
        moved = [p for p in req.mla_pages + req.indexer_pages if p is not None]
        for page in moved:
            self.gpu_cache.release(page)
        self.return_hot(req)
        self.stats.pages_swapped_out += len(moved)
        self.parked_indexer_pages += len(req.host_indexer_pages) if self.config.traits.runs_from_host else 0
        req.mla_pages = [None] * len(req.mla_pages)
        req.indexer_pages = []
        return True

    def _indexer_budget_allows(self, indexer_pages: int) -> bool:
        if not self.config.traits.runs_from_host:
            return True
        return self.parked_indexer_pages + indexer_pages <= self.offload_budget_pages

    def _resume_pages(self, req: PagedRequest) -> tuple[list[int], list[int]]:
        """(MLA page indices, indexer page indices) a swapped request brings back to run again:
        everything for `offload`; for `hybrid` the indexer pages and the tail (the last completed
        page and the one being written), the rest stays on host behind a hot buffer."""
        indexer = list(range(len(req.host_indexer_pages)))
        if not self.config.traits.runs_from_host:
            return list(range(len(req.host_pages))), indexer
        return list(range(max(len(req.host_pages) - 2, 0), len(req.host_pages))), indexer

    def swap_in_cost(self, req: PagedRequest) -> int:
        mla, indexer = self._resume_pages(req)
        hot = self.hot_pages_per_lease if self.config.traits.runs_from_host and len(mla) < len(req.host_pages) else 0
        return len(mla) + len(indexer) + hot

    def swap_in(self, req: PagedRequest) -> bool:
        """Brings a swapped request back so it can run: whole (offload) or its tail (hybrid)."""
        need = self.swap_in_cost(req)
        if need > self.gpu_cache.num_available:
            return False
        mla_idx, idx_idx = self._resume_pages(req)
        self._mirrored_prefix.pop(req.request_id, None)  # host copies are dropped below
        mla = self.gpu_cache.allocate(len(mla_idx), PageUse.MLA)
        idx = self.gpu_cache.allocate(len(idx_idx), PageUse.INDEXER)
        self.load_pages([req.host_pages[i] for i in mla_idx] + list(req.host_indexer_pages), mla + idx)
        if self.config.traits.runs_from_host:
            self.parked_indexer_pages -= len(req.host_indexer_pages)
        for page in req.host_indexer_pages:  # the GPU copies grow from here; host copies go stale
            self.host.cache.release(page)
        req.indexer_pages, req.host_indexer_pages = idx, [None] * len(idx)
        req.pages_replaced_from(0)
        completed = req.num_computed_tokens // PAGE_SIZE
        for i, page in zip(mla_idx, mla):
            req.mla_pages[i] = page
            if i >= completed:  # the partial page is written again on GPU: its host copy goes stale
                self.host.cache.release(req.host_pages[i])
                req.host_pages[i] = None
        if not self.config.traits.runs_from_host:
            for i in mla_idx:
                if req.host_pages[i] is not None:
                    self.host.cache.release(req.host_pages[i])
                    req.host_pages[i] = None
        elif any(p is None for p in req.mla_pages[:completed]):
            self.lease_hot(req)
        self.stats.pages_swapped_in += len(mla) + len(idx)
        return True

    # --- lookups for non-resident tokens (resolved on the ranks, in the forward) ------

    def record_resolves(self, counts: ResolveCounts) -> None:
        """Adds what the ranks' resolves of one step did (they run in the forward, on the ranks)."""
        self.stats.hot_hits += counts.hot_hits
        self.stats.hot_misses += counts.hot_misses
        self.stats.rows_copied_h2d += counts.hot_misses
        self.stats.bytes_h2d += counts.bytes_h2d

    # --- release --------------------------------------------------------------------

    def release(self, req: PagedRequest) -> None:
        """Drops `req`'s host pages and hot buffer (its GPU pages are the engine's to release)."""
        if any(p.request is req for p in self._pending):
            self.poll(wait=True)
        for key in [k for k in self._partial if k[0] == req.request_id]:
            self.host.cache.release(self._partial.pop(key))
        for page in req.host_pages + req.host_indexer_pages:
            if page is not None:
                self.host.cache.release(page)
        req.host_pages, req.host_indexer_pages = [], []
        self._mirrored_prefix.pop(req.request_id, None)
        self.return_hot(req)

    def check_integrity(self) -> None:
        self.host.check_integrity()
