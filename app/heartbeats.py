"""Heartbeat chunks in a decode stream that is quiet: proof to the ingress that the replica is running.

The ingress's `/health` takes text streaming out of a decode replica as proof that
its engine loop runs, and otherwise asks the replica's health check, which waits
in the same `max_ongoing_requests` queue as requests. When every slot holds a
request that streams nothing yet (waiting for a prefill replica, queued in the
engine, or in a long prefill), the check timed out and `/health` answered 503 for
a healthy, busy replica; a load balancer would have taken it out. A heartbeat
every `HEARTBEAT_S` of silence, sent only while the engine loop is alive, keeps
that proof flowing at no cost to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from app.messages import GenerateChunk

# Seconds of silence in a stream before a heartbeat; well inside the ingress's liveness window (5 s).
HEARTBEAT_S = 2.0


async def with_heartbeats(chunks: AsyncIterator[GenerateChunk], alive: Callable[[], bool]
                          ) -> AsyncIterator[GenerateChunk]:
    """`chunks`, with `GenerateChunk.alive()` after every `HEARTBEAT_S` without a chunk while `alive()` holds.

    The next chunk is awaited in a task of its own so the wait can time out without cancelling it. Closing or
    cancelling this stream cancels that task and then closes `chunks` (its own cleanup, an abort, runs).
    """
    source = aiter(chunks)
    pending: asyncio.Future[GenerateChunk] = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=HEARTBEAT_S)
            if not done:
                if alive():
                    yield GenerateChunk.alive()
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(anext(source))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()
