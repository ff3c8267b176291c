"""The indexer's top-K on the GPU at the indexer's real widths (K = 2048 of 8K to 1M scores, a batch of
rows; from 16K the chunked radix select) equals its twin, the stable sort, exactly, and replays in a CUDA
graph."""

from __future__ import annotations

import pytest
import torch

from kernels.topk import topk_positions, topk_positions_ref

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


@pytest.mark.parametrize("width", [8192, 131072])
def test_topk_in_a_cuda_graph(width):
    scores = indexer_like(4, width, seed=1)
    out = torch.empty(4, 2048, dtype=torch.int64, device="cuda")
    topk_positions(scores, 2048, out=out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_positions(scores, 2048, out=out)
    for seed in (2, 3):  # twice: the radix select's per-row counters re-arm themselves
        scores.copy_(indexer_like(4, width, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_positions_ref(scores, 2048))
