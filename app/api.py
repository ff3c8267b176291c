"""The HTTP routes of the OpenAI-compatible API, bound to one `OpenAIIngress`.

Built on each ingress replica by `OpenAIIngress.__serve_build_asgi_app__`. Routes
under `/v1` and the tokenizer routes require the API key when one is configured
(`Authorization: Bearer KEY`, compared by its SHA-256 digest); `/health` never
does, and answers `HEAD` as well as `GET` (what load balancers probe with). Bodies
are size- and time-limited before they are read (`app.body_limit`) and parsed and validated
in a worker thread, so a large body does not hold the event loop that streams
everyone else's tokens. There is no `/docs` and no `/openapi.json`:
the API is OpenAI's, documented by OpenAI and in the README, and an unauthenticated
schema would describe more than the health check to anyone who can connect.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from app.body_limit import BodyLimitMiddleware
from app.errors import APIError, install_error_handlers, invalid_request
from app.openai_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.responses import ResponseMeta, collect_chat, collect_completion, stream_chat, stream_completion

if TYPE_CHECKING:
    from app.ingress import OpenAIIngress

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The request body validated as `model`, parsed off the event loop; 400 naming the field when invalid."""
    raw = await request.body()
    try:
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as exc:
        raise invalid_request(exc.errors(include_url=False)) from None


def build_api(ingress: OpenAIIngress) -> FastAPI:
    api = FastAPI(title="hisparse-serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(api)
    api.add_middleware(BodyLimitMiddleware, max_bytes=ingress.max_body_bytes, timeout_s=ingress.body_timeout_s)

    def authorize(request: Request) -> None:
        if ingress.api_key_digest is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(digest, ingress.api_key_digest):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    guarded = [Depends(authorize)]

    def meta(request_id: str, include_usage: bool, parse_tools: bool = False,
             max_tool_calls: int | None = None) -> ResponseMeta:
        return ResponseMeta(request_id, ingress.model_id, int(time.time()), parse_tools, include_usage, max_tool_calls)

    @api.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        request_id, stream, parse_tools = await ingress.chat(body, request.headers)
        info = meta(request_id, bool(body.stream_options and body.stream_options.include_usage), parse_tools,
                    None if body.parallel_tool_calls else 1)
        if body.stream:
            return StreamingResponse(stream_chat(info, stream), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(collect_chat(info, await stream.collect()))

    @api.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        request_id, stream = await ingress.completion(body, request.headers)
        info = meta(request_id, bool(body.stream_options and body.stream_options.include_usage))
        if body.stream:
            return StreamingResponse(stream_completion(info, stream), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return JSONResponse(collect_completion(info, await stream.collect()))

    def model_card() -> dict[str, Any]:
        return {"id": ingress.model_id, "object": "model", "created": ingress.created,
                "owned_by": "hisparse-serve", "max_model_len": ingress.max_model_len}

    @api.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model:path}", dependencies=guarded)
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve (`client.models.retrieve`); the path form, since a model id may hold slashes."""
        ingress.check_model(model)
        return model_card()

    @api.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        tokens = await ingress.tokenize(await parse_body(request, TokenizeRequest))
        return {"count": len(tokens), "max_model_len": ingress.max_model_len, "tokens": tokens}

    @api.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        ingress.check_model(body.model)
        return {"prompt": await asyncio.to_thread(ingress.detokenize, body.tokens)}

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if await ingress.healthy():
            return Response(status_code=200)
        raise APIError(503, "no healthy decode replica")

    return api
