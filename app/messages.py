"""What the deployments send each other: plain dataclasses, pickled by Ray.

The ingress sends a `GenerateRequest` to a decode replica and reads back a
stream of `GenerateChunk`s; a refused request is one chunk carrying an HTTP
status and message, so the ingress can answer before it starts streaming. While
a request waits (for a prefill replica, in the engine's queue, in a long prefill)
the stream carries heartbeat chunks (`app.heartbeats`), which only the ingress sees.
A decode replica sends a `PrefillRequest` to a prefill replica and gets a
`disagg.host_tier.KVHandle` back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.actor import ActorHandle

from engine.llm_engine import RequestOutput
from engine.request import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # the ingress replica's actor: a decode replica ends the request once it is gone (a caller that dies cannot
    # cancel its call); None where no actor calls (tests, direct use)
    caller: ActorHandle | None = None


@dataclass(frozen=True)
class GenerateChunk:
    """One step's new text of a request, or the reason it was refused."""

    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error_status: int | None = None  # HTTP status of a refusal
    error_message: str = ""
    error_param: str | None = None  # the field at fault, in the engine's terms (`prompt`, `max_tokens`, ...)
    error_code: str | None = None  # OpenAI's error code, where one applies
    heartbeat: bool = False  # no text: the replica and its engine loop were running when it was sent

    @classmethod
    def of(cls, output: RequestOutput) -> GenerateChunk:
        return cls(
            text_delta=output.text_delta,
            finished=output.finished,
            finish_reason=output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            num_output_tokens=output.num_output_tokens,
        )

    @classmethod
    def alive(cls) -> GenerateChunk:
        return cls(heartbeat=True)

    @classmethod
    def refusal(cls, status: int, message: str) -> GenerateChunk:
        return cls(finished=True, error_status=status, error_message=message)

    @classmethod
    def invalid(cls, exc: InvalidRequestError) -> GenerateChunk:
        """The engine's refusal of a request, as a 400 naming the field at fault."""
        return cls(finished=True, error_status=400, error_message=str(exc), error_param=exc.param,
                   error_code=exc.code)


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    start_tokens: int  # the decode replica already holds the prefix up to here: not exported
