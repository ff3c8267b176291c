"""The driver's account of speculative decoding: how many drafts were verified and accepted.

The step itself lives with the ranks (engine/rank/speculative.py); the engine's step loop
(`LLMEngine._speculative_step`) appends each request's accepted tokens and keeps its new drafts. The
counts are the ones vLLM reports for speculative decoding (`spec_decode_*`), so the same dashboards
read them: drafts (requests that verified at least one draft token), draft tokens, accepted tokens and
accepted tokens per draft position; the mean acceptance length is 1 + accepted / drafts (the tokens a
verifying step yields for one request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    """Running totals since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafts: int, accepted: int) -> None:
        """One request's verification: `drafts` draft tokens, the first `accepted` of them accepted."""
        if drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafts:
            self.accepted_per_position += [0] * (drafts - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        }
