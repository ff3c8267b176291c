"""What the driver sends every rank for one forward step, and what comes back.

A `StepInput` is plain host data (CPU tensors, ids): the driver builds it once
from the scheduler's decision and every rank turns it into a `ForwardBatch` on
its own device. Page tables travel as changes to the last step's rows
(engine/page_tables.py); each rank rebuilds them whole first. The
residency page lists of requests with
host-only pages, so each rank can run the same resolve against its own copy of
the request's hot-buffer tables, and the sampling parameters of the rows that
sample. Rank 0 samples on its device and answers with the token ids and the
resolve counts (the other ranks computed the same counts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.page_tables import PageTableRow, PageTableStore
from engine.sampler import SamplingBatch
from residency.rank import NonResidentSpec
from residency.stats import ResolveCounts


@dataclass(frozen=True)
class DraftInput:
    """What a speculative step needs beyond the target forward (engine/rank/speculative.py): the MTP
    layer's input token of every row and, per sampling request, where its logits rows start and how many
    of them verify drafts. Sampling requests are the completing ones, in order; each has 1 + drafts
    consecutive logits rows."""

    next_ids: torch.Tensor  # [T] int64: the token after each row's position when known, -1 on logits rows
    logit_starts: torch.Tensor  # [R] int64: first logits row of each sampling request
    num_drafts: torch.Tensor  # [R] int64: drafts it verifies (its logits rows - 1)
    num_speculative_tokens: int  # drafts to propose for each sampling request

    def to(self, device: torch.device) -> DraftInput:
        return DraftInput(self.next_ids.to(device, non_blocking=True), self.logit_starts.to(device, non_blocking=True),
                          self.num_drafts.to(device, non_blocking=True), self.num_speculative_tokens)


@dataclass(frozen=True)
class StepInput:
    """One step's batch as host data: flattened rows, write slots, page tables (see ForwardBatch)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_of_row: torch.Tensor  # [T]
    mla_write_slots: torch.Tensor  # [T]
    indexer_write_slots: torch.Tensor  # [T]
    page_table_rows: tuple[PageTableRow, ...]  # per request: its page tables as changes to the last step's
    context_lens: tuple[int, ...]  # per request: tokens cached after this step
    logits_rows: torch.Tensor  # [S]
    row_ranges: tuple[tuple[int, int], ...]  # per request: [start, end) of its rows
    request_ids: tuple[str, ...]
    nonresident_tokens: dict[int, int]  # batch index of a request with host-only pages -> its tokens after the step
    step: int  # LRU stamp of this step (grows every step)
    sampling: SamplingBatch  # one row per entry of logits_rows
    # [T] int64: for a row whose input the previous step sampled and the host has not read, that token's
    # number among the previous step's sampled rows (its id is on the device); -1 elsewhere. None: all known.
    prev_rows: torch.Tensor | None = None
    draft: DraftInput | None = None  # speculative decoding: verify this step's drafts and propose the next
    # A speculative step of the requests of the one launched before it, in the same order, each verifying k
    # drafts, built by the host as if that step accepted every draft: its inputs (the last accepted token and
    # the drafts proposed after it) are unread, and its positions, write slots, context lengths and draw keys
    # run ahead by that step's rejected drafts. The rank takes the inputs from that step's results on its
    # device and shifts the rest back (engine/rank/spec_graphs.py); the page tables cover the furthest rows.
    continues: bool = False
    # [R, 2k] int64 with `continues`: each request's replayed output from the token after the first unread one
    # (engine/llm_engine.py `replay_drafts`), its drafts taken from the accepted count on; -1 rows draft with the
    # MTP layer. None: every request does.
    replayed: torch.Tensor | None = None
    # Rebuilt by each rank from `page_table_rows` (`with_page_tables`) before anything reads them:
    # [B, max_pages] / [B, max_indexer_pages] int32 whole tables, and the resolve's page lists of the
    # requests with host-only pages (batch index -> spec).
    mla_page_table: torch.Tensor | None = None
    indexer_page_table: torch.Tensor | None = None
    nonresident: dict[int, NonResidentSpec] = dataclasses.field(default_factory=dict)

    def with_page_tables(self, store: PageTableStore) -> StepInput:
        """This step with its whole page tables and non-resident page lists, from `store` (the rank's rows of
        the last step)."""
        mla, indexer = store.apply(self.page_table_rows)
        nonresident = {b: store.nonresident(self.request_ids[b], n) for b, n in self.nonresident_tokens.items()}
        return dataclasses.replace(self, mla_page_table=mla, indexer_page_table=indexer, nonresident=nonresident)

    @property
    def num_requests(self) -> int:
        return len(self.row_ranges)

    @property
    def is_decode(self) -> bool:
        """Every request brings one row and samples it: the shape a captured decode graph serves."""
        return self.num_logits == self.num_requests == int(self.input_ids.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_rows.shape[0])


@dataclass(frozen=True)
class StepOutput:
    """A rank's answer: the sampled token id of each logits row and the resolve counts (the driver reads
    rank 0's; every rank sampled the same)."""

    tokens: list[int]
    resolve: ResolveCounts
