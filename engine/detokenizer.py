"""Streaming text for one request's generated tokens.

Owns the decode offsets of one output stream: created when a request starts generating, fed
each sampled id by `step`, and closed by `flush` when the request finishes. The pieces it returns,
joined, equal `Tokenizer.decode` of all the ids, and no piece ever ends inside a character.

Why windows: byte-level tokens can split a multibyte UTF-8 character, and some decoders change
a token's text depending on what precedes it, so a token cannot be decoded alone. Each step
decodes a short window that starts at an already emitted boundary and emits only what lies past
the text already sent, holding back text that still ends in a replacement character.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, fed one at a time, into newly completed text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        # ids[_prefix_offset:_read_offset] were emitted and give the next window its context;
        # both offsets sit where the decoded text ended on a whole character.
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial)."""
        self._token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is held back (a trailing partial character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        sent = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(text) <= len(sent) or (text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return text[len(sent) :]
