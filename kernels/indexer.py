"""Lightning indexer: score every cached position of a row, then pick its top-K.

For query row n (a decode token or one token of an extend chunk) with request
r = row_to_req[n] and visible length L = min(ctx_lens[n], limits[n], max_ctx):

    score[n, p] = sum_h w[n, h] * relu(scale * q[n, h] . key[p])    for p < L
    score[n, p] = -inf                                                 otherwise

Keys live in one full-indexer layer's area of every indexer page, viewed as
`IndexerKeys` (T tokens per indexer page, a multiple of 64); logical page
p // T of request r is physical page `page_table[r, p // T]`. Key formats:
`fp8` (Di e4m3 values and one fp32 scale, `kernels.fp8_rows`), stored as the
page's values [T, Di] followed by its scales [T]: each key's values are one
Di-byte block at a Di-byte stride, loaded as aligned 16-byte vectors; `bf16`
and `float32` keys are whole rows [T, Di]. FP8 keys meet FP8 queries, as the
published DSA indexer computes: each query head is quantised to e4m3 with one
scale (`fp8_rows.quantize_query_rows`), the product runs FP8 x FP8 on the tensor
cores straight from shared memory (keys on the MMA's M side), and since every
scale is positive the scales leave the ReLU:

    score[n, p] = scale * k_scale[p] * sum_h (w[n, h] * q_scale[n, h]) * relu(q8[n, h] . k8[p])

(H200, 128K context: 64-69 % -> 85-87 % of the HBM copy bandwidth at B >= 64, where
converting every key to fp16 for an fp16 dot left the kernel issue-bound). bf16
keys dot in the query dtype, float32 queries in IEEE float32. At most 65535
query rows per launch (grid limit).

Top-K: `positions[n, :counts[n]]` are the positions of the counts[n] =
min(K, L) largest scores, in ascending position order, ties to the smaller
position; entries at and after counts[n] are padding (values in
[0, max(max_ctx, K)), never read by consumers). The scores go into a
[N, max(max_ctx, K)] float32 buffer and `kernels.topk` selects in one launch; a
row with L < K selects exactly positions 0..L-1. No host synchronisation, shapes depend
only on tensor shapes: the whole call is CUDA-graph capturable.

Contents: `indexer_scores_ref` / `indexer_topk_ref` (PyTorch twins), the
Triton scoring kernel, and the launchers `indexer_scores` / `indexer_topk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import fp8_rows, pdl
from kernels.fp8_gemm import _soft_cvt, to_e4m3
from kernels.topk import topk_positions, topk_positions_ref


KV_FORMATS = ("fp8", "bf16", "float32")


class IndexerKeys(NamedTuple):
    """One full layer's cached indexer keys in a pool of pages (uint8 views of the pool, no copy).

    `values` [pages, T, value_bytes], one contiguous run per token: a key's Di
    fp8 values (fp8) or the whole bf16 / float32 key. `scales` [pages, T, 4]:
    each fp8 key's float32 scale, in an area of the page of its own; None for
    bf16 / float32 keys.
    """

    values: torch.Tensor
    scales: torch.Tensor | None

    @property
    def tokens_per_page(self) -> int:
        return self.values.shape[1]

    def rows(self, pages: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The keys at (pages, tokens) as runs of key bytes [..., key_bytes]: values, then the scale (fp8), the
        form `kernels.fp8_rows` packs and unpacks."""
        values = self.values[pages, tokens]
        return values if self.scales is None else torch.cat([values, self.scales[pages, tokens]], dim=-1)

    def store(self, pages: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes keys [..., key_bytes] in the form `rows` returns at (pages, tokens) (distinct)."""
        width = self.values.shape[2]
        self.values[pages, tokens] = rows[..., :width]
        if self.scales is not None:
            self.scales[pages, tokens] = rows[..., width:]


class IndexerTopK(NamedTuple):
    positions: torch.Tensor  # [N, K] int32 token positions, first counts[n] valid
    counts: torch.Tensor  # [N] int32 = min(K, visible length)


@dataclass(frozen=True)
class IndexerConfig:
    """Tile shapes of the scoring launch (`for_problem` gives the measured defaults)."""

    block_t: int = 64  # positions per tile (divides tokens per indexer page)
    tiles: int | None = None  # tiles per program (amortises the query load); None: `programs_per_sm` decides
    num_warps: int = 4
    num_stages: int = 2
    prefetch: bool = False  # load tile i+1 into registers while tile i computes
    programs_per_sm: int = 8  # programs a launch puts on an SM (FP8 defaults: their occupancy, measured)
    max_tiles: int = 32

    @classmethod
    def for_problem(cls, kv_format: str) -> "IndexerConfig":
        """Best measured tiles on an H200 (bench/RESULTS.md) for this row format. FP8 keys: 64-token tiles five
        stages deep, eight programs an SM; at 128K, B = 32 that is 89 % of the HBM copy against 83 % for
        128-token tiles three deep (64 divides every page's tokens: they are whole KV pages)."""
        if kv_format == "fp8":
            return cls(block_t=64, num_warps=4, num_stages=5)
        return cls(block_t=64, num_warps=4, num_stages=2, programs_per_sm=4, max_tiles=8)


def indexer_value_bytes(kv_format: str, dim: int) -> int:
    """Bytes of one key's values: Di e4m3 values (its scale is stored apart) or the whole bf16 / float32 key."""
    if kv_format == "fp8":
        return dim
    return dim * (4 if kv_format == "float32" else 2)


def visible_lengths(ctx_lens: torch.Tensor, limits: torch.Tensor, max_ctx: int) -> torch.Tensor:
    """int32 [N]: the positions each row scores, min(its request's context, its limit) within [0, max_ctx]. Two
    small launches on a GPU: a caller that scores the same rows at several layers makes them once and passes
    them to `indexer_scores`."""
    return torch.clamp(torch.minimum(ctx_lens, limits), 0, max_ctx).to(torch.int32)


def _select(scores: torch.Tensor, visible: torch.Tensor, topk: int, kernel: bool) -> IndexerTopK:
    """Top-K of each score row (`kernels.topk`); rows with fewer than K visible positions take 0..K-1, since
    every position past a row's visible length scores -inf and ties go to the smaller position."""
    if kernel:
        positions = topk_positions(scores, topk, out=torch.empty(scores.shape[0], topk, dtype=torch.int32,
                                                                 device=scores.device))
    else:
        positions = topk_positions_ref(scores, topk).to(torch.int32)
    return IndexerTopK(positions, torch.clamp(visible, max=topk))


# --- PyTorch twins -------------------------------------------------------------------


def _decode_keys(rows: torch.Tensor, kv_format: str) -> torch.Tensor:
    """bf16 or float32 key rows -> float32 (FP8 keys are split into values and scales instead)."""
    src = torch.float32 if kv_format == "float32" else torch.bfloat16
    return rows.contiguous().view(src).float()


def indexer_scores_ref(
    q: torch.Tensor, weights: torch.Tensor, kv: IndexerKeys, page_table: torch.Tensor,
    row_to_req: torch.Tensor, ctx_lens: torch.Tensor, limits: torch.Tensor, *,
    kv_format: str, scale: float, topk: int, max_ctx: int | None = None, config: IndexerConfig | None = None,
    out: torch.Tensor | None = None, visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch scores [N, max(max_ctx, topk)] float32; `config` is ignored."""
    tokens = kv.tokens_per_page
    max_ctx = page_table.shape[1] * tokens if max_ctx is None else max_ctx
    width = max(max_ctx, topk)
    visible = visible_lengths(ctx_lens, limits, max_ctx) if visible is None else visible
    pos = torch.arange(width, device=q.device)
    valid = pos[None, :] < visible[:, None].long()  # [N, W]
    page = torch.clamp(pos // tokens, max=page_table.shape[1] - 1)
    phys = page_table[row_to_req.long()][:, page].long()  # [N, W]
    phys = torch.where(valid, phys, torch.zeros_like(phys))
    rows = kv.rows(phys, (pos % tokens)[None, :].expand_as(phys))  # [N, W, key_bytes]
    n, hi, dim = q.shape
    if kv_format == "fp8":  # FP8 queries (one scale a head) meet the FP8 keys; scales apply after the ReLU
        q8, q_scales = fp8_rows.quantize_query_rows(q.reshape(n * hi, dim))
        keys, k_scales = fp8_rows.split_indexer_rows(rows.reshape(n * width, -1), dim)
        logits = torch.relu(torch.einsum("nhd,nwd->nhw", q8.reshape(n, hi, dim), keys.reshape(n, width, dim)))
        scores = torch.einsum("nhw,nh->nw", logits, weights.float() * q_scales.reshape(n, hi))
        scores = scores * (k_scales.reshape(n, width) * scale)
    else:
        keys = _decode_keys(rows.reshape(n * width, -1), kv_format).reshape(n, width, dim)
        logits = torch.relu(torch.einsum("nhd,nwd->nhw", q.float(), keys) * scale)
        scores = torch.einsum("nhw,nh->nw", logits, weights.float())
    scores = scores.masked_fill(~valid, float("-inf"))
    return scores if out is None else out.copy_(scores)


def indexer_topk_ref(
    q: torch.Tensor, weights: torch.Tensor, kv: IndexerKeys, page_table: torch.Tensor,
    row_to_req: torch.Tensor, ctx_lens: torch.Tensor, limits: torch.Tensor, *,
    kv_format: str, scale: float, topk: int, max_ctx: int | None = None, config: IndexerConfig | None = None,
) -> IndexerTopK:
    """Plain PyTorch indexer top-K."""
    scores = indexer_scores_ref(q, weights, kv, page_table, row_to_req, ctx_lens, limits,
                                kv_format=kv_format, scale=scale, topk=topk, max_ctx=max_ctx)
    max_ctx = page_table.shape[1] * kv.tokens_per_page if max_ctx is None else max_ctx
    return _select(scores, visible_lengths(ctx_lens, limits, max_ctx), topk, kernel=False)


# --- Triton kernel -------------------------------------------------------------------


@triton.jit
def _load_keys(kv_ptr, sc_ptr, table_row, t0, visible, num_table_pages, stride_kp, stride_sp,
               DI: tl.constexpr, TOKENS: tl.constexpr, ROW: tl.constexpr, KV_FMT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Issue the loads of one tile of keys (one indexer page holds the whole tile): values as stored, scales."""
    pos = t0 + tl.arange(0, BLOCK_T)
    valid = pos < visible
    lp = t0 // TOKENS
    phys = tl.load(table_row + lp, mask=(t0 < visible) & (lp < num_table_pages), other=0).to(tl.int64)
    row = phys * stride_kp + (pos % TOKENS) * ROW  # constexpr value bytes: the compiler sees their alignment
    cd = tl.arange(0, DI)
    if KV_FMT == 0:  # fp8: each key's DI values one block (ROW == DI), its fp32 scale in the scales area
        k = tl.load(kv_ptr + row[:, None] + cd[None, :], mask=valid[:, None], other=0)
        sc = phys * stride_sp + (pos % TOKENS) * 4
        ksc = tl.load((sc_ptr + sc).to(tl.pointer_type(tl.float32), bitcast=True), mask=valid, other=0.0)
    else:
        if KV_FMT == 1:
            kp = (kv_ptr + row).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        else:
            kp = (kv_ptr + row).to(tl.pointer_type(tl.float32), bitcast=True)
        k = tl.load(kp[:, None] + cd[None, :], mask=valid[:, None], other=0.0)
        ksc = tl.full([BLOCK_T], 1.0, tl.float32)
    return k, ksc


@triton.jit
def _quantize_query(x, SOFT_CVT: tl.constexpr):
    """x [H, Di] float32 -> (e4m3 [H, Di], scales [H]) as `fp8_rows.quantize_query_rows`: one IEEE division a
    head, then products."""
    amax = tl.max(tl.abs(x), axis=1)
    some = amax > 0
    safe = tl.where(some, amax, 1.0)
    inv = tl.where(some, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), safe), 1.0)
    scale = tl.where(some, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    return to_e4m3(x * inv[:, None], SOFT_CVT), scale


# Sizes that change from step to step are not specialised on: a new batch shape reuses the compiled kernel.
@triton.jit(do_not_specialize=["stride_tb", "num_table_pages", "width", "tiles"])
def _indexer_score_kernel(
    q_ptr, w_ptr, kv_ptr, sc_ptr, table_ptr, req_ptr, vis_ptr, score_ptr,
    stride_qn, stride_qh, stride_wn, stride_kp, stride_sp, stride_tb, stride_sn,
    num_heads, num_table_pages, width, scale, tiles,
    DI: tl.constexpr, TOKENS: tl.constexpr, ROW: tl.constexpr, KV_FMT: tl.constexpr, COMPUTE: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr,
    SOFT_CVT: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    pid = tl.program_id(0)
    n = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + tl.arange(0, DI)[None, :],
                mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + n.to(tl.int64) * stride_wn + heads, mask=hmask, other=0.0)
    if KV_FMT == 0:  # FP8 queries, one scale a head, folded into the head weights (ReLU commutes with it)
        q, q_scale = _quantize_query(q.to(tl.float32), SOFT_CVT)
        w = w * q_scale
    else:
        q = q.to(COMPUTE)
    visible = tl.load(vis_ptr + n)
    table_row = table_ptr + tl.load(req_ptr + n).to(tl.int64) * stride_tb
    first = pid * tiles * BLOCK_T
    if PREFETCH:
        nxt_k, nxt_sc = _load_keys(kv_ptr, sc_ptr, table_row, first, visible, num_table_pages, stride_kp,
                                   stride_sp, DI, TOKENS, ROW, KV_FMT, BLOCK_T)
    for i in range(tiles):
        t0 = first + i * BLOCK_T
        if PREFETCH:
            k, ksc = nxt_k, nxt_sc
            nxt_k, nxt_sc = _load_keys(kv_ptr, sc_ptr, table_row, t0 + BLOCK_T, visible, num_table_pages,
                                       stride_kp, stride_sp, DI, TOKENS, ROW, KV_FMT, BLOCK_T)
        else:
            k, ksc = _load_keys(kv_ptr, sc_ptr, table_row, t0, visible, num_table_pages, stride_kp, stride_sp,
                                DI, TOKENS, ROW, KV_FMT, BLOCK_T)
        if KV_FMT == 0:  # keys on the MMA's M side: FP8 x FP8 on the tensor cores straight from shared memory
            s = tl.dot(k.to(tl.float8e4nv, bitcast=True), tl.trans(q))
            sc = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * (ksc * scale)
        else:
            k = k.to(COMPUTE)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            sc = tl.sum(tl.maximum(s * (ksc * scale)[None, :], 0.0) * w[:, None], axis=0)
        pos = t0 + tl.arange(0, BLOCK_T)
        sc = tl.where(pos < visible, sc, float("-inf"))
        tl.store(score_ptr + n.to(tl.int64) * stride_sn + pos, sc, mask=pos < width)


# --- launchers -----------------------------------------------------------------------

_COMPUTE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_FMT_CODE = {"fp8": 0, "bf16": 1, "float32": 2}


def _check(q, weights, kv, page_table, row_to_req, ctx_lens, limits, kv_format, block_t) -> None:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format {kv_format!r} is not one of {KV_FORMATS}")
    if q.dim() != 3 or q.stride(2) != 1 or q.dtype not in _COMPUTE:
        raise ValueError(f"q must be float [N, Hi, Di] with unit last stride, got {tuple(q.shape)} {q.dtype}")
    n, hi, di = q.shape
    if di < 16 or di & (di - 1) or (kv_format == "fp8" and di < 32):
        raise ValueError(f"index dim must be a power of two >= 16 (>= 32 for fp8 keys: an FP8 dot's K), got {di}")
    if weights.dtype != torch.float32 or weights.shape != (n, hi) or weights.stride(1) != 1:
        raise ValueError("weights must be float32 [N, Hi] with unit last stride")
    vb = indexer_value_bytes(kv_format, di)
    values, scales = kv
    if (values.dtype != torch.uint8 or values.dim() != 3 or values.shape[2] != vb or values.stride(2) != 1
            or values.stride(1) != vb):
        raise ValueError(f"kv.values must be a uint8 [pages, T, {vb}] view, rows contiguous within a page")
    if (scales is None) != (kv_format != "fp8"):
        raise ValueError(f"kv.scales must be {'a view' if kv_format == 'fp8' else 'None'} for {kv_format} keys")
    if scales is not None and (scales.dtype != torch.uint8 or scales.shape != (*values.shape[:2], 4)
                               or scales.stride(2) != 1 or scales.stride(1) != 4 or scales.device != values.device):
        raise ValueError(f"kv.scales must be a uint8 [pages, T, 4] view of {tuple(values.shape[:2])}, "
                         "scales contiguous within a page")
    if values.shape[1] % block_t:
        raise ValueError(f"tokens per indexer page {values.shape[1]} must be a multiple of block_t {block_t}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError("page_table must be int32 [R, max_pages] with unit last stride")
    for t, name in ((row_to_req, "row_to_req"), (ctx_lens, "ctx_lens"), (limits, "limits")):
        if t.dtype != torch.int32 or t.shape != (n,):
            raise ValueError(f"{name} must be int32 [N]")
    if len({t.device for t in (q, weights, values, page_table, row_to_req, ctx_lens, limits)}) != 1:
        raise ValueError("all inputs must share a device")


def _tiles(cfg: IndexerConfig, n: int, width: int, device: torch.device) -> int:
    """Tiles a program scores: the fewest that keep the launch within one wave of `programs_per_sm` programs an
    SM, so that the pipeline's start is paid over as many tiles as the rows allow and no second wave of a few
    programs follows (FP8 keys, B = 8 at 128K: 16 tiles a program, 1,024 programs, 43.7 us; 15 tiles, 1,096
    programs, 50.7 us). At least two where that still leaves three programs an SM: a program loads the row's
    query first (32 heads: as many bytes as a 64-token tile of FP8 keys), which one tile would pay for alone
    (B = 8 at 8K: 9.5 us on two tiles a program against 10.4 on one)."""
    if cfg.tiles is not None:
        return cfg.tiles
    total = triton.cdiv(width, cfg.block_t)
    if device.type != "cuda":
        return max(1, min(4, total))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_row = max(1, cfg.programs_per_sm * sms // max(n, 1))  # programs a row may have
    tiles = max(1, min(cfg.max_tiles, triton.cdiv(total, per_row)))
    if tiles == 1 and n * triton.cdiv(total, 2) >= 3 * sms:
        tiles = 2
    return tiles


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, kv: IndexerKeys, page_table: torch.Tensor,
    row_to_req: torch.Tensor, ctx_lens: torch.Tensor, limits: torch.Tensor, *,
    kv_format: str, scale: float, topk: int, max_ctx: int | None = None, config: IndexerConfig | None = None,
    out: torch.Tensor | None = None, visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton scores [N, max(max_ctx, topk)] float32 (-inf where not visible), optionally into `out`; rows of
    a new tensor start 16-byte aligned (its row stride a multiple of four). `visible`: the rows'
    `visible_lengths(ctx_lens, limits, max_ctx)` when the caller already holds them."""
    return _scores(q, weights, kv, page_table, row_to_req, ctx_lens, limits, kv_format=kv_format, scale=scale,
                   topk=topk, max_ctx=max_ctx, config=config, out=out, visible=visible)[0]


def _scores(
    q: torch.Tensor, weights: torch.Tensor, kv: IndexerKeys, page_table: torch.Tensor,
    row_to_req: torch.Tensor, ctx_lens: torch.Tensor, limits: torch.Tensor, *,
    kv_format: str, scale: float, topk: int, max_ctx: int | None, config: IndexerConfig | None,
    out: torch.Tensor | None, visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_scores` and each row's visible length, which `indexer_topk` reuses for its counts (made once:
    in a CUDA graph each small PyTorch op is a launch of its own)."""
    if not isinstance(kv, IndexerKeys):
        raise ValueError(f"kv must be IndexerKeys (values and scales views), got {type(kv).__name__}")
    cfg = config or IndexerConfig.for_problem(kv_format)
    _check(q, weights, kv, page_table, row_to_req, ctx_lens, limits, kv_format, cfg.block_t)
    n, hi, di = q.shape
    max_ctx = page_table.shape[1] * kv.tokens_per_page if max_ctx is None else max_ctx
    width = max(max_ctx, topk)
    if out is None:  # rows start 16-byte aligned, so the top-K's CUDA select loads them as vectors
        scores = torch.empty((n, triton.cdiv(width, 4) * 4), dtype=torch.float32, device=q.device)[:, :width]
    elif out.shape != (n, width) or out.dtype != torch.float32 or out.stride(1) != 1 or out.device != q.device:
        raise ValueError(f"out must be float32 [N, {width}] with unit last stride on q's device")
    else:
        scores = out
    if visible is None:
        visible = visible_lengths(ctx_lens, limits, max_ctx)
    elif visible.shape != (n,) or visible.dtype != torch.int32 or visible.device != q.device:
        raise ValueError(f"visible must be int32 [{n}] on q's device")
    if n == 0:
        return scores, visible
    tiles = _tiles(cfg, n, width, q.device)
    grid = (triton.cdiv(width, cfg.block_t * tiles), n)
    values, scales = kv.values, kv.values if kv.scales is None else kv.scales
    _indexer_score_kernel[grid](
        q, weights, values, scales, page_table, row_to_req, visible, scores,
        q.stride(0), q.stride(1), weights.stride(0), values.stride(0), scales.stride(0), page_table.stride(0),
        scores.stride(0), hi, page_table.shape[1], width, scale, tiles,
        DI=di, TOKENS=kv.tokens_per_page, KV_FMT=_FMT_CODE[kv_format], COMPUTE=_COMPUTE[q.dtype],
        ROW=values.shape[2],
        IEEE=q.dtype == torch.float32, BLOCK_H=max(16, triton.next_power_of_2(hi)),
        BLOCK_T=cfg.block_t, PREFETCH=cfg.prefetch, SOFT_CVT=_soft_cvt(), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_options(q.device)
    )
    return scores, visible


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, kv: IndexerKeys, page_table: torch.Tensor,
    row_to_req: torch.Tensor, ctx_lens: torch.Tensor, limits: torch.Tensor, *,
    kv_format: str, scale: float, topk: int, max_ctx: int | None = None, config: IndexerConfig | None = None,
) -> IndexerTopK:
    """Triton scoring then the top-K kernel: q [N, Hi, Di], weights [N, Hi] -> IndexerTopK."""
    scores, visible = _scores(q, weights, kv, page_table, row_to_req, ctx_lens, limits, kv_format=kv_format,
                              scale=scale, topk=topk, max_ctx=max_ctx, config=config, out=None)
    return _select(scores, visible, topk, kernel=True)
