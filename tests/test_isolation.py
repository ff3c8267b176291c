"""One request's failure stays its own: the async engine and the replica serve the others on.

A request whose processing raises (its sampling, stop strings, detokenizing,
admission) gets an error on its own stream and its pages back in the pool; the
engine loop, the other requests and the replica's health carry on. A failure
the engine cannot pin on one request (the forward pass) still ends the loop.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.decode import DecodeServer
from app.messages import GenerateChunk, GenerateRequest
from engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams


@pytest.fixture
def engine(tiny_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), enable_prefix_cache=False))
    yield eng
    eng.shutdown()


def _fail_stop_check(core: LLMEngine, victim: str, after_tokens: int) -> None:
    """Makes the stop-string check of request `victim` raise once it has `after_tokens` tokens."""
    check = core._stop_reason

    def failing(req: Request, state):  # noqa: ANN001, ANN202 - same signature as `_stop_reason`
        if req.request_id == victim and len(req.output_token_ids) >= after_tokens:
            raise RuntimeError("stop check broke")
        return check(req, state)

    core._stop_reason = failing


async def _count(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> int:
    """Tokens of the request's final output."""
    last = None
    async for last in engine.generate(prompt, params, rid):
        pass
    return len(last.token_ids)


def _params(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def test_edge_sampling_values_complete_beside_others(engine: AsyncEngine) -> None:
    async def run() -> list[int]:
        return await asyncio.gather(
            _count(engine, [1, 2, 3], _params(8, temperature=1e-39), "cold"),
            _count(engine, [4, 5, 6, 7], _params(8, temperature=1.0, top_p=1e-300), "narrow"),
            _count(engine, [8, 9], _params(8, temperature=0.7, seed=3), "plain"),
            _count(engine, list(range(20, 60)), _params(8), "greedy"),
        )

    assert asyncio.run(run()) == [8, 8, 8, 8]
    assert engine.is_healthy()


def test_a_failing_request_fails_alone(engine: AsyncEngine) -> None:
    _fail_stop_check(engine.engine, "victim", after_tokens=3)
    received: list[int] = []

    async def victim() -> None:
        async for output in engine.generate(list(range(1, 70)), _params(20), "victim"):
            received.append(len(output.token_ids))

    async def run() -> list:
        return await asyncio.gather(
            victim(),
            _count(engine, [9, 8, 7], _params(12), "a"),
            _count(engine, [4] * 90, _params(15, temperature=1.0, seed=1), "b"),
            return_exceptions=True,
        )

    failure, a, b = asyncio.run(run())
    assert isinstance(failure, RequestFailedError) and "stop check broke" in str(failure)
    assert received == [1, 2]  # what it streamed before its failure
    assert (a, b) == (12, 15)
    assert engine.is_healthy()
    assert engine.wait_idle()
    engine.engine.check_integrity()
    assert engine.engine.kv.num_pages_in_use() == 0
    assert asyncio.run(_count(engine, [3, 1, 4, 1, 5], _params(6), "after")) == 6


def test_a_failing_admission_fails_alone(engine: AsyncEngine) -> None:
    add = engine.engine.scheduler.add

    def failing_add(req: Request) -> None:
        if req.request_id == "victim":
            raise RuntimeError("queue broke")
        add(req)

    engine.engine.scheduler.add = failing_add

    async def run() -> list:
        return await asyncio.gather(
            _count(engine, [1, 2, 3], _params(5), "victim"),
            _count(engine, [4, 5, 6], _params(7), "other"),
            return_exceptions=True,
        )

    failure, other = asyncio.run(run())
    assert isinstance(failure, RequestFailedError) and "queue broke" in str(failure)
    assert other == 7
    assert engine.is_healthy()
    assert engine.wait_idle() and "victim" not in engine.engine._requests


def test_a_failing_forward_ends_the_loop(engine: AsyncEngine) -> None:
    """A forward failure belongs to no single request: the loop stops and every stream hears of it."""

    def broken(scheduled: list, sampling: object) -> None:
        raise RuntimeError("device lost")

    engine.engine.runner.launch = broken

    async def run() -> list:
        return await asyncio.gather(
            _count(engine, [1, 2, 3], _params(5), "a"), _count(engine, [4, 5], _params(5), "b"),
            return_exceptions=True,
        )

    errors = asyncio.run(run())
    assert all(isinstance(e, EngineDeadError) and "device lost" in str(e) for e in errors)
    assert not engine.is_healthy()


class _Metrics:
    """Records what the replica reports of each finished request."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def request_finished(self, *args: object) -> None:
        self.reasons.append(str(args[-1]))


def test_replica_answers_a_failed_request_with_500_and_stays_healthy(tiny_dir: Path) -> None:
    async def run() -> tuple[list[GenerateChunk], list[GenerateChunk]]:
        server = object.__new__(DecodeServer)  # the replica's state without Serve
        server.engine = AsyncEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=32))
        server.metrics = _Metrics()
        server.counters = collections.Counter()
        _fail_stop_check(server.engine.engine, "victim", after_tokens=2)

        async def chunks(rid: str) -> list[GenerateChunk]:
            return [c async for c in server._stream(GenerateRequest(rid, [5, 6, 7], _params(6)), time.monotonic())]

        try:
            failed, ok = await asyncio.gather(chunks("victim"), chunks("ok"))
            await server.check_health()
        finally:
            server.engine.shutdown()
        assert server.counters["finished_error"] == 1 and server.counters["finished_length"] == 1
        assert sorted(server.metrics.reasons) == ["error", "length"]
        return failed, ok

    failed, ok = asyncio.run(run())
    assert failed[-1].error_status == 500 and "the request failed" in failed[-1].error_message
    assert "stop check broke" in failed[-1].error_message
    assert len(failed) == 2 and failed[0].error_status is None  # the first token still streamed
    assert ok[-1].finished and ok[-1].error_status is None and ok[-1].num_output_tokens == 6
