"""Seeded random workloads on the engine: whatever arrives, is aborted or refused, a step never raises.

Each case is an engine configuration that puts the mechanisms under each other's feet (residency
pressure with requests sharing prefixes through the prefix cache, speculative decoding, asynchronous
scheduling, chunks of a few tokens) and a seed that draws the workload: prompts that share openings,
greedy, seeded and unseeded sampling, stop strings and stop ids, arrivals over the run, aborts at
every stage, and requests the engine must refuse. After every step the page accounting holds; at the
end every request ended exactly once, within its limits, and every page is back. A step that raises
would end a replica's engine loop and every request on it (one such, a demotion of shared pages, was
found this way).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import InvalidRequestError, SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, make_engine

VOCAB = 380  # the tiny model's ordinary tokens (its special ones lie above)
STOP_CHARS = "abcdefghijklmnopqrstuvwxyz .,"


@dataclass(frozen=True)
class Case:
    policy: str
    gpu_pages: int
    prefix_cache: bool = True
    speculative: int = 0
    async_scheduling: bool = True
    chunk: int = 64  # max_num_batched_tokens
    max_seqs: int = 4
    max_len: int = 448


CASES = {
    "hybrid-shared-prefixes": Case("hybrid", 11),
    "hybrid-speculative-small-chunks": Case("hybrid", 12, speculative=2, chunk=7),
    "hybrid-speculative-sync": Case("hybrid", 12, speculative=3, async_scheduling=False, max_seqs=8),
    "offload-speculative": Case("offload", 16, speculative=1, max_len=257),
    "preempt-few-token-chunks": Case("preempt", 12, chunk=5, max_seqs=3, max_len=200),
}


def _engine(tiny_dir: Path, case: Case) -> LLMEngine:
    host = 0.05 if case.policy in ("hybrid", "offload") else 0.0
    return make_engine(tiny_dir, num_gpu_pages=case.gpu_pages, enable_prefix_cache=case.prefix_cache,
                       num_speculative_tokens=case.speculative, async_scheduling=case.async_scheduling,
                       max_num_batched_tokens=case.chunk, max_num_seqs=case.max_seqs, max_model_len=case.max_len,
                       hisparse=HiSparseConfig(policy=case.policy, host_pool_gib=host))


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "seeded", "unseeded"])
    sampled = {} if kind == "greedy" else {"temperature": rng.choice([0.5, 1.0]), "top_p": rng.choice([0.9, 1.0]),
                                           "top_k": rng.choice([0, 5, 50])}
    if kind == "seeded":
        sampled["seed"] = rng.randrange(2**63)
    stop = tuple("".join(rng.choices(STOP_CHARS, k=rng.randint(1, 3))) for _ in range(rng.choice([0, 0, 0, 1, 2])))
    stop_ids = tuple(rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 0, 0, 2])))
    max_tokens = rng.choice([1, rng.randint(1, 40), rng.randint(100, 200), rng.randint(100, 200)])
    return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids, ignore_eos=rng.random() < 0.8,
                          **sampled)


def _refused(rng: random.Random, max_len: int) -> tuple[list[int], dict]:
    """A request the engine must refuse: its prompt, and its sampling fields."""
    return rng.choice([([], {"max_tokens": 4}), ([1, VOCAB + 100], {"max_tokens": 4}), ([1] * max_len, {}),
                       ([1, 2], {"max_tokens": 0}), ([1, 2], {"stop": ("",)}), ([1, 2], {"temperature": -1.0})])


def _check_output(engine: LLMEngine, out: RequestOutput, params: SamplingParams) -> None:
    tokens = out.token_ids
    assert 1 <= len(tokens) <= params.max_tokens or out.finish_reason == "abort"
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_token_ids)
    assert not stops & set(tokens[:-1]), "a stop token before the last"
    for stop in params.stop:
        assert stop not in out.text, f"stop string {stop!r} left in the text"
    if out.finish_reason == "length":
        assert len(tokens) == params.max_tokens or len(tokens) + out.num_prompt_tokens == engine.max_model_len


@pytest.mark.parametrize(("name", "seed"), [(name, seed) for name in CASES
                                            for seed in ((1, 2) if CASES[name].policy == "hybrid" else (1,))])
def test_random_workloads_never_stop_the_engine(tiny_dir: Path, name: str, seed: int) -> None:
    case, rng = CASES[name], random.Random(f"{name}-{seed}")
    torch.manual_seed(seed)
    engine = _engine(tiny_dir, case)
    openings = [[rng.randrange(VOCAB) for _ in range(rng.choice([64, 128, 200]))] for _ in range(3)]
    arrivals: dict[int, list[str]] = {}
    prompts: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(12):
        opening = rng.choice(openings)[: rng.choice([0, 200, 200, rng.randint(1, 200)])]
        prompt = (opening + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))])[: case.max_len - 2]
        prompts[f"r{i}"] = (prompt, _params(rng))
        arrivals.setdefault(rng.choice([0, 0, rng.randint(1, 60)]), []).append(f"r{i}")
    aborts = {rng.randint(0, 80): rng.choice(list(prompts)) for _ in range(4)}

    ended: dict[str, RequestOutput] = {}
    running: set[str] = set()
    step = refusals = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid in arrivals.get(step, ()):
            engine.add_request(rid, *prompts[rid])
            running.add(rid)
        if rng.random() < 0.1:
            prompt, fields = _refused(rng, case.max_len)
            with pytest.raises(InvalidRequestError):
                engine.add_request(f"bad{step}", prompt, SamplingParams(**fields))
            refusals += 1
        if step in aborts and engine.abort_request(aborts[step]):
            running.discard(aborts[step])
        for out in engine.step():
            assert out.request_id in running, f"{out.request_id} produced after it ended"
            if out.finished:
                running.discard(out.request_id)
                assert out.request_id not in ended
                ended[out.request_id] = out
                _check_output(engine, out, prompts[out.request_id][1])
        engine.check_integrity()
        step += 1
        assert step < 5000, "the workload does not finish"
    assert not running
    assert_pages_released(engine)
    if engine.residency is not None:
        assert engine.residency.host.num_in_use() == 0
        assert engine.stats()["hot_unresolved"] == 0
