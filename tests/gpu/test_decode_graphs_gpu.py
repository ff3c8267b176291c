"""Captured decode graphs on the GPU give the eager path's greedy tokens (bf16, FP8 KV), under residency
pressure too, and a replay never makes the host wait for the device.

Batch sizes are bucket sizes here (four requests, then two, then one), so eager
and graph steps run the same kernels at the same shapes and must agree token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.rank.decode_graphs import GraphKey
from kernels import resolve
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine

# Four prompts that fit 20 pages at admission but not once they grow: hybrid demotes and resolves.
PROMPT_LENS = (260, 250, 240, 230)
NEW_TOKENS = 64


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(11 + n)).tolist() for n in PROMPT_LENS]


def _engine(tiny_dir: Path, enforce_eager: bool, pressure: bool):  # noqa: ANN202
    hisparse = HiSparseConfig(policy="hybrid", host_pool_gib=0.05) if pressure else HiSparseConfig()
    return make_engine(tiny_dir, device="cuda", dtype="bfloat16", kv_dtype="fp8", enforce_eager=enforce_eager,
                       num_gpu_pages=20 if pressure else 256, enable_prefix_cache=False, hisparse=hisparse,
                       max_num_seqs=8)


def _checked_replays(engine) -> list[GraphKey]:  # noqa: ANN001
    """Runs every replay of an already captured shape under torch's sync debug mode "error"; returns their keys."""
    graphs = engine.executor.worker.graphs
    launch, replayed = graphs.launch, []

    def checked(key, step, *rest):  # noqa: ANN001, ANN002, ANN202
        if not graphs.is_captured(key):
            return launch(key, step, *rest)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(key, step, *rest)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        replayed.append(key)
        return out

    graphs.launch = checked
    return replayed


@pytest.mark.parametrize(("pressure", "wide"), [(False, False), (True, False), (True, True)],
                         ids=["resident", "hybrid-pressure", "hybrid-pressure-wide-leases"])
def test_graph_decode_matches_eager(tiny_dir: Path, pressure: bool, wide: bool, monkeypatch) -> None:
    """`wide`: the resolve's one-chunk plan made narrower than the tiny model's 64-slot leases, so the captured
    steps take the plan that searches leases in chunks (a lease past 4,096 slots at GLM-5.3's shapes)."""
    if wide:
        monkeypatch.setattr(resolve, "_R_BLOCK", 32)
    prompts = _prompts()
    params = [greedy(n) for n in (NEW_TOKENS, NEW_TOKENS * 3 // 4, NEW_TOKENS // 2, NEW_TOKENS // 2)]  # 4, 2, 1 running
    eager = _engine(tiny_dir, enforce_eager=True, pressure=pressure)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    engine = _engine(tiny_dir, enforce_eager=False, pressure=pressure)
    replayed = _checked_replays(engine)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    graphs = engine.executor.worker.graphs
    assert len(replayed) >= NEW_TOKENS - 8, graphs.steps_run
    if pressure:
        assert any(k.resolves for k in replayed), graphs.steps_run
        assert {k.wide_leases for k in replayed if k.resolves} == {wide}, graphs.steps_run
        stats = engine.stats()
        assert stats["hot_misses"] > 0 and stats["hot_misses"] == eager.stats()["hot_misses"]
    assert_pages_released(engine)
    engine.shutdown()
    eager.shutdown()
