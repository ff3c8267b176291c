"""Building blocks of GLM-MoE-DSA that hold no KV state: norms, rotary embedding, MLPs, MoE.

Parameter names follow the published checkpoints, except the routed experts,
which are stacked per layer for the fused MoE (engine/weight_map.py says where
each published tensor goes). Under tensor parallelism an MLP holds a slice of
the intermediate features and returns a partial output
(engine/tp/sharding.py); the decoder layer sums the ranks' partials.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.linear import WeightFormat, make_linear
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel
from kernels.fp8_gemm import FP8_BLOCK, Fp8Activations
from kernels.fused_moe import fused_moe, fused_moe_ref
from kernels.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_fp8
from kernels.rope import rope
from kernels.router import partial_tokens, route, router_logits


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, times the weight, as the reference does (one kernel on a GPU)."""
    if x.is_cuda and x.dtype == weight.dtype:
        return rmsnorm(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the reference does (one kernel on a GPU).

    `fp8_out`: the norm feeds FP8 linears, so on a GPU `forward_fp8` also writes their quantised input.
    """

    def __init__(self, dim: int, eps: float, fp8_out: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp8_out = fp8_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the norm that follows it, one
        kernel on a GPU."""
        if x.is_cuda and x.dtype == self.weight.dtype == residual.dtype:
            return add_rmsnorm(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total

    def forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, Fp8Activations | None]:
        """(norm(s), s or None without a residual, norm(s) quantised for FP8 GEMMs or None) for s = x (+ residual):
        one kernel on a GPU when the norm feeds FP8 linears; elsewhere those quantise it themselves."""
        if (self.fp8_out and x.is_cuda and x.dim() == 2 and x.dtype == self.weight.dtype
                and (residual is None or residual.dtype == x.dtype)):
            return rmsnorm_fp8(x, self.weight, self.eps, residual)
        if residual is None:
            return self(x), None, None
        return *self.add_forward(x, residual), None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; frequencies in float32 whatever the model dtype."""

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width tables [T, dim/2]: one angle per rotated pair."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., dim] with tables [T, dim/2].

    Interleaved pairs are (x0, x1), (x2, x3), ...; the result is written with the
    rotated evens first and odds second. Queries and keys share that order, so
    their dot products equal the true interleaved rotation.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool) -> torch.Tensor:
    """`apply_rope` on the first `rope_dim` dimensions of x [T, ..., D], the rest unchanged, as one new
    tensor (one kernel on a GPU)."""
    if x.is_cuda:
        return rope(x, cos, sin, rope_dim, interleaved)
    if rope_dim == x.shape[-1]:
        return apply_rope(x, cos, sin, interleaved)
    return torch.cat([apply_rope(x[..., :rope_dim], cos, sin, interleaved), x[..., rope_dim:]], dim=-1)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers, each routed expert and the shared expert.

    `intermediate` is this rank's share; with several ranks the output is partial.
    """

    def __init__(self, hidden: int, intermediate: int, fmt: WeightFormat = WeightFormat()) -> None:
        super().__init__()
        self.gate_proj = make_linear(hidden, intermediate, fmt.is_fp8("gate_proj"))
        self.up_proj = make_linear(hidden, intermediate, fmt.is_fp8("up_proj"))
        self.down_proj = make_linear(intermediate, hidden, fmt.is_fp8("down_proj"))

    def forward(self, x: torch.Tensor, x_fp8: Fp8Activations | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, x_fp8)) * self.up_proj(x, x_fp8))


class Router(nn.Module):
    """Sigmoid router with correction bias and grouped top-k (noaux_tc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.cfg = cfg

    def forward(self, x: torch.Tensor, shared_slot: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k'] float32, expert ids [T, k']): the top-k experts, then, with `shared_slot` >= 0,
        that expert with weight 1 for every token (k' = k + 1). The logits are x.float() @ weight.float().T
        whatever the weight's dtype (the model's, as the reference holds it). Two kernels on a GPU: the float32
        logits (in partial sums for a decode batch, kernels/router.py), then the selection (int32 ids there)."""
        cfg = self.cfg
        if x.is_cuda and x.shape[0] <= partial_tokens(x.dtype, self.weight.dtype):
            logits = router_logits(x, self.weight)
        else:
            logits = F.linear(x.float(), self.weight.float())
        if x.is_cuda:
            return route(logits, self.e_score_correction_bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, cfg.routed_scaling_factor, shared_slot)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, cfg.n_routed_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        if shared_slot < 0:
            return weights, ids
        return (torch.cat([weights, torch.ones_like(weights[:, :1])], 1),
                torch.cat([ids, torch.full_like(ids[:, :1], shared_slot)], 1))


class StackedExperts(nn.Module):
    """Every expert of one MoE layer in two stacked tensors, run by one fused MoE.

    `w13` [E, 2I, H] holds each expert's gate rows then up rows, `w2` [E, H, I]
    its down projection (this rank's I columns under tensor parallelism). FP8
    experts add `w13_scale_inv` [E, 2I/128, H/128] and `w2_scale_inv`
    [E, H/128, I/128]; I must then be a multiple of 128 so no scale block mixes
    gate and up rows.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fp8: bool) -> None:
        super().__init__()
        dtype = torch.float8_e4m3fn if fp8 else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        self.fp8 = fp8
        if fp8:
            if intermediate % FP8_BLOCK:
                raise ValueError(f"FP8 experts need a per-rank intermediate size divisible by {FP8_BLOCK}, "
                                 f"got {intermediate}")
            blocks = -(-hidden // FP8_BLOCK)
            scale = torch.ones(num_experts, 2 * intermediate // FP8_BLOCK, blocks, dtype=torch.float32)
            self.w13_scale_inv = nn.Parameter(scale, requires_grad=False)
            scale = torch.ones(num_experts, blocks, intermediate // FP8_BLOCK, dtype=torch.float32)
            self.w2_scale_inv = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                x_fp8: Fp8Activations | None = None) -> torch.Tensor:
        moe = fused_moe if x.is_cuda else fused_moe_ref
        scales = {"w13_scale_inv": self.w13_scale_inv, "w2_scale_inv": self.w2_scale_inv} if self.fp8 else {}
        return moe(x, self.w13, self.w2, weights, ids, **scales, x_fp8=x_fp8 if self.fp8 else None)


class MoE(nn.Module):
    """Routed experts plus the shared expert, in one fused launch pair.

    The router is replicated, so every rank picks the same experts for a token;
    each rank computes its slice of every picked expert (tensor parallel experts).
    Routing, expert alignment and the grouped GEMMs stay on the device with
    shapes that do not depend on the routing. When the shared expert is as wide
    as a routed one (GLM-5.x), it is stacked as expert E and every token routes
    to it with weight 1; otherwise it stays a separate MLP.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, fmt: WeightFormat = WeightFormat()) -> None:
        super().__init__()
        self.gate = Router(cfg)
        expert = tp.local(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.fold_shared = cfg.n_shared_experts == 1
        slots = cfg.n_routed_experts + (1 if self.fold_shared else 0)
        self.experts = StackedExperts(slots, cfg.hidden_size, expert, fmt.is_fp8("experts"))
        if not self.fold_shared:
            self.shared_experts = MLP(cfg.hidden_size, expert * cfg.n_shared_experts, fmt)
        self.shared_slot = cfg.n_routed_experts

    def forward(self, x: torch.Tensor, x_fp8: Fp8Activations | None = None) -> torch.Tensor:
        if self.fold_shared:
            return self.experts(x, *self.gate(x, self.shared_slot), x_fp8)
        return self.experts(x, *self.gate(x), x_fp8) + self.shared_experts(x, x_fp8)
