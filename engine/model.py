"""GLM-MoE-DSA causal LM over a paged KV cache.

Module and parameter names match the published checkpoints
(`model.layers.N.self_attn.q_a_proj.weight`, `...mlp.experts.E.gate_proj.weight`)
so weights load by name. Layers beyond `num_hidden_layers` (the MTP head) are
not built.

Tensor parallelism (engine/tp/sharding.py) adds exactly two all-reduces
per decoder layer, after attention and after the MLP block, and one gather of
the logits, whose vocabulary rows `lm_head` splits across the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from engine.attention import MLAAttention, Selection, StepContext
from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import MLP, MoE, RMSNorm, RotaryEmbedding
from engine.linear import WeightFormat
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, fmt: WeightFormat) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp8_out=fmt.is_fp8("self_attn.q_a_proj"))
        self.self_attn = MLAAttention(cfg, layer, tp, fmt)
        if cfg.is_moe_layer(layer):
            self.mlp: nn.Module = MoE(cfg, tp, fmt)
            mlp_fp8 = fmt.is_fp8("mlp.experts")
        else:
            self.mlp = MLP(cfg.hidden_size, tp.local(cfg.intermediate_size, "intermediate_size"), fmt)
            mlp_fp8 = fmt.is_fp8("mlp.gate_proj")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp8_out=mlp_fp8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, shared: Selection | None
                ) -> tuple[torch.Tensor, torch.Tensor, Selection]:
        """(MLP output, residual stream before it, selection): the stream is x + residual, added by the next
        norm (the next layer's input norm, or the final one), which saves a launch per add on a GPU. The
        first layer gets the embeddings as x and no residual."""
        h, total, h_fp8 = self.input_layernorm.forward_fp8(x, residual)
        residual = x if residual is None else total
        attn, selection = self.self_attn(h, ctx, shared, h_fp8)
        h, residual, h_fp8 = self.post_attention_layernorm.forward_fp8(self.tp.all_reduce(attn), residual)
        return self.tp.all_reduce(self.mlp(h, h_fp8)), residual, selection


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, fmt: WeightFormat) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, fmt) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ModelConfig, tp: TensorParallel, fmt: WeightFormat, dtype: torch.dtype,
                device: torch.device) -> GlmMoeDsaForCausalLM:
    """The model with its tensors created in place: `dtype` on `device`, FP8 weights and float32 scales as
    declared. Never `.to(dtype)` a built model: FP8 weights are floating point and would be converted."""
    with torch.device(device), _default_dtype(dtype):
        return GlmMoeDsaForCausalLM(cfg, tp, fmt)


class GlmMoeDsaForCausalLM(nn.Module):
    """The whole model; `forward` returns logits of the batch's sampled rows only."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, fmt: WeightFormat = WeightFormat()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.weight_format = fmt
        self.model = Backbone(cfg, self.tp, fmt)
        self.lm_head = nn.Linear(cfg.hidden_size, self.tp.local(cfg.vocab_size, "vocab_size"), bias=False)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)

    def hold_float32_parts(self) -> None:
        """Keeps in float32 what is computed in float32 whatever the model dtype: the indexer's head weights
        (float32 as published) and the routers' weights (their scores; their bias is float32 already), so
        no step converts them again. Called once the model is built, before its weights are set."""
        for layer in self.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.weights_proj.float()
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.float()

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_pool: torch.Tensor, layout: KVLayout, ops: AttentionOps
    ) -> torch.Tensor:
        """float32 logits [S, V] of the batch's sampled rows."""
        return self.logits(self.hidden_states(batch, kv_pool, layout, ops))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, V] of final hidden states [S, hidden]: each rank's rows of the vocabulary, then
        gathered, so every rank holds all of them."""
        return self.tp.all_gather_columns(self.lm_head(hidden).float())

    @torch.inference_mode()
    def hidden_states(
        self, batch: ForwardBatch, kv_pool: torch.Tensor, layout: KVLayout, ops: AttentionOps
    ) -> torch.Tensor:
        """Runs every layer (writing the batch's KV rows) and returns the final normed hidden
        states [S, hidden] of the sampled rows; ranks that return no logits stop here."""
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        ctx = StepContext(batch, cos, sin, kv_pool, layout, ops)
        selection: Selection | None = None
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual, selection = layer(x, residual, ctx, selection)
        rows = batch.logits_rows
        return self.model.norm(x[rows] if residual is None else x[rows] + residual[rows])
