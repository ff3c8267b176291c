"""Fused MoE: routed experts of one layer as two grouped-GEMM launches.

Weights are stacked per layer: `w13` [E, 2I, H] (each expert's I gate rows then
its I up rows) and `w2` [E, H, I]. For token t and its k routing slots:

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])
    expert(v) = w2 @ (silu(w13_gate @ v) * (w13_up @ v))

Ids outside [0, E) contribute nothing (a rank that does not hold an expert can
pass -1). Weight formats:
- bf16 / fp16 / fp32: the dots run in the weights' dtype (x and the
  intermediate are converted to it), float32 accumulation; IEEE float32 dots
  for float32 weights.
- float8_e4m3fn with 128x128 block scales `w13_scale_inv` [E, ceil(2I/128),
  ceil(H/128)] and `w2_scale_inv` [E, ceil(H/128), I/128] (I % 128 == 0, so no
  block mixes gate and up rows): x, and the intermediate before the down
  projection, are quantised per token and 128-column group exactly as
  `kernels.fp8_gemm.quantize_activations_ref` does (one `quantize_activations`
  launch before each GEMM: quantising inside the tiles repeated the work in every
  weight tile of a block and left the decode kernels ALU-bound), fp8 `tl.dot`
  per 128-deep K block, and the two scales multiply each block's float32
  partial (DeepSeek's recipe).
The intermediate silu(gate) * up is rounded to x.dtype, each slot's weighted
down projection is rounded to x.dtype, and the k slots of a token are summed in
float32 in slot order (deterministic), then written in x.dtype.

Launches (`fused_moe`):
1. `moe_align` (the prefill tiles): token slots s = t*k + j grouped by
   expert, each expert's run padded to a multiple of BLOCK_M with the sentinel
   T*k (one Triton launch for T*k <= 1,024, else a count launch and a scatter
   launch; stable: slots ascend within an expert).
   Decode batches (`slot_led`, up to SLOT_LED_MAX_SLOTS slots) have no such
   launch: gate/up runs a program per slot instead of per block, each reads
   every slot's expert, and a slot whose rank among its expert's slots is a
   multiple of BLOCK_M leads the block of the next BLOCK_M of them (the
   alignment's block, rows in the same order, so the same bits); the others
   return at once. One program of each block appends it to the list down reads
   (the order of the list is the atomics', which changes no value), and the
   slot sum re-arms the list's count.
2. gate/up: one program per (block of BLOCK_M sorted slots, BLOCK_N columns of
   I, K range); it reads the block's expert, gathers the token rows, multiplies
   by the gate and up tiles of that expert and writes silu(gate) * up
   [T*k, I], a row per slot (so the intermediate's quantisation reads T*k rows,
   not the padded blocks). At a few tokens the touched experts' tiles are too few to
   keep the GPU's SMs streaming weights, so `split_k` cuts H into ranges: each
   range stores its float32 partials (per slot), and the tile's last range to
   arrive (an atomic counter per tile, as in `kernels.fp8_gemm`) adds them in
   range order (deterministic) and finishes the tile.
3. down: one program per (block, `tiles_down` tiles of BLOCK_N columns of H);
   multiplies by the routing weight and writes each slot's row of [T*k, H].
4. a sum over the k slots of each token into out [T, H].
(fp8 weights add the two quantisation launches, or one when the caller passes x's
quantisation, `x_fp8`, made by the RMSNorm before the MoE.)
One or two tokens with fp8 experts take the `gemv` form instead
(kernels/fused_moe_gemv.py): two launches, no alignment. Gate/up runs one
program per (slot, 8 columns of I) over the whole H; down runs one program per
(token, columns of H) that quantises each slot's intermediate itself (the same
values as step 3's launch), streams the slot's expert rows and adds the k
weighted slots in order (steps 3-4 in one). Same roundings as the tiles.
No host synchronisation; every shape depends only on (T, k, E, H, I), never on
the routing: the whole call is CUDA-graph capturable.

Contents: the PyTorch twin `fused_moe_ref`, the tiled Triton kernels and the
launcher `fused_moe` (the alignment is `kernels.moe_align`, the few-token form
`kernels.fused_moe_gemv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import (
    _DEFAULT_SMS,
    FP8_BLOCK,
    Fp8Activations,
    _arrival_counters,
    _interpreting,
    _num_sms,
    dequantize_weight_blocks,
    quantize_activations,
    quantize_activations_ref,
)
from kernels.fp8_pack import _cast_out
from kernels.fused_moe_gemv import MoEOperands, fused_moe_gemv
from kernels.moe_align import ID_DTYPES, moe_align, moe_align_sizes

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_W_DTYPES = _ACT_DTYPES + (torch.float8_e4m3fn,)
_MAX_GRID_Y = 65535
SPLIT_PROGRAMS_PER_SM = 1  # gate/up programs per SM that the K split aims for at a few tokens (H200 sweep)
# Slots up to which gate/up's programs find their blocks themselves (one program per slot, each reading every
# slot's expert). H200, E = 257, k = 9, fused MoE in a graph (bench/RESULTS.md, 2026-12-04, twenty-ninth session):
# 48.1 / 85.6 / 138.8 / 213.9 us at T = 3 / 8 / 16 / 32 against 51.7 / 86.6 / 139.6 / 214.7 after the alignment
# launch; at T = 64 (576 slots) 300.8 against 278.4: 2,304 programs each reading 576 slots.
SLOT_LED_MAX_SLOTS = 288


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tile shapes of the two grouped GEMMs (`for_problem` gives the defaults; bench/fused_moe.py sweeps)."""

    block_m: int = 16  # sorted slots per program (the padding unit of moe_align), >= 16
    block_n: int = 64  # gate/up: columns of I per program (it reads 2 * block_n weight rows)
    block_k: int = 128  # gate/up: K tile (128 for fp8 weights: one scale block)
    block_n_down: int = 128  # down: columns of H per program
    block_k_down: int = 128  # down: K tile over I (128 for fp8 weights)
    num_warps: int = 4
    num_stages: int = 4
    num_warps_down: int = 4
    num_stages_down: int = 4
    tiles_down: int = 1  # down: consecutive column tiles per program, their K steps one pipelined loop
    swap_ab: bool = False  # weight rows on the MMA's M side, tokens on its N side (small blocks)
    split_k: int = 1  # gate/up: ranges of H per tile; > 1: float32 partials summed by the tile's last range
    gemv: bool = False  # one token's slots as GEMVs (float32 products in registers, K unrolled, num_stages unused):
    # no alignment, two launches
    slot_led: bool = False  # blocks found by gate/up's own programs, one per slot, instead of the alignment launch
    # (decode batches of at most SLOT_LED_MAX_SLOTS slots)

    @classmethod
    def for_problem(cls, num_tokens: int, top_k: int, num_experts: int, *,
                    weight_dtype: torch.dtype = torch.bfloat16, hidden: int = 0, inter: int = 0,
                    num_sms: int = _DEFAULT_SMS) -> "FusedMoEConfig":
        """Defaults for T tokens with k slots over E experts (hidden H and intermediate I, when given, size the
        gate/up K split): vLLM's H200 tiles for E=256, I=256 as the start, decode tiles from
        `python bench/fused_moe.py --sweep` on an H200 (bench/RESULTS.md)."""
        if weight_dtype == torch.float32:  # IEEE float32 dots (tests): small tiles, two stages fit in shared memory
            return cls(block_m=16, block_n=32, block_n_down=64, num_stages=2, num_stages_down=2)
        rows_per_expert = num_tokens * top_k / max(num_experts, 1)
        if rows_per_expert >= 24:  # prefill: blocks are mostly full, compute matters
            return cls(block_m=64, block_n=64, block_n_down=128, num_stages=3, num_stages_down=3)
        if num_tokens <= 2 and weight_dtype == torch.float8_e4m3fn:
            # one or two tokens: each slot a GEMV over the whole H, its K loop unrolled (no split, no alignment, two
            # launches); H200 sweeps, fp8, 8 experts + the shared one (bench/RESULTS.md, 2026-12-01): 4 rows of
            # 2,048-column tiles for gate/up, 28.8 us at T = 1 and 40.5 at T = 2 (rolled loops, 8 rows: 34.8, 48.4)
            return cls(gemv=True, block_n=4, block_k=2048, block_n_down=16 if num_tokens == 1 else 32, block_k_down=256)
        slot_led = num_tokens * top_k <= SLOT_LED_MAX_SLOTS
        if num_tokens * top_k > 32:
            # measured best from T = 8 up (fp8 weights, T = 64: 297 against 327 us): shallower pipelines, swapped
            # operands; down over two column tiles a program (T = 8 / 16 / 32 / 64: 28.9 / 47.9 / 74.2 / 99.5 ->
            # 27.0 / 44.3 / 67.3 / 91.2 us). Four or five tokens (a verifying step of k = 3 or 4 at B = 1, 36 or 45
            # slots): gate/up with five stages (T = 5: 38.1 -> 34.3 us, 156 programs on 132 SMs each needing more
            # weight bytes in flight; T = 4: 57.4 us in all against 62.5 for the former unswapped 32-column tiles)
            return cls(block_m=16, block_n=64, block_n_down=128, num_stages=5 if num_tokens * top_k <= 48 else 3,
                       num_stages_down=3, swap_ab=True, tiles_down=2, slot_led=slot_led)
        # a few tokens: memory-bound on the touched experts' weights, which are too few tiles to keep every SM
        # streaming, so H is split (H200 sweep, fp8, 8 experts at T = 1: 30.8 us against 38.9 unsplit; 128-column
        # tiles, which could quantise the intermediate in the tile, were slower: 33.5 at their best split)
        # (down: four 64-column tiles a program, T = 3: 16.3 -> 14.6 us)
        block_n = 64 if weight_dtype == torch.float8_e4m3fn else 32
        busy_tiles = min(num_experts, num_tokens * top_k) * triton.cdiv(max(inter, 1), block_n)
        return cls(block_m=16, block_n=block_n, block_n_down=64, num_stages=4, num_stages_down=4, tiles_down=4,
                   split_k=cls.split_for(busy_tiles, hidden, num_sms), slot_led=slot_led)

    @staticmethod
    def split_for(busy_tiles: int, hidden: int, num_sms: int = _DEFAULT_SMS) -> int:
        """Ranges of H so that the busy tiles times the ranges reach about SPLIT_PROGRAMS_PER_SM programs per
        SM, each range at least two 128-deep K tiles, none empty."""
        kb = triton.cdiv(hidden, FP8_BLOCK)
        if kb < 4:
            return 1
        split = max(1, min(triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, max(busy_tiles, 1)), kb // 2))
        return triton.cdiv(kb, triton.cdiv(kb, split))


# --- PyTorch twins -------------------------------------------------------------------


def _dequant_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(FP8_BLOCK, 1)[:, : q.shape[1]]


def _fp8_act(v: torch.Tensor) -> torch.Tensor:
    """v [M, K] -> float32 values of its per-token, per-128-group fp8 quantisation."""
    return _dequant_rows(*quantize_activations_ref(v))


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
    w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
    out: torch.Tensor | None = None, config: FusedMoEConfig | None = None, x_fp8: Fp8Activations | None = None,
) -> torch.Tensor:
    """Plain PyTorch fused MoE (a loop over the touched experts, dequantised weights, float32 matmuls, the
    same roundings as the kernels); `config` is ignored, and so is `x_fp8` (x is quantised here, to the same
    values)."""
    fp8 = _check(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, out, kernel=False)
    t, h = x.shape
    k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    wdt = w13.dtype
    y = torch.zeros((t, k, h), dtype=torch.float32, device=x.device)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        for e in torch.unique(ids[valid]).tolist():
            tok, slot = torch.where(ids == e)
            if fp8:
                a = _fp8_act(x[tok])
                w_gu = dequantize_weight_blocks(w13[e], w13_scale_inv[e])
                w_d = dequantize_weight_blocks(w2[e], w2_scale_inv[e])
            else:
                a = x[tok].to(wdt).float()
                w_gu, w_d = w13[e].float(), w2[e].float()
            gu = a @ w_gu.T
            act = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype)
            act = _fp8_act(act) if fp8 else act.to(wdt).float()
            d = (act @ w_d.T) * topk_weights[tok, slot, None]
            y[tok, slot] = d.to(x.dtype).float()
    finally:
        torch.set_float32_matmul_precision(prev)
    res = y.sum(1).to(x.dtype)  # torch sums the k slots of a row in order
    return res if out is None else out.copy_(res)


# --- Triton kernels ------------------------------------------------------------------


@triton.jit
def _block_slots(sorted_ptr, b, num_slots, BLOCK_M: tl.constexpr):
    """The slots of sorted block b and which of them are real (padding holds the sentinel num_slots)."""
    slot = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, slot < num_slots


@triton.jit
def _slot_lead(ids_ptr, s, num_slots, top_k, num_experts, stride_it, stride_ij, BLOCK_M: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """Slot s's expert, every slot's expert ([BLOCK_S], -1 past num_slots), which of them share s's, and s's rank
    among those (how many come before it). Slot s leads a block when its expert is in [0, E) and the rank is a
    multiple of BLOCK_M: the block is its expert's next BLOCK_M slots, the alignment's block exactly."""
    offs = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + (offs // top_k) * stride_it + (offs % top_k) * stride_ij, mask=offs < num_slots,
                  other=-1).to(tl.int32)
    e = tl.load(ids_ptr + (s // top_k) * stride_it + (s % top_k) * stride_ij).to(tl.int32)
    same = (ids == e) & (offs < num_slots)
    rank = tl.sum((same & (offs < s)).to(tl.int32), 0)
    lead = (e >= 0) & (e < num_experts) & (rank % BLOCK_M == 0)
    return e, offs, same, rank, lead


@triton.jit
def _led_slots(offs, same, first, num_slots, BLOCK_M: tl.constexpr):
    """The block of an expert's slots (ascending) from its `first`-th on, and which rows are real; rows past
    the expert's last slot hold the sentinel num_slots, as the alignment's padding."""
    rank = tl.cumsum(same.to(tl.int32), 0) - 1
    want = first + tl.arange(0, BLOCK_M)
    hit = same[None, :] & (rank[None, :] == want[:, None])
    valid = tl.sum(hit.to(tl.int32), 1) > 0
    slot = tl.sum(tl.where(hit, offs[None, :], 0), 1)
    return tl.where(valid, slot, num_slots), valid


@triton.jit
def _mma(a, w, acc, a_s, w_s, FP8: tl.constexpr, IEEE: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += a [BM, BK] . w [BN, BK]^T (scaled by a_s [BM] x w_s [BN] for fp8), acc [BM, BN] or, with
    SWAP_AB, [BN, BM]."""
    if SWAP_AB:
        if FP8:
            acc += tl.dot(w, tl.trans(a)) * (w_s[:, None] * a_s[None, :])
        elif IEEE:
            acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(a), acc)
    else:
        if FP8:
            acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])
        elif IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _finish_gate_up(acc_g, acc_u, slot, valid, cols, cmask, h_ptr, stride_hm, SOFT_CVT: tl.constexpr,
                    SWAP_AB: tl.constexpr):
    """silu(gate) * up of one tile into h's rows of its slots, in h's dtype (x's)."""
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_rows = slot.to(tl.int64) * stride_hm
    if SWAP_AB:
        tl.store(h_ptr + out_rows[None, :] + cols[:, None], _cast_out(act, h_ptr, SOFT_CVT),
                 mask=cmask[:, None] & valid[None, :])
    else:
        tl.store(h_ptr + out_rows[:, None] + cols[None, :], _cast_out(act, h_ptr, SOFT_CVT),
                 mask=valid[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["num_slots", "kb_per_split", "splits", "num_experts"])
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, sorted_ptr, eob_ptr, npad_ptr, h_ptr, part_ptr, arrivals_ptr, ids_ptr,
    num_slots, top_k, hidden, inter, kb_per_split, splits, num_experts,
    stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_ps, stride_pm,
    stride_it, stride_ij,
    FP8: tl.constexpr, SOFT_CVT: tl.constexpr, IEEE: tl.constexpr, COMPUTE: tl.constexpr, SWAP_AB: tl.constexpr,
    SPLIT: tl.constexpr, SLOT_LED: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """h[s, n] = silu(x[tok(s)] . gate_e[n]) * (x[tok(s)] . up_e[n]) for the slots s of one block of expert e
    (with SPLIT, over one range of H; the tile's last range finishes it). The block is the alignment's b-th, or
    with SLOT_LED the one slot b leads (`_slot_lead`), which the program then lists for down."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    nt = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    if SLOT_LED:
        e, offs_s, same, first, lead = _slot_lead(ids_ptr, b, num_slots, top_k, num_experts, stride_it, stride_ij,
                                                 BLOCK_M, BLOCK_S)
        if not lead:
            return
        slot, valid = _led_slots(offs_s, same, first, num_slots, BLOCK_M)
        lists = (nt == 0) & (split == 0)  # one program of the block lists it for down: its place taken now,
        start = tl.atomic_add(npad_ptr, BLOCK_M, mask=lists, sem="relaxed", scope="gpu")  # the stores at its end
    else:
        if b * BLOCK_M >= tl.load(npad_ptr):
            return
        e = tl.load(eob_ptr + b)
        if e < 0:
            return
        slot, valid = _block_slots(sorted_ptr, b, num_slots, BLOCK_M)
    tok = (slot // top_k).to(tl.int64)
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + kk[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    gs_ptrs = ws_ptr + e * stride_wse + (cols // 128) * stride_wsn
    us_ptrs = ws_ptr + e * stride_wse + ((cols + inter) // 128) * stride_wsn
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    k_lo = split * kb_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + kb_per_split * BLOCK_K, hidden)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = (k0 + kk) < hidden
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(g_ptrs + k0, mask=cmask[:, None] & kmask[None, :], other=0.0)
        wu = tl.load(u_ptrs + k0, mask=cmask[:, None] & kmask[None, :], other=0.0)
        if FP8:  # x was quantised once per token and 128 columns before the launch
            kb = k0 // BLOCK_K
            a_s = tl.load(xs_ptr + tok * stride_xst + kb, mask=valid, other=0.0)
            gs = tl.load(gs_ptrs + kb * stride_wsk, mask=cmask, other=0.0)
            us = tl.load(us_ptrs + kb * stride_wsk, mask=cmask, other=0.0)
        else:
            a = a.to(COMPUTE)
            a_s = tl.zeros([BLOCK_M], dtype=tl.float32)
            gs = tl.zeros([BLOCK_N], dtype=tl.float32)
            us = gs
        acc_g = _mma(a, wg, acc_g, a_s, gs, FP8, IEEE, SWAP_AB)
        acc_u = _mma(a, wu, acc_u, a_s, us, FP8, IEEE, SWAP_AB)
    if not SPLIT:
        _finish_gate_up(acc_g, acc_u, slot, valid, cols, cmask, h_ptr, stride_hm, SOFT_CVT, SWAP_AB)
    else:
        # Partials are kept per slot (T*k rows, not the padded blocks): gate columns, then up columns.
        if SWAP_AB:
            tile = slot.to(tl.int64)[None, :] * stride_pm + cols[:, None]
            pmask = cmask[:, None] & valid[None, :]
        else:
            tile = slot.to(tl.int64)[:, None] * stride_pm + cols[None, :]
            pmask = valid[:, None] & cmask[None, :]
        own = part_ptr + split.to(tl.int64) * stride_ps + tile
        tl.store(own, acc_g, mask=pmask)
        tl.store(own + inter, acc_u, mask=pmask)
        tl.debug_barrier()  # the whole program's partials are stored before the arrival is counted
        counter = arrivals_ptr + b * tl.num_programs(0) + nt
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived == splits - 1:
            acc_g = tl.load(part_ptr + tile, mask=pmask, other=0.0, cache_modifier=".cg")
            acc_u = tl.load(part_ptr + tile + inter, mask=pmask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                src = part_ptr + s * stride_ps + tile
                acc_g += tl.load(src, mask=pmask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(src + inter, mask=pmask, other=0.0, cache_modifier=".cg")
            _finish_gate_up(acc_g, acc_u, slot, valid, cols, cmask, h_ptr, stride_hm, SOFT_CVT, SWAP_AB)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    if SLOT_LED:
        if lists:
            tl.store(sorted_ptr + start + tl.arange(0, BLOCK_M), slot)
            tl.store(eob_ptr + start // BLOCK_M, e)


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, sorted_ptr, eob_ptr, npad_ptr, tw_ptr, y_ptr,
    num_slots, top_k, hidden, inter,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_twt, stride_twj, stride_ym,
    FP8: tl.constexpr, SOFT_CVT: tl.constexpr, IEEE: tl.constexpr, COMPUTE: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[s, n] = topk_weight(s) * (h[s] . down_e[n]) for the slots s of one block of expert e, over
    TILES consecutive tiles of BLOCK_N columns. The tiles' K steps run as one loop, so the next tile's weights
    are in flight while this one finishes: I is only a few K tiles (GLM-5.3's rank: two), and a program per
    tile spent most of its time waiting for its first loads."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    nt0 = tl.program_id(0) * TILES
    b = tl.program_id(1)
    if b * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(eob_ptr + b)
    if e < 0:
        return
    slot, valid = _block_slots(sorted_ptr, b, num_slots, BLOCK_M)
    slot = tl.where(valid, slot, 0)
    rw = tl.load(tw_ptr + (slot // top_k) * stride_twt + (slot % top_k) * stride_twj, mask=valid, other=0.0)
    out_rows = slot.to(tl.int64) * stride_ym
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + slot.to(tl.int64)[:, None] * stride_hm + kk[None, :]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(TILES * K_TILES):
        kt = i % K_TILES
        k0 = kt * BLOCK_K
        cols = (nt0 + i // K_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < hidden
        kmask = (k0 + kk) < inter
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_base + cols.to(tl.int64)[:, None] * stride_wn + (k0 + kk)[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)
        if FP8:  # the intermediate was quantised once per row and 128 columns between the launches
            a_s = tl.load(hs_ptr + slot.to(tl.int64) * stride_hsm + kt, mask=valid, other=0.0)
            ws = tl.load(ws_ptr + e * stride_wse + (cols // 128) * stride_wsn + kt * stride_wsk, mask=cmask,
                         other=0.0)
        else:
            a = a.to(COMPUTE)
            a_s = tl.zeros([BLOCK_M], dtype=tl.float32)
            ws = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc = _mma(a, w, acc, a_s, ws, FP8, IEEE, SWAP_AB)
        if kt == K_TILES - 1:  # the tile's last K step: weight, round and store it, start the next
            if SWAP_AB:
                tl.store(y_ptr + out_rows[None, :] + cols[:, None], _cast_out(acc * rw[None, :], y_ptr, SOFT_CVT),
                         mask=cmask[:, None] & valid[None, :])
            else:
                tl.store(y_ptr + out_rows[:, None] + cols[None, :], _cast_out(acc * rw[:, None], y_ptr, SOFT_CVT),
                         mask=valid[:, None] & cmask[None, :])
            acc = tl.zeros_like(acc)


@triton.jit
def _sum_slots_kernel(y_ptr, ids_ptr, out_ptr, listed_ptr, hidden, num_experts, stride_it, stride_ij, stride_ym,
                      stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr, SOFT_CVT: tl.constexpr,
                      REARM: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over j in order of y[t*k + j], slots with an id outside [0, E) skipped. With REARM, zeroes
    the count of slot-led blocks: down, which read it, has completed."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    if REARM:
        if (t == 0) & (tl.program_id(1) == 0):
            tl.store(listed_ptr, 0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.zeros([BLOCK], dtype=tl.int32) + tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int32)
        use = cmask & (e >= 0) & (e < num_experts)
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_ym + cols, mask=use, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, _cast_out(acc, out_ptr, SOFT_CVT), mask=cmask)


# --- launchers -----------------------------------------------------------------------


def _check(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, out, kernel: bool) -> bool:
    """Validates the inputs of fused_moe / fused_moe_ref; returns whether the weights are fp8."""
    if x.dim() != 2 or x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be bf16/fp16/fp32 [T, H], got {tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype not in _W_DTYPES or w2.dtype != w13.dtype:
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] must be 3-D with one dtype among bf16/fp16/fp32/"
                         f"float8_e4m3fn, got {tuple(w13.shape)} {w13.dtype} and {tuple(w2.shape)} {w2.dtype}")
    e, i2, hw = w13.shape
    inter = i2 // 2
    if e < 1 or inter < 1 or i2 % 2 or hw != h or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I] "
                         f"with H = {h} (x's columns), E >= 1, I >= 1")
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        if inter % FP8_BLOCK:
            raise ValueError(f"fp8 experts need I % {FP8_BLOCK} == 0 (scale blocks must not mix gate and up "
                             f"rows), got I = {inter}")
        hb = triton.cdiv(h, FP8_BLOCK)
        for s, want, name in ((w13_scale_inv, (e, 2 * inter // FP8_BLOCK, hb), "w13_scale_inv"),
                              (w2_scale_inv, (e, hb, inter // FP8_BLOCK), "w2_scale_inv")):
            if s is None or s.dtype != torch.float32 or tuple(s.shape) != want:
                got = None if s is None else (tuple(s.shape), s.dtype)
                raise ValueError(f"fp8 weights need {name} float32 {list(want)}, got {got}")
    elif w13_scale_inv is not None or w2_scale_inv is not None:
        raise ValueError(f"scales are only for float8_e4m3fn weights, got {w13.dtype} weights with scales")
    if topk_ids.dim() != 2 or topk_ids.dtype not in ID_DTYPES or topk_ids.shape[0] != t or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be int32/int64 [T={t}, k >= 1], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be float32 {list(topk_ids.shape)}, got {tuple(topk_weights.shape)} "
                         f"{topk_weights.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or (kernel and out.stride(1) != 1)):
        raise ValueError(f"out must be {x.dtype} [{t}, {h}] with unit last stride, got {tuple(out.shape)} {out.dtype}")
    tensors = [x, w13, w2, topk_weights, topk_ids] + [v for v in (w13_scale_inv, w2_scale_inv, out) if v is not None]
    if len({v.device for v in tensors}) != 1:
        raise ValueError("all inputs must share a device")
    if kernel:
        if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
            raise ValueError("x, w13 and w2 must have unit last stride")
        if x.device.type != "cuda" and not _interpreting():
            raise ValueError(f"x is on {x.device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    return fp8


def _check_config(cfg: FusedMoEConfig, fp8: bool) -> None:
    if cfg.gemv:
        for v, name in ((cfg.block_n, "block_n"), (cfg.block_n_down, "block_n_down")):
            if v < 1 or v > FP8_BLOCK or v & (v - 1):
                raise ValueError(f"a GEMV's {name} must be a power of two dividing {FP8_BLOCK}, got {v}")
        for v, name in ((cfg.block_k, "block_k"), (cfg.block_k_down, "block_k_down")):
            if v < FP8_BLOCK or v & (v - 1):
                raise ValueError(f"a GEMV's {name} must be a power of two >= {FP8_BLOCK}, got {v}")
        return
    for v, name in ((cfg.block_m, "block_m"), (cfg.block_n, "block_n"), (cfg.block_k, "block_k"),
                    (cfg.block_n_down, "block_n_down"), (cfg.block_k_down, "block_k_down")):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if cfg.block_m > 256:
        raise ValueError(f"block_m must be at most 256, got {cfg.block_m}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
    if cfg.tiles_down < 1:
        raise ValueError(f"tiles_down must be >= 1, got {cfg.tiles_down}")
    if fp8 and (cfg.block_k != FP8_BLOCK or cfg.block_k_down != FP8_BLOCK):
        raise ValueError(f"fp8 weights need block_k = block_k_down = {FP8_BLOCK} (one scale block per K tile)")


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
    w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
    out: torch.Tensor | None = None, config: FusedMoEConfig | None = None, x_fp8: Fp8Activations | None = None,
) -> torch.Tensor:
    """Triton fused MoE: x [T, H] -> [T, H] in x.dtype (optionally into `out`); see the module docstring.
    With fp8 weights, `x_fp8` is x's quantisation made by its producer (an RMSNorm), used as is."""
    fp8 = _check(x, w13, w2, topk_weights, topk_ids, w13_scale_inv, w2_scale_inv, out, kernel=True)
    t, h = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    k = topk_ids.shape[1]
    res = torch.empty_like(x) if out is None else out
    if t == 0:
        return res
    cfg = config or FusedMoEConfig.for_problem(t, k, num_experts, weight_dtype=w13.dtype, hidden=h, inter=inter,
                                               num_sms=_num_sms(x.device))
    _check_config(cfg, fp8)
    if cfg.slot_led and not cfg.gemv and t * k > SLOT_LED_MAX_SLOTS:
        raise ValueError(f"slot-led blocks read every slot in each program: at most {SLOT_LED_MAX_SLOTS} slots, "
                         f"got T*k = {t * k}")
    ops = MoEOperands.of(x, w13, w13_scale_inv, w2_scale_inv, x_fp8)
    if cfg.gemv:
        fused_moe_gemv(ops, w13, w2, topk_weights, topk_ids, res, cfg)
        return res
    num_slots = t * k
    if cfg.slot_led:  # gate/up's programs find the blocks and list them for down: no alignment launch
        max_padded, max_blocks = moe_align_sizes(num_slots, num_experts, cfg.block_m)
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=x.device)
        eob = torch.empty(max_blocks, dtype=torch.int32, device=x.device)
        num_padded = _listed_slots(x.device)
        gate_up_blocks = num_slots  # one program per slot (and column tile), the leaders work
    else:
        sorted_ids, eob, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
        max_blocks = gate_up_blocks = eob.numel()
    if max(max_blocks, gate_up_blocks) > _MAX_GRID_Y:
        raise ValueError(f"T*k = {num_slots} slots need {max_blocks} blocks of {cfg.block_m}, over the grid limit "
                         f"{_MAX_GRID_Y}: use a larger block_m or split the batch")
    n_tiles = triton.cdiv(inter, cfg.block_n)
    kb = triton.cdiv(h, cfg.block_k)
    kb_per_split = triton.cdiv(kb, cfg.split_k)
    splits = triton.cdiv(kb, kb_per_split)
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)  # a row per slot, quantised by slot
    if splits > 1:
        partials = torch.empty((splits, num_slots, 2 * inter), dtype=torch.float32, device=x.device)
        arrivals = _arrival_counters(x.device, gate_up_blocks * n_tiles)
    else:
        partials = arrivals = act  # unused
    y = torch.empty((num_slots, h), dtype=x.dtype, device=x.device)
    soft, compute = ops.soft_cvt, ops.compute
    ieee = w13.dtype == torch.float32
    _gate_up_kernel[(n_tiles, gate_up_blocks, splits)](
        ops.xq, ops.xs, w13, ops.s13, sorted_ids, eob, num_padded, act, partials, arrivals, topk_ids,
        num_slots, k, h, inter, kb_per_split, splits, num_experts,
        ops.xq.stride(0), ops.xs_stride, w13.stride(0), w13.stride(1), *ops.s13_strides, act.stride(0),
        partials.stride(0) if splits > 1 else 0, partials.stride(1) if splits > 1 else 0,
        topk_ids.stride(0), topk_ids.stride(1),
        FP8=fp8, SOFT_CVT=soft, IEEE=ieee, COMPUTE=compute, SWAP_AB=cfg.swap_ab,
        SPLIT=splits > 1, SLOT_LED=cfg.slot_led, BLOCK_S=triton.next_power_of_2(num_slots),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(ops.xq.device)
    )
    actq, acts = quantize_activations(act) if fp8 else (act, act)
    _down_kernel[(triton.cdiv(triton.cdiv(h, cfg.block_n_down), cfg.tiles_down), max_blocks)](
        actq, acts, w2, ops.s2, sorted_ids, eob, num_padded, topk_weights, y,
        num_slots, k, h, inter,
        actq.stride(0), acts.stride(0) if fp8 else 0, w2.stride(0), w2.stride(1), *ops.s2_strides,
        topk_weights.stride(0), topk_weights.stride(1), y.stride(0),
        FP8=fp8, SOFT_CVT=soft, IEEE=ieee, COMPUTE=compute, SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down,
        K_TILES=triton.cdiv(inter, cfg.block_k_down), TILES=cfg.tiles_down,
        num_warps=cfg.num_warps_down, num_stages=cfg.num_stages_down, **pdl.launch_options(actq.device)
    )
    block = min(1024, triton.next_power_of_2(h))
    _sum_slots_kernel[(t, triton.cdiv(h, block))](
        y, topk_ids, res, num_padded, h, num_experts, topk_ids.stride(0), topk_ids.stride(1), y.stride(0),
        res.stride(0), TOP_K=k, BLOCK=block, SOFT_CVT=soft, REARM=cfg.slot_led, num_warps=4,
        **pdl.launch_options(y.device)
    )
    return res


_listed: dict[torch.device, torch.Tensor] = {}


def _listed_slots(device: torch.device) -> torch.Tensor:
    """The device's count of slots in the blocks that slot-led gate/up programs list for down ([1] int32, a
    multiple of BLOCK_M, read by down as the alignment's `num_padded`), zero between calls: the slot sum,
    launched after down, re-arms it. Allocated once per device outside any CUDA-graph capture (the first
    call on a device is an eager one), and shared as the split-K arrival counters are: calls on one stream."""
    listed = _listed.get(device)
    if listed is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first slot-led fused MoE on a device must run before any graph capture")
        listed = _listed[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return listed

