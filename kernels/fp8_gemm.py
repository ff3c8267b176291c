"""Block-scaled FP8 GEMM for linear layers with FP8 checkpoint weights (DeepSeek-V3 / GLM-5 format).

Weights are `weight` [N, K] float8_e4m3fn with `weight_scale_inv` [ceil(N/128),
ceil(K/128)] float32: W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]
(edge blocks may be partial). Activations are quantised per token and per
128-column group (DeepSeek's recipe):

    s[m, g] = amax_g |x[m, :]| / 448            (IEEE division; an all-zero group gets s = 1)
    q[m, k] = e4m3(clamp(x[m, k] / s[m, k // 128], -448, 448))   (IEEE division, round to nearest even)

and `fp8_block_linear` computes, with float32 accumulation,

    out[m, n] = sum_g s[m, g] * ws[n // 128, g] * sum_{k in g} q[m, k] * weight[n, k]

written in out_dtype. The twin `fp8_block_linear_ref` dequantises both operands
(same quantised activations, bit for bit) and runs one float32 matmul, so kernel
and twin differ by float32 rounding only (on an H200, plus the tensor core's
reduced-precision accumulation inside each 128-deep fp8 dot, as in DeepSeek's
and Triton's fp8 GEMMs).

One launch shape per problem (`FP8GemmConfig.for_problem`):
- one token (decode at batch 1), weights under 64 MB: `gemv` programs of 8 weight rows stream the
  whole K, multiply in float32 registers (no tensor cores) and store; no split,
  so none of the split tiles' partials and last-arrival sum, which cost 1-2 us a
  launch at these sizes.
- small M (decode): the weight is streamed once, so the GEMM is memory-bound on
  weight bytes. `swap_ab` computes out^T = W x^T so weight rows fill the MMA's
  M side and the few tokens its N side; x is quantised by its own launch first
  (inside every weight tile the decode GEMM was ALU-bound); `split_k` cuts K into ranges so enough programs
  fill the GPU; each range stores its float32 partial and the last range of a
  tile to arrive (an atomic counter per tile) adds the partials in range order
  and writes the output: one launch, deterministic.
- large M (prefill): x is quantised once by `quantize_activations`, then a tiled
  fp8 GEMM with an L2-friendly program order (128x128 tiles, smaller ones or a
  split when that leaves fewer programs than SMs).
`fp8_block_linear_pair` runs two linears of one input (two weights of the same K) in one launch, the
second weight's tiles after the first's in one grid and its columns after the first's in one output.
Defaults (swept on an H200): x quantised by its own launch; M <= 16 swapped
16-token tiles; M <= 32 swapped 32-token tiles; M <= 128 64x64 tiles; all with
64-row weight tiles and split-K up to about one program per SM while float32
partials stay under half the weight bytes.

fp32 -> fp8 rounding: under the Triton interpreter `.to(tl.float8e4nv)` does not
round to nearest even (ties go away from zero, subnormals are truncated), so the
interpreter rounds in integer arithmetic (`_e4m3_bits`); on the GPU the hardware
conversion (cvt.rn.satfinite) is used unless `HW_FP8_CVT` is False. fp8 loads
and `tl.dot` on fp8 operands are exact under the interpreter (it decodes e4m3 to
fp16 and multiplies in float32), so no upcast path is needed there.

No host synchronisation; shapes depend only on tensor shapes (CUDA-graph
capturable). NaN / Inf inputs are out of scope.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_pack import _e4m3_bits

FP8_BLOCK = 128
FP8_MAX = 448.0
HW_FP8_CVT = True  # GPU: fp32 -> e4m3 by the hardware conversion; False: integer rounding (as the interpreter)

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEFAULT_SMS = 132  # H200; used off-GPU (interpreter) so configs match the GPU's


class Fp8Activations(NamedTuple):
    """Activations quantised per token and 128-column group, as `quantize_activations` makes them. A kernel
    that already holds x in registers (an RMSNorm) writes them beside x, and the FP8 GEMMs reading x take
    them instead of quantising x again (one launch fewer per linear)."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scales: torch.Tensor  # [M, ceil(K/128)] float32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _soft_cvt() -> bool:
    return _interpreting() or not HW_FP8_CVT


GEMV_MAX_WEIGHT = 64 << 20  # one token's GEMV up to this many weight bytes; beyond, the swapped split-K tiles
# (H200, 2026-12-02: the drafting head [19360, 6144] 35.4-38.0 against 46.9 us, eh_proj [6144, 12288] 27.0 against
# 31.7: at most 60 % of the HBM copy for the GEMV's unrolled loads, 73-79 % for the tiles' five stages)
LONG_RANGE_BLOCKS = 24  # K blocks a split-K range streams for its program to be worth a second one on an SM


@dataclass(frozen=True)
class FP8GemmConfig:
    """Tile shapes of one `fp8_block_linear` launch (K tiles are always FP8_BLOCK wide)."""

    block_m: int = 64  # tokens per tile (>= 16)
    block_n: int = 128  # weight rows (output columns) per tile (>= 16)
    split_k: int = 1  # K ranges per tile; > 1: float32 partials, summed by the tile's last range
    swap_ab: bool = False  # out^T = W x^T: weight rows on the MMA's M side (small M)
    group_m: int = 8  # M tiles per group of the L2-friendly program order
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False  # one token per program, float32 products in registers, whole K unrolled (no split, no MMA,
    # no software pipeline: num_stages unused)
    gemv_block_k: int = 512  # GEMV: columns per loaded tile (a multiple of FP8_BLOCK)

    @classmethod
    def for_problem(cls, m: int, n: int, k: int, num_sms: int = _DEFAULT_SMS) -> "FP8GemmConfig":
        """Default tiles for out[m, n] = x[m, k] W[n, k]^T; decode shapes from the H200 sweep of
        bench/fp8_gemm.py (about one program per SM)."""
        if m > 128:  # prefill: compute-bound; the largest tiles that still give a program per SM
            for bm, bn, warps in ((128, 128, 8), (64, 128, 4), (64, 64, 4)):
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                if tiles >= num_sms:
                    return cls(block_m=bm, block_n=bn, num_warps=warps, num_stages=3)
            kb = triton.cdiv(k, FP8_BLOCK)
            split = max(1, min(triton.cdiv(num_sms, tiles), kb // 4))  # few tiles (small N): split K too
            return cls(block_m=64, block_n=64, split_k=triton.cdiv(kb, triton.cdiv(kb, split)), num_stages=3)
        if m == 1 and n * k < GEMV_MAX_WEIGHT:
            # one token: whole-K GEMV programs of a few weight rows (no split, so no partials and no last-arrival
            # sum); H200 sweeps at GLM-5.3's TP8 shapes (bench/RESULTS.md, 2026-12-01): 1-2 us under the split
            # tiles; a long K in 2,048-column tiles of 4 rows ([576, 6144]: 5.8 against 8.3 us in 1,024-column
            # tiles of 8), 1,024-column tiles except where K is short and N long. Larger weights (the drafting
            # head and eh_proj) stream faster through the tiles' pipelined loads.
            if k >= 4096:
                return cls(block_m=16, block_n=4, gemv=True, gemv_block_k=2048)
            return cls(block_m=16, block_n=8, gemv=True, gemv_block_k=1024 if n <= 2048 else 512)
        if m <= 16:
            block_m, swap = 16, True
        elif m <= 32:
            block_m, swap = 32, True
        else:
            block_m, swap = 64, False
        # 64-row weight tiles (32 where the tokens are not on the MMA's M side and that gives more programs, or
        # as many with fewer K ranges, in one wave), K split by `split_for`. The H200 sweep of 2026-12-04
        # (bench/RESULTS.md) at M = 2-64 over the engine's attention shapes: 0.3-2.0 us a GEMM under the earlier
        # split to about one program per SM, rounded up (o_proj at M = 64: 10.3 against 12.3 us); six stages up
        # to 16 rows, five above (2026-11-30 to 12-02 sweeps: 64-row tiles 10-20 % below 128-row ones).
        tiles_m = triton.cdiv(m, block_m)
        block_n, split = 64, cls.split_for(m, n, k, block_m, 64, num_sms)
        if not swap:
            split32 = cls.split_for(m, n, k, block_m, 32, num_sms)
            programs32 = tiles_m * triton.cdiv(n, 32) * split32
            programs64 = tiles_m * triton.cdiv(n, 64) * split
            if programs32 <= num_sms and (programs32, -split32) > (programs64, -split):
                block_n, split = 32, split32  # more programs in one wave, or as many with fewer K ranges
        return cls(block_m=block_m, block_n=block_n, split_k=split, swap_ab=swap, num_warps=4,
                   num_stages=6 if m <= 16 else 5)

    @staticmethod
    def max_split(m: int, k: int) -> int:
        """At least two K blocks per range, and float32 partials (written and read back) at most half
        the weight bytes: split * m * n * 8 <= n * k / 2."""
        return max(1, min(triton.cdiv(k, FP8_BLOCK) // 2, k // (16 * m)))

    @classmethod
    def split_for(cls, m: int, n: int, k: int, block_m: int, block_n: int, num_sms: int = _DEFAULT_SMS) -> int:
        """K ranges (none empty): enough that tiles x ranges cover every SM where each range still streams at
        least `LONG_RANGE_BLOCKS` K blocks, else at most one program per SM. A short range's fixed costs (its
        pipeline's first loads, its partials and their sum) outweigh the SMs a single wave leaves idle; a long
        one keeps a second program's loads in flight instead (H200, 2026-12-04: o_proj [6144, 2048] at M = 8
        9.0 us on 96 programs against 9.5 on 192; eh_proj [6144, 12288] 27.1 on 192 against 33.3 on 96)."""
        kb = triton.cdiv(k, FP8_BLOCK)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        cap = cls.max_split(m, k)
        split = max(1, min(triton.cdiv(num_sms, tiles), cap))
        if kb < LONG_RANGE_BLOCKS * split:
            split = max(1, min(num_sms // tiles, cap))
        return triton.cdiv(kb, triton.cdiv(kb, split))


# --- PyTorch twins and helpers -------------------------------------------------------------


def _blocks(n: int) -> int:
    return triton.cdiv(n, FP8_BLOCK)


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 by IEEE division (a tensor divisor: CUDA multiplies by the reciprocal of a Python
    scalar), 1 where amax is 0."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32)."""
    m, k = x.shape
    nb = _blocks(k)
    xp = torch.nn.functional.pad(x.float(), (0, nb * FP8_BLOCK - k)).reshape(m, nb, FP8_BLOCK)
    scale = _safe_scale(xp.abs().amax(dim=-1))
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, nb * FP8_BLOCK)[:, :k].contiguous(), scale


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/128), ceil(K/128)] float32),
    one scale (block amax / 448) per 128x128 block."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a float [N, K] tensor, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    bn, bk = _blocks(n), _blocks(k)
    wp = torch.nn.functional.pad(w.float(), (0, bk * FP8_BLOCK - k, 0, bn * FP8_BLOCK - n))
    blocks = wp.reshape(bn, FP8_BLOCK, bk, FP8_BLOCK)
    scale = _safe_scale(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(bn * FP8_BLOCK, bk * FP8_BLOCK)[:n, :k].contiguous(), scale


def dequantize_weight_blocks(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp8 with block scales -> [N, K] float32."""
    n, k = weight.shape
    s = weight_scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.float() * s


def _dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(FP8_BLOCK, 1)[:, : q.shape[1]]


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         out_dtype: torch.dtype | None = None, *, config: FP8GemmConfig | None = None,
                         x_fp8: Fp8Activations | None = None) -> torch.Tensor:
    """Plain PyTorch twin: quantise x with `quantize_activations_ref`, dequantise both operands, one
    float32 matmul (TF32 off for the call); `config` and `x_fp8` (the same values) are ignored."""
    _check(x, weight, weight_scale_inv, out_dtype or x.dtype, kernel=False)
    k = x.shape[-1]
    q, s = quantize_activations_ref(x.reshape(-1, k))
    a = _dequantize_activations(q, s)
    w = dequantize_weight_blocks(weight, weight_scale_inv)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out = a @ w.T
    finally:
        torch.set_float32_matmul_precision(prev)
    return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])


# --- Triton kernels ------------------------------------------------------------------------


@triton.jit
def to_e4m3(y, SOFT_CVT: tl.constexpr):
    """float32 -> e4m3, saturated at +-448 and rounded to nearest even as torch rounds: in integer arithmetic
    under SOFT_CVT (the interpreter), by the hardware's conversion otherwise."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if SOFT_CVT:
        return _e4m3_bits(y).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_groups(x, SOFT_CVT: tl.constexpr):
    """x [R, 128] float32, one quantisation group per row -> (q [R, 128] fp8e4nv, scales [R] float32)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    return to_e4m3(y, SOFT_CVT), scale


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                      GROUPS: tl.constexpr, SOFT_CVT: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    col = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = col < K
    x = tl.load(x_ptr + m * stride_xm + col, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_groups(x, SOFT_CVT)
    tl.store(q_ptr + m * stride_qm + col, q, mask=mask)
    tl.store(s_ptr + m * stride_sm + g, scale, mask=g < num_groups)


@triton.jit
def _pair_tile(pid_n, first_n, w_ptr, ws_ptr, N, N2, w2_offset, ws2_offset):
    """(weight, scales, rows, first output column, tile index within its weight) of column tile `pid_n` of a
    pair: tiles from `first_n` on are the second weight's. The second weight is reached by an element offset,
    not a pointer chosen by a branch, which would lose the 16-byte alignment the loads are vectorised on."""
    second = pid_n >= first_n
    return (w_ptr + tl.where(second, w2_offset, 0), ws_ptr + tl.where(second, ws2_offset, 0),
            tl.where(second, N2, N), tl.where(second, N, 0), tl.where(second, pid_n - first_n, pid_n))


# M changes from step to step: not specialised on, so a new batch size reuses the compiled kernel.
@triton.jit(do_not_specialize=["M", "kb_per_split", "splits"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, out_ptr, arrivals_ptr,
    M, N, K, kb_per_split, splits, N2, w2_offset, ws2_offset,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_wsk, stride_cs, stride_cm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PAIR: tl.constexpr, PDL: tl.constexpr,
):
    """out[:, :N] = x W^T and, with PAIR, out[:, N:] = x W2^T: the second weight's column tiles follow the
    first's in the same grid (W2 [N2, K] and its scales laid out as W's, `w2_offset` / `ws2_offset` elements
    from W's and its scales': `_pair_tile`)."""
    BLOCK_K: tl.constexpr = 128
    pdl.begin(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    first_n = tl.cdiv(N, BLOCK_N)
    num_pid_n = first_n + tl.cdiv(N2, BLOCK_N) if PAIR else first_n
    # Grouped order: GROUP_M consecutive M tiles share the weight tiles they read (L2 reuse).
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    w_base, ws_base, rows, col0 = w_ptr, ws_ptr, N, 0
    if PAIR:
        w_base, ws_base, rows, col0, pid_n = _pair_tile(pid_n, first_n, w_ptr, ws_ptr, N, N2, w2_offset, ws2_offset)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < rows
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_rows = w_base + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    as_rows = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_rows = ws_base + (offs_n // 128) * stride_wsn

    num_kb = tl.cdiv(K, BLOCK_K)
    kb0 = split * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, num_kb)
    for kb in range(kb0, kb1):  # with PDL: this program's weights requested while the kernel before ends
        pdl.prefetch_l2(w_base + offs_n.to(tl.int64) * stride_wn + kb * BLOCK_K, nmask, w_base, PDL)
    pdl.wait(PDL)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BLOCK_K
        if EVEN_K:
            amask = mmask[:, None]
            wmask = nmask[:, None]
        else:
            kmask = (k0 + offs_k) < K
            amask = mmask[:, None] & kmask[None, :]
            wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + k0, mask=wmask, other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        ws = tl.load(ws_rows + kb * stride_wsk, mask=nmask, other=0.0)
        a = tl.load(a_rows + k0, mask=amask, other=0.0)  # [BLOCK_M, BLOCK_K] fp8, quantised beforehand
        a_s = tl.load(as_rows + kb, mask=mmask, other=0.0)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a)) * (ws[:, None] * a_s[None, :])
        else:
            acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * ws[None, :])

    cols = col0 + offs_n  # the output's columns: the second weight's after the first's
    if SWAP_AB:
        tile = offs_m.to(tl.int64)[None, :] * stride_cm + cols[:, None]
        out_tile = offs_m.to(tl.int64)[None, :] * stride_om + cols[:, None]
        cmask = nmask[:, None] & mmask[None, :]
    else:
        tile = offs_m.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        out_tile = offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :]
        cmask = mmask[:, None] & nmask[None, :]
    if not SPLIT:
        tl.store(out_ptr + out_tile, acc.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        # Every K range stores its float32 partial; the tile's last range to arrive adds them in range
        # order (deterministic) and writes the output, then re-arms the tile's counter for the next launch.
        tl.store(c_ptr + split.to(tl.int64) * stride_cs + tile, acc, mask=cmask)
        tl.debug_barrier()  # the whole program's partial is stored before the arrival is counted
        arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived == splits - 1:
            total = tl.load(c_ptr + tile, mask=cmask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += tl.load(c_ptr + s * stride_cs + tile, mask=cmask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_tile, total.to(out_ptr.dtype.element_ty), mask=cmask)
            tl.atomic_xchg(arrivals_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["K"])
def _fp8_gemv_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, N, K, N2, w2_offset, ws2_offset,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_wsk, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr, PAIR: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n-tile] for one token m: the weight rows streamed once over the whole K, each element's
    product with the token's dequantised activation accumulated in float32 registers, the block scales
    folded into the activation (BLOCK_N divides 128, so one weight scale row per program). No split of K,
    so no partials and no last-arrival sum: the launch ends when its loads do. The K loop is unrolled, so
    every tile's loads are issued before the first product waits on one. With PDL the rows' weights are
    requested from L2 and the first tile's loaded before the wait for the kernel before (kernels/pdl.py).
    A pair (PAIR) as in `_fp8_gemm_kernel`: W2's row tiles after W's, its rows written after W's."""
    pdl.begin(PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    w_base, ws_base, rows, col0 = w_ptr, ws_ptr, N, 0
    if PAIR:
        w_base, ws_base, rows, col0, pid_n = _pair_tile(pid_n, tl.cdiv(N, BLOCK_N), w_ptr, ws_ptr, N, N2, w2_offset,
                                                        ws2_offset)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < rows
    w_rows = w_base + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    lines = tl.arange(0, BLOCK_K // 128) * 128
    for kt in tl.static_range(1, K_TILES):  # the first tile is loaded below, before the wait
        cols = kt * BLOCK_K + lines
        pdl.prefetch_l2(w_base + offs_n.to(tl.int64)[:, None] * stride_wn + cols[None, :],
                        nmask[:, None] & (cols < K)[None, :], w_base, PDL)
    ws_row = ws_base + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kt in tl.static_range(K_TILES):
        k0 = kt * BLOCK_K
        cols = k0 + offs_k
        kmask = cols < K
        if EVEN_K:
            w = tl.load(w_rows + k0, mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if kt == 0:
            pdl.wait(PDL)
        if EVEN_K:
            a = tl.load(a_ptr + m * stride_am + cols)
        else:
            a = tl.load(a_ptr + m * stride_am + cols, mask=kmask, other=0.0)
        group = tl.minimum(cols, K - 1) // 128
        scale = tl.load(as_ptr + m * stride_asm + group) * tl.load(ws_row + group * stride_wsk)
        acc += w.to(tl.float32) * (a.to(tl.float32) * scale)[None, :]
    tl.store(out_ptr + m * stride_om + col0 + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=nmask)


# --- launchers -----------------------------------------------------------------------------


def _check_x(x: torch.Tensor, kernel: bool) -> None:
    if x.dtype not in _IN_DTYPES or x.dim() < 1:
        raise ValueError(f"x must be a bf16/fp16/fp32 tensor [..., K], got {tuple(x.shape)} {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError("x must have K >= 1 columns")
    if kernel and x.stride(-1) != 1:
        raise ValueError(f"x must have unit last stride, got strides {x.stride()}")
    if kernel and x.device.type != "cuda" and not _interpreting():
        raise ValueError(f"x is on {x.device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, out_dtype: torch.dtype,
           kernel: bool = True) -> None:
    _check_x(x, kernel)
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if k != x.shape[-1] or n == 0:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x [..., {x.shape[-1]}] (need [N >= 1, K])")
    if kernel and not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    want = (_blocks(n), _blocks(k))
    if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv must be float32 {list(want)} (one per 128x128 block of weight "
                         f"[{n}, {k}]), got {tuple(weight_scale_inv.shape)} {weight_scale_inv.dtype}")
    if out_dtype not in _IN_DTYPES:
        raise ValueError(f"out_dtype must be one of bf16/fp16/fp32, got {out_dtype}")
    if len({x.device, weight.device, weight_scale_inv.device}) != 1:
        raise ValueError("x, weight and weight_scale_inv must share a device")


def _check_config(cfg: FP8GemmConfig) -> None:
    if cfg.gemv:
        if cfg.block_n < 1 or cfg.block_n > FP8_BLOCK or cfg.block_n & (cfg.block_n - 1):
            raise ValueError(f"a GEMV's block_n must be a power of two dividing {FP8_BLOCK}, got {cfg.block_n}")
        kt = cfg.gemv_block_k
        if kt < FP8_BLOCK or kt & (kt - 1):
            raise ValueError(f"gemv_block_k must be a power of two >= {FP8_BLOCK}, got {kt}")
        return
    for v, name in ((cfg.block_m, "block_m"), (cfg.block_n, "block_n")):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if cfg.split_k < 1 or cfg.group_m < 1:
        raise ValueError(f"split_k and group_m must be >= 1, got {cfg}")


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return _sms_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def _default_config(m: int, n: int, k: int, num_sms: int) -> FP8GemmConfig:
    return FP8GemmConfig.for_problem(m, n, k, num_sms)


_MAX_SPLIT_TILES = 1 << 14
_arrivals: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's split-K arrival counters, one per output tile, zero between launches (the last range of
    a tile re-arms its counter), shared by every kernel that adds its programs' partials this way (this
    GEMM, the fused MoE, the router's logits). Allocated once per device, outside any CUDA-graph capture:
    the first split launch on a device is an eager one (a graph is captured after its shape ran eagerly).
    Launches on one stream only: two such kernels running at once would share counters (under PDL a kernel
    waits for the one before before its first atomic)."""
    if tiles > _MAX_SPLIT_TILES:
        raise ValueError(f"a split-K launch of {tiles} tiles exceeds the {_MAX_SPLIT_TILES} arrival counters")
    counters = _arrivals.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first split-K FP8 GEMM on a device must run before any graph capture")
        counters = _arrivals[device] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


def _quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    m, k = x.shape
    nb = _blocks(k)
    groups = min(8, triton.next_power_of_2(nb))
    _quant_act_kernel[(m, triton.cdiv(nb, groups))](
        x, q, s, k, nb, x.stride(0), q.stride(0), s.stride(0), GROUPS=groups, SOFT_CVT=_soft_cvt(), num_warps=4,
        **pdl.launch_options(x.device),
    )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: x [M, K] float -> (q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32), per token and
    128-column group (see the module docstring); equal to `quantize_activations_ref` bit for bit."""
    _check_x(x, kernel=True)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, _blocks(k)), dtype=torch.float32, device=x.device)
    if m:
        _quantize_into(x, q, s)
    return q, s


def _take_quantized(x2: torch.Tensor, x_fp8: Fp8Activations | None) -> Fp8Activations:
    """x2's quantisation: the one given (checked against x2's shape) or a new one."""
    if x_fp8 is None:
        return Fp8Activations(*quantize_activations(x2))
    m, k = x2.shape
    q, s = x_fp8
    if (q.shape != (m, k) or q.dtype != torch.float8_e4m3fn or q.stride(1) != 1 or s.dtype != torch.float32
            or s.shape != (m, _blocks(k)) or s.stride(1) != 1 or q.device != x2.device or s.device != x2.device):
        raise ValueError(f"x_fp8 must be e4m3 [{m}, {k}] and float32 scales [{m}, {_blocks(k)}] beside x, got "
                         f"{tuple(q.shape)} {q.dtype} and {tuple(s.shape)} {s.dtype}")
    return x_fp8


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     out_dtype: torch.dtype | None = None, *, config: FP8GemmConfig | None = None,
                     x_fp8: Fp8Activations | None = None) -> torch.Tensor:
    """Triton: x [..., K] @ dequant(weight [N, K])^T -> [..., N] in out_dtype (default x.dtype), x
    quantised per token and 128-column group on the fly (or taken from `x_fp8`, x's quantisation made by
    its producer), float32 accumulation."""
    out_dtype = out_dtype or x.dtype
    _check(x, weight, weight_scale_inv, out_dtype)
    return _launch(x, (weight, weight_scale_inv), None, out_dtype, config, x_fp8)


def fp8_block_linear_pair(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                          second: tuple[torch.Tensor, torch.Tensor], out_dtype: torch.dtype | None = None, *,
                          config: FP8GemmConfig | None = None, x_fp8: Fp8Activations | None = None) -> torch.Tensor:
    """Two linears of one input in one launch: x [..., K] with the FP8 weights (weight, weight_scale_inv) of
    `first` [N1, K] and `second` [N2, K] -> [..., N1 + N2], the second's columns after the first's, each
    column as `fp8_block_linear` computes it (the tiles of both weights share one grid, one tile config for
    N1 + N2 rows). At decode sizes a launch costs a few microseconds beyond its weight bytes: two projections
    that read the same activations (the query and the indexer's query) need not pay it twice."""
    out_dtype = out_dtype or x.dtype
    _check(x, *first, out_dtype)
    _check(x, *second, out_dtype)
    return _launch(x, first, second, out_dtype, config, x_fp8)


def _launch(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor] | None,
            out_dtype: torch.dtype, config: FP8GemmConfig | None, x_fp8: Fp8Activations | None) -> torch.Tensor:
    """The GEMM (or GEMV) launch for checked inputs: one weight, or a pair whose outputs sit side by side."""
    weight, weight_scale_inv = first
    pair = second is not None
    n, k = weight.shape
    n2 = second[0].shape[0] if pair else 0
    # the second weight and its scales as element offsets from the first's (kernel docstring)
    w2_offset = second[0].data_ptr() - weight.data_ptr() if pair else 0
    ws2_offset = (second[1].data_ptr() - weight_scale_inv.data_ptr()) // 4 if pair else 0
    width = n + n2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, width), dtype=out_dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, width)
    cfg = config or _default_config(m, width, k, _num_sms(x.device))
    _check_config(cfg)
    a, a_s = _take_quantized(x2, x_fp8)
    if cfg.gemv:
        tiles = triton.cdiv(n, cfg.block_n) + triton.cdiv(n2, cfg.block_n)
        _fp8_gemv_kernel[(tiles, m)](
            a, a_s, weight, weight_scale_inv, out, n, k, n2, w2_offset, ws2_offset,
            a.stride(0), a_s.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
            out.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.gemv_block_k, K_TILES=triton.cdiv(k, cfg.gemv_block_k),
            EVEN_K=k % cfg.gemv_block_k == 0, PAIR=pair,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
        )
        return out.reshape(*lead, width)
    nb = _blocks(k)
    kb_per_split = triton.cdiv(nb, cfg.split_k)
    splits = triton.cdiv(nb, kb_per_split)
    tiles = triton.cdiv(m, cfg.block_m) * (triton.cdiv(n, cfg.block_n) + triton.cdiv(n2, cfg.block_n))
    if splits > 1:
        partials = torch.empty((splits, m, width), dtype=torch.float32, device=x.device)
        arrivals = _arrival_counters(x.device, tiles)
    else:
        partials = arrivals = out  # unused
    _fp8_gemm_kernel[(tiles, splits)](
        a, a_s, weight, weight_scale_inv, partials, out, arrivals,
        m, n, k, kb_per_split, splits, n2, w2_offset, ws2_offset,
        a.stride(0), a_s.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        partials.stride(0) if splits > 1 else 0, partials.stride(1) if splits > 1 else 0, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        SWAP_AB=cfg.swap_ab, EVEN_K=k % FP8_BLOCK == 0, SPLIT=splits > 1, PAIR=pair,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
    )
    return out.reshape(*lead, width)
