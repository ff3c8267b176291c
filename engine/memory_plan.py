"""Memory planning: how many KV pages a GPU and a host pool hold, and how many requests fit.

The engine sizes its GPU pool with `num_gpu_pages`; the concurrency calculator
(`notebooks/concurrency.ipynb`) asks `max_concurrent_requests` the same
question per policy. The MLA latent and indexer caches are replicated on every
tensor-parallel rank, so one GPU's budget bounds the whole replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig

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


def weight_bytes(cfg: ModelConfig, bytes_per_param: float) -> int:
    """Bytes of the checkpoint's parameters (MTP layers excluded), from the config's shapes."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attention = (
        h * cfg.q_lora_rank
        + cfg.q_lora_rank * heads * cfg.qk_head_dim
        + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + heads * cfg.v_head_dim * h
    )
    indexer = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim + h * cfg.index_n_heads
    dense = 3 * h * cfg.intermediate_size
    moe = (cfg.n_routed_experts + cfg.n_shared_experts) * 3 * h * cfg.moe_intermediate_size + cfg.n_routed_experts * h
    total = 2 * cfg.vocab_size * h
    for layer in range(cfg.num_hidden_layers):
        total += attention + (indexer if cfg.indexer_types[layer] == "full" else 0)
        total += moe if cfg.is_moe_layer(layer) else dense
    return int(total * bytes_per_param)


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
    if policy != "hybrid":
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
    if policy != "hybrid":
        return by_gpu
    return min(by_gpu, host // fp.host_pages) if fp.host_pages else by_gpu
