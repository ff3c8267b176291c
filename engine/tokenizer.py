"""Text <-> token ids and chat rendering for one model, read from its Hugging Face directory.

Owns the `tokenizers` backend, the stop-token set and the model's chat template. Built once per
replica by `Tokenizer.from_dir` (local files only, never the network) and then shared read-only:
encoding, decoding and rendering keep no state between calls.

Chat templates are model-supplied code, so they run in Jinja's immutable sandbox with the same
environment Hugging Face gives them (trim and lstrip of blocks, a `tojson` filter that keeps
non-ASCII text, `raise_exception`), which lets a real checkpoint's template render unchanged.
"""

from __future__ import annotations

import json
import logging
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


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: bad messages, or the template refused them."""


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
        return self._backend.encode(text, add_special_tokens=False).ids

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
        """Token ids of the rendered conversation."""
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs))
