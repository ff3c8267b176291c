"""Text <-> token ids and chat rendering for one model, read from its Hugging Face directory.

Owns the `tokenizers` backend, the stop-token set and the model's chat template. Built once per
replica by `Tokenizer.from_dir` (local files only, never the network) and then shared read-only:
encoding, decoding and rendering keep no state between calls.

Chat templates are model-supplied code, so they run in Jinja's immutable sandbox with the same
environment Hugging Face gives them (trim and lstrip of blocks, a `tojson` filter that keeps
non-ASCII text, `raise_exception`), which lets a real checkpoint's template render unchanged.

Role markers and other added tokens come only from the template: text a client wrote in a
system, user or tool message, or in a tool definition (names, descriptions, parameter schemas), is
encoded as plain text even where it spells `<|assistant|>`, so a client cannot open a turn of another
role. Such text is rendered between markers that hold a per-call secret and the rendered span is
encoded as plain text; assistant turns (the model's own output) render as they are.

Text is encoded with the backend's batch call, which releases the GIL while it works: the ingress
tokenizes in worker threads, and a long prompt must not stop its event loop meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

# Keys of tokenizer_config.json handed to the template as variables, as Hugging Face does.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Roles whose text is the client's: control tokens it spells are encoded as plain text.
_CLIENT_TEXT_ROLES = frozenset({"system", "developer", "user", "tool"})

_NOT_VERBATIM = ("client text that spells the model's control tokens is not rendered verbatim by this chat template, "
                 "so it cannot be kept as plain text")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: bad messages, or the template refused them."""


class TokenizationError(ValueError):
    """Text that cannot be tokenized (not valid Unicode, e.g. a lone surrogate)."""


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged.

    Templates mark assistant spans with this tag for training masks; serving has no use for
    the spans but must still compile such templates.
    """

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without HTML escaping (Jinja's own filter escapes `<`, `>`, `&` and `'`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; a syntax error becomes a ChatTemplateError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _check_unicode(text: str) -> None:
    """Raises `TokenizationError` naming the position of the first character UTF-8 cannot carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizationError(f"text is not valid Unicode: {exc.reason} at character {exc.start}") from None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _template_from_config(value: Any) -> str | None:
    """`chat_template` in tokenizer_config.json: a string, or named templates (pick "default")."""
    if isinstance(value, str) or value is None:
        return value
    named = {item["name"]: item["template"] for item in value}
    return named.get("default")


def _parse_arguments(text: str, where: str) -> Any:
    """A tool call's JSON arguments; any failure to read them (bad syntax, nesting deeper than the parser's
    recursion allows, an integer too long to convert) is the client's, so it is a ChatTemplateError."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{where}: arguments are not valid JSON ({exc.msg})") from exc
    except RecursionError:
        raise ChatTemplateError(f"{where}: arguments nest too deeply") from None
    except ValueError as exc:
        raise ChatTemplateError(f"{where}: arguments cannot be read ({exc})") from exc


def _normalize_tool_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Copy one tool call with its arguments as a dict, since OpenAI clients send a JSON string."""
    call = dict(call)
    holder = dict(call["function"]) if isinstance(call.get("function"), Mapping) else call
    arguments = holder.get("arguments")
    if isinstance(arguments, str):
        arguments = _parse_arguments(arguments, where)
    if arguments is not None and not isinstance(arguments, Mapping):
        raise ChatTemplateError(f"{where}: arguments must be a JSON object, got {type(arguments).__name__}")
    holder["arguments"] = dict(arguments or {})
    if holder is not call:
        call["function"] = holder
    return call


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate the conversation and return copies the template can read without surprises."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"message {i} has no 'role'")
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_normalize_tool_call(c, f"message {i} tool call {j}") for j, c in enumerate(calls)]
        normalized.append(message)
    return normalized


def _without_added_tokens(backend: Backend) -> Backend:
    """A copy of `backend` that knows none of its added tokens: it encodes text spelling one as ordinary text.

    Its pipeline is otherwise the backend's own, so for text that spells no added token both give the same ids.
    """
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = []
    return Backend.from_str(json.dumps(spec))


def _encode_with(backend: Backend, text: str) -> list[int]:
    """Token ids of `text` from `backend`, without BOS.

    `encode_batch_fast` releases the GIL while it tokenizes (`encode` holds it, so a megabyte of text in a
    worker thread would stop the event loop for a second); it skips offsets, which nothing here reads.
    """
    try:
        return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    except TypeError as exc:  # the backend refuses strings that are not valid Unicode
        _check_unicode(text)
        raise TokenizationError(f"text cannot be tokenized: {exc}") from exc


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and isinstance(part.get("text"), str)


class _ClientTextFence:
    """Brackets client strings that spell added tokens between markers holding a secret nonce.

    The template renders the bracketed string as it would the string itself (escaped as JSON inside
    `tojson`, say), so after rendering the text between the markers is the client's and is encoded
    as plain text. A client cannot write the markers: it does not know the nonce. Strings that spell
    no added token are left alone, so template logic that reads them (`type == 'string'`) is unchanged.
    """

    def __init__(self, spells_added_token: Callable[[str], bool]) -> None:
        # A lowercase word ahead of the secret, so that a template changing the case of client text always
        # breaks the markers (and is refused) whatever digits the secret happens to hold.
        nonce = f"fence{secrets.token_hex(8)}"
        self._nonce = nonce
        self._open, self._close = f"\ue000{nonce}\ue001", f"\ue000{nonce}\ue002"
        self._marker = re.compile(f"\ue000{nonce}([\ue001\ue002])")
        self._spells = spells_added_token
        self.used = False

    def text(self, text: str) -> str:
        """`text` between the markers."""
        self.used = True
        return f"{self._open}{text}{self._close}"

    def value(self, value: Any) -> Any:
        """`value` with every string in it that spells an added token, mapping keys included, fenced."""
        if isinstance(value, str):
            return self.text(value) if self._spells(value) else value
        if isinstance(value, Mapping):
            return {self.value(key): self.value(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(item) for item in value]
        return value

    def message(self, message: Any) -> Any:
        """A client message with its strings fenced; the model's own turns stay as they are."""
        if not isinstance(message, Mapping) or message.get("role") not in _CLIENT_TEXT_ROLES:
            return message
        return {key: self._field(key, value) for key, value in message.items()}

    def _field(self, key: Any, value: Any) -> Any:
        if key == "role":
            return value
        if key == "content" and isinstance(value, list):
            return self._parts(value)
        return self.value(value)

    def _parts(self, parts: list[Any]) -> list[Any]:
        """Content parts, every text fenced when their texts joined spell an added token.

        Templates join the parts, so `<|us` and `er|>` in two parts would meet as `<|user|>`.
        """
        texts = [part["text"] for part in parts if _is_text_part(part)]
        if not self._spells("".join(texts)):
            return self.value(parts)
        return [{**self.value(part), "text": self.text(part["text"])} if _is_text_part(part) else self.value(part)
                for part in parts]

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered text in pieces, each with whether it is fenced client text.

        Raises ChatTemplateError when the template did not keep the markers as they were (it changed
        their case, say, or cut a fenced string short): the prompt would then hold their remains.
        """
        pieces = self._marker.split(rendered)  # text, marker kind, text, ...
        out: list[tuple[str, bool]] = []
        inside = False
        for n, piece in enumerate(pieces):
            if n % 2:
                if (piece == "\ue001") == inside:
                    raise ChatTemplateError(_NOT_VERBATIM)
                inside = not inside
            elif self._nonce in piece.lower():
                raise ChatTemplateError(_NOT_VERBATIM)
            elif piece:
                out.append((piece, inside))
        if inside:
            raise ChatTemplateError(_NOT_VERBATIM)
        return out


# GLM's reasoning and tool-call markup: read from the decoded text by the app's parsers, so it stays in the text
# when special tokens are skipped, whatever a checkpoint's tokenizer flags it as.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>")


class Tokenizer:
    """One model's tokenizer, stop tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        eos_token_ids: tuple[int, ...],
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.eos_token_ids = eos_token_ids
        # Named special tokens (`eos_token`, `pad_token`, ...); templates also read them as variables.
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template is not None else None
        added_tokens = backend.get_added_tokens_decoder()
        added = sorted((t.content for t in added_tokens.values()), key=len, reverse=True)
        # Dropped from text when special tokens are skipped: role headers, the prompt prefix, end of text.
        self._skipped_ids = frozenset(
            i for i, t in added_tokens.items() if t.special and t.content not in MARKUP_TOKENS)
        self._added_token_pattern = re.compile("|".join(map(re.escape, added))) if added else None
        self._plain_backend = _without_added_tokens(backend) if added else backend

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory; reads only local files."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                special_tokens[key] = content
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _template_from_config(config.get("chat_template"))
        eos_ids = cls._stop_ids(backend, model_dir, special_tokens.get("eos_token"))
        logger.info("tokenizer from %s: %d tokens, stop ids %s", model_dir, backend.get_vocab_size(True), eos_ids)
        return cls(backend, eos_ids, special_tokens, chat_template)

    @staticmethod
    def _stop_ids(backend: Backend, model_dir: Path, eos_token: str | None) -> tuple[int, ...]:
        """Stop ids from generation_config.json first (GLM lists several), then the eos token."""
        raw = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        ids = list(raw) if isinstance(raw, list) else ([] if raw is None else [raw])
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            ids.append(eos_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added, and special tokens written in the text are matched."""
        return _encode_with(self._backend, text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with every added token spelled in it encoded as ordinary text.

        For text that spells no added token the ids equal `encode(text)`.
        """
        return _encode_with(self._plain_backend, text)

    def spells_added_token(self, text: str) -> bool:
        return self._added_token_pattern is not None and self._added_token_pattern.search(text) is not None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; skipping special tokens drops the checkpoint's special tokens except GLM's markup."""
        kept = [i for i in ids if i not in self._skipped_ids] if skip_special_tokens else list(ids)
        return self._backend.decode(kept, skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Tool-call arguments given as JSON strings are parsed first, so templates see objects.
        Raises ChatTemplateError (a ValueError) for bad messages or when the template refuses them;
        a template that breaks out of the sandbox raises jinja2's SecurityError.
        """
        if self._template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no chat_template.jinja, none in tokenizer_config.json)"
            )
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return self._template.render(
                messages=_normalize_messages(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.SecurityError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except RecursionError:  # `tojson` of client data nested nearly as deep as the JSON parser allows
            raise ChatTemplateError("the messages or tools nest too deeply to render") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; client text that spells added tokens stays plain text.

        Client text is that of system, user and tool messages and all of the tool definitions.
        """
        fence = _ClientTextFence(self.spells_added_token)
        try:
            messages = [fence.message(message) for message in messages]
            tools = fence.value(tools)
        except RecursionError:
            raise ChatTemplateError("the messages or tools nest too deeply to render") from None
        rendered = self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)
        if not fence.used:
            return self.encode(rendered)
        ids: list[int] = []
        for piece, plain in fence.split(rendered):
            ids += self.encode_plain(piece) if plain else self.encode(piece)
        return ids
