"""Sparse MLA attention and indexer kernels against their PyTorch twins.

Runs the Triton kernels under the interpreter (TRITON_INTERPRET=1, set before
triton is imported) on small shapes; KV rows live in real page pools built by
`engine.kv_layout`, surrounded by random bytes so that wrong addressing shows.
Inputs are fresh random draws; outputs are poisoned with NaN before each launch
and every element is compared. fp32 and fp16 queries only: the interpreter's
bf16 `tl.dot` is not trustworthy. Triton fixes interpreter mode at its first
import, so nothing may import it earlier (a conftest that does makes every test
here fail with a message saying so). The GPU run of the same checks at GLM-5.3
shapes is `bench/gpu_check_attention.py`.
"""

from __future__ import annotations

import os
import zlib

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from kernels.indexer import (  # noqa: E402
    IndexerConfig, IndexerKeys, indexer_scores, indexer_scores_ref, indexer_topk, indexer_topk_ref,
)
from kernels.sparse_mla import SparseMLAConfig, sparse_mla, sparse_mla_ref  # noqa: E402

DL, DR, DI = 256, 64, 64


@pytest.fixture(autouse=True)
def _interpreter_active():
    """Triton decides interpreter mode when it is imported: if a conftest imported it first, say so."""
    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (a conftest or plugin imported it "
                    "first); set it before any import, e.g. `TRITON_INTERPRET=1 pytest ...`")
NUM_PAGES = 6
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def make_layout(kv_format: str) -> KVLayout:
    """Two IndexShare groups {0}, {1, 2, 3}: layer 2 is a shared layer in the middle of a group."""
    return KVLayout(kv_format=kv_format, latent_dim=DL, rope_dim=DR, index_dim=DI, group_sizes=(1, 3),
                    layer_group=(0, 1, 1, 1), layer_pos=(0, 0, 1, 2), num_full_layers=2)


def make_pool(layout: KVLayout, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8, generator=gen)


def fill_mla(layout: KVLayout, pool: torch.Tensor, layer: int, gen: torch.Generator) -> torch.Tensor:
    view = layout.mla_layer_view(pool, layer)
    num = view.shape[0] * view.shape[1]
    latent = torch.randn(num, DL, generator=gen)
    rope = torch.randn(num, DR, generator=gen)
    view.copy_(layout.encode_mla(latent, rope).view(view.shape))
    return view


def fill_indexer(layout: KVLayout, pool: torch.Tensor, full_index: int, gen: torch.Generator) -> IndexerKeys:
    view = layout.indexer_layer_view(pool, full_index)
    pages, tokens = view.values.shape[:2]
    slots = torch.arange(pages * tokens)
    view.store(slots // tokens, slots % tokens, layout.encode_indexer(torch.randn(pages * tokens, DI, generator=gen)))
    return view


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not out.isnan().any(), "unwritten (NaN) output elements"
    same_inf = torch.isinf(out) == torch.isinf(ref)
    assert same_inf.all(), "-inf pattern differs"
    fin = ~torch.isinf(ref)
    err = (out[fin].double() - ref[fin].double()).abs().max().item() if fin.any() else 0.0
    assert err <= tol * max(1.0, ref[fin].abs().max().item() if fin.any() else 1.0), f"max abs error {err}"


# --- sparse MLA --------------------------------------------------------------------------


def _mla_case(kv_format, dtype, seed, num_heads=4, k=48, lens=(48, 17, 0, 5, 33)):
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(kv_format)
    pool = make_pool(layout, gen)
    view = fill_mla(layout, pool, 2, gen)
    n = len(lens)
    slots = torch.randint(0, NUM_PAGES * 64, (n, k), dtype=torch.int32, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    beyond = torch.arange(k)[None, :] >= lens_t[:, None]
    slots[beyond] = 2**30  # entries past lens must never be read
    q = torch.randn(n, num_heads, DL + DR, generator=gen).to(dtype)
    return view, q, slots, lens_t


@pytest.mark.parametrize("kv_format", ["fp8", "float32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits, prefetch", [(1, False), (3, False), (1, True), (2, True)])
def test_sparse_mla_matches_twin(kv_format, dtype, num_splits, prefetch):
    view, q, slots, lens = _mla_case(kv_format, dtype, seed=zlib.crc32(f"{kv_format}{dtype}{num_splits}".encode()))
    kw = dict(kv_format=kv_format, latent_dim=DL, rope_dim=DR, scale=0.07)
    out = torch.full((q.shape[0], q.shape[1], DL), float("nan"))
    sparse_mla(q, view, slots, lens, **kw, config=SparseMLAConfig(block_k=16, num_splits=num_splits, prefetch=prefetch), out=out)
    ref = sparse_mla_ref(q, view, slots, lens, **kw)
    assert_close(out, ref, TOL[dtype])
    assert (out[2] == 0).all(), "lens 0 must give zeros"


@pytest.mark.parametrize("dequant_f32", [False, True])
def test_sparse_mla_head_blocks_and_out_dtype(dequant_f32):
    view, q, slots, lens = _mla_case("fp8", torch.float16, seed=7, num_heads=20, k=40, lens=(40, 1, 39))
    kw = dict(kv_format="fp8", latent_dim=DL, rope_dim=DR, scale=0.05)
    out = sparse_mla(q, view, slots, lens, **kw, out_dtype=torch.float16,
                     config=SparseMLAConfig(block_h=16, block_k=16, num_splits=2, dequant_f32=dequant_f32))
    assert out.dtype == torch.float16
    assert_close(out.float(), sparse_mla_ref(q, view, slots, lens, **kw), 2e-2)


def test_sparse_mla_rejects_bad_inputs():
    view, q, slots, lens = _mla_case("fp8", torch.float32, seed=3)
    kw = dict(latent_dim=DL, rope_dim=DR, scale=0.1)
    with pytest.raises(ValueError):
        sparse_mla(q, view, slots.long(), lens, kv_format="fp8", **kw)
    with pytest.raises(ValueError):
        sparse_mla(q, view, slots, lens, kv_format="bf16", **kw)  # row bytes do not match
    with pytest.raises(ValueError):
        sparse_mla(q[:, :, :DL], view, slots, lens, kv_format="fp8", **kw)


# --- indexer -----------------------------------------------------------------------------


def _indexer_case(kv_format, dtype, seed, num_heads=4):
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(kv_format)
    pool = make_pool(layout, gen)
    view = fill_indexer(layout, pool, 1, gen)
    tokens = view.tokens_per_page
    max_pages = 3
    # Two requests with shuffled physical pages; request 1 has an extend chunk of three rows.
    table = torch.stack([torch.randperm(NUM_PAGES, generator=gen)[:max_pages] for _ in range(2)]).to(torch.int32)
    ctx = 2 * tokens + 37
    row_to_req = torch.tensor([0, 1, 1, 1, 0], dtype=torch.int32)
    ctx_lens = torch.tensor([tokens + 5, ctx, ctx, ctx, 0], dtype=torch.int32)
    limits = torch.tensor([tokens + 5, ctx - 2, ctx, 30, 0], dtype=torch.int32)
    n = len(row_to_req)
    q = torch.randn(n, num_heads, DI, generator=gen).to(dtype)
    weights = torch.randn(n, num_heads, generator=gen)
    return view, q, weights, table, row_to_req, ctx_lens, limits


@pytest.mark.parametrize("kv_format", ["fp8", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefetch", [False, True])
def test_indexer_matches_twin(kv_format, dtype, prefetch):
    view, q, w, table, r2r, ctx, lim = _indexer_case(kv_format, dtype, seed=11 + len(kv_format) + dtype.itemsize)
    kw = dict(kv_format=kv_format, scale=0.125, topk=48)
    width = table.shape[1] * view.tokens_per_page
    scores = torch.full((q.shape[0], width), float("nan"))
    indexer_scores(q, w, view, table, r2r, ctx, lim, **kw, config=IndexerConfig(tiles=3, prefetch=prefetch), out=scores)
    ref = indexer_scores_ref(q, w, view, table, r2r, ctx, lim, **kw)
    assert_close(scores, ref, TOL[dtype])

    got = indexer_topk(q, w, view, table, r2r, ctx, lim, **kw)
    want = indexer_topk_ref(q, w, view, table, r2r, ctx, lim, **kw)
    assert torch.equal(got.counts, want.counts)
    assert got.counts.tolist() == [48, 48, 48, 30, 0]
    for i, c in enumerate(got.counts.tolist()):
        pos = got.positions[i, :c].long()
        assert pos.unique().numel() == c and (pos < torch.minimum(ctx[i], lim[i])).all()
        # exactly the c largest: the twin's scores at our picks are its c largest values
        picked = ref[i, pos].sort().values
        best = ref[i].topk(c).values.sort().values if c else picked
        assert torch.allclose(picked, best, atol=TOL[dtype] * max(1.0, best.abs().max().item() if c else 1.0))


def test_indexer_short_context_and_small_scores_buffer():
    view, q, w, table, r2r, ctx, lim = _indexer_case("fp8", torch.float32, seed=5)
    tokens = view.tokens_per_page
    kw = dict(kv_format="fp8", scale=0.1, topk=tokens + 64, max_ctx=tokens)  # K larger than max_ctx
    got = indexer_topk(q, w, view, table, r2r, ctx, lim, **kw)
    assert got.positions.shape == (q.shape[0], tokens + 64)
    assert got.counts.tolist() == [tokens, tokens, tokens, 30, 0]
    assert torch.equal(got.positions[0, :tokens].sort().values, torch.arange(tokens, dtype=torch.int32))
    scores = indexer_scores(q, w, view, table, r2r, ctx, lim, **kw)
    assert_close(scores, indexer_scores_ref(q, w, view, table, r2r, ctx, lim, **kw), 1e-4)
    odd = dict(kw, topk=tokens + 1)  # a width of no multiple of four still gets 16-byte aligned rows
    scores = indexer_scores(q, w, view, table, r2r, ctx, lim, **odd)
    assert scores.shape[1] == tokens + 1 and scores.stride(0) % 4 == 0
    assert_close(scores, indexer_scores_ref(q, w, view, table, r2r, ctx, lim, **odd), 1e-4)


def test_indexer_rejects_bad_inputs():
    view, q, w, table, r2r, ctx, lim = _indexer_case("fp8", torch.float32, seed=2)
    kw = dict(scale=0.1, topk=16)
    with pytest.raises(ValueError):
        indexer_topk(q, w, view, table.long(), r2r, ctx, lim, kv_format="fp8", **kw)
    with pytest.raises(ValueError):
        indexer_topk(q, w, view, table, r2r, ctx, lim, kv_format="float32", **kw)
    with pytest.raises(ValueError):
        indexer_topk(q, w.double(), view, table, r2r, ctx, lim, kv_format="fp8", **kw)
    with pytest.raises(ValueError, match="IndexerKeys"):
        indexer_topk(q, w, view.values, table, r2r, ctx, lim, kv_format="fp8", **kw)
    with pytest.raises(ValueError, match="scales"):
        indexer_topk(q, w, IndexerKeys(view.values, None), table, r2r, ctx, lim, kv_format="fp8", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_indexer_reads_fp8_values_and_scales_where_the_page_holds_them(dtype):
    """FP8 keys written byte by byte where a full layer's block keeps them (token t's e4m3 values at
    block + t * Di, its fp32 scale at block + T * Di + 4 t): kernel and twin score exactly those keys."""
    gen = torch.Generator().manual_seed(23)
    layout = make_layout("fp8")
    pool = make_pool(layout, gen)
    tokens, block = layout.indexer_tokens_per_page, layout.indexer_block_offset(1)
    assert block == tokens * (DI + 4) and block % 16 == 0 and layout.page_bytes % 16 == 0
    values = torch.randint(-6, 7, (NUM_PAGES, tokens, DI), generator=gen).float()  # exact in e4m3
    scales = torch.rand(NUM_PAGES, tokens, generator=gen) + 0.5
    pool[:, block : block + tokens * DI] = values.to(torch.float8_e4m3fn).view(torch.uint8).reshape(NUM_PAGES, -1)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(NUM_PAGES, -1)
    pool[:, block + tokens * DI : block + tokens * (DI + 4)] = scale_bytes
    view = layout.indexer_layer_view(pool, 1)
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    ctx = torch.tensor([3 * tokens - 9, 2 * tokens + 1], dtype=torch.int32)
    r2r, lim = torch.zeros(2, dtype=torch.int32), ctx.clone()
    q = torch.randint(-2, 3, (2, 4, DI), generator=gen).to(dtype)
    w = torch.randint(-4, 5, (2, 4), generator=gen) / 4
    kw = dict(kv_format="fp8", scale=0.125, topk=16)
    keys = (values * scales[..., None])[table[0].long()].reshape(-1, DI)  # the request's keys in position order
    want = (torch.relu(torch.einsum("nhd,pd->nhp", q.float(), keys) * 0.125) * w[:, :, None]).sum(1)
    want = want.masked_fill(torch.arange(keys.shape[0])[None, :] >= ctx[:, None], float("-inf"))
    assert_close(indexer_scores_ref(q, w, view, table, r2r, ctx, lim, **kw), want, 1e-5)
    assert_close(indexer_scores(q, w, view, table, r2r, ctx, lim, **kw, config=IndexerConfig(tiles=2)), want,
                 TOL[dtype])
