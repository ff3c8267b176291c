"""Sparse MLA attention with the lightning indexer, reading a paged KV cache.

Each layer writes its new rows (normed latent + roped key; indexer key on full
layers) into the page pool, then attends only over the top-K positions that
its IndexShare group's full layer selected. Attention uses the absorbed form:
queries are mapped into the latent space through `kv_b_proj`'s key half and the
latent output back through its value half, so the cache never holds per-head K/V.

Under tensor parallelism a rank holds whole heads (its rows of `q_b_proj` and
`kv_b_proj`, its columns of `o_proj`) and returns a partial output; the latent
projection, the cache writes and the indexer are replicated, so every rank
writes the same rows and selects the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import RMSNorm, rotate
from engine.linear import WeightFormat, linear_pair, make_linear
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel
from kernels.fp8_gemm import FP8_BLOCK, Fp8Activations
from kernels.fp8_pack import KeyPrep, LatentPrep
from kernels.mla_output import mla_output
from kernels.mla_query import mla_query
from kernels.router import router_logits

# rows up to which the indexer's head weights take the router's product kernel (H200, [32, 6144]: 3.7 / 8.4 /
# 12.7 us at 5 / 32 / 64 rows against 12.0 / 13.0 / 13.8 for the float32 copy of x and cuBLAS's two launches)
HEAD_WEIGHTS_FMA_TOKENS = 64


@dataclass(frozen=True)
class StepContext:
    """What every layer of one forward reads: the batch, its rotary tables, the page pool, its
    layout and the ops that read it."""

    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor
    kv_pool: torch.Tensor
    layout: KVLayout
    ops: AttentionOps
    # What the ops derive from the batch once a forward and every layer reads alike (the indexer's per-row
    # limits at each full layer): kept with the forward, never with the batch, whose buffers a CUDA graph
    # replays with new contents.
    derived: dict[str, object] = field(default_factory=dict)


@dataclass
class Selection:
    """Top-K choice of a full layer, shared by its group: slots [T, K] valid up to lens [T]."""

    slots: torch.Tensor
    lens: torch.Tensor


class Indexer(nn.Module):
    """Lightning indexer: scores past tokens with a few cheap heads and keeps the top-K."""

    def __init__(self, cfg: ModelConfig, fmt: WeightFormat) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b = make_linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, fmt.is_fp8("wq_b"))
        self.wk = make_linear(cfg.hidden_size, cfg.index_head_dim, fmt.is_fp8("wk"))
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(x, cos, sin, self.cfg.qk_rope_head_dim, self.cfg.rope_interleave)

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, index_n_heads]: x times the float32 `weights_proj`, times index_n_heads**-0.5. A decode
        batch's few rows on a GPU take the router's float32 product kernel (`kernels.router.router_logits`,
        summed and scaled in one launch), where cuBLAS needed x converted to float32 first, split K over two
        more launches and a fourth for the scale."""
        w = self.weights_proj.weight
        scale = self.cfg.index_n_heads**-0.5
        if x.is_cuda and x.shape[0] <= HEAD_WEIGHTS_FMA_TOKENS and w.dtype == torch.float32:
            return router_logits(x, w, fma_tokens=HEAD_WEIGHTS_FMA_TOKENS, out_scale=scale)[0]
        return self.weights_proj(x.to(w.dtype)).float() * scale

    def forward(self, x: torch.Tensor, q_proj: torch.Tensor, k_proj: torch.Tensor, ctx: StepContext,
                full_index: int) -> Selection:
        """`q_proj` = wq_b(q_latent) and `k_proj` = wk(x): made by the attention beside its own projections of
        the same inputs (`MLAAttention.forward`)."""
        cfg = self.cfg
        batch, cos, sin, layout, ops = ctx.batch, ctx.cos, ctx.sin, ctx.layout, ctx.ops
        q = self._rope(q_proj.view(-1, cfg.index_n_heads, cfg.index_head_dim), cos, sin)
        weights = self._head_weights(x)

        # the key's norm and rotation are done by the row write (one launch with FP8 rows on a GPU)
        norm = self.k_norm
        prep = KeyPrep(norm.weight, norm.bias, norm.eps, cos, sin, cfg.qk_rope_head_dim, cfg.rope_interleave)
        ops.write_indexer_rows(ctx.kv_pool, full_index, batch.indexer_write_slots, k_proj, prep)
        view = layout.indexer_layer_view(ctx.kv_pool, full_index)

        topk = cfg.index_topk
        chosen = ops.indexer_topk(q, weights, view, batch, topk, cfg.index_head_dim**-0.5, full_index, ctx.derived)
        positions = chosen.positions
        if positions.shape[1] < topk:  # contexts shorter than K: pad to [T, K] (entries past lens are never read)
            positions = torch.zeros(batch.num_rows, topk, dtype=torch.long, device=x.device)
            positions[:, : chosen.positions.shape[1]] = chosen.positions
        lens = chosen.counts
        slots = batch.resolve_selection(full_index, positions, lens, ops.index_dtype)
        return Selection(*ops.selection_indices(slots, lens))


def fuses_latent_projections(cfg: ModelConfig, fmt: WeightFormat) -> bool:
    """Whether q_a_proj and kv_a_proj_with_mqa are held as one weight: always for plain weights; for FP8
    ones only when q_lora_rank is a whole number of 128-row scale blocks (GLM-5.3's 2048), so that each
    published tensor's block scales stay its own rows of the joint scale tensor."""
    return not fmt.is_fp8("q_a_proj") or cfg.q_lora_rank % FP8_BLOCK == 0


class MLAAttention(nn.Module):
    """Multi-head latent attention over the slots chosen by the indexer."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, fmt: WeightFormat = WeightFormat(),
                 full: bool | None = None) -> None:
        """`full`: whether the layer has its own indexer; by default as `indexer_types` says (an MTP layer,
        past them, shares its group's selection and passes False)."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.num_heads = h = tp.local(cfg.num_attention_heads, "num_attention_heads")  # this rank's heads
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM when their rows can share a weight
        # (engine/weight_map.py loads both published tensors into it).
        self.fused_latent = fuses_latent_projections(cfg, fmt)
        if self.fused_latent:
            self.q_kv_a_proj = make_linear(cfg.hidden_size, cfg.q_lora_rank + kv_a, fmt.is_fp8("q_a_proj"))
        else:
            self.q_a_proj = make_linear(cfg.hidden_size, cfg.q_lora_rank, fmt.is_fp8("q_a_proj"))
            self.kv_a_proj_with_mqa = make_linear(cfg.hidden_size, kv_a, fmt.is_fp8("kv_a_proj_with_mqa"))
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, fp8_out=fmt.is_fp8("q_b_proj"))
        self.q_b_proj = make_linear(cfg.q_lora_rank, h * cfg.qk_head_dim, fmt.is_fp8("q_b_proj"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = make_linear(h * cfg.v_head_dim, cfg.hidden_size, fmt.is_fp8("o_proj"))
        full = cfg.indexer_types[layer] == "full" if full is None else full
        self.indexer = Indexer(cfg, fmt) if full else None
        self.scale = cfg.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: StepContext, shared: Selection | None,
                x_fp8: Fp8Activations | None = None) -> tuple[torch.Tensor, Selection]:
        """`x_fp8`: x quantised by the input norm (FP8 weights on a GPU), read by the latent projections and the
        indexer's key projection instead of quantising x again."""
        cfg = self.cfg
        batch, cos, sin, layout = ctx.batch, ctx.cos, ctx.sin, ctx.layout
        h, dn, dv, dl = self.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dr = cfg.qk_rope_head_dim
        # the indexer's projections of x and of q_latent run beside the attention's (one launch each pair)
        indexer = self.indexer
        k_index = q_index = None
        if self.fused_latent:
            if indexer is not None:
                q_kv_a, k_index = linear_pair(self.q_kv_a_proj, indexer.wk, x, x_fp8)
            else:
                q_kv_a = self.q_kv_a_proj(x, x_fp8)
            q_a, latent, k_rope = q_kv_a.split([cfg.q_lora_rank, dl, dr], dim=-1)
        else:
            q_a = self.q_a_proj(x, x_fp8)
            latent, k_rope = self.kv_a_proj_with_mqa(x, x_fp8).split([dl, dr], dim=-1)
            if indexer is not None:
                k_index = indexer.wk(x, x_fp8)
        q_latent, _, q_fp8 = self.q_a_layernorm.forward_fp8(q_a)
        if indexer is not None:
            q, q_index = linear_pair(self.q_b_proj, indexer.wq_b, q_latent, q_fp8)
        else:
            q = self.q_b_proj(q_latent, q_fp8)
        q = q.view(-1, h, cfg.qk_head_dim)

        # the latent's norm and the key's rotation are done by the row write (one launch with FP8 rows on a GPU)
        prep = LatentPrep(self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin, cfg.rope_interleave)
        ctx.ops.write_mla_rows(ctx.kv_pool, self.layer, batch.mla_write_slots, latent, k_rope, prep)
        view = layout.mla_layer_view(ctx.kv_pool, self.layer)

        if indexer is not None:
            selection = indexer(x, q_index, k_index, ctx, layout.layer_group[self.layer])
        elif shared is None:
            raise ValueError(f"shared layer {self.layer} has no full indexer layer before it")
        else:
            selection = shared

        w = self.kv_b_proj.weight.view(h, dn + dv, dl)
        if q.is_cuda:  # the absorbed nope part and the rotated rope part in one launch
            q_cat = mla_query(q, w[:, :dn, :], cos, sin, dr, cfg.rope_interleave)
        else:
            q_abs = torch.einsum("thd,hdc->thc", q[..., :dn], w[:, :dn, :])
            q_cat = torch.cat([q_abs, rotate(q[..., dn:], cos, sin, dr, cfg.rope_interleave)], dim=-1)
        out_latent = ctx.ops.sparse_mla(q_cat, view, selection.slots, selection.lens, self.scale).to(x.dtype)
        # the value absorption written as o_proj's rows in one launch (one token too: 2.9 us against cuBLAS's
        # 3.3, bench/RESULTS.md, 2026-12-02, thirteenth session)
        if out_latent.is_cuda:
            return self.o_proj(mla_output(out_latent, w[:, dn:, :])), selection
        out = torch.einsum("thc,hvc->thv", out_latent, w[:, dn:, :])
        return self.o_proj(out.reshape(-1, h * dv)), selection
