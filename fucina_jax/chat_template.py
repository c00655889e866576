"""Chat templates: the GGUF's `tokenizer.chat_template` rendered with jinja2 the way transformers and llama.cpp do,
with a built-in template per family when the file has none (the Gemma 3 270M base file has none).

Rendering environment (transformers' `apply_chat_template`, which llama.cpp's own Jinja engine follows): a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not
HTML-escape (`json.dumps(..., ensure_ascii=False)`), globals `raise_exception(msg)` and `strftime_now(fmt)`, and the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` (the texts of the vocabulary's BOS/EOS
tokens, as llama.cpp passes them) plus any extra keyword (`tools`, `enable_thinking`, ...).

`encode_chat` turns a conversation into prompt ids the way llama.cpp's server does: render, drop a leading BOS text
when the tokenizer adds BOS itself, then encode with special-token parsing on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from fucina_jax.errors import ChatTemplateError

__all__ = [
    "CHATML_TEMPLATE",
    "GEMMA3_TEMPLATE",
    "GEMMA4_TEMPLATE",
    "QWEN3_TEMPLATE",
    "ChatTemplate",
    "chat_template_for",
    "encode_chat",
    "render_chat",
]

# --- built-in templates (used only when the GGUF has no tokenizer.chat_template) ---------------------------------

# Gemma 3 (architectures.md §2.4): no system role - the system text opens the first user turn, followed by a blank
# line; the assistant role is "model"; turns close with <end_of_turn>; message text is trimmed.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] ~ '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Gemma conversations must alternate user/assistant/user/... after the system message') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' ~ role ~ '\\n' ~ (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# Gemma 4 (architectures.md §3.5): a real system role, turns <|turn>ROLE\\n ... <turn|>\\n, "model" for the assistant;
# thinking is switched on by <|think|> at the start of the system turn.
GEMMA4_TEMPLATE = """{{ bos_token }}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {{ '<|turn>system\\n' ~ ('<|think|>' if thinking else '') }}
    {{- messages[0]['content'] | trim -}}
    {{ '<turn|>\\n' }}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- if thinking -%}
        {{ '<|turn>system\\n<|think|><turn|>\\n' }}
    {%- endif -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<|turn>' ~ role ~ '\\n' }}
    {{- message['content'] | trim -}}
    {{ '<turn|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|turn>model\\n' }}
{%- endif -%}
"""

# Qwen3 (architectures.md §1.4): ChatML; earlier assistant turns keep only the answer after </think>; tool results
# go in a user turn inside <tool_response>; enable_thinking=false pre-fills an empty think block.
QWEN3_TEMPLATE = """{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set content = message['content'] -%}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
        {%- endif -%}
        {{ '<|im_start|>assistant\\n' ~ content ~ '<|im_end|>\\n' }}
    {%- elif message['role'] == 'tool' -%}
        {{ '<|im_start|>user\\n<tool_response>\\n' ~ message['content'] ~ '\\n</tool_response><|im_end|>\\n' }}
    {%- else -%}
        {{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{ '<think>\\n\\n</think>\\n\\n' }}
    {%- endif -%}
{%- endif -%}
"""

# Plain ChatML: llama.cpp's default when a file has no template.
CHATML_TEMPLATE = """{%- for message in messages -%}
    {{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\\n' }}
{%- endif -%}
"""

_FALLBACK_BY_ARCH = {
    "gemma": GEMMA3_TEMPLATE, "gemma2": GEMMA3_TEMPLATE, "gemma3": GEMMA3_TEMPLATE, "gemma3n": GEMMA3_TEMPLATE,
    "gemma4": GEMMA4_TEMPLATE,
    "qwen2": QWEN3_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "qwen3moe": QWEN3_TEMPLATE,
}

# Markers that close a turn, most specific first: the text a generation loop stops on when the model ends its turn.
_TURN_END_MARKERS = ("<end_of_turn>", "<turn|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


# --- rendering ---------------------------------------------------------------------------------------------------

def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


MAX_RENDERED = 10_000_000  # characters a template's `*` may build; a chat prompt is far shorter


@lru_cache(maxsize=1)
def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox (no attribute games, ranges of at most 100k) plus bounds on `*` and `**`, so a hostile
        template in a downloaded file fails with an error instead of filling memory ({{ "x" * 10**10 }})."""

        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if operator == "*" and isinstance(seq, (str, list, tuple)) and isinstance(n, int) and (
                    len(seq) * n > MAX_RENDERED):
                raise SecurityError(f"the template builds a sequence longer than {MAX_RENDERED} with '*'")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise SecurityError("the template raises a number to a power above 1024")
            return super().call_binop(context, operator, left, right)

    return Environment


@lru_cache(maxsize=32)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the BOS/EOS texts it renders with. `is_fallback` = built in, not from the file."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    is_fallback: bool = False

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text, exactly as the template writes it (BOS text included if the template emits one)."""
        import jinja2

        _check_messages(messages)
        template = _compile(self.source)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **variables,
                   "messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from None
        except Exception as e:  # the template is code from the file: whatever it does wrong is the template's error
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None

    @property
    def turn_end(self) -> str:
        """The text that closes a turn in this template (e.g. "<end_of_turn>", "<|im_end|>"), else the EOS text."""
        for marker in _TURN_END_MARKERS:
            if marker in self.source:
                return marker
        return self.eos_token


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")


def _source_of(source) -> tuple[str | None, str | None, str, str]:
    """(template, architecture, bos text, eos text) of a Tokenizer or a GGUF metadata dict."""
    from fucina_jax.tokenizer import Tokenizer

    tok = source if isinstance(source, Tokenizer) else Tokenizer.from_metadata(source)
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    return tok.chat_template, tok.architecture, bos, eos


def chat_template_for(source) -> ChatTemplate:
    """The chat template of a Tokenizer (or GGUF metadata dict): the file's own, else the family's built-in one
    (Gemma 3 / Gemma 4 / Qwen3 by `general.architecture`, ChatML otherwise, as llama.cpp defaults to)."""
    template, arch, bos, eos = _source_of(source)
    if template:
        return ChatTemplate(template, bos, eos, is_fallback=False)
    return ChatTemplate(_FALLBACK_BY_ARCH.get(arch or "", CHATML_TEMPLATE), bos, eos, is_fallback=True)


def render_chat(messages: Sequence[Mapping[str, Any]], source, add_generation_prompt: bool = True,
                **variables: Any) -> str:
    """Render a conversation with the template of `source` (a Tokenizer, GGUF metadata dict or ChatTemplate)."""
    tmpl = source if isinstance(source, ChatTemplate) else chat_template_for(source)
    return tmpl.render(messages, add_generation_prompt=add_generation_prompt, **variables)


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                template: ChatTemplate | None = None, **variables: Any) -> list[int]:
    """Prompt ids of a conversation, as llama.cpp's server builds them: the rendered text minus a leading BOS text
    when the tokenizer adds BOS (and a trailing EOS text when it adds EOS), encoded with add_special=True and
    parse_special=True - so the template's turn markers become their control tokens and BOS appears once."""
    tmpl = template or chat_template_for(tokenizer)
    text = tmpl.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    if tokenizer.add_bos and tmpl.bos_token and text.startswith(tmpl.bos_token):
        text = text[len(tmpl.bos_token):]
    if tokenizer.add_eos and tmpl.eos_token and text.endswith(tmpl.eos_token):
        text = text[: -len(tmpl.eos_token)]
    return tokenizer.encode(text, add_special=True, parse_special=True)
