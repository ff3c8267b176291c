"""FP8 row packing at KV write: rows quantised and stored straight into the page pool.

At every forward the new tokens' MLA rows (normed latent [N, Dl] + roped key
[N, Dr]) and indexer keys [N, D] are packed into the byte formats of
`kernels/fp8_rows.py` and written into the pool at the tokens' slots of one
layer, without an intermediate rows tensor. An MLA row is one run of bytes
(values, scales, roped key) and lands by a `RowPlacement`:

    byte = (slot // tokens_per_page) * page_bytes + row_offset
           + (slot % tokens_per_page) * token_stride

MLA layer `l` in IndexShare group `g` at position `j`: tokens_per_page = page
size, row_offset = group_offset(g) + j * mla_row_bytes, token_stride =
group_run_bytes[g]. An indexer key's values and its scale live apart, each at a
`KeyPlacement`:

    values = (slot // tokens_per_page) * page_bytes + value_offset
             + (slot % tokens_per_page) * value_stride
    scale  = (slot // tokens_per_page) * page_bytes + scale_offset
             + (slot % tokens_per_page) * scale_stride

Full layer number `f` (`engine/kv_layout.py`, T = indexer_tokens_per_page, D =
index dim): value_offset = f * T * (D + 4), value_stride = D, scale_offset =
value_offset + T * D, scale_stride = 4: all of the layer's values, then all of
its scales, so every key's values start 16-byte aligned.

Both writes can take their projections' raw outputs and do what sits between the projection and the cache
in the same launch: the latent's RMSNorm and the key's rotation (`LatentPrep`), the indexer key's LayerNorm
and the rotation of its first values (`KeyPrep`).

The result equals the `fp8_rows` twins byte for byte: scales and quotients use
IEEE division (`div_rn`), and fp32 -> e4m3fn / bf16 rounding is done in integer
arithmetic (round to nearest even, as torch's `.to(torch.float8_e4m3fn)` and
`.to(torch.bfloat16)` do) so the CUDA build and the CPU interpreter agree with
torch. NaN inputs are out of scope. Slots must be distinct.

The reference is `fp8_rows` run on the CPU. Run on CUDA, `fp8_rows` itself can
differ in the last bit of a scale (torch's CUDA division by the Python scalar
448 multiplies by its reciprocal): on an H200, 4096 GLM-shaped rows, 10,577 of
2.7 MB bytes differed from its CPU run, while this kernel matched the CPU run
byte for byte (bench/gpu_check_residency.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import fp8_rows, pdl
from kernels.rope import rotated_pairs


class RowPlacement(NamedTuple):
    """Where the rows of one layer live inside a page (see the module docstring)."""

    tokens_per_page: int  # tokens of this row kind per page
    row_offset: int  # byte offset of token 0's row inside a page
    token_stride: int  # bytes from one token's row to the next


class KeyPlacement(NamedTuple):
    """Where the FP8 indexer keys of one full layer live inside an indexer page: values and scales apart (see
    the module docstring)."""

    tokens_per_page: int  # keys per indexer page
    value_offset: int  # byte offset of token 0's fp8 values inside a page
    value_stride: int  # bytes from one token's values to the next
    scale_offset: int  # byte offset of token 0's float32 scale inside a page
    scale_stride: int  # bytes from one token's scale to the next


@triton.jit
def _e4m3_bits(q):
    """fp32 in [-448, 448] -> e4m3fn code (uint32), round to nearest even."""
    bits = q.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960  # rebias 127 -> 7 (120 << 3)
    shift = tl.minimum(141 - tl.minimum(exp, 120), 31)  # subnormal: value * 2^9 as an integer
    mant = (mag & 0x7FFFFF) | 0x800000
    whole = mant >> shift
    rest = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((whole & 1) == 1))
    sub = whole + up.to(tl.uint32)
    return tl.where(exp >= 121, normal, sub) | sign


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (uint32), round to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """float32 v rounded to DT and back (bf16 in integer arithmetic: the interpreter's conversion truncates)."""
    if DT == tl.bfloat16:
        return (_bf16_bits(v) << 16).to(tl.float32, bitcast=True)
    return v.to(DT).to(tl.float32)


@triton.jit
def _store_bf16(base, index, v, mask):
    """Float32 values as bf16 (round to nearest even) at the 2-byte slots `index` from base (uint8 pointer)."""
    two = tl.arange(0, 2)
    value_bytes = (_bf16_bits(v)[:, None] >> (8 * two[None, :]).to(tl.uint32)) & 0xFF
    tl.store(base + 2 * index[:, None] + two[None, :], value_bytes.to(tl.uint8), mask=mask[:, None])


@triton.jit
def _e4m3_scale(amax):
    """A block's scale from its largest magnitude: amax / 448 (IEEE division), 1 for an all-zero block."""
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def _store_e4m3(at, v, scale, mask):
    """v / scale (IEEE division, scale broadcast against v, clamped to e4m3's range) as e4m3 bytes at `at`."""
    q = tl.math.div_rn(v, tl.zeros(v.shape, tl.float32) + scale)
    tl.store(at, _e4m3_bits(tl.minimum(tl.maximum(q, -448.0), 448.0)).to(tl.uint8), mask=mask)


@triton.jit
def _program_token(slots_ptr, pool_ptr, page_bytes, TOKENS: tl.constexpr, PDL: tl.constexpr):
    """(row n of the program, its slot's token within its page, the page's first byte), once the launch before
    has finished (PDL)."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    return n, slot % TOKENS, pool_ptr + (slot // TOKENS) * page_bytes


@triton.jit
def _pack_kernel(
    x_ptr, rope_ptr, pool_ptr, slots_ptr, norm_ptr, cos_ptr, sin_ptr,
    x_stride, rope_stride, page_bytes, row_offset, token_stride, scale_offset, scale_stride, eps, table_stride,
    TOKENS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    NB_P: tl.constexpr, BS_P: tl.constexpr, DR: tl.constexpr, DR_P: tl.constexpr,
    NORM: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
):
    n, token, page = _program_token(slots_ptr, pool_ptr, page_bytes, TOKENS, PDL)
    row = page + row_offset + token * token_stride

    blk = tl.arange(0, NB_P)
    col = tl.arange(0, BS_P)
    mask = (blk[:, None] < NB) & (col[None, :] < BS)
    x = tl.load(x_ptr + n * x_stride + blk[:, None] * BS + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:  # kv_a_layernorm as kernels.rmsnorm computes it: mean square, scale, round, weight, round
        rstd = tl.math.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
        w = tl.load(norm_ptr + blk[:, None] * BS + col[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _round_to(_round_to(x * rstd, DT) * w, DT)
    scale = _e4m3_scale(tl.max(tl.abs(x), 1))
    _store_e4m3(row + blk[:, None] * BS + col[None, :], x, scale[:, None], mask)

    four = tl.arange(0, 4)
    scale_bytes = (scale.to(tl.uint32, bitcast=True)[:, None] >> (8 * four[None, :]).to(tl.uint32)) & 0xFF
    scales_at = page + scale_offset + token * scale_stride
    tl.store(scales_at + 4 * blk[:, None] + four[None, :], scale_bytes.to(tl.uint8), mask=blk[:, None] < NB)

    if DR > 0:
        rope_at = row + D + 4 * NB  # bf16 values, two bytes each
        if ROTATE:  # the key's rotary embedding, stored in the order kernels.rope writes it
            i = tl.arange(0, DR_P // 2)
            pair = i < DR // 2
            lo, hi = rotated_pairs(rope_ptr + n * rope_stride, cos_ptr + n * table_stride,
                                   sin_ptr + n * table_stride, i, pair, DR, INTERLEAVED)
            _store_bf16(rope_at, i, _round_to(lo, DT), pair)
            _store_bf16(rope_at, DR // 2 + i, _round_to(hi, DT), pair)
        else:
            r = tl.arange(0, DR_P)
            rope = tl.load(rope_ptr + n * rope_stride + r, mask=r < DR, other=0.0).to(tl.float32)
            _store_bf16(rope_at, r, rope, r < DR)


@triton.jit
def _layer_norm_at(x_row, w_ptr, b_ptr, cols, mean, rstd, mask, DT: tl.constexpr):
    """LayerNorm of the row's columns `cols` given its mean and rstd, as float32 rounded to DT (the norm's output
    dtype, what the rotation and the quantisation read)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _round_to((x - mean) * rstd * w + b, DT)


@triton.jit
def _pack_key_kernel(
    x_ptr, pool_ptr, slots_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr,
    x_stride, table_stride, page_bytes, value_offset, value_stride, scale_offset, scale_stride, eps,
    TOKENS: tl.constexpr, D: tl.constexpr, R: tl.constexpr, REST_P: tl.constexpr, INTERLEAVED: tl.constexpr,
    DT: tl.constexpr, PDL: tl.constexpr,
):
    """One indexer key from wk's raw output: LayerNorm (float32 mean and variance, rounded to DT), the rotary
    embedding of its first R values (kernels.rope's products and order, rounded to DT), then the FP8 values
    and the scale stored as `_pack_kernel` stores a one-block key."""
    n, token, page = _program_token(slots_ptr, pool_ptr, page_bytes, TOKENS, PDL)
    values = page + value_offset + token * value_stride
    x_row = x_ptr + n * x_stride
    x = tl.load(x_row + tl.arange(0, D)).to(tl.float32)
    mean = tl.sum(x, 0) / D
    rstd = tl.math.rsqrt(tl.sum((x - mean) * (x - mean), 0) / D + eps)

    i = tl.arange(0, R // 2)
    pair = i < R // 2
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + R // 2
    a = _layer_norm_at(x_row, w_ptr, b_ptr, first, mean, rstd, pair, DT)
    b = _layer_norm_at(x_row, w_ptr, b_ptr, second, mean, rstd, pair, DT)
    c = tl.load(cos_ptr + n * table_stride + i).to(tl.float32)
    s = tl.load(sin_ptr + n * table_stride + i).to(tl.float32)
    lo = _round_to(a * c - b * s, DT)
    hi = _round_to(b * c + a * s, DT)
    r = R + tl.arange(0, REST_P)
    rest_mask = r < D
    rest = _layer_norm_at(x_row, w_ptr, b_ptr, r, mean, rstd, rest_mask, DT)

    scale = _e4m3_scale(tl.maximum(tl.maximum(tl.max(tl.abs(lo), 0), tl.max(tl.abs(hi), 0)), tl.max(tl.abs(rest), 0)))
    _store_e4m3(values + i, lo, scale, pair)
    _store_e4m3(values + R // 2 + i, hi, scale, pair)
    _store_e4m3(values + r, rest, scale, rest_mask)
    four = tl.arange(0, 4)
    scale_bytes = (scale.to(tl.uint32, bitcast=True) >> (8 * four).to(tl.uint32)) & 0xFF
    tl.store(page + scale_offset + token * scale_stride + four, scale_bytes.to(tl.uint8))


def _check(values: list[tuple[str, torch.Tensor]], pool: torch.Tensor, slots: torch.Tensor) -> None:
    n = slots.shape[0] if slots.dim() == 1 else -1
    if n < 0 or slots.dtype not in (torch.int32, torch.int64) or slots.device != pool.device:
        raise ValueError("slots must be a 1-D int32/int64 tensor on the pool's device")
    for name, t in values:
        if t.dim() != 2 or t.shape[0] != n or not t.is_floating_point() or t.device != pool.device:
            raise ValueError(f"{name} must be a [N, dim] float tensor on the pool's device")
        if t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous")
    if pool.dim() != 2 or pool.dtype != torch.uint8 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous [pages, page_bytes] uint8 tensor")


def _check_runs(place: RowPlacement | KeyPlacement, pool: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """For each (offset, stride, size): tokens_per_page runs of `size` bytes, `stride` apart from `offset`, fit
    in a page without overlapping."""
    tokens = place.tokens_per_page
    for offset, stride, size in runs:
        if tokens <= 0 or offset < 0 or stride < size or offset + (tokens - 1) * stride + size > pool.shape[1]:
            raise ValueError(f"{place} does not fit {size}-byte runs in a {pool.shape[1]}-byte page")


class LatentPrep(NamedTuple):
    """What turns kv_a_proj's raw outputs into an MLA row: the latent's RMSNorm (weight [Dl], eps) and the
    key's rotary embedding (tables cos / sin [N, Dr/2], pair order), applied by the packing launch."""

    norm_weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool


class KeyPrep(NamedTuple):
    """What turns the indexer's key projection into its cached key: the LayerNorm (weight and bias [D], eps),
    then the rotary embedding of its first `rope_dim` values (tables cos / sin [N, rope_dim/2], pair order),
    applied by the packing launch."""

    norm_weight: torch.Tensor
    norm_bias: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    rope_dim: int
    interleaved: bool


_DT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _launch(x: torch.Tensor, rope: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor,
            place: RowPlacement | KeyPlacement, num_blocks: int, prep: LatentPrep | None = None) -> None:
    n, d = x.shape
    dr = 0 if rope is None else rope.shape[1]
    if n == 0:
        return
    if isinstance(place, KeyPlacement):
        tokens, row_offset, token_stride, scale_offset, scale_stride = place
    else:  # the scales follow the values inside the row
        tokens, row_offset, token_stride = place
        scale_offset, scale_stride = row_offset + d, token_stride
    bs = d // num_blocks
    _pack_kernel[(n,)](
        x, x if rope is None else rope, pool, slots,
        x if prep is None else prep.norm_weight, x if prep is None else prep.cos, x if prep is None else prep.sin,
        x.stride(0), 0 if rope is None else rope.stride(0), pool.shape[1], row_offset, token_stride,
        scale_offset, scale_stride, 0.0 if prep is None else prep.eps, 0 if prep is None else prep.cos.stride(0),
        TOKENS=tokens, D=d, NB=num_blocks, BS=bs,
        NB_P=triton.next_power_of_2(num_blocks), BS_P=triton.next_power_of_2(bs),
        DR=dr, DR_P=triton.next_power_of_2(max(dr, 1)), NORM=prep is not None, ROTATE=prep is not None,
        INTERLEAVED=prep is not None and prep.interleaved, DT=_DT.get(x.dtype, tl.float32), num_warps=4,
        **pdl.launch_options(x.device)
    )


def _check_mla(latent: torch.Tensor, rope: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
               place: RowPlacement) -> None:
    _check([("latent", latent), ("rope", rope)], pool, slots)
    if not isinstance(place, RowPlacement):
        raise TypeError(f"MLA rows are placed by a RowPlacement, got {place!r}")
    _check_runs(place, pool, [(place.row_offset, place.token_stride,
                               fp8_rows.mla_row_bytes(latent.shape[1], rope.shape[1]))])


def _check_keys(keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, place: KeyPlacement) -> None:
    _check([("keys", keys)], pool, slots)
    if not isinstance(place, KeyPlacement):
        raise TypeError(f"indexer keys are placed by a KeyPlacement (values and scales apart), got {place!r}")
    _check_runs(place, pool, [(place.value_offset, place.value_stride, keys.shape[1]),
                              (place.scale_offset, place.scale_stride, 4)])


def pack_mla_rows_into(latent: torch.Tensor, rope: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                       place: RowPlacement, prep: LatentPrep | None = None) -> None:
    """[N, Dl] latent + [N, Dr] rope -> FP8 MLA rows at `slots` of one layer of `pool`. With `prep` the inputs
    are kv_a_proj's raw outputs (rows may be strided), normalised and rotated here first (in their dtype's
    roundings), so the norm and the rotary embedding cost no launch of their own."""
    _check_mla(latent, rope, pool, slots, place)
    if prep is not None and (prep.norm_weight.shape != (latent.shape[1],) or prep.norm_weight.stride(0) != 1
                             or prep.cos.shape != (latent.shape[0], rope.shape[1] // 2) or prep.cos.stride(1) != 1
                             or prep.sin.shape != prep.cos.shape or prep.sin.stride() != prep.cos.stride()
                             or rope.shape[1] % 2):
        raise ValueError("prep needs a norm weight [Dl] and rotary tables [N, Dr/2] with contiguous rows")
    _launch(latent, rope, pool, slots, place, fp8_rows.num_scale_blocks(latent.shape[1]), prep)


def key_prep_fits(dim: int, rope_dim: int) -> bool:
    """Whether the packing launch normalises and rotates keys of `dim` values with `rope_dim` rotated: both
    halves of the rotated part and the key itself a power of two wide."""
    half = rope_dim // 2
    return dim & (dim - 1) == 0 and rope_dim % 2 == 0 and 0 < rope_dim <= dim and half & (half - 1) == 0


def pack_indexer_rows_into(keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                           place: KeyPlacement, prep: KeyPrep | None = None) -> None:
    """[N, D] indexer keys -> FP8 values and scales at `slots` of one full layer of `pool`. With `prep` the keys
    are wk's raw outputs (rows may be strided), normalised and rotated here first (in their dtype's roundings),
    so the LayerNorm and the rotary embedding cost no launch of their own."""
    _check_keys(keys, pool, slots, place)
    if prep is None:
        _launch(keys, None, pool, slots, place, 1)
        return
    n, d = keys.shape
    r = prep.rope_dim
    if (not key_prep_fits(d, r) or prep.norm_weight.shape != (d,) or prep.norm_bias.shape != (d,)
            or prep.norm_weight.stride(0) != 1 or prep.norm_bias.stride(0) != 1
            or prep.cos.shape != (n, r // 2) or prep.cos.stride(1) != 1 or prep.sin.shape != prep.cos.shape
            or prep.sin.stride() != prep.cos.stride()):
        raise ValueError("prep needs a power-of-two key width, a norm weight and bias [D] and rotary tables "
                         "[N, rope_dim/2] (a power of two) with contiguous rows")
    if n == 0:
        return
    tokens, value_offset, value_stride, scale_offset, scale_stride = place
    _pack_key_kernel[(n,)](
        keys, pool, slots, prep.norm_weight, prep.norm_bias, prep.cos, prep.sin,
        keys.stride(0), prep.cos.stride(0), pool.shape[1], value_offset, value_stride, scale_offset, scale_stride,
        prep.eps, TOKENS=tokens, D=d, R=r, REST_P=triton.next_power_of_2(max(d - r, 1)),
        INTERLEAVED=prep.interleaved, DT=_DT.get(keys.dtype, tl.float32), num_warps=4,
        **pdl.launch_options(keys.device)
    )


# --- PyTorch twins -------------------------------------------------------------------


def _scatter(data: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, tokens_per_page: int, offset: int,
             stride: int) -> None:
    """data [N, bytes] uint8 to the runs at `offset + token * stride` of the slots' pages."""
    slots = slots.long()
    base = (slots // tokens_per_page) * pool.shape[1] + offset + (slots % tokens_per_page) * stride
    idx = base[:, None] + torch.arange(data.shape[1], device=pool.device)
    pool.view(-1)[idx.reshape(-1)] = data.reshape(-1)


def pack_mla_rows_into_reference(latent: torch.Tensor, rope: torch.Tensor, pool: torch.Tensor,
                                 slots: torch.Tensor, place: RowPlacement) -> None:
    """Twin of `pack_mla_rows_into` through `fp8_rows.pack_mla_rows`."""
    _check_mla(latent, rope, pool, slots, place)
    _scatter(fp8_rows.pack_mla_rows(latent, rope), pool, slots, *place)


def pack_indexer_rows_into_reference(keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                     place: KeyPlacement) -> None:
    """Twin of `pack_indexer_rows_into` through `fp8_rows.pack_indexer_rows`."""
    _check_keys(keys, pool, slots, place)
    packed = fp8_rows.pack_indexer_rows(keys)
    d = keys.shape[1]
    _scatter(packed[:, :d], pool, slots, place.tokens_per_page, place.value_offset, place.value_stride)
    _scatter(packed[:, d:], pool, slots, place.tokens_per_page, place.scale_offset, place.scale_stride)


@triton.jit
def _cast_out(v, ptr, SOFT_CVT: tl.constexpr):
    """float32 v in the element type of ptr, rounded to nearest even (the interpreter's own fp32 -> bf16
    conversion truncates, so under SOFT_CVT bf16 is rounded in integer arithmetic first)."""
    if SOFT_CVT and ptr.dtype.element_ty == tl.bfloat16:
        v = (_bf16_bits(v) << 16).to(tl.float32, bitcast=True)
    return v.to(ptr.dtype.element_ty)
