"""GLM-MoE-DSA causal LM over a paged KV cache.

Module and parameter names match the published checkpoints
(`model.layers.N.self_attn.q_a_proj.weight`, `...mlp.experts.E.gate_proj.weight`)
so weights load by name. Layers beyond `num_hidden_layers` (the MTP head) are
not built.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import MLAAttention, Selection
from engine.attention_ops import AttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import MLP, MoE, RMSNorm, RotaryEmbedding
from engine.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_pool: torch.Tensor,
        layout: KVLayout,
        ops: AttentionOps,
        shared: Selection | None,
    ) -> tuple[torch.Tensor, Selection]:
        attn, selection = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_pool, layout, ops, shared)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), selection


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaForCausalLM(nn.Module):
    """The whole model; `forward` returns logits of the batch's sampled rows only."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_pool: torch.Tensor, layout: KVLayout, ops: AttentionOps
    ) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        selection: Selection | None = None
        for layer in self.model.layers:
            x, selection = layer(x, cos, sin, batch, kv_pool, layout, ops, selection)
        hidden = self.model.norm(x[batch.logits_rows])
        return self.lm_head(hidden).float()
