"""The multi-token-prediction (MTP) layer: GLM-5's draft model for speculative decoding.

A published GLM-MoE-DSA checkpoint carries `num_nextn_predict_layers` layers past
`num_hidden_layers` (`model.layers.78.*` for GLM-5.3): a decoder block like the
others (sparse MLA and an MoE) with three parts of its own. At position p it reads
the target's final hidden state h_p and the embedding of the token at p + 1, joins
them (`eh_proj` of `[enorm(embedding), hnorm(h_p)]`), runs the block and predicts the
token at p + 2 through its own final norm (`shared_head.norm`) and the target's
`lm_head` (the checkpoint's `shared_head.head` and `embed_tokens` copies of the
target's are not loaded). Iterated on its own output stream it drafts further tokens.

Its attention is sparse like the target's, with IndexShare for the MTP iterations
(`index_share_for_mtp_iteration`): it has no indexer and attends over the selection
of the target's last full layer, so its KV rows are one more member of that
IndexShare group in the page layout (`KVLayout.for_model(draft_layers=...)`) and
travel with the group's rows (misses, mirrors, exports).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import Selection, StepContext
from engine.decoder_layer import DecoderLayer
from engine.layers import RMSNorm
from engine.linear import Fp8Linear, WeightFormat, make_linear
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel
from kernels.fp8_gemm import FP8_BLOCK, Fp8Activations
from kernels.rmsnorm import rmsnorm_pair


def draft_layers(num_speculative_tokens: int) -> int:
    """MTP layers a replica drafting `num_speculative_tokens` tokens a step builds (and its pages hold rows of):
    one, iterated for every draft after the first, as the published recipe runs it."""
    return 1 if num_speculative_tokens else 0


class SharedHead(nn.Module):
    """The MTP layer's output norm (its `head` is the target's `lm_head`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One next-token-prediction layer; its parameters carry the published names (`model.layers.L.enorm`, ...)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, fmt: WeightFormat) -> None:
        super().__init__(cfg, layer, tp, fmt, full=False)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = make_linear(2 * cfg.hidden_size, cfg.hidden_size, fmt.is_fp8("eh_proj"))
        self.shared_head = SharedHead(cfg)

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: StepContext, selection: Selection
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output stream [T, H], its normed form [T, H] for the logits) of rows whose token embeddings are
        `embeds` [T, H] and whose previous hidden states are `hidden` [T, H] (the target's final normed state,
        or this layer's output stream when iterating). Writes the rows' KV at `ctx.batch.mla_write_slots`."""
        x = self.eh_proj(*self._joined(embeds, hidden))
        out, residual, _ = self(x, None, ctx, selection)
        stream = out + residual
        return stream, self.shared_head.norm(stream)

    def _joined(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, Fp8Activations | None]:
        """`eh_proj`'s input [enorm(embeds), hnorm(hidden)] [T, 2H] and, for an FP8 `eh_proj`, its quantisation:
        one launch on a GPU (kernels/rmsnorm.py `rmsnorm_pair`) for the two norms, the join and the quantisation."""
        fp8 = isinstance(self.eh_proj, Fp8Linear)
        if (embeds.is_cuda and embeds.dtype == hidden.dtype == self.enorm.weight.dtype == self.hnorm.weight.dtype
                and not (fp8 and embeds.shape[-1] % FP8_BLOCK)):
            return rmsnorm_pair(embeds, self.enorm.weight, hidden, self.hnorm.weight, self.enorm.eps, fp8)
        return torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1), None
