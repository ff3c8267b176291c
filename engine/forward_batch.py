"""What one forward pass needs to know about its batch: flattened tokens and page tables.

Built on each tensor-parallel rank from the driver's `StepInput` (the same
host data on every rank), or, for a captured decode graph, a fixed set of
views into the rank's persistent buffers (engine/rank/decode_graphs.py).
Consumed by attention. Tokens of all requests are flattened into one sequence
of T rows; `req_of_row` maps each row to its request in the batch.

Requests with host-only pages resolve their top-K positions through the
residency tables of this rank: a request with several rows (a prefill chunk)
alone, the single-row (decode) requests together in one resolve per
IndexShare group (`DecodeLeases`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_layout import KVLayout
from engine.rank.step import StepInput
from kernels.page_slots import page_slots, page_slots_ref
from residency.rank import DecodeLeases, NonResidentSpec, RankResidency


@dataclass
class ForwardBatch:
    """Tensors describing one step; all live on the model's device."""

    input_ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] position of each row in its request
    req_of_row: torch.Tensor  # [T] request index in the batch
    mla_write_slots: torch.Tensor  # [T] MLA slot receiving each row's KV
    indexer_write_slots: torch.Tensor  # [T] indexer slot receiving each row's key
    mla_page_table: torch.Tensor  # [B, max_pages] physical MLA page per logical page
    indexer_page_table: torch.Tensor  # [B, max_indexer_pages]
    context_lens: torch.Tensor  # [B] tokens cached after this step
    logits_rows: torch.Tensor  # [S] rows whose logits are sampled
    row_ranges: list[tuple[int, int]]  # per request: [start, end) of its rows (host side)
    context_lens_host: list[int]  # per request: tokens cached after this step (host side)
    request_ids: list[str]  # per request: its id (names per-request state of attention ops)
    max_context: int  # positions the indexer scores per row: the longest context, or a graph's fixed width
    page_size: int
    indexer_tokens_per_page: int
    nonresident: dict[int, NonResidentSpec] = field(default_factory=dict)  # multi-row requests with host-only pages
    decode_leases: DecodeLeases | None = None  # single-row requests with host-only pages, resolved together
    residency: RankResidency | None = None  # this rank's hot tables (set when a host tier exists)
    step: int = 0  # LRU stamp of this step (grows every step)

    @classmethod
    def from_step(
        cls, step: StepInput, layout: KVLayout, device: torch.device, residency: RankResidency | None
    ) -> ForwardBatch:
        """This rank's batch: the step's host data on `device`. The copies do not wait for the device (a
        blocking copy would wait for the step in flight, and the host would prepare this one unoverlapped);
        CUDA copies pageable host memory to its own staging before each call returns."""
        single = {b for b, (start, end) in enumerate(step.row_ranges) if end - start == 1}
        decode = [(step.row_ranges[b][0], spec) for b, spec in step.nonresident.items() if b in single]
        return cls(
            input_ids=step.input_ids.to(device, non_blocking=True),
            positions=step.positions.to(device, non_blocking=True),
            req_of_row=step.req_of_row.to(device, non_blocking=True),
            mla_write_slots=step.mla_write_slots.to(device, non_blocking=True),
            indexer_write_slots=step.indexer_write_slots.to(device, non_blocking=True),
            mla_page_table=step.mla_page_table.to(device, torch.long, non_blocking=True),
            indexer_page_table=step.indexer_page_table.to(device, torch.long, non_blocking=True),
            context_lens=torch.tensor(step.context_lens, dtype=torch.long).to(device, non_blocking=True),
            logits_rows=step.logits_rows.to(device, non_blocking=True),
            row_ranges=list(step.row_ranges),
            context_lens_host=list(step.context_lens),
            request_ids=list(step.request_ids),
            max_context=max(step.context_lens),
            page_size=layout.page_size,
            indexer_tokens_per_page=layout.indexer_tokens_per_page,
            nonresident={b: spec for b, spec in step.nonresident.items() if b not in single},
            decode_leases=residency.decode_leases(decode, step.step) if decode else None,
            residency=residency,
            step=step.step,
        )

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def mla_slots(self, positions: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Physical MLA slots of every row's token `positions` [T, K], in `dtype` (one launch on a GPU)."""
        slots_of = page_slots if positions.is_cuda else page_slots_ref
        return slots_of(self.mla_page_table, self.req_of_row, positions, self.page_size, dtype)

    def resolve_selection(self, group: int, positions: torch.Tensor, lens: torch.Tensor,
                          index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """KV slots of the chosen positions [T, K]: in place for resident pages, hot slots otherwise; in
        `index_dtype` (what the attention reads) when every page is resident, else int64."""
        decode = self.decode_leases
        if decode is not None and decode.rows is None:  # every row (a decode graph): resident ones in place
            return self.residency.resolve_decode(decode, group, positions, lens)
        if decode is None and not self.nonresident:
            return self.mla_slots(positions, index_dtype)
        slots = self.mla_slots(positions)
        for b, spec in self.nonresident.items():
            span = slice(*self.row_ranges[b])
            self.residency.resolve_rows(spec, group, positions[span], lens[span], self.step, slots[span])
        if decode is None:
            return slots
        slots[decode.rows] = self.residency.resolve_decode(decode, group, positions[decode.rows], lens[decode.rows])
        return slots

    def indexer_slots(self, req: int, num_tokens: int) -> torch.Tensor:
        """Indexer slots of positions 0..num_tokens-1 of request `req`."""
        pos = torch.arange(num_tokens, device=self.positions.device)
        per_page = self.indexer_tokens_per_page
        pages = self.indexer_page_table[req, pos // per_page]
        return pages * per_page + pos % per_page


def with_previous_tokens(input_ids: torch.Tensor, prev_rows: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids [T] with row t replaced by the previous step's sampled token number `prev_rows[t]` where
    that is >= 0: a token the host has not read yet (asynchronous scheduling). Device operations only."""
    return torch.where(prev_rows >= 0, last_tokens[prev_rows.clamp(min=0)], input_ids)
