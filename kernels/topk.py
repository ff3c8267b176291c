"""Top-K of each row of scores, exact and deterministic, in one launch.

For scores [R, W] float32 and K <= W, `topk_positions` writes, for every row,
the positions of the K largest scores in ascending position order; among equal
scores the smaller position is taken first (the choice a stable descending sort
makes, so it does not depend on chunking or batching; ReLU makes exact ties, a
zero score, common). -0.0 counts as equal to 0.0; NaN is out of scope.

Rows up to MAX_KERNEL_WIDTH scores (a decode step's indexer rows up to a 10K
context, with the width bucket) take one program each, the row held in
registers:
1. Each score maps to a 32-bit key whose unsigned order is the float order.
   The K-th largest key T is found bit by bit from the top: 32 steps, each
   counting the keys at or above the candidate (a compare and a sum per key;
   histograms were slower: the indexer's many equal scores collide on one bin).
2. Compaction: the keys above T, and the first (by position) of those equal to
   T, are written in position order (one prefix sum counts both kinds).
Wider rows take the PyTorch form (a stable sort, then the K positions sorted),
which is the twin. No host synchronisation, shapes fixed by (R, K): CUDA-graph
capturable. Contents: the twin `topk_positions_ref`, the kernel and the
launcher `topk_positions`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import _interpreting

MAX_KERNEL_WIDTH = 16384  # scores a row may have for the kernel (held in registers); wider rows sort


def topk_positions_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[R, K] int64 positions of each row's K largest scores (stable descending sort, ties to the smaller
    position), in ascending position order."""
    _check(scores, k, kernel=False)
    canonical = torch.where(scores == 0, torch.zeros_like(scores), scores)  # -0.0 ties with 0.0 in the sort too
    chosen = canonical.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return chosen.sort(dim=-1).values


@triton.jit
def _keys(s):
    """float32 -> uint32 keys in the same order (0.0 and -0.0 one key)."""
    s = tl.where(s == 0.0, 0.0, s)
    u = s.to(tl.uint32, bitcast=True)
    flip = tl.where((u >> 31) == 1, tl.full(u.shape, 0xFFFFFFFF, tl.uint32), tl.full(u.shape, 0x80000000, tl.uint32))
    return u ^ flip


@triton.jit(do_not_specialize=["width", "k"])
def _topk_kernel(scores_ptr, out_ptr, width, k, stride_s, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    # key 0 lies below every real key (-inf's is 0x007fffff), so the padding is never counted or taken
    key = tl.where(inside, _keys(tl.load(scores_ptr + r * stride_s + cols, mask=inside, other=0.0)), 0)
    kth = tl.zeros([], dtype=tl.uint32)  # the largest T with at least k keys >= T, one bit at a time
    for b in tl.static_range(32):
        candidate = kth | tl.full([], 1 << (31 - b), tl.uint32)
        at_least = tl.sum(tl.where(key >= candidate, 1.0, 0.0))  # float32 counts are exact here; bool sums pack bits
        kth = tl.where(at_least >= k, candidate, kth)
    above = key > kth
    tie = key == kth
    # one prefix sum counts both kinds before each position: keys above T in the low 16 bits, ties above them
    before = tl.cumsum(tl.where(above, 1, 0) + tl.where(tie, 1 << 16, 0), 0)
    ties_to_take = k - tl.sum(tl.where(above, 1, 0))
    tie_rank = (before >> 16) - 1
    take = above | (tie & (tie_rank < ties_to_take))
    place = (before & 0xFFFF) + tl.minimum(before >> 16, ties_to_take) - 1
    tl.store(out_ptr + r * stride_o + place, cols.to(out_ptr.dtype.element_ty), mask=take)


def _check(scores: torch.Tensor, k: int, kernel: bool) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [R, W], got {tuple(scores.shape)} {scores.dtype}")
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, W = {scores.shape[1]}], got {k}")
    if kernel and scores.stride(1) != 1:
        raise ValueError("scores must have unit last stride")
    if kernel and scores.device.type != "cuda" and not _interpreting():
        raise ValueError(f"scores are on {scores.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


def topk_positions(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
                   num_warps: int | None = None) -> torch.Tensor:
    """[R, K] positions of each row's K largest scores (see the module docstring), int64, or written into `out`
    (an integer [R, K] tensor, e.g. a view of a larger buffer). `num_warps` overrides the kernel's default."""
    _check(scores, k, kernel=True)
    rows, width = scores.shape
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    elif out.shape != (rows, k) or out.dtype not in (torch.int32, torch.int64) or out.stride(1) != 1:
        raise ValueError(f"out must be int32/int64 [{rows}, {k}] with unit last stride, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if rows == 0:
        return out
    if width > MAX_KERNEL_WIDTH:
        out.copy_(topk_positions_ref(scores, k))
        return out
    block = triton.next_power_of_2(width)
    _topk_kernel[(rows,)](scores, out, width, k, scores.stride(0), out.stride(0), BLOCK=block,
                          num_warps=num_warps or max(4, min(32, block // 512)))
    return out
