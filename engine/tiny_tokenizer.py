"""A small GLM-style tokenizer written in Hugging Face format, for the tiny test model.

Owns the files a checkpoint directory needs for tokenization and chat: `tokenizer.json`
(byte-level BPE with the GLM special tokens), `tokenizer_config.json`, `chat_template.jinja`
and `generation_config.json`. The chat template follows the GLM layout (role headers as special
tokens, tools inside `<tools>`, XML-style tool calls, `<|observation|>` tool results) so that the
chat renderer and the tool-call parser are exercised end to end without a real checkpoint.
Written once by `write_tiny_tokenizer`; the files are then read like any other model's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.tokenizer import MARKUP_TOKENS

logger = logging.getLogger(__name__)

# Role and control tokens: dropped by `decode(..., skip_special_tokens=True)`.
CONTROL_TOKENS = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|endoftext|>",
)
# Structure tokens: not special, so they stay in the text whatever the request asks of special tokens.
STRUCTURE_TOKENS = (*MARKUP_TOKENS, "<tool_response>", "</tool_response>")
EOS_TOKEN = "<|endoftext|>"
# Tokens that end a generated turn: the model either ends the text or starts the next turn.
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# Frequent pieces of English chat and of JSON tool arguments; each becomes one token.
# A piece must not cross a byte-level pre-tokenizer boundary (letters, digits and punctuation
# runs are split apart, a space attaches to the run after it), or its merges never fire.
_COMMON_PIECES = (
    " the", " to", " of", " and", " a", " in", " is", " you", " that", " it", " for", " on",
    " with", " what", " weather", " city", " call", " tool", "ing", "ed", "er", "es", "re",
    "name", "type", "function", "arguments", "string", "object", "properties", "description",
    "required", "value", "true", "false", "null",
    '{"', '":', ' "', '",', '"}', "}}", " {", "]}",
)

CHAT_TEMPLATE = r"""{#- GLM chat layout: each role header is a special token followed by a newline. -#}
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- '[gMASK]<sop>' -}}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if has_system or tools -%}
    {{- '<|system|>\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) -}}{%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}{{- '\n\n' -}}{%- endif -%}
        {{- '# Tools\n\nTo call a tool, write its name and one key and value pair per argument:\n' -}}
        {{- '<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>\n' -}}
        {{- 'Values that are not strings are written as JSON. The tools, one JSON schema per line:\n<tools>\n' -}}
        {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
        {{- '</tools>' -}}
    {%- endif -%}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- '<|system|>\n' + text(message.content) -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|user|>\n' + text(message.content) -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|assistant|>\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>' + message.reasoning_content + '</think>' -}}
        {%- endif -%}
        {%- set content = text(message.content) -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first or content or message.reasoning_content -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>' + fn.name -}}
            {%- if fn.arguments is not mapping -%}
                {{- raise_exception('tool call arguments must be a JSON object') -}}
            {%- endif -%}
            {%- for key, value in fn.arguments.items() -%}
                {{- '\n<arg_key>' + key + '</arg_key>\n<arg_value>' -}}
                {{- value if value is string else value | tojson -}}
                {{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '\n</tool_call>' -}}
        {%- endfor -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|observation|>\n' -}}
        {%- else -%}
            {{- '\n' -}}
        {%- endif -%}
        {{- '<tool_response>' + text(message.content) + '</tool_response>' -}}
    {%- else -%}
        {{- raise_exception('unknown role ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think></think>' -}}{%- endif -%}
{%- endif -%}
"""


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte value, in byte order.

    Byte-level BPE stores tokens as strings: printable Latin-1 bytes stand for themselves and
    the rest are shifted above U+0100, so every byte has a visible, whitespace-free symbol.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte tokens first (id = byte value), then one token per merge of the common pieces."""
    symbols = _byte_symbols()
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    for piece in _COMMON_PIECES:
        chars = "".join(symbols[b] for b in piece.encode("utf-8"))
        for end in range(2, len(chars) + 1):
            if chars[:end] not in vocab:
                merges.append((chars[: end - 1], chars[end - 1]))
                vocab[chars[:end]] = len(vocab)
    return vocab, merges


def build_tiny_backend() -> Tokenizer:
    """The byte-level BPE tokenizer with the GLM control and structure tokens appended."""
    vocab, merges = _vocab_and_merges()
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in STRUCTURE_TOKENS])
    return backend


def write_tiny_tokenizer(out_dir: Path, cover_vocab: int | None = None) -> int:
    """Write the tokenizer, its config, chat template and stop tokens into `out_dir`.

    Returns the number of token ids in use (byte tokens, merges and added tokens); the tiny
    model's `vocab_size` must be at least this, and may be padded above it. With `cover_vocab`, every
    id from the tokenizer's own up to that vocabulary size is an added token `<|id|>`: a random-weight
    model of a real vocabulary (154,880 ids against about 400) then streams visible text for any id it
    samples, and that text encodes back to the same ids (a conversation's next turn hits the cache).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = build_tiny_backend()
    if cover_vocab is not None:
        first = backend.get_vocab_size(with_added_tokens=True)
        backend.add_tokens([AddedToken(f"<|{i}|>", special=False, normalized=False) for i in range(first, cover_vocab)])
    backend.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation = {
        "eos_token_id": [backend.token_to_id(t) for t in STOP_TOKENS],
        "pad_token_id": backend.token_to_id(EOS_TOKEN),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    logger.info("wrote tiny tokenizer with %d tokens to %s", vocab_size, out_dir)
    return vocab_size
