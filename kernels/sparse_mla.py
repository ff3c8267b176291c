"""Sparse MLA attention in absorbed form over selected KV slots.

For each query row n (a decode token, or one token of an extend chunk: rows are
independent, each with its own top-K) and head h:

    s[k]   = (q_lat[n, h] . latent[slot[n, k]] + q_rope[n, h] . rope[slot[n, k]]) * scale
    out    = sum_k softmax(s)[k] * latent[slot[n, k]]      over k < lens[n]

Rows are read straight out of one layer's page view `[num_pages, page_size,
row_bytes]` uint8 (slot = page * page_size + token_in_page), in the `fp8`,
`bf16` or `float32` row format of `kernels.fp8_rows` / `engine.kv_layout`. FP8
rows are dequantised in registers (e4m3 -> fp16 times the block scale) and the
dots run in fp16; bf16 rows use the query dtype; float32 queries use IEEE float32
dots (the reference mode). K is walked in tiles with an online softmax;
when the batch is too small to fill the GPU the K range is split across programs
(flash-decoding) and a second launch merges the partial results by their
log-sum-exp. A row with lens 0 gets zeros. Shapes depend only on tensor shapes,
never on values, so the launch can be captured in a CUDA graph. At most 65535
query rows per launch (grid limit).

Contents: `sparse_mla_ref` (PyTorch twin), the Triton kernels, and the
launcher `sparse_mla` (same signature as the twin) that checks its inputs and,
where the configuration asks (`SparseMLAConfig.cuda`, the default for FP8 rows
at up to 8 heads from 8 query rows) and the GPU allows, runs the CUDA kernel of
`kernels/sparse_mla_fp8.cu` instead (same splits and combine kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels import fp8_rows, pdl, sparse_mla_cuda


KV_FORMATS = ("fp8", "bf16", "float32")
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SparseMLAConfig:
    """Tile shapes of one launch (`for_problem` gives the measured defaults)."""

    block_h: int = 16  # heads per program (>= 16: the tl.dot minimum; fewer heads are masked)
    block_k: int = 32  # selected rows per tile
    num_splits: int | None = None  # programs along K per (row, head block)
    waves: int = 2  # with num_splits None: split K until the grid has waves x SM-count programs
    num_warps: int = 8
    num_stages: int = 2
    prefetch: bool = False  # load tile i+1 into registers while tile i computes
    dequant_f32: bool = False  # fp8 rows: scale in float32 (else in the compute dtype, fp16)
    cuda: bool = False  # the CUDA kernels (kernels/sparse_mla_fp8*.cu) where `sparse_mla_cuda.supports` holds
    cuda_waves: float = 1.0  # its splits: about this many times the CTAs the GPU holds at once

    @classmethod
    def for_problem(cls, num_heads: int, kv_format: str, num_rows: int = 1) -> "SparseMLAConfig":
        """The measured defaults on an H200 (bench/RESULTS.md): FP8 rows at up to 8 heads take the CUDA kernel
        at every batch (B = 1 / 8 / 32 / 64 / 128: 9.5 / 12.7 / 22.9 / 37.1 / 60.8 us against the Triton
        kernel's 11.5 / 18.3 / 56.6 / 101.2 / 211.0, eighteenth session), and from 17 to 64 heads the wgmma
        kernel (64 heads, B = 8 / 32 / 64 / 128: 24 / 49 / 82 / 138 us against 51 / 157 / 260 / 487,
        twenty-fifth session); the Triton tiles stay for the rest (9 to 16 heads would pad to 64 there) and
        for machines where the CUDA kernels cannot be built."""
        tiles = cls._triton_tiles(num_heads, kv_format, num_rows)
        if kv_format == "fp8" and (num_heads <= sparse_mla_cuda.MAX_HEADS
                                   or 16 < num_heads <= sparse_mla_cuda.WIDE_MAX_HEADS):
            return replace(tiles, cuda=True)
        return tiles

    @classmethod
    def _triton_tiles(cls, num_heads: int, kv_format: str, num_rows: int) -> "SparseMLAConfig":
        """Best measured tiles on an H200 (bench/RESULTS.md) for this head count, row format and number of
        query rows. FP8 rows at a few heads: from 4 rows on, 32-row tiles of four warps (5 rows, a verifying
        step of k = 4 at B = 1: 17.0 against 19.2 us with 64-row tiles); below 128 rows
        without the register prefetch (B = 8 / 32 / 64: 18.2 / 56.7 / 101.3 us against 19.8 / 60.8 / 108.5
        with it: the prefetched tile spills at 255 registers), from 128 rows with it and 8 waves (207.5 against
        218.0); below 4 rows, 64-row tiles in two stages (B = 1: 11.0 against 11.9 us in three). bf16 rows
        from 8 rows on: 32-row tiles of four warps in 2 waves (B = 32 / 64 / 128: 39.2 / 64.7 / 104.8 us against
        54.3 / 83.9 / 154.9 with 64-row tiles of eight warps)."""
        if num_heads > 16 and kv_format == "fp8":
            return cls(block_h=64, block_k=32, num_warps=8, num_stages=2, waves=4)
        if num_heads > 16:
            return cls(block_h=16, block_k=64, num_warps=8, num_stages=2, waves=1)
        if kv_format == "fp8" and num_rows >= 128:
            return cls(block_h=16, block_k=32, num_warps=4, num_stages=2, prefetch=True, waves=8)
        if kv_format == "fp8" and num_rows >= 4:
            return cls(block_h=16, block_k=32, num_warps=4, num_stages=2, waves=4)
        if kv_format == "bf16" and num_rows >= 8:
            return cls(block_h=16, block_k=32, num_warps=4, num_stages=2, waves=2)
        if kv_format == "fp8":
            return cls(block_h=16, block_k=64, num_warps=8, num_stages=2, waves=4)
        return cls(block_h=16, block_k=64, num_warps=8, num_stages=3, waves=4)


def mla_row_bytes(kv_format: str, latent_dim: int, rope_dim: int) -> int:
    """Bytes of one MLA row in `kv_format`."""
    if kv_format == "fp8":
        return fp8_rows.mla_row_bytes(latent_dim, rope_dim)
    return (latent_dim + rope_dim) * (4 if kv_format == "float32" else 2)


# --- PyTorch twin ------------------------------------------------------------------


def _decode_rows(rows: torch.Tensor, kv_format: str, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """[M, row_bytes] uint8 -> [M, Dl + Dr] float32."""
    if kv_format == "fp8":
        return fp8_rows.unpack_mla_rows(rows, latent_dim, rope_dim)
    src = torch.float32 if kv_format == "float32" else torch.bfloat16
    return rows.contiguous().view(src).float()


def sparse_mla_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    *,
    kv_format: str,
    latent_dim: int,
    rope_dim: int,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch sparse MLA in float32; `config` is accepted and ignored."""
    n, k = slots.shape
    page_size = kv.shape[1]
    valid = torch.arange(k, device=slots.device)[None, :] < lens[:, None].long()
    safe = torch.where(valid, slots.long(), torch.zeros_like(slots, dtype=torch.long))
    rows = kv[safe // page_size, safe % page_size]  # [N, K, row_bytes]
    kvf = _decode_rows(rows.reshape(n * k, -1), kv_format, latent_dim, rope_dim).reshape(n, k, -1)
    scores = torch.einsum("nhd,nkd->nhk", q.float(), kvf) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # lens 0: all -inf -> zeros
    res = torch.einsum("nhk,nkd->nhd", probs, kvf[..., :latent_dim])
    if out is None:
        return res.to(out_dtype)
    return out.copy_(res)


# --- Triton kernels ----------------------------------------------------------------


@triton.jit
def _load_raw(kv_ptr, slots_ptr, k0, end, DL: tl.constexpr, DR: tl.constexpr, NB: tl.constexpr,
              PAGE: tl.constexpr, stride_kp, stride_kt, KV_FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Issue the loads of one tile: latent as stored, fp8 scales [BLOCK_K, NB], rope as stored."""
    offs = k0 + tl.arange(0, BLOCK_K)
    valid = offs < end
    slot = tl.load(slots_ptr + offs, mask=valid, other=0)
    row = (slot // PAGE).to(tl.int64) * stride_kp + (slot % PAGE) * stride_kt
    cl = tl.arange(0, DL)
    cr = tl.arange(0, DR)
    if KV_FMT == 0:  # fp8: e4m3 latent, NB fp32 scales, bf16 rope
        lat = tl.load(kv_ptr + row[:, None] + cl[None, :], mask=valid[:, None], other=0)
        sp = (kv_ptr + row + DL).to(tl.pointer_type(tl.float32), bitcast=True)
        sc = tl.load(sp[:, None] + tl.arange(0, NB)[None, :], mask=valid[:, None], other=0.0)
        rp = (kv_ptr + row + DL + 4 * NB).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        rope = tl.load(rp[:, None] + cr[None, :], mask=valid[:, None], other=0.0)
    else:
        if KV_FMT == 1:
            p = (kv_ptr + row).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        else:
            p = (kv_ptr + row).to(tl.pointer_type(tl.float32), bitcast=True)
        lat = tl.load(p[:, None] + cl[None, :], mask=valid[:, None], other=0.0)
        rope = tl.load(p[:, None] + DL + cr[None, :], mask=valid[:, None], other=0.0)
        sc = tl.zeros([BLOCK_K, NB], tl.float32)
    return lat, sc, rope


@triton.jit
def _convert(lat, sc, rope, DL: tl.constexpr, NB: tl.constexpr, KV_FMT: tl.constexpr, COMPUTE: tl.constexpr,
             DEQUANT_F32: tl.constexpr):
    """Raw tile -> latent and rope in the compute dtype (fp8 dequantised with its block scales)."""
    if KV_FMT == 0:
        if DEQUANT_F32:  # multiply in float32, then round once to the compute dtype
            vals = lat.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v3 = tl.reshape(vals, (lat.shape[0], NB, DL // NB))
            out_lat = tl.reshape(v3 * sc[:, :, None], (lat.shape[0], DL)).to(COMPUTE)
        else:  # multiply in the compute dtype (fp16 for fp8 rows): fewer conversions
            vals = lat.to(tl.float8e4nv, bitcast=True).to(COMPUTE)
            v3 = tl.reshape(vals, (lat.shape[0], NB, DL // NB))
            out_lat = tl.reshape(v3 * sc.to(COMPUTE)[:, :, None], (lat.shape[0], DL))
    else:
        out_lat = lat.to(COMPUTE)
    return out_lat, rope.to(COMPUTE)


@triton.jit(do_not_specialize=["num_splits", "split_len"])  # one compiled kernel for any split
def _sparse_mla_kernel(
    q_ptr, kv_ptr, slots_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    stride_qn, stride_qh, stride_kp, stride_kt, stride_sn, stride_on, stride_oh,
    num_heads, num_splits, split_len, scale_log2,
    DL: tl.constexpr, DR: tl.constexpr, NB: tl.constexpr, PAGE: tl.constexpr,
    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    DEQUANT_F32: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    hb = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    qrow = q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh
    q_lat = tl.load(qrow + tl.arange(0, DL)[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    q_rope = tl.load(qrow + DL + tl.arange(0, DR)[None, :], mask=hmask[:, None], other=0.0).to(COMPUTE)
    row_slots = slots_ptr + n.to(tl.int64) * stride_sn

    length = tl.load(lens_ptr + n)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DL], tl.float32)
    if PREFETCH:  # software pipeline: the next tile's loads are in flight while this one computes
        nxt_lat, nxt_sc, nxt_rope = _load_raw(kv_ptr, row_slots, start, end, DL, DR, NB, PAGE,
                                              stride_kp, stride_kt, KV_FMT, BLOCK_K)
    for k0 in range(start, end, BLOCK_K):
        if PREFETCH:
            raw_lat, raw_sc, raw_rope = nxt_lat, nxt_sc, nxt_rope
            nxt_lat, nxt_sc, nxt_rope = _load_raw(kv_ptr, row_slots, k0 + BLOCK_K, end, DL, DR, NB, PAGE,
                                                  stride_kp, stride_kt, KV_FMT, BLOCK_K)
        else:
            raw_lat, raw_sc, raw_rope = _load_raw(kv_ptr, row_slots, k0, end, DL, DR, NB, PAGE,
                                                  stride_kp, stride_kt, KV_FMT, BLOCK_K)
        lat, rope = _convert(raw_lat, raw_sc, raw_rope, DL, NB, KV_FMT, COMPUTE, DEQUANT_F32)
        valid = (k0 + tl.arange(0, BLOCK_K)) < end
        if IEEE:
            s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
            s = tl.dot(q_rope, tl.trans(rope), s, input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(lat))
            s = tl.dot(q_rope, tl.trans(rope), s)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = tl.dot(p.to(COMPUTE), lat, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(COMPUTE), lat, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0
    res = acc / tl.where(has, l_i, 1.0)[:, None]
    cols = tl.arange(0, DL)[None, :]
    if not SPLIT:
        optr = out_ptr + n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + cols
        tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        base = (n.to(tl.int64) * num_splits + split) * num_heads + heads
        tl.store(part_ptr + base[:, None] * DL + cols, res, mask=hmask[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + base, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, num_splits, stride_on, stride_oh,
    DL: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    h = tl.program_id(0)
    n = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < num_splits
    base = (n.to(tl.int64) * num_splits + sp) * num_heads + h
    lse = tl.load(lse_ptr + base, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # every split empty (lens 0): weights all 0
    wgt = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
    total = tl.sum(wgt, axis=0)
    part = tl.load(part_ptr + base[:, None] * DL + tl.arange(0, DL)[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(part * wgt[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    optr = out_ptr + n.to(tl.int64) * stride_on + h * stride_oh + tl.arange(0, DL)
    tl.store(optr, res.to(out_ptr.dtype.element_ty))


# --- launcher ----------------------------------------------------------------------

_COMPUTE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_FMT_CODE = {"fp8": 0, "bf16": 1, "float32": 2}


def compute_dtype(q_dtype: torch.dtype, kv_format: str):
    """Operand dtype of the dots: float32 for float32 queries (IEEE dots), fp16 for fp8 rows (e4m3 -> fp16
    is one exact conversion; queries must stay inside fp16 range), else the query dtype."""
    if q_dtype == torch.float32:
        return tl.float32
    return tl.float16 if kv_format == "fp8" else _COMPUTE[q_dtype]


def _check(q, kv, slots, lens, kv_format, latent_dim, rope_dim) -> None:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format {kv_format!r} is not one of {KV_FORMATS}")
    if q.dim() != 3 or q.shape[2] != latent_dim + rope_dim or q.stride(2) != 1:
        raise ValueError(f"q must be [N, H, {latent_dim + rope_dim}] with unit last stride, got {tuple(q.shape)}")
    if q.dtype not in _COMPUTE:
        raise TypeError(f"q dtype {q.dtype} not supported")
    row_bytes = mla_row_bytes(kv_format, latent_dim, rope_dim)
    if kv.dtype != torch.uint8 or kv.dim() != 3 or kv.shape[2] != row_bytes or kv.stride(2) != 1:
        raise ValueError(f"kv must be a uint8 [pages, page_size, {row_bytes}] view with unit last stride")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != q.shape[0] or slots.stride(1) != 1:
        raise ValueError("slots must be int32 [N, K] with unit last stride")
    if lens.dtype != torch.int32 or lens.shape != (q.shape[0],) or not lens.is_contiguous():
        raise ValueError("lens must be contiguous int32 [N]")
    if len({t.device for t in (q, kv, slots, lens)}) != 1:
        raise ValueError("q, kv, slots and lens must share a device")
    for d, name in ((latent_dim, "latent_dim"), (rope_dim, "rope_dim")):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {d}")


def _num_splits(cfg: SparseMLAConfig, programs: int, k: int, block_k: int, device: torch.device) -> int:
    if cfg.num_splits is not None:
        return max(1, min(cfg.num_splits, triton.cdiv(k, block_k)))
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(cfg.waves * sms, max(programs, 1))
    # Two tiles per split, or one when even two-tile splits leave most SMs idle (H200, B = 1: 16 -> 10 us).
    tiles_per_split = 1 if programs * triton.cdiv(k, 2 * block_k) < sms // 2 else 2
    return max(1, min(want, triton.cdiv(k, tiles_per_split * block_k)))


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    *,
    kv_format: str,
    latent_dim: int,
    rope_dim: int,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton sparse MLA: q [N, H, Dl+Dr], kv [P, page, row_bytes] uint8 view, slots [N, K] int32,
    lens [N] int32 -> [N, H, Dl] in `out_dtype` (or written into `out`, e.g. a CUDA-graph buffer)."""
    _check(q, kv, slots, lens, kv_format, latent_dim, rope_dim)
    cfg = config or SparseMLAConfig.for_problem(q.shape[1], kv_format, q.shape[0])
    n, h, _ = q.shape
    k = slots.shape[1]
    if out is None:
        out = torch.empty((n, h, latent_dim), dtype=out_dtype, device=q.device)
    elif out.shape != (n, h, latent_dim) or out.stride(2) != 1 or out.device != q.device:
        raise ValueError(f"out must be [N, H, {latent_dim}] with unit last stride on q's device")
    if n == 0 or h == 0:
        return out
    if cfg.cuda and sparse_mla_cuda.supports(q, kv, out, kv_format, latent_dim, rope_dim):
        return _sparse_mla_cuda(q, kv, slots, lens, out, scale, cfg)
    block_h = cfg.block_h
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    block_k = cfg.block_k
    head_blocks = triton.cdiv(h, block_h)
    splits = _num_splits(cfg, n * head_blocks, k, block_k, q.device)
    split_len = triton.cdiv(triton.cdiv(max(k, 1), splits), block_k) * block_k
    splits = max(1, triton.cdiv(k, split_len))
    part, lse = _partials(n, splits, h, latent_dim, q.device)
    if part is None:
        part = lse = out  # unused
    _sparse_mla_kernel[(head_blocks, splits, n)](
        q, kv, slots, lens, out, part, lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        h, splits, split_len, scale * _LOG2E,
        DL=latent_dim, DR=rope_dim, NB=fp8_rows.num_scale_blocks(latent_dim), PAGE=kv.shape[1],
        KV_FMT=_FMT_CODE[kv_format], COMPUTE=compute_dtype(q.dtype, kv_format), IEEE=q.dtype == torch.float32,
        BLOCK_H=block_h, BLOCK_K=block_k, SPLIT=splits > 1, PREFETCH=cfg.prefetch,
        DEQUANT_F32=cfg.dequant_f32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(q.device)
    )
    if splits > 1:
        _combine(part, lse, out)
    return out


def _partials(n: int, splits: int, heads: int, latent_dim: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Each split's normalised output [N, splits, H, Dl] and log-sum-exp [N, splits, H] (base 2), float32, for
    the combine kernel; none with one split (the attention writes the output itself)."""
    if splits == 1:
        return None, None
    return (torch.empty((n, splits, heads, latent_dim), dtype=torch.float32, device=device),
            torch.empty((n, splits, heads), dtype=torch.float32, device=device))


def _combine(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    n, splits, h, latent_dim = part.shape
    _combine_kernel[(h, n)](
        part, lse, out, h, splits, out.stride(0), out.stride(1),
        DL=latent_dim, BLOCK_S=triton.next_power_of_2(splits), num_warps=4, **pdl.launch_options(part.device)
    )


def _sparse_mla_cuda(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                     out: torch.Tensor, scale: float, cfg: SparseMLAConfig) -> torch.Tensor:
    """The CUDA kernel's launch, its splits merged by the combine kernel."""
    n, h, _ = q.shape
    k = slots.shape[1]
    splits, split_len = sparse_mla_cuda.num_splits(n, k, cfg.cuda_waves, q.device, splits=cfg.num_splits,
                                                   step=sparse_mla_cuda.rows_per_step(h))
    part, lse = _partials(n, splits, h, out.shape[2], q.device)
    sparse_mla_cuda.launch(q, kv, slots, lens, out, part, lse, splits, split_len, scale * _LOG2E)
    if splits > 1:
        _combine(part, lse, out)
    return out

