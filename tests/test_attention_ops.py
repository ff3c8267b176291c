"""The GPU attention ops equal the PyTorch ops on the engine's own page layout (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.attention_ops import TorchAttentionOps
from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig
from engine.tiny import TINY_CONFIG
from engine.triton_ops import TritonAttentionOps


@pytest.mark.parametrize("kv_format", ["float32", "fp8"])
def test_triton_sparse_mla_equals_torch_ops(kv_format: str) -> None:
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448))
    layout = KVLayout.for_model(cfg, kv_format)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 255, (6, layout.page_bytes), dtype=torch.uint8, generator=gen)
    view = layout.mla_layer_view(pool, 3)  # a shared layer in the middle of a group
    slots_all = torch.arange(6 * 64)
    view[slots_all // 64, slots_all % 64] = layout.encode_mla(torch.randn(384, 128, generator=gen),
                                                              torch.randn(384, 16, generator=gen))
    q = torch.randn(3, 4, 144, generator=gen)
    slots = torch.randint(0, 384, (3, 32), generator=gen)
    lens = torch.tensor([32, 10, 0])
    expected = TorchAttentionOps(layout).sparse_mla(q, view, slots, lens, 0.1)
    got = TritonAttentionOps(layout).sparse_mla(q, view, slots, lens, 0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
