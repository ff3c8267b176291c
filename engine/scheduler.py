"""Continuous batching with chunked prefill.

Each step spends a token budget (`max_num_batched_tokens`): first on running
requests in admission order (one token for a decode, a chunk for an unfinished
prefill), then on admitting waiting requests while `max_num_seqs` allows. When a
running request cannot get its pages, the pressure policy frees pages (the
default preempts the most recently admitted request, which recomputes later).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise ValueError("scheduler limits must be positive")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last known token (so a token is sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class PressurePolicy(Protocol):
    """Frees pages when a running request cannot grow."""

    def make_room(self, scheduler: "Scheduler", needed: int, requester: Request) -> bool:
        """Frees pages towards `needed`; False when it could do nothing (`requester` must wait)."""
        ...


class PreemptPolicy:
    """Preempt the most recently admitted running request; it recomputes when readmitted."""

    def make_room(self, scheduler: "Scheduler", needed: int, requester: Request) -> bool:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        return victim is not requester


PRESSURE_POLICIES: dict[str, Callable[[], PressurePolicy]] = {"preempt": PreemptPolicy}


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: PressurePolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or PreemptPolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s", req.request_id)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Ends `req` in any state and frees its pages."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._grow(req, req.num_computed_tokens + num_new):
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
            elif req not in self.running:
                continue  # it was the one preempted; the list shifted
            else:
                break
        if self.num_preemptions == preempted_before:
            budget = self._admit(out, budget)
        return out

    def _grow(self, req: Request, num_tokens: int) -> bool:
        while not self.kv.allocate(req, num_tokens):
            needed = self.kv.pages_needed(req, num_tokens) - self.kv.num_available
            if not self.policy.make_room(self, needed, req):
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.match_prefix(req)
            req.num_computed_tokens = hit
            if req.num_preemptions == 0:
                req.num_cached_tokens = hit
            num_new = min(req.num_tokens - hit, budget)
            if not self.kv.allocate(req, hit + num_new):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def after_step(self, out: SchedulerOutput) -> None:
        """Advances computed counts and registers newly full pages in the prefix cache."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_pages(s.request)
