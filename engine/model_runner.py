"""Model runner: owns the model, the KV page pool tensor and the attention ops.

Turns a scheduler decision into a `ForwardBatch` (flattened rows, write slots,
page tables), runs the forward and returns the logits of the rows that sample.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.attention_ops import AttentionOps, TorchAttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.model import GlmMoeDsaForCausalLM
from engine.model_config import ModelConfig
from engine.scheduler import ScheduledRequest
from engine.weights import load_weights, random_init
from residency.manager import ResidencyManager

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
        model_dir: str | Path | None,
        random_seed: int | None = None,
    ) -> None:
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        with torch.device(device):
            self.model = GlmMoeDsaForCausalLM(cfg).to(dtype)
        # The router's correction bias and the indexer's head weights stay in float32, as published.
        for layer in self.model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.weights_proj.float()
        if random_seed is not None:
            random_init(self.model, random_seed)
        else:
            load_weights(self.model, model_dir, dtype)
        self.model.eval()
        self.kv_pool = torch.empty(0, layout.page_bytes, dtype=torch.uint8, device=device)
        self.ops: AttentionOps = TorchAttentionOps(layout)
        self.residency: ResidencyManager | None = None  # set by the engine when a host tier exists
        self.num_steps = 0

    def allocate_kv_pool(self, num_pages: int) -> None:
        """The one GPU page pool; sized after the weights so the free memory is known."""
        self.kv_pool = torch.zeros(num_pages, self.layout.page_bytes, dtype=torch.uint8, device=self.device)
        logger.info(
            "KV pool: %d pages x %.2f MiB (%s rows)", num_pages, self.layout.page_bytes / 2**20,
            self.layout.kv_format,
        )

    def prepare(self, scheduled: list[ScheduledRequest]) -> ForwardBatch:
        self.num_steps += 1
        ids: list[int] = []
        positions: list[int] = []
        req_of_row: list[int] = []
        row_ranges: list[tuple[int, int]] = []
        logits_rows: list[int] = []
        ctx_lens: list[int] = []
        for b, s in enumerate(scheduled):
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            row_ranges.append((len(ids), len(ids) + s.num_new_tokens))
            ids += req.all_token_ids[start:end]
            positions += range(start, end)
            req_of_row += [b] * s.num_new_tokens
            ctx_lens.append(end)
            if s.completes:
                logits_rows.append(len(ids) - 1)
        page, idx_page = self.layout.page_size, self.layout.indexer_tokens_per_page
        reqs = [s.request for s in scheduled]
        mla_table = _pad_table([r.mla_pages for r in reqs])
        idx_table = _pad_table([r.indexer_pages for r in reqs])
        pos = torch.tensor(positions, dtype=torch.long)
        rows_req = torch.tensor(req_of_row, dtype=torch.long)
        mla_slots = mla_table[rows_req, pos // page] * page + pos % page
        idx_slots = idx_table[rows_req, pos // idx_page] * idx_page + pos % idx_page
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=pos.to(dev),
            req_of_row=rows_req.to(dev),
            mla_write_slots=mla_slots.to(dev),
            indexer_write_slots=idx_slots.to(dev),
            mla_page_table=mla_table.to(dev),
            indexer_page_table=idx_table.to(dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.long, device=dev),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            page_size=page,
            indexer_tokens_per_page=idx_page,
            row_ranges=row_ranges,
            context_lens_host=ctx_lens,
            request_ids=[r.request_id for r in reqs],
            nonresident={b: r for b, r in enumerate(reqs) if r.hot is not None},
            residency=self.residency,
            step=self.num_steps,
        )

    def execute(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Runs one step; returns float32 logits [S, V] for the requests whose chunk completes."""
        batch = self.prepare(scheduled)
        return self.model(batch, self.kv_pool, self.layout, self.ops)


def _pad_table(tables: list[list[int | None]]) -> torch.Tensor:
    """Page tables as one tensor; host-only pages read as page 0 (their slots come from the resolve)."""
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor([0 if p is None else p for p in t], dtype=torch.long)
    return out
