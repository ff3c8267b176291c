"""Whole-request swapping: a request's pages go to the host pool and come back before it runs again.

`offload` swaps a request out whole and brings it back whole (dense-attention style); `hybrid` parks
one the same way, but its completed pages are mostly mirrored already (residency/mirroring.py), so
only the tail and the indexer pages move out, and it resumes with just its indexer pages and tail on
the GPU behind a hot buffer. Indexer pages of parked requests live in the host pool within their own
budget (`offload_pool_gib`). Mechanism only: the pressure policies decide whom to swap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from residency.config import HiSparseConfig
from residency.hot_buffer import PAGE_SIZE
from residency.hot_leases import HotLeases
from residency.host_pool import HostPool
from residency.interfaces import PagedRequest, PoolExecutor
from residency.mirroring import Mirroring, align, set_host
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache
from residency.stats import ResidencyStats


class Swapping:
    """Moves whole requests between the GPU and the host pool, keeping both pools' counts exact."""

    def __init__(self, config: HiSparseConfig, gpu_cache: PrefixCache, host: HostPool, executor: PoolExecutor,
                 mirroring: Mirroring, hot: HotLeases, stats: ResidencyStats,
                 load_pages: Callable[[Sequence[int], Sequence[int]], None], offload_budget_pages: int) -> None:
        self.config, self.gpu_cache, self.host, self.executor = config, gpu_cache, host, executor
        self.mirroring, self.hot, self.stats = mirroring, hot, stats
        self.load_pages = load_pages  # host pages -> GPU pages on every rank, counted
        self.offload_budget_pages = offload_budget_pages
        # Indexer pages each parked (`hybrid`) request holds on host, within `offload_budget_pages`; an entry
        # leaves when its request is swapped in or ends (an aborted parked request kept its share for good).
        self._parked: dict[str, int] = {}

    @property
    def parked_indexer_pages(self) -> int:
        return sum(self._parked.values())

    def swap_out(self, req: PagedRequest) -> bool:
        """Copies every page of `req` not yet on host there and frees its GPU pages; False if host is short.

        `offload` swaps a request this way; `hybrid` parks one (its completed pages are mostly
        mirrored already, so only the tail and the indexer pages move, the latter within the
        separate `offload_pool_gib` budget).
        """
        align(req)
        self.mirroring.take_copies(req)
        todo = [(PageUse.MLA, i, p) for i, p in enumerate(req.mla_pages) if req.host_pages[i] is None]
        todo += [(PageUse.INDEXER, j, p) for j, p in enumerate(req.indexer_pages) if req.host_indexer_pages[j] is None]
        indexer = sum(1 for use, _, _ in todo if use is PageUse.INDEXER)
        if len(todo) > self.host.cache.num_available or not self._indexer_budget_allows(indexer):
            return False
        host_ids = [self.host.cache.allocate(1, use)[0] for use, _, _ in todo]
        if todo:
            self.executor.mirror_pages([t[2] for t in todo], host_ids).wait()
        for (use, index, _), host_page in zip(todo, host_ids):
            set_host(req, use, index, host_page)
        moved = [p for p in req.mla_pages + req.indexer_pages if p is not None]
        for page in moved:
            self.gpu_cache.release(page)
        self.hot.release(req)
        self.stats.pages_swapped_out += len(moved)
        if self.config.traits.runs_from_host:
            self._parked[req.request_id] = len(req.host_indexer_pages)
        req.mla_pages = [None] * len(req.mla_pages)
        req.indexer_pages = []
        req.pages_changed_at(0)
        return True

    def forget(self, req: PagedRequest) -> None:
        """`req` ended (finished or aborted, parked or not): its indexer pages leave the parking budget."""
        self._parked.pop(req.request_id, None)

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
        hot = self.hot.pages_per_lease if self.config.traits.runs_from_host and len(mla) < len(req.host_pages) else 0
        return len(mla) + len(indexer) + hot

    def swap_in(self, req: PagedRequest) -> bool:
        """Brings a swapped request back so it can run: whole (offload) or its tail (hybrid)."""
        need = self.swap_in_cost(req)
        if need > self.gpu_cache.num_available:
            return False
        mla_idx, idx_idx = self._resume_pages(req)
        self.mirroring.restart(req)  # host copies are dropped below
        mla = self.gpu_cache.allocate(len(mla_idx), PageUse.MLA)
        idx = self.gpu_cache.allocate(len(idx_idx), PageUse.INDEXER)
        self.load_pages([req.host_pages[i] for i in mla_idx] + list(req.host_indexer_pages), mla + idx)
        self._parked.pop(req.request_id, None)
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
        if not self.config.traits.runs_from_host:  # (the host entries changed: marked by pages_replaced_from above)
            for i in mla_idx:
                if req.host_pages[i] is not None:
                    self.host.cache.release(req.host_pages[i])
                    req.host_pages[i] = None
        elif any(p is None for p in req.mla_pages[:completed]):
            self.hot.lease(req)
        self.stats.pages_swapped_in += len(mla) + len(idx)
        return True
