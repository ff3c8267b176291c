"""Expert alignment for the fused MoE: routing slots grouped by expert, padded to whole blocks.

For topk_ids [T, k], slot s = t*k + j routes token t to expert topk_ids[t, j].
`moe_align` lists the slots grouped by expert (ascending within an expert),
each expert's run padded to a multiple of block_m with the sentinel T*k, and
the expert of every block, so that a grouped GEMM program takes one block and
one expert. Output sizes depend only on (T*k, E, block_m) (`moe_align_sizes`),
never on the routing; no host synchronisation: CUDA-graph capturable. Ids
outside [0, E) are left out (a rank without an expert passes -1).

The fused MoE's decode tiles up to `kernels.fused_moe.SLOT_LED_MAX_SLOTS` slots
find their blocks in gate/up's own programs instead; the larger decode batches
and the prefill tiles align here.

Launches: for T*k <= ONE_LAUNCH_ALIGN (decode batches) one launch of programs
that each own EXPERTS_PER_PROGRAM experts: every program reads all the slots
and counts them per expert (each expert's padded start), then ranks its own
experts' slots by a running count along the slots. Above that (prefill
chunks, where every program counting every slot would repeat the most work),
a per-chunk count launch and a scatter launch. Deterministic: no atomics
decide an order. Contents: the PyTorch twin `moe_align_ref`, the Triton
kernels and the launcher `moe_align`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import _interpreting


ID_DTYPES = (torch.int32, torch.int64)
ALIGN_CHUNK = 128  # slots per program of the multi-program alignment (prefill chunks)
ONE_LAUNCH_ALIGN = 1024  # up to this many slots one launch aligns them (H200, E = 257, k = 9, 16 routings in a CUDA
# graph: 3.95 / 4.55 / 5.11 / 7.36 us at 72 / 144 / 288 / 576 slots, where one program sorting every slot took 5.20 /
# 6.09 / 7.88 / 10.50, passes over 64-slot sub-blocks 15.6-24.9 and the count and scatter launches 21-23, which
# win from 1,152 slots: 22.9 against 24.8)
EXPERTS_PER_PROGRAM = 4  # experts whose slots one program of that launch places (E = 257: 65 programs of 4 warps;
# 8 experts a program 4.30 / 5.41 / 6.44 / 9.06 us, 16 5.31-15.10, and 2 warps lose from 144 slots)


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32 slot indices t*k + j grouped by expert; sentinel T*k pads
    expert_of_block: torch.Tensor  # [max_blocks] int32 expert of each BLOCK_M block; -1 past num_padded
    num_padded: torch.Tensor  # [1] int32 slots in use (a multiple of BLOCK_M)


def moe_align_sizes(num_slots: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks) of `moe_align`: at most min(E, T*k) experts hold slots, each padded by at most
    block_m - 1, so max_padded = T*k + min(E, T*k) * (block_m - 1) rounded up to block_m."""
    busy = min(num_experts, num_slots)
    max_padded = triton.cdiv(num_slots + busy * (block_m - 1), block_m) * block_m
    return max_padded, max_padded // block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Plain PyTorch alignment (stable sort), equal to `moe_align` element for element."""
    _check_align(topk_ids, num_experts, block_m, kernel=False)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    max_padded, max_blocks = moe_align_sizes(n, num_experts, block_m)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    skey = key[order]
    ok = skey < num_experts
    e = skey.clamp(max=num_experts - 1)
    first = (counts.cumsum(0) - counts)[e]  # sorted position of each expert's first slot
    dest = starts[e] + torch.arange(n, device=dev) - first
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest[ok]] = order[ok].to(torch.int32)
    num_padded = padded.sum()
    blocks = torch.arange(max_blocks, device=dev) * block_m
    eob = torch.searchsorted(ends, blocks, right=True)
    eob = torch.where(blocks < num_padded, eob, torch.full_like(eob, -1)).to(torch.int32)
    return MoEAlignment(sorted_ids, eob, num_padded.reshape(1).to(torch.int32))


@triton.jit
def _load_ids(ids_ptr, offs, num_slots, num_experts, top_k, stride_it, stride_ij):
    inb = offs < num_slots
    e = tl.load(ids_ptr + (offs // top_k) * stride_it + (offs % top_k) * stride_ij, mask=inb, other=-1).to(tl.int32)
    return e, inb & (e >= 0) & (e < num_experts)


@triton.jit
def _count_chunk(ids_ptr, start, num_slots, num_experts, top_k, stride_it, stride_ij,
                 BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Slots per expert among slots start .. start + CHUNK - 1 (one-hot sums over SUB slots at a time)."""
    ex = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for i0 in range(0, CHUNK, SUB):
        e, ok = _load_ids(ids_ptr, start + i0 + tl.arange(0, SUB), num_slots, num_experts, top_k, stride_it, stride_ij)
        counts += tl.sum(((e[:, None] == ex[None, :]) & ok[:, None]).to(tl.int32), axis=0)
    return counts


@triton.jit(do_not_specialize=["num_slots"])
def _align_count_kernel(ids_ptr, hist_ptr, num_slots, num_experts, top_k, stride_it, stride_ij,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    c = tl.program_id(0)
    counts = _count_chunk(ids_ptr, c * CHUNK, num_slots, num_experts, top_k, stride_it, stride_ij, BLOCK_E, CHUNK, SUB)
    tl.store(hist_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit(do_not_specialize=["num_slots", "num_chunks", "max_padded", "max_blocks"])
def _align_scatter_kernel(
    ids_ptr, hist_ptr, base_ptr, sorted_ptr, eob_ptr, npad_ptr,
    num_slots, num_experts, num_chunks, max_padded, max_blocks, top_k, stride_it, stride_ij,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    HIST_ROWS: tl.constexpr, TAIL: tl.constexpr, SUB: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    c = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    idx = tl.arange(0, CHUNK)
    offs = c * CHUNK + idx
    e, ok = _load_ids(ids_ptr, offs, num_slots, num_experts, top_k, stride_it, stride_ij)
    # Counts per expert over all slots, and over the slots of the chunks before this one.
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, num_chunks, HIST_ROWS):
        rows = r0 + tl.arange(0, HIST_ROWS)
        hist = tl.load(hist_ptr + rows[:, None] * BLOCK_E + ex[None, :], mask=rows[:, None] < num_chunks, other=0)
        total += tl.sum(hist, axis=0)
        before += tl.sum(tl.where(rows[:, None] < c, hist, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    num_padded = tl.sum(padded, axis=0)

    # Slots: the expert's start, the earlier chunks' slots of the expert, the earlier slots of this chunk
    # (ranks in sub-blocks of SUB slots against the whole chunk, to keep the comparison tile small).
    tl.store(base_ptr + c * BLOCK_E + ex, starts + before)
    tl.debug_barrier()  # the stores above are read back (gathered by expert) below
    for i0 in range(0, CHUNK, SUB):
        sub = i0 + tl.arange(0, SUB)
        e_i, ok_i = _load_ids(ids_ptr, c * CHUNK + sub, num_slots, num_experts, top_k, stride_it, stride_ij)
        same = (e_i[:, None] == e[None, :]) & (idx[None, :] < sub[:, None]) & ok[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        pos = tl.load(base_ptr + c * BLOCK_E + tl.where(ok_i, e_i, 0), mask=ok_i, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + pos + rank, c * CHUNK + sub, mask=ok_i)

    # Padding after each expert's slots (experts e with e % num_chunks == c), PAD columns at a time.
    mine = (ex % num_chunks) == c
    pad_end = padded - total
    for j0 in range(0, BLOCK_M, PAD):
        col = j0 + tl.arange(0, PAD)
        pad_mask = mine[:, None] & (col[None, :] < pad_end[:, None])
        tl.store(sorted_ptr + (starts + total)[:, None] + col[None, :], num_slots, mask=pad_mask)

    # Expert of each block in use, -1 after; sentinel after num_padded.
    nblk = padded // BLOCK_M
    sblk = starts // BLOCK_M
    for r in range(c, tl.max(nblk, axis=0), num_chunks):
        tl.store(eob_ptr + sblk + r, ex, mask=r < nblk)
    used_blocks = num_padded // BLOCK_M
    for t0 in range(c * TAIL, max_blocks, num_chunks * TAIL):
        b = t0 + tl.arange(0, TAIL)
        tl.store(eob_ptr + b, tl.full([TAIL], -1, tl.int32), mask=(b >= used_blocks) & (b < max_blocks))
    for t0 in range(c * TAIL, max_padded, num_chunks * TAIL):
        p = t0 + tl.arange(0, TAIL)
        tl.store(sorted_ptr + p, tl.zeros([TAIL], dtype=tl.int32) + num_slots,
                 mask=(p >= num_padded) & (p < max_padded))
    if c == 0:
        tl.store(npad_ptr, num_padded)


@triton.jit(do_not_specialize=["num_slots", "max_padded", "max_blocks"])
def _align_experts_kernel(
    ids_ptr, sorted_ptr, eob_ptr, npad_ptr,
    num_slots, num_experts, max_padded, max_blocks, top_k, stride_it, stride_ij,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr,
    TAIL: tl.constexpr, PDL: tl.constexpr,
):
    """Program p places the slots of experts p * EXPERTS .. + EXPERTS - 1: every program reads all the slots and
    counts them per expert (each expert's padded start), then ranks the slots of its own experts (a running count
    along the slots) and stores them, their padding and their blocks' expert; the unused tail is shared out.
    Slots left out (ids outside [0, E), lanes past num_slots) are never stored."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    p = tl.program_id(0)
    s = tl.arange(0, BLOCK_N)
    ex = tl.arange(0, BLOCK_E)
    e, ok = _load_ids(ids_ptr, s, num_slots, num_experts, top_k, stride_it, stride_ij)
    total = tl.histogram(tl.where(ok, e, BLOCK_E - 1), BLOCK_E)
    total = tl.where(ex < num_experts, total, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    num_padded = tl.sum(padded, axis=0)

    mine = p * EXPERTS + tl.arange(0, EXPERTS)
    own = ex[None, :] == mine[:, None]
    m_start = tl.sum(tl.where(own, starts[None, :], 0), axis=1)
    m_total = tl.sum(tl.where(own, total[None, :], 0), axis=1)
    m_blocks = (m_total + BLOCK_M - 1) // BLOCK_M
    hit = (e[None, :] == mine[:, None]) & ok[None, :]
    rank = tl.cumsum(hit.to(tl.int32), axis=1) - 1
    tl.store(sorted_ptr + m_start[:, None] + rank, tl.broadcast_to(s[None, :], rank.shape), mask=hit)
    col = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (m_start + m_total)[:, None] + col[None, :], num_slots,
             mask=col[None, :] < (m_blocks * BLOCK_M - m_total)[:, None])
    for r in range(0, tl.max(m_blocks, axis=0)):
        tl.store(eob_ptr + m_start // BLOCK_M + r, mine, mask=r < m_blocks)

    used_blocks = num_padded // BLOCK_M
    step = tl.num_programs(0) * TAIL
    for t0 in range(p * TAIL, max_blocks, step):
        b = t0 + tl.arange(0, TAIL)
        tl.store(eob_ptr + b, tl.full([TAIL], -1, tl.int32), mask=(b >= used_blocks) & (b < max_blocks))
    for t0 in range(p * TAIL, max_padded, step):
        q = t0 + tl.arange(0, TAIL)
        tl.store(sorted_ptr + q, tl.zeros([TAIL], dtype=tl.int32) + num_slots,
                 mask=(q >= num_padded) & (q < max_padded))
    if p == 0:
        tl.store(npad_ptr, num_padded)


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, kernel: bool) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids must be int32/int64 [T, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids must have k >= 1 columns")
    if not isinstance(num_experts, int) or not 1 <= num_experts <= 1024:
        raise ValueError(f"num_experts must be an int in [1, 1024], got {num_experts!r}")
    if not isinstance(block_m, int) or block_m < 1 or block_m > 256 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two in [1, 256], got {block_m!r}")
    if topk_ids.numel() >= 2**30:
        raise ValueError("too many slots (T*k must stay below 2**30)")
    if kernel and topk_ids.device.type != "cuda" and not _interpreting():
        raise ValueError(f"topk_ids is on {topk_ids.device}: the Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1)")


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Triton: slots t*k + j grouped by expert (ascending within an expert), each expert's run padded to a
    multiple of block_m with the sentinel T*k; sizes from `moe_align_sizes`. Blocks of sorted_ids at and
    after num_padded hold the sentinel and expert -1. Ids outside [0, E) are left out. No host sync."""
    _check_align(topk_ids, num_experts, block_m, kernel=True)
    dev = topk_ids.device
    n = topk_ids.numel()
    max_padded, max_blocks = moe_align_sizes(n, num_experts, block_m)
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    eob = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    if n == 0:
        num_padded.zero_()
        return MoEAlignment(sorted_ids, eob, num_padded)
    k = topk_ids.shape[1]
    si, sj = topk_ids.stride()
    if n <= ONE_LAUNCH_ALIGN:
        block_n = max(16, triton.next_power_of_2(n))
        _align_experts_kernel[(triton.cdiv(num_experts, EXPERTS_PER_PROGRAM),)](
            topk_ids, sorted_ids, eob, num_padded, n, num_experts, max_padded, max_blocks, k, si, sj,
            BLOCK_N=block_n, BLOCK_E=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
            EXPERTS=EXPERTS_PER_PROGRAM, TAIL=512, num_warps=4, **pdl.launch_options(topk_ids.device)
        )
        return MoEAlignment(sorted_ids, eob, num_padded)
    block_e = max(32, triton.next_power_of_2(num_experts))
    chunks = triton.cdiv(n, ALIGN_CHUNK)
    base = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)  # per-chunk slot bases (scratch)
    hist = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](topk_ids, hist, n, num_experts, k, si, sj,
                                   BLOCK_E=block_e, CHUNK=ALIGN_CHUNK, SUB=32, num_warps=4,
                                   **pdl.launch_options(topk_ids.device))
    _align_scatter_kernel[(chunks,)](
        topk_ids, hist, base, sorted_ids, eob, num_padded,
        n, num_experts, chunks, max_padded, max_blocks, k, si, sj,
        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, HIST_ROWS=16, TAIL=1024, SUB=32,
        PAD=16, num_warps=8, **pdl.launch_options(topk_ids.device)
    )
    return MoEAlignment(sorted_ids, eob, num_padded)
