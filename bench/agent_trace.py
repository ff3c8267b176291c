"""The agent workload both agent benchmarks replay: vLLM's published GLM-5.3 agent runs (OpenHands traces).

A conversation has 13 turns; the first turn's prompt is 74,160 tokens, each later turn adds 753 new
prompt tokens to the conversation so far, and every turn generates 220 tokens. `TurnLengths.scaled`
multiplies every count by one factor, so a smaller machine (or the CPU) runs the same shape of work;
callers scale their memory pools by the same factor to keep the pressure GLM-5.3 meets on 8x H200.
`bench/policies.py` drives it against the engine directly, `bench/agent_http.py` through the HTTP API.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_TURN, LATER_TURN, OUTPUT = 74160, 753, 220
TURNS = 13
MIN_OUTPUT = 16  # below this a turn's time per output token is mostly its first token's


@dataclass(frozen=True)
class TurnLengths:
    """Token counts of one conversation's turns at some scale."""

    first_prompt: int
    """Prompt tokens of the first turn."""
    later_prompt: int
    """New prompt tokens each later turn adds (the conversation so far comes before them)."""
    output: int
    """Generated tokens per turn."""

    @classmethod
    def scaled(cls, scale: float) -> TurnLengths:
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        return cls(max(1, round(FIRST_TURN * scale)), max(1, round(LATER_TURN * scale)),
                    max(MIN_OUTPUT, round(OUTPUT * scale)))

    def new_prompt_tokens(self, turn: int) -> int:
        """Prompt tokens turn `turn` (0-based) adds to the conversation."""
        return self.first_prompt if turn == 0 else self.later_prompt
