"""The fused resolve on the GPU at GLM-5.3's shapes (top-K 2,048, 4,096 hot slots, contexts up to 70K, one
IndexShare group of the FP8 layout): three decode steps with overlapping selections and a replay inside a CUDA
graph equal the PyTorch twin byte for byte (slots, copy counts, LRU tables, the pool), and every selected
host-only row reads its host bytes (`bench/gpu_check_residency.check_resolve`), for each form of the victim
search (probes a round; first round near the smallest key)."""

from __future__ import annotations

import pytest
import torch

from bench import gpu_check_residency as checks
from bench.kernels_residency import glm53_layout
from kernels import resolve


@pytest.mark.parametrize("ways,gallop", [(1, False), (1, True), (2, True), (3, True)])
def test_resolve_matches_twin_at_glm_shapes(ways: int, gallop: bool, monkeypatch) -> None:
    monkeypatch.setattr(resolve, "_SEARCH_WAYS", ways)
    monkeypatch.setattr(resolve, "_SEARCH_GALLOP", gallop)
    monkeypatch.setattr(checks, "FAILED", [])
    checks.check_resolve(glm53_layout(), torch.device("cuda"), [1, 40, 2047, 2048, 2049, 5000, 30000, 70001], 2048,
                         4096, 70016)
    assert not checks.FAILED, checks.FAILED
