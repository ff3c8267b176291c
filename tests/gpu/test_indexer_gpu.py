"""Lightning-indexer scoring and top-K on the GPU at GLM-5.3's shapes (32 index heads of 128 dims, K = 2048),
bf16 queries over fp8 and bf16 keys in a pool laid out by `engine.kv_layout`: scores equal the float32 twin
(for fp8 keys the twin quantises the queries per head as the kernel does, and the FP8 x FP8 product on the
tensor cores is checked here: the interpreter decodes e4m3 before its dot), -inf exactly where a position is not
visible, and the selection holds the K largest (`bench/gpu_check_attention.check_indexer`)."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check_attention import check_indexer
from kernels.indexer import IndexerConfig


CASES = [("fp8", None), ("bf16", None), ("fp8", IndexerConfig(block_t=64, prefetch=True)),
         ("bf16", IndexerConfig(block_t=64, prefetch=True)),
         ("fp8", IndexerConfig(block_t=128, num_warps=8, num_stages=3))]  # a bf16 page holds 704 keys: no 128-key tiles


@pytest.mark.parametrize("kv_format, config", CASES, ids=["fp8", "bf16", "fp8-t64-prefetch", "bf16-t64-prefetch",
                                                          "fp8-t128w8"])
@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
def test_indexer_matches_twin_at_glm_shapes(kv_format: str, config: IndexerConfig | None, extend: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7 + extend + len(kv_format))
    assert check_indexer(kv_format, extend, gen, config)
