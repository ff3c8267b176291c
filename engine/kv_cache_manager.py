"""Pages of each request: prefix matching at admission, growth per step, caching, release.

Every request holds an MLA page per 64 tokens and an indexer page per
`indexer_tokens_per_page` tokens. Reuse goes through the prefix cache in whole
indexer pages (a reused prefix needs its MLA rows and its indexer keys), never
the whole prompt (its last token is always recomputed to produce logits).
"""

from __future__ import annotations

from engine.kv_layout import KVLayout
from residency.page_pool import PagePool, PageUse
from residency.prefix_cache import PrefixCache, chain_hashes
from engine.request import Request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the pages of requests through one pool."""

    def __init__(self, layout: KVLayout, num_pages: int, enable_prefix_cache: bool = True) -> None:
        self.layout = layout
        self.pool = PagePool(num_pages)
        self.cache = PrefixCache(self.pool)
        self.enable_prefix_cache = enable_prefix_cache
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def indexer_page_tokens(self) -> int:
        return self.layout.indexer_tokens_per_page

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        """Extra pages `req` needs to hold `num_tokens` tokens in total."""
        mla = _ceil_div(num_tokens, self.page_size) - len(req.mla_pages)
        idx = _ceil_div(num_tokens, self.indexer_page_tokens) - len(req.indexer_pages)
        return max(mla, 0) + max(idx, 0)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages a request of `num_tokens` tokens holds (admission checks)."""
        return _ceil_div(num_tokens, self.page_size) + _ceil_div(num_tokens, self.indexer_page_tokens)

    @property
    def num_available(self) -> int:
        return self.cache.num_available

    def lookup_prefix(self, token_ids: list[int]) -> tuple[list[bytes], list[int], list[int]]:
        """(page hashes, cached MLA pages, cached indexer pages) of the longest reusable prefix.

        Reuse stops one token short of the whole sequence and is whole indexer pages long.
        Nothing is acquired: callers take references before the pages can be evicted.
        """
        hashes = chain_hashes(token_ids, self.page_size)
        per_idx = self.indexer_page_tokens // self.page_size
        mla: list[int] = []
        for h in hashes[: (len(token_ids) - 1) // self.page_size]:
            page = self.cache.lookup(PageUse.MLA, h)
            if page is None:
                break
            mla.append(page)
        idx: list[int] = []
        while (len(idx) + 1) * per_idx <= len(mla):
            page = self.cache.lookup(PageUse.INDEXER, hashes[(len(idx) + 1) * per_idx - 1])
            if page is None:
                break
            idx.append(page)
        return hashes, mla[: len(idx) * per_idx], idx

    def match_prefix(self, req: Request) -> int:
        """Attaches cached pages of the longest reusable prefix of `req`'s tokens; returns its token count."""
        if not self.enable_prefix_cache:
            return 0
        tokens = req.all_token_ids
        req.page_hashes, mla, idx = self.lookup_prefix(tokens)
        for page in mla + idx:
            self.cache.acquire(page)
        req.mla_pages, req.indexer_pages = mla, idx
        hit = len(mla) * self.page_size
        self.num_prefix_queried_tokens += len(tokens)
        self.num_prefix_hit_tokens += hit
        return hit

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grows `req` to hold `num_tokens` tokens; False (nothing taken) if pages are short."""
        mla = max(_ceil_div(num_tokens, self.page_size) - len(req.mla_pages), 0)
        idx = max(_ceil_div(num_tokens, self.indexer_page_tokens) - len(req.indexer_pages), 0)
        if mla + idx > self.cache.num_available:
            return False
        req.mla_pages += self.cache.allocate(mla, PageUse.MLA)
        req.indexer_pages += self.cache.allocate(idx, PageUse.INDEXER)
        return True

    def cache_full_pages(self, req: Request) -> None:
        """Registers the pages of `req` whose tokens are all computed."""
        if not self.enable_prefix_cache:
            return
        computed = req.num_computed_tokens
        full = computed // self.page_size
        if len(req.page_hashes) < full:
            req.page_hashes += chain_hashes(req.all_token_ids[: full * self.page_size], self.page_size, req.page_hashes)
        for i in range(full):
            self.cache.insert(req.mla_pages[i], PageUse.MLA, req.page_hashes[i])
        per_idx = self.indexer_page_tokens // self.page_size
        for j in range(computed // self.indexer_page_tokens):
            self.cache.insert(req.indexer_pages[j], PageUse.INDEXER, req.page_hashes[(j + 1) * per_idx - 1])

    def free(self, req: Request) -> None:
        """Releases every page of `req`, tail first so the tail is evicted first."""
        for page in reversed(req.indexer_pages):
            self.cache.release(page)
        for page in reversed(req.mla_pages):
            self.cache.release(page)
        req.mla_pages, req.indexer_pages = [], []

    def num_pages_in_use(self) -> int:
        """Pages held by requests (not counting unreferenced cached pages)."""
        return self.pool.num_used() - (self.cache.num_available - self.pool.num_free)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
