"""Continuous batching with chunked prefill.

Each step spends a token budget (`max_num_batched_tokens`): first on running
requests in admission order (one token for a decode, a chunk for an unfinished
prefill), then on admitting waiting requests while `max_num_seqs` allows. The
pressure policy is asked once, at the start of the step, for the step's
`ResidencyPlan` (residency/plan.py): promotions, carried out at once; the
ordered actions that free pages when a running request cannot get its pages
(the default preempts the most recently admitted request, which recomputes
later); the demotions offered to admit a waiting request; whether the step's
rows are mirrored to host. Filling the batch then only carries out that plan,
as far as pages are actually short.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from residency.mirroring import align
from residency.plan import ResidencyPlan, RoomAction, RoomKind
from residency.policies import PreemptPolicy, PressurePolicy

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
        """Whether this chunk reaches the request's last known token and its drafts (so tokens are sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_step_tokens

    @property
    def num_drafts(self) -> int:
        """Draft rows this chunk verifies."""
        return len(self.request.draft_token_ids) if self.completes else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    mirror: bool = False  # the plan's: copy the pages the step completes to host after the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: PressurePolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or PreemptPolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_swaps = 0
        self._room: Iterator[RoomAction] = iter(())  # the step's plan: room-making actions not yet taken
        self._offer: Iterable[Request] = ()  # the step's plan: requests offered for demotion to admit
        self._offered: list[Request] | None = None  # that offer, ordered when first needed

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def swap_out(self, req: Request) -> bool:
        """Moves `req` to host whole (offload policy); False when the host tier cannot take it."""
        if self.kv.residency is None or not self.kv.residency.swapping.swap_out(req):
            return False
        self.running.remove(req)
        req.status = RequestStatus.SWAPPED
        self.swapped.append(req)
        self.num_swaps += 1
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s", req.request_id)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Ends `req` in any state and frees its pages."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.num_pending_tokens = 0  # a running step's token for it is discarded

    def _done_by_length(self, req: Request) -> bool:
        """Its last token is sampled (pending: asynchronous scheduling); it ends when that is read."""
        outputs = len(req.output_token_ids) + req.num_pending_tokens
        return outputs >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len

    def schedule(self) -> SchedulerOutput:
        plan = self.policy.plan(self)  # the step's one residency decision point
        out = SchedulerOutput(mirror=plan.mirror)
        self._start(plan)
        budget = self.config.max_num_batched_tokens
        pressure_before = self.num_preemptions + self.num_swaps
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._done_by_length(req):
                i += 1
                continue
            num_new = self._chunk(req, budget)
            if self._grow(req, req.num_computed_tokens + num_new):
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
            elif req not in self.running:
                continue  # it was the one preempted; the list shifted
            else:
                break
        if self.num_preemptions + self.num_swaps == pressure_before:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                budget = self._admit(out, budget)
        for s in out.scheduled:  # making room may have demoted a request after its chunk was sized
            s.num_new_tokens = self._chunk(s.request, s.num_new_tokens)
            if s.request.hot is not None:  # the resolve reads a host entry (maybe none yet) for every page
                align(s.request)
        return out

    @property
    def max_chunk_tokens(self) -> int:
        """A prefill chunk takes at most a quarter of the pool in new MLA pages, so a small pool
        under a long prompt makes progress instead of waiting for pages it can never have."""
        return max(1, self.kv.pool.num_pages // 4) * self.kv.page_size

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens `req` computes this step: a request with host-only pages takes the rows whose
        misses its hot buffer holds at once (its buffer is sized for the step first). Drafts that do not
        fit with the last known token are dropped (verified in part, they would sample nothing)."""
        num_new = min(req.num_step_tokens - req.num_computed_tokens, budget, self.max_chunk_tokens)
        if req.hot is not None:
            spare = self.kv.num_available - self.kv.pages_needed(req, req.num_computed_tokens + num_new)
            self.kv.residency.hot.size_for(req, num_new, spare)
            num_new = min(num_new, self.kv.residency.hot.rows_per_step(req))
        if req.draft_token_ids and req.num_computed_tokens + num_new < req.num_step_tokens:
            del req.draft_token_ids[max(req.num_computed_tokens + num_new - req.num_tokens, 0) :]
        return num_new

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Resumes swapped (offload) or parked (hybrid) requests, oldest first, while pages allow."""
        residency = self.kv.residency
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if self._done_by_length(req):
                break
            num_new = min(req.num_step_tokens - req.num_computed_tokens, budget)
            total = req.num_computed_tokens + num_new
            growth = max(-(-total // self.kv.page_size) - len(req.mla_pages), 0)
            growth += max(-(-total // self.kv.indexer_page_tokens) - len(req.host_indexer_pages), 0)
            swapping = residency.swapping
            if swapping.swap_in_cost(req) + growth > self.kv.num_available or not swapping.swap_in(req):
                break
            self.swapped.popleft()
            if not self.kv.allocate(req, total):
                raise RuntimeError("pages checked available before swap-in were not")
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = self._chunk(req, num_new)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def _start(self, plan: ResidencyPlan) -> None:
        """Carries out the plan's promotions and keeps the rest for when pages run short."""
        for req in plan.promote:
            self.kv.residency.promote(req)
        self._room = iter(plan.make_room)
        self._offer, self._offered = plan.admit_room, None

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for `req`'s next chunk, taking the plan's room-making actions in order while they are short;
        False when `req` must wait (the actions ran out, or it was the one that gave way)."""
        while not self.kv.allocate(req, num_tokens):
            action = next(self._room, None)
            if action is None or not self._make_room(action, req):
                return False
        return True

    def _make_room(self, action: RoomAction, requester: Request) -> bool:
        """Carries out one action (skipped for a request gone earlier in the step); False when it removed
        `requester`."""
        victim = action.request
        if action.kind is RoomKind.AWAIT_MIRRORS:
            self.kv.residency.mirroring.poll(wait=True)
            return True
        if victim not in self.running:
            return True
        if action.kind is RoomKind.DEMOTE:
            self.kv.residency.demote(victim)
            return True
        if action.kind is not RoomKind.SWAP_OUT or not self.swap_out(victim):
            self.preempt(victim)  # swapping falls back to recompute when the host pool is full
        return victim is not requester

    def _admit_pages(self, req: Request, num_tokens: int) -> bool:
        """Pages for a waiting request's first chunk. When they are short, the plan's offered demotions may
        free pages (never preemption), but only enough for the whole prompt: a request admitted with room for
        its first chunk alone would take its later chunks from requests still prefilling."""
        if self.kv.allocate(req, num_tokens):
            return True
        needed = self.kv.pages_needed(req, req.num_tokens) - self.kv.num_available
        return self._admission_room(needed) and self.kv.allocate(req, num_tokens)

    def _admission_room(self, needed: int) -> bool:
        """Demotes the plan's offered requests towards `needed`, largest offer first, only if together they
        can free it (a demotion that cannot admit anyone only costs misses)."""
        if self._offered is None:
            self._offered = list(self._offer)
        residency = self.kv.residency
        offered = [r for r in self._offered if r in self.running]
        if not offered or sum(max(residency.demotion_gain(r), 0) for r in offered) < needed:
            return False
        freed = 0
        for req in offered:
            if freed >= needed:
                break
            freed += residency.demote(req)
        return freed >= needed

    def _try_admit(self, req: Request, budget: int) -> int | None:
        """Matches `req`'s cached prefix and takes the pages of its first chunk: the chunk's token count, or None
        when it must wait.

        A request whose own cached prefix leaves no room for the rest of its prompt, with nothing running or
        swapped that could free pages, is admitted without the prefix and computes it again. It had waited for
        good, its prefix's pages taken and given back every step (a prefix landed from a prefill replica that
        filled a `hybrid` pool).
        """
        for reuse in (True, False):
            hit = self.kv.match_prefix(req, reuse)
            req.num_computed_tokens = hit
            if req.num_preemptions == 0:
                req.num_cached_tokens = hit
            num_new = self._chunk(req, budget)
            if self._admit_pages(req, hit + num_new):
                return num_new
            self.kv.free(req)
            req.num_computed_tokens = 0
            if not hit or self.running or self.swapped:
                return None
        return None

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._done_by_length(req):
                break
            num_new = self._try_admit(req, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def after_step(self, out: SchedulerOutput) -> None:
        """Advances computed counts, registers newly full pages, mirrors them when residency asks."""
        self.advance(out)
        self.settle(out, {})

    def advance(self, out: SchedulerOutput) -> None:
        """Counts every scheduled row as computed once the step is launched. A speculative step's rows are
        counted as if the target accepted every draft; `settle` takes the rejected ones back."""
        for s in out.scheduled:
            if not s.request.is_finished:
                s.request.num_computed_tokens += s.num_new_tokens

    def settle(self, out: SchedulerOutput, rejected: dict[str, int], later_rows: dict[str, int] | None = None
               ) -> None:
        """Once a launched step's tokens are read: takes back the draft rows the target rejected (request id
        -> rows; the pages past the tokens held are released), registers newly full pages and mirrors the
        kept rows when residency asks. `later_rows`: rows a later step, already launched, counted for a
        request (speculative steps continued before this one was read)."""
        later_rows = later_rows or {}
        kept: list[tuple[Request, int, int]] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            dropped = rejected.get(req.request_id, 0)
            req.num_computed_tokens -= dropped
            if dropped:
                self.kv.trim(req, req.num_tokens)
            self.kv.cache_full_pages(req)
            end = req.num_computed_tokens - later_rows.get(req.request_id, 0)
            kept.append((req, end - (s.num_new_tokens - dropped), end))
        if out.mirror:
            self.kv.residency.mirroring.mirror_step(kept)
