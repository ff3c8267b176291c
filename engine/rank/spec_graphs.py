"""Speculative steps over persistent buffers, captured as CUDA graphs per shape.

A verifying step whose requests all decode (each brings its last known token and its drafts, every row
sampled) runs like a decode step (engine/rank/decode_graphs.py) through fixed views of buffers this rank
allocates once. Each request takes exactly k + 1 rows: drafts it lacks (near its `max_tokens`, or beyond
what its hot lease serves) become padding rows that repeat its last row, token and position, write to the
scratch page and are never accepted (`DraftInput.num_drafts` masks them). Repeating the token matters under
pressure: a padding row then selects exactly the last row's top-K, so the union its request resolves stays
within the rows the scheduler sized the hot lease for. Requests are padded to the next batch size, page
tables to the next width. The whole verify-and-draft step
(engine/rank/speculative.py: the target forward, sampling, acceptance, the MTP layer's k passes) is one
graph per `SpecGraphKey`; the step's real rows are gathered from its outputs afterwards, in the eager
step's order. When some request has host-only pages the residency resolve runs inside the graph too, each
request's k + 1 rows resolved as the union of their selections (`RankResidency.resolve_decode`). On the
first step of a shape it runs through the buffers eagerly and is captured after; off the GPU the same
buffers run without capture. Steps with prefill rows run eagerly.

A step that continues the one before it (`StepInput.continues`: launched before that one was read, built
as if it accepted every draft) is staged the same way and then corrected on the device from the last step's
results, before its replay: each request's inputs become the token sampled after its accepted drafts and
the drafts proposed there, and its positions, write slots, context length and draw keys move back by the
drafts rejected (`_continue`). So the host never waits for a step's accepted counts while the device idles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.model import GlmMoeDsaForCausalLM
from engine.rank.decode_graphs import (
    SAMPLING_PADDING, CapturedShapes, GraphConfig, Sampler, StepBuffers, batch_sizes, buffered_batch, context_widths,
    lease_buffers, lease_views, sampling_buffers, sampling_views, scratch_slots, shape_bucket, stage_leases,
    table_pages, wide_leases,
)
from engine.rank.speculative import speculative_step
from engine.rank.step import DraftInput, StepInput
from engine.sampler import SamplerMode
from residency.rank import RankResidency


@dataclass(frozen=True)
class SpecGraphKey:
    """One captured shape: `requests` (padded) of k + 1 rows each."""

    requests: int
    context: int  # page-table width in tokens, the indexer's scoring width
    resolves: bool  # some request has host-only pages: the residency resolve runs for every request
    sampler: SamplerMode
    wide_leases: bool = False  # some lease is wider than the resolve's one-chunk plan (`RankResidency.wide_leases`)


class SpecGraphs:
    """One rank's verify-and-draft runner for steps of decoding requests: buffers, graphs, padding."""

    def __init__(self, config: GraphConfig, model: GlmMoeDsaForCausalLM, layout: KVLayout, ops: AttentionOps,
                 pool: torch.Tensor, scratch_page: int, sampler: Sampler, num_speculative_tokens: int) -> None:
        """`pool` includes `scratch_page`, which padding rows write and read."""
        self.model, self.layout, self.ops, self.pool = model, layout, ops, pool
        self.scratch_page, self.sampler = scratch_page, sampler
        self.k = num_speculative_tokens
        self.batch_sizes = batch_sizes(config.max_batch)
        self.widths = context_widths(model.cfg.index_topk, config.max_model_len, layout.page_size)
        requests = self.batch_sizes[-1]
        rows, (pages, idx_pages) = requests * (self.k + 1), table_pages(layout, self.widths[-1])
        self.buffers = StepBuffers({
            "input_ids": (rows, torch.long), "positions": (rows, torch.long), "next_ids": (rows, torch.long),
            "mla_write_slots": (rows, torch.long), "indexer_write_slots": (rows, torch.long),
            "context_lens": (requests, torch.long), "num_drafts": (requests, torch.long),
            "mla_page_table": (requests * pages, torch.long), "indexer_page_table": (requests * idx_pages, torch.long),
            "real_rows": (rows, torch.long), "replayed": (requests * 2 * self.k, torch.long), **sampling_buffers(rows),
            **lease_buffers(requests, pages, len(layout.group_sizes)),
        }, pool.device)
        # Each request's first row, and a scratch-page slot each for the drafting passes' throwaway rows.
        self._logit_starts = torch.arange(requests, device=pool.device) * (self.k + 1)
        self._scratch_slots = scratch_slots(scratch_page, layout.page_size, torch.arange(requests, device=pool.device))
        self._batches: dict[SpecGraphKey, ForwardBatch] = {}
        self.shapes = CapturedShapes(pool.device, "speculative")
        self._last: tuple[SpecGraphKey, torch.Tensor] | None = None  # the last step's shape and raw results

    @property
    def steps_run(self) -> Counter[SpecGraphKey]:
        """Steps run through the buffers, by shape."""
        return self.shapes.steps_run

    def is_captured(self, key: SpecGraphKey) -> bool:
        return key in self.shapes

    def key_for(self, step: StepInput, residency: RankResidency | None) -> SpecGraphKey | None:
        """The shape `step` runs as, or None when it must run eagerly: it has rows that sample nothing (a
        prefill chunk), or more requests or context than the buffers hold."""
        every_row_samples = step.draft is not None and step.num_logits == int(step.input_ids.shape[0])
        bucket = shape_bucket(self.batch_sizes, self.widths, step) if every_row_samples else None
        if bucket is None:
            return None
        return SpecGraphKey(*bucket, bool(step.nonresident), step.sampling.mode, wide_leases(step, residency))

    def launch(self, key: SpecGraphKey, step: StepInput, residency: RankResidency | None) -> torch.Tensor:
        """Runs `step` as `key` (replays its graph, or runs through the buffers and captures after, on a
        GPU). Returns what `speculative_step` returns for the step itself: its rows' tokens in its own order,
        then each request's accepted count and drafts; the host has not waited for them."""
        batch, real_rows = self._fill(key, step, residency)
        if step.continues:
            self._continue(key, step.num_requests, batch)
        out = self.shapes.run(key, lambda: self._forward(key, batch))
        self._last = key, out
        rows, n = key.requests * (self.k + 1), step.num_requests
        return torch.cat([out[:rows][real_rows], out[rows : rows + n],
                          out[rows + key.requests : rows + key.requests + n * self.k]])

    def _forward(self, key: SpecGraphKey, batch: ForwardBatch) -> torch.Tensor:
        view, n = self.buffers.view, key.requests
        rows = n * (self.k + 1)
        draft = DraftInput(next_ids=view("next_ids", rows), logit_starts=self._logit_starts[:n],
                           num_drafts=view("num_drafts", n), num_speculative_tokens=self.k)
        return speculative_step(self.model, batch, self.pool, self._scratch_slots, self.layout, self.ops,
                                sampling_views(self.buffers, rows, key.sampler), self.sampler, draft)

    def close(self) -> None:
        self.shapes.clear()
        self._last = None

    def _continue(self, key: SpecGraphKey, n: int, batch: ForwardBatch) -> None:
        """Turns the staged `StepInput.continues` step into the real one, on the device: each of the `n`
        requests' k + 1 rows take the token sampled after its accepted drafts in the last step and the k drafts
        proposed there (or replayed from its accepted count on), and its positions, context length and draw
        keys move back by the drafts the last step rejected (it verified k for each), its write slots with them.
        The last step's results are read before this step's replay overwrites them (stream order). Its page
        tables may be wider than the last step's (the furthest rows crossed a width); the request count is the
        same."""
        if self._last is None or self._last[0].requests != key.requests:
            raise RuntimeError("a continued speculative step must have as many requests as the step before it")
        last, k, per, requests = self._last[1], self.k, self.k + 1, key.requests
        rows, view = requests * per, self.buffers.view
        accepted = last[rows : rows + n]
        rejected = (k - accepted)[:, None]
        ids = view("input_ids", rows).view(requests, per)[:n]
        ids[:, :1] = last[:rows].view(requests, per)[:n].gather(1, accepted[:, None])
        drafts = last[rows + requests : rows + requests + requests * k].view(requests, k)[:n]
        replayed = view("replayed", requests, 2 * k)[:n]  # -1 rows: the MTP layer's drafts
        picked = replayed.gather(1, accepted[:, None] + torch.arange(k, device=replayed.device))
        ids[:, 1:] = torch.where(replayed[:, :1] >= 0, picked, drafts)
        positions = view("positions", rows).view(requests, per)[:n]
        positions -= rejected
        view("keys", rows).view(requests, per)[:n] -= rejected
        context_lens = view("context_lens", requests)
        context_lens[:n] -= rejected[:, 0]
        pages, idx_pages = table_pages(self.layout, key.context)
        for slots, table, width, per_page in (
                ("mla_write_slots", "mla_page_table", pages, self.layout.page_size),
                ("indexer_write_slots", "indexer_page_table", idx_pages, self.layout.indexer_tokens_per_page)):
            entries = view(table, requests, width)[:n].gather(1, positions // per_page)
            view(slots, rows).view(requests, per)[:n] = entries * per_page + positions % per_page
        if context_lens.device.type == "cpu":  # the reference attention reads the host-side lengths
            batch.context_lens_host[:n] = context_lens[:n].tolist()

    def _fill(self, key: SpecGraphKey, step: StepInput, residency: RankResidency | None
              ) -> tuple[ForwardBatch, torch.Tensor]:
        """Stages `step` into the buffers as `key`: request b's rows at b * (k + 1) on, padding rows after
        them. Returns the key's batch and, for each of the step's rows in its own order, its padded row.
        The index arithmetic is numpy's: a step's host work is on the critical path whenever a
        verify-and-draft step is read before the next is launched."""
        per, n, buffers = self.k + 1, step.num_requests, self.buffers
        rows = key.requests * per
        ranges = np.asarray(step.row_ranges, dtype=np.int64).reshape(n, 2)
        starts, counts = ranges[:, 0], ranges[:, 1] - ranges[:, 0]
        # each of the step's rows: its padded row (request b's rows from b * per on)
        real = np.repeat(np.arange(n) * per - starts, counts) + np.arange(int(counts.sum()))
        # Each request's last row (padding requests: token 0 at position 0), which its padding rows repeat.
        last_ids, last = np.zeros(key.requests, dtype=np.int64), np.zeros(key.requests, dtype=np.int64)
        last_ids[:n] = step.input_ids.numpy()[starts + counts - 1]
        last[:n] = step.positions.numpy()[starts + counts - 1]

        def spread(values: torch.Tensor, fill: np.ndarray) -> np.ndarray:
            out = fill.copy()
            out[real] = values.numpy()
            return out

        buffers.begin()
        put = buffers.put
        put("input_ids", (rows,), 0, spread(step.input_ids, np.repeat(last_ids, per)))
        put("positions", (rows,), 0, spread(step.positions, np.repeat(last, per)))
        put("next_ids", (rows,), -1)  # every row samples: the MTP layer reads each one's sampled token
        padded = np.arange(rows)
        for name, per_page in (("mla_write_slots", self.layout.page_size),
                               ("indexer_write_slots", self.layout.indexer_tokens_per_page)):
            put(name, (rows,), 0, spread(getattr(step, name), scratch_slots(self.scratch_page, per_page, padded)))
        put("context_lens", (key.requests,), 1, np.asarray(step.context_lens, dtype=np.int64))
        put("num_drafts", (key.requests,), 0, step.draft.num_drafts)
        pages, idx_pages = table_pages(self.layout, key.context)
        put("mla_page_table", (key.requests, pages), self.scratch_page, step.mla_page_table)
        put("indexer_page_table", (key.requests, idx_pages), self.scratch_page, step.indexer_page_table)
        # Every row samples, so the step's sampling rows are its rows, in order (`key_for`).
        for name, fill in SAMPLING_PADDING:
            values = getattr(step.sampling, name)
            put(name, (rows,), fill, spread(values, np.full(rows, fill, dtype=values.numpy().dtype)))
        put("real_rows", (rows,), 0, real)
        put("replayed", (key.requests, 2 * self.k), -1, step.replayed if step.continues else None)
        leases = None
        if key.resolves:
            leases = stage_leases(buffers, key.requests, pages, step, residency, self.scratch_page)
        buffers.end()

        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = self._batch(key, residency)
        batch.context_lens_host = [*step.context_lens, *[1] * (key.requests - n)]
        if leases is not None:
            batch.decode_leases.leases = leases
        return batch, buffers.view("real_rows", len(real))

    def _batch(self, key: SpecGraphKey, residency: RankResidency | None) -> ForwardBatch:
        """The key's `ForwardBatch`: views of the buffers (the same tensors at every replay)."""
        per, (pages, _) = self.k + 1, table_pages(self.layout, key.context)
        decode = None
        if key.resolves:
            decode = lease_views(self.buffers, key.requests, pages, len(self.layout.group_sizes), key.wide_leases,
                                 rows_per_lease=per)
        return buffered_batch(self.buffers, self.layout, key.requests, per, key.context, decode, residency)
