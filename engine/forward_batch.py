"""What one forward pass needs to know about its batch: flattened tokens and page tables.

Built by the model runner from the scheduler's decision, consumed by attention.
Tokens of all requests are flattened into one sequence of T rows; `req_of_row`
maps each row to its request in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from residency.manager import ResidencyManager


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
    page_size: int
    indexer_tokens_per_page: int
    nonresident: dict[int, Any] = field(default_factory=dict)  # batch index -> request with host-only pages
    residency: ResidencyManager | None = None
    step: int = 0  # LRU stamp of this step (grows every step)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def mla_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical MLA slots of token `positions` [N, K] of the requests of `rows` [N]."""
        table = self.mla_page_table[self.req_of_row[rows]]
        pages = table.gather(1, (positions // self.page_size).long())
        return pages * self.page_size + positions % self.page_size

    def resolve_selection(self, group: int, positions: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """KV slots of the chosen positions [T, K]: in place for resident pages, hot slots otherwise."""
        rows = torch.arange(self.num_rows, device=positions.device)
        slots = self.mla_slots(rows, positions)
        for b, req in self.nonresident.items():
            start, end = self.row_ranges[b]
            slots[start:end] = self.residency.resolve_rows(req, group, positions[start:end], lens[start:end], self.step)
        return slots

    def indexer_slots(self, req: int, num_tokens: int) -> torch.Tensor:
        """Indexer slots of positions 0..num_tokens-1 of request `req`."""
        pos = torch.arange(num_tokens, device=self.positions.device)
        per_page = self.indexer_tokens_per_page
        pages = self.indexer_page_table[req, pos // per_page]
        return pages * per_page + pos % per_page
