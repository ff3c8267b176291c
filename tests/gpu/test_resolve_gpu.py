"""The fused resolve on the GPU. At GLM-5.3's shapes (top-K 2,048, 4,096 hot slots, contexts up to 70K, one
IndexShare group of the FP8 layout): three decode steps with overlapping selections and a replay inside a CUDA
graph equal the PyTorch twin byte for byte (slots, copy counts, LRU tables, the pool), and every selected
host-only row reads its host bytes (`bench/gpu_check_residency.check_resolve`), for each form of the victim
search (probes a round; a first round of histogram bins above the smallest key, or none). The interpreter tests'
small cases (a hot buffer no larger than the top-K, or smaller than the caller promised; stamps 2^40 apart; three
stamps; a stamp a slot) and hot buffers larger than one chunk of the plan's slots, over three steps each, equal the
twin on the GPU too."""

from __future__ import annotations

import random

import pytest
import torch

from bench import gpu_check_residency as checks
from bench.kernels_residency import glm53_layout
from kernels import resolve
from tests.resolve_cases import PAGE, SMALL_CASES, make_case, make_topk, run_resolve


@pytest.mark.parametrize("ways,bins", [(1, 0), (3, 0), (1, 32), (3, 32), (3, 64)])
def test_resolve_matches_twin_at_glm_shapes(ways: int, bins: int, monkeypatch) -> None:
    monkeypatch.setattr(resolve, "_SEARCH_WAYS", ways)
    monkeypatch.setattr(resolve, "_SEARCH_BINS", bins)
    monkeypatch.setattr(checks, "FAILED", [])
    checks.check_resolve(glm53_layout(), torch.device("cuda"), [1, 40, 2047, 2048, 2049, 5000, 30000, 70001], 2048,
                         4096, 70016)
    assert not checks.FAILED, checks.FAILED


@pytest.mark.parametrize("seed,ctx,k,num_hot,step,stamp_dtype,map_dtype", SMALL_CASES + [
    (7, [6000, 9000, 64], 2047, 4100, 1000, torch.int64, torch.int32),  # slots past one chunk (4,096)
    (8, [12000], 1000, 9000, 40, torch.int32, torch.int16),  # three chunks, few stamps
])
def test_plan_matches_twin_on_small_cases_and_large_buffers(seed, ctx, k, num_hot, step, stamp_dtype,
                                                            map_dtype) -> None:
    rng = random.Random(seed)
    max_ctx = -(-max(ctx) // PAGE) * PAGE
    case = make_case(rng, ctx, num_hot, max_ctx, step=step, stamp_dtype=stamp_dtype, map_dtype=map_dtype).to_gpu()
    got_state, want_state = case.state(), case.state()
    rows = None
    copied = 0
    for t in range(3):  # later steps hit what earlier ones loaded
        topk, counts, rows = make_topk(rng, ctx, k, previous=rows)
        topk, counts = topk.cuda(), counts.cuda()
        got = run_resolve(resolve.resolve_group, case, topk, counts, got_state, step + t, 1)
        want = run_resolve(resolve.resolve_group_reference, case, topk, counts, want_state, step + t, 1)
        assert torch.equal(got.kv_slots, want.kv_slots)
        assert torch.equal(got.num_copied, want.num_copied)
        for g, w in zip(got_state, want_state):
            assert torch.equal(g, w)
        copied += int(want.num_copied.sum())
    assert copied > 0
