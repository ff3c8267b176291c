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


def _cuda_kernel_builds(heads: int = 8) -> bool:
    from kernels import sparse_mla_cuda

    return sparse_mla_cuda.available(torch.device("cuda"), heads)


@pytest.mark.parametrize("heads", [8, 5])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 32])
def test_cuda_kernel_matches_twin(heads: int, num_splits: int | None) -> None:
    """The CUDA kernel (built with the machine's nvcc, which must be there: else this would test Triton) over
    fewer heads than 8 too, with one split (written straight to the output), a few and one per 64 rows."""
    assert _cuda_kernel_builds()
    gen = torch.Generator(device="cuda").manual_seed(heads * 7 + (num_splits or 0))
    assert check_mla("fp8", heads, torch.bfloat16, LENS, gen, SparseMLAConfig(cuda=True, num_splits=num_splits))


@pytest.mark.parametrize("heads", [64, 40, 17])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
def test_64_head_cuda_kernel_matches_twin(heads: int, num_splits: int | None) -> None:
    """The wgmma kernel (sm_90a, built with the machine's nvcc) at 64 heads and at fewer (zero queries for the
    rest, whose outputs must not be written), with one split, a few and one per 32-row tile."""
    assert _cuda_kernel_builds(heads)
    gen = torch.Generator(device="cuda").manual_seed(heads * 5 + (num_splits or 0))
    assert check_mla("fp8", heads, torch.bfloat16, LENS, gen, SparseMLAConfig(cuda=True, num_splits=num_splits))


@pytest.mark.parametrize("heads", [8, 64])
def test_cuda_kernel_bf16_output_and_graph_replay(heads: int) -> None:
    """bf16 output equals the float32 output rounded; a captured launch replays new slots right."""
    from bench.gpu_check_attention import DL, DR, NUM_PAGES, glm_layout
    from kernels import sparse_mla_cuda
    from kernels.sparse_mla import sparse_mla, sparse_mla_ref

    assert _cuda_kernel_builds(heads)
    gen = torch.Generator(device="cuda").manual_seed(3)
    layout = glm_layout("fp8")
    pool = torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    view = layout.mla_layer_view(pool, 3)
    num = NUM_PAGES * 64
    view.copy_(layout.encode_mla(torch.randn(num, DL, device="cuda", generator=gen),
                                 torch.randn(num, DR, device="cuda", generator=gen)).view(view.shape))
    n = 16
    q = torch.randn(n, heads, DL + DR, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randint(0, num, (n, TOPK), dtype=torch.int32, device="cuda", generator=gen)
    lens = torch.randint(1, TOPK + 1, (n,), dtype=torch.int32, device="cuda", generator=gen)
    kw = dict(kv_format="fp8", latent_dim=DL, rope_dim=DR, scale=0.05, config=SparseMLAConfig(cuda=True))
    probe = torch.empty(n, heads, DL, device="cuda")
    assert sparse_mla_cuda.supports(q, view, probe, "fp8", DL, DR)  # else the Triton kernel would be tested here
    full = sparse_mla(q, view, slots, lens, **kw, out_dtype=torch.float32)
    half = sparse_mla(q, view, slots, lens, **kw, out_dtype=torch.bfloat16)
    assert torch.equal(half, full.to(torch.bfloat16))

    out = torch.empty(n, heads, DL, device="cuda", dtype=torch.bfloat16)
    sparse_mla(q, view, slots, lens, **kw, out=out)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla(q, view, slots, lens, **kw, out=out)
    slots.copy_(torch.randint(0, num, (n, TOPK), dtype=torch.int32, device="cuda", generator=gen))
    graph.replay()
    ref = sparse_mla_ref(q, view, slots, lens, **{k: v for k, v in kw.items() if k != "config"})
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
