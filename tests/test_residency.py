"""Hybrid HiSparse residency on the tiny model: lossless under pressure, exact accounting, byte-identical round trips."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.request import InvalidRequestError
from residency.config import HiSparseConfig
from residency.page_pool import PageUse
from tests.helpers import LogitsRecorder, assert_pages_released, greedy, make_engine, tokens_within

# Three requests that fit at admission (5 pages each) but not once they grow past 320 tokens.
PROMPT_LENS = (250, 240, 230)
NEW_TOKENS = 80
TIGHT_PAGES = 16


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(tiny_dir: Path, policy: str, pages: int | None = TIGHT_PAGES, host_gib: float = 0.05,
            **kw) -> LLMEngine:
    hs = HiSparseConfig(policy=policy, host_pool_gib=host_gib if policy in ("hybrid", "offload") else 0.0, **kw)
    return make_engine(tiny_dir, num_gpu_pages=pages, enable_prefix_cache=False, hisparse=hs)


def _checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def ample_run(tiny_dir: Path):
    prompts = [_prompt(n, 30 + n) for n in PROMPT_LENS]
    engine = make_engine(tiny_dir, enable_prefix_cache=False)
    recorder = LogitsRecorder(engine)
    outs = engine.generate(prompts, [greedy(NEW_TOKENS)] * len(prompts))
    return prompts, [o.token_ids for o in outs], [recorder.of(o.request_id) for o in outs]


def _assert_matches_ample(engine: LLMEngine, ample_run) -> None:  # noqa: ANN001
    """Runs the ample run's prompts on `engine`: same greedy tokens, logits within 1e-4."""
    prompts, tokens, logits = ample_run
    recorder = LogitsRecorder(engine)
    outs = engine.generate(prompts, [greedy(NEW_TOKENS)] * len(prompts))
    assert [o.token_ids for o in outs] == tokens
    for out, ref in zip(outs, logits):
        torch.testing.assert_close(recorder.of(out.request_id), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["hybrid", "offload", "preempt"])
def test_pressure_is_lossless(tiny_dir: Path, ample_run, policy: str) -> None:
    engine = _engine(tiny_dir, policy)
    _assert_matches_ample(engine, ample_run)
    stats = engine.stats()
    if policy == "hybrid":
        assert stats["pages_demoted"] > 0 and stats["pages_mirrored"] > 0
        assert stats["hot_misses"] > 0 and stats["rows_copied_h2d"] == stats["hot_misses"]
        assert stats["requests_by_state"]["mixed"]["peak"] >= 1
        assert stats["preemptions"] == 0
    elif policy == "offload":
        assert stats["swaps"] > 0 and stats["pages_swapped_in"] == stats["pages_swapped_out"]
    else:
        assert stats["preemptions"] > 0
    assert_pages_released(engine)
    if engine.residency is not None:
        assert engine.residency.host.num_in_use() == 0


def test_hybrid_needs_fewer_steps_than_recompute(tiny_dir: Path, ample_run) -> None:
    prompts, _, _ = ample_run
    steps = {}
    for policy in ("hybrid", "preempt"):
        engine = _engine(tiny_dir, policy)
        engine.generate(prompts, [greedy(NEW_TOKENS)] * len(prompts))
        steps[policy] = engine.num_steps
    assert steps["hybrid"] < steps["preempt"]


def test_host_pool_exhaustion_degrades_to_preemption(tiny_dir: Path, ample_run) -> None:
    prompts, tokens, _ = ample_run
    page_gib = make_engine(tiny_dir, num_gpu_pages=1).layout.page_bytes / 2**30
    engine = _engine(tiny_dir, "hybrid", host_gib=2 * page_gib)  # two host pages: almost nothing mirrors
    outs = engine.generate(prompts, [greedy(NEW_TOKENS)] * len(prompts))
    assert [o.token_ids for o in outs] == tokens
    stats = engine.stats()
    assert stats["mirror_skipped_host_full"] > 0 and stats["preemptions"] > 0
    assert_pages_released(engine)


@pytest.mark.parametrize("policy", ["hybrid", "offload", "off"])
def test_random_arrivals_and_aborts_keep_exact_accounting(tiny_dir: Path, policy: str) -> None:
    rng = random.Random(7)
    engine = _engine(tiny_dir, policy, pages=14, host_gib=0.02)
    live: list[str] = []
    for step in range(120):
        if rng.random() < 0.3 and len(live) < 6:
            rid = f"r{step}"
            engine.add_request(rid, _prompt(rng.randint(5, 200), step), greedy(rng.randint(1, 60)))
            live.append(rid)
        if live and rng.random() < 0.05:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.check_integrity()
        pool = engine.kv.pool
        assert pool.num_used() + pool.num_free == pool.num_pages
        if engine.residency is not None:
            host = engine.residency.host.cache.pool
            assert host.num_used() + host.num_free == host.num_pages
    for rid in list(live):
        engine.abort_request(rid)
    assert_pages_released(engine)
    if engine.residency is not None:
        assert engine.residency.host.num_in_use() == 0


def _run_until(engine: LLMEngine, predicate, limit: int = 400) -> None:  # noqa: ANN001
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition never reached")


def test_demote_promote_round_trip_is_byte_identical(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "hybrid", pages=40)
    engine.add_request("a", _prompt(300, 1), greedy(50))
    req = engine.scheduler.waiting[0]
    residency = engine.residency
    _run_until(engine, lambda: len(residency.demotable(req)) >= 3)
    pool = engine.runner.kv_pool
    before = {i: _checksum(pool[req.mla_pages[i]]) for i in residency.demotable(req)}
    assert residency.demote(req) > 0 and residency.state(req) == "mixed"
    for i, digest in before.items():
        assert _checksum(residency.host.data[req.host_pages[i]]) == digest
    engine.step()  # a decode step reading through the hot buffer
    assert residency.promote(req) and residency.state(req) == "full" and req.hot is None
    for i, digest in before.items():
        assert _checksum(pool[req.mla_pages[i]]) == digest
    engine.abort_request("a")
    assert_pages_released(engine)


def test_promoted_pages_register_for_prefix_reuse_again(tiny_dir: Path) -> None:
    """A page registers for reuse once (a decode step does not walk the whole context again), and one that
    was host-only registers when promotion brings it back: every completed page is then found in the GPU
    prefix cache under its hash, as the promoted page."""
    hs = HiSparseConfig(policy="hybrid", host_pool_gib=0.05)
    engine = make_engine(tiny_dir, num_gpu_pages=40, enable_prefix_cache=True, hisparse=hs)
    engine.add_request("a", _prompt(300, 4), greedy(50))
    req = engine.scheduler.waiting[0]
    residency, cache = engine.residency, engine.kv.cache
    _run_until(engine, lambda: len(residency.demotable(req)) >= 3)
    assert residency.demote(req) > 0
    cache.clear()  # the demoted pages' old GPU copies are dropped: only a promoted page can answer a lookup
    assert residency.promote(req)  # (the policy would too: pages are plentiful)
    engine.step()
    assert req.num_registered_pages == req.num_computed_tokens // 64
    for i in range(req.num_computed_tokens // 64):
        assert cache.lookup(PageUse.MLA, req.page_hashes[i]) == req.mla_pages[i], f"page {i} not registered"
    engine.abort_request("a")
    assert_pages_released(engine)


def test_swap_round_trip_is_byte_identical(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "offload", pages=40)
    engine.add_request("a", _prompt(200, 2), greedy(20))
    req = engine.scheduler.waiting[0]
    engine.step()
    pool = engine.runner.kv_pool
    complete = req.num_computed_tokens // 64  # the next step writes into the tail page
    before = [_checksum(pool[p]) for p in req.mla_pages[:complete]]
    assert engine.scheduler.swap_out(req)
    assert all(p is None for p in req.mla_pages) and not req.indexer_pages
    engine.step()  # swapped back in whole before it runs
    assert [_checksum(pool[p]) for p in req.mla_pages[:complete]] == before
    while engine.has_unfinished():
        engine.step()
    assert_pages_released(engine)


def test_abort_in_every_state_frees_everything(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "hybrid", pages=40)
    prompts = {"mixed": _prompt(300, 3), "waiting": _prompt(50, 4)}
    engine.add_request("mixed", prompts["mixed"], greedy(40))
    req = engine.scheduler.waiting[0]
    _run_until(engine, lambda: len(engine.residency.demotable(req)) >= 2)
    engine.residency.demote(req)
    engine.add_request("waiting", prompts["waiting"], greedy(5))
    assert engine.abort_request("mixed") and engine.abort_request("waiting")
    assert_pages_released(engine)
    assert engine.residency.host.num_in_use() == 0

    swap = _engine(tiny_dir, "offload", pages=40)
    swap.add_request("s", _prompt(150, 5), greedy(30))
    swap.step()
    assert swap.scheduler.swap_out(swap.scheduler.running[0])
    assert swap.abort_request("s")
    assert_pages_released(swap)
    assert swap.residency.host.num_in_use() == 0


def test_next_turn_finds_its_prefix_on_host(tiny_dir: Path) -> None:
    """Turn 2 of a conversation reuses turn 1's pages from host after the GPU copies are gone."""
    hs = HiSparseConfig(policy="hybrid", host_pool_gib=0.05)
    engine = make_engine(tiny_dir, num_gpu_pages=40, hisparse=hs)
    per_page = engine.kv.indexer_page_tokens
    turn1 = _prompt(per_page + 100, 9)
    [first] = engine.generate([turn1], [greedy(10)])
    engine.kv.cache.clear()  # the GPU prefix cache is gone; host copies remain
    turn2 = turn1 + first.token_ids + _prompt(40, 10)
    recorder = LogitsRecorder(engine)
    [second] = engine.generate([turn2], [greedy(12)])
    assert second.num_cached_tokens == per_page
    stats = engine.stats()
    assert stats["pages_promoted"] > 0 or stats["hot_misses"] > 0
    fresh = make_engine(tiny_dir)
    fresh_rec = LogitsRecorder(fresh)
    [ref] = fresh.generate([turn2], [greedy(12)])
    assert second.token_ids == ref.token_ids
    torch.testing.assert_close(recorder.of(second.request_id), fresh_rec.of(ref.request_id), rtol=1e-4, atol=1e-4)
    assert_pages_released(engine)


def test_hybrid_runs_a_request_longer_than_the_gpu_pool(tiny_dir: Path) -> None:
    """Only the indexer pages, the tail, the hot buffer and a chunk need the GPU; the rest lives on host."""
    prompt = _prompt(900, 12)
    [ref] = make_engine(tiny_dir, enable_prefix_cache=False).generate([prompt], [greedy(20)])
    pages_alone = make_engine(tiny_dir, num_gpu_pages=1).kv.pages_for_tokens(920)
    engine = make_engine(tiny_dir, num_gpu_pages=12, max_num_batched_tokens=128, enable_prefix_cache=False,
                         hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    assert pages_alone > 12
    [out] = engine.generate([prompt], [greedy(20)])
    assert out.token_ids == ref.token_ids
    stats = engine.stats()
    assert stats["pages_demoted"] > 0 and stats["preemptions"] == 0
    # Prefill chunks after demotion grow the hot buffer with the free pages instead of crawling at
    # hot_rows / top-K = 2 rows a step (about 140 steps here); 12 pages leave room for a few rows.
    assert engine.num_steps <= 60
    assert_pages_released(engine)
    off = make_engine(tiny_dir, num_gpu_pages=12, enable_prefix_cache=False)
    with pytest.raises(InvalidRequestError, match="KV pool"):
        off.add_request("long", prompt, greedy(20))


def test_a_hot_lease_grown_by_an_extend_gives_pages_back_to_its_own_next_chunk(tiny_dir: Path) -> None:
    """A request run from the host grows its hot lease with every spare page for its prefill chunks; its next
    chunk's page then had none: it gave way to itself, recomputed its prompt and met the same wall, forever. The
    lease gives back what the chunk lacks."""
    prompt = _prompt(1609, 0)
    [ref] = make_engine(tiny_dir, enable_prefix_cache=False).generate([prompt], [greedy(4)])
    engine = make_engine(tiny_dir, num_gpu_pages=24, max_num_batched_tokens=64, max_num_seqs=1,
                         enable_prefix_cache=False, hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    engine.add_request("long", prompt, greedy(4))
    tokens = tokens_within(engine, 80)
    assert engine.stats()["preemptions"] == 0 and engine.stats()["pages_demoted"] > 0
    assert tokens == ref.token_ids
    assert_pages_released(engine)


def test_hybrid_parks_instead_of_preempting_when_demotion_is_not_enough(tiny_dir: Path, ample_run) -> None:
    """A hot buffer too big to pay off leaves parking: mirrored pages stay on host, the tail and the
    indexer pages follow within the offload budget, and the request resumes without recomputing."""
    outcomes = {}
    for offload_gib in (0.01, 0.0):
        hs = HiSparseConfig(policy="hybrid", host_pool_gib=0.05, offload_pool_gib=offload_gib, hot_rows=512)
        engine = make_engine(tiny_dir, num_gpu_pages=TIGHT_PAGES, enable_prefix_cache=False, hisparse=hs)
        _assert_matches_ample(engine, ample_run)
        stats = engine.stats()
        outcomes[offload_gib] = (stats["swaps"], stats["preemptions"])
        assert_pages_released(engine)
        assert engine.residency.host.num_in_use() == 0 and engine.residency.swapping.parked_indexer_pages == 0
    assert outcomes[0.01][0] > 0 and outcomes[0.01][1] == 0  # parked, never recomputed
    assert outcomes[0.0][1] > 0  # no budget for indexer pages: preempted


def test_completed_pages_are_mirrored_once_at_the_step_that_completes_them(tiny_dir: Path) -> None:
    """Under `hybrid` each page gets its host copy (every layer, byte-identical) at the step that completes it,
    one copy a page, so it is demotable once that copy lands; the page still being written has none (copying
    rows as they come would cost host work every decode step)."""
    engine = _engine(tiny_dir, "hybrid", pages=40)
    engine.add_request("a", _prompt(100, 3), greedy(60))
    req = engine.scheduler.waiting[0]
    residency, layout = engine.residency, engine.layout
    pool, host = engine.runner.kv_pool, residency.host.data
    while engine.has_unfinished():
        engine.step()
        if req.is_finished:
            break
        residency.mirroring.poll(wait=True)
        computed = req.num_computed_tokens
        for i, gpu_page in enumerate(req.mla_pages):
            host_page = residency.mirroring.host_copy_of(req, i)
            if i >= computed // 64:
                assert host_page is None, f"page {i} is still being written but has a host copy"
                continue
            assert host_page is not None, f"page {i} has no host copy"
            for layer in range(layout.num_layers):
                on_gpu = layout.mla_layer_view(pool, layer)[gpu_page]
                assert torch.equal(layout.mla_layer_view(host, layer)[host_page], on_gpu)
        assert residency.stats.pages_mirrored == computed // 64 + computed // layout.indexer_tokens_per_page
        assert residency.demotable(req) == list(range(max(computed // 64 - 1, 0)))
    assert_pages_released(engine)
    assert residency.host.num_in_use() == 0


def _multi_turn(engine: LLMEngine, conversations: int, turns: int) -> dict[str, list[int]]:
    """Closed-loop agent conversations (a turn starts when the previous one ends), checking accounting
    after every step; returns each turn's greedy tokens."""
    history = {c: _prompt(700 + 37 * c, 100 + c) for c in range(conversations)}  # over one indexer page
    turn_of = dict.fromkeys(history, 0)
    tokens: dict[str, list[int]] = {}
    for c in history:
        engine.add_request(f"c{c}-t0", list(history[c]), greedy(8))
    while engine.has_unfinished():
        for out in engine.step():
            if not out.finished:
                continue
            c = int(out.request_id[1:].split("-")[0])
            tokens[out.request_id] = out.token_ids
            turn_of[c] += 1
            if turn_of[c] < turns:
                history[c] += out.token_ids + _prompt(30, 1000 * c + turn_of[c])
                engine.add_request(f"c{c}-t{turn_of[c]}", list(history[c]), greedy(8))
        engine.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def multi_turn_ample(tiny_dir: Path) -> dict[str, list[int]]:
    return _multi_turn(make_engine(tiny_dir, enable_prefix_cache=False), conversations=6, turns=3)


@pytest.mark.parametrize("policy", ["hybrid", "offload", "preempt"])
def test_multi_turn_agents_under_pressure_reuse_prefixes_losslessly(tiny_dir: Path, multi_turn_ample,
                                                                    policy: str) -> None:
    """Later turns find their history in the prefix caches (GPU, and host under `hybrid`) while other
    conversations hold most pages; reviving cached pages never overdraws the pool, and every turn's
    tokens equal an ample run with no prefix cache."""
    hs = HiSparseConfig(policy=policy, host_pool_gib=0.1 if policy != "preempt" else 0.0)
    engine = make_engine(tiny_dir, num_gpu_pages=24, hisparse=hs, enable_prefix_cache=True)
    assert _multi_turn(engine, conversations=6, turns=3) == multi_turn_ample
    stats = engine.stats()
    if policy == "hybrid":  # only the host tier keeps histories this pool cannot hold
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["pages_demoted"] > 0 and stats["hot_misses"] > 0
    assert_pages_released(engine)


@pytest.mark.parametrize("policy", ["hybrid", "offload"])
def test_hybrid_admits_a_waiting_request_by_demoting_decoding_ones(tiny_dir: Path, policy: str) -> None:
    """Two decoding requests fill the pool; a third arrives. `hybrid` demotes the decoding ones (their
    pages are mirrored) and runs all three at once; `offload` makes it wait. Tokens equal an ample run."""
    prompts = [_prompt(400, 60 + i) for i in range(3)]
    [ref] = [make_engine(tiny_dir, enable_prefix_cache=False).generate(prompts, [greedy(40)] * 3)]
    engine = _engine(tiny_dir, policy, pages=18)
    engine.add_request("r0", prompts[0], greedy(40))
    engine.add_request("r1", prompts[1], greedy(40))
    tokens: dict[str, list[int]] = {}
    while not all(r.num_computed_tokens > 400 for r in engine.scheduler.running) or len(engine.scheduler.running) < 2:
        engine.step()
    engine.add_request("r2", prompts[2], greedy(40))
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        peak = max(peak, len(engine.scheduler.running))
        engine.check_integrity()
    assert [tokens[f"r{i}"] for i in range(3)] == [o.token_ids for o in ref]
    assert peak == (3 if policy == "hybrid" else 2)
    assert (engine.stats()["pages_demoted"] > 0) == (policy == "hybrid")
    assert_pages_released(engine)


class _CountingPolicy:
    """Wraps an engine's pressure policy and counts how often the scheduler asks it."""

    def __init__(self, inner) -> None:
        self.inner, self.plans, self.kinds_taken = inner, 0, set()

    def plan(self, scheduler):
        self.plans += 1
        plan = self.inner.plan(scheduler)
        plan.make_room = self._seen(plan.make_room)
        return plan

    def _seen(self, actions):
        for action in actions:
            self.kinds_taken.add(action.kind.name.lower())
            yield action


@pytest.mark.parametrize("policy", ["hybrid", "offload", "preempt"])
def test_residency_is_decided_once_per_step(tiny_dir: Path, ample_run, policy: str) -> None:
    """Under pressure every policy is asked for exactly one plan per scheduled step, and the scheduler
    carries out its room-making actions (demotions and mirror waits for hybrid, swaps for offload,
    preemptions otherwise) with the same tokens as an ample pool."""
    engine = _engine(tiny_dir, policy)
    scheduler = engine.scheduler
    counting = _CountingPolicy(scheduler.policy)
    scheduler.policy = counting
    schedule, calls = scheduler.schedule, []
    scheduler.schedule = lambda: calls.append(1) or schedule()
    _assert_matches_ample(engine, ample_run)
    assert counting.plans == len(calls) >= engine.num_steps > 0
    expected = {"hybrid": {"demote"}, "offload": {"swap_out"}, "preempt": {"preempt"}}[policy]
    assert expected <= counting.kinds_taken, counting.kinds_taken
    assert_pages_released(engine)


def test_the_mechanism_never_names_a_policy() -> None:
    """Policy branches live in the policy objects: the scheduler and the residency mechanism read the plan
    and the policies' traits, never a policy's name."""
    root = Path(__file__).resolve().parent.parent
    mechanism = [root / "engine" / "scheduler.py", root / "engine" / "kv_cache_manager.py"]
    mechanism += [p for p in (root / "residency").glob("*.py") if p.name not in ("policies.py", "config.py")]
    for path in mechanism:
        code = path.read_text()
        for name in ("hybrid", "offload", "preempt"):
            for quoted in (f'"{name}"', f"'{name}'"):
                assert quoted not in code, f"{path.name} tests the policy name {quoted}"


def test_hybrid_demotes_only_pages_it_alone_holds(tiny_dir: Path) -> None:
    """Requests sharing a prefix through the prefix cache share its GPU pages. Demoting one of them counted the
    shared pages as freed, released them (freeing nothing), and leasing its hot buffer then found the pool
    empty: the step raised, which ends the engine loop of a replica. Only pages a request alone holds are
    demoted; every request runs to its end, and matches a run without pressure."""
    shared = _prompt(128, 40)
    prompts = [shared + _prompt(10, 41 + i) for i in range(3)]
    params = [greedy(200)] * 3
    engine = make_engine(tiny_dir, num_gpu_pages=11, max_model_len=448,
                         hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
        for req in engine.scheduler.running:
            assert all(engine.kv.cache.pool.refs(req.mla_pages[i]) == 1 for i in engine.residency.demotable(req))
    assert engine.stats()["pages_demoted"] > 0 and engine.stats()["prefix_cache_hit_tokens"] > 0
    assert_pages_released(engine)
    reference = make_engine(tiny_dir, max_model_len=448).generate(prompts, params)
    assert [finished[f"r{i}"].token_ids for i in range(3)] == [o.token_ids for o in reference]


def test_aborting_a_parked_request_returns_its_share_of_the_parking_budget(tiny_dir: Path) -> None:
    """`hybrid` parks a request's indexer pages within `offload_pool_gib`; a parked request that was aborted kept
    its share for good, and once the phantom shares filled the budget, parking was refused and requests were
    preempted (recomputed) instead."""
    page_bytes = make_engine(tiny_dir, num_gpu_pages=4).layout.page_bytes
    hs = HiSparseConfig(policy="hybrid", hot_rows=200, host_pool_gib=64 * page_bytes / 2**30,
                        offload_pool_gib=2 * page_bytes / 2**30 + 1e-9)
    engine = make_engine(tiny_dir, num_gpu_pages=16, hisparse=hs, async_scheduling=False)
    swapping = engine.residency.swapping
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(300, 60 + i), greedy(140))
    _run_until(engine, lambda: bool(engine.scheduler.swapped))
    assert swapping.parked_indexer_pages > 0
    assert engine.abort_request(engine.scheduler.swapped[0].request_id)
    assert swapping.parked_indexer_pages == 0
    while engine.has_unfinished():
        engine.step()
    assert_pages_released(engine)
    assert engine.residency.host.num_in_use() == 0 and swapping.parked_indexer_pages == 0
