"""The MoE router's selection in one launch: sigmoid scores, correction bias, group-limited top-k,
normalised and scaled weights, and the shared expert appended as one more slot.

`engine.layers.Router` does this in about twenty PyTorch operations (two to three top-k, a scatter, masks,
gathers, sums), each a launch of a few microseconds at decode batch sizes. Here one program per token
(one warp) holds its E scores in registers: groups rank by the sum of their two best biased scores (the first
`topk_group` groups win, ties to the lower group), then the `top_k` best biased scores inside them (ties to
the lower expert) are the experts; their weights are the unbiased sigmoid scores, divided by their sum
(plus 1e-20) when `normalise`, times `scale`. With `shared_slot` >= 0 a last column routes every token to
that expert with weight 1 (the shared expert stacked with the routed ones). Scores are float32 as in the
reference; the weights' sum may round differently from torch's, so weights agree to float32 rounding,
the chosen experts exactly (in order of decreasing score; the reference's order is unspecified).

The logits themselves (`router_logits`) are the float32 product the reference computes, x.float() @ w.float().T
with the router weight in the model's dtype (bf16 for a serving model, as published), for decode batches as
partial sums over K ranges spread across programs (a few rows against 256 x 6144 weights: a handful of programs
would each stream megabytes), added in a fixed order by the selection launch, or, for a token or two, by the last
range of each expert tile to arrive. Forms:
- bf16 activations and a bf16 weight, up to `ROUTER_BF16_TOKENS` tokens: one bf16 dot a tile, every product exact
  in float32, every token in one tile so the weight (3.1 MB at GLM-5.3) is read once: 7.1-8.9 us with the
  selection at 4-128 tokens on an H200, where a float32 weight's forms took 10.6-16.5. The tensor core's float32
  accumulation is not IEEE: 3-4e-6 absolute at GLM-5.3's shapes (cuBLAS's IEEE SGEMM 2e-6).
- other activations or weights, up to `ROUTER_PARTIAL_TOKENS` tokens: three TF32 products (`tf32x3`: the weight
  split into a TF32 head and tail; bf16 activations are exact in TF32), 2-3e-6 from the IEEE product, a 16 x 16
  tile a program of two warps: 6.5 us at 3-16 tokens and 9.9 at 32 for a float32 weight (cuBLAS 6-19 us, IEEE
  dots in Triton 17-32). Float32 products for a block of tokens a program measured slower than the dots from two
  tokens on: the time is the chain of load, partial store and last range's sum.
More tokens take cuBLAS (`partial_tokens`). Up to `ROUTER_FMA_TOKENS` tokens the partial sums are IEEE float32
products summed in registers, one token per program (no mostly empty 16-row dot tiles); a caller may raise that
bound (`fma_tokens`): the indexer's head weights, [32, 6144] float32, take it up to 64 rows (engine/attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import _arrival_counters, _interpreting, _num_sms


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, num_tokens, num_experts, hidden, k_per_split,
                          stride_xt, stride_we, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          BF16: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """part[s, t, e] = sum over k in split s of x[t, k] * w[e, k], in float32: bf16 dots (BF16: bf16 x and w,
    `_bf16_dot`) or tf32x3 dots."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    pe, pt, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    tmask, emask = offs_t < num_tokens, offs_e < num_experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_end = tl.minimum(split * k_per_split + k_per_split, hidden)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        kmask = (k0 + offs_k) < k_end
        x = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * stride_we + (k0 + offs_k)[None, :],
                    mask=emask[:, None] & kmask[None, :], other=0.0)
        if BF16:
            acc = _bf16_dot(x, w, acc, IEEE)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="tf32x3")
    out = part_ptr + (split * num_tokens + offs_t.to(tl.int64))[:, None] * num_experts + offs_e[None, :]
    tl.store(out, acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _bf16_dot(x, w, acc, IEEE: tl.constexpr):
    """acc + x @ w.T for bf16 operands, each product exact, accumulated by the tensor core in float32; IEEE: as
    float32 IEEE dots instead (the interpreter's bf16 dots are unreliable; the products are the same)."""
    if IEEE:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _router_logits_fma_kernel(x_ptr, w_ptr, part_ptr, logits_ptr, arrivals_ptr, num_tokens, num_experts, hidden,
                              k_per_split, stride_xt, stride_we, out_scale,
                              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """logits[t, e-tile] for a token or two: each program (expert tile, token, K range) sums its range's IEEE
    float32 products in registers (a 16-row dot tile would be mostly padding) and stores them as part[s, t, e];
    the tile's last range to arrive adds the ranges' partials (one fixed-shape sum, so every rank adds alike),
    writes the logits times `out_scale` and re-arms its counter. The selection then reads one float an expert,
    not one a range (48 at GLM-5.3). With PDL the weight tile is requested before the wait for the kernel that
    writes x (kernels/pdl.py)."""
    pdl.begin(PDL)
    pe, t, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    emask = offs_e < num_experts
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    k_end = tl.minimum(split * k_per_split + k_per_split, hidden)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        kmask = (k0 + offs_k) < k_end
        w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * stride_we + (k0 + offs_k)[None, :],
                    mask=emask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        pdl.wait(PDL)  # returns at once after the first tile
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    pdl.wait(PDL)  # an empty K range stores too
    tl.store(part_ptr + (split * num_tokens + t).to(tl.int64) * num_experts + offs_e, acc, mask=emask)
    tl.debug_barrier()  # the whole partial is stored before the arrival is counted
    counter = arrivals_ptr + t * tl.num_programs(0) + pe
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if arrived == tl.num_programs(2) - 1:
        ranges = tl.arange(0, BLOCK_S)
        tile = tl.load(part_ptr + (ranges[:, None] * num_tokens + t).to(tl.int64) * num_experts + offs_e[None, :],
                       mask=(ranges < tl.num_programs(2))[:, None] & emask[None, :], other=0.0,
                       cache_modifier=".cg")
        tl.store(logits_ptr + t.to(tl.int64) * num_experts + offs_e, tl.sum(tile, 0) * out_scale, mask=emask)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


_LOWEST_EXPERT_KEY: tl.constexpr = tl.constexpr(0x7FFFFFFF)  # a key's low half: this less the expert id
_TAKEN: tl.constexpr = tl.constexpr(-(2**63))  # below every key: an expert already picked


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, scale, num_tokens, num_experts,
                   SPLITS: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOPK: tl.constexpr, SLOTS: tl.constexpr, NORMALISE: tl.constexpr, SHARED: tl.constexpr,
                   SHARED_SLOT: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)[:, None]
    e = g * PER_GROUP + tl.arange(0, PER_GROUP)[None, :]  # [GROUPS, PER_GROUP] expert ids
    logits = tl.load(logits_ptr + t * num_experts + e)
    for s in tl.static_range(1, SPLITS):  # partial sums of router_logits, added in order
        logits += tl.load(logits_ptr + (s * num_tokens + t) * num_experts + e)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + e)
    if GROUPS > 1:  # groups: the sum of each group's two best biased scores
        neg = float("-inf")
        best = tl.max(choice, 1)
        first = tl.min(tl.where(choice == best[:, None], e, num_experts), 1)
        second = tl.max(tl.where(e == first[:, None], neg, choice), 1)
        group_score = best + second
        allowed = tl.zeros([GROUPS, PER_GROUP], dtype=tl.int1)
        gid = tl.arange(0, GROUPS)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == top, gid, GROUPS), 0)
            allowed = allowed | (g == pick)
            group_score = tl.where(gid == pick, neg, group_score)
        choice = tl.where(allowed, choice, neg)
    # experts: TOPK best biased scores among the allowed groups, ties to the lower expert, one maximum a round:
    # each score's bits as an integer of the same order above the expert id reversed (a sigmoid is never -0.0,
    # nor is its sum with the bias, so equal scores have equal bits)
    bits = choice.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (-e + _LOWEST_EXPERT_KEY).to(tl.int64)
    slot = tl.arange(0, SLOTS)
    out_ids = tl.zeros([SLOTS], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        pick = (-(tl.max(tl.max(key, 1), 0) & 0xFFFFFFFF) + _LOWEST_EXPERT_KEY).to(tl.int32)
        out_ids = tl.where(slot == k, pick, out_ids)
        key = tl.where(e == pick, _TAKEN, key)
    out_w = tl.gather(tl.reshape(scores, [GROUPS * PER_GROUP]), out_ids, 0)  # the unbiased scores
    routed = slot < TOPK
    if NORMALISE:
        out_w = out_w / (tl.sum(tl.where(routed, out_w, 0.0), 0) + 1e-20)
    out_w = out_w * scale
    if SHARED:
        out_ids = tl.where(slot == TOPK, SHARED_SLOT, out_ids)
        out_w = tl.where(slot == TOPK, 1.0, out_w)
    width = TOPK + SHARED
    tl.store(ids_ptr + t * width + slot, out_ids, mask=slot < width)
    tl.store(weights_ptr + t * width + slot, out_w, mask=slot < width)


_ROUTER_TILE = 16  # tokens and experts per program (the float32 dot's smallest tile)
_ROUTER_K = 128
SELECT_WARPS = 1  # one warp per token: its reductions stay in shuffles (H200: 3.3 us against 4.9 with four)
DOT_WARPS = 2  # a 16 x 16 dot tile a program (H200, 4-16 tokens: 6.5 us against 7.9 with four warps)
ROUTER_PARTIAL_TOKENS = 32  # up to this many tokens the tf32x3 partial sums beat cuBLAS (H200, 256 x 6144)
ROUTER_BF16_TOKENS = 128  # up to this many tokens bf16 activations and a bf16 weight take bf16 dots
# their expert tile, K ranges and warps, every token in one tile (H200, 4-128 tokens with the selection: 7.1-8.9 us
# in 12 ranges against 7.5-11.5 in 24 and more in 48)
_BF16_E, _BF16_RANGES, _BF16_WARPS = 32, 12, 4
ROUTER_FMA_TOKENS = 2  # up to this many tokens the partial sums are float32 products in registers, not dots
_FMA_MAX_SPLITS = 64  # K ranges of those (GLM-5.3: 48 of 128 columns, 768 programs of one 16 x 128 tile)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def partial_tokens(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
    """The most tokens of activations of `x_dtype` whose logits against a weight of `weight_dtype`
    `router_logits` computes faster than cuBLAS."""
    bf16 = x_dtype == weight_dtype == torch.bfloat16
    return ROUTER_BF16_TOKENS if bf16 else ROUTER_PARTIAL_TOKENS


def router_logits(x: torch.Tensor, weight: torch.Tensor, fma_tokens: int = ROUTER_FMA_TOKENS,
                  out_scale: float = 1.0) -> torch.Tensor:
    """x [T, H] and a weight [E, H] (the router's, in the model dtype, or the indexer's float32 head weights) ->
    partial logits [S, T, E] float32 whose sum over S is x.float() @ weight.float().T. Up to `fma_tokens` tokens
    (one program per 128-column tile and token) come back summed: S = 1; bf16 x and w of up to
    `ROUTER_BF16_TOKENS` tokens take bf16 dots over `_BF16_RANGES` K ranges; others tf32x3 dots, S chosen so
    about two programs run per SM. `out_scale` multiplies the summed logits (the float32 product a separate
    multiply would round to, without its launch: the indexer's head weights carry n_heads**-0.5); partial
    sums are returned as they are, so it needs the summed form."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if (weight.shape[1] != hidden or weight.dtype not in _WEIGHT_DTYPES or x.stride(1) != 1
            or weight.stride(1) != 1):
        raise ValueError("router_logits needs x [T, H] and a float32, bf16 or fp16 weight [E, H], both with unit "
                         "last stride")
    fma = t <= fma_tokens
    if out_scale != 1.0 and not fma:
        raise ValueError(f"out_scale scales summed logits: up to fma_tokens = {fma_tokens} tokens, got {t}")
    bf16 = not fma and x.dtype == weight.dtype == torch.bfloat16 and t <= ROUTER_BF16_TOKENS
    blocks = triton.cdiv(hidden, _ROUTER_K)
    if fma:  # every weight tile loaded at once, one per program: a single memory round trip
        splits = min(blocks, _FMA_MAX_SPLITS)
    elif bf16:
        splits = _BF16_RANGES
    else:
        tiles = triton.cdiv(num_experts, _ROUTER_TILE) * triton.cdiv(t, _ROUTER_TILE)
        splits = max(1, min(triton.cdiv(2 * _num_sms(x.device), tiles), blocks // 2, 16))
    k_per_split = triton.cdiv(blocks, splits) * _ROUTER_K
    splits = triton.cdiv(hidden, k_per_split)
    parts = torch.empty(splits, t, num_experts, dtype=torch.float32, device=x.device)
    if t and fma:
        tiles = triton.cdiv(num_experts, _ROUTER_TILE)
        logits = torch.empty(1, t, num_experts, dtype=torch.float32, device=x.device)
        _router_logits_fma_kernel[(tiles, t, splits)](
            x, weight, parts, logits, _arrival_counters(x.device, t * tiles), t, num_experts, hidden, k_per_split,
            x.stride(0), weight.stride(0), out_scale, BLOCK_E=_ROUTER_TILE, BLOCK_K=_ROUTER_K,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4, **pdl.launch_options(x.device))
        return logits
    if t:
        # bf16: every token in one tile, so the weight is read once
        block_t, block_e = (max(16, triton.next_power_of_2(t)), _BF16_E) if bf16 else (_ROUTER_TILE,) * 2
        grid = (triton.cdiv(num_experts, block_e), triton.cdiv(t, block_t), splits)
        _router_logits_kernel[grid](x, weight, parts, t, num_experts, hidden, k_per_split, x.stride(0),
                                    weight.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=_ROUTER_K,
                                    BF16=bf16, IEEE=_interpreting(), num_warps=_BF16_WARPS if bf16 else DOT_WARPS,
                                    **pdl.launch_options(x.device))
    return parts


def route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, normalise: bool,
          scale: float, shared_slot: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, E] (or `router_logits`' partial sums [S, T, E]) and correction bias [E] ->
    (weights [T, k'] float32, expert ids [T, k'] int32), k' = top_k, plus one when `shared_slot` >= 0 (that
    expert, weight 1, last)."""
    parts = logits if logits.dim() == 3 else logits[None]
    splits, t, num_experts = parts.shape
    per_group = num_experts // max(n_group, 1)
    if (parts.dtype != torch.float32 or not parts.is_contiguous() or bias.shape != (num_experts,)
            or bias.dtype != torch.float32 or n_group * per_group != num_experts
            or per_group & (per_group - 1) or n_group & (n_group - 1) or not 0 < topk_group <= n_group
            or not 0 < top_k <= topk_group * per_group):
        raise ValueError("route needs float32 logits [T, E], a float32 bias [E], power-of-two groups and experts "
                         "per group, and top-k within the allowed groups")
    shared = shared_slot >= 0
    width = top_k + int(shared)
    weights = torch.empty(t, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, width, dtype=torch.int32, device=logits.device)
    if t:
        _router_kernel[(t,)](
            parts, bias.contiguous(), weights, ids, scale, t, num_experts, SPLITS=splits,
            GROUPS=n_group, PER_GROUP=per_group, TOPK_GROUP=topk_group, TOPK=top_k,
            SLOTS=triton.next_power_of_2(width), NORMALISE=normalise, SHARED=shared,
            SHARED_SLOT=max(shared_slot, 0), num_warps=SELECT_WARPS, **pdl.launch_options(parts.device)
        )
    return weights, ids
