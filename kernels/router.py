"""The MoE router's selection in one launch: sigmoid scores, correction bias, group-limited top-k,
normalised and scaled weights, and the shared expert appended as one more slot.

`engine.layers.Router` does this in about twenty PyTorch operations (two to three top-k, a scatter, masks,
gathers, sums), each a launch of a few microseconds at decode batch sizes. Here one program per token
holds its E scores in registers: groups rank by the sum of their two best biased scores (the first
`topk_group` groups win, ties to the lower group), then the `top_k` best biased scores inside them (ties to
the lower expert) are the experts; their weights are the unbiased sigmoid scores, divided by their sum
(plus 1e-20) when `normalise`, times `scale`. With `shared_slot` >= 0 a last column routes every token to
that expert with weight 1 (the shared expert stacked with the routed ones). Scores are float32 as in the
reference; the weights' sum may round differently from torch's, so weights agree to float32 rounding,
the chosen experts exactly (in order of decreasing score; the reference's order is unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, scale, num_experts,
                   GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                   SLOTS: tl.constexpr, NORMALISE: tl.constexpr, SHARED: tl.constexpr, SHARED_SLOT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)[:, None]
    e = g * PER_GROUP + tl.arange(0, PER_GROUP)[None, :]  # [GROUPS, PER_GROUP] expert ids
    logits = tl.load(logits_ptr + t * num_experts + e)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + e)
    neg = float("-inf")
    # groups: the sum of each group's two best biased scores
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
    # experts: TOPK best biased scores among the allowed groups
    slot = tl.arange(0, SLOTS)
    out_ids = tl.zeros([SLOTS], dtype=tl.int32)
    out_w = tl.zeros([SLOTS], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        top = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == top, e, num_experts), 1), 0)
        w = tl.sum(tl.sum(tl.where(e == pick, scores, 0.0), 1), 0)
        out_ids = tl.where(slot == k, pick, out_ids)
        out_w = tl.where(slot == k, w, out_w)
        choice = tl.where(e == pick, neg, choice)
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


def route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, normalise: bool,
          scale: float, shared_slot: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, E] and correction bias [E] -> (weights [T, k'] float32, expert ids [T, k']
    int64), k' = top_k, plus one when `shared_slot` >= 0 (that expert, weight 1, last)."""
    t, num_experts = logits.shape
    per_group = num_experts // max(n_group, 1)
    if (logits.dtype != torch.float32 or not logits.is_contiguous() or bias.shape != (num_experts,)
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
            logits, bias.contiguous(), weights, ids, scale, num_experts,
            GROUPS=n_group, PER_GROUP=per_group, TOPK_GROUP=topk_group, TOPK=top_k,
            SLOTS=triton.next_power_of_2(width), NORMALISE=normalise, SHARED=shared,
            SHARED_SLOT=max(shared_slot, 0), num_warps=4,
        )
    return weights, ids.long()
