"""Which parameters are split across tensor-parallel ranks, and along which dimension.

Split (weights are `[out_features, in_features]`):

- attention heads: `q_b_proj` and `kv_b_proj` by output rows (whole heads per
  rank), `o_proj` by input columns; the rank's partial output is summed by the
  all-reduce after attention. The latent path (`q_a_proj`, `kv_a_proj_with_mqa`
  and their norms) is replicated: every rank writes the same latent rows, so
  the KV pool is a replica and page ids mean the same on every rank.
- MLPs, the shared expert and every routed expert: `gate_proj` / `up_proj` by
  output rows, `down_proj` by input columns; one all-reduce after the MLP block
  sums routed and shared partials together. Routed experts are tensor parallel,
  not expert parallel: each rank does 1/size of every selected expert, so its
  share of the work does not depend on where the router sends tokens (with
  expert parallelism the slowest rank sets every step's pace, and at decode
  batches a few hot experts on one rank are the common case). GLM-5.3's
  2048-wide experts split 8 ways stay a multiple of the 128-wide FP8 blocks.
- `lm_head` by output rows (vocabulary): each rank computes its part of the
  logits and one gather gives every rank all of them, so every rank samples the
  same tokens as before. Replicated, every rank read all 154880 x 6144 bf16
  (1.9 GB) each decode step, about 0.45 ms at the H200's HBM bandwidth, more
  than five decoder layers at batch 1; split 8 ways it reads 0.24 GB and
  gathers B x 154880 float32 logits (0.6 MB at B = 1).

Replicated:

- the indexer. Its one key per token is shared by all indexer heads, so
  splitting the heads would not cut the key reads that bound decode scoring
  (132 B per cached token on every rank either way), while summing the per-head
  scores across ranks before top-K all-reduces one float per cached token per
  query row per full layer: at GLM-5.3 shape, 64 decode rows over 128K tokens,
  21 x 32 MiB per step, about 5.7 times the 2 x 78 hidden-state all-reduces of
  the whole model (~120 MB), and n x context floats per chunk at prefill. The
  price of replication is the indexer's weights (~0.4 GB bf16 per rank) and
  its query projection and score FLOPs done on every rank. Replicated, every
  rank selects the same top-K with no communication, which the replicated
  hot-buffer tables rely on;
- the router, the norms and the embedding (a row lookup per token: split, it
  would add an all-reduce and save nothing a step reads).
"""

from __future__ import annotations

import re

from engine.model_config import ModelConfig

_FP8_BLOCK = 128  # rows and columns of one FP8 weight scale block

_ROW_SPLIT = re.compile(
    r"\.self_attn\.(q_b_proj|kv_b_proj)\.weight$|\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj)\.weight$"
    r"|^lm_head\.weight$"
)
_COLUMN_SPLIT = re.compile(r"\.self_attn\.o_proj\.weight$|\.mlp\.(experts\.\d+\.|shared_experts\.)?down_proj\.weight$")


def shard_dim(name: str) -> int | None:
    """Dimension along which parameter `name` is split (0 rows, 1 columns), None if replicated."""
    if _ROW_SPLIT.search(name):
        return 0
    if _COLUMN_SPLIT.search(name):
        return 1
    return None


def check_shardable(cfg: ModelConfig, size: int, fp8: bool = False) -> None:
    """Raises ValueError naming the first dimension that `size` ranks cannot split evenly, or, with FP8
    weights, whose per-rank part does not lie on 128-wide scale blocks (a block would straddle two ranks)."""
    dims = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    for what, n in dims.items():
        if n % size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    if not fp8 or size == 1:  # one rank reads whole tensors: partial edge blocks are fine
        return
    heads = cfg.num_attention_heads // size
    per_rank = {
        "q_b_proj rows (heads x qk_head_dim)": heads * cfg.qk_head_dim,
        "o_proj columns (heads x v_head_dim)": heads * cfg.v_head_dim,
        "intermediate_size": cfg.intermediate_size // size,
        "moe_intermediate_size": cfg.moe_intermediate_size // size,
    }
    for what, n in per_rank.items():
        if n % _FP8_BLOCK:
            raise ValueError(f"FP8 weights at tensor_parallel_size={size}: each rank's {what} is {n}, not a "
                             f"multiple of {_FP8_BLOCK}; use a smaller size or --quantization none")
