"""One step's residency decisions: what the scheduler gets from the pressure policy, once, before it fills
the batch.

The policy (residency/policies.py) looks at the running and waiting requests at the start of a step and
returns a `ResidencyPlan`: the requests to bring back to the GPU now, the ordered room-making actions for
running requests whose next chunk lacks pages, the demotions offered to let a waiting request start, and
whether the pages this step completes are mirrored to host after the forward. The scheduler then fills the batch
without asking again: it carries out the plan's actions only as far as pages are actually short (an
action frees what the pools say it frees, shared prefix pages included), in the plan's order. The
mechanism that moves pages (residency/manager.py, mirroring, swapping) never tests which policy made the
plan. The orders under pressure are iterables the policy computes when first taken (from the state then):
a step without pressure pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import NamedTuple

from residency.interfaces import PagedRequest


class RoomKind(Enum):
    DEMOTE = auto()  # drop the request's mirrored GPU pages, lease it a hot buffer (it keeps running)
    AWAIT_MIRRORS = auto()  # wait for host copies in flight: their pages become demotable
    SWAP_OUT = auto()  # move the request to host whole (it resumes later); preempt when the host is full
    PREEMPT = auto()  # drop the request's pages; it recomputes later


class RoomAction(NamedTuple):
    kind: RoomKind
    request: PagedRequest | None = None  # None for AWAIT_MIRRORS


@dataclass
class ResidencyPlan:
    """A step's residency decisions, made by the policy before any page of the step is allocated."""

    promote: list[PagedRequest] = field(default_factory=list)
    """Requests whose host-only pages come back to the GPU at the start of the step, in order."""
    make_room: Iterable[RoomAction] = ()
    """Taken in order while a running request's next chunk lacks pages (stale ones skipped)."""
    admit_room: Iterable[PagedRequest] = ()
    """Running requests whose demotion may admit a waiting one: all of them together must cover the waiting
    request's whole prompt, or none is demoted for it."""
    mirror: bool = False
    """Copy the pages the step completes to host after the forward (demotion then needs no copy)."""
