"""The indexer's top-K on the GPU at the indexer's real widths (K = 2048 of 8K to 1M scores, a batch of
rows; the CUDA cluster select, and the Triton kernels it replaced) equals its twin, the stable sort,
exactly, and replays in a CUDA graph; the cluster select on its own in every variant the benchmark times, on
the rows that stress its passes (ties everywhere, -0.0 beside 0.0, negative scores, K = W, a width that is not
a multiple of four) and the unaligned rows it leaves to Triton."""

from __future__ import annotations

import pytest
import torch

from kernels import topk_cuda
from kernels.topk import one_program_warps, radix_topk_positions, topk_positions, topk_positions_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def indexer_like(rows: int, width: int, seed: int) -> torch.Tensor:
    """ReLU-weighted sums: many exact zeros and repeated values, a tail of -inf past each row's length."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(rows, width, generator=gen, device="cuda").clamp_min(0).mul(32).floor().div(32)
    length = torch.randint(width // 2, width + 1, (rows, 1), generator=gen, device="cuda")
    return s.masked_fill(torch.arange(width, device="cuda") >= length, float("-inf"))


@pytest.mark.parametrize("rows, width", [(1, 8192), (8, 12288), (64, 8192), (2, 131072), (8, 20000),
                                         (1, 1 << 20)])
def test_topk_equals_the_stable_sort(rows, width):
    scores = indexer_like(rows, width, seed=rows + width)
    got = topk_positions(scores, 2048)
    assert torch.equal(got, topk_positions_ref(scores, 2048))


@pytest.mark.parametrize("rows, width", [(8, 12288), (64, 16384)])
def test_the_one_program_triton_kernel_equals_the_stable_sort(rows, width):
    scores = indexer_like(rows, width, seed=width)
    got = topk_positions(scores, 2048, num_warps=one_program_warps(width))
    assert torch.equal(got, topk_positions_ref(scores, 2048))


@pytest.mark.parametrize("width", [8192, 131072])
def test_topk_in_a_cuda_graph(width):
    scores = indexer_like(4, width, seed=1)
    out = torch.empty(4, 2048, dtype=torch.int64, device="cuda")
    topk_positions(scores, 2048, out=out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_positions(scores, 2048, out=out)
    for seed in (2, 3):  # twice: a replay leaves nothing behind that the next one reads
        scores.copy_(indexer_like(4, width, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_positions_ref(scores, 2048))


def stressing(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "equal":  # every key ties: the first K positions
        return torch.ones(rows, width, device="cuda")
    if kind == "signed-zeros":  # -0.0 and 0.0 tie; few positives
        s = torch.randn(rows, width, generator=gen, device="cuda")
        s = torch.where(s > 2.5, s, torch.zeros_like(s))
        return torch.where(torch.rand(rows, width, generator=gen, device="cuda") < 0.5, -s.abs() * 0, s)
    if kind == "negative":  # continuous, both signs, a few -inf
        s = torch.randn(rows, width, generator=gen, device="cuda") * 100
        return s.masked_fill(torch.rand(rows, width, generator=gen, device="cuda") < 0.01, float("-inf"))
    return indexer_like(rows, width, seed)


@pytest.mark.parametrize("variant", [topk_cuda.DEFAULT, topk_cuda.Variant(512, 8), topk_cuda.Variant(256, 8),
                                     topk_cuda.Variant(1024, 4), topk_cuda.Variant(1024, 2),
                                     topk_cuda.Variant(list_cap=0), topk_cuda.Variant(list_cap=64)],
                         ids=lambda v: f"{v.threads}x{v.cluster}-list{v.list_cap}")
@pytest.mark.parametrize("kind, rows, width, k", [
    ("indexer", 3, 131072, 2048), ("indexer", 2, 20001, 2048), ("indexer", 1, 1 << 20, 2048),
    ("equal", 2, 65536, 2048), ("signed-zeros", 2, 40000, 2048), ("negative", 4, 131072, 2048),
    ("negative", 2, 17000, 17000), ("indexer", 2, 30000, 1), ("indexer", 1, 4096, 2048),
])
def test_cluster_select_equals_the_stable_sort(variant, kind, rows, width, k):
    padded = torch.empty(rows, (width + 3) // 4 * 4, device="cuda")  # rows 16-byte aligned, as the indexer's
    scores = padded[:, :width]
    scores.copy_(stressing(kind, rows, width, seed=rows * width + k))
    want = topk_positions_ref(scores, k)
    out = torch.full((rows, k), -1, dtype=torch.int64, device="cuda")
    assert topk_cuda.supports(scores, out, variant)
    topk_cuda.launch(scores, k, out, variant)
    assert torch.equal(out, want)
    buf = torch.full((rows, k + 5), -1, dtype=torch.int32, device="cuda")  # int32 into a wider buffer's view
    topk_cuda.launch(scores, k, buf[:, :k], variant)
    assert torch.equal(buf[:, :k].long(), want) and bool((buf[:, k:] == -1).all())


@pytest.mark.parametrize("kind", ["zeros", "-inf"])
def test_the_list_holds_the_special_keys(kind):
    # 256 threads x 2 CTAs: 16 keys a thread at width 8,192 take the list; the K-th key is 0.0 (-0.0 beside it) or
    # -inf, so the list holds the row's special keys, which the first pass counted apart
    gen = torch.Generator(device="cuda").manual_seed(7)
    s = torch.randn(2, 8192, generator=gen, device="cuda")
    rest = torch.where(torch.rand(2, 8192, generator=gen, device="cuda") < 0.5, -0.0, 0.0)
    if kind == "-inf":
        rest = torch.full_like(s, float("-inf"))
    scores = torch.where(s > 2.5, s, rest)
    variant = topk_cuda.Variant(256, 2)
    out = torch.full((2, 2048), -1, dtype=torch.int64, device="cuda")
    assert topk_cuda.supports(scores, out, variant)
    topk_cuda.launch(scores, 2048, out, variant)
    assert torch.equal(out, topk_positions_ref(scores, 2048))


def test_unaligned_rows_take_the_triton_select():
    scores = indexer_like(2, 70001, seed=5)[:, 1:]  # rows start 4 bytes past a 16-byte boundary
    out = torch.empty(2, 2048, dtype=torch.int64, device="cuda")
    assert not topk_cuda.supports(scores, out)
    assert torch.equal(topk_positions(scores, 2048, out=out), topk_positions_ref(scores, 2048))
    assert torch.equal(radix_topk_positions(scores.contiguous(), 2048), out)


@pytest.mark.parametrize("width", [8192, 131072])
def test_limits_write_positions_past_a_row_as_zero(width):
    """A batch scored to its longest request's width: a shorter request's row (-inf past its context, which is
    shorter than K) gets zeros past its limit from the cluster select, the one-program kernel and the radix
    select alike, in an int32 view too, and from a CUDA graph; a row whose limit is the width is untouched."""
    scores = indexer_like(4, width, seed=5)
    lengths = torch.tensor([width, 100, 1, 2047], device="cuda")
    scores = scores.masked_fill(torch.arange(width, device="cuda") >= lengths[:, None], float("-inf"))
    limits = lengths.to(torch.int32)
    want = topk_positions_ref(scores, 2048, limits)
    assert (want[1, 100:] == 0).all() and torch.equal(want[0], topk_positions_ref(scores, 2048)[0])
    assert torch.equal(topk_positions(scores, 2048, limits=limits), want)
    if width <= 16384:
        assert torch.equal(topk_positions(scores, 2048, limits=limits, num_warps=one_program_warps(width)), want)
    assert torch.equal(radix_topk_positions(scores, 2048, limits=limits), want)
    buf = torch.full((4, 2048), -7, dtype=torch.int32, device="cuda")
    assert torch.equal(topk_positions(scores, 2048, out=buf, limits=limits).long(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_positions(scores, 2048, out=buf, limits=limits)
    buf.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf.long(), want)
