"""One rank's side of residency: it executes the page copies the driver decided and keeps the
hot-buffer LRU tables of every leased request.

The driver (residency/manager.py) decides which pages move where and which
requests lease hot buffers; every rank carries those decisions out on its own
replica of the KV pool. Page loads (promotion, swap-in, host prefix reuse) run
on every rank; mirrors to the host pool run on one rank only (rank 0), because
the host pool is one per replica and every rank's pool holds the same bytes.
Each rank keeps its own `HotTables` per request id, created and dropped when
the driver leases and returns a hot buffer; the resolve in the forward reads
and updates them on this rank's device. Every rank runs the same resolves on
the same inputs, so the tables, and what they load into the hot slots, stay
identical across ranks (`digests` lets tests and integrity checks compare).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.kv_layout import KVLayout
from engine.parallel.step import NonResidentSpec
from kernels import page_mirror, resolve
from residency.hot_buffer import PAGE_SIZE, HotTables
from residency.manager import ResolveCounts


class RankResidency:
    def __init__(self, layout: KVLayout, pool: torch.Tensor, host: torch.Tensor) -> None:
        self.pool, self.host = pool, host
        self.num_groups = len(layout.group_sizes)
        self.group_offsets = tuple(layout.group_offset(g) for g in range(self.num_groups))
        self.group_run_bytes = layout.group_run_bytes
        self.tables: dict[str, HotTables] = {}
        self._counts = ResolveCounts()
        self._stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        self._resolve = resolve.resolve_group if pool.is_cuda else resolve.resolve_group_reference

    # --- leases ----------------------------------------------------------------------

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        if request_id in self.tables:
            raise RuntimeError(f"request {request_id!r} already holds a hot lease on this rank")
        self.tables[request_id] = HotTables.new(tuple(pages), self.num_groups, capacity, self.pool.device)

    def close_lease(self, request_id: str) -> None:
        del self.tables[request_id]

    def digests(self) -> dict[str, str]:
        """A hash of each lease's tables: equal across ranks when they resolved in lockstep."""
        out = {}
        for rid, t in self.tables.items():
            h = hashlib.sha256()
            for tensor in (t.hot_slots, t.slot_pos, t.slot_stamp, t.pos_to_hot):
                h.update(tensor.cpu().numpy().tobytes())
            out[rid] = h.hexdigest()
        return out

    # --- page copies -----------------------------------------------------------------

    def mirror(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> torch.cuda.Event | None:
        """Copies whole GPU pages to host pages on a side stream; the event marks completion (None: done)."""
        return page_mirror.mirror_pages(self.pool, self.host, list(gpu_ids), list(host_ids), self._stream)

    def mirror_rows(self, gpu_ids: Sequence[int], host_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """Copies single tokens' rows of every layer to the same tokens of host pages: per IndexShare
        group one gather of whole runs (a token's rows of the group are contiguous)."""
        if not gpu_ids:
            return
        gpu = torch.tensor(list(gpu_ids), dtype=torch.long, device=self.pool.device)
        tok = torch.tensor(list(tokens), dtype=torch.long, device=self.pool.device)
        host, host_tok = torch.tensor(list(host_ids), dtype=torch.long), tok.cpu()
        for offset, run in zip(self.group_offsets, self.group_run_bytes):
            src = self.pool[:, offset : offset + PAGE_SIZE * run].unflatten(1, (PAGE_SIZE, run))
            dst = self.host[:, offset : offset + PAGE_SIZE * run].unflatten(1, (PAGE_SIZE, run))
            dst[host, host_tok] = src[gpu, tok].cpu()

    def load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> None:
        """Copies whole host pages into GPU pages, in order with this rank's forward steps."""
        if not gpu_ids:
            return
        dst = torch.tensor(list(gpu_ids), dtype=torch.long, device=self.pool.device)
        self.pool[dst] = self.host[torch.tensor(list(host_ids), dtype=torch.long)].to(self.pool.device)

    # --- lookups for non-resident tokens ----------------------------------------------

    def resolve_rows(self, spec: NonResidentSpec, group: int, positions: torch.Tensor, lens: torch.Tensor,
                     step: int) -> torch.Tensor:
        """KV slots [n, K] for the top-K positions of one request's query rows, loading misses into its
        hot rows.

        Rows are resolved one after another with the same step stamp, so rows of
        one step never evict each other's hot slots (the scheduler keeps
        rows x top-K within the hot rows).
        """
        tables = self.tables[spec.request_id]
        tables.ensure_capacity(spec.num_tokens)
        dev = self.pool.device
        gpu, host = spec.gpu_pages.to(dev)[None], spec.host_pages.to(dev)[None]
        out = torch.empty(positions.shape, dtype=torch.long, device=dev)
        hits = misses = 0
        for r in range(positions.shape[0]):
            result = self._resolve(
                positions[r : r + 1].to(torch.int32), lens[r : r + 1].to(torch.int32), gpu, host,
                tables.hot_slots[None], tables.slot_pos[group : group + 1], tables.slot_stamp[group : group + 1],
                tables.pos_to_hot[group : group + 1], step, self.group_offsets[group],
                self.group_run_bytes[group], self.pool, self.host,
            )
            out[r] = result.kv_slots[0].long().clamp(min=0)
            copied = int(result.num_copied.sum())
            valid = positions[r, : int(lens[r])]
            misses += copied
            hits += int((gpu[0, valid // PAGE_SIZE] < 0).sum()) - copied
        self._counts += ResolveCounts(hits, misses, misses * self.group_run_bytes[group])
        return out

    def resolve_decode(self, specs: Sequence[NonResidentSpec], group: int, positions: torch.Tensor,
                       lens: torch.Tensor, step: int) -> torch.Tensor:
        """KV slots [B, K] for one decode row of each of B requests, in one resolve for the group.

        The requests' tables are stacked (padded: missing pages -1; missing hot slots look held and
        used this step, so they are never victims), resolved together, and written back.
        """
        dev = self.pool.device
        tables = [self.tables[s.request_id] for s in specs]
        for t, s in zip(tables, specs):
            t.ensure_capacity(s.num_tokens)
        num_pages = max(s.gpu_pages.numel() for s in specs)
        rows = max(t.hot_slots.numel() for t in tables)
        capacity = max(t.pos_to_hot.shape[1] for t in tables)
        b = len(specs)
        gpu = torch.full((b, num_pages), -1, dtype=torch.int32, device=dev)
        host = torch.full((b, num_pages), -1, dtype=torch.int32, device=dev)
        hot_slots = torch.zeros((b, rows), dtype=torch.int32, device=dev)
        slot_pos = torch.zeros((b, rows), dtype=torch.int32, device=dev)  # padding: "held" and used now
        slot_stamp = torch.full((b, rows), step, dtype=torch.int64, device=dev)
        pos_to_hot = torch.full((b, capacity), -1, dtype=torch.int32, device=dev)
        for i, (t, s) in enumerate(zip(tables, specs)):
            n, r, c = s.gpu_pages.numel(), t.hot_slots.numel(), t.pos_to_hot.shape[1]
            gpu[i, :n], host[i, :n] = s.gpu_pages.to(dev), s.host_pages.to(dev)
            hot_slots[i, :r], slot_pos[i, :r], slot_stamp[i, :r] = t.hot_slots, t.slot_pos[group], t.slot_stamp[group]
            pos_to_hot[i, :c] = t.pos_to_hot[group]
        result = self._resolve(
            positions.to(torch.int32), lens.to(torch.int32), gpu, host, hot_slots, slot_pos, slot_stamp,
            pos_to_hot, step, self.group_offsets[group], self.group_run_bytes[group], self.pool, self.host,
        )
        for i, t in enumerate(tables):
            r, c = t.hot_slots.numel(), t.pos_to_hot.shape[1]
            t.slot_pos[group], t.slot_stamp[group], t.pos_to_hot[group] = slot_pos[i, :r], slot_stamp[i, :r], \
                pos_to_hot[i, :c]
        valid = torch.arange(positions.shape[1], device=dev)[None, :] < lens[:, None]
        page = torch.where(valid, positions, 0).long() // PAGE_SIZE
        non_resident = int((valid & (gpu.gather(1, page) < 0)).sum())
        misses = int(result.num_copied.sum())
        self._counts += ResolveCounts(non_resident - misses, misses, misses * self.group_run_bytes[group])
        return result.kv_slots.long().clamp(min=0)

    def take_counts(self) -> ResolveCounts:
        """The resolve counts since the last call."""
        counts, self._counts = self._counts, ResolveCounts()
        return counts
