"""Speculative decoding on the GPU (bf16, FP8 KV): the Triton kernels write and read the MTP
layer's rows as one more member of the last IndexShare group, under residency pressure too.

Replayed drafts (the output of decoding without drafts) must nearly all be accepted: a verifying step
samples each row as a one-token step would, so the target agrees with the run it replays; the tokens
are compared whole. The MTP layer's own (random) drafts exercise rejection and page roll-back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine

PROMPT_LENS = (260, 250, 240, 230)
NEW_TOKENS = 48


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(11 + n)).tolist() for n in PROMPT_LENS]


def _engine(tiny_dir: Path, k: int, pressure: bool):  # noqa: ANN202
    hisparse = HiSparseConfig(policy="hybrid", host_pool_gib=0.05) if pressure else HiSparseConfig()
    return make_engine(tiny_dir, device="cuda", dtype="bfloat16", kv_dtype="fp8",
                       enforce_eager=True, num_speculative_tokens=k, num_gpu_pages=20 if pressure else 256,
                       enable_prefix_cache=False, hisparse=hisparse, max_num_seqs=8)


def _generate(engine, replay: list[list[int]] | None = None) -> list[list[int]]:  # noqa: ANN001
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(NEW_TOKENS))
        if replay is not None:
            engine.replay_drafts(f"r{i}", replay[i])
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        engine.check_integrity()
    assert_pages_released(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("pressure", [False, True], ids=["resident", "hybrid-pressure"])
def test_replayed_drafts_are_accepted_and_keep_the_tokens(tiny_dir: Path, pressure: bool) -> None:
    want = _generate(_engine(tiny_dir, 0, pressure))
    engine = _engine(tiny_dir, 3, pressure)
    assert _generate(engine, want) == want
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"] > 0
    if pressure:
        assert stats["pages_demoted"] > 0 and stats["hot_misses"] > 0


def test_mtp_drafts_roll_back_under_pressure(tiny_dir: Path) -> None:
    want = _generate(_engine(tiny_dir, 0, True))
    engine = _engine(tiny_dir, 2, True)
    got = _generate(engine)
    assert got == want
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
