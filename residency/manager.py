"""Residency of each request's pages: mirroring, demotion, promotion, swapping, hot rows.

Mechanism only; the pressure policies (policies.py) decide when to use it.
A request's page table maps each logical MLA page to a GPU page, a host page,
or both (`mla_pages[i]` / `host_pages[i]`, None where absent). Derived state:
full (every page on GPU), mixed (some pages host-only, hot buffer leased),
none (every completed page host-only). Indexer pages of running requests stay
on the GPU. Every transition keeps both pools' reference counts exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kernels import page_mirror, resolve
from residency.config import HiSparseConfig
from residency.hot_buffer import PAGE_SIZE, HotLease
from residency.host_pool import HostPool
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache


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


@dataclass
class ResidencyStats:
    pages_mirrored: int = 0
    pages_demoted: int = 0
    pages_promoted: int = 0
    pages_swapped_out: int = 0
    pages_swapped_in: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    rows_copied_h2d: int = 0
    bytes_h2d: int = 0
    mirror_skipped_host_full: int = 0


@dataclass
class _PendingMirror:
    request: PagedRequest
    entries: list[tuple[PageUse, int, int, bytes]]  # (use, logical index, host page, hash)
    event: torch.cuda.Event | None


@dataclass
class GroupGeometry:
    """Where each IndexShare group's run sits in a page."""

    offsets: tuple[int, ...]
    run_bytes: tuple[int, ...]


class ResidencyManager:
    def __init__(
        self,
        config: HiSparseConfig,
        gpu_cache: PrefixCache,
        gpu_pool: torch.Tensor,
        host: HostPool,
        geometry: GroupGeometry,
        index_topk: int,
        indexer_tokens_per_page: int,
    ) -> None:
        self.config = config
        self.gpu_cache, self.gpu_pool, self.host = gpu_cache, gpu_pool, host
        self.geometry = geometry
        self.hot_rows = config.hot_rows_for(index_topk)
        self.hot_pages_per_lease = self.hot_rows // PAGE_SIZE
        self.indexer_tokens_per_page = indexer_tokens_per_page
        self.stats = ResidencyStats()
        self._pending: list[_PendingMirror] = []
        self._stream = torch.cuda.Stream(gpu_pool.device) if gpu_pool.is_cuda else None
        self._resolve = resolve.resolve_group if gpu_pool.is_cuda else resolve.resolve_group_reference

    # --- states --------------------------------------------------------------------

    @staticmethod
    def state(req: PagedRequest) -> str:
        completed = req.num_computed_tokens // PAGE_SIZE
        on_gpu = [p is not None for p in req.mla_pages[:completed]]
        if all(on_gpu):
            return "full"
        return "none" if not any(on_gpu) else "mixed"

    @staticmethod
    def align(req: PagedRequest) -> None:
        """Keeps the host tables as long as the GPU tables."""
        req.host_pages += [None] * (len(req.mla_pages) - len(req.host_pages))
        req.host_indexer_pages += [None] * (len(req.indexer_pages) - len(req.host_indexer_pages))

    # --- proactive mirroring -------------------------------------------------------

    def mirror_completed(self, requests: list[PagedRequest]) -> None:
        """Queues every completed, not yet mirrored page of `requests` to host, in one launch."""
        self.poll()
        in_flight = {(id(p.request), e[0], e[1]) for p in self._pending for e in p.entries}
        gpu_ids: list[int] = []
        host_ids: list[int] = []
        for req in requests:
            self.align(req)
            entries: list[tuple[PageUse, int, int, bytes]] = []
            for use, index, gpu_page, key in self._mirror_candidates(req):
                if (id(req), use, index) in in_flight:
                    continue
                cached = self.host.cache.lookup(use, key)
                if cached is not None:  # the same prefix is already on host: share it
                    self.host.cache.acquire(cached)
                    self._set_host(req, use, index, cached)
                    continue
                if self.host.cache.num_available == 0:
                    self.stats.mirror_skipped_host_full += 1
                    continue
                [host_page] = self.host.cache.allocate(1, use)
                entries.append((use, index, host_page, key))
                gpu_ids.append(gpu_page)
                host_ids.append(host_page)
            if entries:
                self._pending.append(_PendingMirror(req, entries, None))
        if not gpu_ids:
            return
        event = page_mirror.mirror_pages(self.gpu_pool, self.host.data, gpu_ids, host_ids, self._stream)
        for pending in self._pending:
            if pending.event is None:
                pending.event = event
        self.stats.pages_mirrored += len(gpu_ids)
        self.poll()

    def _mirror_candidates(self, req: PagedRequest):  # noqa: ANN202 - iterator of tuples
        completed = req.num_computed_tokens // PAGE_SIZE
        for i in range(min(completed, len(req.page_hashes))):
            if req.host_pages[i] is None and req.mla_pages[i] is not None:
                yield PageUse.MLA, i, req.mla_pages[i], req.page_hashes[i]
        per_idx = self.indexer_tokens_per_page // PAGE_SIZE
        for j in range(req.num_computed_tokens // self.indexer_tokens_per_page):
            if req.host_indexer_pages[j] is None and (j + 1) * per_idx <= len(req.page_hashes):
                yield PageUse.INDEXER, j, req.indexer_pages[j], req.page_hashes[(j + 1) * per_idx - 1]

    @staticmethod
    def _set_host(req: PagedRequest, use: PageUse, index: int, host_page: int) -> None:
        if use is PageUse.MLA:
            req.host_pages[index] = host_page
        else:
            req.host_indexer_pages[index] = host_page

    def poll(self, wait: bool = False) -> None:
        """Completes finished mirrors: their host copies become usable and findable."""
        still: list[_PendingMirror] = []
        for pending in self._pending:
            if pending.event is not None and not wait and not pending.event.query():
                still.append(pending)
                continue
            if pending.event is not None:
                pending.event.synchronize()
            for use, index, host_page, key in pending.entries:
                self._set_host(pending.request, use, index, host_page)
                self.host.cache.insert(host_page, use, key)
        self._pending = still

    # --- demotion and promotion ----------------------------------------------------

    def demotable(self, req: PagedRequest) -> list[int]:
        """Completed pages with a finished host copy whose GPU page can be dropped now.

        The last completed page stays: with the page being written it is the request's
        tail, the most recent tokens, which the indexer selects most often.
        """
        completed = req.num_computed_tokens // PAGE_SIZE
        return [i for i in range(completed - 1) if req.mla_pages[i] is not None and req.host_pages[i] is not None]

    def demotion_gain(self, req: PagedRequest) -> int:
        """GPU pages a demotion of `req` would free, net of the hot buffer it must lease."""
        lease = 0 if req.hot is not None else self.hot_pages_per_lease
        return len(self.demotable(req)) - lease

    def demote(self, req: PagedRequest) -> int:
        """full/mixed -> mixed: drops mirrored GPU pages, leases a hot buffer; returns pages freed net."""
        pages = self.demotable(req)
        if not pages or self.demotion_gain(req) <= 0:
            return 0
        for i in pages:
            self.gpu_cache.release(req.mla_pages[i])
            req.mla_pages[i] = None
        leased = 0 if req.hot is not None else self.lease_hot(req)
        self.stats.pages_demoted += len(pages)
        return len(pages) - leased

    def lease_hot(self, req: PagedRequest) -> int:
        pages = self.gpu_cache.allocate(self.hot_pages_per_lease, PageUse.HOT)
        req.hot = HotLease.new(pages, len(self.geometry.offsets), req.num_tokens + PAGE_SIZE, self.gpu_pool.device)
        return len(pages)

    def promotion_cost(self, req: PagedRequest) -> int:
        return sum(1 for p in req.mla_pages if p is None)

    def promote(self, req: PagedRequest) -> bool:
        """mixed/none -> full: copies host-only pages back and returns the hot buffer."""
        missing = [i for i, p in enumerate(req.mla_pages) if p is None]
        if len(missing) > self.gpu_cache.num_available:
            return False
        if missing:
            fresh = self.gpu_cache.allocate(len(missing), PageUse.MLA)
            src = torch.tensor([req.host_pages[i] for i in missing], dtype=torch.long)
            self.gpu_pool[torch.tensor(fresh, device=self.gpu_pool.device)] = self.host.data[src].to(self.gpu_pool.device)
            for i, page in zip(missing, fresh):
                req.mla_pages[i] = page
            self.stats.pages_promoted += len(missing)
            self.stats.bytes_h2d += len(missing) * self.gpu_pool.shape[1]
        self.return_hot(req)
        return True

    def return_hot(self, req: PagedRequest) -> None:
        if req.hot is not None:
            for page in req.hot.pages:
                self.gpu_cache.release(page)
            req.hot = None

    # --- whole-request swap (the offload baseline) ----------------------------------

    def swap_out(self, req: PagedRequest) -> bool:
        """Copies every page of `req` to host and frees its GPU pages; False if host is short."""
        self.align(req)
        todo = [(PageUse.MLA, i, p) for i, p in enumerate(req.mla_pages) if req.host_pages[i] is None]
        todo += [(PageUse.INDEXER, j, p) for j, p in enumerate(req.indexer_pages) if req.host_indexer_pages[j] is None]
        if len(todo) > self.host.cache.num_available:
            return False
        host_ids = [self.host.cache.allocate(1, use)[0] for use, _, _ in todo]
        if todo:
            event = page_mirror.mirror_pages(self.gpu_pool, self.host.data, [t[2] for t in todo], host_ids, self._stream)
            if event is not None:
                event.synchronize()
        for (use, index, _), host_page in zip(todo, host_ids):
            self._set_host(req, use, index, host_page)
        for page in req.mla_pages + req.indexer_pages:
            self.gpu_cache.release(page)
        self.stats.pages_swapped_out += len(req.mla_pages) + len(req.indexer_pages)
        req.mla_pages = [None] * len(req.mla_pages)
        req.indexer_pages = []
        return True

    def swap_in_cost(self, req: PagedRequest) -> int:
        return len(req.host_pages) + len(req.host_indexer_pages)

    def swap_in(self, req: PagedRequest) -> bool:
        """Brings a swapped request back in full (MLA and indexer pages) before it runs again."""
        need = self.swap_in_cost(req)
        if need > self.gpu_cache.num_available:
            return False
        mla = self.gpu_cache.allocate(len(req.host_pages), PageUse.MLA)
        idx = self.gpu_cache.allocate(len(req.host_indexer_pages), PageUse.INDEXER)
        src = torch.tensor(req.host_pages + req.host_indexer_pages, dtype=torch.long)
        dst = torch.tensor(mla + idx, dtype=torch.long, device=self.gpu_pool.device)
        self.gpu_pool[dst] = self.host.data[src].to(self.gpu_pool.device)
        for page in req.host_pages + req.host_indexer_pages:
            self.host.cache.release(page)
        req.mla_pages, req.indexer_pages = mla, idx
        req.host_pages, req.host_indexer_pages = [None] * len(mla), [None] * len(idx)
        self.stats.pages_swapped_in += need
        self.stats.bytes_h2d += need * self.gpu_pool.shape[1]
        return True

    # --- lookups for non-resident tokens --------------------------------------------

    def resolve_rows(self, req: PagedRequest, group: int, positions: torch.Tensor, lens: torch.Tensor,
                     step: int) -> torch.Tensor:
        """KV slots [n, K] for the top-K positions of `req`'s query rows, loading misses into its hot rows.

        Rows are resolved one after another with the same step stamp, so rows of
        one step never evict each other's hot slots (the scheduler keeps
        rows x top-K within the hot rows).
        """
        lease = req.hot
        assert lease is not None, "a request with host-only pages holds a hot lease"
        lease.ensure_capacity(req.num_tokens)
        self.align(req)
        dev = self.gpu_pool.device
        gpu = torch.tensor([-1 if p is None else p for p in req.mla_pages], dtype=torch.int32, device=dev)[None]
        host = torch.tensor([-1 if p is None else p for p in req.host_pages], dtype=torch.int32, device=dev)[None]
        out = torch.empty(positions.shape, dtype=torch.long, device=dev)
        for r in range(positions.shape[0]):
            result = self._resolve(
                positions[r : r + 1].to(torch.int32), lens[r : r + 1].to(torch.int32), gpu, host,
                lease.hot_slots[None], lease.slot_pos[group : group + 1], lease.slot_stamp[group : group + 1],
                lease.pos_to_hot[group : group + 1], step, self.geometry.offsets[group],
                self.geometry.run_bytes[group], self.gpu_pool, self.host.data,
            )
            out[r] = result.kv_slots[0].long().clamp(min=0)
            misses = int(result.num_copied.sum())
            valid = positions[r, : int(lens[r])]
            non_resident = int((gpu[0, valid // PAGE_SIZE] < 0).sum())
            self.stats.hot_misses += misses
            self.stats.hot_hits += non_resident - misses
            self.stats.rows_copied_h2d += misses
            self.stats.bytes_h2d += misses * self.geometry.run_bytes[group]
        return out

    # --- release --------------------------------------------------------------------

    def release(self, req: PagedRequest) -> None:
        """Drops `req`'s host pages and hot buffer (its GPU pages are the engine's to release)."""
        if any(p.request is req for p in self._pending):
            self.poll(wait=True)
        for page in req.host_pages + req.host_indexer_pages:
            if page is not None:
                self.host.cache.release(page)
        req.host_pages, req.host_indexer_pages = [], []
        self.return_hot(req)

    def check_integrity(self) -> None:
        self.host.check_integrity()


@dataclass
class StateCounter:
    """Requests by state over steps: peak and mean of each."""

    totals: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def record(self, counts: dict[str, int]) -> None:
        self.steps += 1
        for state, n in counts.items():
            self.totals[state] = self.totals.get(state, 0) + n
            self.peaks[state] = max(self.peaks.get(state, 0), n)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            s: {"peak": self.peaks[s], "mean": round(self.totals[s] / max(self.steps, 1), 3)} for s in self.totals
        }
