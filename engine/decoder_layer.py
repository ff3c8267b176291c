"""One decoder layer of GLM-MoE-DSA: sparse MLA attention and an MLP (dense or MoE), pre-norm.

Under tensor parallelism it adds exactly two all-reduces, after attention and after the MLP block.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import MLAAttention, Selection, StepContext
from engine.layers import MLP, MoE, RMSNorm
from engine.linear import WeightFormat
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, fmt: WeightFormat,
                 full: bool | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp8_out=fmt.is_fp8("self_attn.q_a_proj"))
        self.self_attn = MLAAttention(cfg, layer, tp, fmt, full)
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
