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


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
@pytest.mark.parametrize("config", [None, IndexerConfig(block_t=64, prefetch=True),
                                    IndexerConfig(block_t=128, num_warps=8, num_stages=3)],
                         ids=["default", "t64-prefetch", "t128w8"])
def test_indexer_matches_twin_at_glm_shapes(kv_format: str, extend: bool, config: IndexerConfig | None) -> None:
    if config is not None and config.block_t == 128 and kv_format == "bf16":
        pytest.skip("a bf16 indexer page holds 704 keys: 128-key tiles do not divide it")
    gen = torch.Generator(device="cuda").manual_seed(7 + extend + len(kv_format))
    assert check_indexer(kv_format, extend, gen, config)
