"""Decode steps over persistent buffers, captured as CUDA graphs per shape.

A decode step (every request brings one row and samples it) runs through a
fixed set of views into buffers this rank allocates once: token ids,
positions, write slots, page tables, context lengths, sampling parameters and,
when some request has host-only pages, the residency page tables, lease table
and step stamp of its resolve. The step is padded to the next of a few batch
sizes and its page tables to the next of a few context widths (from
`_MIN_CONTEXT` up, two per doubling: 2, 3, 4, 6, 8, 12, ... K tokens; the
indexer scores that many positions per row, at most 1.5x the longest
context); the top-K width is always the model's K. Padding rows decode token 0 at position 0 from a scratch
page that no request owns, greedily, and their tokens are dropped.

On a GPU each shape (`GraphKey`: rows, width, whether a resolve runs, the
sampler's mode) is captured once as a CUDA graph covering embedding to sampled
token ids: the indexer, the residency resolve and its miss copies, sparse MLA,
the fused MoE and, with tensor parallelism, the all-reduces. A step then costs
the host its inputs staged in pinned memory and copied in one transfer, one
replay and one read of the token ids. The greedy shapes at the narrowest width
are captured when the pool is built; other shapes on their first step, which
runs eagerly through the same buffers and is captured after (every rank decides
the same, so their collectives stay in step). Off the GPU the same buffers and
padding run without capture. Steps with prefill rows, more requests than the
largest batch size or contexts beyond `max_model_len` run eagerly
(engine/rank/worker.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch, with_previous_tokens
from engine.kv_layout import KVLayout
from engine.model import GlmMoeDsaForCausalLM
from engine.rank.step import StepInput
from engine.sampler import SamplerMode, SamplingBatch
from kernels import pdl, resolve
from kernels.resolve import LEASE_WIDTH
from residency.rank import DecodeLeases, NonResidentSpec, RankResidency

logger = logging.getLogger(__name__)

# Decode batch sizes a step is padded to (those up to the engine's max_num_seqs, and that one).
_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# The narrowest page-table width in tokens; wider ones double up to max_model_len.
_MIN_CONTEXT = 2048
# Decode steps of up to this many requests launch their kernels with PDL (kernels/pdl.py: a gain at one
# request, none at 8, a loss at 32 on an H200).
PDL_MAX_ROWS = 8

Sampler = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


@dataclass(frozen=True)
class GraphConfig:
    """How decode steps run on a rank."""

    enforce_eager: bool = False  # every step eagerly: no persistent buffers, no graphs
    max_batch: int = 64  # the largest decode batch run through the buffers (the engine's max_num_seqs)
    max_model_len: int = 8192  # the widest page table the buffers hold, in tokens


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in _BATCH_SIZES if b < max_batch} | {max_batch}))


def context_widths(topk: int, max_model_len: int, page_size: int) -> tuple[int, ...]:
    """Page-table widths in tokens (whole pages, at least K, the last one covering max_model_len): from
    `_MIN_CONTEXT` up, each 1.5x or 4/3x the one before (2, 3, 4, 6, 8, 12, ...)."""
    def pages(tokens: int) -> int:
        return -(-tokens // page_size) * page_size

    last = pages(max(max_model_len, topk))
    widths = [min(last, pages(max(_MIN_CONTEXT, topk)))]
    while widths[-1] < last:
        w = widths[-1]
        power = 1 << (w.bit_length() - 1)
        widths.append(min(last, pages(power * 3 // 2 if w == power else power * 2)))
    return tuple(widths)


@dataclass(frozen=True)
class GraphKey:
    """One captured shape."""

    rows: int  # padded batch size
    context: int  # page-table width in tokens, the indexer's scoring width
    resolves: bool  # some request has host-only pages: the residency resolve runs for every row
    sampler: SamplerMode
    wide_leases: bool = False  # some lease is wider than the resolve's one-chunk plan (`RankResidency.wide_leases`)


# the dtypes a step stages, as the host twin's numpy views hold them
_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


class StepBuffers:
    """A step's inputs in one device arena with a pinned host twin, copied over in one transfer a step.

    Each step stages its fields with `put` in a fixed order, packed from the arena's start in that order
    at the sizes of the step's shape; `end` queues a single copy of the staged bytes (one copy instead of one
    per field: each costs the host about ten microseconds). A shape stages the same fields at the same sizes
    at every step, so its fields sit at the same places every time and the views its graph was captured
    with (`view`, after the shape's first `end`) stay its own. Shapes overlap in the arena; a step's copy
    is queued after the previous step's work, so no step reads another's staging."""

    ALIGN = 128  # bytes: every field starts on a 128-byte boundary, as the allocator's tensors do

    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device) -> None:
        """`sizes`: each field's largest element count and its dtype (int64, int32, float32 or bool)."""
        unstageable = sorted(name for name, (_, dtype) in sizes.items() if dtype not in _NUMPY)
        if unstageable:
            raise ValueError(f"fields {unstageable} have a dtype the host twin cannot stage")
        self.device = device
        self.dtypes = {name: dtype for name, (_, dtype) in sizes.items()}
        capacity = sum(self._aligned(n * dtype.itemsize) for n, dtype in sizes.values())
        self._capacity = {name: n for name, (n, _) in sizes.items()}
        self.arena = torch.zeros(capacity, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.uint8, pin_memory=True) if pin else self.arena
        self._host_np = self._host.numpy()  # numpy writes cost a microsecond each instead of a torch op's ten
        self._placed: dict[str, tuple[int, int]] = {}  # this step's fields: (byte offset, elements)
        self._end = 0  # staged bytes
        self._copied: torch.cuda.Event | None = None  # the last step's copy out of the host twin

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def begin(self) -> None:
        """Starts staging a step; first waits until the last step's copy has left the host twin (done at
        once when its tokens were read; a rank that reads no tokens runs at most one step behind)."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        self._placed, self._end = {}, 0

    def put(self, name: str, shape: tuple[int, ...], pad: float | int,
            value: torch.Tensor | np.ndarray | None = None) -> None:
        """Stages field `name` as [shape] next: `value` (host memory) in its leading corner, `pad` elsewhere."""
        size = math.prod(shape)
        if name in self._placed:
            raise ValueError(f"{name} is staged once a step")
        if size > self._capacity[name]:
            raise ValueError(f"{name} holds at most {self._capacity[name]} elements, {size} staged")
        dtype = self.dtypes[name]
        start = self._end
        self._end = start + self._aligned(size * dtype.itemsize)
        self._placed[name] = (start, size)
        host = self._host_np[start : start + size * dtype.itemsize].view(_NUMPY[dtype]).reshape(shape)
        host.fill(pad)
        if value is not None:
            value = np.asarray(value)
            if value.size:
                host[tuple(slice(0, n) for n in value.shape)] = value

    def end(self) -> None:
        """Queues the staged bytes' copy to the device (in place off a GPU)."""
        if self.device.type == "cuda" and self._end:
            self.arena[: self._end].copy_(self._host[: self._end], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def view(self, name: str, *shape: int) -> torch.Tensor:
        """The device view of field `name` as the last step staged it, shaped [shape] (its leading elements)."""
        if name not in self._placed:
            raise KeyError(f"{name} was not staged this step")
        start, size = self._placed[name]
        if math.prod(shape) > size:
            raise ValueError(f"{name} was staged with {size} elements, {tuple(shape)} asked")
        dtype = self.dtypes[name]
        return self.arena[start : start + size * dtype.itemsize].view(dtype)[: math.prod(shape)].view(shape)


class DecodeGraphs:
    """One rank's decode runner: persistent buffers, graphs per `GraphKey`, the padding around them."""

    def __init__(self, config: GraphConfig, model: GlmMoeDsaForCausalLM, layout: KVLayout, ops: AttentionOps,
                 pool: torch.Tensor, scratch_page: int, sampler: Sampler) -> None:
        """`pool` includes `scratch_page`, which padding rows write and read."""
        self.model, self.layout, self.ops, self.pool = model, layout, ops, pool
        self.scratch_page, self.sampler = scratch_page, sampler
        self.topk = model.cfg.index_topk
        self.batch_sizes = batch_sizes(config.max_batch)
        self.widths = context_widths(self.topk, config.max_model_len, layout.page_size)
        rows, (pages, idx_pages) = self.batch_sizes[-1], table_pages(layout, self.widths[-1])
        groups = len(layout.group_sizes)
        self.buffers = StepBuffers({
            "input_ids": (rows, torch.long), "prev_rows": (rows, torch.long), "positions": (rows, torch.long),
            "context_lens": (rows, torch.long),
            "mla_write_slots": (rows, torch.long), "indexer_write_slots": (rows, torch.long),
            "mla_page_table": (rows * pages, torch.long), "indexer_page_table": (rows * idx_pages, torch.long),
            **sampling_buffers(rows), **lease_buffers(rows, pages, groups),
        }, pool.device)
        self._batches: dict[GraphKey, ForwardBatch] = {}
        self.shapes = CapturedShapes(pool.device, "decode")

    @property
    def steps_run(self) -> Counter[GraphKey]:
        """Decode steps run through the buffers, by shape."""
        return self.shapes.steps_run

    def is_captured(self, key: GraphKey) -> bool:
        return key in self.shapes

    # --- which steps -------------------------------------------------------------------

    def key_for(self, step: StepInput, residency: RankResidency | None) -> GraphKey | None:
        """The shape `step` runs as, or None when it must run eagerly."""
        bucket = shape_bucket(self.batch_sizes, self.widths, step) if step.is_decode else None
        if bucket is None:
            return None
        return GraphKey(*bucket, bool(step.nonresident), step.sampling.mode, wide_leases(step, residency))

    def capture_common(self, residency: RankResidency | None) -> None:
        """Captures the greedy shapes at the narrowest width, largest first (they share one memory pool),
        so a serving decode step at a common shape never waits for a capture."""
        if not self.shapes.capture_on:
            return
        for rows in reversed(self.batch_sizes):
            key = GraphKey(rows, self.widths[0], False, "greedy")
            batch = self._fill(key, None, residency, None)
            self._forward(batch, key)  # compiles every kernel of the shape; writes only the scratch page
            self.shapes.capture(key, lambda: self._forward(batch, key))
        logger.info("captured %d decode graphs (batch sizes %s, width %d)", len(self.batch_sizes),
                    list(self.batch_sizes), self.widths[0])

    # --- running a step -----------------------------------------------------------------

    def launch(self, key: GraphKey, step: StepInput, residency: RankResidency | None,
               last_tokens: torch.Tensor) -> torch.Tensor:
        """Runs decode `step` as `key`: replays its graph, or runs eagerly through the same buffers and
        captures the graph after (on a GPU). Inputs the host has not read come from `last_tokens`, the
        previous step's sampled ids. Returns the token ids [key.rows] on the device, padding rows last;
        the host has not waited for them."""
        batch = self._fill(key, step, residency, last_tokens)
        return self.shapes.run(key, lambda: self._forward(batch, key))

    def _forward(self, batch: ForwardBatch, key: GraphKey) -> torch.Tensor:
        with pdl.launches(key.rows <= PDL_MAX_ROWS):
            hidden = self.model.hidden_states(batch, self.pool, self.layout, self.ops)
            return self.sampler(self.model.logits(hidden), sampling_views(self.buffers, key.rows, key.sampler))

    def close(self) -> None:
        """Drops the graphs (a captured collective left alive hangs the process group's teardown)."""
        self.shapes.clear()

    # --- the buffers ----------------------------------------------------------------------

    def _fill(self, key: GraphKey, step: StepInput | None, residency: RankResidency | None,
              last_tokens: torch.Tensor | None) -> ForwardBatch:
        """Stages `step` (None: padding only) into the buffers as `key` and returns the key's batch."""
        buffers, rows = self.buffers, key.rows
        page, per_page = self.layout.page_size, self.layout.indexer_tokens_per_page
        pages, idx_pages = table_pages(self.layout, key.context)
        real = 0 if step is None else step.num_requests
        pad = torch.arange(rows - real)
        buffers.begin()
        put = buffers.put
        previous = None if step is None else step.prev_rows
        put("input_ids", (rows,), 0, None if step is None else step.input_ids)
        put("prev_rows", (rows,), -1, previous)
        put("positions", (rows,), 0, None if step is None else step.positions)
        put("context_lens", (rows,), 1, None if step is None else torch.tensor(step.context_lens))
        for name, per in (("mla_write_slots", page), ("indexer_write_slots", per_page)):
            slots = scratch_slots(self.scratch_page, per, pad)
            put(name, (rows,), 0, slots if step is None else torch.cat([getattr(step, name), slots]))
        put("mla_page_table", (rows, pages), self.scratch_page, None if step is None else step.mla_page_table)
        put("indexer_page_table", (rows, idx_pages), self.scratch_page,
            None if step is None else step.indexer_page_table)
        sampling = None if step is None else step.sampling
        for name, fill in SAMPLING_PADDING:
            put(name, (rows,), fill, None if sampling is None else getattr(sampling, name))
        leases = stage_leases(buffers, rows, pages, step, residency, self.scratch_page) if key.resolves else None
        buffers.end()
        if previous is not None:
            ids = buffers.view("input_ids", rows)
            ids.copy_(with_previous_tokens(ids, buffers.view("prev_rows", rows), last_tokens))

        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = self._batch(key, residency)
        batch.context_lens_host = [1] * rows if step is None else [*step.context_lens, *[1] * (rows - real)]
        batch.request_ids = [""] * rows if step is None else [*step.request_ids, *[""] * (rows - real)]
        if leases is not None:
            batch.decode_leases.leases = leases
        return batch

    def _batch(self, key: GraphKey, residency: RankResidency | None) -> ForwardBatch:
        """The key's `ForwardBatch`: views of the buffers (the same tensors at every replay)."""
        pages, _ = table_pages(self.layout, key.context)
        decode = None
        if key.resolves:
            decode = lease_views(self.buffers, key.rows, pages, len(self.layout.group_sizes), key.wide_leases)
        return buffered_batch(self.buffers, self.layout, key.rows, 1, key.context, decode, residency)


def buffered_batch(buffers: StepBuffers, layout: KVLayout, requests: int, rows_per_request: int, context: int,
                   decode: DecodeLeases | None, residency: RankResidency | None) -> ForwardBatch:
    """A shape's `ForwardBatch` over the buffers: `requests` of `rows_per_request` consecutive rows each, every
    row sampled, page tables `context` tokens wide."""
    view, rows = buffers.view, requests * rows_per_request
    pages, idx_pages = table_pages(layout, context)
    arange = torch.arange(rows, device=buffers.device)
    return ForwardBatch(
        input_ids=view("input_ids", rows),
        positions=view("positions", rows),
        req_of_row=arange // rows_per_request,
        mla_write_slots=view("mla_write_slots", rows),
        indexer_write_slots=view("indexer_write_slots", rows),
        mla_page_table=view("mla_page_table", requests, pages),
        indexer_page_table=view("indexer_page_table", requests, idx_pages),
        context_lens=view("context_lens", requests),
        logits_rows=arange,
        row_ranges=[(b * rows_per_request, (b + 1) * rows_per_request) for b in range(requests)],
        context_lens_host=[1] * requests,
        request_ids=[""] * requests,
        max_context=context,
        page_size=layout.page_size,
        indexer_tokens_per_page=layout.indexer_tokens_per_page,
        decode_leases=decode,
        residency=residency,
    )


class CapturedShapes:
    """A runner's CUDA graphs by shape, in one memory pool: a shape's first step runs eagerly through the
    buffers and is captured after (on a GPU; elsewhere every step runs through the buffers uncaptured),
    later steps replay it."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.capture_on = device.type == "cuda"
        self.name = name
        self._pool = torch.cuda.graph_pool_handle() if self.capture_on else None
        self._graphs: dict[object, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps_run: Counter = Counter()  # steps run through the buffers, by shape

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: object, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output of `forward` for shape `key`: its graph replayed, or `forward` run and then captured."""
        self.steps_run[key] += 1
        captured = self._graphs.get(key)
        if captured is not None:
            graph, out = captured
            graph.replay()
            return out
        out = forward()
        if self.capture_on:
            start = time.perf_counter()
            self.capture(key, forward)
            logger.info("captured the %s graph of %s in %.0f ms", self.name, key, 1e3 * (time.perf_counter() - start))
        return out

    def capture(self, key: object, forward: Callable[[], torch.Tensor]) -> None:
        """Captures `forward` as shape `key`'s graph (its output tensor is rewritten at every replay)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward()
        self._graphs[key] = (graph, out)

    def clear(self) -> None:
        self._graphs.clear()


def table_pages(layout: KVLayout, width: int) -> tuple[int, int]:
    """(MLA pages, indexer pages) of a page table `width` tokens wide."""
    return width // layout.page_size, -(-width // layout.indexer_tokens_per_page)


def scratch_slots(scratch_page: int, per_page: int, rows: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Slots of the scratch page for `rows` (a row number each), distinct where they fit: where padding rows and
    throwaway rows write."""
    return scratch_page * per_page + rows % per_page


def shape_bucket(batch_sizes: tuple[int, ...], widths: tuple[int, ...], step: StepInput) -> tuple[int, int] | None:
    """(padded request count, page-table width) of the smallest captured shape that holds `step`, or None when
    it has more requests or context than the largest."""
    if step.num_requests > batch_sizes[-1]:
        return None
    width = next((w for w in widths if w >= max(step.context_lens)), None)
    if width is None:
        return None
    return next(b for b in batch_sizes if b >= step.num_requests), width


# What a padding row samples with: greedily, so its draw keys and cuts are never read.
SAMPLING_PADDING = (("inv_temperature", 1.0), ("greedy", True), ("top_k", 0), ("top_p", 1.0), ("keys", 0))


def sampling_buffers(rows: int) -> dict[str, tuple[int, torch.dtype]]:
    """The `StepBuffers` of `rows` rows' sampling parameters (`sampling_views` reads them)."""
    return {"inv_temperature": (rows, torch.float32), "greedy": (rows, torch.bool), "top_k": (rows, torch.long),
            "top_p": (rows, torch.float32), "keys": (rows, torch.long)}


def sampling_views(buffers: StepBuffers, rows: int, mode: SamplerMode) -> SamplingBatch:
    """The sampling parameters of `rows` rows as views of the buffers."""
    view = buffers.view
    return SamplingBatch(view("inv_temperature", rows), view("greedy", rows), view("top_k", rows), view("top_p", rows),
                         view("keys", rows), mode)


def lease_buffers(rows: int, pages: int, groups: int) -> dict[str, tuple[int, torch.dtype]]:
    """The `StepBuffers` a resolving step stages its requests' residency in: `rows` requests of up to
    `pages` pages, `groups` IndexShare groups."""
    return {"gpu_pages": (rows * pages, torch.int32), "host_pages": (rows * pages, torch.int32),
            "lease_table": (groups * rows * LEASE_WIDTH, torch.long), "step": (1, torch.long)}


def wide_leases(step: StepInput, residency: RankResidency | None) -> bool:
    """Whether a lease of the step's requests with host-only pages is wider than the one-chunk resolve plan."""
    return residency is not None and residency.wide_leases(step.nonresident.values())


def lease_views(buffers: StepBuffers, rows: int, pages: int, groups: int, wide: bool,
                rows_per_lease: int = 1) -> DecodeLeases:
    """A shape's `DecodeLeases` over the buffers (the same tensors at every replay); its per-step leases are
    set by `stage_leases`. `wide`: its leases may be wider than the resolve's one-chunk plan (the shape's key
    says; a shape without wide leases captures that plan)."""
    view = buffers.view
    return DecodeLeases(rows=None, gpu_pages=view("gpu_pages", rows, pages), host_pages=view("host_pages", rows, pages),
                        leases=[], lease_table=view("lease_table", groups, rows, LEASE_WIDTH), step=view("step", 1),
                        rows_per_lease=rows_per_lease, max_rows=None if wide else resolve.one_chunk_rows())


def stage_leases(buffers: StepBuffers, rows: int, pages: int, step: StepInput | None,
                 residency: RankResidency | None, scratch_page: int) -> list[list]:
    """Stages a resolving step's page tables and lease table for `rows` requests: host-only pages of the
    requests that have them, the in-place pages of the others, the scratch page for padding. Returns the
    leases per group (the PyTorch twin reads them)."""
    if residency is None:
        raise RuntimeError("a resolving step needs this rank's host tier")
    specs: list[NonResidentSpec | None] = [None] * rows
    gpu = torch.full((rows, pages), scratch_page, dtype=torch.int32)
    host = torch.full((rows, pages), -1, dtype=torch.int32)
    if step is not None:
        width = min(pages, step.mla_page_table.shape[1])
        gpu[: step.num_requests, :width] = step.mla_page_table[:, :width]
        for b, spec in step.nonresident.items():
            specs[b] = spec
            gpu[b, : spec.gpu_pages.numel()] = spec.gpu_pages
            host[b, : spec.host_pages.numel()] = spec.host_pages
    buffers.put("gpu_pages", (rows, pages), 0, gpu)
    buffers.put("host_pages", (rows, pages), 0, host)
    leases, table = residency.lease_rows(specs)
    buffers.put("lease_table", (len(leases), rows, LEASE_WIDTH), 0, table)
    buffers.put("step", (1,), 0 if step is None else step.step)  # the stamp is the fill value
    return leases
