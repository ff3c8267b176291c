"""GLM-MoE-DSA causal LM over a paged KV cache.

Module and parameter names match the published checkpoints
(`model.layers.N.self_attn.q_a_proj.weight`, `...mlp.experts.E.gate_proj.weight`)
so weights load by name. The MTP layers past `num_hidden_layers` (engine/mtp.py) are
built only for speculative decoding (`num_draft_layers`), after the target's layers.

Tensor parallelism (engine/tp/sharding.py) adds exactly two all-reduces
per decoder layer, after attention and after the MLP block, and one gather of
the logits, whose vocabulary rows `lm_head` splits across the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from engine.attention import Selection, StepContext
from engine.attention_ops import AttentionOps
from engine.decoder_layer import DecoderLayer
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import RMSNorm, RotaryEmbedding
from engine.linear import Fp8Linear, PlainLinear, WeightFormat
from engine.model_config import ModelConfig
from engine.mtp import MTPLayer
from engine.tp.tensor_parallel import TensorParallel


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, fmt: WeightFormat, num_draft_layers: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, tp, fmt) for i in range(n)]
                                    + [MTPLayer(cfg, n + i, tp, fmt) for i in range(num_draft_layers)])
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
                device: torch.device, num_draft_layers: int = 0) -> GlmMoeDsaForCausalLM:
    """The model with its tensors created in place: `dtype` on `device`, FP8 weights and float32 scales as
    declared. Never `.to(dtype)` a built model: FP8 weights are floating point and would be converted."""
    with torch.device(device), _default_dtype(dtype):
        return GlmMoeDsaForCausalLM(cfg, tp, fmt, num_draft_layers)


class GlmMoeDsaForCausalLM(nn.Module):
    """The whole model; `forward` returns logits of the batch's sampled rows only."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, fmt: WeightFormat = WeightFormat(),
                 num_draft_layers: int = 0) -> None:
        """`num_draft_layers`: how many of the checkpoint's MTP layers to build (speculative decoding)."""
        super().__init__()
        if num_draft_layers > cfg.num_nextn_predict_layers:
            raise ValueError(f"the model has {cfg.num_nextn_predict_layers} MTP layers, {num_draft_layers} asked")
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.weight_format = fmt
        self.model = Backbone(cfg, self.tp, fmt, num_draft_layers)
        self.lm_head = nn.Linear(cfg.hidden_size, self.tp.local(cfg.vocab_size, "vocab_size"), bias=False)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.draft_lm_head: Fp8Linear | None = None  # set by `prepare_drafting` in an FP8 model

    def hold_float32_parts(self) -> None:
        """Keeps the indexer's head weights in float32 whatever the model dtype (float32 as published, and
        so the reference holds them), so no step converts them. The routers' weights stay in the model dtype,
        as the reference holds them (their logits are the float32 product of the two, their bias is float32
        already): a bf16 weight is half the bytes a decode step streams, and its products with bf16
        activations are exact in one bf16 dot. Called once the model is built, before its weights are set."""
        for layer in self.model.layers:  # the MTP layers too
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.weights_proj.float()

    @torch.inference_mode()
    def prepare_drafting(self) -> None:
        """Called once the weights are set. In an FP8 model the drafting passes stream FP8 copies of the two
        plain weights they read at one row a request: `lm_head` (`draft_lm_head`; the verifying pass keeps the
        published bf16 head, whose logits are sampled) and the MTP layer's `eh_proj` (replaced: only drafting
        reads it). At GLM-5.3's shapes on one rank of eight that is 238 + 151 MB of bf16 a drafting pass
        read as 119 + 76 MB. Drafts need no exactness: a draft changes which tokens are accepted, never which
        tokens are output."""
        if self.weight_format.kind != "fp8" or not self.mtp_layers:
            return
        self.draft_lm_head = Fp8Linear.quantized(self.lm_head.weight.data)
        for mtp in self.mtp_layers:
            if isinstance(mtp.eh_proj, PlainLinear):
                mtp.eh_proj = Fp8Linear.quantized(mtp.eh_proj.weight.data)

    @torch.inference_mode()
    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """int64 [R]: the most probable next token of each of the MTP layer's normed outputs [R, hidden], by
        the drafting head (`prepare_drafting`); the ranks gather their best (value, token) pairs, not logits."""
        head = self.draft_lm_head if self.draft_lm_head is not None else self.lm_head
        return self.tp.argmax_columns(head(normed))

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
        x, residual, _, _ = self._layers(batch, kv_pool, layout, ops)
        rows = batch.logits_rows
        return self.model.norm(x[rows] if residual is None else x[rows] + residual[rows])

    @torch.inference_mode()
    def target_pass(
        self, batch: ForwardBatch, kv_pool: torch.Tensor, layout: KVLayout, ops: AttentionOps
    ) -> tuple[torch.Tensor, Selection, StepContext]:
        """Runs the target's layers and returns the final normed hidden states of every row [T, hidden] (an
        MTP layer reads them all), the last full layer's selection (the MTP layer's) and the step's context."""
        x, residual, selection, ctx = self._layers(batch, kv_pool, layout, ops)
        return self.model.norm(x if residual is None else x + residual), selection, ctx

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.cfg.num_hidden_layers :])

    def _layers(self, batch: ForwardBatch, kv_pool: torch.Tensor, layout: KVLayout, ops: AttentionOps
                ) -> tuple[torch.Tensor, torch.Tensor | None, Selection, StepContext]:
        """The target's layers over the batch: (last MLP output, residual stream before it, last selection,
        context)."""
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        ctx = StepContext(batch, cos, sin, kv_pool, layout, ops)
        selection: Selection | None = None
        residual: torch.Tensor | None = None
        for layer in self.model.layers[: self.cfg.num_hidden_layers]:
            x, residual, selection = layer(x, residual, ctx, selection)
        assert selection is not None  # layer 0 is always a full layer
        return x, residual, selection, ctx
