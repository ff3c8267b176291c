"""Heartbeat chunks in a decode stream before its first chunk: proof to the ingress that the replica runs.

The ingress's `/health` takes text streaming out of a decode replica as proof that
its engine loop runs, and otherwise asks the replica's health check, which waits
in the same `max_ongoing_requests` queue as requests. When every slot holds a
request that streams nothing yet (waiting for a prefill replica, queued in the
engine, or in a long prefill), the check timed out and `/health` answered 503 for
a healthy, busy replica; a load balancer would have taken it out. A heartbeat
every `HEARTBEAT_S` of that wait, sent only while the engine loop is alive, keeps
the proof flowing at no cost to the engine. Once a request streams, its text is
the proof: the rest of the stream is passed on as it comes, without the task a
timed wait needs (about 20 us a chunk, thousands of chunks a second at a full batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from app.messages import GenerateChunk

# Seconds of waiting before a heartbeat; well inside the ingress's liveness window (5 s).
HEARTBEAT_S = 2.0


async def with_heartbeats(chunks: AsyncIterator[GenerateChunk], alive: Callable[[], bool]
                          ) -> AsyncIterator[GenerateChunk]:
    """`chunks`, with `GenerateChunk.alive()` every `HEARTBEAT_S` before the first while `alive()` holds.

    The first chunk is awaited in a task of its own so the wait can time out without cancelling it. Closing or
    cancelling this stream cancels that task and closes `chunks` (its own cleanup, an abort, runs).
    """
    source = aiter(chunks)
    try:
        first: asyncio.Future[GenerateChunk] = asyncio.ensure_future(anext(source))
        try:
            while not (await asyncio.wait({first}, timeout=HEARTBEAT_S))[0]:
                if alive():
                    yield GenerateChunk.alive()
        finally:
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
        try:
            chunk = first.result()
        except StopAsyncIteration:
            return
        yield chunk
        async for chunk in source:
            yield chunk
    finally:
        await source.aclose()
