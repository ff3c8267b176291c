"""Asynchronous scheduling (the host prepares step N+1 while the device runs step N, reading N's tokens after
launching N+1) gives exactly the outputs of stepping synchronously: tokens, text, finish reasons, with
requests stopping on EOS, on a stop string and on length mid-batch, and with an abort between steps."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.request import SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine, record_device_inputs


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(tiny_dir: Path, async_scheduling: bool, eos: int, stop: str):  # noqa: ANN202
    engine = make_engine(tiny_dir, async_scheduling=async_scheduling)
    engine.eos_token_ids.add(eos)
    launched_with_device_inputs = record_device_inputs(engine)
    params = {
        "eos": SamplingParams(max_tokens=40),  # stops on the EOS id
        "stop": greedy(40, stop=(stop,)),
        "length": greedy(7),
        "sampled": SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        "aborted": greedy(40),
    }
    for i, (rid, p) in enumerate(params.items()):
        engine.add_request(rid, _prompt(30 + 7 * i, i), p)
    final, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 12:
            assert engine.abort_request("aborted")
    assert_pages_released(engine)
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in final.items()}, launched_with_device_inputs


def test_async_scheduling_gives_the_outputs_of_stepping_in_turn(tiny_dir: Path) -> None:
    [free] = make_engine(tiny_dir).generate([_prompt(30, 0)], [greedy(40)])
    [text_run] = make_engine(tiny_dir).generate([_prompt(37, 1)], [greedy(40)])
    eos, stop = free.token_ids[9], text_run.text[4:7]
    sync, sync_launches = _run(tiny_dir, False, eos, stop)
    got, launches = _run(tiny_dir, True, eos, stop)
    assert got == sync
    assert sync["eos"][2] == "stop" and sync["stop"][2] == "stop" and sync["length"][2] == "length"
    assert len(sync["length"][0]) == 7 and "aborted" not in sync
    assert not any(sync_launches) and sum(launches) >= 20  # decode inputs came from the device


def test_async_scheduling_moves_the_same_pages_under_pressure(tiny_dir: Path) -> None:
    """Hybrid under pressure: the same tokens, and the same mirrors, demotions and misses (a page whose last
    token was still pending when it completed is published once its hash is known, not copied again)."""
    prompts = [_prompt(n, 30 + n) for n in (250, 240, 230)]
    runs = []
    for async_scheduling in (False, True):
        engine = make_engine(tiny_dir, num_gpu_pages=16, enable_prefix_cache=False, async_scheduling=async_scheduling,
                             hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
        outs = engine.generate(prompts, [greedy(80)] * len(prompts))
        stats = engine.stats()
        runs.append(([o.token_ids for o in outs],
                     {k: stats[k] for k in ("pages_mirrored", "pages_demoted", "pages_promoted",
                                            "hot_misses", "bytes_h2d")}))
        assert_pages_released(engine)
        assert engine.residency.host.num_in_use() == 0
    assert runs[0] == runs[1] and runs[0][1]["pages_demoted"] > 0
