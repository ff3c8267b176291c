"""What the residency mechanism talks to: the requests it pages and the executor that moves their bytes.

Protocols only. The engine's `Request` is a `PagedRequest`; the engine's executor
(every tensor-parallel rank's copy of the GPU pool, the one shared host pool) is
a `PoolExecutor`, whose asynchronous copies come back as `CopyTicket`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from residency.hot_buffer import HotLease


class PagedRequest(Protocol):
    """What residency needs of a request (the engine's Request has these)."""

    request_id: str
    mla_pages: list[int | None]
    host_pages: list[int | None]
    indexer_pages: list[int]
    host_indexer_pages: list[int | None]
    page_hashes: list[bytes]
    num_computed_tokens: int
    hot: HotLease | None

    @property
    def num_tokens(self) -> int: ...

    def pages_replaced_from(self, index: int) -> None:
        """GPU pages from `index` on were replaced: the prefix cache registers them again (and they moved)."""
        ...

    def pages_changed_at(self, index: int) -> None:
        """MLA or host page entries from `index` on changed other than by appending (0: any page list)."""
        ...


class CopyTicket(Protocol):
    """Completion of an asynchronous page copy."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class PoolExecutor(Protocol):
    """What residency asks of the ranks that hold the replica's GPU pools."""

    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyTicket:
        """Whole GPU pages -> host pages, asynchronously."""
        ...

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyTicket:
        """Whole host pages -> GPU pages, on every rank before its next step; done once every rank has
        read the host pages."""
        ...

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        """Every rank creates the request's hot tables (reverse map covering `capacity` positions)."""
        ...

    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        """Every rank refits the request's hot tables, keeping the entries of the slots that stay."""
        ...

    def close_lease(self, request_id: str) -> None: ...
