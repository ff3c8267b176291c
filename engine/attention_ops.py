"""The KV-cache operations of sparse MLA, behind one small interface.

`write_mla_rows` / `write_indexer_rows` store a step's new rows at their slots
of one layer; `indexer_topk` scores every query row of a step against its
request's cached indexer keys and picks the top-K positions; `sparse_mla`
attends over the selected KV slots in the absorbed form. Each takes a whole
batch in one call, so an implementation can cover all requests with one kernel
launch instead of a Python loop over them. The plain PyTorch implementation
here runs everywhere; Triton kernels implement the same interface for the GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import rms_norm, rotate
from kernels.fp8_pack import KeyPrep, LatentPrep
from kernels.indexer import IndexerKeys
from kernels.topk import topk_positions_ref

# Query rows processed together by the PyTorch path: bounds the gathered rows held at once.
_ROW_CHUNK = 256
# Float32 elements of per-head indexer scores held at once by the PyTorch path (1 GiB).
_SCORE_ELEMENTS = 1 << 28


class TopK(NamedTuple):
    positions: torch.Tensor  # [T, K'] int64, K' <= K; entries >= counts are padding
    counts: torch.Tensor  # [T] valid entries per row: int64, or the ops' index_dtype (what `sparse_mla` reads)


class AttentionOps(Protocol):
    index_dtype: torch.dtype  # of the slots and lens `sparse_mla` reads (`selection_indices` converts to it)

    def write_mla_rows(self, kv_pool: torch.Tensor, layer: int, slots: torch.Tensor, latent: torch.Tensor,
                       rope: torch.Tensor, prep: LatentPrep | None = None) -> None:
        """Stores latent [N, Dl] and roped key [N, Dr] as layer `layer`'s rows at `slots` (distinct). With
        `prep` they are kv_a_proj's raw outputs, normalised and rotated first (in the same launch where the
        kernels allow)."""
        ...

    def write_indexer_rows(self, kv_pool: torch.Tensor, full_index: int, slots: torch.Tensor,
                           keys: torch.Tensor, prep: KeyPrep | None = None) -> None:
        """Stores indexer keys [N, Di] as full layer `full_index`'s rows at `slots` (distinct). With `prep` they
        are wk's raw outputs, normalised and rotated first (in the same launch where the kernels allow)."""
        ...

    def indexer_topk(
        self, q: torch.Tensor, weights: torch.Tensor, view: IndexerKeys, batch: ForwardBatch, topk: int,
        scale: float, full_index: int, derived: dict[str, object] | None = None,
    ) -> TopK:
        """Top-K positions of every row of `batch`: q [T, Hi, Di], weights [T, Hi] against the keys of one
        full layer's indexer `view` (`KVLayout.indexer_layer_view`); row t sees positions <= batch.positions[t].

        counts[t] = min(K, visible positions). K' = min(K, batch.max_context): shorter contexts select
        fewer positions, the caller pads. Equal scores rank by position, so that a tie never
        resolves by the order rows or chunks arrive in. `full_index` with a request id names a stream of choices:
        implementations may keep per-stream state (a synthetic top-K trace). `derived` lives as long as one
        forward (`StepContext.derived`): what an implementation computes from `batch` alone may be kept there
        for the step's other full layers.
        """
        ...

    def selection_indices(self, slots: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full layer's selected slots and lens in the index dtype `sparse_mla` reads, made once and shared
        by the layers of its group."""
        ...

    def sparse_mla(
        self, q: torch.Tensor, kv_view: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Latent outputs [N, H, Dl] of q [N, H, Dl+Dr] over slots [N, K] (valid up to lens [N]), in float32
        or in q's dtype (the caller casts to q's dtype)."""
        ...


class TorchAttentionOps:
    """Reference implementation: gathers and decodes rows, then plain tensor math."""

    index_dtype = torch.int64

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def write_mla_rows(self, kv_pool: torch.Tensor, layer: int, slots: torch.Tensor, latent: torch.Tensor,
                       rope: torch.Tensor, prep: LatentPrep | None = None) -> None:
        if prep is not None:
            latent = rms_norm(latent, prep.norm_weight, prep.eps)
            rope = rotate(rope, prep.cos, prep.sin, rope.shape[-1], prep.interleaved)
        view = self.layout.mla_layer_view(kv_pool, layer)
        page = self.layout.page_size
        view[slots // page, slots % page] = self.layout.encode_mla(latent, rope)

    def write_indexer_rows(self, kv_pool: torch.Tensor, full_index: int, slots: torch.Tensor,
                           keys: torch.Tensor, prep: KeyPrep | None = None) -> None:
        if prep is not None:
            keys = F.layer_norm(keys, keys.shape[-1:], prep.norm_weight, prep.norm_bias, prep.eps)
            keys = rotate(keys, prep.cos, prep.sin, prep.rope_dim, prep.interleaved)
        view = self.layout.indexer_layer_view(kv_pool, full_index)
        per_page = view.tokens_per_page
        view.store(slots // per_page, slots % per_page, self.layout.encode_indexer(keys))

    def indexer_topk(
        self, q: torch.Tensor, weights: torch.Tensor, view: IndexerKeys, batch: ForwardBatch, topk: int,
        scale: float, full_index: int, derived: dict[str, object] | None = None,
    ) -> TopK:
        """One request at a time: gathers and decodes its keys, then scores its rows (see `AttentionOps`)."""
        width = min(topk, batch.max_context)
        positions = torch.zeros(batch.num_rows, width, dtype=torch.long, device=q.device)
        counts = torch.zeros(batch.num_rows, dtype=torch.long, device=q.device)
        per_page = view.tokens_per_page
        for req, (start, end) in enumerate(batch.row_ranges):
            slots = batch.indexer_slots(req, batch.context_lens_host[req])
            keys = self.layout.decode_indexer(view.rows(slots // per_page, slots % per_page), torch.float32)
            chosen = self._request_topk(q[start:end], weights[start:end], keys, batch.positions[start:end] + 1,
                                        topk, scale)
            positions[start:end, : chosen.positions.shape[1]] = chosen.positions
            counts[start:end] = chosen.counts
        return TopK(positions, counts)

    def _request_topk(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, limits: torch.Tensor, topk: int,
        scale: float,
    ) -> TopK:
        """q [n, Hi, Di], weights [n, Hi], keys [ctx, Di] of one request; row i sees positions < limits[i]."""
        ctx = keys.shape[0]
        k = min(topk, ctx)
        keys = keys.float()
        # Per-head scores are [rows, Hi, ctx] floats: bound the rows scored at once.
        rows = max(1, _SCORE_ELEMENTS // max(q.shape[1] * ctx, 1))
        positions = torch.empty(q.shape[0], k, dtype=torch.long, device=q.device)
        for start in range(0, q.shape[0], rows):
            part = slice(start, start + rows)
            scores = torch.relu(torch.einsum("nhd,td->nht", q[part].float(), keys) * scale)
            index_scores = torch.einsum("nh,nht->nt", weights[part].float(), scores)
            visible = torch.arange(ctx, device=q.device)[None, :] < limits[part, None]
            index_scores = index_scores.masked_fill(~visible, float("-inf"))
            # Ties (ReLU makes exact zeros common) go to the smaller position, the same way whatever the
            # chunking or batching, so chunked prefill selects what one-shot selects; ascending positions.
            positions[part] = topk_positions_ref(index_scores, k)
        return TopK(positions, torch.clamp(limits, max=k))

    def selection_indices(self, slots: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots, lens

    def sparse_mla(
        self, q: torch.Tensor, kv_view: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [N, H, Dl+Dr], slots [N, K] into kv_view [P, page, row_bytes] -> [N, H, Dl] float32."""
        out = torch.empty(q.shape[0], q.shape[1], self.layout.latent_dim, dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[0], _ROW_CHUNK):
            rows = slice(start, start + _ROW_CHUNK)
            out[rows] = self._attend(q[rows], kv_view, slots[rows], lens[rows], scale)
        return out

    def _attend(
        self, q: torch.Tensor, kv_view: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        n, k = slots.shape
        page = kv_view.shape[1]
        flat = slots.reshape(-1).long()
        raw = kv_view[flat // page, flat % page]
        kv = self.layout.decode_mla(raw, torch.float32).view(n, k, -1)
        scores = torch.einsum("nhd,nkd->nhk", q.float(), kv) * scale
        valid = torch.arange(k, device=q.device)[None, :] < lens[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return torch.einsum("nhk,nkd->nhd", probs, kv[..., : self.layout.latent_dim])
