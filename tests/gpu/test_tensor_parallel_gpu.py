"""Tensor parallelism on two GPUs (NCCL, one process per rank): decode steps replayed as captured graphs,
their all-reduces inside, with asynchronous scheduling, give the eager split's greedy tokens (bf16, FP8 KV,
under residency pressure: demoted requests resolve host-only rows inside the graphs), and in float32 the
tokens of one rank. Needs two GPUs (`nvidia-h200-x2`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from residency.config import HiSparseConfig
from tests.helpers import greedy, make_engine

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

PROMPT_LENS = (260, 250, 240, 230)  # fit 20 pages a rank at admission, not once they grow
NEW_TOKENS = (48, 36, 24, 24)  # 4, then 2, then 1 running: three batch sizes replayed


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(11 + n)).tolist() for n in PROMPT_LENS]


def _tokens(tiny_dir: Path, **config) -> list[list[int]]:  # noqa: ANN003
    engine = make_engine(tiny_dir, device="cuda", enable_prefix_cache=False, max_num_seqs=8, **config)
    try:
        outs = engine.generate(_prompts(), [greedy(n) for n in NEW_TOKENS])
        engine.check_integrity()
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


@pytest.fixture(autouse=True)
def _no_nvlink_multicast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the ranks inherit it


def test_split_graphs_match_split_eager_under_pressure(tiny_dir: Path) -> None:
    pressure = dict(tensor_parallel_size=2, dtype="bfloat16", kv_dtype="fp8", num_gpu_pages=20,
                    hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    eager = _tokens(tiny_dir, enforce_eager=True, async_scheduling=False, **pressure)
    graphs = _tokens(tiny_dir, **pressure)  # graphs and asynchronous scheduling: the defaults
    assert graphs == eager


def test_split_graphs_match_one_rank_in_float32(tiny_dir: Path) -> None:
    one = _tokens(tiny_dir, dtype="float32", num_gpu_pages=256)
    split = _tokens(tiny_dir, dtype="float32", num_gpu_pages=256, tensor_parallel_size=2)
    assert split == one
