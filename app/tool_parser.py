"""GLM tool calls in generated text, parsed into OpenAI tool calls: whole, or as the text streams.

A call is `<tool_call>NAME`, then per argument `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>`, then `</tool_call>`; several calls may follow each
other. Values are JSON when they parse as strict JSON (finite numbers, nesting the
parser can follow), else raw strings, so `arguments` is always valid JSON. A call that
does not close (the output hit its length limit), or whose name is not a function name
(it holds spaces or markup), stays text.

`parse_tool_calls` splits a finished output into content and calls.
`ToolCallStreamParser` does the same for a stream of text deltas: text before a
call is released at once, except a tail that may be the start of `<tool_call>`
and trailing whitespace (not content if a call follows); from `<tool_call>` on,
nothing is released until `</tool_call>` closes the call, which then comes out
whole. One parser per streamed response.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# A name a request may give a tool (1 to 256 characters): word characters, with the `.`, `:`, `/` and `-`
# that namespaced tool names use. Whitespace, markup and JSON punctuation mean the text is not a call.
_NAME = re.compile(r"[\w.:/-]{1,256}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        """Arguments as OpenAI sends them: a JSON object in a string."""
        return json.dumps(self.arguments, ensure_ascii=False, allow_nan=False)


def _finite(number: str) -> float:
    """A JSON number as a float; NaN, Infinity and overflowing numbers have no strict JSON form."""
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is not a finite number")
    return value


def _value(raw: str) -> Any:
    """`raw` as JSON when it reads as strict JSON, else the raw string.

    Reading fails with ValueError (bad JSON, a non-finite number, an integer too long to convert) or,
    for deep nesting, RecursionError; either way the model's text is kept as it is.
    """
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_finite)
    except (ValueError, RecursionError):
        return raw


def parse_call(body: str) -> ToolCall | None:
    """The call inside `<tool_call>...</tool_call>`; None when what it names is not a function name."""
    name = body.split("<arg_key>", 1)[0].strip()
    if not _NAME.fullmatch(name):
        return None
    return ToolCall(name, {key.strip(): _value(value) for key, value in _ARGUMENT.findall(body)})


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the calls, the calls) of a finished output: what the stream parser sends, joined."""
    parser = ToolCallStreamParser()
    events = parser.feed(text) + parser.finish()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


def _partial_open_len(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class ToolCallStreamParser:
    """Turns text deltas into content deltas and whole tool calls, in order.

    Whitespace right before a call and at the end of an output that made calls is not content (the newline a
    model writes before `<tool_call>`): trailing whitespace is held back until text follows it.
    """

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self._space_before_call = ""  # given back if the call turns out to be text
        self._made_calls = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        """Content and calls that `delta` completes; text that may belong to a call is held back."""
        self._held += delta
        events: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._held.find(OPEN)
                if at < 0:
                    keep = _partial_open_len(self._held)
                    text = self._held[: len(self._held) - keep].rstrip()
                    events.append(text)
                    self._held = self._held[len(text) :]
                    break
                text = self._held[:at].rstrip()
                events.append(text)
                self._space_before_call = self._held[len(text) : at]
                self._held, self._in_call = self._held[at + len(OPEN) :], True
            else:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                body = self._held[:end]
                self._held, self._in_call = self._held[end + len(CLOSE) :], False
                call = parse_call(body)
                self._made_calls |= call is not None
                events.append(call or self._space_before_call + OPEN + body + CLOSE)
        return [e for e in events if e != ""]

    def finish(self) -> list[str | ToolCall]:
        """Releases what is held at the end of the output: an unclosed call stays text."""
        rest = self._space_before_call + OPEN + self._held if self._in_call else self._held
        if self._made_calls:
            rest = rest.rstrip()
        self._held, self._in_call = "", False
        return [rest] if rest else []
