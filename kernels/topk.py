"""Top-K of each row of scores, exact and deterministic, in one launch.

For scores [R, W] float32 and K <= W, `topk_positions` writes, for every row,
the positions of the K largest scores in ascending position order; among equal
scores the smaller position is taken first (the choice a stable descending sort
makes, so it does not depend on chunking or batching; ReLU makes exact ties, a
zero score, common). -0.0 counts as equal to 0.0; NaN is out of scope.

One program per row:
1. Radix select: each score maps to a 32-bit key whose unsigned order is the
   float order; four passes over the row, each a 256-bin histogram of one key
   byte among the keys that share the bytes fixed so far, find the K-th largest
   key T and how many keys equal to T are taken (the first ones by position).
2. Compaction: one more pass writes the positions with key > T, and the first
   of those equal to T, in position order (a running prefix count).
No sort, no host synchronisation, shapes fixed by (R, K): CUDA-graph
capturable. Contents: the PyTorch twin `topk_positions_ref` and the launcher
`topk_positions`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import _interpreting

BLOCK = 2048  # scores per step of a pass


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
    row = scores_ptr + r * stride_s
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    fixed = tl.zeros([], dtype=tl.uint32)  # mask of the key bits decided so far
    remaining = k  # keys still to take among those matching the prefix
    for p in tl.static_range(4):
        shift: tl.constexpr = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            inside = cols < width
            key = _keys(tl.load(row + cols, mask=inside, other=0.0))
            match = inside & ((key & fixed) == prefix)
            digit = ((key >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(tl.where(match, digit, 0), 256)
            hist -= tl.where(bins == 0, tl.sum((~match).to(tl.int32)), 0)  # non-matching keys were put in bin 0
        # keys with this byte >= d, for every d (non-increasing in d); the K-th largest has the largest d
        # whose count still reaches `remaining`
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        d = tl.sum((at_least >= remaining).to(tl.int32)) - 1
        remaining -= tl.sum(tl.where(bins == d, at_least - hist, 0))
        prefix |= d.to(tl.uint32) << shift
        fixed |= tl.full([], 0xFF, tl.uint32) << shift
    taken = 0
    ties = 0
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < width
        key = _keys(tl.load(row + cols, mask=inside, other=0.0))
        tie = inside & (key == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = (inside & (key > prefix)) | (tie & (tie_rank < remaining))
        place = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_ptr + r * stride_o + place, cols.to(out_ptr.dtype.element_ty), mask=take)
        taken += tl.sum(take.to(tl.int32))
        ties += tl.sum(tie.to(tl.int32))


def _check(scores: torch.Tensor, k: int, kernel: bool) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [R, W], got {tuple(scores.shape)} {scores.dtype}")
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, W = {scores.shape[1]}], got {k}")
    if kernel and scores.stride(1) != 1:
        raise ValueError("scores must have unit last stride")
    if kernel and scores.device.type != "cuda" and not _interpreting():
        raise ValueError(f"scores are on {scores.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


def topk_positions(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: [R, K] positions of each row's K largest scores (see the module docstring), int64, or written
    into `out` (an integer [R, K] tensor, e.g. a view of a larger buffer)."""
    _check(scores, k, kernel=True)
    rows = scores.shape[0]
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    elif out.shape != (rows, k) or out.dtype not in (torch.int32, torch.int64) or out.stride(1) != 1:
        raise ValueError(f"out must be int32/int64 [{rows}, {k}] with unit last stride, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if rows:
        _topk_kernel[(rows,)](scores, out, scores.shape[1], k, scores.stride(0), out.stride(0), BLOCK=BLOCK,
                              num_warps=8)
    return out
