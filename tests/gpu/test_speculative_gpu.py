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
from tests.helpers import greedy, make_engine, run_checked

PROMPT_LENS = (260, 250, 240, 230)
NEW_TOKENS = 48


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(11 + n)).tolist() for n in PROMPT_LENS]


def _params() -> list:
    return [greedy(NEW_TOKENS)] * len(PROMPT_LENS)


def _engine(tiny_dir: Path, k: int, pressure: bool, enforce_eager: bool = True,  # noqa: ANN202
            dtype: str = "bfloat16", pages: int = 20):
    hisparse = HiSparseConfig(policy="hybrid", host_pool_gib=0.05) if pressure else HiSparseConfig()
    return make_engine(tiny_dir, device="cuda", dtype=dtype, kv_dtype="fp8",
                       enforce_eager=enforce_eager, num_speculative_tokens=k, num_gpu_pages=pages if pressure else 256,
                       enable_prefix_cache=False, hisparse=hisparse, max_num_seqs=8)


@pytest.mark.parametrize("pressure", [False, True], ids=["resident", "hybrid-pressure"])
def test_replayed_drafts_are_accepted_and_keep_the_tokens(tiny_dir: Path, pressure: bool) -> None:
    want = run_checked(_engine(tiny_dir, 0, pressure), _prompts(), _params())
    engine = _engine(tiny_dir, 3, pressure)
    assert run_checked(engine, _prompts(), _params(), want) == want
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"] > 0
    if pressure:
        assert stats["pages_demoted"] > 0 and stats["hot_misses"] > 0


def test_mtp_drafts_roll_back_under_pressure(tiny_dir: Path) -> None:
    want = run_checked(_engine(tiny_dir, 0, True), _prompts(), _params())
    engine = _engine(tiny_dir, 2, True)
    got = run_checked(engine, _prompts(), _params())
    assert got == want
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize(("pressure", "pages"), [(False, 0), (True, 19), (True, 21)],
                         ids=["resident", "hybrid-cut-drafts", "hybrid-continued"])
def test_captured_speculative_steps_match_eager_ones(tiny_dir: Path, pressure: bool, pages: int) -> None:
    """Verify-and-draft steps of decoding requests replay as CUDA graphs, those with host-only pages too
    (their union resolve inside the graph, also when the step continues one not yet read): the eager
    speculative steps' tokens and acceptance, and a replay never makes the host wait. In 19 pages some hot
    leases serve fewer than k + 1 rows, so drafts are cut and the graph pads those requests (the CPU's
    `test_padding_rows_of_cut_drafts_stay_inside_the_hot_lease`); in 21 they serve k + 1 and steps with
    host-only pages continue the step before them.

    Under pressure the weights are float32: a graph step pads every request to k + 1 rows while an eager step
    runs the drafts that fit the hot buffer, and bf16 GEMMs round differently with the row count, which flips
    a random tiny model's greedy tokens (seen on the H200 at token 19 of one request); float32 leaves only
    the mechanism to compare."""
    dtype = "float32" if pressure else "bfloat16"
    want = run_checked(_engine(tiny_dir, 0, pressure, dtype=dtype, pages=pages), _prompts(), _params())
    replay = [t[:5] + [(t[5] + 1) % 380] + t[6:] for t in want]  # one wrong draft a request
    eager = _engine(tiny_dir, 3, pressure, dtype=dtype, pages=pages)
    eager_tokens = run_checked(eager, _prompts(), _params(), replay)
    engine = _engine(tiny_dir, 3, pressure, enforce_eager=False, dtype=dtype, pages=pages)
    graphs = engine.executor.worker.spec_graphs
    launch, replayed = graphs.launch, []

    def checked(key, step, residency):  # noqa: ANN001, ANN202
        if not graphs.is_captured(key):
            return launch(key, step, residency)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(key, step, residency)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        replayed.append((key, step.continues))
        return out

    graphs.launch = checked
    assert eager_tokens == want
    assert run_checked(engine, _prompts(), _params(), replay) == want
    assert len(replayed) > 5
    if pressure:  # requests with host-only pages resolve in the graph; in 21 pages in continued steps too
        assert any(key.resolves for key, _ in replayed)
        assert pages < 21 or any(key.resolves and continues for key, continues in replayed)
    else:  # resident: most steps were launched before the one they continue was read, corrected on the device
        assert engine.num_continued_steps > engine.num_steps // 2
    stats, eager_stats = engine.stats(), eager.stats()
    assert stats["spec_decode_num_accepted_tokens"] == eager_stats["spec_decode_num_accepted_tokens"]


def test_an_fp8_model_drafts_through_its_fp8_head(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An FP8 checkpoint drafts through FP8 copies of lm_head and eh_proj (the Triton FP8 GEMV at one row):
    the copy's most probable tokens are the bf16 head's but where logits nearly tie, and captured steps
    draft, verify and roll back as the eager ones do: the same tokens while both run the same rows. FP8 GEMMs
    pick their kernel by row count (a GEMV at one row, tensor cores at k + 1), which rounds differently and
    flips a random tiny model's greedy tokens, so decoding without drafts is not the reference here, and
    near `max_tokens` (an eager step runs only the drafts a request can still use, a captured one pads them)
    the runs may part (seen on the H200 two tokens before the end)."""
    from engine.tiny import make_tiny

    fp8_dir = make_tiny(tmp_path_factory.mktemp("tiny-fp8"), seed=0, fp8=True)
    eager = _engine(fp8_dir, 3, False)
    want = run_checked(eager, _prompts(), _params())
    engine = _engine(fp8_dir, 3, False, enforce_eager=False)
    model = engine.executor.worker.model
    assert model.draft_lm_head is not None
    assert model.mtp_layers[0].eh_proj.weight.dtype == torch.float8_e4m3fn
    normed = torch.randn(64, model.cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    agree = (model.draft_tokens(normed.bfloat16()) == model.logits(normed.bfloat16()).argmax(dim=-1)).float()
    assert float(agree.mean()) >= 0.9
    same_rows = NEW_TOKENS - 4  # before any request's drafts are cut by its max_tokens (k = 3)
    got = run_checked(engine, _prompts(), _params())
    assert [t[:same_rows] for t in got] == [t[:same_rows] for t in want]
    assert engine.executor.worker.spec_graphs.steps_run and engine.stats()["spec_decode_num_draft_tokens"] > 0
