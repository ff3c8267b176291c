"""The page pool: one free list of equal pages, typed by use, reference counted.

Mechanism only: it knows nothing of requests, prefixes or residency. A page is
free, or in use with a reference count and a use (MLA, indexer, hot). When the
last reference goes, the owner of the page decides whether it returns to the
free list (`free`) or is kept by the prefix cache.
"""

from __future__ import annotations

from collections import deque
from enum import Enum


class PageUse(str, Enum):
    MLA = "mla"
    INDEXER = "indexer"
    HOT = "hot"


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """Free list plus per-page use and reference count for `num_pages` pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("a page pool needs at least one page")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._use: list[PageUse | None] = [None] * num_pages
        self._refs: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_used(self, use: PageUse | None = None) -> int:
        if use is None:
            return self.num_pages - self.num_free
        return sum(1 for u in self._use if u is use)

    def allocate(self, n: int, use: PageUse) -> list[int]:
        """Takes `n` free pages, each with one reference."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._use[i], self._refs[i] = use, 1
        return ids

    def incref(self, page: int) -> None:
        if self._use[page] is None:
            raise ValueError(f"page {page} is free")
        self._refs[page] += 1

    def decref(self, page: int) -> int:
        """Drops one reference; returns the count left. The page stays in use at zero."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} has no reference to drop")
        self._refs[page] -= 1
        return self._refs[page]

    def refs(self, page: int) -> int:
        return self._refs[page]

    def use_of(self, page: int) -> PageUse | None:
        return self._use[page]

    def free(self, page: int) -> None:
        """Returns an unreferenced page to the free list."""
        if self._use[page] is None or self._refs[page]:
            raise ValueError(f"page {page} is not an unreferenced page in use")
        self._use[page] = None
        self._free.append(page)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "page listed twice in the free list"
        for page in range(self.num_pages):
            in_use = self._use[page] is not None
            assert in_use != (page in free), f"page {page}: in use and free disagree"
            assert self._refs[page] >= 0 and (in_use or self._refs[page] == 0)
        assert self.num_used() + self.num_free == self.num_pages
