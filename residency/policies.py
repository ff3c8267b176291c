"""Pressure policies: what frees GPU pages when the next step does not fit.

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

from collections.abc import Callable
from typing import Any, Protocol

from residency.interfaces import PagedRequest
from residency.manager import ResidencyManager


class SchedulerView(Protocol):
    """The scheduler operations a policy may use."""

    running: list
    waiting: Any

    def preempt(self, req: PagedRequest) -> None: ...

    def swap_out(self, req: PagedRequest) -> bool: ...


class PressurePolicy(Protocol):
    def make_room(self, scheduler: SchedulerView, needed: int, requester: PagedRequest) -> bool:
        """Frees pages towards `needed`; False when `requester` must wait (it may have been preempted)."""
        ...

    def rebalance(self, scheduler: SchedulerView) -> None:
        """Runs before each step's scheduling: moves pages back when memory allows."""
        ...

    def admit_room(self, scheduler: SchedulerView, needed: int) -> bool:
        """Frees pages towards `needed` so a waiting request can start; True when enough were freed.
        Never parks or preempts: a running request is not traded for a waiting one."""
        ...


class PreemptPolicy:
    def make_room(self, scheduler: SchedulerView, needed: int, requester: PagedRequest) -> bool:
        victim = scheduler.running[-1]
        scheduler.preempt(victim)
        return victim is not requester

    def rebalance(self, scheduler: SchedulerView) -> None:
        return None

    def admit_room(self, scheduler: SchedulerView, needed: int) -> bool:
        return False


class HybridPolicy:
    def __init__(self, residency: ResidencyManager) -> None:
        self.residency = residency

    def make_room(self, scheduler: SchedulerView, needed: int, requester: PagedRequest) -> bool:
        freed = self._demote(scheduler, needed)
        if freed == 0:  # mirrors still in flight: waiting for them costs less than a recompute
            self.residency.mirroring.poll(wait=True)
            freed = self._demote(scheduler, needed)
        if freed > 0:
            return True
        return OffloadPolicy().make_room(scheduler, needed, requester)  # park the newest, else preempt

    def admit_room(self, scheduler: SchedulerView, needed: int) -> bool:
        """Demotes decoding requests (their prompts done, so only their decode rows pay misses) to
        let a waiting request start: this is where hybrid's concurrency comes from."""
        decoding = [r for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
        if sum(max(self.residency.demotion_gain(r), 0) for r in decoding) < needed:
            return False  # not enough to admit it: demote no one for nothing
        return self._demote(scheduler, needed, decoding) >= needed

    def _demote(self, scheduler: SchedulerView, needed: int, candidates: list | None = None) -> int:
        """Demotes decoding requests first, largest gain first: a demoted request still prefilling
        computes its remaining prompt through its hot buffer, a few rows a step while pages are short."""
        freed = 0
        pool = scheduler.running if candidates is None else candidates
        for req in sorted(pool, key=lambda r: (r.num_computed_tokens < r.num_prompt_tokens,
                                               -self.residency.demotion_gain(r))):
            if freed >= needed:
                break
            if self.residency.demotion_gain(req) > 0:
                freed += self.residency.demote(req)
        return freed

    def rebalance(self, scheduler: SchedulerView) -> None:
        if scheduler.waiting:  # requests are queued for pages: promoting now would be undone at once
            return
        cache = self.residency.gpu_cache
        reserve = int(self.residency.config.promote_free_fraction * cache.pool.num_pages)
        for req in scheduler.running:
            if self.residency.state(req) == "full" and req.hot is None:
                continue
            cost = self.residency.promotion_cost(req) - (len(req.hot.pages) if req.hot else 0)
            if cache.num_available - cost >= reserve:
                self.residency.promote(req)


class OffloadPolicy:
    def make_room(self, scheduler: SchedulerView, needed: int, requester: PagedRequest) -> bool:
        victim = scheduler.running[-1]
        if not scheduler.swap_out(victim):
            scheduler.preempt(victim)  # host pool full: fall back to recompute
        return victim is not requester

    def rebalance(self, scheduler: SchedulerView) -> None:
        return None

    def admit_room(self, scheduler: SchedulerView, needed: int) -> bool:
        return False


def make_policy(name: str, residency: ResidencyManager | None) -> PressurePolicy:
    factories: dict[str, Callable[[], PressurePolicy]] = {
        "off": PreemptPolicy,
        "preempt": PreemptPolicy,
        "hybrid": lambda: HybridPolicy(_need(residency, name)),
        "offload": lambda: OffloadPolicy(),
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(factories)}")
    return factories[name]()


def _need(residency: ResidencyManager | None, name: str) -> ResidencyManager:
    if residency is None:
        raise ValueError(f"policy {name!r} needs a host pool")
    return residency
