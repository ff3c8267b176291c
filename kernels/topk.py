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
Wider rows (a full indexer layer at long context: 128K scores, up to 1M) are
cut into chunks of 2,048 to 8,192 scores (`wide_chunk`), one program each, and select by radix:
1. Four passes, one launch each, fix T a byte at a time from the top: every
   chunk counts its keys that match the bytes fixed so far by their next byte
   (a 256-bin histogram); the row's last chunk to arrive (an atomic counter per
   row) adds the chunks' histograms, picks the byte whose keys hold the K-th
   largest, and records, per chunk, its keys above T found at this byte (and, at
   the last, its keys equal to T).
2. Compaction (one launch): each chunk places its keys above T and its share of
   the ties (the first ties of the row by position) after those of the chunks
   before it.
The same positions as the one-program kernel and the sort, in 5 launches whose
programs each hold a chunk, instead of one program per row (or a sort).
On a GPU with nvcc, rows of every width take the CUDA cluster select instead
(`kernels/topk_cuda.py`): the same radix idea in one launch, a row's CTAs
meeting at the cluster barrier (H200, K = 2048: 15.8 us for a 128K row
against 51 for the five launches, 46 us for 64 of them against 264; 8K-16K
rows in 10-14 us against 18-30 for the one-program kernel; bench/RESULTS.md);
the Triton kernels remain where it cannot run (the interpreter, an older GPU,
rows not 16-byte aligned).
No host synchronisation, shapes fixed by (R, W, K): CUDA-graph capturable.
Contents: the twin `topk_positions_ref`, the kernels and the launcher
`topk_positions`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl, topk_cuda
from kernels.fp8_gemm import _interpreting


MAX_KERNEL_WIDTH = 16384  # scores a row may have for the one-program kernel (held in registers)
_ZERO_KEY: tl.constexpr = tl.constexpr(0x80000000)  # the key of 0.0 and -0.0
_NEG_INF_KEY: tl.constexpr = tl.constexpr(0x007FFFFF)  # the key of -inf


def topk_positions_ref(scores: torch.Tensor, k: int, limits: torch.Tensor | None = None) -> torch.Tensor:
    """[R, K] int64 positions of each row's K largest scores (stable descending sort, ties to the smaller
    position), in ascending position order; with `limits` [R], positions at or past a row's limit read 0."""
    _check(scores, k, kernel=False)
    canonical = torch.where(scores == 0, torch.zeros_like(scores), scores)  # -0.0 ties with 0.0 in the sort too
    chosen = canonical.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = chosen.sort(dim=-1).values
    return chosen if limits is None else chosen.masked_fill(chosen >= limits[:, None], 0)


@triton.jit
def _keys(s):
    """float32 -> uint32 keys in the same order (0.0 and -0.0 one key)."""
    s = tl.where(s == 0.0, 0.0, s)
    u = s.to(tl.uint32, bitcast=True)
    flip = tl.where((u >> 31) == 1, tl.full(u.shape, 0xFFFFFFFF, tl.uint32), tl.full(u.shape, 0x80000000, tl.uint32))
    return u ^ flip


@triton.jit
def _place(out_ptr, r, stride_o, cols, inside, key, kth, above_before, ties_before, ties_wanted, limit):
    """Writes the chosen positions among `cols`: keys above T and the row's first `ties_wanted` ties (by
    position), after `above_before` keys above T and `ties_before` ties at earlier positions of the row (one
    prefix sum counts both kinds before each position: keys above T in the low 16 bits, ties above them);
    a position at or past `limit` is written as 0. The one-program kernel places a whole row (nothing before
    it), the radix select one chunk of a row."""
    ties_here = tl.maximum(ties_wanted - ties_before, 0)
    above = inside & (key > kth)
    tie = inside & (key == kth)
    before = tl.cumsum(tl.where(above, 1, 0) + tl.where(tie, 1 << 16, 0), 0)
    take = above | (tie & ((before >> 16) - 1 < ties_here))
    place = (above_before + tl.minimum(ties_before, ties_wanted)
             + (before & 0xFFFF) + tl.minimum(before >> 16, ties_here) - 1)
    tl.store(out_ptr + r * stride_o + place, tl.where(cols < limit, cols, 0).to(out_ptr.dtype.element_ty), mask=take)


@triton.jit
def _row_limit(limits_ptr, r, width, HAS_LIMITS: tl.constexpr):
    """Row r's limit: positions at or past it are written as 0 (the row's width when there are none)."""
    if HAS_LIMITS:
        return tl.load(limits_ptr + r)
    return width


@triton.jit(do_not_specialize=["width", "k"])
def _topk_kernel(scores_ptr, out_ptr, limits_ptr, width, k, stride_s, stride_o, BLOCK: tl.constexpr,
                 HAS_LIMITS: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
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
    ties_to_take = k - tl.sum(tl.where(key > kth, 1, 0))
    _place(out_ptr, r, stride_o, cols, inside, key, kth, 0, 0, ties_to_take,
           _row_limit(limits_ptr, r, width, HAS_LIMITS))


@triton.jit
def _chunk_keys(scores_ptr, r, c, width, stride_s, CHUNK: tl.constexpr):
    """Chunk c of row r: its columns, which of them lie inside the row, and their keys."""
    cols = c * CHUNK + tl.arange(0, CHUNK)
    inside = cols < width
    key = _keys(tl.load(scores_ptr + r * stride_s + cols, mask=inside, other=0.0))
    return cols, inside, key


@triton.jit
def _byte_histogram(key, match, cols, PASS: tl.constexpr):
    """[512] counts of the matching keys by their byte PASS from the top (bins 0-255; bins 256-511 are dropped).
    The GPU counts each key of a histogram with a shared-memory atomic add, so equal keys in a warp wait on one
    another. The indexer's common values, 0.0 (ReLU) and -inf (past a row's length), are counted by sums
    instead; they, and the keys that do not match, go to bins 256-511 spread by column."""
    shift: tl.constexpr = 24 - 8 * PASS
    digit = ((key >> shift) & 0xFF).to(tl.int32)
    zero = match & (key == _ZERO_KEY)
    neg_inf = match & (key == _NEG_INF_KEY)
    rest = match & ~zero & ~neg_inf
    hist = tl.histogram(tl.where(rest, digit, 256 + (cols & 255)), 512)
    all_bins = tl.arange(0, 512)
    hist += tl.where(all_bins == (_ZERO_KEY >> shift) & 0xFF, tl.sum(zero.to(tl.int32)), 0)
    hist += tl.where(all_bins == (_NEG_INF_KEY >> shift) & 0xFF, tl.sum(neg_inf.to(tl.int32)), 0)
    return hist


@triton.jit
def _pick_byte(total, bins, need):
    """The byte whose keys hold the need-th largest of `total` (counts by byte), and the keys whose byte is
    above it."""
    at_or_above = tl.sum(total) - tl.cumsum(total, 0) + total  # keys whose byte is >= each bin
    byte = tl.max(tl.where(at_or_above >= need, bins, -1))
    return byte, tl.sum(tl.where(bins > byte, total, 0))


@triton.jit(do_not_specialize=["width", "k", "num_chunks"])
def _radix_pass_kernel(scores_ptr, hist_ptr, state_ptr, counts_ptr, arrivals_ptr, width, k, num_chunks, stride_s,
                       PASS: tl.constexpr, CHUNK: tl.constexpr, TILE_C: tl.constexpr):
    """Pass PASS (0-3) of the radix select: this chunk's histogram of the keys that match T's bytes fixed so
    far, by their next byte; the row's last chunk to arrive fixes that byte (state: T's bytes so far, and how
    many of the matching keys are still to take) and adds, per chunk, the keys above T this byte separates."""
    c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
    shift: tl.constexpr = 24 - 8 * PASS
    cols, inside, key = _chunk_keys(scores_ptr, r, c, width, stride_s, CHUNK)
    if PASS == 0:
        prefix = tl.zeros([], dtype=tl.uint32)
        need = k
        match = inside
    else:
        prefix = tl.load(state_ptr + r * 2).to(tl.uint32)
        need = tl.load(state_ptr + r * 2 + 1)
        match = inside & ((key >> (shift + 8)) == prefix)
    hist = _byte_histogram(key, match, cols, PASS)
    bins = tl.arange(0, 256)
    all_bins = tl.arange(0, 512)
    row_hist = hist_ptr + r * num_chunks * 256
    tl.store(row_hist + c * 256 + all_bins, hist, mask=all_bins < 256)
    tl.debug_barrier()  # the whole histogram is stored before the arrival is counted
    arrived = tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if arrived == num_chunks - 1:  # the row's histograms are read as tiles of TILE_C chunks
        tile_c = tl.arange(0, TILE_C)
        total = tl.zeros([256], dtype=tl.int32)
        for j0 in range(0, num_chunks, TILE_C):
            tile_mask = (j0 + tile_c < num_chunks)[:, None]
            tile = tl.load(row_hist + (j0 + tile_c)[:, None] * 256 + bins[None, :], mask=tile_mask, other=0,
                           cache_modifier=".cg")
            total += tl.sum(tile, 0)
        byte, above = _pick_byte(total, bins, need)
        tl.store(state_ptr + r * 2, (prefix.to(tl.int64) << 8) | byte)
        tl.store(state_ptr + r * 2 + 1, need - above)
        for j0 in range(0, num_chunks, TILE_C):  # per chunk: keys above T found at this byte (last: its ties)
            in_row = j0 + tile_c < num_chunks
            tile = tl.load(row_hist + (j0 + tile_c)[:, None] * 256 + bins[None, :], mask=in_row[:, None],
                           other=0, cache_modifier=".cg")
            chunk_above = tl.sum(tl.where(bins[None, :] > byte, tile, 0), 1)
            counted = counts_ptr + (r * num_chunks + j0 + tile_c) * 2
            if PASS == 0:
                tl.store(counted, chunk_above, mask=in_row)
            else:
                tl.store(counted, tl.load(counted, mask=in_row, other=0) + chunk_above, mask=in_row)
            if PASS == 3:
                tl.store(counted + 1, tl.sum(tl.where(bins[None, :] == byte, tile, 0), 1), mask=in_row)
        tl.atomic_xchg(arrivals_ptr + r, 0, sem="relaxed", scope="gpu")  # re-armed for the next pass


@triton.jit(do_not_specialize=["width", "num_chunks"])
def _radix_place_kernel(scores_ptr, state_ptr, counts_ptr, out_ptr, limits_ptr, width, num_chunks, stride_s, stride_o,
                        CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, HAS_LIMITS: tl.constexpr):
    """Writes chunk c's chosen positions: its keys above T and the row's first ties (by position) that fall
    in it, after the chosen keys of the chunks before it, in ascending position order."""
    c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols, inside, key = _chunk_keys(scores_ptr, r, c, width, stride_s, CHUNK)
    kth = tl.load(state_ptr + r * 2).to(tl.uint32)
    ties_wanted = tl.load(state_ptr + r * 2 + 1).to(tl.int32)
    earlier = tl.arange(0, BLOCK_C)
    mask = earlier < c
    above_before = tl.sum(tl.load(counts_ptr + (r * num_chunks + earlier) * 2, mask=mask, other=0))
    ties_before = tl.sum(tl.load(counts_ptr + (r * num_chunks + earlier) * 2 + 1, mask=mask, other=0))
    _place(out_ptr, r, stride_o, cols, inside, key, kth, above_before, ties_before, ties_wanted,
           _row_limit(limits_ptr, r, width, HAS_LIMITS))


def wide_chunk(rows: int, width: int) -> int:
    """Scores per program of the radix select of `rows` rows of `width` scores: the best of chunks of 1,024 to
    8,192 in H200 sweeps of `bench/topk.py` (bench/RESULTS.md, 2026-12-02, twelfth session). A smaller chunk
    means more programs a pass, but more chunk histograms for the row's last arrival to add, one after the
    other, and a larger one a longer histogram a program: 2,048 up to 64K scores and at 128K outside 4-31 rows
    (128K B = 64: 266 us against 302 at 4,096), 4,096 at 128K for 4-31 rows (B = 8: 67 against 76), at 256K and
    at 1M from two rows, 8,192 for one row of 1M (133 against 139)."""
    if width <= 65536:
        return 2048
    if width <= 131072:
        return 4096 if 4 <= rows < 32 else 2048
    if width <= 262144 or rows > 1:
        return 4096
    return 8192


def radix_topk_positions(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                         chunk: int | None = None, *, limits: torch.Tensor | None = None) -> torch.Tensor:
    """`topk_positions` by the radix select in chunks of `chunk` scores (a power of two; default
    `wide_chunk`), at any width: what rows wider than MAX_KERNEL_WIDTH take (module docstring)."""
    _check(scores, k, kernel=True, limits=limits)
    if chunk is None:
        chunk = wide_chunk(*scores.shape)
    if chunk < 16 or chunk & (chunk - 1) or chunk >= 1 << 16:
        raise ValueError(f"chunk must be a power of two in [16, 32768], got {chunk}")
    out = _out(scores, k, out)
    if scores.shape[0]:
        _radix_select(scores, k, out, chunk, limits)
    return out


def _radix_select(scores: torch.Tensor, k: int, out: torch.Tensor, chunk: int,
                  limits: torch.Tensor | None = None) -> None:
    """The radix select's launches for checked inputs (at least one row). Its kernels never launch with
    programmatic dependent launch, also inside `pdl.launches(True)`: with it the scoring + selection of a
    64K-128K row took 1.2-1.5x as long (H200, B = 1 / 8 at 128K: 90 / 146 us against 72 / 123;
    bench/RESULTS.md); the first pass follows the scoring in stream order and the kernel after the last one
    starts when it completes."""
    rows, width = scores.shape
    num_chunks = triton.cdiv(width, chunk)
    hist = torch.empty(rows, num_chunks, 256, dtype=torch.int32, device=scores.device)  # a bin per byte value
    state = torch.empty(rows, 2, dtype=torch.int64, device=scores.device)  # T's bytes so far, ties still to take
    counts = torch.empty(rows, num_chunks, 2, dtype=torch.int32, device=scores.device)  # per chunk: above T, ties
    arrivals = torch.zeros(rows, dtype=torch.int32, device=scores.device)
    grid = (num_chunks, rows)
    for p in range(4):
        _radix_pass_kernel[grid](scores, hist, state, counts, arrivals, width, k, num_chunks, scores.stride(0),
                                 PASS=p, CHUNK=chunk, TILE_C=16, num_warps=4)
    _radix_place_kernel[grid](scores, state, counts, out, out if limits is None else limits, width, num_chunks,
                              scores.stride(0), out.stride(0), CHUNK=chunk, BLOCK_C=triton.next_power_of_2(num_chunks),
                              HAS_LIMITS=limits is not None, num_warps=4)


def _check(scores: torch.Tensor, k: int, kernel: bool, limits: torch.Tensor | None = None) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [R, W], got {tuple(scores.shape)} {scores.dtype}")
    if limits is not None and (limits.shape != scores.shape[:1] or limits.dtype != torch.int32
                               or limits.device != scores.device or not limits.is_contiguous()):
        raise ValueError(f"limits must be a contiguous int32 [{scores.shape[0]}] tensor on {scores.device}, got "
                         f"{tuple(limits.shape)} {limits.dtype} on {limits.device}")
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be in [1, W = {scores.shape[1]}], got {k}")
    if kernel and scores.stride(1) != 1:
        raise ValueError("scores must have unit last stride")
    if kernel and scores.device.type != "cuda" and not _interpreting():
        raise ValueError(f"scores are on {scores.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


def _out(scores: torch.Tensor, k: int, out: torch.Tensor | None) -> torch.Tensor:
    rows = scores.shape[0]
    if out is None:
        return torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    if out.shape != (rows, k) or out.dtype not in (torch.int32, torch.int64) or out.stride(1) != 1:
        raise ValueError(f"out must be int32/int64 [{rows}, {k}] with unit last stride, got {tuple(out.shape)} "
                         f"{out.dtype}")
    return out


def one_program_warps(width: int) -> int:
    """The one-program kernel's default warps for rows of `width` scores."""
    return max(4, min(32, triton.next_power_of_2(width) // 512))


def topk_positions(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, *,
                   limits: torch.Tensor | None = None, num_warps: int | None = None) -> torch.Tensor:
    """[R, K] positions of each row's K largest scores (see the module docstring), int64, or written into `out`
    (an integer [R, K] tensor, e.g. a view of a larger buffer). `limits` (int32 [R]): positions at or past a
    row's limit are written as 0 (the indexer's columns past a shorter request's context), in the same launch.
    `num_warps` asks for the one-program Triton kernel (rows up to MAX_KERNEL_WIDTH) at that many warps instead
    of the CUDA select."""
    _check(scores, k, kernel=True, limits=limits)
    rows, width = scores.shape
    out = _out(scores, k, out)
    if rows == 0:
        return out
    if num_warps is None and topk_cuda.supports(scores, out):
        topk_cuda.launch(scores, k, out, limits=limits)
        return out
    if width > MAX_KERNEL_WIDTH:
        _radix_select(scores, k, out, wide_chunk(rows, width), limits)
        return out
    block = triton.next_power_of_2(width)
    _topk_kernel[(rows,)](scores, out, out if limits is None else limits, width, k, scores.stride(0), out.stride(0),
                          BLOCK=block, HAS_LIMITS=limits is not None, num_warps=num_warps or one_program_warps(width),
                          **pdl.launch_options(scores.device))
    return out
