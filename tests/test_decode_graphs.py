"""Decode steps through the rank's persistent buffers (engine/rank/decode_graphs.py) give the tokens the eager
path gives: greedy and sampled requests, under residency pressure (host-only pages resolved inside the step).

On a CPU the buffers, the padding and the scratch page run without capture; tests/gpu/ replays captured
graphs against the eager path on the H200."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.rank.decode_graphs import GraphKey, StepBuffers, batch_sizes, context_widths
from engine.request import SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import LogitsRecorder, assert_pages_released, greedy, make_engine

PROMPT_LENS = (250, 240, 230)  # fit at admission in 16 pages, not once they grow: hybrid demotes
NEW_TOKENS = 60


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(7 + n)).tolist() for n in PROMPT_LENS]


def _run(tiny_dir: Path, enforce_eager: bool):  # noqa: ANN202
    engine = make_engine(tiny_dir, num_gpu_pages=16, enable_prefix_cache=False, enforce_eager=enforce_eager,
                         hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    recorder = LogitsRecorder(engine)
    params = [greedy(NEW_TOKENS), SamplingParams(max_tokens=NEW_TOKENS // 2, temperature=0.8, top_p=0.9, seed=5,
                                                   ignore_eos=True), greedy(NEW_TOKENS)]
    outs = engine.generate(_prompts(), params)
    return engine, outs, [recorder.of(o.request_id) for o in outs]


def test_buffered_decode_matches_eager_under_pressure(tiny_dir: Path) -> None:
    eager, eager_outs, eager_logits = _run(tiny_dir, enforce_eager=True)
    buffered, outs, logits = _run(tiny_dir, enforce_eager=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
    for got, want in zip(logits, eager_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert eager.executor.worker.graphs is None
    runs = buffered.executor.worker.graphs.steps_run
    # Decode steps of every kind went through the buffers: with and without host-only pages, greedy and
    # filtered sampling, padded (3 requests run as 4) and not.
    assert any(k.resolves for k in runs) and any(not k.resolves for k in runs), runs
    assert not any(k.wide_leases for k in runs), runs  # configured leases: the one-chunk resolve plan
    assert {k.sampler for k in runs} == {"greedy", "filtered"} and {k.rows for k in runs} >= {2, 4}, runs
    assert sum(runs.values()) >= NEW_TOKENS - 1
    stats = buffered.stats()
    assert stats["hot_misses"] > 0 and stats["hot_misses"] == eager.stats()["hot_misses"]
    assert_pages_released(buffered)


def test_prefill_steps_and_enforce_eager_run_eagerly(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=4)
    graphs = engine.executor.worker.graphs
    assert graphs.batch_sizes == (1, 2, 4)
    out = engine.generate([[5, 6, 7, 8]], [greedy(3)])[0]
    # one prefill step (eager), two decode steps at batch size 1
    assert sum(graphs.steps_run.values()) == 2 and list(graphs.steps_run) == [GraphKey(1, 2048, False, "greedy")]
    assert out.token_ids == make_engine(tiny_dir, enforce_eager=True).generate([[5, 6, 7, 8]], [greedy(3)])[0].token_ids


def test_shapes() -> None:
    assert batch_sizes(16) == (1, 2, 4, 8, 16) and batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert context_widths(32, 2048, 64) == (2048,)
    assert context_widths(2048, 5000, 64) == (2048, 3072, 4096, 5056)
    widths = context_widths(4096, 1 << 20, 64)
    assert widths[:4] == (4096, 6144, 8192, 12288) and widths[-1] == 1 << 20 and len(widths) == 17


def test_step_buffers_keep_a_shapes_fields_in_place() -> None:
    """A step stages its fields packed in one arena (one copy a step on a GPU); a shape staging the same fields
    at the same sizes finds them where its first step put them, so the views a graph captured read each new
    step's values."""
    buffers = StepBuffers({"ids": (32, torch.long), "table": (16, torch.int32), "temp": (32, torch.float32),
                           "greedy": (32, torch.bool)}, torch.device("cpu"))

    def stage(ids: np.ndarray, table: np.ndarray | None, rows: int) -> None:
        buffers.begin()
        buffers.put("ids", (rows,), 0, ids)
        buffers.put("table", (2, 4), -1, table)
        buffers.put("temp", (rows,), 1.0, np.full(rows - 1, 0.5))
        buffers.put("greedy", (rows,), True)
        buffers.end()

    stage(np.arange(3), np.ones((1, 2), dtype=np.int32), 4)
    ids, table, temp = buffers.view("ids", 4), buffers.view("table", 2, 4), buffers.view("temp", 4)
    assert ids.tolist() == [0, 1, 2, 0] and ids.dtype == torch.long
    assert table.tolist() == [[1, 1, -1, -1], [-1] * 4] and table.dtype == torch.int32
    assert temp.tolist() == [0.5, 0.5, 0.5, 1.0] and buffers.view("greedy", 4).tolist() == [True] * 4
    assert all(v.data_ptr() % StepBuffers.ALIGN == buffers.arena.data_ptr() % StepBuffers.ALIGN
               for v in (ids, table, temp))
    stage(np.arange(10, 14), None, 4)  # the same shape: the same views read the new step
    assert ids.tolist() == [10, 11, 12, 13] and table.tolist() == [[-1] * 4] * 2
    stage(np.arange(20), None, 20)  # another shape: its wider ids push the fields after them further
    assert buffers.view("table", 2, 4).data_ptr() > table.data_ptr()
    buffers.begin()
    with pytest.raises(ValueError, match="at most 32"):
        buffers.put("ids", (33,), 0)
    buffers.put("ids", (2,), 0)
    with pytest.raises(ValueError, match="staged once"):
        buffers.put("ids", (2,), 0)
    with pytest.raises(KeyError, match="table"):
        buffers.view("table", 2, 4)
    with pytest.raises(ValueError, match="2 elements"):
        buffers.view("ids", 4)
    with pytest.raises(ValueError, match="cannot stage"):
        StepBuffers({"half": (4, torch.float16)}, torch.device("cpu"))
