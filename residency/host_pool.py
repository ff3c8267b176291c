"""The host tier: pinned memory in pages of the GPU page layout, reference counted and hashed.

GPU kernels read it directly (a pinned CPU tensor is a valid device pointer),
so a miss copies one IndexShare group's run of one token straight from here.
Its pages carry the same prefix hashes as GPU pages, so a conversation's next
turn finds its prefix on host after the GPU copy was evicted or demoted.
The engine's executor allocates the memory (pinned on CUDA; shared by every
tensor-parallel rank of the replica); this class keeps its page accounting.
"""

from __future__ import annotations

import logging

import torch

from residency.page_pool import PagePool
from residency.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class HostPool:
    def __init__(self, data: torch.Tensor) -> None:
        """`data`: [num_pages, page_bytes] uint8 host memory in the GPU page layout."""
        self.data = data
        num_pages, page_bytes = data.shape
        self.cache = PrefixCache(PagePool(num_pages))
        logger.info("host pool: %d pages (%.2f GiB)", num_pages, num_pages * page_bytes / 2**30)

    @property
    def num_pages(self) -> int:
        return self.cache.pool.num_pages

    def num_in_use(self) -> int:
        """Pages referenced by requests (unreferenced cached pages excluded)."""
        return self.cache.pool.num_used() - (self.cache.num_available - self.cache.pool.num_free)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
