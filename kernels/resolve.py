"""Fused resolve of one IndexShare group: top-K positions -> KV slots, loading misses.

For every request of a decode batch the indexer's top-K token positions become
physical KV slots (`page * page_size + token`) that sparse attention reads:

- resident: the position's page is on the GPU; the slot is read in place;
- hot hit: the position sits in one of the request's leased hot slots; that
  slot's last-use stamp becomes the current step;
- miss: the position lives only in the pinned host pool. It takes the least
  recently used hot slot that was not used this step (empty slots first, then
  ascending stamp, ties by slot index; the victims, in slot-index order, go to
  the misses in top-K order), the victim's old position leaves the reverse map,
  and the token's contiguous run of the group (`run_bytes`: the rows of every
  layer of the group) is copied host -> that hot slot's run in the GPU pool.

Two launches, both of fixed shape and free of host synchronisation, so a decode
step that calls them can be captured in a CUDA graph:

1. plan (one program per request): classify the K positions, detect hits by
   gathering the reverse map `pos_to_hot`, pick victims with a threshold search
   on the per-slot stamps (a first round that bins the stamps just above the
   oldest one, then, when the threshold lies beyond them, a few probes a round,
   their counts in one packed sum) plus one prefix-sum compaction, update the
   LRU state in place and write a compacted list of (host slot, hot slot)
   copies;
2. copy (a persistent grid over every miss of the batch): each program maps
   global miss numbers to (request, miss) with a prefix sum over the per-request
   counts and moves whole runs, reading the pinned host tensor directly (UVA).

A request's LRU tables are reached through its row of a lease table (their
addresses and sizes), so requests whose hot buffers differ in size and live in
separate tensors resolve in one launch, updated where they live (`resolve_leases`).
The plan reads the slots in chunks of `_R_BLOCK` and the copy reads the counts
in chunks of `_B_BLOCK`, and no size argument is specialised: two compiled plans
per top-K width (one for leases of at most one chunk, the default's size, and
one for leases of any size, which also carries the chunked search) and one copy
per run size serve every batch and hot buffer, so a new shape never stalls a
serving step on a compile.

Caller guarantees: positions are unique within a row; the newest token's page
is resident; `R >= count` (hot_rows >= top-K); step numbers grow from call to
call and stay below 2**60; a hot buffer has fewer than 2**21 slots. If a row
still has more misses than victims (slots not used this step), the extra misses
resolve to -1 and copy nothing. Entries past `count` are -1.

`resolve_group` runs both launches over [B, R] stacked tables; `plan_group` and
`copy_misses` are the two halves (the copy can go on a side stream as prefetch
for the group's shared layers). They and `resolve_leases` are the Triton path
(CUDA, or CPU under TRITON_INTERPRET=1); `resolve_group_reference` and
`resolve_leases_reference` are the plain PyTorch twins with the same signatures
and the same effects, byte for byte. H200 numbers: bench/RESULTS.md (plan at
B=100 in a CUDA graph 6.6 us without misses, 13.0 us at 1 %; miss copy 85-100%
of the UVA gather ceiling from about 1.7 MB per launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl


PAGE_SIZE = 64
_COPY_RUNS_PER_PROGRAM = 4
_COPY_PROGRAMS_PER_SM = 8
# Threshold probes per round of the victim search after its first round (at most 3: their counts share one int64
# sum, _FIELD_BITS each). H200, B = 100, 1 % misses, CUDA graph: 3 probes 14.1-14.3 us against binary search's
# 15.4-15.7 (bench/RESULTS.md, 2026-12-01, tenth session).
_SEARCH_WAYS = 3
# The first round counts the candidates' keys in _SEARCH_BINS bins above the smallest one (one `tl.histogram`: a
# ballot a bit of the bin and a popcount a bin, no block reduction a probe): a step's victims are the oldest few
# slots, so the threshold nearly always lies within BINS - 2 of the smallest key (empty slots are all -1; a lease's
# first fill stamps thousands of slots alike) and the search ends there; past it, rounds of even splits go on.
# 0: every round even splits from the candidates' bounds. H200, B = 100, CUDA graph, 1 % misses: 13.0 us against 15.3
# without bins and 14.4 for the former first round of probes near the smallest key; 64 bins 13.4 (at 5 % misses
# 13.5 against 32 bins' 16.6: the bench's stamps, four slots a value, put those thresholds past 30 bins) (bench/
# RESULTS.md, 2026-12-04, thirtieth session).
_SEARCH_BINS = 32
_FIELD_BITS: tl.constexpr = tl.constexpr(21)  # one probe's count in the packed sum
_FIELD_MASK: tl.constexpr = tl.constexpr((1 << 21) - 1)
MAX_HOT_SLOTS = 1 << 21
# Hot slots per chunk of the victim search: one compiled plan for any hot buffer size; the default buffer
# (2 x top-K = 4,096 slots) in one chunk: 23 us at 1 % misses against 26 (2,048) and 31 (1,024).
_R_BLOCK = 4096
_B_BLOCK = 64  # requests per chunk of the copy's prefix sum: one compiled copy for any batch


class ResolveResult(NamedTuple):
    """What one resolve produced: slots for attention and how much was loaded."""

    kv_slots: torch.Tensor  # [B, K] int32 physical slot per top-K entry, -1 past count
    num_copied: torch.Tensor  # [B] int32 runs copied (one miss = group rows of one token)


class ResolvePlan(NamedTuple):
    """The plan launch's output: slots plus the compacted copy list per request."""

    kv_slots: torch.Tensor  # [B, K] int32
    num_copied: torch.Tensor  # [B] int32
    copy_src: torch.Tensor  # [B, K] int32 host slot of the m-th miss (first num_copied valid)
    copy_dst: torch.Tensor  # [B, K] int32 hot slot of the m-th miss


# --- kernels -------------------------------------------------------------------------

# Columns of a lease table row: addresses of a request's hot slots [R] int32, slot positions [R]
# int32, slot stamps [R] int32/int64 and reverse map [capacity] int16/int32, then R and capacity.
LEASE_WIDTH = 6
LEASE_COLUMNS: tl.constexpr = tl.constexpr(LEASE_WIDTH)


@triton.jit
def _lease_rows(lease, STAMP64: tl.constexpr, MAP16: tl.constexpr):
    """One request's LRU tables, read from its lease table row."""
    hot_row = tl.load(lease).to(tl.pointer_type(tl.int32))
    held_row = tl.load(lease + 1).to(tl.pointer_type(tl.int32))
    if STAMP64:
        stamp_row = tl.load(lease + 2).to(tl.pointer_type(tl.int64))
    else:
        stamp_row = tl.load(lease + 2).to(tl.pointer_type(tl.int32))
    if MAP16:
        map_row = tl.load(lease + 3).to(tl.pointer_type(tl.int16))
    else:
        map_row = tl.load(lease + 3).to(tl.pointer_type(tl.int32))
    return hot_row, held_row, stamp_row, map_row, tl.load(lease + 4).to(tl.int32)


@triton.jit
def _slot_keys(held_row, stamp_row, r0, R, step, R_BLOCK: tl.constexpr):
    """Slots r0..r0+R_BLOCK: their indices, their LRU key (-1 when empty, else last use) and whether they may
    be victims (not used this step)."""
    offs_r = r0 + tl.arange(0, R_BLOCK)
    rmask = offs_r < R
    held = tl.load(held_row + offs_r, mask=rmask, other=-1)
    key = tl.where(held < 0, -1, tl.load(stamp_row + offs_r, mask=rmask, other=0))
    return offs_r, key, rmask & (key < step)


@triton.jit
def _bounds_combine(n0, lo0, hi0, n1, lo1, hi1):
    return n0 + n1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _bounds(key, cand, step):
    """(candidates, smallest candidate key, largest) of a run of slots, in one reduction."""
    return tl.reduce((cand.to(tl.int32), tl.where(cand, key, step), tl.where(cand, key, -2)), 0, _bounds_combine)


@triton.jit
def _probe(lo, hi, w: tl.constexpr, WAYS: tl.constexpr):
    """Threshold w of a search round in [lo, hi): the w-th of WAYS even splits."""
    return lo + ((hi - lo).to(tl.int64) * (w + 1) // (WAYS + 1)).to(lo.dtype)


@triton.jit
def _count_at_or_below(key, cand, lo, hi, WAYS: tl.constexpr):
    """Candidates with key <= each of the round's WAYS probes, in one sum: probe w's count in bits
    [FIELD * w, FIELD * (w + 1)) of an int64."""
    packed = tl.zeros(key.shape, tl.int64)
    for w in tl.static_range(WAYS):
        at_or_below = cand & (key <= _probe(lo, hi, w, WAYS))
        packed += at_or_below.to(tl.int64) << (_FIELD_BITS * w)
    return tl.sum(packed, 0)


@triton.jit
def _narrow(lo, hi, below, counts, num_miss, WAYS: tl.constexpr):
    """The range after one round: above the highest probe with fewer than `num_miss` candidates at or below it,
    up to the lowest probe with enough; and `below`, the candidates under the new lo (that probe's count)."""
    new_lo, new_hi, new_below = lo, hi, below
    for w in tl.static_range(WAYS):
        probe = _probe(lo, hi, w, WAYS)
        count = ((counts >> (_FIELD_BITS * w)) & _FIELD_MASK).to(tl.int32)
        enough = count >= num_miss
        new_lo = tl.where(enough, new_lo, tl.maximum(new_lo, probe + 1))
        new_below = tl.where(enough, new_below, tl.maximum(new_below, count))
        new_hi = tl.where(enough, tl.minimum(new_hi, probe), new_hi)
    return new_lo, new_hi, new_below


@triton.jit
def _key_bins(key, cand, lo, BINS: tl.constexpr):
    """Each slot's bin for the first round: key - lo for a candidate up to BINS - 3, BINS - 2 for the candidates
    above, BINS - 1 for the slots that are not candidates."""
    return tl.where(cand, tl.minimum(key - lo, BINS - 2), BINS - 1).to(tl.int32)


@triton.jit
def _first_round(hist, lo, num_miss, BINS: tl.constexpr):
    """The first round from the bins' counts: the threshold lo + t of the first exact bin whose running count
    reaches `num_miss`, or lo + BINS - 2 (the search goes on) when none does; the candidates under it; the
    candidates; and whether the threshold is final. The three sums share one int64."""
    bins = tl.arange(0, BINS)
    short = (bins < BINS - 2) & (tl.cumsum(hist, 0) < num_miss)  # a prefix of the exact bins
    counts = hist.to(tl.int64)
    packed = (tl.where(short, counts, 0) + (short.to(tl.int64) << _FIELD_BITS)
              + (tl.where(bins < BINS - 1, counts, 0) << (2 * _FIELD_BITS)))
    sums = tl.sum(packed, 0)
    below = (sums & _FIELD_MASK).to(tl.int32)
    t = ((sums >> _FIELD_BITS) & _FIELD_MASK).to(tl.int32)
    num_cand = ((sums >> (2 * _FIELD_BITS)) & _FIELD_MASK).to(tl.int32)
    return lo + t, below, num_cand, t < BINS - 2


@triton.jit
def _pick_victims(key, cand, offs_r, lo, at_quota, num_below, num_at, num_served, victims):
    """Writes the run's victims (keys below the threshold `lo`, and keys equal to it by slot index while at most
    `at_quota` of those are taken; `num_below` and `num_at` of each in earlier runs) by rank: only their slots,
    a store a slot of the run; the misses gather what the victims held and their hot slots. Returns the updated
    counts."""
    below = cand & (key < lo)
    at = cand & (key == lo)
    # one scan ranks both: keys below the threshold counted in the low 16 bits, keys at it above (a run has
    # fewer than 2**16 slots)
    scan = tl.cumsum(below.to(tl.int32) + (at.to(tl.int32) << 16), 0)
    at_upto = num_at + (scan >> 16)
    victim = below | (at & (at_upto <= at_quota))
    victim_rank = num_below + (scan & 0xFFFF) + tl.minimum(at_upto, at_quota) - 1
    take = victim & (victim_rank < num_served)
    tl.store(victims + victim_rank, offs_r, mask=take)
    last = tl.max(scan, 0)  # the scan only grows
    return num_below + (last & 0xFFFF), num_at + (last >> 16)


@triton.jit
def _victims_in_registers(held_row, stamp_row, R, step, num_miss, victims,
                          R_BLOCK: tl.constexpr, WAYS: tl.constexpr, BINS: tl.constexpr):
    """The victim search over a hot buffer of at most R_BLOCK slots (the default's size), read once and searched
    in registers; returns the misses served."""
    offs_r = tl.arange(0, R_BLOCK)
    held = tl.load(held_row + offs_r, mask=offs_r < R, other=-1)  # on its way across the barrier
    tl.debug_barrier()  # hit stamps are visible: hit slots are not candidates
    key = tl.where(held < 0, -1, tl.load(stamp_row + offs_r, mask=offs_r < R, other=0))
    cand = (offs_r < R) & (key < step)
    if BINS > 0:
        lo = tl.min(tl.where(cand, key, step), 0)
        hist = tl.histogram(_key_bins(key, cand, lo, BINS), BINS)
        lo, below, num_cand, settled = _first_round(hist, lo, num_miss, BINS)  # below: candidates < lo
        hi = lo
        if settled == 0:
            hi = tl.max(tl.where(cand, key, -2), 0)
    else:
        num_cand, lo, hi = _bounds(key, cand, step)
        below = num_miss * 0
    num_served = tl.minimum(num_miss, num_cand)
    while lo < hi:  # smallest threshold with num_miss candidates at or below it, WAYS probes a round
        counts = _count_at_or_below(key, cand, lo, hi, WAYS)
        lo, hi, below = _narrow(lo, hi, below, counts, num_miss, WAYS)
    _pick_victims(key, cand, offs_r, lo, num_miss - below, num_miss * 0, num_miss * 0, num_served, victims)
    return num_served


@triton.jit
def _victims_in_chunks(held_row, stamp_row, R, step, num_miss, victims,
                       R_BLOCK: tl.constexpr, WAYS: tl.constexpr, BINS: tl.constexpr):
    """The same search over a hot buffer of any size, its slots read in chunks of R_BLOCK at every pass."""
    tl.debug_barrier()
    num_cand = num_miss * 0
    lo = step
    hi = step * 0 - 2
    for r0 in range(0, R, R_BLOCK):
        offs_r, key, cand = _slot_keys(held_row, stamp_row, r0, R, step, R_BLOCK)
        n, chunk_lo, chunk_hi = _bounds(key, cand, step)
        num_cand += n
        lo = tl.minimum(lo, chunk_lo)
        hi = tl.maximum(hi, chunk_hi)
    num_served = tl.minimum(num_miss, num_cand)
    below = num_miss * 0
    if BINS > 0:
        hist = tl.zeros([BINS], tl.int32)
        for r0 in range(0, R, R_BLOCK):
            offs_r, key, cand = _slot_keys(held_row, stamp_row, r0, R, step, R_BLOCK)
            hist += tl.histogram(_key_bins(key, cand, lo, BINS), BINS)
        lo, below, _, settled = _first_round(hist, lo, num_miss, BINS)
        hi = tl.where(settled, lo, hi)
    while lo < hi:
        counts = (lo * 0).to(tl.int64)
        for r0 in range(0, R, R_BLOCK):
            offs_r, key, cand = _slot_keys(held_row, stamp_row, r0, R, step, R_BLOCK)
            counts += _count_at_or_below(key, cand, lo, hi, WAYS)
        lo, hi, below = _narrow(lo, hi, below, counts, num_miss, WAYS)
    at_quota = num_miss - below  # slots stamped exactly `lo` that become victims, lowest index first
    num_below = num_miss * 0
    num_at = num_miss * 0
    for r0 in range(0, R, R_BLOCK):
        offs_r, key, cand = _slot_keys(held_row, stamp_row, r0, R, step, R_BLOCK)
        num_below, num_at = _pick_victims(key, cand, offs_r, lo, at_quota, num_below, num_at, num_served, victims)
    return num_served


@triton.jit(do_not_specialize=["K", "max_pages"], do_not_specialize_on_alignment=["topk_ptr", "counts_ptr"])
def _plan_kernel(
    topk_ptr, counts_ptr, gpu_page_ptr, host_page_ptr, lease_ptr, step_ptr,
    kv_ptr, num_copied_ptr, victim_ptr, copy_src_ptr, copy_dst_ptr,
    K, max_pages,
    PAGE: tl.constexpr, K_BLOCK: tl.constexpr, R_BLOCK: tl.constexpr, WAYS: tl.constexpr, BINS: tl.constexpr,
    ONE_CHUNK: tl.constexpr, STAMP64: tl.constexpr, MAP16: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    step = tl.load(step_ptr)
    hot_row, held_row, stamp_row, map_row, R = _lease_rows(lease_ptr + b * LEASE_COLUMNS, STAMP64, MAP16)

    # classify: resident page, hot hit through the reverse map, miss
    offs_k = tl.arange(0, K_BLOCK)
    # the whole row is read (the entries past the count masked after), not behind the count's load: one
    # dependent load fewer before the gathers (H200, B = 100, the engine's tables: 7.2 -> 7.05 us without
    # misses, equal at 1 %; the bench's int32 stamps in random order 0.1-0.3 us slower at 1 %, within their spread)
    pos = tl.load(topk_ptr + b * K + offs_k, mask=offs_k < K, other=0)
    valid = offs_k < tl.minimum(tl.load(counts_ptr + b), K)
    pos = tl.where(valid, pos, 0)
    page, tok = pos // PAGE, pos % PAGE
    gpage = tl.load(gpu_page_ptr + b * max_pages + page, mask=valid, other=-1)
    resident = valid & (gpage >= 0)
    lookup = valid & (gpage < 0)
    h = tl.load(map_row + pos, mask=lookup, other=-1).to(tl.int32)
    hit = lookup & (h >= 0)
    miss = lookup & (h < 0)
    tl.store(stamp_row + h, step, mask=hit)
    hot_hit = tl.load(hot_row + h, mask=hit, other=-1)
    num_miss = tl.sum(miss.to(tl.int32), 0)

    # misses only: victims, reverse-map and LRU updates, the copy list. A hot buffer of up to R_BLOCK slots
    # (the default's size) is read once and searched in registers; a larger one is read in chunks of R_BLOCK
    # at every pass. ONE_CHUNK: the caller guarantees every lease of the launch has at most R_BLOCK slots, and
    # the chunked search is left out of the compiled plan (about half its code; a probe of this form, H200,
    # B = 100, 1 % misses: 0.2-0.6 us faster)
    num_served = num_miss * 0
    served = offs_k < 0
    miss_rank = h * 0
    v_hot = h * 0
    if num_miss > 0:
        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # victims go to misses in top-K order
        host_page = tl.load(host_page_ptr + b * max_pages + page, mask=miss, other=0)
        victims = victim_ptr + b * K
        tl.static_assert(WAYS * _FIELD_BITS <= 63 and R_BLOCK < 65536)
        if ONE_CHUNK:
            num_served = _victims_in_registers(held_row, stamp_row, R, step, num_miss, victims, R_BLOCK, WAYS, BINS)
        else:
            if R <= R_BLOCK:
                num_served = _victims_in_registers(held_row, stamp_row, R, step, num_miss, victims, R_BLOCK, WAYS,
                                                   BINS)
            else:
                num_served = _victims_in_chunks(held_row, stamp_row, R, step, num_miss, victims, R_BLOCK, WAYS,
                                                BINS)
        tl.debug_barrier()
        served = miss & (miss_rank < num_served)
        v = tl.load(victims + miss_rank, mask=served, other=0)
        old = tl.load(held_row + v, mask=served, other=-1)
        v_hot = tl.load(hot_row + v, mask=served, other=-1)
        # `old` is never a position of this row's top-K (a held selected position is a hit, its slot stamped
        # this step, so not a victim): clearing it and mapping the misses touch different entries
        tl.store(map_row + old, -1, mask=served & (old >= 0))
        tl.store(map_row + pos, v.to(map_row.dtype.element_ty), mask=served)
        tl.store(held_row + v, pos, mask=served)
        tl.store(stamp_row + v, step, mask=served)
        tl.store(copy_src_ptr + b * K + miss_rank, host_page * PAGE + tok, mask=served)
        tl.store(copy_dst_ptr + b * K + miss_rank, v_hot, mask=served)

    kv = tl.where(resident, gpage * PAGE + tok, tl.where(hit, hot_hit, tl.where(served, v_hot, -1)))
    tl.store(kv_ptr + b * K + offs_k, kv, mask=offs_k < K)
    tl.store(num_copied_ptr + b, num_served)


@triton.jit(do_not_specialize=["B", "K", "page_words", "group_words", "run_words"])
def _copy_kernel(
    num_copied_ptr, copy_src_ptr, copy_dst_ptr, host_ptr, gpu_ptr,
    B, K, page_words, group_words, run_words,
    PAGE: tl.constexpr, B_BLOCK: tl.constexpr, RUNS: tl.constexpr, RUN_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    total = 0
    for c0 in range(0, B, B_BLOCK):
        offs_b = c0 + tl.arange(0, B_BLOCK)
        total += tl.sum(tl.load(num_copied_ptr + offs_b, mask=offs_b < B, other=0), 0)
    offs_w = tl.arange(0, RUN_BLOCK)
    in_run = offs_w < run_words
    for first in range(tl.program_id(0) * RUNS, total, tl.num_programs(0) * RUNS):
        g = first + tl.arange(0, RUNS)
        live = g < total
        req = g * 0  # requests wholly before miss g, and their misses, over chunks of B_BLOCK requests
        before = g * 0
        ends = 0
        for c0 in range(0, B, B_BLOCK):
            offs_b = c0 + tl.arange(0, B_BLOCK)
            n = tl.load(num_copied_ptr + offs_b, mask=offs_b < B, other=0)
            done = (ends + tl.cumsum(n, 0))[None, :] <= g[:, None]
            req += tl.sum(done.to(tl.int32), 1)
            before += tl.sum(tl.where(done, n[None, :], 0), 1)
            ends += tl.sum(n, 0)
        idx = req.to(tl.int64) * K + (g - before)
        src = tl.load(copy_src_ptr + idx, mask=live, other=0)
        dst = tl.load(copy_dst_ptr + idx, mask=live, other=0)
        src_off = (src // PAGE).to(tl.int64) * page_words + group_words + (src % PAGE) * run_words
        dst_off = (dst // PAGE).to(tl.int64) * page_words + group_words + (dst % PAGE) * run_words
        mask = live[:, None] & in_run[None, :]
        words = tl.load(host_ptr + src_off[:, None] + offs_w[None, :], mask=mask)
        tl.store(gpu_ptr + dst_off[:, None] + offs_w[None, :], words, mask=mask)


# --- launchers -----------------------------------------------------------------------


class LeaseState(NamedTuple):
    """One request's LRU tables of one group: 1-D views that a resolve updates in place."""

    hot_slots: torch.Tensor  # [R] int32 physical slot of each hot slot
    slot_pos: torch.Tensor  # [R] int32 token held by each slot, -1 when empty
    slot_stamp: torch.Tensor  # [R] int32/int64 step of last use
    pos_to_hot: torch.Tensor  # [capacity] int16/int32 hot slot of each position, -1 when none


def _check_batch(topk_pos, counts, gpu_slot_of_page, host_page_of_page, step, group_offset, run_bytes,
                 gpu_pool, host_pool, page_size) -> None:
    b, k = topk_pos.shape
    expect = {
        "topk_pos": (topk_pos, (b, k)),
        "counts": (counts, (b,)),
        "gpu_slot_of_page": (gpu_slot_of_page, (b, gpu_slot_of_page.shape[-1])),
        "host_page_of_page": (host_page_of_page, tuple(gpu_slot_of_page.shape)),
    }
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape or t.dtype != torch.int32:
            raise ValueError(f"{name}: expected shape {shape} dtype int32, got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous() or t.device != gpu_pool.device:
            raise ValueError(f"{name} must be contiguous on {gpu_pool.device}")
    if isinstance(step, torch.Tensor) and (step.numel() != 1 or step.device != gpu_pool.device):
        raise ValueError("step must be an int or a one-element tensor on the pool's device")
    for name, pool in (("gpu_pool", gpu_pool), ("host_pool", host_pool)):
        if pool.dim() != 2 or pool.dtype != torch.uint8 or not pool.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [pages, page_bytes] uint8 tensor")
    if host_pool.shape[1] != gpu_pool.shape[1]:
        raise ValueError("host and GPU pages must have the same size")
    if gpu_pool.is_cuda and (host_pool.is_cuda or not _is_pinned(host_pool)):
        raise ValueError("host_pool must be a pinned CPU tensor (read through UVA)")
    if run_bytes <= 0 or group_offset < 0 or group_offset + page_size * run_bytes > gpu_pool.shape[1]:
        raise ValueError("the group's runs must lie inside a page")


def _check_tables(hot_slots, slot_pos, slot_stamp, pos_to_hot, device) -> None:
    """A [B, R] stack or one lease's [R] views: dtypes, matching slot counts, contiguity, device."""
    r = hot_slots.shape[-1]
    expect = {
        "hot_slots": (hot_slots, (torch.int32,)),
        "slot_pos": (slot_pos, (torch.int32,)),
        "slot_stamp": (slot_stamp, (torch.int32, torch.int64)),
        "pos_to_hot": (pos_to_hot, (torch.int16, torch.int32)),
    }
    for name, (t, dtypes) in expect.items():
        if t.dtype not in dtypes or (name != "pos_to_hot" and t.shape[-1] != r):
            raise ValueError(f"{name}: expected {r} slots of dtype in {dtypes}, got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"{name} must be contiguous on {device}")
    if pos_to_hot.dtype == torch.int16 and r > torch.iinfo(torch.int16).max:
        raise ValueError("an int16 reverse map holds at most 32767 hot slots")
    if r >= MAX_HOT_SLOTS:
        raise ValueError(f"a hot buffer holds fewer than {MAX_HOT_SLOTS} slots, got {r}")


def _is_pinned(host_pool: torch.Tensor) -> bool:
    """Pinned check, skipped while a CUDA graph is being captured (checked at the eager call)."""
    return torch.cuda.is_current_stream_capturing() or host_pool.is_pinned()


def _step_tensor(step: int | torch.Tensor, stamp_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.reshape(1).to(stamp_dtype)
    return torch.full((1,), step, dtype=stamp_dtype, device=device)


def _stacked_lease_table(hot_slots, slot_pos, slot_stamp, pos_to_hot) -> torch.Tensor:
    """Lease table rows of [B, R] stacked tables, computed on the device (capturable in a graph)."""
    b, r = hot_slots.shape
    rows = torch.arange(b, dtype=torch.int64, device=hot_slots.device)
    cols = [t.data_ptr() + rows * (t.stride(0) * t.element_size())
            for t in (hot_slots, slot_pos, slot_stamp, pos_to_hot)]
    cols += [torch.full_like(rows, r), torch.full_like(rows, pos_to_hot.shape[1])]
    return torch.stack(cols, 1)


def one_chunk_rows() -> int:
    """The most hot slots a lease may hold for the plan compiled without its chunked search."""
    return _R_BLOCK


def one_chunk(max_rows: int | None) -> bool:
    """Whether leases of at most `max_rows` hot slots (None: any size) are searched by the plan without its
    chunked path."""
    return max_rows is not None and max_rows <= _R_BLOCK


def _launch_plan(topk_pos, counts, gpu_slot_of_page, host_page_of_page, lease_table, stamp_dtype, map_dtype,
                 step, gpu_pool, out, page_size, num_warps, max_rows: int | None) -> ResolvePlan:
    """`max_rows`: a bound on every lease's hot slots that the caller guarantees (None: none)."""
    b, k = topk_pos.shape
    dev = gpu_pool.device
    kv_slots = torch.empty((b, k), dtype=torch.int32, device=dev) if out is None else out
    if (kv_slots.shape != (b, k) or kv_slots.dtype != torch.int32 or not kv_slots.is_contiguous()
            or kv_slots.device != dev):
        raise ValueError("out must be a contiguous [B, K] int32 tensor on the pool's device")
    num_copied = torch.empty(b, dtype=torch.int32, device=dev)
    work = torch.empty((3, b, k), dtype=torch.int32, device=dev)
    _plan_kernel[(b,)](
        topk_pos, counts, gpu_slot_of_page, host_page_of_page, lease_table, _step_tensor(step, stamp_dtype, dev),
        kv_slots, num_copied, work[0], work[1], work[2],
        k, gpu_slot_of_page.shape[1],
        PAGE=page_size, K_BLOCK=triton.next_power_of_2(k), R_BLOCK=_R_BLOCK, WAYS=_SEARCH_WAYS, BINS=_SEARCH_BINS,
        ONE_CHUNK=one_chunk(max_rows), STAMP64=stamp_dtype == torch.int64, MAP16=map_dtype == torch.int16,
        num_warps=num_warps,
        **pdl.launch_options(topk_pos.device)
    )
    return ResolvePlan(kv_slots, num_copied, work[1], work[2])


def plan_group(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
               pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, out=None,
               page_size: int = PAGE_SIZE, num_warps: int = 8) -> ResolvePlan:
    """The plan launch alone over [B, R] stacked tables: slots, LRU updates and the copy list."""
    _check_batch(topk_pos, counts, gpu_slot_of_page, host_page_of_page, step, group_offset, run_bytes,
                 gpu_pool, host_pool, page_size)
    _check_tables(hot_slots, slot_pos, slot_stamp, pos_to_hot, gpu_pool.device)
    if not hot_slots.shape[0] == slot_pos.shape[0] == slot_stamp.shape[0] == pos_to_hot.shape[0] == topk_pos.shape[0]:
        raise ValueError("stacked tables need one row per request")
    table = _stacked_lease_table(hot_slots, slot_pos, slot_stamp, pos_to_hot)
    return _launch_plan(topk_pos, counts, gpu_slot_of_page, host_page_of_page, table, slot_stamp.dtype,
                        pos_to_hot.dtype, step, gpu_pool, out, page_size, num_warps, hot_slots.shape[1])


def _word_views(gpu_pool, host_pool, group_offset, run_bytes) -> tuple[torch.Tensor, torch.Tensor, int]:
    """View both pools as int32 words when every run is 4-byte aligned, else bytes."""
    aligned = all(x % 4 == 0 for x in (gpu_pool.shape[1], group_offset, run_bytes,
                                         gpu_pool.data_ptr(), host_pool.data_ptr()))
    if aligned:
        return gpu_pool.view(torch.int32), host_pool.view(torch.int32), 4
    return gpu_pool, host_pool, 1


def copy_misses(plan: ResolvePlan, group_offset: int, run_bytes: int, gpu_pool: torch.Tensor,
                host_pool: torch.Tensor, page_size: int = PAGE_SIZE, num_warps: int = 4) -> None:
    """The copy launch: move every planned miss run host -> hot slot, grid over the whole batch."""
    b, k = plan.copy_src.shape
    gpu_words, host_words, word = _word_views(gpu_pool, host_pool, group_offset, run_bytes)
    if gpu_pool.is_cuda:
        sms = torch.cuda.get_device_properties(gpu_pool.device).multi_processor_count
        max_programs = sms * _COPY_PROGRAMS_PER_SM
    else:
        max_programs = 2
    grid = (max(1, min(triton.cdiv(b * k, _COPY_RUNS_PER_PROGRAM), max_programs)),)
    _copy_kernel[grid](
        plan.num_copied, plan.copy_src, plan.copy_dst, host_words, gpu_words,
        b, k, gpu_pool.shape[1] // word, group_offset // word, run_bytes // word,
        PAGE=page_size, B_BLOCK=_B_BLOCK, RUNS=_COPY_RUNS_PER_PROGRAM,
        RUN_BLOCK=triton.next_power_of_2(run_bytes // word), num_warps=num_warps,
        **pdl.launch_options(plan.num_copied.device)
    )


def resolve_group(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
                  pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, out=None,
                  page_size: int = PAGE_SIZE) -> ResolveResult:
    """Resolve one group for a batch (plan + copy launches); updates the LRU state in place.

    topk_pos [B, K] int32, counts [B] int32, gpu_slot_of_page / host_page_of_page
    [B, max_pages] int32 (GPU page or negative; host page), hot_slots [B, R] int32,
    slot_pos [B, R] int32, slot_stamp [B, R] int32/int64, pos_to_hot [B, max_ctx]
    int16/int32, step int or one-element tensor (use a tensor under graph capture),
    group byte offset and run bytes inside a page, gpu_pool / host_pool
    [pages, page_bytes] uint8 (host pinned when the GPU pool is on CUDA).
    """
    plan = plan_group(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos,
                      slot_stamp, pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool,
                      out=out, page_size=page_size)
    copy_misses(plan, group_offset, run_bytes, gpu_pool, host_pool, page_size=page_size)
    return ResolveResult(plan.kv_slots, plan.num_copied)


def resolve_leases(topk_pos, counts, gpu_slot_of_page, host_page_of_page, leases: Sequence[LeaseState | None], step,
                   group_offset, run_bytes, gpu_pool, host_pool, out=None, page_size: int = PAGE_SIZE) -> ResolveResult:
    """`resolve_group` over each request's own tables (`leases[b]` for row b, None for a row whose pages
    are all resident), read and updated where they live: requests with hot buffers of different sizes
    resolve in one launch, nothing is stacked or written back. The lease table is built on the host
    here; `resolve_lease_table` takes one already on the device (a graph's persistent buffer)."""
    if len(leases) != topk_pos.shape[0]:
        raise ValueError(f"{topk_pos.shape[0]} rows need as many leases, got {len(leases)}")
    held = [lease for lease in leases if lease is not None]
    for lease in held:
        _check_tables(*lease, gpu_pool.device)
    stamp_dtype = held[0].slot_stamp.dtype if held else torch.int64
    map_dtype = held[0].pos_to_hot.dtype if held else torch.int32
    if any(lease.slot_stamp.dtype != stamp_dtype or lease.pos_to_hot.dtype != map_dtype for lease in held):
        raise ValueError("every lease of one resolve needs the same stamp and reverse-map dtypes")
    table = lease_table(leases).to(gpu_pool.device, non_blocking=True)
    return resolve_lease_table(topk_pos, counts, gpu_slot_of_page, host_page_of_page, table, stamp_dtype, map_dtype,
                               step, group_offset, run_bytes, gpu_pool, host_pool, out=out, page_size=page_size,
                               max_rows=widest_lease(leases))


def widest_lease(leases: Sequence[LeaseState | None]) -> int:
    """The most hot slots any of `leases` holds (0: none holds any)."""
    return max((lease.hot_slots.numel() for lease in leases if lease is not None), default=0)


def lease_table(leases: Sequence[LeaseState | None]) -> torch.Tensor:
    """[B, LEASE_WIDTH] int64 host rows of separate leases: their addresses and sizes (zeros for a row
    without a lease, whose positions must all be resident)."""
    if any(lease is not None and lease.hot_slots.numel() >= MAX_HOT_SLOTS for lease in leases):
        raise ValueError(f"a hot buffer holds fewer than {MAX_HOT_SLOTS} slots")
    rows = [[0] * LEASE_WIDTH if lease is None else
            [*(t.data_ptr() for t in lease), lease.hot_slots.numel(), lease.pos_to_hot.numel()] for lease in leases]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(leases), LEASE_WIDTH)


def resolve_lease_table(topk_pos, counts, gpu_slot_of_page, host_page_of_page, table: torch.Tensor,
                        stamp_dtype: torch.dtype, map_dtype: torch.dtype, step, group_offset, run_bytes, gpu_pool,
                        host_pool, out=None, page_size: int = PAGE_SIZE, max_rows: int | None = None) -> ResolveResult:
    """`resolve_leases` with the lease table [B, LEASE_WIDTH] already on the device: nothing here reads
    host data, so a CUDA graph can capture it (with `step` a device tensor) and replay it after the
    table's rows were rewritten in place. `max_rows` bounds every lease's hot slots at every replay, as the
    caller guarantees (None: any size); a plan for leases of at most `_R_BLOCK` slots compiles without the
    chunked search (`one_chunk`), and a lease past the bound would be searched in its first `_R_BLOCK` slots."""
    _check_batch(topk_pos, counts, gpu_slot_of_page, host_page_of_page, step, group_offset, run_bytes,
                 gpu_pool, host_pool, page_size)
    if table.shape != (topk_pos.shape[0], LEASE_WIDTH) or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError(f"the lease table must be a contiguous [{topk_pos.shape[0]}, {LEASE_WIDTH}] int64 tensor")
    plan = _launch_plan(topk_pos, counts, gpu_slot_of_page, host_page_of_page, table, stamp_dtype, map_dtype, step,
                        gpu_pool, out, page_size, num_warps=8, max_rows=max_rows)
    copy_misses(plan, group_offset, run_bytes, gpu_pool, host_pool, page_size=page_size)
    return ResolveResult(plan.kv_slots, plan.num_copied)


# --- PyTorch twin --------------------------------------------------------------------


def _rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return mask.nonzero(as_tuple=True)


def resolve_group_reference(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos,
                            slot_stamp, pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool,
                            out=None, page_size: int = PAGE_SIZE) -> ResolveResult:
    """Plain PyTorch twin of `resolve_group`: same outputs, same state updates, same bytes."""
    _check_batch(topk_pos, counts, gpu_slot_of_page, host_page_of_page, step, group_offset, run_bytes,
                 gpu_pool, host_pool, page_size)
    _check_tables(hot_slots, slot_pos, slot_stamp, pos_to_hot, gpu_pool.device)
    b, k = topk_pos.shape
    r = hot_slots.shape[1]
    dev = gpu_pool.device
    step = int(step.reshape(-1)[0]) if isinstance(step, torch.Tensor) else int(step)
    valid = torch.arange(k, device=dev)[None, :] < counts[:, None].clamp(max=k)
    pos = torch.where(valid, topk_pos, 0).long()
    page, tok = pos // page_size, pos % page_size
    gpage = gpu_slot_of_page.gather(1, page)
    resident = valid & (gpage >= 0)
    h = pos_to_hot.gather(1, pos).long()
    hit = valid & (gpage < 0) & (h >= 0)
    miss = valid & (gpage < 0) & (h < 0)
    bi, ki = _rows(hit)
    slot_stamp[bi, h[bi, ki]] = step

    key = torch.where(slot_pos < 0, -1, slot_stamp.long())
    cand = key < step
    num_miss = miss.sum(1)
    num_served = torch.minimum(num_miss, cand.sum(1))
    # stable sort by key puts ties in slot order: the first num_served are the victims
    order = torch.sort(torch.where(cand, key, step), dim=1, stable=True).indices
    chosen = torch.arange(r, device=dev)[None, :] < num_served[:, None]
    is_victim = torch.zeros_like(cand).scatter_(1, order, chosen)
    victims = torch.sort(torch.where(is_victim, torch.arange(r, device=dev), r), dim=1).values
    miss_rank = miss.long().cumsum(1) - 1
    served = miss & (miss_rank < num_served[:, None])
    v = victims.gather(1, miss_rank.clamp(0, r - 1))

    bi, ki = _rows(served)
    vb = v[bi, ki]
    old = slot_pos[bi, vb].long()
    keep = old >= 0
    pos_to_hot[bi[keep], old[keep]] = -1
    pos_to_hot[bi, pos[bi, ki]] = vb.to(pos_to_hot.dtype)
    slot_pos[bi, vb] = pos[bi, ki].int()
    slot_stamp[bi, vb] = step

    hot = hot_slots.gather(1, torch.where(hit, h, v).clamp(0, r - 1)).long()
    kv = torch.where(resident, gpage.long() * page_size + tok, torch.where(hit | served, hot, -1))
    kv_slots = torch.empty((b, k), dtype=torch.int32, device=dev) if out is None else out
    kv_slots.copy_(kv)
    _copy_runs_reference(host_page_of_page[bi, page[bi, ki]].long(), tok[bi, ki], hot[bi, ki],
                         group_offset, run_bytes, gpu_pool, host_pool, page_size)
    return ResolveResult(kv_slots, num_served.int())


def resolve_leases_reference(topk_pos, counts, gpu_slot_of_page, host_page_of_page,
                             leases: Sequence[LeaseState | None], step, group_offset, run_bytes, gpu_pool, host_pool,
                             out=None, page_size: int = PAGE_SIZE) -> ResolveResult:
    """Plain PyTorch twin of `resolve_leases`: the stacked twin on each request's own tables in turn
    (requests touch disjoint slots, so one at a time equals one launch for all); a row without a lease
    reads its resident slots."""
    if len(leases) != topk_pos.shape[0]:
        raise ValueError(f"{topk_pos.shape[0]} rows need as many leases, got {len(leases)}")
    kv_slots = torch.empty(topk_pos.shape, dtype=torch.int32, device=gpu_pool.device) if out is None else out
    num_copied = torch.zeros(len(leases), dtype=torch.int32, device=gpu_pool.device)
    for b, lease in enumerate(leases):
        one = slice(b, b + 1)
        if lease is None:
            valid = torch.arange(topk_pos.shape[1], device=gpu_pool.device) < counts[b].clamp(max=topk_pos.shape[1])
            pos = torch.where(valid, topk_pos[b], 0).long()
            gpage = gpu_slot_of_page[b].long()[pos // page_size]
            kv_slots[b] = torch.where(valid, gpage * page_size + pos % page_size, -1).to(torch.int32)
            continue
        result = resolve_group_reference(
            topk_pos[one], counts[one], gpu_slot_of_page[one], host_page_of_page[one],
            *(t[None] for t in lease), step, group_offset, run_bytes, gpu_pool, host_pool, page_size=page_size)
        kv_slots[one], num_copied[one] = result.kv_slots, result.num_copied
    return ResolveResult(kv_slots, num_copied)

def _group_runs(pool: torch.Tensor, group_offset: int, run_bytes: int, page_size: int) -> torch.Tensor:
    """[pages, page_size, run_bytes] strided view of one group's runs."""
    block = pool[:, group_offset : group_offset + page_size * run_bytes]
    return block.unflatten(1, (page_size, run_bytes))


def _copy_runs_reference(host_pages, toks, dst_slots, group_offset, run_bytes, gpu_pool, host_pool,
                         page_size) -> None:
    if host_pages.numel() == 0:
        return
    src = _group_runs(host_pool, group_offset, run_bytes, page_size)
    dst = _group_runs(gpu_pool, group_offset, run_bytes, page_size)
    rows = src[host_pages.cpu(), toks.cpu()]
    dst[dst_slots // page_size, dst_slots % page_size] = rows.to(gpu_pool.device)
