"""A request body size limit, applied before any route reads or parses the body.

An ASGI middleware around the API: a request whose `Content-Length` is over the
limit is answered 413 without reading it; a body sent without a length is read
up to the limit and refused as soon as it goes over. A body within the limit is
read once here and replayed to the route. Without the limit, a few multi-megabyte
chats would hold the ingress parsing JSON while small requests wait.
"""

from __future__ import annotations

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
    """Refuses HTTP request bodies over `max_bytes` with an OpenAI-style 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, size: int) -> None:
        message = f"the request body has at least {size} bytes; this server accepts at most {self.max_bytes}"
        body = json.dumps(error_body(413, message, None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
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
