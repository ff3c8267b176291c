"""Speculative decoding with the MTP layer: the output is the target's own, drafts good or bad.

The tiny checkpoint's MTP layer has random weights, so its drafts are nearly always rejected (every
rejection rolls back pages); replayed drafts (an earlier run's output, corrupted at chosen places) make
acceptance known, so accepted and rejected drafts mix and page boundaries are crossed both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.forward_batch import ForwardBatch
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine, run_checked, tokens_within

PROMPT_LENS = (250, 240, 230)
NEW_TOKENS = 60


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(n, 30 + n) for n in PROMPT_LENS]
GREEDY = [greedy(NEW_TOKENS)] * len(PROMPTS)


def _engine(tiny_dir: Path, k: int, policy: str = "off", pages: int | None = None) -> LLMEngine:
    host = 0.05 if policy in ("hybrid", "offload") else 0.0
    return make_engine(tiny_dir, num_speculative_tokens=k, num_gpu_pages=pages, enable_prefix_cache=False,
                       hisparse=HiSparseConfig(policy=policy, host_pool_gib=host))


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    """Greedy tokens without drafts, the pool ample."""
    return run_checked(_engine(tiny_dir, 0), PROMPTS, GREEDY)


def _corrupted(tokens: list[int], every: int) -> list[int]:
    """`tokens` with every `every`-th one replaced: drafts from it are accepted up to the next replacement."""
    return [(t + 1) % 380 if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafts_keep_the_greedy_tokens(tiny_dir: Path, reference: list[list[int]], k: int) -> None:
    engine = _engine(tiny_dir, k)
    assert run_checked(engine, PROMPTS, GREEDY) == reference
    # Most steps are launched before the one they continue is read (asynchronous scheduling): the ranks take
    # their inputs from that step's results and move their rows back by its rejected drafts.
    assert engine.num_continued_steps > engine.num_steps // 2
    stats = engine.stats()
    assert stats["spec_decode_num_continued_steps"] == engine.num_continued_steps  # a dashboard counter
    drafts, draft_tokens = stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"]
    assert 0 < drafts <= draft_tokens <= k * drafts


@pytest.mark.parametrize(("policy", "pages", "k"), [("off", None, 3), ("hybrid", 16, 3), ("hybrid", 16, 1),
                                                   ("offload", 16, 3), ("preempt", 12, 3)])
def test_replayed_drafts_accept_and_roll_back_exactly(tiny_dir: Path, reference: list[list[int]], policy: str,
                                                      pages: int | None, k: int) -> None:
    """Drafts right up to every fifth token: steps accept some drafts and reject the rest, under pressure
    too (k = 2 under pressure: the two-rank test); the tokens are the reference's and every rolled-back page
    is released. Under `hybrid`, steps of requests with host-only pages continue the step before them too
    (their hot leases serve k + 1 rows a step as they are)."""
    engine = _engine(tiny_dir, k, policy, pages)
    continued_with_host_pages = []
    launch = engine.executor.launch_model

    def watching(step):  # noqa: ANN001, ANN202
        continued_with_host_pages.append(step.continues and bool(step.nonresident_tokens))
        return launch(step)

    engine.executor.launch_model = watching
    replay = [_corrupted(t, 5) for t in reference]
    assert run_checked(engine, PROMPTS, GREEDY, replay) == reference
    stats = engine.stats()
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted
    assert stats["spec_decode_mean_acceptance_length"] > 1 + k / 2  # about 4 of every 5 drafts are right
    if policy == "off":  # continued steps with accepted and rejected drafts (see the test above)
        assert engine.num_continued_steps > engine.num_steps // 2
    elif policy == "hybrid":
        assert stats["pages_demoted"] > 0 and stats["hot_misses"] > 0
        assert sum(continued_with_host_pages) > len(continued_with_host_pages) // 4
    elif policy == "offload":
        assert stats["swaps"] > 0
    elif policy == "preempt":
        assert stats["preemptions"] > 0


def test_steps_read_before_the_next_is_launched_give_the_same_tokens(tiny_dir: Path,
                                                                    reference: list[list[int]]) -> None:
    """Asynchronous scheduling off: every verifying step is read before the next is built (no step continues
    one not yet read), with the same tokens as the continued steps of the tests above."""
    engine = make_engine(tiny_dir, num_speculative_tokens=3, enable_prefix_cache=False, async_scheduling=False)
    assert run_checked(engine, PROMPTS, GREEDY, [_corrupted(t, 5) for t in reference]) == reference
    assert engine.num_continued_steps == 0


def test_continued_steps_cross_a_page_table_width(tiny_dir: Path) -> None:
    """A continued step whose furthest rows need a wider page table than the step before it (the graphs'
    first width, 2,048 tokens, crossed while every draft is accepted) gives the reference tokens."""
    prompt, params = [_prompt(2036, 7)], [greedy(24)]
    want = run_checked(_engine(tiny_dir, 0), prompt, params)
    engine = _engine(tiny_dir, 3)
    assert run_checked(engine, prompt, params, want) == want
    assert engine.num_continued_steps > 0


def _run_acting_once(engine: LLMEngine, continued: int, action: Callable[[], None]) -> dict[str, list[int]]:
    """Steps `engine` to the end, checking the accounting after every step, and runs `action` once after the
    step that brings its continued steps to `continued`; returns each finished request's tokens."""
    tokens: dict[str, list[int]] = {}
    acted = False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        engine.check_integrity()
        if not acted and engine.num_continued_steps >= continued:
            action()
            acted = True
    assert acted
    assert_pages_released(engine)
    return tokens


def test_abort_while_a_continued_step_runs(tiny_dir: Path, reference: list[list[int]]) -> None:
    """A request aborted while a continued verifying step for it is in flight: its rows there are discarded, the
    other requests keep the reference tokens (their steps continue again after one read first) and every page
    comes back."""
    engine = _engine(tiny_dir, 3)
    for i, (prompt, params) in enumerate(zip(PROMPTS, GREEDY)):
        engine.add_request(f"r{i}", prompt, params)

    def abort() -> None:
        assert engine.abort_request("r1")

    tokens = _run_acting_once(engine, 3, abort)
    assert set(tokens) == {"r0", "r2"} and [tokens["r0"], tokens["r2"]] == [reference[0], reference[2]]
    assert engine.num_continued_steps > 6  # 3 before the abort, and more after it


def test_pages_completed_by_continued_steps_serve_after_demotion(tiny_dir: Path, reference: list[list[int]]) -> None:
    """Under `hybrid` the pages continued steps complete are mirrored to host when the step is read, with
    their kept rows only: two requests decode through continued steps, a third one's admission demotes their
    pages, and their later steps read those rows back through the hot buffers with the reference tokens."""
    engine = _engine(tiny_dir, 3, "hybrid", 16)
    for i in range(2):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY[i])

    def admit() -> None:
        assert engine.stats()["pages_demoted"] == 0
        engine.add_request("r2", PROMPTS[2], GREEDY[2])

    tokens = _run_acting_once(engine, 6, admit)
    assert [tokens[f"r{i}"] for i in range(3)] == reference
    stats = engine.stats()
    assert stats["pages_demoted"] > 0 and stats["hot_misses"] > 0


def test_steps_continue_while_a_request_waits_for_a_sequence_slot(tiny_dir: Path,
                                                                  reference: list[list[int]]) -> None:
    """With every sequence slot taken a waiting request cannot be admitted, so the running ones keep continuing
    their steps; the waiting one is admitted when a slot frees (that step read first). Reference tokens."""
    engine = make_engine(tiny_dir, num_speculative_tokens=3, enable_prefix_cache=False, max_num_seqs=2)
    assert run_checked(engine, PROMPTS, GREEDY) == reference
    assert engine.num_continued_steps > engine.num_steps // 2


def test_every_draft_of_the_run_itself_is_accepted(tiny_dir: Path, reference: list[list[int]]) -> None:
    engine = _engine(tiny_dir, 3)
    assert run_checked(engine, PROMPTS, GREEDY, reference) == reference
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    # A request's first token comes from its prefill; the others arrive up to four a step.
    assert engine.num_steps < NEW_TOKENS


def test_sampling_with_drafts_is_reproducible_and_the_targets(tiny_dir: Path) -> None:
    """A seeded sampled run gives the same tokens twice and the same as without drafts: each output position
    is drawn from the target's distribution with the request's seed, whatever was drafted."""
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    without = run_checked(_engine(tiny_dir, 0), PROMPTS, params)
    first, second = (run_checked(_engine(tiny_dir, 2), PROMPTS, params) for _ in range(2))
    assert first == second == without


def test_draft_iterations_replay_the_resolve(tiny_dir: Path, reference: list[list[int]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Under hybrid pressure a step resolves the selections of its full layers once each (hits, victims, miss
    copies of requests with host-only pages) and its draft iterations reuse them: a draft iteration that
    selected or resolved again would add calls."""
    calls: list[int] = []
    resolve = ForwardBatch.resolve_selection

    def counting(self: ForwardBatch, group: int, positions: torch.Tensor, lens: torch.Tensor,
                 index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
        calls.append(len(self.nonresident) + (self.decode_leases is not None))
        return resolve(self, group, positions, lens, index_dtype)

    monkeypatch.setattr(ForwardBatch, "resolve_selection", counting)
    engine = _engine(tiny_dir, 3, "hybrid", 16)
    full_layers = engine.layout.num_full_layers
    per_step: list[int] = []
    launch = engine.executor.launch_model

    def watching(step):  # noqa: ANN001, ANN202
        before = len(calls)
        result = launch(step)
        per_step.append(len(calls) - before)
        return result

    engine.executor.launch_model = watching
    assert run_checked(engine, PROMPTS, GREEDY, [_corrupted(t, 5) for t in reference]) == reference
    assert per_step and all(n == full_layers for n in per_step)
    assert any(calls), "no step had requests with host-only pages"


def test_split_ranks_draft_and_verify_like_one(tiny_dir: Path, reference: list[list[int]]) -> None:
    """Two ranks (gloo) under hybrid pressure: every rank verifies, drafts and rolls back alike (the ranks'
    leases and LRU tables are checked after every step) and the tokens are one rank's; every host page is
    released at the end (`run_checked`), those of pages completed by a continued step's first row too."""
    engine = make_engine(tiny_dir, num_speculative_tokens=2, num_gpu_pages=16, enable_prefix_cache=False,
                         tensor_parallel_size=2, hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    try:
        assert run_checked(engine, PROMPTS, GREEDY, [_corrupted(t, 4) for t in reference]) == reference
        stats = engine.stats()
        assert stats["pages_demoted"] > 0 and 0 < stats["spec_decode_num_accepted_tokens"]
        assert engine.num_continued_steps > 0  # mirrored rows and host copies of continued steps balance too
    finally:
        engine.shutdown()


def test_prefilled_kv_with_the_mtp_rows_moves_between_drafting_replicas(tiny_dir: Path) -> None:
    """A drafting prefill replica's export carries the MTP layer's rows (one more member of the last group):
    a drafting decode replica lands it and decodes the tokens it would compute itself; a replica that does not
    draft has other pages and refuses the export, naming the difference."""
    from disagg.kv_export import ExportMismatch, export_snapshot
    from disagg.landing import land_prefix
    from engine.prefix_transfer import snapshot_prefix

    prefill = make_engine(tiny_dir, num_speculative_tokens=2, num_gpu_pages=64)
    unit = prefill.layout.indexer_tokens_per_page  # the unit of reuse (its pages are larger than without MTP)
    ids = _prompt(2 * unit + 50, seed=40)
    prefill.generate([ids], [SamplingParams(max_tokens=1, ignore_eos=True)])
    export = export_snapshot(snapshot_prefix(prefill.kv, prefill.executor, ids), "glm-tiny", prefill.layout, ids, 0)
    decode = make_engine(tiny_dir, num_speculative_tokens=2, num_gpu_pages=64)
    export.verify("glm-tiny", decode.layout, ids)
    assert land_prefix(decode, ids, export).imported_tokens == 2 * unit
    [out] = decode.generate([ids], [greedy(12)])
    assert out.num_cached_tokens == 2 * unit
    [local] = make_engine(tiny_dir, num_speculative_tokens=2, num_gpu_pages=64).generate([ids], [greedy(12)])
    assert out.token_ids == local.token_ids
    plain = make_engine(tiny_dir, num_gpu_pages=64)
    with pytest.raises(ExportMismatch, match="page_bytes"):
        export.verify("glm-tiny", plain.layout, ids)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_buffered_steps_match_eager_ones(tiny_dir: Path, reference: list[list[int]], sampled: bool) -> None:
    """Verify-and-draft steps of decoding requests run through the rank's persistent buffers (three requests
    padded to four, drafts near `max_tokens` padded to k rows): the tokens and acceptance of eager steps."""
    params = ([SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=5 + i, ignore_eos=True)
               for i in range(len(PROMPTS))] if sampled else GREEDY)
    replay = [_corrupted(t, 5) for t in reference]
    runs = []
    for enforce_eager in (True, False):
        engine = make_engine(tiny_dir, num_speculative_tokens=3, enforce_eager=enforce_eager,
                             enable_prefix_cache=False)
        runs.append((run_checked(engine, PROMPTS, params, replay), engine.stats()["spec_decode_num_accepted_tokens"]))
        graphs = engine.executor.worker.spec_graphs
        if not enforce_eager:
            assert [key.requests for key in graphs.steps_run] == [4] and sum(graphs.steps_run.values()) > 10
    assert runs[0] == runs[1]
    if not sampled:
        assert runs[0][0] == reference


_STOP_PROMPTS = (30, 37, 44, 90, 58, 33)  # prompt lengths of the requests of `_stop_run`, in its order


def _stop_run(tiny_dir: Path, k: int, eos: int, stop: str, stop_id: int,  # noqa: ANN202
              replay: dict[str, list[int]] | None):
    """EOS, a stop string, max_tokens, max_model_len, an abort and a stop token id, each in one request (each
    its own prompt); returns each finished request's (tokens, text, finish reason)."""
    engine = make_engine(tiny_dir, num_speculative_tokens=k, max_model_len=120)
    engine.eos_token_ids.add(eos)
    params = {
        "eos": SamplingParams(max_tokens=40),
        "stop": greedy(40, stop=(stop,)),
        "length": greedy(7),
        "context": greedy(100),  # its 90-token prompt reaches max_model_len first
        "aborted": greedy(40),
        "stop_id": greedy(40, stop_token_ids=(stop_id,)),
    }
    lengths = dict(zip(params, _STOP_PROMPTS))
    for i, (rid, p) in enumerate(params.items()):
        engine.add_request(rid, _prompt(lengths[rid], i), p)
        if replay is not None:
            engine.replay_drafts(rid, replay[rid])
    final, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
        steps += 1
        if steps == 4:
            assert engine.abort_request("aborted")
    assert_pages_released(engine)
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in final.items()}


def test_stops_inside_accepted_drafts_end_like_decoding(tiny_dir: Path) -> None:
    """A stop (EOS, a stop string, max_tokens, the context limit) that falls among a step's accepted drafts
    ends the request there, with the text and finish reason of decoding one token a step."""
    free, text_run, id_run = make_engine(tiny_dir).generate(
        [_prompt(30, 0), _prompt(37, 1), _prompt(_STOP_PROMPTS[-1], 5)], [greedy(40)] * 3)
    eos, stop, stop_id = free.token_ids[9], text_run.text[4:7], id_run.token_ids[8]
    want = _stop_run(tiny_dir, 0, eos, stop, stop_id, None)
    assert [want[r][2] for r in ("eos", "stop", "length", "context", "stop_id")] == [
        "stop", "stop", "length", "length", "stop"]
    # Drafts from an unbounded run of the same prompts: every one right, so stops land inside accepted runs.
    unbounded = make_engine(tiny_dir, max_model_len=120)
    outs = unbounded.generate([_prompt(n, i) for i, n in enumerate(_STOP_PROMPTS)], [greedy(29)] * 6)
    replay = dict(zip(("eos", "stop", "length", "context", "aborted", "stop_id"), (o.token_ids for o in outs)))
    assert _stop_run(tiny_dir, 3, eos, stop, stop_id, replay) == want


def test_buffered_steps_resolve_host_only_pages_as_one_union(tiny_dir: Path, reference: list[list[int]]) -> None:
    """Under hybrid pressure the verifying steps of requests with host-only pages run through the buffers too,
    each request's k + 1 rows resolved as the union of their selections inside the step: the tokens are the
    reference's, and rows came back from the host."""
    engine = _engine(tiny_dir, 3, "hybrid", 16)
    assert run_checked(engine, PROMPTS, GREEDY, [_corrupted(t, 5) for t in reference]) == reference
    runs = engine.executor.worker.spec_graphs.steps_run
    assert sum(n for key, n in runs.items() if key.resolves) > 5
    assert engine.stats()["hot_misses"] > 0


def test_padding_rows_of_cut_drafts_stay_inside_the_hot_lease(tiny_dir: Path) -> None:
    """A hot lease that serves fewer than k + 1 rows a step cuts its request's drafts, and the buffered step
    pads that request with rows repeating its last one, token and position: they select the last row's top-K,
    so the union the request resolves stays within its lease. Padding rows of another token selected other
    positions, the union outgrew the lease and real rows read slots that held other tokens (four requests
    in 19 pages: changed tokens; `hot_unresolved`, which `run_checked` asserts to be 0, counts such rows)."""
    prompts = [_prompt(n, 11 + n) for n in (260, 250, 240, 230)]
    params = [greedy(48)] * len(prompts)
    want = run_checked(_engine(tiny_dir, 0, "hybrid", 19), prompts, params)
    engine = _engine(tiny_dir, 3, "hybrid", 19)
    cut = []
    launch = engine.executor.launch_model

    def watching(step):  # noqa: ANN001, ANN202
        cut.append(bool(step.nonresident_tokens) and step.draft is not None and bool((step.draft.num_drafts < 3).any()))
        return launch(step)

    engine.executor.launch_model = watching
    assert run_checked(engine, prompts, params, [t[:5] + [(t[5] + 1) % 380] + t[6:] for t in want]) == want
    runs = engine.executor.worker.spec_graphs.steps_run
    assert any(cut) and sum(n for key, n in runs.items() if key.resolves) > 5


def test_reverse_maps_cover_the_draft_rows_of_a_step(tiny_dir: Path) -> None:
    """A verifying step's rows run past the tokens the host holds (its drafts, and a continued step's drafts taken
    as accepted), and their selections may name those positions: every demoted request's reverse map must cover
    them. Sized to the host's tokens, a step crossing its end stopped the engine loop (an out-of-range position;
    on the GPU the resolve would read past the map). Four requests drafting 3 tokens in a 24-page pool, `hybrid`."""
    from engine.model_runner import ModelRunner

    engine = make_engine(tiny_dir, num_speculative_tokens=3, num_gpu_pages=24, enable_prefix_cache=False,
                         hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05, hot_rows=64))
    prepare, past_host = ModelRunner.prepare, []

    def watched(self, scheduled, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        step = prepare(self, scheduled, *args, **kwargs)
        past_host.extend(step.context_lens[b] > scheduled[b].request.num_tokens for b in step.nonresident_tokens)
        return step

    ModelRunner.prepare = watched
    try:
        params = [SamplingParams(max_tokens=420, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
        outs = engine.generate([[5 + i] * 12 for i in range(4)], params)
    finally:
        ModelRunner.prepare = prepare
    assert [len(o.token_ids) for o in outs] == [420] * 4
    assert any(past_host) and engine.stats()["hot_misses"] > 0
    assert_pages_released(engine)


def test_a_request_run_from_the_host_crosses_into_new_pages_after_an_extend(tiny_dir: Path) -> None:
    """A prompt longer than the GPU pool runs from the host; its prefill chunks grow its hot lease with the spare
    pages. With drafting's page layout, its MLA and indexer pages end at the same token, so the chunk past it needs
    two new pages while a demotion frees one: the lease gives pages back. It held them, the request gave way to
    itself and recomputed its prompt from the start, forever."""
    prompt = _prompt(650, 0)
    [reference] = run_checked(_engine(tiny_dir, 0), [prompt], [greedy(8)])
    engine = _engine(tiny_dir, 1, "hybrid", pages=10)
    engine.add_request("r", prompt, greedy(8))
    tokens = tokens_within(engine, 60)
    assert engine.stats()["preemptions"] == 0 and tokens == reference
    assert_pages_released(engine)
