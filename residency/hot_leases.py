"""Hot leases: the GPU pages a request with host-only pages holds for the rows its indexer selects.

A request leases `hot_rows` slots (whole pages of the pool, use HOT) when its first pages leave the GPU;
its resolves (on the ranks, in the forward) load selected host-only rows into them. A step may compute
as many query rows as its lease can serve without a slot being reused within the step
(`rows_per_step`); an extend grows the lease for its rows and the decode after it shrinks it back
(`size_hot_for`), keeping the rows of the slots that stay. Every rank keeps the lease's LRU tables
(opened, resized and closed through the `PoolExecutor`).
"""

from __future__ import annotations

from residency.hot_buffer import PAGE_SIZE, HotLease
from residency.interfaces import PagedRequest, PoolExecutor
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache


class HotLeases:
    def __init__(self, gpu_cache: PrefixCache, executor: PoolExecutor, index_topk: int, hot_rows: int) -> None:
        self.gpu_cache, self.executor, self.index_topk = gpu_cache, executor, index_topk
        self.hot_rows = hot_rows
        self.pages_per_lease = hot_rows // PAGE_SIZE

    @staticmethod
    def host_only_tokens(req: PagedRequest) -> int:
        return PAGE_SIZE * req.mla_pages.count(None)

    def rows_per_step(self, req: PagedRequest) -> int:
        """Query rows `req` may compute in one step with its hot buffer: every miss of the step needs
        a slot no earlier row of the step used, and a step misses each host-only token at most once."""
        rows = req.hot.num_rows if req.hot is not None else 0
        if rows >= self.host_only_tokens(req):
            return 1 << 30
        return max(1, rows // self.index_topk)

    def pages_for(self, req: PagedRequest, rows: int) -> int:
        """Pages the hot buffer of `req` takes for `rows` query rows per step (`size_for` fits it to them):
        K slots a row, never more than its host-only tokens, never fewer than the configured lease."""
        want_rows = min(rows * self.index_topk, self.host_only_tokens(req))
        return max(self.pages_per_lease, -(-want_rows // PAGE_SIZE))

    def serves(self, req: PagedRequest, rows: int) -> bool:
        """Whether the lease of `req` as it is computes `rows` query rows a step and sizing it for them leaves
        it as it is: a step scheduled before the one before it is read must get exactly those rows."""
        return (req.hot is not None and self.rows_per_step(req) >= rows
                and self.pages_for(req, rows) == len(req.hot.pages))

    def size_for(self, req: PagedRequest, rows: int, spare_pages: int) -> None:
        """Fits the hot buffer of a request with host-only pages to `rows` query rows per step: an
        extend grows it (with at most `spare_pages` free pages) so a turn's new tokens take few
        steps; back at one row it returns to the configured size. The slots of the pages that stay
        keep their rows, so the decode after an extend finds the rows it held before. A negative
        `spare_pages` is what the request's own next pages lack: the lease gives that many back, down to
        the configured size (grown by an extend, it held the pages the request then needed to cross into
        a new MLA and indexer page at once, and the request gave way to itself, over and over)."""
        if req.hot is None:
            return
        want = self.pages_for(req, rows)
        have = list(req.hot.pages)
        if spare_pages < 0:
            want = min(want, max(len(have) + spare_pages, self.pages_per_lease))
        if want > len(have):
            have += self.gpu_cache.allocate(min(want - len(have), max(spare_pages, 0)), PageUse.HOT)
        else:
            for page in have[want:]:
                self.gpu_cache.release(page)
            have = have[:want]
        if len(have) != len(req.hot.pages):
            req.hot = HotLease(tuple(have))
            self.executor.resize_lease(req.request_id, have, req.num_tokens + PAGE_SIZE)

    def lease(self, req: PagedRequest) -> int:
        pages = self.gpu_cache.allocate(self.pages_per_lease, PageUse.HOT)
        req.hot = HotLease(tuple(pages))
        self.executor.open_lease(req.request_id, pages, req.num_tokens + PAGE_SIZE)
        return len(pages)

    def release(self, req: PagedRequest) -> None:
        if req.hot is not None:
            for page in req.hot.pages:
                self.gpu_cache.release(page)
            req.hot = None
            self.executor.close_lease(req.request_id)
