"""Reasoning split: `<think>...</think>` at the start of a reply becomes `reasoning_content`."""

from __future__ import annotations

import random

import pytest

from app.reasoning_parser import ReasoningStreamParser, split_reasoning

CASES = [
    ("<think>plan the call</think>\nThe answer is 4.", "plan the call", "The answer is 4."),
    ("  <think>a</think>b", "a", "b"),
    ("<think>still thinking when max_tokens hit", "still thinking when max_tokens hit", ""),
    ("no think block here <think>x</think>", None, "no think block here <think>x</think>"),
    ("<thin", None, "<thin"),
    ("<think>", "", ""),  # max_tokens right after the opening tag: nothing of it is content
    (" \n<think>", "", ""),
    ("", None, ""),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_split_reasoning(text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_stream_parser_equals_whole_split_for_any_chunking(text: str, reasoning: str | None, content: str) -> None:
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = ReasoningStreamParser()
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        got_reasoning = "".join(t for kind, t in events if kind == "reasoning")
        got_content = "".join(t for kind, t in events if kind == "content")
        assert got_reasoning == (reasoning or "")
        assert got_content == content
        kinds = [kind for kind, _ in events]
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # reasoning never after content
