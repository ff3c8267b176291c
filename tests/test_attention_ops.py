"""The GPU attention ops equal the PyTorch ops on the engine's own page layout (Triton interpreter on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import triton_ops
from engine.attention_ops import TorchAttentionOps
from engine.forward_batch import ForwardBatch
from engine.kv_layout import KVLayout
from engine.layers import rotate
from engine.model_config import ModelConfig
from engine.tiny import TINY_CONFIG
from engine.triton_ops import TritonAttentionOps
from kernels import fp8_rows
from kernels.fp8_pack import KeyPrep
from kernels.indexer import IndexerKeys

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


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


def _indexer_batch(layout: KVLayout, gen: torch.Generator) -> tuple[IndexerKeys, ForwardBatch]:
    """A page pool of random bytes and a batch of four requests over shuffled indexer pages.

    Contexts: 20 (shorter than top-K, one decode row), two pages (an extend chunk of four rows), 52 (an
    extend chunk whose first rows see fewer positions than top-K), three pages (one decode row). Keys are
    small integers (amax 7, so FP8 rows decode exactly) with zero and repeated rows: scores are exact in
    both implementations and ReLU-zero and repeated-key ties are common, so only tie-breaking can differ.
    """
    tokens = layout.indexer_tokens_per_page
    contexts = [20, tokens + 90, 52, 2 * tokens + 5]
    row_positions = [[19], list(range(contexts[1] - 4, contexts[1])), list(range(40, 52)), [contexts[3] - 1]]
    pool = torch.randint(0, 256, (10, layout.page_bytes), dtype=torch.uint8, generator=gen)
    view = layout.indexer_layer_view(pool, 1)
    pages = torch.randperm(10, generator=gen).tolist()
    table = torch.zeros(len(contexts), 3, dtype=torch.long)
    for req, ctx in enumerate(contexts):
        own = [pages.pop() for _ in range(-(-ctx // tokens))]
        table[req, : len(own)] = torch.tensor(own)
        keys = torch.randint(-6, 7, (ctx, layout.index_dim), generator=gen).float()
        keys[:, 0] = 7.0
        keys[::5] = 0.0
        keys[3::7] = keys[1]
        pos = torch.arange(ctx)
        slots = table[req, pos // tokens] * tokens + pos % tokens
        view.store(slots // tokens, slots % tokens, layout.encode_indexer(keys))
    ranges, start = [], 0
    for rows in row_positions:
        ranges.append((start, start + len(rows)))
        start += len(rows)
    positions = torch.tensor([p for rows in row_positions for p in rows])
    req_of_row = torch.tensor([req for req, rows in enumerate(row_positions) for _ in rows])
    unused = torch.zeros_like(positions)
    batch = ForwardBatch(
        input_ids=unused, positions=positions, req_of_row=req_of_row, mla_write_slots=unused,
        indexer_write_slots=unused, mla_page_table=torch.zeros(len(contexts), 1, dtype=torch.long),
        indexer_page_table=table, context_lens=torch.tensor(contexts), logits_rows=unused, row_ranges=ranges,
        context_lens_host=contexts, request_ids=[f"r{i}" for i in range(len(contexts))],
        max_context=max(contexts), page_size=layout.page_size, indexer_tokens_per_page=tokens,
    )
    return view, batch


@pytest.mark.parametrize("kv_format", ["float32", "fp8"])
def test_triton_indexer_topk_equals_torch_ops(kv_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448))
    layout = KVLayout.for_model(cfg, kv_format)
    gen = torch.Generator().manual_seed(3)
    view, batch = _indexer_batch(layout, gen)
    q = torch.randint(-2, 3, (batch.num_rows, cfg.index_n_heads, cfg.index_head_dim), generator=gen).float()
    weights = torch.randint(-4, 5, (batch.num_rows, cfg.index_n_heads), generator=gen) / 4
    topk = 48
    args = (q, weights, view, batch, topk, 0.25, 1)
    expected = TorchAttentionOps(layout).indexer_topk(*args)
    got = TritonAttentionOps(layout).indexer_topk(*args)
    assert got.positions.shape == (batch.num_rows, topk)
    assert torch.equal(got.counts, torch.clamp(batch.positions + 1, max=topk))
    assert torch.equal(got.counts, expected.counts)
    assert torch.equal(got.positions, expected.positions)
    # Seven rows per launch (chunks cross requests) select what one launch for the whole batch selects.
    monkeypatch.setattr(triton_ops, "_SCORE_ELEMENTS", 7 * max(batch.context_lens_host))
    chunked = TritonAttentionOps(layout).indexer_topk(*args)
    assert torch.equal(chunked.positions, got.positions) and torch.equal(chunked.counts, got.counts)
    # The rows' limits made at a step's first full layer serve the next ones (`StepContext.derived`).
    derived: dict[str, object] = {}
    for _ in range(2):
        again = TritonAttentionOps(layout).indexer_topk(*args, derived)
        assert torch.equal(again.positions, got.positions) and torch.equal(again.counts, got.counts)
    assert set(derived) == {"indexer_rows"}


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_triton_row_writes_store_the_same_bytes_as_torch_ops(kv_format: str) -> None:
    """New rows land at their slots of the right layer: every byte of the pool equals the PyTorch path's."""
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448))
    layout = KVLayout.for_model(cfg, kv_format)
    gen = torch.Generator().manual_seed(4)
    pool = torch.randint(0, 255, (5, layout.page_bytes), dtype=torch.uint8, generator=gen)
    expected, got = pool.clone(), pool.clone()
    slots = torch.randperm(5 * 64, generator=gen)[:37]
    latent, rope = torch.randn(37, 128, generator=gen), torch.randn(37, 16, generator=gen)
    per_page = layout.indexer_tokens_per_page
    key_slots = torch.randperm(5 * per_page, generator=gen)[:37]
    keys = torch.randn(37, 32, generator=gen)
    for ops, target in ((TorchAttentionOps(layout), expected), (TritonAttentionOps(layout), got)):
        ops.write_mla_rows(target, 3, slots, latent, rope)  # a shared layer in the middle of a group
        ops.write_indexer_rows(target, 1, key_slots, keys)
    assert torch.equal(got, expected)
    assert not torch.equal(got, pool)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_indexer_row_writes_normalise_and_rotate_raw_keys(kv_format: str) -> None:
    """With a KeyPrep both ops store LayerNorm-then-rotated keys (the Indexer's former two steps before the
    write); the FP8 packing launch does them itself, to within one e4m3 step of the PyTorch path."""
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448))
    layout = KVLayout.for_model(cfg, kv_format)
    gen = torch.Generator().manual_seed(6)
    n, dim, rope_dim = 19, cfg.index_head_dim, cfg.qk_rope_head_dim
    pool = torch.zeros((5, layout.page_bytes), dtype=torch.uint8)
    per_page = layout.indexer_tokens_per_page
    slots = torch.randperm(5 * per_page, generator=gen)[:n]
    raw = torch.randn(n, dim + 8, generator=gen)[:, 4 : 4 + dim] * 2 + 0.3
    angles = torch.rand(n, rope_dim // 2, generator=gen) * 6
    prep = KeyPrep(torch.rand(dim, generator=gen) + 0.5, torch.randn(dim, generator=gen) * 0.1, 1e-6,
                   angles.cos(), angles.sin(), rope_dim, True)
    want_keys = rotate(F.layer_norm(raw, (dim,), prep.norm_weight, prep.norm_bias, 1e-6), prep.cos, prep.sin,
                       rope_dim, True)
    view = lambda p: layout.indexer_layer_view(p, 1)  # noqa: E731
    decoded = {}
    for name, ops in (("torch", TorchAttentionOps(layout)), ("triton", TritonAttentionOps(layout))):
        got = pool.clone()
        ops.write_indexer_rows(got, 1, slots, raw, prep)
        decoded[name] = layout.decode_indexer(view(got).rows(slots // per_page, slots % per_page), torch.float32)
    reference = layout.decode_indexer(layout.encode_indexer(want_keys), torch.float32)
    assert torch.equal(decoded["torch"], reference)
    step = reference.abs().amax(dim=1, keepdim=True) / 448 * 32 if kv_format == "fp8" else 1e-6
    assert ((decoded["triton"] - reference).abs() <= step).all()


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_indexer_keys_land_where_the_layout_says(kv_format: str) -> None:
    """At GLM-5.3's shape: an FP8 key's 128 values at block + t * 128 (16-byte aligned), its fp32 scale at
    block + T * 128 + 4 t, block = f * T * 132; a bf16 key one 256-byte row at block + t * 256. Both ops write
    exactly those bytes, tokens per page and page bytes are the row layout's."""
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / "models" / "glm-5.3" / "config.json").read_text()))
    layout = KVLayout.for_model(cfg, kv_format)
    tokens, full = layout.indexer_tokens_per_page, layout.num_full_layers
    key_bytes = 132 if kv_format == "fp8" else 256
    assert layout.indexer_key_bytes == key_bytes
    assert tokens == layout.page_bytes // (full * key_bytes) // 64 * 64 and tokens % 64 == 0
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 256, (3, layout.page_bytes), dtype=torch.uint8, generator=gen)
    slots = torch.tensor([0, 5, tokens - 1, tokens + 7, 3 * tokens - 1])
    keys = torch.randn(len(slots), 128, generator=gen)
    f = full - 1
    block = f * tokens * key_bytes
    expected = pool.clone()
    for slot, key in zip(slots.tolist(), keys):
        page, t = divmod(slot, tokens)
        if kv_format == "fp8":
            packed = fp8_rows.pack_indexer_rows(key[None])[0]
            values, scale = block + t * 128, block + tokens * 128 + 4 * t
            assert values % 16 == 0 and layout.page_bytes % 16 == 0
            expected[page, values : values + 128] = packed[:128]
            expected[page, scale : scale + 4] = packed[128:]
        else:
            expected[page, block + t * 256 : block + (t + 1) * 256] = key.bfloat16().view(torch.uint8)
    for ops in (TorchAttentionOps(layout), TritonAttentionOps(layout)):
        got = pool.clone()
        ops.write_indexer_rows(got, f, slots, keys)
        assert torch.equal(got, expected)
        view = layout.indexer_layer_view(got, f)
        torch.testing.assert_close(layout.decode_indexer(view.rows(slots // tokens, slots % tokens), torch.float32),
                                   layout.decode_indexer(layout.encode_indexer(keys), torch.float32))
