"""The HTTP routes of the OpenAI-compatible API, bound to one `OpenAIIngress`.

Built on each ingress replica by `OpenAIIngress.__serve_build_asgi_app__`. Routes
under `/v1` and the tokenizer routes require the API key when one is configured
(`Authorization: Bearer KEY`); `/health` never does.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.errors import APIError, install_error_handlers
from app.openai_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.responses import ResponseMeta, collect_chat, collect_completion, stream_chat, stream_completion

if TYPE_CHECKING:
    from app.ingress import OpenAIIngress

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_api(ingress: OpenAIIngress) -> FastAPI:
    api = FastAPI(title="hisparse-serve", docs_url=None, redoc_url=None)
    install_error_handlers(api)

    def authorize(request: Request) -> None:
        if ingress.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), ingress.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    guarded = [Depends(authorize)]

    def meta(request_id: str, include_usage: bool, parse_tools: bool = False) -> ResponseMeta:
        return ResponseMeta(request_id, ingress.model_id, ingress.created, parse_tools, include_usage)

    @api.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id, stream, parse_tools = await ingress.chat(body, request.headers)
        info = meta(request_id, bool(body.stream_options and body.stream_options.include_usage), parse_tools)
        if body.stream:
            return StreamingResponse(stream_chat(info, stream), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(collect_chat(info, await stream.collect()))

    @api.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id, stream = await ingress.completion(body, request.headers)
        info = meta(request_id, bool(body.stream_options and body.stream_options.include_usage))
        if body.stream:
            return StreamingResponse(stream_completion(info, stream), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return JSONResponse(collect_completion(info, await stream.collect()))

    @api.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        card = {"id": ingress.model_id, "object": "model", "created": ingress.created,
                "owned_by": "hisparse-serve", "max_model_len": ingress.max_model_len}
        return {"object": "list", "data": [card]}

    @api.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tokens = await ingress.tokenize(body)
        return {"count": len(tokens), "max_model_len": ingress.max_model_len, "tokens": tokens}

    @api.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ingress.check_model(body.model)
        return {"prompt": ingress.detokenize(body.tokens)}

    @api.get("/health")
    async def health() -> Response:
        if await ingress.healthy():
            return Response(status_code=200)
        raise APIError(503, "no healthy decode replica")

    return api
