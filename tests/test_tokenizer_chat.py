"""Chat templates: the built-in per-family templates against the formats of architectures.md (§1.4, §2.4, §3.5),
the rendering environment against transformers' conventions, and encode_chat's BOS handling. (The real files'
templates and llama.cpp's C++ formats are checked in test_tokenizer_parity.py.)"""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from fucina_jax.chat_template import (
    CHATML_TEMPLATE,
    GEMMA3_TEMPLATE,
    GEMMA4_TEMPLATE,
    QWEN3_TEMPLATE,
    ChatTemplate,
    chat_template_for,
    encode_chat,
    render_chat,
)
from fucina_jax.errors import ChatTemplateError
from fucina_jax.testing.vocab import gemma4_vocab
from fucina_jax.tokenizer import Tokenizer

CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def g4():
    tokens, types, scores, merges = gemma4_vocab(["hello world, model turn user system"] * 4, vocab_size=400)
    return Tokenizer.from_metadata({
        "general.architecture": "gemma4", "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 106})


def test_gemma3_format():
    t = ChatTemplate(GEMMA3_TEMPLATE, "<bos>", "<eos>")
    assert t.render(CONVO) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert t.render(CONVO[1:2], add_generation_prompt=False) == "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    assert t.turn_end == "<end_of_turn>"
    with pytest.raises(ChatTemplateError, match="alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma4_format():
    t = ChatTemplate(GEMMA4_TEMPLATE, "<bos>", "<turn|>")
    assert t.render(CONVO) == (
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n"
        "<|turn>model\n4<turn|>\n<|turn>user\nAnd 3+3?<turn|>\n<|turn>model\n")
    assert t.render(CONVO, enable_thinking=True).startswith("<bos><|turn>system\n<|think|>You are terse.<turn|>\n")
    assert t.render(CONVO[1:2], enable_thinking=True) == (
        "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n")
    assert t.turn_end == "<turn|>"


def test_qwen3_format():
    t = ChatTemplate(QWEN3_TEMPLATE, "<|endoftext|>", "<|im_end|>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"}, {"role": "tool", "content": "{}"},
            {"role": "user", "content": "Q2"}]
    assert t.render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert t.render(msgs[:2], enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert t.render(msgs[:2], enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert t.turn_end == "<|im_end|>"


def test_chatml_format():
    t = ChatTemplate(CHATML_TEMPLATE)
    assert t.render(CONVO[:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n  What is 2+2?\n<|im_end|>\n")


def test_environment_like_transformers():
    src = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
           "|{{ {'k': '<é>'} | tojson(indent=2) }}|{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}"
           "|{{ extra }}")
    out = ChatTemplate(src, "<s>", "</s>").render([{"role": "user", "content": "<b>ü</b>"}] * 2, extra=7)
    first, second, year, toks, extra = out.split("|")
    assert json.loads(first) == {"role": "user", "content": "<b>ü</b>"} and "<b>ü</b>" in first  # no HTML escaping
    assert second == json.dumps({"k": "<é>"}, ensure_ascii=False, indent=2)
    assert year == str(datetime.now().year) and toks == "<s></s>" and extra == "7"
    # trim_blocks / lstrip_blocks: block tags leave no blank lines behind
    src = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(src).render([{"role": "u", "content": "x"}, {"role": "u", "content": "y"}]) == "x\ny\n"


@pytest.mark.parametrize("source, match", [
    ('{{ "x" * 10**10 }}', "longer than"),  # would take ~10 GB
    ("{{ 10**9 * [1] }}", "longer than"),
    ("{{ 2 ** 100000 }}", "power above 1024"),
    ("{% for i in range(10**12) %}{% endfor %}", "Range too big"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_hostile_templates_fail_cleanly(source, match):
    """A template in a downloaded file is code: one that would exhaust memory, time or the stack, or raises a Python
    error, is a ChatTemplateError, while ordinary uses of the same operators render."""
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert ChatTemplate('{{ "ab" * 2 }}{{ 2 * "c" }}{{ 2 ** 10 }}{{ [0] * 2 }}').render([]) == "ababcc1024[0, 0]"


def test_template_errors():
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}").render([])
    with pytest.raises(ChatTemplateError, match="rejected the conversation: no"):
        ChatTemplate("{{ raise_exception('no') }}").render([])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content.nope() }}").render([{"role": "u", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="'role' and 'content'"):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="list"):
        ChatTemplate(CHATML_TEMPLATE).render("hello")
    # the sandbox refuses to mutate the caller's data
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_fallback_selection_and_encode_chat(g4):
    t = chat_template_for(g4)
    assert t.is_fallback and t.source == GEMMA4_TEMPLATE and t.bos_token == "<bos>" and t.eos_token == "<turn|>"
    ids = encode_chat(g4, CONVO[1:2])
    assert ids.count(g4.bos_id) == 1 and ids[0] == g4.bos_id  # the rendered "<bos>" text is not encoded again
    assert ids[1] == g4.token_id("<|turn>") and g4.token_id("<turn|>") in ids
    assert g4.decode(ids) == render_chat(CONVO[1:2], g4)
    assert g4.decode(ids) == "<bos><|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n"
    # a file's own template wins over the fallback
    g4.chat_template = "{{ bos_token }}custom"
    try:
        assert not chat_template_for(g4).is_fallback and render_chat([], g4) == "<bos>custom"
    finally:
        g4.chat_template = None
