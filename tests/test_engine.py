"""Engine behaviour on the tiny model: chunking, batching, prefix reuse, pressure, stops, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.request import InvalidRequestError, SamplingParams
from engine.sampler import SamplingBatch, sample
from engine.tiny_tokenizer import CONTROL_TOKENS
from tests.helpers import LogitsRecorder, assert_pages_released, greedy, make_engine


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_equals_one_shot(tiny_dir: Path) -> None:
    prompt = _prompt(150, 1)
    whole = make_engine(tiny_dir, max_num_batched_tokens=512)
    chunked = make_engine(tiny_dir, max_num_batched_tokens=40)
    rec_whole, rec_chunked = LogitsRecorder(whole), LogitsRecorder(chunked)
    [a] = whole.generate([prompt], [greedy(12)])
    [b] = chunked.generate([prompt], [greedy(12)])
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(rec_chunked.of(b.request_id), rec_whole.of(a.request_id), rtol=1e-5, atol=1e-5)
    assert chunked.num_steps > whole.num_steps
    assert_pages_released(whole)
    assert_pages_released(chunked)


def test_batched_equals_solo(tiny_dir: Path) -> None:
    prompts = [_prompt(n, s) for s, n in enumerate([90, 33, 140, 64])]
    solo = []
    for p in prompts:
        engine = make_engine(tiny_dir)
        solo.append(engine.generate([p], [greedy(10)])[0].token_ids)
    engine = make_engine(tiny_dir, max_num_batched_tokens=100)
    batched = engine.generate(prompts, [greedy(10)] * len(prompts))
    assert [o.token_ids for o in batched] == solo
    assert_pages_released(engine)


def test_prefix_cache_reuse_gives_same_tokens(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    per_page = engine.kv.indexer_page_tokens
    shared = _prompt(per_page + 100, 7)
    first = shared + _prompt(20, 8)
    second = shared + _prompt(30, 9)
    [a] = engine.generate([first], [greedy(8)])
    assert a.num_cached_tokens == 0
    recorder = LogitsRecorder(engine)
    [b] = engine.generate([second], [greedy(8)])
    # every whole MLA page of the shared prefix: the partly used indexer page is copied, not recomputed
    reused = len(shared) // 64 * 64
    assert reused > per_page and b.num_cached_tokens == reused
    assert engine.stats()["prefix_cache_hit_tokens"] == reused
    fresh = make_engine(tiny_dir, enable_prefix_cache=False)
    fresh_recorder = LogitsRecorder(fresh)
    [c] = fresh.generate([second], [greedy(8)])
    assert b.token_ids == c.token_ids
    torch.testing.assert_close(recorder.of(b.request_id), fresh_recorder.of(c.request_id), rtol=1e-5, atol=1e-5)
    assert_pages_released(engine)
    assert engine.kv.cache.num_cached > 0


def test_next_turn_reuses_its_whole_conversation(tiny_dir: Path) -> None:
    """Turn 2 = turn 1's prompt + reply + new text: everything but the tail page is reused."""
    engine = make_engine(tiny_dir)
    turn1 = _prompt(300, 21)
    [first] = engine.generate([turn1], [greedy(12)])
    turn2 = turn1 + first.token_ids + _prompt(25, 22)
    [second] = engine.generate([turn2], [greedy(6)])
    assert second.num_cached_tokens == (len(turn1) + len(first.token_ids) - 1) // 64 * 64
    [ref] = make_engine(tiny_dir, enable_prefix_cache=False).generate([turn2], [greedy(6)])
    assert second.token_ids == ref.token_ids
    assert_pages_released(engine)


def test_preemption_under_pressure_is_lossless(tiny_dir: Path) -> None:
    # All three fit at admission (3 pages each) but not once they grow past 128 tokens.
    prompts = [_prompt(n, 20 + n) for n in (120, 110, 100)]
    ample = make_engine(tiny_dir, enable_prefix_cache=False)
    expected = [o.token_ids for o in ample.generate(prompts, [greedy(40)] * 3)]
    tight = make_engine(tiny_dir, num_gpu_pages=10, enable_prefix_cache=False)
    got = tight.generate(prompts, [greedy(40)] * 3)
    assert [o.token_ids for o in got] == expected
    assert tight.stats()["preemptions"] > 0
    assert_pages_released(tight)


def test_accounting_holds_after_every_step(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, num_gpu_pages=14, max_num_batched_tokens=64, max_num_seqs=3)
    for i, n in enumerate([120, 40, 250, 10, 75]):
        engine.add_request(f"r{i}", _prompt(n, i), greedy(15 + i))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps == 6:
            assert engine.abort_request("r2")
    assert_pages_released(engine)


def test_stop_conditions(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    prompt = _prompt(40, 3)
    [free_run] = engine.generate([prompt], [greedy(30)])
    text = free_run.text
    assert len(text) > 6
    stop = text[3:6]
    [stopped] = engine.generate([prompt], [greedy(30, stop=(stop,))])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    eos = free_run.token_ids[5]
    engine.eos_token_ids.add(eos)
    [eos_run] = engine.generate([prompt], [SamplingParams(max_tokens=30)])
    assert eos_run.finish_reason == "stop" and eos_run.token_ids[-1] == eos
    assert len(eos_run.token_ids) == free_run.token_ids.index(eos) + 1
    [short] = engine.generate([prompt], [greedy(4)])
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    # a request's stop token ids end it like EOS (the token kept in token_ids, not in the text), ignore_eos or not
    engine.eos_token_ids.discard(eos)
    stop_id = free_run.token_ids[7]
    [id_run] = engine.generate([prompt], [greedy(30, stop_token_ids=(stop_id,))])
    first = free_run.token_ids.index(stop_id)
    assert id_run.finish_reason == "stop" and id_run.token_ids == free_run.token_ids[: first + 1]
    assert free_run.text.startswith(id_run.text) and len(id_run.text) < len(free_run.text)


def test_special_tokens_stay_out_of_the_text_unless_asked_for(tiny_dir: Path) -> None:
    """Role headers and the prompt prefix the model emits are not text a client shows (vLLM's default); a request
    with `skip_special_tokens=False` gets them, and the token ids are the same either way."""
    engine = make_engine(tiny_dir)
    tok = engine.tokenizer
    control = {tok.token_to_id(t) for t in CONTROL_TOKENS}
    params = dict(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    skipped, kept = engine.generate([_prompt(20, 5)] * 2, [SamplingParams(**params),
                                                            SamplingParams(**params, skip_special_tokens=False)])
    assert skipped.token_ids == kept.token_ids and control & set(kept.token_ids)  # the model emitted some
    assert kept.text == tok.decode(kept.token_ids)
    assert skipped.text == tok.decode(skipped.token_ids, skip_special_tokens=True)
    assert any(t in kept.text for t in CONTROL_TOKENS) and not any(t in skipped.text for t in CONTROL_TOKENS)


def test_the_earliest_stop_string_ends_the_text_whatever_the_order(tiny_dir: Path) -> None:
    """Two stop strings completed by the same token: the text ends before the one that starts first, whichever
    the list names first."""
    engine = make_engine(tiny_dir)
    prompt = _prompt(40, 3)
    params = dict(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    [free_run] = engine.generate([prompt], [SamplingParams(**params)])
    text = free_run.text
    ends = [len(engine.tokenizer.decode(free_run.token_ids[:n])) for n in range(len(free_run.token_ids) + 1)]
    # a token adding at least two characters: `early` straddles its first one, `late` is what it adds
    early = late = ""
    for a, b in zip(ends, ends[1:]):
        if a > 0 and b - a >= 2 and text.find(text[a - 1 : a + 1]) == a - 1 and text.find(text[a:b]) == a:
            early, late = text[a - 1 : a + 1], text[a:b]
            break
    assert early, "no token of the free run adds two characters"
    for stop in ((late, early), (early, late)):
        [stopped] = engine.generate([prompt], [SamplingParams(**params, stop=stop)])
        assert stopped.finish_reason == "stop"
        assert stopped.text == text[: text.index(early)]


def test_max_model_len_stops_generation(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_model_len=50)
    [out] = engine.generate([_prompt(45, 2)], [greedy(100)])
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_max_model_len_beyond_the_largest_hot_buffer_is_refused(tiny_dir: Path) -> None:
    """A hot lease grows to a request's host-only tokens, and the resolve serves buffers below 2**21 slots: a
    context that could outgrow it is refused when the engine is built, not in a step."""
    with pytest.raises(ValueError, match="max_model_len 2097152 must be below 2097152"):
        make_engine(tiny_dir, max_model_len=1 << 21)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir: Path) -> None:
    prompt = _prompt(30, 4)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(tiny_dir)
    [a] = engine.generate([prompt], [params])
    others = [_prompt(50, 5), _prompt(20, 6)]
    b = engine.generate([others[0], prompt, others[1]], [greedy(12), params, params])[1]
    assert a.token_ids == b.token_ids
    [c] = engine.generate([prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)])
    assert c.token_ids != a.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message", "code"),
    [
        ([], greedy(4), "empty", None),
        ([1, 2, 100000], greedy(4), "token ids", None),
        ([1, -3], greedy(4), "token ids", None),
        ([1, True, 2], greedy(4), "token ids", None),
        ([1, 2.0], greedy(4), "token ids", None),
        (["1", 2], greedy(4), "token ids", None),
        (list(range(10)) * 60, greedy(4), "maximum context length", "context_length_exceeded"),
    ],
)
def test_invalid_requests_are_refused_clearly(tiny_dir: Path, prompt: list[int], params, message: str,
                                              code: str | None) -> None:
    engine = make_engine(tiny_dir, max_model_len=512)
    with pytest.raises(InvalidRequestError, match=message) as refused:
        engine.add_request("bad", prompt, params)
    assert (refused.value.param, refused.value.code) == ("prompt", code)
    [ok] = engine.generate([[1, 2, 3]], [greedy(3)])  # the engine keeps serving
    assert len(ok.token_ids) == 3
    assert_pages_released(engine)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2**63), "top_k"),  # past int64: the sampler's tensor would fail inside a step
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(2**63,)), "stop_token_ids"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == message  # the field at fault, for the error's `param`


def test_request_larger_than_pool_is_refused(tiny_dir: Path) -> None:
    """The refusal names what the client can change, with OpenAI's code for a request too long (agents trim their
    history on it): the prompt when it alone does not fit, else max_tokens."""
    engine = make_engine(tiny_dir, num_gpu_pages=4)
    page = engine.kv.page_size
    with pytest.raises(InvalidRequestError, match="KV pool") as refused:
        engine.add_request("big", _prompt(300, 1), greedy(10))
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="lower max_tokens") as refused:
        engine.add_request("long", _prompt(2 * page, 1), greedy(3 * page))
    assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
    [ok] = engine.generate([_prompt(2 * page, 1)], [greedy(4)])  # the same prompt with fewer tokens runs
    assert len(ok.token_ids) == 4


def test_prefix_moves_between_engines(tiny_dir: Path) -> None:
    """A prefix computed by one engine, installed in another, is reused there unchanged."""
    from engine.prefix_transfer import install_prefix, snapshot_prefix

    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    per_page = prefill.kv.indexer_page_tokens
    prompt = _prompt(per_page + 90, 11)
    prefill.generate([prompt], [greedy(1)])
    snap = snapshot_prefix(prefill.kv, prefill.runner.executor, prompt)
    assert snap.num_tokens == per_page
    assert install_prefix(decode.kv, decode.runner.executor, prompt, snap) == per_page
    decode.check_integrity()
    [moved] = decode.generate([prompt], [greedy(10)])
    assert moved.num_cached_tokens == per_page
    [local] = make_engine(tiny_dir).generate([prompt], [greedy(10)])
    assert moved.token_ids == local.token_ids
    with pytest.raises(ValueError, match="hashes"):
        install_prefix(decode.kv, decode.runner.executor, list(reversed(prompt)), snap)
    assert_pages_released(decode)


# Values validation accepts at their edges that leave one candidate token: each must give the argmax.
_NEAR_GREEDY = {
    "temperature 1e-39": SamplingParams(temperature=1e-39),
    "temperature 1e-30": SamplingParams(temperature=1e-30),
    "top_p 1e-300": SamplingParams(temperature=1.0, top_p=1e-300),
    "top_p 7e-46": SamplingParams(temperature=1.0, top_p=7e-46),
    "top_k 1, temperature 2": SamplingParams(temperature=2.0, top_k=1),
    "top_k 1, top_p 1e-300, temperature 100": SamplingParams(temperature=100.0, top_k=1, top_p=1e-300),
}


def _spread_logits(dtype: torch.dtype) -> torch.Tensor:
    """A row with a clear winner, a wide range and masked entries, as a model head can produce."""
    logits = torch.randn(400, generator=torch.Generator().manual_seed(0)) * 30
    logits[17] = 200.0
    logits[:5] = float("-inf")
    return logits.to(dtype)


def _draw(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    return sample(logits, SamplingBatch.build(params, seeds, positions, logits.shape[-1])).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_sampling_values_pick_the_argmax(dtype: torch.dtype) -> None:
    logits = _spread_logits(dtype)
    cases = {**_NEAR_GREEDY, "temperature 1e-5": SamplingParams(temperature=1e-5)}  # samples, from a one-hot row
    for name, params in cases.items():
        picks = {token for seed in range(20) for token in _draw(logits[None], [params], [seed], [0])}
        assert picks == {17}, name


def test_sampling_draws_from_the_filtered_distribution() -> None:
    """Over many seeds each token's frequency matches softmax(logits / T) restricted by top-k and top-p."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    cases = [(SamplingParams(temperature=0.7), [0, 1, 2, 3, 4]),
             (SamplingParams(temperature=1.3, top_k=2), [0, 1]),
             (SamplingParams(temperature=1.0, top_p=0.8), [0, 1, 2])]  # 0.56 + 0.21 < 0.8: token 2 crosses, kept
    n = 6000
    for params, support in cases:
        draws = _draw(logits.expand(n, -1), [params] * n, list(range(n)), [3] * n)
        freq = torch.bincount(torch.tensor(draws), minlength=5).float() / n
        masked = torch.full_like(logits, float("-inf"))
        masked[support] = logits[support] / params.temperature
        assert torch.allclose(freq, masked.softmax(-1), atol=0.025), (params, freq)


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9), greedy(1)]
    together = _draw(logits, params, [11, 12, 13], [5, 6, 7])
    alone = [_draw(logits[i : i + 1], [params[i]], [11 + i], [5 + i])[0] for i in range(3)]
    assert together == alone
    assert _draw(logits[:1], params[:1], [11], [6]) != [] and together[2] == int(logits[2].argmax())


def test_extreme_sampling_values_generate_like_greedy(tiny_dir: Path) -> None:
    """A batch of every edge value runs to the end, and each request decodes exactly as greedy does."""
    engine = make_engine(tiny_dir)
    prompt = _prompt(40, 12)
    [reference] = engine.generate([prompt], [greedy(10)])
    params = [dataclasses.replace(p, max_tokens=10, ignore_eos=True) for p in _NEAR_GREEDY.values()]
    outputs = engine.generate([prompt] * len(params), params)
    assert [o.token_ids for o in outputs] == [reference.token_ids] * len(params)
    assert_pages_released(engine)


def test_seeded_request_repeats_beside_edge_values(tiny_dir: Path) -> None:
    """A seeded request draws the same tokens alone and batched with near-zero temperature and top_p."""
    prompt = _prompt(30, 13)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=77, ignore_eos=True)
    engine = make_engine(tiny_dir)
    [alone] = engine.generate([prompt], [seeded])
    edges = [SamplingParams(max_tokens=12, temperature=1e-39),
             SamplingParams(max_tokens=12, temperature=1.0, top_p=7e-46)]
    batched = engine.generate([_prompt(20, 14), prompt, _prompt(50, 15)], [edges[0], seeded, edges[1]])
    assert batched[1].token_ids == alone.token_ids
    [greedy_run] = engine.generate([prompt], [greedy(12)])
    assert alone.token_ids != greedy_run.token_ids  # it samples
    assert_pages_released(engine)


@pytest.mark.parametrize("drafts", [0, 2], ids=["decode", "speculative"])
def test_a_failing_request_ends_alone_and_frees_its_pages(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          drafts: int) -> None:
    """Its output processing raising mid-generation ends it with an error output; the batch (sampled rows too)
    goes on, with MTP drafts too."""
    engine = make_engine(tiny_dir, max_num_batched_tokens=64, num_speculative_tokens=drafts)
    prompts = [_prompt(n, 30 + n) for n in (90, 40, 70)]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    victim = SamplingParams(max_tokens=12, temperature=1.0, seed=6, ignore_eos=True)
    [expected] = make_engine(tiny_dir).generate([prompts[2]], [sampled])
    append = LLMEngine._append

    def flaky(self: LLMEngine, req, token: int, *rest):  # noqa: ANN001, ANN002, ANN202
        if req.params is victim and len(req.output_token_ids) == 3:
            raise RuntimeError("row broke")
        return append(self, req, token, *rest)

    monkeypatch.setattr(LLMEngine, "_append", flaky)
    engine.add_request("ok", prompts[0], greedy(12))
    engine.add_request("victim", prompts[1], victim)
    engine.add_request("sampled", prompts[2], sampled)
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            engine.check_integrity()
            if o.finished:
                final[o.request_id] = o
    failed = final["victim"]
    assert failed.finish_reason == "error" and failed.error == "RuntimeError: row broke"
    assert len(failed.token_ids) == 3 and failed.new_token_ids == []
    assert final["ok"].error is None and len(final["ok"].token_ids) == 12
    assert final["sampled"].token_ids == expected.token_ids
    assert_pages_released(engine)
    [after] = engine.generate([prompts[1]], [greedy(5)])
    assert len(after.token_ids) == 5 and after.error is None
