"""A request body size and time limit, applied before any route reads or parses the body.

An ASGI middleware around the API: a request whose `Content-Length` is over the
limit is answered 413 without reading it; a body sent without a length is read
up to the limit and refused as soon as it goes over. A body within the limit is
read once here and replayed to the route. Without the limit, a few multi-megabyte
chats would hold the ingress parsing JSON while small requests wait.

The whole body must also arrive within `timeout_s` of the request's start, else
the request is answered 408. Every request waiting on its body holds one of the
ingress replica's `max_ongoing_requests` slots: without the deadline, a few hundred
connections that send a header and a byte of body, then nothing, held all of
them, and every other request, `/health` included, waited for as long as those
connections stayed open.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ray.exceptions import TaskCancelledError

from app.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimitMiddleware:
    """Refuses HTTP request bodies over `max_bytes` with an OpenAI-style 413, and slower than `timeout_s` with a 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(send, declared)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await _refuse(send, 408, "request_timeout",
                          f"the request body did not arrive within {self.timeout_s:g} s")
            return
        except _BodyTooLarge as exc:
            await self._too_large(send, exc.size)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, send: Send, size: int) -> None:
        await _refuse(send, 413, "request_too_large",
                      f"the request body has at least {size} bytes; this server accepts at most {self.max_bytes}")

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body; None when the client went away while sending it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await receive()
            except TaskCancelledError:  # Serve's relay of a client that left (see `_replay`)
                return None
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise _BodyTooLarge(size)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    """An error answered before the body is read whole: the connection closes, the rest of the body unread."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out the buffered body once, then waits on the real one (for disconnects).

    When a client goes away, Serve cancels the task that relays its messages and the real `receive` raises
    `TaskCancelledError`; that is the ASGI disconnect, so it is handed on as one. Raised instead, it reached
    the app's error handler as an unexpected error (a traceback for every stream a client left)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        try:
            return await receive()
        except TaskCancelledError:
            return {"type": "http.disconnect"}

    return replayed
