"""The ingress deployment: OpenAI requests in, decode replica streams out.

Per request it checks the model name, renders the chat template and tokenizes
(off the event loop), applies the admission limit, builds the sampling
parameters, picks the affinity key, and calls a decode replica. It waits for the
first chunk before answering, so refusals (400) and overload (503, from the
decode deployment's `max_queued_requests`) get their status instead of a broken
stream. When the client goes away, Serve cancels the handler and the decode call
is cancelled with it, which aborts the request and frees its pages.
The HTTP routes themselves are in `app.api`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.api import build_api
from app.config import AppConfig
from app.errors import APIError
from app.messages import GenerateChunk, GenerateRequest
from app.openai_models import ChatCompletionRequest, CompletionRequest, GenerationRequest, TokenizeRequest
from engine.model_config import ModelConfig
from engine.request import InvalidRequestError, SamplingParams
from engine.tokenizer import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 10.0


class DecodeStream:
    """The chunks of one decode call; closing it early cancels the call (and so the request)."""

    def __init__(self, response: DeploymentResponseGenerator, first: GenerateChunk) -> None:
        self._response, self._first = response, first

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        """Yields chunks up to the finished one; a decode replica lost mid-request ends it with a 503 chunk."""
        finished = False
        try:
            chunk = self._first
            while True:
                finished = chunk.finished
                yield chunk
                if finished:
                    return
                try:
                    chunk = await self._response.__anext__()
                except (RayError, StopAsyncIteration) as exc:
                    logger.warning("decode stream broke off: %r", exc)
                    chunk = GenerateChunk.refusal(503, "the decode replica was lost during the request; retry")
        finally:
            if not finished:
                self._response.cancel()

    async def collect(self) -> list[GenerateChunk]:
        chunks = [c async for c in self]
        last = chunks[-1]
        if last.error_status is not None:
            raise APIError(last.error_status, last.error_message)
        return chunks


class OpenAIIngress:
    """Serves the OpenAI API; one per ingress replica."""

    def __init__(self, config: AppConfig, decode: DeploymentHandle) -> None:
        self.config = config
        self.model_id = config.model_id
        self.created = int(time.time())
        self.tokenizer = Tokenizer.from_dir(config.model.path)
        model_len = ModelConfig.from_dir(config.model.path).max_position_embeddings
        self.max_model_len = config.engine.max_model_len or model_len
        self.api_key = config.api.api_key or os.environ.get(config.api.api_key_env) or None
        self._decode = decode
        self._generate = decode.options(method_name="generate", stream=True)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self)

    # --- checks ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           "model", "model_not_found")

    def _admit(self, prompt_ids: list[int], param: str) -> None:
        limit = self.config.api.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server admits at most {limit}",
                           param, "context_length_exceeded")
        if len(prompt_ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length is "
                           f"{self.max_model_len} and at least one token must be generated",
                           param, "context_length_exceeded")

    def _sampling(self, body: GenerationRequest, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", "n")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens or self.config.api.default_max_tokens,
                temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from None

    # --- affinity -------------------------------------------------------------------

    def _affinity_key(self, headers: Mapping[str, str], opening: Any) -> str:
        """The decode router's key: the client's session, else a hash of the conversation's opening."""
        if not self.config.routing.affinity:
            return ""
        session = headers.get(self.config.routing.session_header)
        if session:
            return f"session:{session}"
        digest = hashlib.blake2b(json.dumps(opening, sort_keys=True, default=str).encode(), digest_size=16)
        return f"prefix:{digest.hexdigest()}"

    @staticmethod
    def _chat_opening(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        """System prompt, tools and first user turn: the part every later turn repeats."""
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
        return {"tools": tools, "messages": messages[: first_user + 1]}

    # --- requests ---------------------------------------------------------------------

    async def start(
        self, kind: str, prompt_ids: list[int], params: SamplingParams, key: str
    ) -> tuple[str, DecodeStream]:
        """Sends a `chatcmpl` or `cmpl` request to a decode replica; returns its id and stream at the first chunk."""
        self._admit(prompt_ids, "messages" if kind == "chatcmpl" else "prompt")
        request_id = f"{kind}-{uuid.uuid4().hex}"
        handle = self._generate.options(session_id=key) if key else self._generate
        response = handle.remote(GenerateRequest(request_id, prompt_ids, params))
        try:
            first = await response.__anext__()
        except BackPressureError:
            raise APIError(503, "the server is overloaded; retry later", code="overloaded") from None
        except (DeploymentUnavailableError, RayError) as exc:
            logger.warning("%s: decode call failed: %r", request_id, exc)
            raise APIError(503, "no decode replica could take the request; retry later") from None
        except BaseException:
            response.cancel()
            raise
        if first.error_status is not None:
            raise APIError(first.error_status, first.error_message)
        return request_id, DecodeStream(response, first)

    @staticmethod
    def _tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The tools to render (None: no tools, or tool_choice 'none'); refuses what cannot be honoured."""
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if body.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "only tool_choice 'auto' and 'none' are supported", "tool_choice")
        if not body.tools or body.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in body.tools]

    async def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            return await asyncio.to_thread(
                self.tokenizer.encode_chat, messages, tools, add_generation_prompt, **(template_kwargs or {})
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None
        except TypeError as exc:  # chat_template_kwargs naming an argument of the renderer
            raise APIError(400, f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None

    async def chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]) -> tuple[str, DecodeStream, bool]:
        """Starts a chat completion; the flag says whether tool calls are parsed from the output."""
        self.check_model(body.model)
        params = self._sampling(body, body.max_completion_tokens or body.max_tokens)
        tools = self._tools(body)
        ids = await self._render(body.messages, tools, True, body.chat_template_kwargs)
        key = self._affinity_key(headers, self._chat_opening(body.messages, tools))
        request_id, stream = await self.start("chatcmpl", ids, params, key)
        return request_id, stream, tools is not None

    async def completion(self, body: CompletionRequest, headers: Mapping[str, str]) -> tuple[str, DecodeStream]:
        self.check_model(body.model)
        if body.echo or body.logprobs is not None or body.suffix:
            raise APIError(400, "echo, logprobs and suffix are not supported")
        params = self._sampling(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        key = self._affinity_key(headers, ids[: self.config.routing.prefix_tokens])
        return await self.start("cmpl", ids, params, key)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages")
        if body.prompt is not None:
            return await asyncio.to_thread(self.tokenizer.encode, body.prompt)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return await self._render(body.messages, tools, body.add_generation_prompt)

    def detokenize(self, tokens: list[int]) -> str:
        bad = [t for t in tokens if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {self.tokenizer.vocab_size}); got {bad[:5]}", "tokens")
        return self.tokenizer.decode(tokens)

    async def healthy(self) -> bool:
        """Whether a decode replica answers its health check."""
        try:
            await asyncio.wait_for(self._decode.check_health.remote(), _HEALTH_TIMEOUT_S)
        except (RayError, BackPressureError, DeploymentUnavailableError, RuntimeError, asyncio.TimeoutError) as exc:
            logger.warning("health check failed: %r", exc)
            return False
        return True
