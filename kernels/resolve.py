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
   on the per-slot stamps plus prefix-sum compaction, update the LRU state in
   place and write a compacted list of (host slot, hot slot) copies;
2. copy (a persistent grid over every miss of the batch): each program maps
   global miss numbers to (request, miss) with a prefix sum over the per-request
   counts and moves whole runs, reading the pinned host tensor directly (UVA).

Caller guarantees: positions are unique within a row; the newest token's page
is resident; `R >= count` (hot_rows >= top-K); step numbers grow from call to
call and stay below 2**60. If a row still has more misses than victims (slots
not used this step), the extra misses resolve to -1 and copy nothing. Entries
past `count` are -1.

`resolve_group` runs both launches; `plan_group` and `copy_misses` are the two
halves (the copy can go on a side stream as prefetch for the group's shared
layers). They are the Triton path (CUDA, or CPU under TRITON_INTERPRET=1);
`resolve_group_reference` is the plain PyTorch twin with the same signature and
the same effects, byte for byte. H200 numbers: bench/RESULTS.md (plan
8.4 us at B=100 without misses in a CUDA graph; miss copy 85-100% of the UVA
gather ceiling from about 1.7 MB per launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

PAGE_SIZE = 64
_COPY_RUNS_PER_PROGRAM = 4
_COPY_PROGRAMS_PER_SM = 8
_SEARCH_WAYS = 4  # threshold probes per round of the victim search


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


@triton.jit
def _plan_kernel(
    topk_ptr, counts_ptr, gpu_page_ptr, host_page_ptr, hot_slots_ptr,
    slot_pos_ptr, slot_stamp_ptr, pos_to_hot_ptr, step_ptr,
    kv_ptr, num_copied_ptr, victim_ptr, copy_src_ptr, copy_dst_ptr,
    K, R, max_pages, max_ctx,
    PAGE: tl.constexpr, K_BLOCK: tl.constexpr, R_BLOCK: tl.constexpr, WAYS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    step = tl.load(step_ptr)
    stamp_row = slot_stamp_ptr + b * R
    held_row = slot_pos_ptr + b * R
    map_row = pos_to_hot_ptr + b * max_ctx

    # classify: resident page, hot hit through the reverse map, miss
    offs_k = tl.arange(0, K_BLOCK)
    valid = offs_k < tl.minimum(tl.load(counts_ptr + b), K)
    pos = tl.load(topk_ptr + b * K + offs_k, mask=valid, other=0)
    page, tok = pos // PAGE, pos % PAGE
    gpage = tl.load(gpu_page_ptr + b * max_pages + page, mask=valid, other=-1)
    resident = valid & (gpage >= 0)
    lookup = valid & (gpage < 0)
    h = tl.load(map_row + pos, mask=lookup, other=-1).to(tl.int32)
    hit = lookup & (h >= 0)
    miss = lookup & (h < 0)
    tl.store(stamp_row + h, step, mask=hit)
    num_miss = tl.sum(miss.to(tl.int32), 0)

    # misses only: victims, reverse-map and LRU updates, the copy list
    num_served = num_miss * 0
    served = offs_k < 0
    v = h * 0
    miss_rank = h * 0
    if num_miss > 0:
        tl.debug_barrier()  # hit stamps are visible: hit slots are not candidates
        offs_r = tl.arange(0, R_BLOCK)
        rmask = offs_r < R
        held = tl.load(held_row + offs_r, mask=rmask, other=-1)
        key = tl.where(held < 0, -1, tl.load(stamp_row + offs_r, mask=rmask, other=0))
        cand = rmask & (key < step)
        num_served = tl.minimum(num_miss, tl.sum(cand.to(tl.int32), 0))
        lo = tl.min(tl.where(cand, key, step), 0)
        hi = tl.max(tl.where(cand, key, -2), 0)
        ways = tl.arange(0, WAYS)
        while lo < hi:  # smallest threshold with num_miss candidates at or below it, WAYS probes a round
            probe = lo + ((hi - lo).to(tl.int64) * (ways + 1) // (WAYS + 1)).to(lo.dtype)
            at_or_below = cand[:, None] & (key[:, None] <= probe[None, :])
            enough = tl.sum(at_or_below.to(tl.int32), 0) >= num_miss
            hi = tl.min(tl.where(enough, probe, hi), 0)
            lo = tl.max(tl.where(enough, lo, probe + 1), 0)
        below = cand & (key < lo)
        at = cand & (key == lo)
        at_rank = tl.cumsum(at.to(tl.int32), 0) - 1
        victim = below | (at & (at_rank < num_miss - tl.sum(below.to(tl.int32), 0)))
        victim_rank = tl.cumsum(victim.to(tl.int32), 0) - 1
        tl.store(victim_ptr + b * K + victim_rank, offs_r, mask=victim)
        tl.debug_barrier()
        # victims go to misses in top-K order
        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        served = miss & (miss_rank < num_served)
        v = tl.load(victim_ptr + b * K + miss_rank, mask=served, other=0)
        old = tl.load(held_row + v, mask=served, other=-1)
        tl.store(map_row + old, -1, mask=served & (old >= 0))
        tl.debug_barrier()
        tl.store(map_row + pos, v, mask=served)
        tl.store(held_row + v, pos, mask=served)
        tl.store(stamp_row + v, step, mask=served)
        host_page = tl.load(host_page_ptr + b * max_pages + page, mask=served, other=0)
        tl.store(copy_src_ptr + b * K + miss_rank, host_page * PAGE + tok, mask=served)

    use = hit | served
    hot = tl.load(hot_slots_ptr + b * R + tl.where(hit, h, v), mask=use, other=-1)
    kv = tl.where(resident, gpage * PAGE + tok, tl.where(use, hot, -1))
    tl.store(kv_ptr + b * K + offs_k, kv, mask=offs_k < K)
    tl.store(copy_dst_ptr + b * K + miss_rank, hot, mask=served)
    tl.store(num_copied_ptr + b, num_served)


@triton.jit
def _copy_kernel(
    num_copied_ptr, copy_src_ptr, copy_dst_ptr, host_ptr, gpu_ptr,
    B, K, page_words, group_words, run_words,
    PAGE: tl.constexpr, B_BLOCK: tl.constexpr, RUNS: tl.constexpr, RUN_BLOCK: tl.constexpr,
):
    offs_b = tl.arange(0, B_BLOCK)
    n = tl.load(num_copied_ptr + offs_b, mask=offs_b < B, other=0)
    ends = tl.cumsum(n, 0)
    total = tl.sum(n, 0)
    offs_w = tl.arange(0, RUN_BLOCK)
    in_run = offs_w < run_words
    for first in range(tl.program_id(0) * RUNS, total, tl.num_programs(0) * RUNS):
        g = first + tl.arange(0, RUNS)
        live = g < total
        done = ends[None, :] <= g[:, None]  # requests wholly before miss g
        req = tl.sum(done.to(tl.int32), 1)
        m = g - tl.sum(tl.where(done, n[None, :], 0), 1)
        idx = req.to(tl.int64) * K + m
        src = tl.load(copy_src_ptr + idx, mask=live, other=0)
        dst = tl.load(copy_dst_ptr + idx, mask=live, other=0)
        src_off = (src // PAGE).to(tl.int64) * page_words + group_words + (src % PAGE) * run_words
        dst_off = (dst // PAGE).to(tl.int64) * page_words + group_words + (dst % PAGE) * run_words
        mask = live[:, None] & in_run[None, :]
        words = tl.load(host_ptr + src_off[:, None] + offs_w[None, :], mask=mask)
        tl.store(gpu_ptr + dst_off[:, None] + offs_w[None, :], words, mask=mask)


# --- launchers -----------------------------------------------------------------------


def _check(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
           pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, page_size) -> None:
    b, k = topk_pos.shape
    r = hot_slots.shape[1]
    expect = {
        "topk_pos": (topk_pos, (b, k), (torch.int32,)),
        "counts": (counts, (b,), (torch.int32,)),
        "gpu_slot_of_page": (gpu_slot_of_page, (b, gpu_slot_of_page.shape[-1]), (torch.int32,)),
        "host_page_of_page": (host_page_of_page, tuple(gpu_slot_of_page.shape), (torch.int32,)),
        "hot_slots": (hot_slots, (b, r), (torch.int32,)),
        "slot_pos": (slot_pos, (b, r), (torch.int32,)),
        "slot_stamp": (slot_stamp, (b, r), (torch.int32, torch.int64)),
        "pos_to_hot": (pos_to_hot, (b, pos_to_hot.shape[-1]), (torch.int16, torch.int32)),
    }
    for name, (t, shape, dtypes) in expect.items():
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(f"{name}: expected shape {shape} dtype in {dtypes}, got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous() or t.device != gpu_pool.device:
            raise ValueError(f"{name} must be contiguous on {gpu_pool.device}")
    if pos_to_hot.dtype == torch.int16 and r > torch.iinfo(torch.int16).max:
        raise ValueError("an int16 reverse map holds at most 32767 hot slots")
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


def _is_pinned(host_pool: torch.Tensor) -> bool:
    """Pinned check, skipped while a CUDA graph is being captured (checked at the eager call)."""
    return torch.cuda.is_current_stream_capturing() or host_pool.is_pinned()


def _step_tensor(step: int | torch.Tensor, stamp: torch.Tensor) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.reshape(1).to(stamp.dtype)
    return torch.full((1,), step, dtype=stamp.dtype, device=stamp.device)


def plan_group(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
               pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, out=None,
               page_size: int = PAGE_SIZE, num_warps: int = 8) -> ResolvePlan:
    """The plan launch alone: slots, LRU updates and the copy list; copies nothing."""
    _check(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
           pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, page_size)
    b, k = topk_pos.shape
    r = hot_slots.shape[1]
    kv_slots = torch.empty((b, k), dtype=torch.int32, device=gpu_pool.device) if out is None else out
    if (kv_slots.shape != (b, k) or kv_slots.dtype != torch.int32 or not kv_slots.is_contiguous()
            or kv_slots.device != gpu_pool.device):
        raise ValueError("out must be a contiguous [B, K] int32 tensor on the pool's device")
    num_copied = torch.empty(b, dtype=torch.int32, device=gpu_pool.device)
    work = torch.empty((3, b, k), dtype=torch.int32, device=gpu_pool.device)
    _plan_kernel[(b,)](
        topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots,
        slot_pos, slot_stamp, pos_to_hot, _step_tensor(step, slot_stamp),
        kv_slots, num_copied, work[0], work[1], work[2],
        k, r, gpu_slot_of_page.shape[1], pos_to_hot.shape[1],
        PAGE=page_size, K_BLOCK=triton.next_power_of_2(k), R_BLOCK=triton.next_power_of_2(r),
        WAYS=_SEARCH_WAYS, num_warps=num_warps,
    )
    return ResolvePlan(kv_slots, num_copied, work[1], work[2])


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
        PAGE=page_size, B_BLOCK=triton.next_power_of_2(b), RUNS=_COPY_RUNS_PER_PROGRAM,
        RUN_BLOCK=triton.next_power_of_2(run_bytes // word), num_warps=num_warps,
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


# --- PyTorch twin --------------------------------------------------------------------


def _rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return mask.nonzero(as_tuple=True)


def resolve_group_reference(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos,
                            slot_stamp, pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool,
                            out=None, page_size: int = PAGE_SIZE) -> ResolveResult:
    """Plain PyTorch twin of `resolve_group`: same outputs, same state updates, same bytes."""
    _check(topk_pos, counts, gpu_slot_of_page, host_page_of_page, hot_slots, slot_pos, slot_stamp,
           pos_to_hot, step, group_offset, run_bytes, gpu_pool, host_pool, page_size)
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
