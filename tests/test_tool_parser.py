"""The GLM tool-call parser on output a model may write: its arguments are strict JSON, its names are names."""

from __future__ import annotations

import json
import re

import pytest

from app import reasoning_parser, tool_parser
from app.tool_parser import ToolCall, ToolCallStreamParser, parse_tool_calls
from engine.tokenizer import MARKUP_TOKENS


def call_text(name: str, value: str) -> str:
    return f"<tool_call>{name}\n<arg_key>a</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"


def streamed(text: str, step: int = 5) -> list[str | ToolCall]:
    parser, events = ToolCallStreamParser(), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    return events + parser.finish()


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "raw", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[1, NaN]", '{"x": 1e400}', DEEP, "1" * 5000]
)
def test_values_that_are_not_strict_json_stay_strings(raw: str) -> None:
    content, calls = parse_tool_calls(call_text("f", raw))
    assert content == "" and calls == [ToolCall("f", {"a": raw})]
    assert json.loads(calls[0].arguments_json()) == {"a": raw}


def test_finite_json_values_are_parsed() -> None:
    _, calls = parse_tool_calls(call_text("f", '{"x": [1.5, -2e3, 0, null, true]}'))
    assert calls == [ToolCall("f", {"a": {"x": [1.5, -2000.0, 0, None, True]}})]
    assert calls[0].arguments_json() == '{"a": {"x": [1.5, -2000.0, 0, null, true]}}'


def test_arguments_json_refuses_non_finite_numbers() -> None:
    with pytest.raises(ValueError):
        ToolCall("f", {"a": float("nan")}).arguments_json()


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>f<tool_call>g</tool_call>",
        "<tool_call>get weather\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "<tool_call>f<br></tool_call>",
        f"<tool_call>{'f' * 257}</tool_call>",
        "<tool_call>\n</tool_call>",
    ],
)
def test_text_that_names_no_function_stays_content(text: str) -> None:
    assert parse_tool_calls(f"ok {text}") == (f"ok {text}", [])
    assert "".join(e for e in streamed(f"ok {text}") if isinstance(e, str)) == f"ok {text}"
    assert not any(isinstance(e, ToolCall) for e in streamed(f"ok {text}"))


@pytest.mark.parametrize("name", ["get_weather", "get-weather2", "mcp__github__create_issue", "browser.search",
                                  "server:tool", "files/read", "查询天气", "f" * 256])
def test_function_names_are_accepted(name: str) -> None:
    assert parse_tool_calls(call_text(name, "1")) == ("", [ToolCall(name, {"a": 1})])
    assert [e for e in streamed(call_text(name, "1")) if isinstance(e, ToolCall)] == [ToolCall(name, {"a": 1})]


def test_a_bad_call_leaves_the_next_one_intact() -> None:
    text = "<tool_call>f g</tool_call>" + call_text("h", "NaN")
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>f g</tool_call>" and calls == [ToolCall("h", {"a": "NaN"})]


WHITESPACE_CASES = [
    ("Let me check.\n" + call_text("f", "1") + "\n", "Let me check.", 1),
    ("\n\n" + call_text("f", "1") + "\n" + call_text("g", "2") + " \n", "", 2),
    (call_text("f", "1") + "\nDone.\n", "\nDone.", 1),  # text after a call keeps its opening newline
    ("ok \n<tool_call>f g</tool_call> \n", "ok \n<tool_call>f g</tool_call> \n", 0),  # no call: all content
    ("ok \n<tool_call>f\n<arg_key>a</arg_key>", "ok \n<tool_call>f\n<arg_key>a</arg_key>", 0),  # unclosed
    ("  Sure \n\n", "  Sure \n\n", 0),
]


@pytest.mark.parametrize(("text", "content", "num_calls"), WHITESPACE_CASES)
def test_streamed_and_whole_outputs_agree_on_whitespace_around_calls(text: str, content: str, num_calls: int) -> None:
    """Whitespace before a call or after the last one is not content, streamed or not (the whole output stripped
    its content when it had calls, a stream sent that whitespace as it came)."""
    assert parse_tool_calls(text)[0] == content and len(parse_tool_calls(text)[1]) == num_calls
    for step in range(1, 12):
        events = streamed(text, step)
        assert "".join(e for e in events if isinstance(e, str)) == content
        assert sum(isinstance(e, ToolCall) for e in events) == num_calls


def test_the_parsers_tags_stay_in_text_when_special_tokens_are_skipped() -> None:
    """The engine keeps `MARKUP_TOKENS` in the text whatever a checkpoint flags special; every tag the reasoning and
    tool-call parsers read must be among them, or skipping special tokens would hide a call from its parser."""
    tags = {reasoning_parser.OPEN, reasoning_parser.CLOSE, tool_parser.OPEN, tool_parser.CLOSE,
            *re.findall(r"</?\w+>", tool_parser._ARGUMENT.pattern)}
    assert len(tags) == 8 and tags <= set(MARKUP_TOKENS)
