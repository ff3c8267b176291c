"""Attention ops on the GPU: Triton kernels behind the `AttentionOps` interface.

Both operations read the page pool directly (FP8 rows dequantised in the
kernels). The indexer scores every row of a step in one launch per chunk of
rows, through the batch's indexer page table, instead of gathering and decoding
each request's keys in a Python loop: a decode step then costs the same number
of launches whatever the number of requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention_ops import TopK, TorchAttentionOps
from engine.forward_batch import ForwardBatch
from kernels.fp8_pack import KeyPrep, LatentPrep, key_prep_fits, pack_indexer_rows_into, pack_mla_rows_into
from kernels.indexer import IndexerKeys, indexer_scores, visible_lengths
from kernels.sparse_mla import sparse_mla
from kernels.topk import topk_positions

# Indexer scores held at once (float32): bounds the scoring buffer of a long prefill chunk.
_SCORE_ELEMENTS = 1 << 25
# Query rows of one scoring launch at most (the kernel's grid limit).
_MAX_LAUNCH_ROWS = 65535


class _IndexerRows(NamedTuple):
    """What the indexer's launches read of a step's rows, the same at each of its full layers (int32 where the
    kernel reads it): ten small launches a full layer when made again for each."""

    page_table: torch.Tensor  # [R, pages] int32
    row_to_req: torch.Tensor  # [T] int32
    row_ctx: torch.Tensor  # [T] int32: the row's request's context
    visible: torch.Tensor  # [T] int32: positions the row sees, its position + 1
    scored: torch.Tensor  # [T] int32: positions it scores, min(its context, position + 1) within the step's context
    counts: torch.Tensor  # [T] int32: positions it selects, min(its context, position + 1, width)

    @classmethod
    def of(cls, batch: ForwardBatch, width: int) -> _IndexerRows:
        row_ctx = batch.context_lens[batch.req_of_row]
        visible = batch.positions + 1
        row_ctx32, visible32 = row_ctx.to(torch.int32), visible.to(torch.int32)
        scored = visible_lengths(row_ctx32, visible32, batch.max_context)
        return cls(batch.indexer_page_table.to(torch.int32), batch.req_of_row.to(torch.int32), row_ctx32, visible32,
                   scored, torch.clamp(scored, max=width))  # width <= max_context: the same as clamping the minimum


class TritonAttentionOps(TorchAttentionOps):
    index_dtype = torch.int32

    def write_mla_rows(self, kv_pool: torch.Tensor, layer: int, slots: torch.Tensor, latent: torch.Tensor,
                       rope: torch.Tensor, prep: LatentPrep | None = None) -> None:
        """FP8 rows are normalised, rotated (with `prep`), quantised and stored by one launch (the PyTorch
        packing is a dozen); others as the twin."""
        if self.layout.kv_format != "fp8" or (prep is not None and prep.norm_weight.dtype != latent.dtype):
            return super().write_mla_rows(kv_pool, layer, slots, latent, rope, prep)
        if prep is None:
            latent, rope = latent.contiguous(), rope.contiguous()
        pack_mla_rows_into(latent, rope, kv_pool, slots.contiguous(), self.layout.mla_placement(layer), prep)

    def write_indexer_rows(self, kv_pool: torch.Tensor, full_index: int, slots: torch.Tensor,
                           keys: torch.Tensor, prep: KeyPrep | None = None) -> None:
        """FP8 keys are normalised, rotated (with `prep`), quantised and stored by one launch (three with the
        norm and the rotation apart); others as the twin."""
        fused = prep is None or (prep.norm_weight.dtype == keys.dtype and key_prep_fits(keys.shape[1], prep.rope_dim))
        if self.layout.kv_format != "fp8" or not fused:
            return super().write_indexer_rows(kv_pool, full_index, slots, keys, prep)
        if keys.stride(1) != 1:  # the packing launches read rows at any stride, values contiguous
            keys = keys.contiguous()
        pack_indexer_rows_into(keys, kv_pool, slots.contiguous(), self.layout.indexer_placement(full_index), prep)

    def indexer_topk(
        self, q: torch.Tensor, weights: torch.Tensor, view: IndexerKeys, batch: ForwardBatch, topk: int,
        scale: float, full_index: int, derived: dict[str, object] | None = None,
    ) -> TopK:
        """All rows of the batch from the page pool (see `AttentionOps`); the same positions as the PyTorch
        ops, padding included (positions past a request's context read 0, as there). The rows' limits are
        the same at every full layer of a step: made once a forward when `derived` is given."""
        max_ctx = batch.max_context
        width = min(topk, max_ctx)
        limits = derived.get("indexer_rows") if derived is not None else None
        if limits is None:
            limits = _IndexerRows.of(batch, width)
            if derived is not None:
                derived["indexer_rows"] = limits
        positions = torch.empty(batch.num_rows, width, dtype=torch.long, device=q.device)
        rows = max(1, min(_MAX_LAUNCH_ROWS, _SCORE_ELEMENTS // max(max_ctx, topk)))
        for start in range(0, batch.num_rows, rows):
            part = slice(start, start + rows)
            scores = indexer_scores(
                q[part], weights[part], view, limits.page_table, limits.row_to_req[part], limits.row_ctx[part],
                limits.visible[part], kv_format=self.layout.kv_format, scale=scale, topk=topk, max_ctx=max_ctx,
                visible=limits.scored[part],
            )
            # Past its own context, a request shorter than the width gets invisible positions from the top-K (the
            # -inf scores past it, in position order, so column j holds position j there); the PyTorch ops leave
            # those columns 0, and the top-K writes them so (`limits`), not a launch of its own at each full layer.
            topk_positions(scores, width, out=positions[part], limits=limits.row_ctx[part])
        return TopK(positions, limits.counts)

    def selection_indices(self, slots: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 and contiguous, as the sparse MLA kernel reads them (converted once per group, not per layer)."""
        return slots.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous()

    def sparse_mla(
        self, q: torch.Tensor, kv_view: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The output in q's dtype: the caller rounds the float32 result to it anyway."""
        layout = self.layout
        return sparse_mla(
            q.contiguous(), kv_view, slots.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous(),
            kv_format=layout.kv_format, latent_dim=layout.latent_dim, rope_dim=layout.rope_dim, scale=scale,
            out_dtype=q.dtype,
        )
