"""OpenAI request bodies, validated by pydantic at the HTTP boundary.

Validation is strict where OpenAI's API is typed: `"max_tokens": "10"` or
`"stream": "yes"` is a 400 naming the field, not a silent coercion; `null` for a
field with a default means that default, as OpenAI's API documents. Messages are
typed by role, every list a client controls has a bound (messages, stop strings,
tools), and the integer sampling fields fit in 32 bits (the seed in 64), so one body
cannot make the ingress do unbounded work nor overflow the sampler's tensors. Fields
OpenAI defines that change nothing here (`user`, `store`, `metadata`, ...) are
accepted and ignored, so stock clients work (`parallel_tool_calls: false` keeps the
first tool call of a reply);
fields whose meaning this server cannot honour (n > 1, logprobs, penalties,
logit bias, a structured `response_format`, echo, forced tool choice) are
refused with 400 by `unsupported` or the ingress. `ignore_eos` and `top_k` are
vLLM's extensions, sent through the client's `extra_body`, as are `stop_token_ids`
and `skip_special_tokens` (true by default: role headers stay out of the text);
vLLM's other sampling extensions (`min_p`, `repetition_penalty`, `min_tokens`,
beam search, guided decoding) are accepted at their neutral values only, so a
client moved from vLLM is told rather than sampled differently without a word.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.request import MAX_TOKEN_ID

MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 512
# torch.Generator takes any seed in [-2**63, 2**64): anything beyond is the client's mistake.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The bound of the other integer sampling fields: the engine's own bound on top_k and token ids (a top_k beyond
# 64 bits stopped the engine loop in the sampler's int64 tensors, and any top_k above the vocabulary already means
# no cut); the fields refused away from their neutral values keep the same bound, so a huge one is refused by name.
INT32_MAX = MAX_TOKEN_ID


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drops `null` where the field has a default: OpenAI documents its optional parameters as nullable and
        clients send `null` for "unset"; a required field keeps its `null`, to be refused by its type."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationRequest(_Body):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    # vLLM's sampling extensions this server cannot honour (see the module docstring)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    use_beam_search: bool = False
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return stop

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot honour, with the reason; None if all can be."""
        if self.stream_options is not None and not self.stream:  # OpenAI refuses it too
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.n != 1:
            return "n", "only n=1 is supported"
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty" if self.presence_penalty else "frequency_penalty",
                    "presence and frequency penalties are not supported")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        for name, neutral in (("min_p", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0)):
            if getattr(self, name) != neutral:
                return name, f"{name} is not supported (only {neutral})"
        if self.use_beam_search:
            return "use_beam_search", "beam search is not supported"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if getattr(self, name) is not None:
                return name, "structured output (guided decoding) is not supported"
        return None


def _finite(value: Any) -> Any:
    """A JSON value from the body, refused if it holds NaN or an infinity (`NaN`, `Infinity`, or a number like
    1e999 that overflows): JSON has neither, and the template would write them into the prompt as invalid JSON.
    Walked without recursion (the body parser allows 200 levels)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not a JSON number (NaN and infinities are not JSON)")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


class FunctionSpec(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    _finite_parameters = field_validator("parameters")(_finite)


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class TextPart(_Body):
    """A content part; only text parts exist for a text-only model."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        """An image, audio or file part is refused as what it is, not as a text part missing its `text`."""
        if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
            raise ValueError(f"this model reads text only: a content part of type {part['type']!r} cannot be read")
        return part


class CalledFunction(_Body):
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is accepted too

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """The arguments as an object, so a bad JSON string is refused here with its exact location.

        Parsed by the parser, and under the nesting limit, that reads the request body itself: JSON nested
        too deeply is a parse error like any other, never a recursion error further on.
        """
        if isinstance(arguments, dict):
            return _finite(arguments)
        if not arguments.strip():
            return {}
        try:
            parsed = pydantic_core.from_json(arguments, allow_inf_nan=False)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"must be a JSON object, got {type(parsed).__name__}")
        return _finite(parsed)  # a number like 1e999 overflows to an infinity, which `allow_inf_nan` lets through


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    """One turn of the conversation, typed by role."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_by_role(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (a string or a list of text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (`developer` is OpenAI's newer name for `system`)."""
        message = self.model_dump(exclude_none=True)
        if self.role == "developer":
            message["role"] = "system"
        return message


def _tool_choice_refusal(tool_choice: str | dict[str, Any] | None) -> tuple[str, str] | None:
    """A forced tool choice (`required`, a named function) is not honoured: the output is not constrained."""
    if tool_choice not in (None, "auto", "none"):
        return "tool_choice", "only tool_choice 'auto' and 'none' are supported"
    return None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one tool call a reply (the first the model makes)

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs is not None:
            return ("logprobs" if self.logprobs else "top_logprobs"), "logprobs are not supported"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported (no JSON or schema mode)"
        return _tool_choice_refusal(self.tool_choice) or super().unsupported()


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs is not None:  # 0 asks for the sampled tokens' logprobs
            return "logprobs", "logprobs are not supported"
        for name in ("echo", "suffix"):  # an empty suffix is no suffix
            if getattr(self, name):
                return name, f"{name} is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return super().unsupported()


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None  # as in chat: 'none' renders no tools
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # as in chat: the count is the prompt chat would send

    def unsupported(self) -> tuple[str, str] | None:
        return _tool_choice_refusal(self.tool_choice)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
