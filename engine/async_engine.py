"""Async front of the engine: a background thread steps the core; callers stream outputs.

`generate()` is an async generator yielding one `RequestOutput` per step that
produced tokens for the request. Submissions and aborts cross into the engine
thread through a locked inbox; outputs come back through each request's
asyncio queue. A consumer that stops iterating (client gone, task cancelled)
aborts its request, which frees its pages. A request the engine ended on an
error of its own raises `RequestFailedError` from its stream while the others go
on. If the loop dies, every stream gets `EngineDeadError` and `is_healthy()`
turns false. `generate_then` also runs a function on the engine thread right
after the step that ends the request, before any other step: the pages the
request leaves cached are still there to read (a prefill's export).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can make progress."""


class RequestFailedError(RuntimeError):
    """Processing this one request failed; the engine ended it and serves the others."""


class RequestCancelledError(RuntimeError):
    """The request was ended from outside its stream (`AsyncEngine.cancel`): its consumer is gone."""


def _stream_item(output: RequestOutput) -> RequestOutput | RequestFailedError:
    """What the request's stream gets: the output, or the error the engine ended the request with."""
    return output if output.error is None else RequestFailedError(output.error)


@dataclass
class _ThenResult:
    """What a request's `then` function returned, queued after the request's last output."""

    value: Any


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | _ThenResult | BaseException]
    then: Callable[[LLMEngine], Any] | None = None

    def put(self, item: RequestOutput | _ThenResult | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.engine.tokenizer

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises `InvalidRequestError` before anything runs if it cannot."""
        request_id, stream = self._submit(prompt_token_ids, params, request_id, None)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, RequestOutput)
                finished = item.finished
                yield item
        finally:
            if not finished:  # its consumer left: nobody reads the stream
                self._end(request_id, None)

    async def generate_then(
        self, prompt_token_ids: list[int], params: SamplingParams, then: Callable[[LLMEngine], T],
        request_id: str | None = None,
    ) -> tuple[RequestOutput, T]:
        """Runs the request to its end, then `then(engine)` on the engine thread before the next step: another
        request's step could otherwise evict the pages this one left cached. Returns the last output and what
        `then` returned; raises what `then` raised (the engine goes on)."""
        request_id, stream = self._submit(prompt_token_ids, params, request_id, then)
        last: RequestOutput | None = None
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _ThenResult):
                    assert last is not None
                    return last, item.value
                last = item
        finally:
            if last is None or not last.finished:  # its caller left before the end
                self._end(request_id, None)

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                then: Callable[[LLMEngine], Any] | None) -> tuple[str, _Stream]:
        """Queues the request for the engine thread and opens its stream."""
        if not self.is_healthy():
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        self.engine.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), then)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adds.append((request_id, list(prompt_token_ids), params))
        self._wake.set()
        return request_id, stream

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps (page transfers, stats)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.is_healthy():
                raise EngineDeadError(f"engine loop is not running: {self.error!r}")
            self._calls.append((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Ends the request; a consumer still reading its stream gets `RequestCancelledError` (it waited for
        good: the stream was dropped with nothing more to come)."""
        self._end(request_id, RequestCancelledError(f"request {request_id!r} was aborted"))

    def cancel(self, request_id: str, reason: str) -> None:
        """Ends the request as `abort` does, its stream with `RequestCancelledError(reason)`: for a watcher that
        knows the stream's consumer is gone when the consumer itself cannot close it."""
        self._end(request_id, RequestCancelledError(reason))

    def _end(self, request_id: str, error: RequestCancelledError | None) -> None:
        """Takes the request out of the inbox if it still waits there (the engine never sees it), else has the
        engine abort it at the next drain; its stream, if still read, ends with `error`. An abort queued beside
        its own add would reach the engine first, find nothing, and the add would then run the request to its
        last token for nobody."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            queued = len(self._adds)
            self._adds = [add for add in self._adds if add[0] != request_id]
            if len(self._adds) == queued:
                self._aborts.append(request_id)
        self._wake.set()
        if stream is not None and error is not None:
            stream.put(error)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop after the current step (pending streams get an error), then the ranks."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Blocks until no request is queued or running (tests, graceful drain)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not (self._adds or self._aborts or self._calls or self.engine.has_unfinished()):
                    return True
            time.sleep(0.01)
        return False

    # --- engine thread --------------------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting (aborted, timed out): nothing is run for it
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - the caller gets the failure
                future.set_exception(exc)
            else:
                future.set_result(result)
        for rid in aborts:
            self.engine.abort_request(rid)
        for rid, prompt, params in adds:
            try:
                self.engine.add_request(rid, prompt, params)
            except ValueError as exc:
                self._deliver(rid, exc)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own, not the loop's
                logger.exception("adding request %s failed", rid)
                self._deliver(rid, RequestFailedError(f"{type(exc).__name__}: {exc}"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.put(item)
        if stream.then is not None and isinstance(item, RequestOutput) and item.finished:
            try:
                stream.put(_ThenResult(stream.then(self.engine)))
            except Exception as exc:  # noqa: BLE001 - the request's caller gets the failure, not the loop
                stream.put(exc)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self.engine.check_health()  # a rank that died while idle ends the loop now
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, _stream_item(output))
        except BaseException as exc:  # noqa: BLE001 - any failure ends the loop; streams must hear of it
            self.error = exc  # first, so health checks fail from now on
            logger.exception("engine loop died")
        dead = EngineDeadError(f"engine loop stopped: {self.error!r}" if self.error else "engine shut down")
        with self._lock:
            streams, self._streams = dict(self._streams), {}
            calls, self._calls = self._calls, []
        for stream in streams.values():
            stream.put(dead)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(dead)
