"""The ingress deployment: OpenAI requests in, decode replica streams out.

Per request it checks the model name, refuses parameters it cannot honour,
renders the chat template, tokenizes and computes the affinity key (in a worker
thread, off the event loop), applies the admission limit, builds the sampling
parameters and calls a decode replica. It waits for the
first chunk before answering, so refusals (400) and overload (503, from the
decode deployment's `max_queued_requests`) get their status instead of a broken
stream. When the client goes away, Serve cancels the handler and the decode call
is cancelled with it, which aborts the request and frees its pages. Text
streaming out of a decode replica counts for the health check, which probes the
replica only when none came lately (`OpenAIIngress.healthy`).
The HTTP routes themselves are in `app.api`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import ray
from fastapi import FastAPI
from ray.actor import ActorHandle
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.api import build_api
from app.config import AppConfig, ConfigError
from app.errors import APIError
from app.logs import log_cancellations_briefly, route_app_logs
from app.messages import GenerateChunk, GenerateRequest
from app.openai_models import ChatCompletionRequest, CompletionRequest, GenerationRequest, TokenizeRequest
from engine.model_config import ModelConfig
from engine.request import InvalidRequestError, SamplingParams
from engine.tokenizer import ChatTemplateError, TokenizationError, Tokenizer

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 10.0
# Generated text or a heartbeat from a decode replica this recent answers the health check without a probe.
_LIVE_WINDOW_S = 5.0
# Arguments of the renderer itself, which chat_template_kwargs may not name: the request's fields and `self`.
_RENDER_ARGUMENTS = frozenset({"self", "messages", "tools", "add_generation_prompt"})


class EngineLiveness:
    """When a decode replica last sent generated text or a heartbeat: its engine loop was running then.

    A refusal proves nothing (a dead engine answers every request with one), so only
    chunks without an error status count.
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._last = -math.inf

    def saw(self, chunk: GenerateChunk) -> None:
        if chunk.error_status is None:
            self._last = time.monotonic()

    def recent(self) -> bool:
        """Whether generated text or a heartbeat arrived within the window."""
        return time.monotonic() - self._last < self._window_s


def _current_actor() -> ActorHandle | None:
    """This replica's actor, which decode replicas ping to learn whether their caller is alive (None outside one)."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def refusal_error(chunk: GenerateChunk, kind: str) -> APIError:
    """A decode replica's refusal as the API's error; the engine's `prompt` is a chat's rendered `messages`."""
    param = "messages" if chunk.error_param == "prompt" and kind == "chatcmpl" else chunk.error_param
    return APIError(chunk.error_status or 500, chunk.error_message, param, chunk.error_code)


class DecodeStream:
    """The chunks of one decode call, each shown to `liveness` (heartbeats only to it); closing it early cancels
    the call (and so the request)."""

    def __init__(self, response: DeploymentResponseGenerator, first: GenerateChunk, liveness: EngineLiveness) -> None:
        self._response, self._first, self._liveness = response, first, liveness

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        """Yields chunks up to the finished one; a decode replica lost mid-request ends it with a 503 chunk."""
        finished = False
        try:
            chunk = self._first
            while True:
                finished = chunk.finished
                self._liveness.saw(chunk)
                yield chunk
                if finished:
                    return
                try:
                    chunk = await self._response.__anext__()
                    while chunk.heartbeat:
                        self._liveness.saw(chunk)
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

    async def __init__(self, config: AppConfig, decode: DeploymentHandle) -> None:
        route_app_logs()
        log_cancellations_briefly(asyncio.get_running_loop())
        self.config = config
        self.model_id = config.model_id
        self.created = int(time.time())
        self.tokenizer = Tokenizer.from_dir(config.model.path)
        model_len = ModelConfig.from_dir(config.model.path).max_position_embeddings
        self.max_model_len = config.engine.max_model_len or model_len
        if (config.api.max_prompt_tokens or 0) >= self.max_model_len:
            logger.warning("api.max_prompt_tokens %d is not below the context length %d: it admits nothing the context "
                           "length does not", config.api.max_prompt_tokens, self.max_model_len)
        self.max_body_bytes = config.api.body_limit(self.max_model_len)
        self.body_timeout_s = config.api.body_timeout_s
        # The digest carried in the args (key set where the app was built), else the key set here.
        self.api_key_digest = config.api.key_digest()
        self._log_key_policy()
        self._decode = decode
        self._generate = decode.options(method_name="generate", stream=True)
        self._liveness = EngineLiveness(_LIVE_WINDOW_S)
        self._actor = _current_actor()

    def _log_key_policy(self) -> None:
        if self.api_key_digest is not None:
            logger.info("%s: clients must send the API key (Authorization: Bearer KEY)", self.model_id)
        elif self.config.api.require_api_key:
            raise ConfigError(f"api.require_api_key is set but no key was found: set api.api_key_sha256, or "
                              f"${self.config.api.api_key_env} where the app is built or the ingress runs")
        else:
            logger.warning("%s: no API key is set: every client that can connect is served", self.model_id)

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
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], refused[0])
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        stop_ids = tuple(body.stop_token_ids or ())
        self._check_ids(list(stop_ids), "stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=max_tokens or self.config.api.default_max_tokens,
                temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                seed=body.seed, stop=stop, ignore_eos=body.ignore_eos, stop_token_ids=stop_ids,
                skip_special_tokens=body.skip_special_tokens,
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def _check_ids(self, ids: list[int], param: str) -> None:
        """Token ids a client sends (a prompt, stop ids) must be ones the tokenizer can decode (what /detokenize
        accepts)."""
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param)

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
        response = handle.remote(GenerateRequest(request_id, prompt_ids, params, self._actor))
        try:
            first = await response.__anext__()
            while first.heartbeat:  # still waiting: no status to answer with yet
                self._liveness.saw(first)
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
            raise refusal_error(first, kind)
        return request_id, DecodeStream(response, first, self._liveness)

    @staticmethod
    def _tools(body: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]] | None:
        """The tools to render (None: no tools, or tool_choice 'none')."""
        if not body.tools or body.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in body.tools]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the conversation (runs in a worker thread); 400 naming the part at fault."""
        clash = sorted(_RENDER_ARGUMENTS & set(template_kwargs or {}))
        if clash:
            raise APIError(400, f"chat_template_kwargs may not set {clash}: the chat renderer's own arguments "
                           "(messages, tools and add_generation_prompt come from the request)", "chat_template_kwargs")
        try:
            return self.tokenizer.encode_chat(messages, tools, add_generation_prompt, **(template_kwargs or {}))
        except (ChatTemplateError, TokenizationError) as exc:
            raise APIError(400, str(exc), "messages") from None
        except (TypeError, ValueError, LookupError) as exc:  # a template tripping over values it did not expect
            raise APIError(400, f"the chat template cannot render these messages ({type(exc).__name__}: {exc})",
                           "messages") from None

    def _prepare_chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]) -> tuple[list[int], str, bool]:
        """Prompt ids, affinity key and whether tools are parsed: the heavy part, off the event loop."""
        tools = self._tools(body)
        messages = [m.for_template() for m in body.messages]
        ids = self._render(messages, tools, True, body.chat_template_kwargs)
        return ids, self._affinity_key(headers, self._chat_opening(messages, tools)), tools is not None

    async def chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]) -> tuple[str, DecodeStream, bool]:
        """Starts a chat completion; the flag says whether tool calls are parsed from the output."""
        self.check_model(body.model)
        params = self._sampling(body, body.max_completion_tokens or body.max_tokens)
        ids, key, parse_tools = await asyncio.to_thread(self._prepare_chat, body, dict(headers))
        request_id, stream = await self.start("chatcmpl", ids, params, key)
        return request_id, stream, parse_tools

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except TokenizationError as exc:
            raise APIError(400, str(exc), param) from None

    async def completion(self, body: CompletionRequest, headers: Mapping[str, str]) -> tuple[str, DecodeStream]:
        self.check_model(body.model)
        params = self._sampling(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self._encode, prompt, "prompt")
        else:
            ids = list(prompt)
            self._check_ids(ids, "prompt")
        key = self._affinity_key(headers, ids[: self.config.routing.prefix_tokens])
        return await self.start("cmpl", ids, params, key)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages")
        if body.prompt is not None:
            if body.chat_template_kwargs:
                raise APIError(400, "chat_template_kwargs apply to messages, not to a prompt", "chat_template_kwargs")
            return await asyncio.to_thread(self._encode, body.prompt, "prompt")
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], refused[0])
        messages = [m.for_template() for m in body.messages]
        return await asyncio.to_thread(self._render, messages, self._tools(body), body.add_generation_prompt,
                                       body.chat_template_kwargs)

    def detokenize(self, tokens: list[int]) -> str:
        self._check_ids(tokens, "tokens")
        return self.tokenizer.decode(tokens)

    async def healthy(self) -> bool:
        """Whether a decode replica's engine is running: it sent generated text or a heartbeat within
        `_LIVE_WINDOW_S`, or it answers its health check.

        The probe is a call like `generate` and waits in the same queue (`max_ongoing_requests`), so on a fully
        loaded replica it would time out, or be refused by `max_queued_requests`, exactly when the engine is
        busiest. Chunks streaming out of a replica are proof enough then, and cost no call: text, or while its
        requests wait (for a prefill replica, in a long prefill) the heartbeats it sends only while its engine
        loop is alive (`app.heartbeats`). A dead engine loop sends neither, only refusals (which empty the queue
        at once), so once its last chunk is older than the window the probe runs and fails: a dead engine still
        answers 503.
        """
        if self._liveness.recent():
            return True
        try:
            await asyncio.wait_for(self._decode.check_health.remote(), _HEALTH_TIMEOUT_S)
        except (RayError, BackPressureError, DeploymentUnavailableError, RuntimeError, asyncio.TimeoutError) as exc:
            logger.warning("health check failed: %r", exc)
            return False
        return True
