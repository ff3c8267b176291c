"""Page pool and prefix cache: exact page ids, reference counts, eviction order."""

from __future__ import annotations

import pytest

from residency.page_pool import OutOfPages, PagePool, PageUse
from residency.prefix_cache import PrefixCache, chain_hashes, hashes_after


def make_cache(num_pages: int) -> PrefixCache:
    return PrefixCache(PagePool(num_pages))


def test_pool_allocates_in_order_and_counts_uses() -> None:
    pool = PagePool(6)
    assert pool.allocate(2, PageUse.MLA) == [0, 1]
    assert pool.allocate(1, PageUse.INDEXER) == [2]
    assert pool.allocate(1, PageUse.HOT) == [3]
    assert (pool.num_used(PageUse.MLA), pool.num_used(PageUse.INDEXER), pool.num_used(PageUse.HOT)) == (2, 1, 1)
    assert pool.num_free == 2
    with pytest.raises(OutOfPages):
        pool.allocate(3, PageUse.MLA)
    assert pool.num_free == 2  # a refused allocation takes nothing
    assert pool.decref(1) == 0
    pool.free(1)
    assert pool.allocate(3, PageUse.MLA) == [4, 5, 1]
    pool.check_integrity()


def test_pool_refuses_misuse() -> None:
    pool = PagePool(2)
    [p] = pool.allocate(1, PageUse.MLA)
    with pytest.raises(ValueError):
        pool.free(p)  # still referenced
    pool.decref(p)
    with pytest.raises(ValueError):
        pool.decref(p)
    pool.free(p)
    with pytest.raises(ValueError):
        pool.incref(p)


def test_chain_hashes_identify_whole_prefixes() -> None:
    a = chain_hashes(list(range(10)), 4)
    assert len(a) == 2
    b = chain_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]
    c = chain_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert c[1] != a[1]  # same page tokens, different prefix
    assert hashes_after(a[-1], list(range(8, 12)), 4) == chain_hashes(list(range(12)), 4)[2:]
    # a request's next pages hash from the last page's hash and their own tokens only (a partial page: none)
    whole = chain_hashes(list(range(21)), 4)
    assert hashes_after(whole[1], list(range(8, 21)), 4) == whole[2:] and hashes_after(None, [0, 1, 2], 4) == []
    assert hashes_after(None, list(range(21)), 4) == whole


def test_cached_pages_are_evicted_least_recently_released_first() -> None:
    cache = make_cache(4)
    pages = cache.allocate(4, PageUse.MLA)
    for i, p in enumerate(pages):
        assert cache.insert(p, PageUse.MLA, bytes([i]))
    for p in (2, 0, 3):
        cache.release(p)
    assert cache.num_available == 3 and cache.pool.num_free == 0
    assert cache.allocate(2, PageUse.INDEXER) == [2, 0]
    assert cache.lookup(PageUse.MLA, bytes([2])) is None
    assert cache.lookup(PageUse.MLA, bytes([3])) == 3
    cache.acquire(3)  # revived: no longer evictable
    assert cache.num_available == 0
    cache.check_integrity()


def test_shared_pages_count_references() -> None:
    cache = make_cache(3)
    [p] = cache.allocate(1, PageUse.MLA)
    cache.insert(p, PageUse.MLA, b"k")
    cache.acquire(p)
    assert cache.pool.refs(p) == 2
    cache.release(p)
    assert cache.num_available == 2
    cache.release(p)
    assert cache.num_available == 3 and cache.num_cached == 1
    assert not cache.insert(1, PageUse.MLA, b"k")  # key already held by page p
    cache.clear()
    assert cache.num_cached == 0 and cache.pool.num_free == 3
    cache.check_integrity()


def test_uncached_pages_go_straight_back() -> None:
    cache = make_cache(2)
    pages = cache.allocate(2, PageUse.INDEXER)
    for p in pages:
        cache.release(p)
    assert cache.pool.num_free == 2 and cache.num_cached == 0
    cache.check_integrity()
