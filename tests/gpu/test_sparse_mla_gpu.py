"""Sparse MLA decode on the GPU at GLM-5.3's shapes (Dl = 512, Dr = 64, K = 2048; 8 heads a rank at TP 8, 64 at
TP 1), bf16 queries, fp8 and bf16 rows in a pool laid out by `engine.kv_layout`: the defaults (chosen by the
number of rows: 8 here) and the tile forms they choose among equal the float32 twin, rows of fewer than K
selections and of none included. bf16 dots are wrong under the interpreter, so this is where they are checked."""

from __future__ import annotations

import pytest
import torch

from engine.kv_layout import KVLayout
from kernels.sparse_mla import SparseMLAConfig, sparse_mla, sparse_mla_ref

DL, DR, DI, TOPK, NUM_PAGES = 512, 64, 128, 2048, 512
LENS = [TOPK, TOPK, 100, 0, TOPK - 1, 1, TOPK, 777]


def _case(kv_format: str, heads: int, seed: int):  # noqa: ANN202
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layout = KVLayout(kv_format=kv_format, latent_dim=DL, rope_dim=DR, index_dim=DI, group_sizes=(1, 4),
                      layer_group=(0, 1, 1, 1, 1), layer_pos=(0, 0, 1, 2, 3), num_full_layers=2)
    pool = torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    view = layout.mla_layer_view(pool, 3)
    num = NUM_PAGES * 64
    rows = layout.encode_mla(torch.randn(num, DL, device="cuda", generator=gen),
                             torch.randn(num, DR, device="cuda", generator=gen))
    view.copy_(rows.view(view.shape))
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    slots = torch.randint(0, num, (len(LENS), TOPK), dtype=torch.int32, device="cuda", generator=gen)
    slots[torch.arange(TOPK, device="cuda")[None, :] >= lens[:, None]] = 2**30  # never read
    q = torch.randn(len(LENS), heads, DL + DR, device="cuda", generator=gen).bfloat16()
    return view, q, slots, lens


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("config", [None, SparseMLAConfig(block_k=64, num_warps=8, num_stages=3),
                                    SparseMLAConfig(block_k=32, num_warps=4, num_stages=2, prefetch=True, waves=8),
                                    SparseMLAConfig(block_h=64, block_k=32, num_warps=8, dequant_f32=True)],
                         ids=["default", "k64w8", "k32w4-prefetch", "h64-f32"])
def test_sparse_mla_matches_twin_at_glm_shapes(kv_format: str, heads: int, config: SparseMLAConfig | None) -> None:
    view, q, slots, lens = _case(kv_format, heads, seed=heads + len(kv_format))
    kw = dict(kv_format=kv_format, latent_dim=DL, rope_dim=DR, scale=(DL + DR) ** -0.5 * 4)
    out = torch.full((q.shape[0], heads, DL), float("nan"), device="cuda")
    sparse_mla(q, view, slots, lens, **kw, out=out, config=config)
    ref = sparse_mla_ref(q, view, slots, lens, **kw)
    assert not out.isnan().any()
    assert (out[lens == 0] == 0).all()
    err = ((out - ref).double().norm() / ref.double().norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
