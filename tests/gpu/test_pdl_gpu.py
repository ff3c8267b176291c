"""Programmatic dependent launch (kernels/pdl.py) changes when kernels start, never what they compute: on a
Hopper GPU small decode batches take it, and decode with it (captured graphs, under residency pressure too)
gives the greedy tokens of the same engine with every kernel launched plainly.

A kernel that read its input before `gdc_wait` would race with the kernel writing it; the tokens of 64
steps through every decode kernel (norms, GEMVs, router, fused MoE, indexer, top-K, resolve, sparse MLA)
would then differ from the plain launches' in some step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import pdl
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA GPU of compute capability 9.0 or later")

PROMPT_LENS = (260, 250, 240, 230)


def _tokens(tiny_dir: Path, pressure: bool, with_pdl: bool) -> list[list[int]]:
    previous = pdl.configure(with_pdl)
    try:
        hisparse = HiSparseConfig(policy="hybrid", host_pool_gib=0.05) if pressure else HiSparseConfig()
        engine = make_engine(tiny_dir, device="cuda", dtype="bfloat16", kv_dtype="fp8", num_gpu_pages=20 if pressure
                             else 256, enable_prefix_cache=False, hisparse=hisparse, max_num_seqs=8)
        prompts = [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(5 + n)).tolist()
                   for n in PROMPT_LENS]
        out = [o.token_ids for o in engine.generate(prompts, [greedy(n) for n in (64, 48, 32, 32)])]
        assert_pages_released(engine)
        engine.shutdown()
        return out
    finally:
        pdl.configure(previous)


def test_pdl_only_inside_launches_on_hopper() -> None:
    cuda = torch.device("cuda")
    assert pdl.launch_options(cuda) == {"PDL": False}
    with pdl.launches(True):
        assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
        with pdl.launches(False):
            assert not pdl.enabled(cuda)
    assert not pdl.enabled(cuda)


@pytest.mark.parametrize("pressure", [False, True], ids=["resident", "hybrid-pressure"])
def test_pdl_decode_matches_plain_launches(tiny_dir: Path, pressure: bool) -> None:
    plain = _tokens(tiny_dir, pressure, with_pdl=False)
    assert _tokens(tiny_dir, pressure, with_pdl=True) == plain
