"""The server's pieces without a server: request validation into GenRequest (serve/protocol.py), the text deltas
with stop strings (TextAssembler), and the Ticket contract every backend keeps (serve/backend.py)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("starlette")

from fucina_jax.serve import protocol  # noqa: E402
from fucina_jax.serve.backend import Delta, Done, Failed, GenRequest, Ticket, TextAssembler  # noqa: E402
from fucina_jax.serve.protocol import APIError, ModelInfo  # noqa: E402


@pytest.fixture(scope="module")
def tiny(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


@pytest.fixture(scope="module")
def info(tiny):
    return ModelInfo.from_model(tiny, ctx=256, speculation=False)


def test_completion_request_maps_onto_gen_request(info, tiny):
    p = protocol.parse_completion({"prompt": "hello", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
                                   "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                   "seed": 42, "max_tokens": 9, "stop": "xy", "stop_token_ids": [3, 4],
                                   "stream": True, "stream_options": {"include_usage": True}}, info)
    g = p.gen
    assert g.prompt_ids == tiny.tokenizer.encode("hello", add_special=True, parse_special=True)
    assert g.max_tokens == 9 and g.stop_strings == ("xy",)
    assert g.stop_ids == frozenset(tiny.tokenizer.eog_ids) | {3, 4}
    s = g.sampler
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty, s.presence_penalty, s.frequency_penalty,
            s.seed) == (0.5, 0.9, 7, 0.1, 1.1, 0.5, -0.5, 42)
    assert p.stream and p.include_usage and p.kind == "completion" and not g.speculation


def test_defaults(info):
    g = protocol.parse_completion({"prompt": "hello"}, info).gen
    d = protocol.SAMPLER_DEFAULTS
    assert (g.sampler.temperature, g.sampler.top_p, g.sampler.top_k, g.sampler.min_p) == (
        d["temperature"], d["top_p"], d["top_k"], d["min_p"]) == (1.0, 1.0, 40, 0.05)
    assert g.max_tokens == protocol.COMPLETION_DEFAULT_MAX_TOKENS
    assert isinstance(g.sampler.seed, int)  # a concrete random seed
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, info)
    assert chat.gen.max_tokens == info.ctx - len(chat.gen.prompt_ids)  # chat: the rest of the context
    assert info.turn_end_id in chat.gen.stop_ids
    # include_usage without stream is ignored; top_k -1 means off
    p = protocol.parse_completion({"prompt": "x", "stream_options": {"include_usage": True}, "top_k": -1}, info)
    assert not p.include_usage and p.gen.sampler.top_k == 0


def test_speculation_defaults_and_references(tiny):
    on = ModelInfo.from_model(tiny, ctx=256, speculation=True)
    off = ModelInfo.from_model(tiny, ctx=256, speculation=False)
    assert protocol.parse_completion({"prompt": "x"}, on).gen.speculation
    assert not protocol.parse_completion({"prompt": "x", "speculation": False}, on).gen.speculation
    g = protocol.parse_completion({"prompt": "x", "references": ["a doc"]}, off).gen
    assert g.speculation and g.references == ("a doc",)


def test_max_tokens_must_fit_the_context(info):
    n = len(protocol.parse_completion({"prompt": "hello"}, info).gen.prompt_ids)
    assert protocol.parse_completion({"prompt": "hello", "max_tokens": 256 - n}, info).gen.max_tokens == 256 - n
    with pytest.raises(APIError) as e:
        protocol.parse_completion({"prompt": "hello", "max_tokens": 257 - n}, info)
    assert e.value.code == "context_length_exceeded" and f"max_tokens <= {256 - n}" in e.value.message


def test_chat_messages_roles_and_template_errors(info, tiny):
    p = protocol.parse_chat({"messages": [{"role": "developer", "content": "rules"},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                          {"role": "assistant", "content": None},
                                          {"role": "user", "content": "again"}]}, info)
    text = tiny.tokenizer.decode(p.gen.prompt_ids)
    assert "<|im_start|>system\nrules" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(APIError) as e:
        protocol.parse_chat({"messages": [{"role": "user", "content": "x"}],
                             "chat_template_kwargs": {"messages": []}}, info)
    assert e.value.param == "chat_template_kwargs"


def test_response_shapes_validate_against_the_openai_types(info):
    openai = pytest.importorskip("openai")
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    for kind, parse in (("completion", protocol.parse_completion), ("chat", protocol.parse_chat)):
        body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
        p = parse({**body, "stream": True, "stream_options": {"include_usage": True}}, info)
        out = protocol.ResponseBuilder(p, "id-1", 123)
        whole = out.response("ab", "stop", usage, None, [1, 2])
        chunks = [out.chunk(role=True) if kind == "chat" else out.chunk("a"), out.chunk("b"),
                  out.chunk(None, finish_reason="length", final=True), out.usage_chunk(usage)]
        if kind == "completion":
            Completion.model_validate(whole)
            # The type has finish_reason non-null, but OpenAI's own stream sends null until the last chunk (the
            # client builds stream chunks without validating): check the others with the field filled in.
            for c in chunks:
                filled = [{**ch, "finish_reason": ch["finish_reason"] or "stop"} for ch in c["choices"]]
                Completion.model_validate({**c, "choices": filled})
        else:
            ChatCompletion.model_validate(whole)
            for c in chunks:
                ChatCompletionChunk.model_validate(c)
        assert whole["usage"] == usage and chunks[-1]["choices"] == [] and chunks[0]["usage"] is None
    assert openai is not None


class _CharTokenizer:
    """One character per token id (ids are code points), for TextAssembler's own tests."""

    class _Dec:
        def feed(self, i):
            return chr(i)

        def flush(self):
            return ""

    def stream_decoder(self):
        return self._Dec()


@pytest.mark.parametrize("seed", range(40))
def test_text_assembler_never_shows_text_past_a_stop(seed):
    rng = random.Random(seed)
    alphabet = "abc"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))})
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[:min(hits)] if hits else text
    ta = TextAssembler(_CharTokenizer(), stops)
    shown = ""
    for ch in text:
        shown += ta.feed(ord(ch))
        assert expected.startswith(shown)  # nothing past the cut, ever
        if ta.stopped:
            break
    shown += ta.finish()
    assert shown == expected and ta.text == expected and ta.stopped == bool(hits)


def test_ticket_delivers_exactly_one_end_and_wakes_subscribers():
    from fucina_jax.sampling import SamplerConfig

    t = Ticket(GenRequest([1], 1, SamplerConfig(seed=0), frozenset()))
    calls = []
    t.put(Delta((1,), "a"))
    t.subscribe(lambda: calls.append(1))  # events already waiting: notified at once
    assert calls == [1]
    t.put(Done("stop", {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}))
    t.put(Failed(RuntimeError("late")))  # after the end: dropped
    t.put(Delta((2,), "b"))
    events = [t.events.get_nowait() for _ in range(t.events.qsize())]
    assert [type(e).__name__ for e in events] == ["Delta", "Done"] and t.finished and len(calls) == 2
    assert not t.cancelled
    t.cancel()
    assert t.cancelled
