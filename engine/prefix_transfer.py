"""Moving a computed prefix between engines: snapshot its cached pages, install them elsewhere.

A prefill replica computes a prompt, then `snapshot_prefix` copies the prompt's
cached pages (whole MLA pages and the indexer pages they complete) to host
memory. A decode replica `install_prefix`es them into its own prefix cache, so
the request it then admits finds its prefix cached like any other reuse. The
page hashes travel with the bytes and are checked against the receiver's own
hashing of the token ids, so bytes only ever land under the prefix they belong to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache_manager import KVCacheManager
from residency.page_pool import PageUse

logger = logging.getLogger(__name__)


@dataclass
class PrefixSnapshot:
    """Host copy of the cached pages covering the first `num_tokens` tokens."""

    num_tokens: int
    page_hashes: list[bytes]  # chained hash per MLA page of the prefix
    mla: torch.Tensor  # [num_mla_pages, page_bytes] uint8, CPU
    indexer: torch.Tensor  # [num_indexer_pages, page_bytes] uint8, CPU


class PageStore(Protocol):
    """Whole-page access to a replica's GPU pool, whichever ranks hold it (the executors)."""

    def read_pages(self, gpu_ids: Sequence[int]) -> torch.Tensor: ...

    def write_pages(self, gpu_ids: Sequence[int], data: torch.Tensor) -> None: ...


def snapshot_prefix(kv: KVCacheManager, pages: PageStore, token_ids: list[int]) -> PrefixSnapshot:
    """Copies the cached reusable prefix of `token_ids` out of the GPU pool and the host pool: a prefill replica
    under `hybrid` may hold part of a prompt's prefix on the host alone (its request reused those pages from
    there), and an export of the GPU pages alone would stop at the first of them."""
    hashes, mla, idx = kv.locate_prefix(token_ids)
    located = mla + idx
    data = torch.empty(len(located), kv.layout.page_bytes, dtype=torch.uint8)
    for on_host in (False, True):
        rows = [i for i, cached in enumerate(located) if cached.on_host == on_host]
        if not rows:
            continue
        ids = [located[i].page for i in rows]
        data[rows] = kv.residency.host.data[ids] if on_host else pages.read_pages(ids)
    return PrefixSnapshot(len(mla) * kv.page_size, hashes[: len(mla)], data[: len(mla)], data[len(mla) :])


def install_prefix(kv: KVCacheManager, pages: PageStore, token_ids: list[int], snap: PrefixSnapshot) -> int:
    """Adds the snapshot's pages to the prefix cache; returns the prefix tokens now cached.

    Pages already cached are kept; the rest are written into fresh pages while
    pages are available. Raises ValueError when the snapshot does not belong to
    `token_ids` (hash mismatch) or has the wrong page size.
    """
    page_bytes = kv.layout.page_bytes
    if snap.mla.shape[1:] != (page_bytes,) or snap.indexer.shape[1:] != (page_bytes,):
        raise ValueError(f"snapshot pages are not {page_bytes} bytes: the two engines differ in layout")
    hashes, _, _ = kv.lookup_prefix(token_ids)
    if hashes[: len(snap.page_hashes)] != snap.page_hashes:
        raise ValueError("snapshot page hashes do not match these token ids")
    per_idx = kv.indexer_page_tokens // kv.page_size
    held: list[int] = []  # pages of this prefix, pinned until the end so installing cannot evict them
    installed_idx = 0
    try:
        for j in range(snap.indexer.shape[0]):
            group = [(PageUse.MLA, snap.page_hashes[i], snap.mla[i]) for i in range(j * per_idx, (j + 1) * per_idx)]
            group.append((PageUse.INDEXER, snap.page_hashes[(j + 1) * per_idx - 1], snap.indexer[j]))
            if not _install_pages(kv, pages, group, held):
                break
            installed_idx += 1
    finally:
        for page in held:
            kv.cache.release(page)
    logger.debug("installed %d of %d indexer pages of a prefix", installed_idx, snap.indexer.shape[0])
    return installed_idx * per_idx * kv.page_size


def _install_pages(kv: KVCacheManager, store: PageStore, group: list[tuple], held: list[int]) -> bool:
    """Caches every page of `group` (use, key, bytes) or none (`PrefixCache.claim`); pins them in `held`."""
    fresh = kv.cache.claim([(use, key) for use, key, _ in group], held)
    if fresh is None:
        return False
    new = [(page, entry) for page, entry in zip(fresh, group) if page is not None]
    if new:
        store.write_pages([page for page, _ in new], torch.stack([data for _, (_, _, data) in new]))
    for page, (use, key, _) in new:
        kv.cache.insert(page, use, key)
    return True
