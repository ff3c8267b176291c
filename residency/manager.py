"""Residency of each request's pages: demotion and promotion here; mirroring
(residency/mirroring.py), hot leases (residency/hot_leases.py) and whole-request
swapping (residency/swapping.py) run under it.

Mechanism only; the pressure policies (policies.py) decide when to use it, in the one plan per step
(plan.py) the scheduler carries out.
A request's page table maps each logical MLA page to a GPU page, a host page,
or both (`mla_pages[i]` / `host_pages[i]`, None where absent). Derived state:
full (every page on GPU), mixed (some pages host-only, hot buffer leased),
none (every completed page host-only). Indexer pages of running requests stay
on the GPU. Under `hybrid` every page is mirrored to the host at the step
that completes it, so completed pages are demotable without a copy once
that copy lands. Every transition keeps both pools' reference counts exact.

Decisions are made here, once per replica; the bytes move through a
`PoolExecutor`: the engine's executor, which has every tensor-parallel rank
copy pages in its own replica of the GPU pool (mirrors into the one shared
host pool are done by one rank) and keep its own copy of each request's
hot-buffer LRU tables, keyed by request id, opened and closed here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from residency.config import HiSparseConfig
from residency.hot_buffer import PAGE_SIZE
from residency.hot_leases import HotLeases
from residency.host_pool import HostPool
from residency.interfaces import CopyTicket, PagedRequest, PoolExecutor
from residency.mirroring import Mirroring
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache
from residency.stats import ResidencyStats, ResolveCounts
from residency.swapping import Swapping

logger = logging.getLogger(__name__)


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
        self.hot = HotLeases(gpu_cache, executor, index_topk, config.hot_rows_for(index_topk))
        self.indexer_tokens_per_page = indexer_tokens_per_page
        self.stats = ResidencyStats()
        self._loads: CopyTicket | None = None  # the last page load's completion
        self.mirroring = Mirroring(executor, host, self.stats, indexer_tokens_per_page)
        self.swapping = Swapping(config, gpu_cache, host, executor, self.mirroring, self.hot, self.stats,
                                 self.load_pages, int(config.offload_pool_gib * 2**30) // self.page_bytes)

    # --- states --------------------------------------------------------------------

    @staticmethod
    def state(req: PagedRequest) -> str:
        completed = req.mla_pages[: req.num_computed_tokens // PAGE_SIZE]
        if None not in completed:
            return "full"
        return "none" if completed.count(None) == len(completed) else "mixed"

    @property
    def mirror_backlog(self) -> int:
        return self.mirroring.backlog

    # --- demotion and promotion ----------------------------------------------------

    def demotable(self, req: PagedRequest) -> list[int]:
        """Completed pages with a finished host copy whose GPU page dropping frees now.

        The last completed page stays: with the page being written it is the request's
        tail, the most recent tokens, which the indexer selects most often. A page another
        request shares through the prefix cache stays too: dropping this request's
        reference frees nothing while the other holds it, and the request would then read
        from the host rows the GPU still has. (Counted as freed, such pages made demotion
        promise pages it could not give, and leasing the hot buffer then found the pool
        empty in the middle of a step.)
        """
        completed = req.num_computed_tokens // PAGE_SIZE
        refs = self.gpu_cache.pool.refs
        return [i for i in range(completed - 1)
                if req.mla_pages[i] is not None and req.host_pages[i] is not None and refs(req.mla_pages[i]) == 1]

    def demotion_gain(self, req: PagedRequest) -> int:
        """GPU pages a demotion of `req` would free, net of the hot buffer it must lease."""
        lease = 0 if req.hot is not None else self.hot.pages_per_lease
        return len(self.demotable(req)) - lease

    def demote(self, req: PagedRequest) -> int:
        """full/mixed -> mixed: drops mirrored GPU pages, leases a hot buffer; returns pages freed net."""
        pages = self.demotable(req)
        if not pages or self.demotion_gain(req) <= 0:
            return 0
        for i in pages:
            self.gpu_cache.release(req.mla_pages[i])
            req.mla_pages[i] = None
        req.pages_changed_at(pages[0])
        leased = 0 if req.hot is not None else self.hot.lease(req)
        self.stats.pages_demoted += len(pages)
        return len(pages) - leased

    def promotion_cost(self, req: PagedRequest) -> int:
        return req.mla_pages.count(None)

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
        self.hot.release(req)
        return True

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> None:
        """Copies host pages into GPU pages on every rank (promotion, swap-in, host prefix reuse)."""
        if not gpu_ids:
            return
        self._loads = self.executor.load_pages(host_ids, gpu_ids)
        self.stats.bytes_h2d += len(gpu_ids) * self.page_bytes

    def wait_for_loads(self) -> None:
        """Blocks until every rank has read the host pages of the loads issued so far: the loads are not
        waited for when issued, and a host page freed after its load may be handed out again, so a CPU
        writer of the host pool (P/D landing) calls this first."""
        if self._loads is not None:
            self._loads.wait()
            self._loads = None

    # --- lookups for non-resident tokens (resolved on the ranks, in the forward) ------

    def record_resolves(self, counts: ResolveCounts) -> None:
        """Adds what the ranks' resolves of one step did (they run in the forward, on the ranks)."""
        self.stats.hot_hits += counts.hot_hits
        self.stats.hot_misses += counts.hot_misses
        self.stats.rows_copied_h2d += counts.hot_misses
        self.stats.bytes_h2d += counts.bytes_h2d
        if counts.unresolved:  # the step's outputs are wrong for some request: a lease was sized too small
            self.stats.hot_unresolved += counts.unresolved
            logger.error("%d selected host-only rows found no hot slot this step (hot leases too small for "
                         "the rows scheduled)", counts.unresolved)

    # --- release --------------------------------------------------------------------

    def release(self, req: PagedRequest) -> None:
        """Drops `req`'s host pages and hot buffer (its GPU pages are the engine's to release)."""
        self.mirroring.forget(req)
        self.swapping.forget(req)
        for page in req.host_pages + req.host_indexer_pages:
            if page is not None:
                self.host.cache.release(page)
        req.host_pages, req.host_indexer_pages = [], []
        req.pages_changed_at(0)
        self.hot.release(req)

    def check_integrity(self) -> None:
        self.host.check_integrity()
