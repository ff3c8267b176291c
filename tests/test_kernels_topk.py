"""The indexer's top-K kernel (`kernels.topk`) against its twin (a stable descending sort).

Runs under the interpreter (TRITON_INTERPRET=1, set before triton is imported)
on rows shaped like the indexer's scores: ReLU-weighted sums with many exact
ties (0.0 and -0.0, repeated values), -inf past a row's visible length, widths
that are not powers of two, K from 1 to the whole row, and rows too wide for
one program (the chunked radix select, also run at small widths through small
chunks). The positions must equal the twin's exactly: the set a stable sort
chooses, in ascending position order. The GPU run at the indexer's real widths
is tests/gpu/test_topk_gpu.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.topk import MAX_KERNEL_WIDTH, radix_topk_positions, topk_positions, topk_positions_ref  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_active():
    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; set it before any import")


def indexer_like(rows: int, width: int, seed: int) -> torch.Tensor:
    """Scores with the indexer's features: a third exact zeros (some -0.0), values repeated from a small
    set, a few large ones, -inf past each row's visible length (row 0 sees everything)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(-4, 9, (rows, width), generator=gen).float() / 4
    s = torch.where(s < 0, torch.zeros_like(s), s)
    s[torch.rand(rows, width, generator=gen) < 0.1] = -0.0
    s += (torch.rand(rows, width, generator=gen) < 0.05) * torch.randn(rows, width, generator=gen) * 100
    visible = torch.randint(1, width + 1, (rows,), generator=gen)
    visible[0] = width
    s[torch.arange(width)[None, :] >= visible[:, None]] = float("-inf")
    return s


@pytest.mark.parametrize("rows, width, k", [
    (3, 300, 64),
    (2, 5000, 2048),
    (4, 130, 130),  # K = the whole row
    (2, 77, 1),
])
def test_topk_matches_stable_sort(rows, width, k):
    scores = indexer_like(rows, width, seed=rows * width + k)
    got = topk_positions(scores, k)
    want = topk_positions_ref(scores, k)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_topk_signed_values_and_int32_out():
    """Negative scores (a negative head weight), -0.0 against 0.0, a row of -inf only; into a view."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 600, generator=gen)
    scores[1, ::3] = -0.0
    scores[1, 1::3] = 0.0
    scores[2] = float("-inf")
    buf = torch.full((3, 40), -7, dtype=torch.int32)
    out = topk_positions(scores, 32, out=buf[:, :32])
    assert torch.equal(out.long(), topk_positions_ref(scores, 32))
    assert torch.equal(out[2], torch.arange(32, dtype=torch.int32)), "all -inf: the first K positions"
    assert (buf[:, 32:] == -7).all(), "nothing written past K"


@pytest.mark.parametrize("num_warps", [1, 8])
def test_topk_warps(num_warps):
    scores = indexer_like(3, 1500, seed=9)
    assert torch.equal(topk_positions(scores, 200, num_warps=num_warps), topk_positions_ref(scores, 200))


@pytest.mark.parametrize("rows, width, k, chunk", [
    (3, 300, 64, 32),  # 10 chunks, the last one partial
    (2, 1000, 1000, 64),  # K = the whole row
    (4, 257, 1, 16),
    (3, 700, 300, 16),  # 44 chunks, K larger than a chunk
    (2, 5000, 2048, 256),
])
def test_radix_select_matches_stable_sort(rows, width, k, chunk):
    """The chunked radix select (wide rows) at small widths through small chunks: the same positions."""
    scores = indexer_like(rows, width, seed=rows * width + k)
    assert torch.equal(radix_topk_positions(scores, k, chunk=chunk), topk_positions_ref(scores, k))


def test_radix_select_signed_values_ties_across_chunks_and_int32_out():
    """Negative scores, -0.0 against 0.0 across chunks, a row of one repeated value (every key ties: the first
    K positions, taken over several chunks), a row of -inf; into a view, nothing written past K."""
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(4, 600, generator=gen)
    scores[1, ::3] = -0.0
    scores[1, 1::3] = 0.0
    scores[2] = 0.5
    scores[3] = float("-inf")
    buf = torch.full((4, 140), -7, dtype=torch.int32)
    out = radix_topk_positions(scores, 130, out=buf[:, :130], chunk=32)
    assert torch.equal(out.long(), topk_positions_ref(scores, 130))
    assert torch.equal(out[2], torch.arange(130, dtype=torch.int32)) and torch.equal(out[3], out[2])
    assert (buf[:, 130:] == -7).all()
    with pytest.raises(ValueError):
        radix_topk_positions(scores, 4, chunk=24)


@pytest.mark.parametrize("width, k", [(MAX_KERNEL_WIDTH + 5, 64), (70001, 2048)])  # 5 and 18 chunks of 4,096
def test_topk_wide_rows_take_the_radix_select(width, k):
    scores = indexer_like(2, width, seed=3)
    assert torch.equal(topk_positions(scores, k), topk_positions_ref(scores, k))


def test_limits_write_positions_past_a_row_as_zero():
    """`limits` (a shorter request's context in a batch scored to a longer one's width): the positions at or past
    a row's limit read 0, in the one-program kernel and the radix select alike, as the twin's masked fill; rows
    whose limit is the width are untouched; the limits' shape and dtype are checked."""
    scores = indexer_like(4, 300, seed=11)
    visible = torch.tensor([300, 40, 7, 150])
    scores[torch.arange(300)[None, :] >= visible[:, None]] = float("-inf")
    limits = visible.to(torch.int32)
    want = topk_positions_ref(scores, 64, limits)
    assert torch.equal(want[1, 40:], torch.zeros(24, dtype=torch.int64)) and (want[1, 1:40] > 0).all()
    assert torch.equal(want[0], topk_positions_ref(scores, 64)[0])
    assert torch.equal(topk_positions(scores, 64, limits=limits), want)
    assert torch.equal(radix_topk_positions(scores, 64, chunk=32, limits=limits), want)
    buf = torch.full((4, 64), -7, dtype=torch.int32)
    assert torch.equal(topk_positions(scores, 64, out=buf, limits=limits).long(), want)
    for bad in (limits.long(), limits[:3]):
        with pytest.raises(ValueError, match="limits"):
            topk_positions(scores, 64, limits=bad)


def test_topk_rejects_bad_input():
    scores = torch.zeros(2, 10)
    for bad in (lambda: topk_positions(scores, 11), lambda: topk_positions(scores, 0),
                lambda: topk_positions(scores.half(), 2), lambda: topk_positions(scores[0], 2),
                lambda: topk_positions(scores, 2, out=torch.empty(2, 3, dtype=torch.int64))):
        with pytest.raises(ValueError):
            bad()
