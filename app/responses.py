"""OpenAI response bodies and server-sent events, built from the decode replica's chunks.

`collect_*` build the body of a non-streaming response from all chunks;
`stream_*` turn the chunks into SSE lines (`data: {...}` ... `data: [DONE]`).
With tools, generated text goes through the GLM tool-call parser: calls become
`tool_calls` (whole in one delta when streaming, once `</tool_call>` closes them)
and the finish reason is `tool_calls`. A refusal that arrives mid-stream (the
engine died) is sent as an error event before `[DONE]`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.errors import error_body
from app.messages import GenerateChunk
from app.reasoning_parser import ReasoningStreamParser, split_reasoning
from app.tool_parser import ToolCall, ToolCallStreamParser, parse_tool_calls


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    request_id: str
    model: str
    created: int
    parse_tools: bool = False
    include_usage: bool = False
    max_tool_calls: int | None = None  # 1 when the request turned parallel tool calls off


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(chunk: GenerateChunk) -> dict[str, Any]:
    return {
        "prompt_tokens": chunk.num_prompt_tokens,
        "completion_tokens": chunk.num_output_tokens,
        "total_tokens": chunk.num_prompt_tokens + chunk.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": chunk.num_cached_tokens},
    }


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }
    return body if index is None else {"index": index, **body}


def _finish_reason(chunk: GenerateChunk, num_calls: int) -> str | None:
    if num_calls and chunk.finish_reason == "stop":
        return "tool_calls"
    return chunk.finish_reason


def collect_chat(meta: ResponseMeta, chunks: list[GenerateChunk]) -> dict[str, Any]:
    text, last = "".join(c.text_delta for c in chunks), chunks[-1]
    reasoning, text = split_reasoning(text)
    content, calls = parse_tool_calls(text) if meta.parse_tools else (text, [])
    calls = calls[: meta.max_tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:  # a block cut off right after `<think>` has no reasoning to show, streamed or not
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_tool_call(c) for c in calls]
    return {
        "id": meta.request_id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": _finish_reason(last, len(calls)), "logprobs": None}
        ],
        "usage": usage(last),
    }


def collect_completion(meta: ResponseMeta, chunks: list[GenerateChunk]) -> dict[str, Any]:
    last = chunks[-1]
    return {
        "id": meta.request_id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "text": "".join(c.text_delta for c in chunks),
                     "finish_reason": last.finish_reason, "logprobs": None}],
        "usage": usage(last),
    }


def _chat_chunk(meta: ResponseMeta, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": meta.request_id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


async def stream_chat(meta: ResponseMeta, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    parser = ToolCallStreamParser() if meta.parse_tools else None
    thinking = ReasoningStreamParser()
    num_calls = 0
    yield sse(_chat_chunk(meta, {"role": "assistant", "content": ""}))
    async for chunk in chunks:
        if chunk.error_status is not None:
            yield sse(error_body(chunk.error_status, chunk.error_message))
            break
        split = thinking.feed(chunk.text_delta) + (thinking.finish() if chunk.finished else [])
        for _, reasoning in (e for e in split if e[0] == "reasoning"):
            yield sse(_chat_chunk(meta, {"reasoning_content": reasoning}))
        text = "".join(t for kind, t in split if kind == "content")
        events: list[str | ToolCall] = [text] if parser is None else parser.feed(text)
        if chunk.finished and parser is not None:
            events += parser.finish()
        for event in events:
            if isinstance(event, ToolCall):
                if meta.max_tool_calls is not None and num_calls >= meta.max_tool_calls:
                    continue  # a call past the one the request allows is dropped, as the whole reply drops it
                yield sse(_chat_chunk(meta, {"tool_calls": [_tool_call(event, num_calls)]}))
                num_calls += 1
            elif event:
                yield sse(_chat_chunk(meta, {"content": event}))
        if chunk.finished:
            yield sse(_chat_chunk(meta, {}, _finish_reason(chunk, num_calls)))
            if meta.include_usage:
                yield sse({**_chat_chunk(meta, {}), "choices": [], "usage": usage(chunk)})
    yield sse("[DONE]")


async def stream_completion(meta: ResponseMeta, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    async for chunk in chunks:
        if chunk.error_status is not None:
            yield sse(error_body(chunk.error_status, chunk.error_message))
            break
        body = {
            "id": meta.request_id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": chunk.text_delta, "finish_reason": chunk.finish_reason, "logprobs": None}],
        }
        if chunk.text_delta or chunk.finished:
            yield sse(body)
        if chunk.finished and meta.include_usage:
            yield sse({**body, "choices": [], "usage": usage(chunk)})
    yield sse("[DONE]")
