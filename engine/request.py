"""A request's sampling parameters and its lifecycle state inside the engine.

Created by the engine from a validated submission; mutated only by the
scheduler (tokens computed, pages held, status) and the output processor
(generated tokens, finish reason).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from residency.hot_buffer import HotLease


# Temperatures below this sample greedily: the distribution is one-hot to float32 precision there, and
# dividing by a subnormal temperature overflows (vLLM uses the same bound).
MIN_TEMPERATURE = 1e-5
# The largest top_k or token id a request may name: the sampler packs them into int64 tensors (a top_k past the
# vocabulary means no cut, so no real bound is lost).
MAX_TOKEN_ID = 2**31 - 1
# Stands for a token a running step has sampled and the host has not read yet (asynchronous scheduling).
PENDING = -1


class InvalidRequestError(ValueError):
    """A submission the engine refuses; the message is meant for the client.

    `param` names the request field at fault in the engine's terms (`prompt`, `max_tokens`, a sampling field) and
    `code` is OpenAI's error code where one applies (`context_length_exceeded`), so an agent that trims its history
    on that code does so whichever layer refused the request.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end the output like EOS (kept in token_ids, not in text), ignore_eos or not
    skip_special_tokens: bool = True  # role headers and end-of-text tokens stay out of the text (GLM markup stays)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOKEN_ID:
            raise InvalidRequestError(f"top_k must be an integer in [0, {MAX_TOKEN_ID}], got {self.top_k!r}", "top_k")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID}], got "
                                      f"{self.stop_token_ids!r}", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        """Whether the most probable token is taken; a near-zero temperature means the same."""
        return self.temperature < MIN_TEMPERATURE


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # moved to host whole by the offload policy
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # processing this request failed; the engine ended it alone


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at last admission
    mla_pages: list[int | None] = field(default_factory=list)  # GPU page per 64 tokens, None if host-only
    indexer_pages: list[int] = field(default_factory=list)
    host_pages: list[int | None] = field(default_factory=list)  # host copy of each MLA page, if any
    host_indexer_pages: list[int | None] = field(default_factory=list)
    hot: HotLease | None = None  # hot rows while some pages are host-only
    page_hashes: list[bytes] = field(default_factory=list)
    # MLA pages below this index were registered for reuse (kv_cache_manager.py), host-only ones once back
    num_registered_pages: int = 0
    num_pending_tokens: int = 0  # sampled by a step still running (asynchronous scheduling), ids not yet read
    # smallest page index whose MLA / host page entry changed other than by appending since the rows were last
    # sent to the ranks (engine/page_tables.py sends them from there); 0 also covers the indexer pages
    tables_dirty_from: int = 0
    num_preemptions: int = 0
    # speculative decoding: tokens the MTP layer proposed for the positions after the last known one, which
    # the next step computes (and the target verifies) beside that token
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        """Every token, with `PENDING` for each sampled one not yet read back."""
        return self.prompt_token_ids + self.output_token_ids + [PENDING] * self.num_pending_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole sequence (a decode step reads one); `PENDING`
        past the known ones."""
        n, known = len(self.prompt_token_ids), self.num_known_tokens
        if start >= n:
            out = self.output_token_ids[start - n : end - n]
        elif end <= n:
            out = self.prompt_token_ids[start:end]
        else:
            out = self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
        return out + [PENDING] * (min(end, self.num_tokens) - max(start, known))

    def step_token_ids(self, start: int, end: int) -> list[int]:
        """The input ids of positions [start, end): known (or pending) tokens, then drafts."""
        known = self.token_ids(start, min(end, self.num_tokens))
        first_draft = max(start, self.num_tokens) - self.num_tokens
        return known + self.draft_token_ids[first_draft : end - self.num_tokens]

    @property
    def num_step_tokens(self) -> int:
        """Positions a step may compute up to: the tokens held and the drafts after them."""
        return self.num_tokens + len(self.draft_token_ids)

    def pages_replaced_from(self, index: int) -> None:
        """GPU pages from `index` on were replaced (promoted, swapped in, reattached): they register again."""
        self.num_registered_pages = min(self.num_registered_pages, index)
        self.pages_changed_at(index)

    def pages_changed_at(self, index: int) -> None:
        """MLA or host page entries from `index` on changed other than by appending (0: any page list, the
        indexer's too); the ranks get the rows again from there."""
        self.tables_dirty_from = min(self.tables_dirty_from, index)

    @property
    def num_tokens(self) -> int:
        """Tokens the request holds, those sampled by a step still running included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: the prompt and the outputs read back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_positions(self) -> int:
        """Output tokens sampled so far, pending ones included: the draw position of the next."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
