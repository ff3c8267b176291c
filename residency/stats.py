"""Residency counters: what resolves and page moves did, and requests by state over steps.

Filled by the mechanism (`ResidencyManager`) and the ranks' resolves; read by the
engine's `stats()` and from there by the replica's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResolveCounts:
    """What resolves did: selected rows of host-only pages found hot, or loaded (misses)."""

    hot_hits: int = 0
    hot_misses: int = 0  # one miss = one token's run of one IndexShare group copied host -> hot slot
    bytes_h2d: int = 0
    unresolved: int = 0  # selected host-only rows that found no hot slot (a lease sized too small: a bug)

    def __add__(self, other: ResolveCounts) -> ResolveCounts:
        return ResolveCounts(self.hot_hits + other.hot_hits, self.hot_misses + other.hot_misses,
                             self.bytes_h2d + other.bytes_h2d, self.unresolved + other.unresolved)


@dataclass
class ResidencyStats:
    pages_mirrored: int = 0
    pages_demoted: int = 0
    pages_promoted: int = 0
    pages_swapped_out: int = 0
    pages_swapped_in: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    hot_unresolved: int = 0  # selected host-only rows that found no hot slot and read a wrong row
    rows_copied_h2d: int = 0
    bytes_h2d: int = 0
    mirror_skipped_host_full: int = 0


@dataclass
class StateCounter:
    """Requests by state over steps: peak and mean of each."""

    totals: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def record(self, counts: dict[str, int]) -> None:
        self.steps += 1
        for state, n in counts.items():
            self.totals[state] = self.totals.get(state, 0) + n
            self.peaks[state] = max(self.peaks.get(state, 0), n)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            s: {"peak": self.peaks[s], "mean": round(self.totals[s] / max(self.steps, 1), 3)} for s in self.totals
        }
