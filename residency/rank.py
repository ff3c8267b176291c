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
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kernels import page_mirror, resolve
from kernels.resolve import LeaseState
from residency.hot_buffer import PAGE_SIZE, HotTables
from residency.stats import ResolveCounts

# Host-only positions of one request's rows resolved per call: the plan launch's fixed width.
_UNION_PIECE = 4096
# The dtypes of `HotTables`' stamps and reverse maps, which every lease table row points at.
_STAMP_DTYPE, _MAP_DTYPE = torch.int64, torch.int32
# The resolve tally's entries: host-only rows looked up, misses, miss bytes, rows left without a hot slot.
TALLY_SIZE = 4


@dataclass(frozen=True)
class NonResidentSpec:
    """A request with host-only pages: where each of its logical MLA pages lives."""

    request_id: str  # names the request's hot-buffer tables on each rank
    gpu_pages: torch.Tensor  # [P] int32 GPU page per logical page, -1 where host-only
    host_pages: torch.Tensor  # [P] int32 host page per logical page, -1 where none
    num_tokens: int  # tokens the request holds after this step (reverse maps must cover them)


@dataclass
class DecodeLeases:
    """Single-row requests resolved together, one resolve per IndexShare group: where their pages live,
    their LRU tables (as views for the PyTorch twin and as addresses for the kernel) and the step."""

    rows: torch.Tensor | None  # [D] their rows of the batch; None: every row (resident ones resolve in place)
    gpu_pages: torch.Tensor  # [D, P] int32 GPU page of each logical page, -1 where host-only
    host_pages: torch.Tensor  # [D, P] int32 host page of each logical page, -1 where none
    leases: list[list[LeaseState | None]]  # per group, per row: the request's tables (None: all pages resident)
    lease_table: torch.Tensor  # [G, D, LEASE_WIDTH] int64 the same tables by address, on the device
    step: torch.Tensor  # [1] int64 LRU stamp of the step, on the device
    rows_per_lease: int = 1  # consecutive rows of each request (a verifying step's k + 1), every row: rows None
    # the most hot slots a lease of the step holds, at every replay of a captured step (None: any number); the
    # resolve's plan is compiled for it (`resolve.one_chunk`)
    max_rows: int | None = None


class RankResidency:
    def __init__(self, group_offsets: Sequence[int], group_run_bytes: Sequence[int], pool: torch.Tensor,
                 host: torch.Tensor) -> None:
        """`group_offsets` / `group_run_bytes`: per IndexShare group, where its block starts in a page and
        the bytes of one token's rows in it (a miss copies one such run); the pool's layout says them."""
        self.pool, self.host = pool, host
        self.num_groups = len(group_offsets)
        self.group_offsets, self.group_run_bytes = tuple(group_offsets), tuple(group_run_bytes)
        self.tables: dict[str, HotTables] = {}
        # [lookups of host-only rows, misses, miss bytes, unresolved rows] since the last read; added to in
        # place (by captured graphs too), read once per step
        self._tally = torch.zeros(TALLY_SIZE, dtype=torch.long, device=pool.device)
        self._stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        self._mirrors_unordered = False  # mirrors issued since the compute stream last waited for the side stream
        self._loaded: torch.cuda.Event | None = None  # marks the last load's copies done

    def warm_up(self, topk: int) -> None:
        """Compiles the resolve kernels for this pool before the first step: a compile takes about a
        second, and a serving step must not wait for one. Each resolves one resident position, so no
        table, slot or page changes; both plans compile, for leases of one chunk and of any size. Nothing to
        compile off the GPU."""
        if not self.pool.is_cuda:
            return
        dev = self.pool.device
        table = resolve.lease_table([HotTables.new((0,), 1, PAGE_SIZE, dev).lease(0)]).to(dev)
        page = torch.zeros(1, 1, dtype=torch.int32, device=dev)  # logical page 0 is GPU page 0
        count = torch.ones(1, dtype=torch.int32, device=dev)
        for width in sorted({topk, _UNION_PIECE}):
            positions = torch.zeros(1, width, dtype=torch.int32, device=dev)
            for max_rows, group in itertools.product((PAGE_SIZE, None), range(self.num_groups)):
                resolve.resolve_lease_table(positions, count, page, page, table, _STAMP_DTYPE, _MAP_DTYPE, 0,
                                            self.group_offsets[group], self.group_run_bytes[group], self.pool,
                                            self.host, max_rows=max_rows)

    # --- leases ----------------------------------------------------------------------

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        if request_id in self.tables:
            raise RuntimeError(f"request {request_id!r} already holds a hot lease on this rank")
        self.tables[request_id] = HotTables.new(tuple(pages), self.num_groups, capacity, self.pool.device)

    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self.tables[request_id].resize(tuple(pages), capacity)

    def close_lease(self, request_id: str) -> None:
        del self.tables[request_id]

    def wide_leases(self, specs: Iterable[NonResidentSpec]) -> bool:
        """Whether some lease of these requests holds more hot slots than the resolve's one-chunk plan searches
        (`resolve.one_chunk`): a captured step's shape records it, so a replay never meets a lease wider than
        the plan it captured. A decode lease holds the configured hot rows (2 x top-K by default: one chunk);
        an extend's or a verifying step's rows, or a setting above 4,096 rows, make it wider."""
        widest = max((self.tables[spec.request_id].hot_slots.numel() for spec in specs), default=0)
        return not resolve.one_chunk(widest)

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
        self._mirrors_unordered = True
        return page_mirror.mirror_pages(self.pool, self.host, list(gpu_ids), list(host_ids), self._stream)

    def order_after_mirrors(self) -> None:
        """Makes the compute stream wait (on the GPU, the host does not block) for every mirror issued so
        far: a page freed after its copy was queued may be reused by the next forward, and a host copy
        may be read (load, resolve) only once written. Only mirrors use the side stream, so when none was
        issued since the last wait there is nothing new to wait for (most decode steps: a page completes
        every 64 tokens) and the step is spared the event."""
        if self._stream is not None and self._mirrors_unordered:
            torch.cuda.current_stream(self.pool.device).wait_stream(self._stream)
            self._mirrors_unordered = False

    def load(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> torch.cuda.Event | None:
        """Copies whole host pages into GPU pages, in order with this rank's forward steps; returns the
        event that marks the copies done (None: done already, off the GPU).

        On the GPU the copies are queued on the compute stream (after the forward in flight, before the
        next) and the host does not wait for them: a blocking copy would wait for the forward in flight
        too and leave the next step's preparation unoverlapped. The host pages are read after the call
        returns, so a CPU writer of the host pool waits for `wait_for_loads` first; writes by mirrors
        are ordered after the loads on the device."""
        if not gpu_ids:
            return None
        self.order_after_mirrors()
        if not self.pool.is_cuda:
            dst = torch.tensor(list(gpu_ids), dtype=torch.long)
            self.pool[dst] = self.host[torch.tensor(list(host_ids), dtype=torch.long)]
            return None
        for gpu, host, n in page_mirror.page_runs(list(gpu_ids), list(host_ids)):
            self.pool[gpu : gpu + n].copy_(self.host[host : host + n], non_blocking=True)
        self._loaded = torch.cuda.Event()
        self._loaded.record(torch.cuda.current_stream(self.pool.device))
        return self._loaded

    def wait_for_loads(self) -> None:
        """Blocks until every load issued so far has read its host pages."""
        if self._loaded is not None:
            self._loaded.synchronize()

    # --- lookups for non-resident tokens ----------------------------------------------

    def resolve_rows(self, spec: NonResidentSpec, group: int, positions: torch.Tensor, lens: torch.Tensor,
                     step: int, slots: torch.Tensor) -> None:
        """Points `slots` [n, K] (the rows' in-place slots) at hot slots for the top-K positions of
        one request's query rows that live only on host, loading misses into its hot rows.

        The rows' host-only selections are merged into one sorted union and resolved in pieces of
        `_UNION_PIECE` positions (one compiled plan for every piece) under one step stamp, so no
        piece evicts a slot the step already uses: a step loads each host-only token at most once,
        and the scheduler sizes the hot buffer for the step's union. The union is built on the
        device and its size stays there: the number of pieces comes from the request's host-only
        token count, known on the host, so the forward never waits for the GPU here. Rows read
        their slots back by binary search in the union.
        """
        tables = self.tables[spec.request_id]
        tables.ensure_capacity(spec.num_tokens)
        dev = self.pool.device
        gpu, host = (t.to(dev, non_blocking=True)[None] for t in (spec.gpu_pages, spec.host_pages))
        valid = torch.arange(positions.shape[1], device=dev)[None, :] < lens[:, None]
        valid &= gpu[0, torch.where(valid, positions, 0) // PAGE_SIZE] < 0
        bound = min(valid.numel(), PAGE_SIZE * int((spec.gpu_pages < 0).sum()))  # distinct host-only positions
        if bound == 0:
            return
        pieces = -(-bound // _UNION_PIECE)
        far = torch.iinfo(torch.int32).max  # sorts after every position
        flat = torch.where(valid, positions, far).reshape(-1).sort().values
        repeat = torch.zeros_like(flat, dtype=torch.bool)
        repeat[1:] = flat[1:] == flat[:-1]
        union = torch.full((pieces, _UNION_PIECE), far, dtype=torch.int32, device=dev)
        taken = min(flat.numel(), union.numel())
        union.view(-1)[:taken] = torch.where(repeat, far, flat).sort().values[:taken]
        counts = (union < far).sum(dim=1, dtype=torch.int32)  # sorted: each piece's positions come first
        union_slots = torch.empty_like(union)
        lease = [tables.lease(group)]
        table = resolve.lease_table(lease).to(dev, non_blocking=True)  # moved once for every piece
        copied = []
        for i in range(pieces):
            piece = slice(i, i + 1)
            result = self._resolve(union[piece], counts[piece], gpu, host, table, lease, step, group,
                                   out=union_slots[piece], max_rows=resolve.widest_lease(lease))
            copied.append(result.num_copied)
        union, union_slots = union.view(-1), union_slots.view(-1)
        at = torch.searchsorted(union, positions.to(torch.int32).contiguous()).clamp(max=union.numel() - 1)
        slots.copy_(torch.where(valid, union_slots[at].clamp(min=0), slots))
        self._count(group, valid.sum(), torch.cat(copied).sum(), ((union < far) & (union_slots < 0)).sum())

    def lease_rows(self, specs: Sequence[NonResidentSpec | None]) -> tuple[list[list[LeaseState | None]], torch.Tensor]:
        """Each row's LRU tables per group (None for a row without host-only pages) and the same as a host
        lease table [G, D, LEASE_WIDTH]. Grows every reverse map to its request's length first: the
        resolve reads the tables where they live, so they must not move during the forward."""
        for spec in specs:
            if spec is not None:
                self.tables[spec.request_id].ensure_capacity(spec.num_tokens)
        leases = [[None if spec is None else self.tables[spec.request_id].lease(g) for spec in specs]
                  for g in range(self.num_groups)]
        return leases, torch.stack([resolve.lease_table(per_group) for per_group in leases])

    def decode_leases(self, decode: Sequence[tuple[int, NonResidentSpec]], step: int) -> DecodeLeases:
        """The eager step's `DecodeLeases` for (row, spec) pairs: built on the host and moved once; every
        group of the step resolves against them."""
        specs = [spec for _, spec in decode]
        num_pages = max(s.gpu_pages.numel() for s in specs)
        gpu = torch.full((len(specs), num_pages), -1, dtype=torch.int32)
        host = torch.full((len(specs), num_pages), -1, dtype=torch.int32)
        for i, s in enumerate(specs):
            gpu[i, : s.gpu_pages.numel()], host[i, : s.host_pages.numel()] = s.gpu_pages, s.host_pages
        leases, table = self.lease_rows(specs)
        dev = self.pool.device
        return DecodeLeases(
            rows=torch.tensor([row for row, _ in decode]).to(dev, non_blocking=True),
            gpu_pages=gpu.to(dev, non_blocking=True),
            host_pages=host.to(dev, non_blocking=True),
            leases=leases,
            lease_table=table.to(dev, non_blocking=True),
            step=torch.tensor([step], dtype=torch.int64).to(dev, non_blocking=True),
            max_rows=resolve.widest_lease(leases[0]),
        )

    def resolve_decode(self, decode: DecodeLeases, group: int, positions: torch.Tensor,
                       lens: torch.Tensor) -> torch.Tensor:
        """KV slots [D x rows_per_lease, K] for the rows of `decode`, resolved for the group against every
        request's own tables where they live. Reads nothing from the host and never waits for the device,
        so a captured step can call it. Several rows of one request (a verifying step) resolve as the union
        of their positions, in pieces of K under one step stamp (a step loads each host-only token once and
        no piece evicts a slot the step uses); each row then finds its slots in the union."""
        gpu, m = decode.gpu_pages, decode.rows_per_lease
        valid = torch.arange(positions.shape[1], device=gpu.device)[None, :] < lens[:, None]
        page = torch.where(valid, positions, 0).long() // PAGE_SIZE
        host_only = valid & (gpu.repeat_interleave(m, dim=0).gather(1, page) < 0)
        if m == 1:  # a lease holds at least K slots, so one row's selection always finds them: nothing unresolved
            result = self._resolve_decode(decode, group, positions.to(torch.int32), lens.to(torch.int32))
            self._count(group, host_only.sum(), result.num_copied.sum())
            return result.kv_slots.long().clamp(min=0)
        width = positions.shape[1]
        far = torch.iinfo(torch.int32).max  # sorts after every position
        per_lease = torch.where(valid, positions, far).to(torch.int32).view(gpu.shape[0], m * width)
        flat = per_lease.sort(dim=1).values
        repeat = torch.zeros_like(flat, dtype=torch.bool)
        repeat[:, 1:] = flat[:, 1:] == flat[:, :-1]
        union = torch.where(repeat, far, flat).sort(dim=1).values
        count = (union < far).sum(dim=1, dtype=torch.int32)
        union_slots = torch.empty_like(union, dtype=torch.long)
        copied = torch.zeros((), dtype=torch.long, device=gpu.device)
        for begin in range(0, m * width, width):
            piece = union[:, begin : begin + width].contiguous()
            result = self._resolve_decode(decode, group, piece, (count - begin).clamp(0, width))
            union_slots[:, begin : begin + width] = result.kv_slots.long()
            copied += result.num_copied.sum()
        at = torch.searchsorted(union, per_lease.contiguous()).clamp(max=m * width - 1)
        self._count(group, host_only.sum(), copied, ((union < far) & (union_slots < 0)).sum())
        return union_slots.gather(1, at).view(-1, width).clamp(min=0)

    def _resolve_decode(self, decode: DecodeLeases, group: int, positions: torch.Tensor, lens: torch.Tensor
                        ) -> resolve.ResolveResult:
        """One resolve of positions [D, K] (int32, unique within a row), one row per lease of `decode`."""
        return self._resolve(positions, lens, decode.gpu_pages, decode.host_pages, decode.lease_table[group],
                             decode.leases[group], decode.step, group, max_rows=decode.max_rows)

    def _resolve(self, positions: torch.Tensor, lens: torch.Tensor, gpu_pages: torch.Tensor,
                 host_pages: torch.Tensor, table: torch.Tensor, leases: Sequence[LeaseState | None],
                 step: int | torch.Tensor, group: int, out: torch.Tensor | None = None,
                 max_rows: int | None = None) -> resolve.ResolveResult:
        """One resolve of positions [D, K] for the group, one row per lease: on the GPU the kernels, which
        read the tables by address from `table` [D, LEASE_WIDTH] on the device (`max_rows`: the bound on
        their hot slots the caller keeps); elsewhere the PyTorch twin, which reads `leases`."""
        tail = (step, self.group_offsets[group], self.group_run_bytes[group], self.pool, self.host)
        if self.pool.is_cuda:
            return resolve.resolve_lease_table(positions, lens, gpu_pages, host_pages, table, _STAMP_DTYPE,
                                               _MAP_DTYPE, *tail, out=out, max_rows=max_rows)
        return resolve.resolve_leases_reference(positions, lens, gpu_pages, host_pages, leases, *tail, out=out)

    def _count(self, group: int, lookups: torch.Tensor, misses: torch.Tensor,
               unresolved: torch.Tensor | None = None) -> None:
        """Adds a resolve's counts on the device: they are read once per step, not once per resolve.
        `unresolved`: selected host-only positions that found no hot slot (every slot already used by the
        step: its rows' union outgrew the lease the scheduler sized), which read a wrong row; counted where
        several rows resolve as one union, the only way a lease can run short."""
        counts = [lookups.long(), misses.long(), misses.long() * self.group_run_bytes[group]]
        if unresolved is None:  # the tally's last entry stays as it is
            self._tally[: len(counts)] += torch.stack(counts)
        else:
            self._tally += torch.stack([*counts, unresolved.long()])

    def counts_into(self, host: torch.Tensor) -> torch.Tensor:
        """Queues a copy of the counts since the last call into `host` [TALLY_SIZE] (pinned: the host need not wait
        for it now) and restarts them; read `host` with `counts_of` once the copy is done."""
        host.copy_(self._tally, non_blocking=True)
        self._tally.zero_()
        return host


def counts_of(tally: list[int]) -> ResolveCounts:
    """`ResolveCounts` from a tally [lookups of host-only rows, misses, miss bytes, unresolved rows]."""
    lookups, misses, miss_bytes, unresolved = tally
    return ResolveCounts(lookups - misses - unresolved, misses, miss_bytes, unresolved)
