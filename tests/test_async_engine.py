"""Async API: streaming, cancellation frees everything, errors reach the caller."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, RequestCancelledError
from engine.config import EngineConfig
from engine.request import InvalidRequestError, SamplingParams


@pytest.fixture
def engine(tiny_dir: Path):
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), enable_prefix_cache=False))
    yield eng
    eng.shutdown()


def test_streams_tokens_as_they_arrive(engine: AsyncEngine) -> None:
    async def run() -> list:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        return [o async for o in engine.generate([5, 6, 7, 8], params)]

    outputs = asyncio.run(run())
    assert len(outputs) == 6
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    # each output keeps the tokens up to it, read after the request finished
    assert [o.token_ids for o in outputs] == [outputs[-1].token_ids[: i + 1] for i in range(6)]
    assert [o.new_token_ids[0] for o in outputs] == outputs[-1].token_ids
    assert [o.num_output_tokens for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text


def test_concurrent_streams_and_cancellation_free_pages(engine: AsyncEngine) -> None:
    async def consume(prompt: list[int], n: int, stop_after: int | None) -> int:
        got = 0
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            got += 1
            if stop_after is not None and got == stop_after:
                break  # the consumer walks away mid-stream
        return got

    async def run() -> list[int]:
        return await asyncio.gather(
            consume(list(range(1, 90)), 200, 3), consume([9, 8, 7], 5, None), consume([4] * 70, 8, None)
        )

    assert asyncio.run(run()) == [3, 5, 8]
    assert engine.wait_idle()
    assert engine.engine.kv.num_pages_in_use() == 0
    engine.engine.check_integrity()


def test_an_abort_ends_the_stream_its_consumer_still_reads(engine: AsyncEngine) -> None:
    """`abort` by id (an operator's or a timeout's, not the consumer's own leaving) dropped the stream with nothing
    more to come: its reader waited for good."""
    async def run() -> int:
        got = 0
        with pytest.raises(RequestCancelledError, match="aborted"):
            async with asyncio.timeout(30):
                async for _ in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True), "x"):
                    got += 1
                    if got == 3:
                        engine.abort("x")
        return got

    assert asyncio.run(run()) >= 3
    assert engine.wait_idle() and engine.engine.kv.num_pages_in_use() == 0


def test_invalid_request_raises_before_streaming(engine: AsyncEngine) -> None:
    async def run() -> None:
        async for _ in engine.generate([], SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(run())
    assert engine.is_healthy()


def test_dead_loop_fails_streams_and_calls(tiny_dir: Path) -> None:
    from engine.async_engine import EngineDeadError

    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), enable_prefix_cache=False))

    def broken_step():  # noqa: ANN202 - the model runner failing mid-step
        raise RuntimeError("device lost")

    eng.engine.step = broken_step

    async def run() -> None:
        async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(run())
    assert not eng.is_healthy()

    async def call() -> None:
        await eng.run_in_engine(lambda e: e.stats())

    with pytest.raises(EngineDeadError):
        asyncio.run(call())


def test_a_call_its_caller_gave_up_on_is_dropped(engine: AsyncEngine) -> None:
    """A caller that stops waiting for `run_in_engine` (an aborted request, a timeout) cancels the call; the engine
    thread, reaching it later, skips it and goes on serving (setting a cancelled call's result ended the loop)."""
    import threading

    busy, release = threading.Event(), threading.Event()

    def hold(_engine) -> None:  # noqa: ANN001 - keeps the engine thread inside its inbox
        busy.set()
        release.wait(10)

    async def run() -> list:
        held = asyncio.ensure_future(engine.run_in_engine(hold))
        await asyncio.to_thread(busy.wait, 10)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.run_in_engine(lambda e: e.stats()), 0.01)
        release.set()
        await held
        outputs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        return [outputs, await engine.run_in_engine(lambda e: e.num_steps)]

    outputs, steps = asyncio.run(run())
    assert engine.is_healthy() and len(outputs) == 3 and steps >= 3


def test_a_request_its_client_left_before_the_engine_took_it_never_runs(engine: AsyncEngine) -> None:
    """A client that leaves while its request still waits in the inbox (the engine thread busy with a step or a
    call) takes the request with it: it ran to its last token for nobody, holding a batch slot and KV pages."""
    import threading

    busy, release = threading.Event(), threading.Event()

    def hold(_engine) -> None:  # noqa: ANN001 - keeps the engine thread away from its inbox
        busy.set()
        release.wait(10)

    async def run() -> None:
        held = asyncio.ensure_future(engine.run_in_engine(hold))
        await asyncio.to_thread(busy.wait, 10)
        stream = engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=1500, ignore_eos=True), "gone")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)  # the request is in the inbox, waiting for its first output
        first.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        await stream.aclose()
        release.set()
        await held
        assert await engine.run_in_engine(lambda e: (e.has_unfinished(), e.kv.num_pages_in_use())) == (False, 0)

    asyncio.run(run())
    assert engine.wait_idle(5) and engine.is_healthy()


def test_then_runs_after_the_ending_step_and_its_failure_is_the_callers(engine: AsyncEngine) -> None:
    """`generate_then` runs its function on the engine thread before any step after the one that ended the request,
    even while another request keeps the engine stepping; a function that raises fails its caller only."""
    core = engine.engine
    ended_at: dict[str, int] = {}  # request id -> the engine's step count when the step that ended it returned
    step = core.step

    def recording_step() -> list:
        outputs = step()
        ended_at.update((o.request_id, core.num_steps) for o in outputs if o.finished)
        return outputs

    core.step = recording_step
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> tuple:
        other = asyncio.ensure_future(_drain(engine.generate(list(range(1, 30)), SamplingParams(max_tokens=40))))
        last, seen = await engine.generate_then([5, 6, 7], params, lambda e: (e.num_steps, e.has_unfinished()), "t")
        with pytest.raises(ZeroDivisionError):
            await engine.generate_then([5, 6, 7], params, lambda e: 1 / 0)
        return last, seen, await other

    last, (steps_seen, busy), other = asyncio.run(run())
    assert last.finished and last.num_output_tokens == 4
    assert busy and steps_seen == ended_at["t"]  # the other request still ran; no step came between
    assert other[-1].finished and engine.is_healthy()


def test_a_then_request_whose_caller_left_is_ended(engine: AsyncEngine) -> None:
    """A caller of `generate_then` that is cancelled (its own caller timed out) ends the request: its function
    never runs and its pages are freed."""
    ran = []

    async def run() -> None:
        task = asyncio.ensure_future(engine.generate_then(
            [1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True), lambda e: ran.append(1)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert engine.wait_idle(5) and engine.engine.kv.num_pages_in_use() == 0 and ran == []


async def _drain(stream) -> list:  # noqa: ANN001 - an async iterator of outputs
    return [o async for o in stream]
