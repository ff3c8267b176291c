"""Text <-> token ids and chat rendering for one model, read from its Hugging Face directory.

Owns the `tokenizers` backend, the stop-token set and the model's chat template. Built once per
replica by `Tokenizer.from_dir` (local files only, never the network) and then shared read-only:
encoding, decoding and rendering keep no state between calls.

Chat templates are model-supplied code, so they run in Jinja's immutable sandbox with the same
environment Hugging Face gives them (trim and lstrip of blocks, a `tojson` filter that keeps
non-ASCII text, `raise_exception`), which lets a real checkpoint's template render unchanged.

Role markers and other added tokens come only from the template: text a client wrote in a
system, user or tool message is encoded as plain text even where it spells `<|assistant|>`, so a
message cannot open a turn of another role. Such text is rendered through a placeholder and
spliced back as plain-text tokens; assistant turns (the model's own output) render as they are.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
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


def _normalize_tool_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Copy one tool call with its arguments as a dict, since OpenAI clients send a JSON string."""
    call = dict(call)
    holder = dict(call["function"]) if isinstance(call.get("function"), Mapping) else call
    arguments = holder.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{where}: arguments are not valid JSON ({exc.msg})") from exc
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
        added = sorted((t.content for t in backend.get_added_tokens_decoder().values()), key=len, reverse=True)
        self._added_token_pattern = re.compile("|".join(map(re.escape, added))) if added else None

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
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        except TypeError as exc:  # the backend refuses strings that are not valid Unicode
            _check_unicode(text)
            raise TokenizationError(f"text cannot be tokenized: {exc}") from exc

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with every added token spelled in it encoded as ordinary text.

        Runs the backend's pipeline without its added-token pass; for text that spells no added
        token the ids equal `encode(text)`.
        """
        _check_unicode(text)
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]

    def spells_added_token(self, text: str) -> bool:
        return self._added_token_pattern is not None and self._added_token_pattern.search(text) is not None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

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

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; client text that spells added tokens stays plain text."""
        messages, spliced, marker = self._hide_client_markers(messages)
        rendered = self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)
        if not spliced:
            return self.encode(rendered)
        pieces = marker.split(rendered)  # template text, placeholder index, template text, ...
        indices = [int(i) for i in pieces[1::2]]
        if sorted(indices) != list(range(len(spliced))):
            raise ChatTemplateError("message text that spells the model's control tokens is not rendered verbatim "
                                    "by this chat template, so it cannot be kept as plain text")
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            ids += self.encode(piece) if n % 2 == 0 else self.encode_plain(spliced[int(piece)])
        return ids

    def _hide_client_markers(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[Mapping[str, Any]], list[str], re.Pattern[str]]:
        """Messages whose client text spelling added tokens is replaced by unique placeholders.

        Returns the messages, the replaced texts by placeholder index, and the placeholder pattern.
        """
        nonce = secrets.token_hex(8)
        marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        spliced: list[str] = []

        def hide(text: Any) -> Any:
            if not isinstance(text, str) or not self.spells_added_token(text):
                return text
            spliced.append(text)
            return f"\ue000{nonce}:{len(spliced) - 1}\ue001"

        hidden: list[Mapping[str, Any]] = []
        for message in messages:
            if not isinstance(message, Mapping) or message.get("role") not in _CLIENT_TEXT_ROLES:
                hidden.append(message)
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = [{**part, "text": hide(part.get("text"))} if isinstance(part, Mapping) else part
                           for part in content]
            hidden.append({**message, "content": hide(content)})
        return hidden, spliced, marker
