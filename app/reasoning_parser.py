"""GLM reasoning: a reply may open with `<think>...</think>`; OpenAI-style APIs return that part as
`reasoning_content`, apart from `content`.

The reasoning block counts only at the start of the reply (leading whitespace
allowed); a `<think>` later in the text is content. The streaming parser holds
back text that could still be the start of either tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning is None when the reply has no think block.
    An unclosed block is all reasoning (the reply stopped while thinking)."""
    stripped = text.lstrip()
    if not stripped.startswith(OPEN):
        return None, text
    body = stripped[len(OPEN) :]
    end = body.find(CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(CLOSE) :].lstrip("\n")


class ReasoningStreamParser:
    """Turns text deltas into ("reasoning" | "content", text) events, in order."""

    def __init__(self) -> None:
        self._held = ""
        self._state = "start"  # start -> reasoning -> after_think -> content, or start -> content

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._held += delta
        if self._state == "start":
            stripped = self._held.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):  # still could be the opening tag
                return []
            if stripped.startswith(OPEN):
                self._held, self._state = stripped[len(OPEN) :], "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._held.find(CLOSE)
            if end >= 0:
                reasoning, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                self._state = "after_think"
                return [e for e in [("reasoning", reasoning), *self._content()] if e[1]]
            keep = _partial_tail(self._held, CLOSE)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            return [("reasoning", out)] if out else []
        return self._content()

    def _content(self) -> list[tuple[str, str]]:
        if self._state == "after_think":  # newlines right after the block separate it; drop them
            self._held = self._held.lstrip("\n")
            if not self._held:
                return []
            self._state = "content"
        out = self._take_all()
        return [("content", out)] if out else []

    def finish(self) -> list[tuple[str, str]]:
        """Releases held text at the end of the reply."""
        kind = "reasoning" if self._state == "reasoning" else "content"
        rest = self._take_all()
        return [(kind, rest)] if rest else []

    def _take_all(self) -> str:
        out, self._held = self._held, ""
        return out


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
