"""Residency settings, named after vLLM's Hybrid HiSparse flags so settings carry over.

Also what each pressure policy asks of the residency mechanism (`PolicyTraits`):
the mechanism (page tables, mirroring, swapping, landing) reads these traits and
never tests a policy's name; the policies' decisions live in `residency.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyTraits:
    """What a pressure policy needs from the mechanism."""

    runs_from_host: bool = False  # a running request's pages may be host-only: selected rows load via a hot buffer
    mirrors_ahead: bool = False  # completed pages are copied to host as they complete, so demotion frees at once


POLICY_TRAITS = {
    "hybrid": PolicyTraits(runs_from_host=True, mirrors_ahead=True),
    "offload": PolicyTraits(),
    "preempt": PolicyTraits(),
    "off": PolicyTraits(),
}
POLICIES = tuple(POLICY_TRAITS)


@dataclass(frozen=True)
class HiSparseConfig:
    """How KV may leave the GPU under pressure, and how much host memory it may use."""

    policy: str = "off"  # hybrid | offload | preempt | off (no host tier)
    host_pool_gib: float = 0.0  # pinned host memory for mirrored / demoted / swapped pages
    hot_rows: int | None = None  # hot slots per demoted request; None = 2 x index_topk
    offload_pool_gib: float = 0.0  # separate host budget for indexer pages of waiting requests
    promote_free_fraction: float = 0.25  # re-promote only if this share of the GPU pool stays free

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.host_pool_gib < 0 or self.offload_pool_gib < 0:
            raise ValueError("host pool sizes must be non-negative")
        if self.policy in ("hybrid", "offload") and self.host_pool_gib <= 0:
            raise ValueError(f"policy {self.policy!r} needs host_pool_gib > 0")
        if self.hot_rows is not None and self.hot_rows <= 0:
            raise ValueError("hot_rows must be positive")
        if not 0.0 <= self.promote_free_fraction < 1.0:
            raise ValueError("promote_free_fraction must be in [0, 1)")

    @property
    def traits(self) -> PolicyTraits:
        return POLICY_TRAITS[self.policy]

    @property
    def uses_host(self) -> bool:
        return self.policy != "off" and self.host_pool_gib > 0

    def hot_rows_for(self, index_topk: int) -> int:
        """Hot slots per request: at least top-K, rounded up to whole 64-slot pages."""
        rows = self.hot_rows if self.hot_rows is not None else 2 * index_topk
        if rows < index_topk:
            raise ValueError(f"hot_rows ({rows}) must be at least index_topk ({index_topk})")
        return -(-rows // 64) * 64
