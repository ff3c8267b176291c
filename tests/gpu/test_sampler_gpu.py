"""The batched sampler on the GPU draws what it draws on the CPU, at GLM-5.3's vocabulary.

The uniforms come from integer hashing, identical on both devices; the float work after them (scaling,
sorting for top-k / top-p, logarithms) may round differently in the last bit, which can only change a
draw at an exact near-tie, so nearly every row must agree.
"""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import SamplingBatch, sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 154880


def _batch(n: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.95),
             SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.0)]
    return logits, [kinds[i % len(kinds)] for i in range(n)]


def test_seeded_draws_agree_between_cpu_and_gpu() -> None:
    logits, params = _batch(256)
    seeds, positions = list(range(1000, 1256)), [i % 7 for i in range(256)]
    batch = SamplingBatch.build(params, seeds, positions, VOCAB)
    cpu = sample(logits, batch).tolist()
    gpu = sample(logits.cuda(), batch.to(torch.device("cuda"))).tolist()
    agree = sum(a == b for a, b in zip(cpu, gpu))
    assert agree >= 254, agree
