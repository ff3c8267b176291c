"""Sparse MLA decode on the GPU at GLM-5.3's shapes (Dl = 512, Dr = 64, K = 2048; 8 heads a rank at TP 8, 64 at
TP 1), bf16 queries, fp8 and bf16 rows in a pool laid out by `engine.kv_layout`: the defaults (chosen by the
number of rows: 8 here) and the tile forms they choose among equal the float32 twin, rows of fewer than K
selections and of none included (`bench/gpu_check_attention.check_mla`, whose NaN-poisoned output must be
written everywhere). bf16 dots are wrong under the interpreter, so this is where they are checked."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check_attention import TOPK, check_mla
from kernels.sparse_mla import SparseMLAConfig

LENS = [TOPK, TOPK, 100, 0, TOPK - 1, 1, TOPK, 777]


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("config", [None, SparseMLAConfig(block_k=64, num_warps=8, num_stages=3),
                                    SparseMLAConfig(block_k=32, num_warps=4, num_stages=2, prefetch=True, waves=8),
                                    SparseMLAConfig(block_h=64, block_k=32, num_warps=8, dequant_f32=True)],
                         ids=["default", "k64w8", "k32w4-prefetch", "h64-f32"])
def test_sparse_mla_matches_twin_at_glm_shapes(kv_format: str, heads: int, config: SparseMLAConfig | None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(heads + len(kv_format))
    assert check_mla(kv_format, heads, torch.bfloat16, LENS, gen, config)
