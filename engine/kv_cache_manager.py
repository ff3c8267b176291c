"""Pages of each request: prefix matching at admission, growth per step, caching, release.

Every request holds an MLA page per 64 tokens and an indexer page per
`indexer_tokens_per_page` tokens. A reused prefix needs its MLA rows and its
indexer keys: it is reused in whole MLA pages, sharing whole indexer pages and
copying the one it ends inside (found by alias), never the whole prompt (its last
token is always recomputed to produce logits). Transfers between engines and
reuse from the host tier still move whole indexer pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

from engine.kv_layout import KVLayout
from residency.manager import ResidencyManager
from residency.page_pool import PagePool, PageUse
from residency.prefix_cache import PrefixCache, chain_hashes, hashes_after
from engine.request import Request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


T = TypeVar("T")  # what a prefix walk finds for a page: its id, or its id and tier


class CachedPage(NamedTuple):
    """A cached page of a prefix and the tier that holds it."""

    page: int
    on_host: bool


class KVCacheManager:
    """Allocates, caches and frees the pages of requests through one pool."""

    def __init__(self, layout: KVLayout, num_pages: int, enable_prefix_cache: bool = True) -> None:
        self.layout = layout
        self.pool = PagePool(num_pages)
        self.cache = PrefixCache(self.pool)
        self.enable_prefix_cache = enable_prefix_cache
        self.residency: ResidencyManager | None = None  # set when a host tier exists
        # Whole-page GPU copies on every rank (set by the engine): partial indexer pages are copied.
        self.copy_pages: Callable[[list[int], list[int]], None] | None = None
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
        return self._walk_prefix(token_ids, self.cache.lookup)

    def locate_prefix(self, token_ids: list[int]) -> tuple[list[bytes], list[CachedPage], list[CachedPage]]:
        """`lookup_prefix` over both tiers: each page from the GPU cache, else from the host pool's. A prefix can
        be split between them: a request that reused host pages runs with them there, and the pages it computes
        after them are on the GPU. Takes nothing."""
        host = self.residency.host.cache if self.residency is not None else None

        def find(use: PageUse, key: bytes) -> CachedPage | None:
            page = self.cache.lookup(use, key)
            if page is not None:
                return CachedPage(page, False)
            page = host.lookup(use, key) if host is not None else None
            return CachedPage(page, True) if page is not None else None

        return self._walk_prefix(token_ids, find)

    def _walk_prefix(self, token_ids: list[int], find: Callable[[PageUse, bytes], T | None]
                     ) -> tuple[list[bytes], list[T], list[T]]:
        """The prefix's page hashes and, while `find` finds them, its MLA pages, then the indexer pages they
        complete, cut to whole indexer pages, one token short of the sequence."""
        hashes = chain_hashes(token_ids, self.page_size)
        per_idx = self.indexer_page_tokens // self.page_size
        mla: list[T] = []
        for h in hashes[: (len(token_ids) - 1) // self.page_size]:
            page = find(PageUse.MLA, h)
            if page is None:
                break
            mla.append(page)
        idx: list[T] = []
        while (len(idx) + 1) * per_idx <= len(mla):
            page = find(PageUse.INDEXER, hashes[(len(idx) + 1) * per_idx - 1])
            if page is None:
                break
            idx.append(page)
        return hashes, mla[: len(idx) * per_idx], idx

    def match_prefix(self, req: Request, reuse: bool = True) -> int:
        """Attaches cached pages of the longest reusable prefix of `req`'s tokens; returns its token count.
        `reuse=False` attaches none (the request computes its whole prompt) and returns 0."""
        if not self.enable_prefix_cache:
            return 0
        tokens = req.all_token_ids
        req.page_hashes, mla, idx = self.lookup_prefix(tokens)
        if not reuse:
            mla, idx = [], []
        for page in mla + idx:
            self.cache.acquire(page)
        req.mla_pages, req.indexer_pages = list(mla), idx
        req.pages_replaced_from(0)
        if not reuse:
            return 0
        if not self._extend_into_indexer_page(req, (len(tokens) - 1) // self.page_size):
            if self.residency is not None and self.residency.config.traits.runs_from_host:
                self._extend_from_host(req, (len(tokens) - 1) // self.page_size)
        hit = len(req.mla_pages) * self.page_size
        self.num_prefix_queried_tokens += len(tokens)
        self.num_prefix_hit_tokens += hit
        return hit

    def _extend_into_indexer_page(self, req: Request, max_pages: int) -> bool:
        """Continues a GPU match past the last whole indexer page: the further cached MLA pages are
        reused and the indexer page holding their keys is copied (it is found by alias through its
        last MLA page; rows beyond the prefix are overwritten as the request computes them)."""
        extra: list[int] = []
        for h in req.page_hashes[len(req.mla_pages) : max_pages]:
            page = self.cache.lookup(PageUse.MLA, h)
            if page is None:
                break
            extra.append(page)
        while extra:
            source = self.cache.lookup_alias(PageUse.INDEXER, req.page_hashes[len(req.mla_pages) + len(extra) - 1])
            if source is not None:
                break
            extra.pop()
        if not extra or self.copy_pages is None or self.cache.num_available < 1 + self.cache.revival_cost(extra):
            return False
        for page in extra:
            self.cache.acquire(page)
        [copy] = self.cache.allocate(1, PageUse.INDEXER)
        self.copy_pages([source], [copy])
        req.mla_pages += extra
        req.indexer_pages.append(copy)
        return True

    def reusable_prefix_tokens(self, token_ids: list[int]) -> int:
        """Tokens of `token_ids` a request would find cached at admission: on the GPU, and past them in the host
        tier when the policy runs requests from host pages. Takes nothing (a P/D decode replica asks this before
        sending a prompt to a prefill replica: a conversation's older pages may live on the host alone)."""
        if not self.enable_prefix_cache:
            return 0
        hashes, mla, idx = self.lookup_prefix(token_ids)
        host_mla: list[int] = []
        if self.residency is not None and self.residency.config.traits.runs_from_host:
            host_mla, _ = self._find_on_host(hashes, len(mla), len(idx), (len(token_ids) - 1) // self.page_size)
        return (len(mla) + len(host_mla)) * self.page_size

    def _find_on_host(self, hashes: list[bytes], num_mla: int, num_indexer: int, max_pages: int
                      ) -> tuple[list[int], list[tuple[int | None, int | None]]]:
        """How a prefix matched on the GPU up to `num_mla` MLA and `num_indexer` indexer pages continues in the
        host pool, in whole indexer pages: (host pages of the further MLA pages, (GPU page, host page) of each
        further indexer page, either may be None but not both). Takes nothing."""
        host = self.residency.host
        per_idx = self.indexer_page_tokens // self.page_size
        found: list[int] = []
        for i in range(num_mla, min(max_pages, len(hashes))):
            page = host.cache.lookup(PageUse.MLA, hashes[i])
            if page is None:
                break
            found.append(page)
        idx_found: list[tuple[int | None, int | None]] = []
        for j in range(num_indexer, (num_mla + len(found)) // per_idx):
            key = hashes[(j + 1) * per_idx - 1]
            gpu = self.cache.lookup(PageUse.INDEXER, key)
            hp = host.cache.lookup(PageUse.INDEXER, key)
            if gpu is None and hp is None:
                break
            idx_found.append((gpu, hp))
        found = found[: max((num_indexer + len(idx_found)) * per_idx - num_mla, 0)]
        return found, idx_found[: (num_mla + len(found)) // per_idx - num_indexer]

    def _extend_from_host(self, req: Request, max_pages: int) -> None:
        """Continues a prefix match in the host pool: MLA pages stay host-only (the request starts
        mixed or none, with a hot buffer), indexer pages are copied back to the GPU."""
        host = self.residency.host
        found, idx_found = self._find_on_host(req.page_hashes, len(req.mla_pages), len(req.indexer_pages), max_pages)
        copies = sum(1 for gpu, _ in idx_found if gpu is None)
        revived = self.cache.revival_cost([gpu for gpu, _ in idx_found if gpu is not None])
        if not found or copies + revived + self.residency.hot.pages_per_lease > self.cache.num_available:
            return
        for hp in found:
            host.cache.acquire(hp)
        req.host_pages = [None] * len(req.mla_pages) + found
        req.pages_changed_at(0)
        req.mla_pages += [None] * len(found)
        loads: list[tuple[int, int]] = []  # (host page, GPU page) of indexer pages found only on host
        for gpu, hp in idx_found:
            if gpu is not None:
                self.cache.acquire(gpu)
            else:
                [gpu] = self.cache.allocate(1, PageUse.INDEXER)
                loads.append((hp, gpu))
            req.indexer_pages.append(gpu)
        self.residency.load_pages([hp for hp, _ in loads], [gpu for _, gpu in loads])
        self.residency.hot.lease(req)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grows `req` to hold `num_tokens` tokens; False (nothing taken) if pages are short."""
        mla = max(_ceil_div(num_tokens, self.page_size) - len(req.mla_pages), 0)
        idx = max(_ceil_div(num_tokens, self.indexer_page_tokens) - len(req.indexer_pages), 0)
        if mla + idx == 0:  # most decode steps: the token lands in a page the request holds
            return True
        if mla + idx > self.cache.num_available:
            return False
        req.mla_pages += self.cache.allocate(mla, PageUse.MLA)
        req.indexer_pages += self.cache.allocate(idx, PageUse.INDEXER)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Releases `req`'s pages past those `num_tokens` tokens need: a speculative step took pages for
        drafts the target rejected. They hold only rejected rows, so none has a host copy or a prefix-cache
        entry (both cover computed rows only). The ranks' page tables are sent again from the first released
        page (a page taken later in its place is another page)."""
        keep_mla = _ceil_div(num_tokens, self.page_size)
        keep_idx = _ceil_div(num_tokens, self.indexer_page_tokens)
        if len(req.mla_pages) > keep_mla:
            req.pages_changed_at(keep_mla)
        if len(req.indexer_pages) > keep_idx:
            req.pages_changed_at(0)  # the page tables' change marks count MLA pages: 0 also covers the indexer's
        for pages, host, keep in ((req.mla_pages, req.host_pages, keep_mla),
                                  (req.indexer_pages, req.host_indexer_pages, keep_idx)):
            if any(p is not None for p in host[keep:]):
                raise RuntimeError(f"request {req.request_id}: a page past its {num_tokens} tokens has a host copy")
            del host[keep:]
            for page in reversed(pages[keep:]):
                self.cache.release(page)
            del pages[keep:]

    def cache_full_pages(self, req: Request) -> None:
        """Hashes the pages of `req` whose tokens are all computed and registers them for reuse.

        Hashes are kept even with the prefix cache off: they name host copies. Pages registered by an
        earlier step are skipped, so a decode step costs its new page, not the whole context (a request
        with host-only pages included: such a page registers when it comes back, which moves the mark
        back, `Request.pages_replaced_from`). A page whose last token was sampled by a step still running
        registers at the next call.
        """
        computed = min(req.num_computed_tokens, req.num_known_tokens)  # a pending token's id is not known yet
        full = computed // self.page_size
        if len(req.page_hashes) < full:
            first, parent = len(req.page_hashes) * self.page_size, req.page_hashes[-1] if req.page_hashes else None
            req.page_hashes += hashes_after(parent, req.token_ids(first, full * self.page_size), self.page_size)
        if not self.enable_prefix_cache:
            return
        start = req.num_registered_pages
        for i in range(start, full):
            if req.mla_pages[i] is not None:
                self.cache.insert(req.mla_pages[i], PageUse.MLA, req.page_hashes[i])
        per_idx = self.indexer_page_tokens // self.page_size
        for j in range(start // per_idx, computed // self.indexer_page_tokens):
            self.cache.insert(req.indexer_pages[j], PageUse.INDEXER, req.page_hashes[(j + 1) * per_idx - 1])
        for i in range(start, full):  # every completed MLA page names the indexer page holding its keys
            self.cache.add_alias(req.indexer_pages[i // per_idx], PageUse.INDEXER, req.page_hashes[i])
        req.num_registered_pages = full

    def free(self, req: Request) -> None:
        """Releases every page of `req`, tail first so the tail is evicted first.

        A partly filled last indexer page is kept in the cache (named by its last completed MLA
        page), so the next turn of a conversation can copy its rows instead of recomputing them.
        """
        full = min(req.num_computed_tokens // self.page_size, len(req.page_hashes))
        per_idx = self.indexer_page_tokens // self.page_size
        if self.enable_prefix_cache and req.indexer_pages and full > (len(req.indexer_pages) - 1) * per_idx:
            self.cache.insert(req.indexer_pages[-1], PageUse.INDEXER, req.page_hashes[full - 1])
        for page in reversed(req.indexer_pages):
            self.cache.release(page)
        for page in reversed(req.mla_pages):
            if page is not None:
                self.cache.release(page)
        req.mla_pages, req.indexer_pages = [], []
        req.pages_replaced_from(0)
        if self.residency is not None:
            self.residency.release(req)

    def num_pages_in_use(self) -> int:
        """Pages held by requests (not counting unreferenced cached pages)."""
        return self.pool.num_used() - (self.cache.num_available - self.pool.num_free)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        if self.residency is not None:
            self.residency.check_integrity()
