"""Prefix cache: full pages identified by a hash chained over their tokens.

A full MLA page of tokens [64 i, 64 (i+1)) is identified by the hash of its
tokens chained with the hash of the page before it, so equal hashes mean equal
whole prefixes. An indexer page is identified by the chained hash of the last
MLA page it covers. Cached pages whose last user left stay in use, unreferenced
and evictable, least recently released first; allocation evicts them only when
the free list runs short. An indexer page is also reachable by alias, through
every MLA page inside it, so a prefix that ends inside it can copy its rows;
aliases die with the page.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from residency.page_pool import OutOfPages, PagePool, PageUse

PageKey = tuple[PageUse, bytes]


def chain_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of every full page of `token_ids`, from the first (`hashes_after` continues a chain)."""
    return hashes_after(None, token_ids, page_size)


def hashes_after(parent: bytes | None, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of every full page of `token_ids`, the tokens after the page hashed `parent` (None: the first
    page's), so a request's new pages hash without reading its earlier tokens (building a 1M-token context's
    list again took 25 ms)."""
    full = len(token_ids) // page_size * page_size
    ids = np.asarray(token_ids[:full], dtype=np.int64)  # converted once: a conversion a page cost more
    hashes, last = [], b"root" if parent is None else parent
    for start in range(0, full, page_size):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(last)
        digest.update(ids[start : start + page_size])  # a contiguous slice: its int64 bytes, as before
        last = digest.digest()
        hashes.append(last)
    return hashes


class PrefixCache:
    """Owns the release path of pages: cached ones become evictable, others go free."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._alias_page: dict[PageKey, int] = {}
        self._aliases_of: dict[int, list[PageKey]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evicted = 0

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def lookup(self, use: PageUse, key: bytes) -> int | None:
        return self._page_of.get((use, key))

    def revival_cost(self, pages: Sequence[int]) -> int:
        """Available pages that acquiring `pages` would use up: the evictable ones among them."""
        return sum(1 for page in set(pages) if page in self._evictable)

    def acquire(self, page: int) -> None:
        """Takes a reference to a cached page (reviving it if it was evictable)."""
        self._evictable.pop(page, None)
        self.pool.incref(page)

    def insert(self, page: int, use: PageUse, key: bytes) -> bool:
        """Makes `page` findable by `key`; False when another page already holds that key."""
        if (use, key) in self._page_of or page in self._key_of:
            return False
        self._page_of[(use, key)] = page
        self._key_of[page] = (use, key)
        return True

    def add_alias(self, page: int, use: PageUse, key: bytes) -> None:
        """Names a page by a prefix it covers only in part (an indexer page by an MLA page inside it),
        for reading while the page lives; the first page named so keeps the alias."""
        if (use, key) not in self._alias_page:
            self._alias_page[(use, key)] = page
            self._aliases_of.setdefault(page, []).append((use, key))

    def lookup_alias(self, use: PageUse, key: bytes) -> int | None:
        return self._alias_page.get((use, key))

    def _free(self, page: int) -> None:
        for alias in self._aliases_of.pop(page, ()):
            del self._alias_page[alias]
        self.pool.free(page)

    def release(self, page: int) -> None:
        if self.pool.decref(page):
            return
        if page in self._key_of:
            self._evictable[page] = None
        else:
            self._free(page)

    def claim(self, keys: Sequence[PageKey], held: list[int]) -> list[int | None] | None:
        """Pages for every key of a group that must be cached whole, or None (nothing taken) when they do not
        fit: cached ones acquired, fresh ones allocated for the others, all pinned in `held`. Returns, for each
        key, its fresh page for the caller to fill and then `insert`, or None where the page was cached.

        Cached pages count against the room when evictable, since acquiring them takes them out of it (a group
        let in on its missing pages alone failed at its last allocation, the pages before it held by nobody).
        """
        found = [self.lookup(use, key) for use, key in keys]
        cached = [page for page in found if page is not None]
        if len(keys) - len(cached) + self.revival_cost(cached) > self.num_available:
            return None
        for page in cached:
            self.acquire(page)
            held.append(page)
        fresh: list[int | None] = []
        for (use, _), page in zip(keys, found):
            fresh.append(None if page is not None else self.allocate(1, use)[0])
            if page is None:
                held.append(fresh[-1])  # released (freed: not yet findable) if the caller fails before `insert`
        return fresh

    def allocate(self, n: int, use: PageUse) -> list[int]:
        """`n` fresh pages, evicting least recently released cached pages if needed."""
        if n > self.num_available:
            raise OutOfPages(f"asked for {n} pages, {self.num_available} available")
        while self.pool.num_free < n:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self._free(page)
            self.num_evicted += 1
        return self.pool.allocate(n, use)

    def clear(self) -> None:
        """Drops every unreferenced cached page (used pages keep their keys until released)."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self._free(page)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for key, page in self._page_of.items():
            assert self._key_of[page] == key
            assert self.pool.use_of(page) is key[0]
        for page in self._evictable:
            assert page in self._key_of and self.pool.refs(page) == 0
        for alias, page in self._alias_page.items():
            assert self.pool.use_of(page) is alias[0] and alias in self._aliases_of[page]
        for page in range(self.pool.num_pages):
            if self.pool.use_of(page) is not None and self.pool.refs(page) == 0:
                assert page in self._evictable, f"page {page} unreferenced but neither free nor evictable"
