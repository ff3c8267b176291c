"""Pressure policies: what frees GPU pages when the next step does not fit, decided once per step as a
`ResidencyPlan` (residency/plan.py) that the scheduler carries out.

- `hybrid`: demote running requests whose completed pages are already mirrored
  (their GPU pages free at once, no copy on the critical path), lease them hot
  buffers, keep their tails; a waiting request that does not fit is admitted by
  demoting decoding requests the same way; when that is not enough, park the most recently
  admitted request (its mirrored pages stay on host, its tail and indexer pages
  follow within `offload_pool_gib`; it resumes with just those back on GPU), and
  preempt only when the host cannot take it. When pages
  are plentiful again, re-promote host-resident requests (resident pages cost no
  miss copies), but only while nothing waits for pages and a share of the pool
  stays free afterwards, so a promotion is not undone by the next admission.
- `offload`: move the most recently admitted request to host whole; it comes
  back whole before it runs again (dense-attention style swapping).
- `preempt` / `off`: drop the most recently admitted request; it recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from residency.manager import ResidencyManager
from residency.plan import ResidencyPlan, RoomAction, RoomKind


class SchedulerView(Protocol):
    """What a policy reads of the scheduler to plan a step."""

    running: list
    waiting: Any


class PressurePolicy(Protocol):
    def plan(self, scheduler: SchedulerView) -> ResidencyPlan:
        """The step's residency decisions, asked once at the start of each step (residency/plan.py)."""
        ...


def _newest_first(scheduler: SchedulerView, kind: RoomKind) -> Iterator[RoomAction]:
    """The most recently admitted request first, over the running list as it is when first needed."""
    for req in list(reversed(scheduler.running)):
        yield RoomAction(kind, req)


class PreemptPolicy:
    def plan(self, scheduler: SchedulerView) -> ResidencyPlan:
        return ResidencyPlan(make_room=_newest_first(scheduler, RoomKind.PREEMPT))


class OffloadPolicy:
    def plan(self, scheduler: SchedulerView) -> ResidencyPlan:
        return ResidencyPlan(make_room=_newest_first(scheduler, RoomKind.SWAP_OUT))


class HybridPolicy:
    def __init__(self, residency: ResidencyManager) -> None:
        self.residency = residency

    def plan(self, scheduler: SchedulerView) -> ResidencyPlan:
        """Promotions while pages are plentiful; under pressure demotions, then parking the newest; decoding
        requests offered to admit a waiting one; every completed page mirrored ahead."""
        return ResidencyPlan(promote=self._promotions(scheduler), make_room=self._make_room(scheduler),
                             admit_room=self._admission_offer(scheduler),
                             mirror=self.residency.config.traits.mirrors_ahead)

    def _make_room(self, scheduler: SchedulerView) -> Iterator[RoomAction]:
        """Demotions (largest gain first), again once the mirrors in flight land (waiting for them costs less
        than a recompute), then the newest request parked (preempted when the host cannot take it)."""
        for req in self._by_gain(scheduler.running):
            yield RoomAction(RoomKind.DEMOTE, req)
        yield RoomAction(RoomKind.AWAIT_MIRRORS)
        for req in self._by_gain(scheduler.running):
            yield RoomAction(RoomKind.DEMOTE, req)
        yield from _newest_first(scheduler, RoomKind.SWAP_OUT)

    def _admission_offer(self, scheduler: SchedulerView) -> Iterator:
        """Decoding requests (their prompts done, so only their decode rows pay misses), largest gain first:
        this is where hybrid's concurrency comes from."""
        yield from self._by_gain([r for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens])

    def _by_gain(self, requests: list) -> list:
        """Decoding requests first, largest gain first: a demoted request still prefilling computes its
        remaining prompt through its hot buffer, a few rows a step while pages are short."""
        return sorted(requests, key=lambda r: (r.num_computed_tokens < r.num_prompt_tokens,
                                               -self.residency.demotion_gain(r)))

    def _promotions(self, scheduler: SchedulerView) -> list:
        """Host-resident requests to re-promote: only while nothing waits for pages (a promotion would be
        undone by the next admission) and a share of the pool stays free afterwards."""
        if scheduler.waiting:
            return []
        reserve = int(self.residency.config.promote_free_fraction * self.residency.gpu_cache.pool.num_pages)
        available = self.residency.gpu_cache.num_available
        promote = []
        for req in scheduler.running:
            if self.residency.state(req) == "full" and req.hot is None:
                continue
            cost = self.residency.promotion_cost(req) - (len(req.hot.pages) if req.hot else 0)
            if available - cost >= reserve:
                promote.append(req)
                available -= cost
        return promote


def make_policy(name: str, residency: ResidencyManager | None) -> PressurePolicy:
    factories: dict[str, Callable[[], PressurePolicy]] = {
        "off": PreemptPolicy,
        "preempt": PreemptPolicy,
        "hybrid": lambda: HybridPolicy(_need(residency, name)),
        "offload": OffloadPolicy,
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(factories)}")
    return factories[name]()


def _need(residency: ResidencyManager | None, name: str) -> ResidencyManager:
    if residency is None:
        raise ValueError(f"policy {name!r} needs a host pool")
    return residency
