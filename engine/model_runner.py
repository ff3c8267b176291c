"""Model runner: the driver's side of a forward step.

Turns a scheduler decision into a `StepInput` (flattened rows, write slots,
page tables as changes to the last step's, the residency page tables of requests with host-only pages, the
sampling parameters) and runs it on the replica's ranks through the executor,
which returns the token ids rank 0 sampled. The model, the KV pool and the attention ops
live with the ranks (engine/rank/worker.py): in this process with one
rank, in worker processes with several.
"""

from __future__ import annotations

import torch

from engine.executors.executor import Executor, PendingOutput
from engine.kv_layout import KVLayout
from engine.page_tables import PageTableSender
from engine.rank.step import DraftInput, StepInput
from engine.request import PENDING
from engine.sampler import SamplingBatch
from engine.scheduler import ScheduledRequest
from residency.manager import ResidencyManager


class ModelRunner:
    def __init__(self, executor: Executor, layout: KVLayout, num_speculative_tokens: int = 0) -> None:
        """`num_speculative_tokens` > 0: every step verifies drafts and proposes that many (`DraftInput`)."""
        self.executor, self.layout = executor, layout
        self.num_speculative_tokens = num_speculative_tokens
        self.residency: ResidencyManager | None = None  # set by the engine when a host tier exists
        self.num_steps = 0
        self._last_sampled: dict[str, int] = {}  # request id -> its row among the last launched step's samples
        self.page_tables = PageTableSender()

    @property
    def kv_pool(self) -> torch.Tensor:
        """The page pool tensor; only a single-rank replica has it in this process."""
        return self.executor.kv_pool

    def prepare(self, scheduled: list[ScheduledRequest], sampling: SamplingBatch, continues: bool = False,
                replayed: torch.Tensor | None = None) -> StepInput:
        self.num_steps += 1
        ids: list[int] = []
        prev_rows: list[int] = []
        positions: list[int] = []
        req_of_row: list[int] = []
        row_ranges: list[tuple[int, int]] = []
        logits_rows: list[int] = []
        ctx_lens: list[int] = []
        next_ids: list[int] = []
        logit_starts: list[int] = []
        for b, s in enumerate(scheduled):
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            row_ranges.append((len(ids), len(ids) + s.num_new_tokens))
            chunk = req.step_token_ids(start, end)
            if self.num_speculative_tokens:  # MTP input: each row's next token, -1 where this step samples it
                known = req.token_ids(start + 1, min(end + 1, req.num_tokens))
                next_ids += known + [-1] * (s.num_new_tokens - len(known))
            if req.num_pending_tokens:
                prev_rows += [-1 if t != PENDING else self._last_sampled[req.request_id] for t in chunk]
            else:
                prev_rows += [-1] * len(chunk)
            ids += chunk
            positions += range(start, end)
            req_of_row += [b] * s.num_new_tokens
            ctx_lens.append(end)
            if s.completes:  # the last known token's row and the draft rows after it
                logit_starts.append(len(logits_rows))
                logits_rows += range(len(ids) - 1 - s.num_drafts, len(ids))
        page, idx_page = self.layout.page_size, self.layout.indexer_tokens_per_page
        reqs = [s.request for s in scheduled]
        draft = None
        if self.num_speculative_tokens:
            draft = DraftInput(next_ids=torch.tensor(next_ids, dtype=torch.long),
                               logit_starts=torch.tensor(logit_starts, dtype=torch.long),
                               num_drafts=torch.tensor([s.num_drafts for s in scheduled if s.completes],
                                                       dtype=torch.long),
                               num_speculative_tokens=self.num_speculative_tokens)
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            req_of_row=torch.tensor(req_of_row, dtype=torch.long),
            mla_write_slots=_write_slots(scheduled, "mla_pages", page),
            indexer_write_slots=_write_slots(scheduled, "indexer_pages", idx_page),
            page_table_rows=self.page_tables.rows(reqs),
            context_lens=tuple(ctx_lens),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            row_ranges=tuple(row_ranges),
            request_ids=tuple(r.request_id for r in reqs),
            # a verifying step's rows run past what the host holds (its drafts, and a continued step's drafts
            # taken as accepted): the reverse maps must cover its last position too
            nonresident_tokens={b: max(r.num_tokens, ctx_lens[b]) for b, r in enumerate(reqs) if r.hot is not None},
            step=self.num_steps,
            sampling=sampling,
            prev_rows=torch.tensor(prev_rows, dtype=torch.long) if PENDING in ids else None,
            draft=draft,
            continues=continues,
            replayed=replayed,
        )

    def launch(self, scheduled: list[ScheduledRequest], sampling: SamplingBatch, continues: bool = False,
               replayed: torch.Tensor | None = None) -> PendingOutput:
        """Queues one step on every rank (`collect` reads it); `sampling` has one row for each request whose
        chunk completes, in order. Inputs sampled by the step launched before and not yet read are taken
        from the ranks' devices; `continues`: a speculative step continuing the one launched before it, built
        as if that one accepted every draft (`StepInput.continues`, `replayed`)."""
        try:
            pending = self.executor.launch_model(self.prepare(scheduled, sampling, continues, replayed))
        except BaseException:
            self.page_tables.reset()  # the ranks may hold some of this step's rows, or none
            raise
        completing = [s.request.request_id for s in scheduled if s.completes]
        self._last_sampled = {rid: i for i, rid in enumerate(completing)}
        return pending

    def collect(self, pending: PendingOutput) -> list[int]:
        """The token sampled for each completing request of a launched step, once the ranks have it."""
        out = pending.output()
        if self.residency is not None:
            self.residency.record_resolves(out.resolve)
        return out.tokens


def _write_slots(scheduled: list[ScheduledRequest], pages_attr: str, page: int) -> torch.Tensor:
    """The slots of each scheduled row's new KV entry, from its request's pages, one run of slots per page
    touched (host-only pages read as page 0; new tokens never land in one)."""
    out: list[int] = []
    for s in scheduled:
        pages = getattr(s.request, pages_attr)
        pos, end = s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_new_tokens
        while pos < end:
            run_end = min(end, (pos // page + 1) * page)
            base = (pages[pos // page] or 0) * page - pos // page * page
            out.extend(range(base + pos, base + run_end))
            pos = run_end
    return torch.tensor(out, dtype=torch.long)
