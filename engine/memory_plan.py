"""Memory planning: how many KV pages a GPU and a host pool hold, and how many requests fit.

The engine sizes its GPU pool with `num_gpu_pages`; the concurrency calculator
(`notebooks/concurrency.ipynb`) asks `max_concurrent_requests` the same
question per policy. The MLA latent and indexer caches are replicated on every
tensor-parallel rank, so one GPU's budget bounds the whole replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_layout import KVLayout
from engine.linear import WeightFormat
from engine.model_config import ModelConfig
from kernels.fp8_gemm import FP8_BLOCK
from residency.config import POLICY_TRAITS

GIB = 2**30


@dataclass(frozen=True)
class MemoryBudget:
    """One replica's memory: per-GPU HBM and what else lives there, plus its host pool."""

    gpu_bytes: int  # HBM of one GPU
    gpu_memory_utilization: float  # share of HBM the engine may use
    weight_bytes_per_gpu: int  # weights resident on one GPU after tensor parallel sharding
    activation_reserve_bytes: int  # workspace for the forward pass at max_num_batched_tokens
    host_pool_bytes: int = 0  # pinned host tier of the replica

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class Footprint:
    """Pages one request holds while it runs."""

    gpu_pages: int
    host_pages: int


def linear_weight_bytes(out_features: int, in_features: int, fp8: bool, dtype_bytes: int) -> int:
    """A linear layer's weight: e4m3 values plus one float32 scale per 128x128 block, or dense values."""
    if not fp8:
        return out_features * in_features * dtype_bytes
    return out_features * in_features + 4 * -(-out_features // FP8_BLOCK) * -(-in_features // FP8_BLOCK)


def attention_weight_bytes(cfg: ModelConfig, heads: int, fmt: WeightFormat, d: int) -> int:
    h = cfg.hidden_size
    return (
        linear_weight_bytes(cfg.q_lora_rank, h, fmt.is_fp8("q_a_proj"), d)
        + linear_weight_bytes(heads * cfg.qk_head_dim, cfg.q_lora_rank, fmt.is_fp8("q_b_proj"), d)
        + linear_weight_bytes(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, fmt.is_fp8("kv_a_proj_with_mqa"), d)
        + linear_weight_bytes(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, False, d)
        + linear_weight_bytes(h, heads * cfg.v_head_dim, fmt.is_fp8("o_proj"), d)
        + (cfg.q_lora_rank + cfg.kv_lora_rank) * d  # the two latent norms
    )


def indexer_weight_bytes(cfg: ModelConfig, fmt: WeightFormat, d: int) -> int:
    h, heads, dim = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return (
        linear_weight_bytes(heads * dim, cfg.q_lora_rank, fmt.is_fp8("wq_b"), d)
        + linear_weight_bytes(dim, h, fmt.is_fp8("wk"), d)
        + 2 * dim * d  # key LayerNorm weight and bias
        + heads * h * 4  # head weights, float32 as published
    )


def _moe_bytes(cfg: ModelConfig, expert: int, fmt: WeightFormat, d: int) -> int:
    h, fp8 = cfg.hidden_size, fmt.is_fp8("experts")
    folded = cfg.n_shared_experts == 1
    slots = cfg.n_routed_experts + (1 if folded else 0)
    experts = slots * (linear_weight_bytes(2 * expert, h, fp8, d) + linear_weight_bytes(h, expert, fp8, d))
    shared = 0 if folded else _mlp_bytes(h, expert * cfg.n_shared_experts, fmt, d)
    router = cfg.n_routed_experts * h * d + cfg.n_routed_experts * 4  # weight in the model dtype, float32 bias
    return experts + shared + router


def _mlp_bytes(hidden: int, intermediate: int, fmt: WeightFormat, d: int) -> int:
    return (linear_weight_bytes(intermediate, hidden, fmt.is_fp8("gate_proj"), d)
            + linear_weight_bytes(intermediate, hidden, fmt.is_fp8("up_proj"), d)
            + linear_weight_bytes(hidden, intermediate, fmt.is_fp8("down_proj"), d))


def mtp_layer_bytes(cfg: ModelConfig, tp_size: int, fmt: WeightFormat, d: int) -> int:
    """One MTP layer (engine/mtp.py) on one rank: an MoE decoder block without an indexer (it uses the
    target's selection), `eh_proj` [H, 2H] (replicated) and its three norms (`enorm`, `hnorm`,
    `shared_head.norm`); its embedding and head are the target's. An FP8 model drafts through FP8 copies
    (`GlmMoeDsaForCausalLM.prepare_drafting`): `eh_proj` is held in FP8 and the head's rows once more."""
    h, drafting_fp8 = cfg.hidden_size, fmt.kind == "fp8"
    block = 2 * h * d + attention_weight_bytes(cfg, cfg.num_attention_heads // tp_size, fmt, d)
    block += _moe_bytes(cfg, cfg.moe_intermediate_size // tp_size, fmt, d)
    head_copy = linear_weight_bytes(cfg.vocab_size // tp_size, h, True, d) if drafting_fp8 else 0
    return block + linear_weight_bytes(h, 2 * h, drafting_fp8, d) + 3 * h * d + head_copy


def weight_bytes(cfg: ModelConfig, tp_size: int, fmt: WeightFormat, dtype: torch.dtype,
                 num_draft_layers: int = 0) -> int:
    """Bytes one tensor-parallel rank allocates for the model's weights, with `num_draft_layers` MTP layers:
    the engine's own layout (FP8 values and scales, stacked experts, float32 indexer head weights and
    router biases), so the memory plan counts what the GPU really holds."""
    d = torch.finfo(dtype).bits // 8
    h = cfg.hidden_size
    heads = cfg.num_attention_heads // tp_size
    total = (cfg.vocab_size + cfg.vocab_size // tp_size) * h * d  # embedding (replicated), lm_head (split)
    total += h * d + cfg.qk_rope_head_dim // 2 * 4  # final norm, rotary frequencies
    for layer in range(cfg.num_hidden_layers):
        total += 2 * h * d + attention_weight_bytes(cfg, heads, fmt, d)
        if cfg.indexer_types[layer] == "full":
            total += indexer_weight_bytes(cfg, fmt, d)
        if cfg.is_moe_layer(layer):
            total += _moe_bytes(cfg, cfg.moe_intermediate_size // tp_size, fmt, d)
        else:
            total += _mlp_bytes(h, cfg.intermediate_size // tp_size, fmt, d)
    return total + num_draft_layers * mtp_layer_bytes(cfg, tp_size, fmt, d)


def num_gpu_pages(budget: MemoryBudget, layout: KVLayout) -> int:
    free = budget.gpu_bytes * budget.gpu_memory_utilization - budget.weight_bytes_per_gpu
    free -= budget.activation_reserve_bytes
    return max(int(free // layout.page_bytes), 0)


def num_host_pages(budget: MemoryBudget, layout: KVLayout) -> int:
    return budget.host_pool_bytes // layout.page_bytes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def request_footprint(layout: KVLayout, num_tokens: int, policy: str, hot_rows: int) -> Footprint:
    """Pages a running request of `num_tokens` tokens needs on GPU and host under `policy`.

    hybrid: indexer pages, a two-page tail and the hot buffer on GPU; every MLA page on host.
    offload / preempt / off: everything on GPU while it runs.
    """
    mla = _ceil_div(num_tokens, layout.page_size)
    idx = _ceil_div(num_tokens, layout.indexer_tokens_per_page)
    if not POLICY_TRAITS[policy].runs_from_host:
        return Footprint(mla + idx, 0)
    tail = min(mla, 2)
    hot = _ceil_div(hot_rows, layout.page_size) if mla > tail else 0
    return Footprint(idx + tail + hot, mla)


def max_concurrent_requests(
    layout: KVLayout, budget: MemoryBudget, num_tokens: int, policy: str, hot_rows: int
) -> int:
    """Requests of `num_tokens` tokens that can run at once (0: not even one fits).

    offload keeps the swapped requests on host, but they do not run: its running
    set is bounded by the GPU alone, like preempt's.
    """
    gpu, host = num_gpu_pages(budget, layout), num_host_pages(budget, layout)
    fp = request_footprint(layout, num_tokens, policy, hot_rows)
    by_gpu = gpu // fp.gpu_pages if fp.gpu_pages else 0
    if not POLICY_TRAITS[policy].runs_from_host:
        return by_gpu
    return min(by_gpu, host // fp.host_pages) if fp.host_pages else by_gpu
