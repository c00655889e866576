"""The OpenAI-compatible server, live on 127.0.0.1: driven by the official `openai` client and by raw HTTP.

A server process (`python -m fucina_jax.serve MODEL --port 0`) serves a tiny random-weight Qwen3 fixture; every
served output is compared with fucina_jax.generate on the same prompt in this process (greedy and seeded sampling):
an equivalence, not hard-coded text. Faults that need a scripted backend (a request failing inside the model, a
full queue, a client hanging up on a request that would never end) run against an in-process server.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from fucina_jax.serve.testing import (  # noqa: E402
    HOST,
    InProcessServer,
    LiveServer,
    chat_ids_and_stops,
    get_json,
    reference,
    request,
    sse_events,
    stream_and_hang_up,
    wait_health,
    wait_idle,
)

PROMPTS = ["the cat sat on the mat", "hello there, general", "one two three four", "in the beginning"]


@pytest.fixture(scope="module")
def tiny_path(fixture_path):
    return fixture_path("qwen3")


@pytest.fixture(scope="module")
def tiny(tiny_path, load_model):
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def server(tiny_path):
    s = LiveServer(tiny_path, "--queue", "32", "--shutdown-timeout", "10")
    yield s
    rc = s.stop()
    assert rc == 0, s.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _ids(model, text):
    return model.tokenizer.encode(text, add_special=True, parse_special=True)


def _until(url: str, cond, timeout: float = 20.0) -> dict:
    h = wait_health(url, cond, timeout)
    assert cond(h), f"/health never satisfied the condition: {h}"
    return h


# ---- endpoints and equivalence ---------------------------------------------------------------------------------

def test_health_and_models(server, client, tiny_path):
    status, h = get_json(server.url + "/health")
    assert status == 200
    assert h["status"] == "ok" and h["slots_total"] >= 1 and h["slots_free"] == h["slots_total"] and h["queued"] == 0
    models = client.models.list().data
    assert [m.id for m in models] == ["qwen3.gguf"] and models[0].object == "model"
    assert client.models.retrieve("qwen3.gguf").id == "qwen3.gguf"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    # the file's name without .gguf is accepted too, and answered with the id
    r = client.completions.create(model="qwen3", prompt="hi", max_tokens=2, temperature=0)
    assert r.model == "qwen3.gguf"


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=1234),
                                      dict(temperature=1.3, top_k=0, min_p=0.0, top_p=0.9, seed=7)])
def test_completion_equals_generate(server, client, tiny, sampling):
    prompt = PROMPTS[0]
    ref = reference(tiny, _ids(tiny, prompt), 24, **sampling)
    kw = dict(sampling)
    extra = {k: kw.pop(k) for k in ("top_k", "min_p") if k in kw}
    r = client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=24,
                                  extra_body={"return_token_ids": True, **extra}, **kw)
    assert r.object == "text_completion"
    assert r.fucina["token_ids"] == ref.tokens
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.stop_reason == "max_tokens" else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.n_prompt, ref.n_gen)
    assert r.usage.total_tokens == ref.n_prompt + ref.n_gen
    if "seed" in sampling:
        assert r.fucina["seed"] == sampling["seed"]
    # streamed: the same text and tokens, chunk by chunk
    chunks = list(client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=24, stream=True,
                                            extra_body={"return_token_ids": True, **extra}, **kw))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert [t for c in chunks for t in (getattr(c, "fucina", None) or {}).get("token_ids", [])] == ref.tokens
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_unseeded_requests_get_a_seed_that_reproduces(client):
    a = client.completions.create(model="qwen3.gguf", prompt=PROMPTS[1], max_tokens=16,
                                  extra_body={"return_token_ids": True})
    seed = a.fucina["seed"]
    assert isinstance(seed, int)
    b = client.completions.create(model="qwen3.gguf", prompt=PROMPTS[1], max_tokens=16, seed=seed,
                                  extra_body={"return_token_ids": True})
    assert b.fucina["token_ids"] == a.fucina["token_ids"]


def test_completion_from_token_ids_and_default_max_tokens(server, tiny):
    ids = [5, 6, 7, 8, 9]
    ref = reference(tiny, ids, 16, temperature=0.0)  # OpenAI's default max_tokens for completions: 16
    status, r = get_json(server.url + "/v1/completions", {"prompt": ids, "temperature": 0,
                                                          "return_token_ids": True})
    assert status == 200, r
    assert r["fucina"]["token_ids"] == ref.tokens and r["usage"]["prompt_tokens"] == 5
    status, r1 = get_json(server.url + "/v1/completions", {"prompt": [ids], "temperature": 0})  # a batch of one
    assert status == 200 and r1["choices"][0]["text"] == r["choices"][0]["text"]


def test_chat_equals_generate(server, client, tiny):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids, stops = chat_ids_and_stops(tiny, messages)
    ref = reference(tiny, ids, 20, stop_ids=stops, temperature=0.8, seed=99)
    r = client.chat.completions.create(model="qwen3.gguf", messages=messages, max_tokens=20, temperature=0.8,
                                       seed=99, extra_body={"return_token_ids": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.fucina["token_ids"] == ref.tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), ref.n_gen)
    # max_completion_tokens, content as a list of text parts, and streaming
    parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    stream = client.chat.completions.create(model="qwen3.gguf", messages=parts, max_completion_tokens=20,
                                            temperature=0.8, seed=99, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.n_gen
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_sse_wire_format(server):
    """Raw bytes: `data: {json}` events, the chat stream's first chunk carries the role, `data: [DONE]` last."""
    status, headers, raw = request(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in chunks[0]  # include_usage not asked for
    assert chunks[-1]["fucina"]["speculation"] is None
    status, _, raw = request(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in events[:-2])


def test_stop_strings_cut_the_text(server, client, tiny):
    prompt = PROMPTS[2]
    ref = reference(tiny, _ids(tiny, prompt), 48, temperature=0.0)
    text = ref.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.find(stop)
    for spec in (False, True):
        r = client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=48, temperature=0, stop=stop,
                                      extra_body={"speculation": spec})
        assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=48, temperature=0,
                                                stop=[stop, "\x00never"], stream=True,
                                                extra_body={"speculation": spec}))
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == text[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_speculation_per_request_is_lossless_and_reports_stats(server, client, tiny):
    doc = "the cat sat on the mat and the dog sat on the log " * 3
    prompt = doc + "the cat"
    ref = reference(tiny, _ids(tiny, prompt), 40, temperature=0.0)
    for body in ({"speculation": True}, {"references": [doc]}, {"speculation": True, "references": [doc, "x y"]}):
        r = client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"return_token_ids": True, **body})
        assert r.fucina["token_ids"] == ref.tokens and r.choices[0].text == ref.text
        spec = r.fucina["speculation"]
        assert spec["committed"] >= 1 and {"drafted", "accepted", "steps", "acceptance"} <= set(spec)
    sampled = reference(tiny, _ids(tiny, prompt), 40, temperature=1.0, seed=5)
    r = client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=40, seed=5,
                                  extra_body={"return_token_ids": True, "speculation": True})
    assert r.fucina["token_ids"] == sampled.tokens
    r = client.completions.create(model="qwen3.gguf", prompt=prompt, max_tokens=4, temperature=0)
    assert r.fucina["speculation"] is None  # the server runs without --spec: off unless asked for


@pytest.mark.slow
def test_chat_on_smollm2(smollm2_path, smollm2):
    """The real SmolLM2-135M-Instruct and its own chat template, served as in-process generate gives it."""
    s = LiveServer(smollm2_path, "--ctx", "512")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids, stops = chat_ids_and_stops(smollm2, messages)
        ref = reference(smollm2, ids, 24, stop_ids=stops, temperature=0.0)
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=messages, max_tokens=24,
                                      temperature=0)
        assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ids)
        assert "<|im_start|>assistant" in smollm2.tokenizer.decode(ids)  # the file's own (ChatML) template
    finally:
        assert s.stop() == 0


# ---- bad input ------------------------------------------------------------------------------------------------

LONG = "the cat sat on the mat " * 200  # > 512 tokens: longer than the tiny model's context

BAD = [
    # (path, body (dict, or raw bytes), status, code, param)
    ("/v1/completions", b"{not json", 400, "invalid_json", None),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json", None),
    ("/v1/completions", b"\xff\xfe{", 400, "invalid_json", None),
    ("/v1/completions", {"max_tokens": 4}, 400, "missing_required_parameter", "prompt"),
    ("/v1/completions", {"prompt": 17}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_value", "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "invalid_value", "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "invalid_value", "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "invalid_value", "min_p"),
    ("/v1/completions", {"prompt": "x", "repeat_penalty": 0}, 400, "invalid_value", "repeat_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "invalid_value", "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "invalid_value", "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "invalid_value", "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**40}, 400, "invalid_value", "seed"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, 400, "invalid_type", "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "unsupported_value", "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_type", "stream"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": []}, 400, "invalid_type",
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "invalid_value", "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "invalid_type", "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, 400, "invalid_value", "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "references": "doc"}, 400, "invalid_type", "references"),
    ("/v1/completions", {"prompt": "x", "references": ["doc"], "speculation": False}, 400, "invalid_value",
     "references"),
    ("/v1/completions", {"prompt": "x", "references": ["d"] * 9}, 400, "invalid_value", "references"),
    ("/v1/completions", {"prompt": "x", "speculation": "on"}, 400, "invalid_type", "speculation"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "invalid_type", "model"),
    ("/v1/completions", {"prompt": "x", "model": "llama"}, 404, "model_not_found", "model"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "unsupported_parameter", "logprobs"),
    ("/v1/completions", {"prompt": "x", "user": 5}, 400, "invalid_type", "user"),
    ("/v1/completions", {"prompt": "\ud800x"}, 400, "invalid_value", "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": "qwen3.gguf"}, 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value",
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type",
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_value", "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded",
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400,
     "context_length_exceeded", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                              "max_completion_tokens": 6}, 400, "invalid_value", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400,
     "unsupported_parameter", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "unsupported_parameter", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "unsupported_parameter",
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "unsupported_value",
     "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1}, 400,
     "invalid_type", "chat_template_kwargs"),
]


def test_bad_input_gives_openai_errors_and_the_server_keeps_serving(server):
    failures = []
    for path, body, status, code, param in BAD:
        got, _, raw = request(server.url + path, body)
        try:
            err = json.loads(raw)["error"]
            ok = (got, err["code"], err["param"]) == (status, code, param) and err["type"] == "invalid_request_error"
            ok = ok and isinstance(err["message"], str) and err["message"]
        except (ValueError, KeyError, TypeError):
            ok, err = False, raw[:200]
        if not ok:
            failures.append((path, body if isinstance(body, bytes) else json.dumps(body)[:80], got, err))
    assert not failures, "\n".join(map(str, failures))
    # the limit is named in the message
    _, _, raw = request(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 600})
    assert "512" in json.loads(raw)["error"]["message"]
    # unknown routes and methods are error objects too
    status, _, raw = request(server.url + "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, _, raw = request(server.url + "/v1/completions", method="GET")
    assert status == 405 and "error" in json.loads(raw)
    # unknown fields are ignored, as OpenAI-compatible servers do
    status, r = get_json(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": [1]})
    assert status == 200 and r["usage"]["completion_tokens"] == 2
    assert wait_idle(server.url)["slots_free"] >= 1


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen3.gguf", prompt="x", max_tokens=4, temperature=7)
    assert e.value.code == "invalid_value" and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen3.gguf", messages=[{"role": "user", "content": LONG}])
    assert e.value.code == "context_length_exceeded"


# ---- disconnects, SIGTERM, load ----------------------------------------------------------------------------------

def test_client_disconnect_mid_stream_frees_the_slot(server):
    _, before = get_json(server.url + "/health")
    got = stream_and_hang_up(server.port, "/v1/completions",
                             {"prompt": "count", "max_tokens": 500, "temperature": 0, "stream": True,
                              "return_token_ids": True}, n_events=3)
    assert got.count(b"data: ") >= 3
    h = wait_idle(server.url)
    assert h["slots_free"] == h["slots_total"] and h["queued"] == 0
    assert h["cancelled"] == before["cancelled"] + 1  # stopped, not run to its 500 tokens
    status, r = get_json(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 200


def test_sigterm_finishes_the_in_flight_request_and_exits_0(tiny_path, tiny):
    ids = _ids(tiny, PROMPTS[3])
    ref = reference(tiny, ids, 480, temperature=0.0)
    for attempt in range(3):  # the tiny model may finish the request before a poll sees it running: try again
        s = LiveServer(tiny_path, "--shutdown-timeout", "20")
        out = {}

        def ask():
            out["r"] = get_json(s.url + "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 480,
                                                            "temperature": 0, "return_token_ids": True})
            out["t"] = time.monotonic()

        t = threading.Thread(target=ask)
        t.start()
        try:
            h = wait_health(s.url, lambda h: h["slots_free"] < h["slots_total"] or "r" in out)
            running = h["slots_free"] < h["slots_total"] and "r" not in out  # the request is running
            t_term = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            rc = s.proc.wait(30)
        finally:
            if s.proc.poll() is None:  # a failed check must not leave the server running
                s.proc.kill()
        t.join(30)
        if running:
            break
    assert running, "the request was never seen in flight in 3 attempts"
    assert rc == 0, s.log
    status, r = out["r"]
    assert status == 200 and r["fucina"]["token_ids"] == ref.tokens
    assert out["t"] > t_term  # it was in flight when the signal came


def test_bounded_load(server, tiny):
    """36 requests at concurrency 8: completions and chat, streaming and not, greedy and seeded, mixed lengths,
    some hanging up mid-stream. Every completed response equals its single-request output (so none is mixed with
    another), and no slot leaks."""
    rng = random.Random(0)
    jobs = []
    for i in range(36):
        chat = i % 3 == 0
        job = dict(chat=chat, stream=i % 2 == 0, max_tokens=rng.choice([3, 8, 16, 32, 48]),
                   prompt=PROMPTS[i % len(PROMPTS)], seed=None if i % 4 == 0 else 1000 + i,
                   hang_up=i % 7 == 3)
        job["hang_up"] = job["hang_up"] and job["stream"]
        jobs.append(job)

    expected = {}
    for j in jobs:
        if j["chat"]:
            ids, stops = chat_ids_and_stops(tiny, [{"role": "user", "content": j["prompt"]}])
        else:
            ids, stops = _ids(tiny, j["prompt"]), None
        sampling = dict(temperature=0.0) if j["seed"] is None else dict(temperature=1.0, seed=j["seed"])
        expected[id(j)] = reference(tiny, ids, j["max_tokens"], stop_ids=stops, **sampling)

    def run(j):
        body = {"max_tokens": j["max_tokens"], "return_token_ids": True, "stream": j["stream"]}
        body.update(temperature=0) if j["seed"] is None else body.update(seed=j["seed"])
        if j["chat"]:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": j["prompt"]}]
        else:
            path = "/v1/completions"
            body["prompt"] = j["prompt"]
        if j["hang_up"]:
            stream_and_hang_up(server.port, path, body, n_events=2)
            return j, None, None
        status, _, raw = request(server.url + path, body, timeout=120)
        assert status == 200, raw
        if not j["stream"]:
            r = json.loads(raw)
            text = r["choices"][0]["message"]["content"] if j["chat"] else r["choices"][0]["text"]
            return j, text, r["fucina"]["token_ids"]
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        text, ids = "", []
        for e in events[:-1]:
            c = e["choices"][0]
            text += (c["delta"].get("content") or "") if j["chat"] else c["text"]
            ids += e.get("fucina", {}).get("token_ids", [])
        return j, text, ids

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    assert time.monotonic() - t0 < 120
    for j, text, ids in results:
        if j["hang_up"]:
            continue
        ref = expected[id(j)]
        assert ids == ref.tokens, j
        assert text == ref.text, j
    h = wait_idle(server.url)
    assert h["slots_free"] == h["slots_total"] and h["queued"] == 0 and h["failed"] == 0


# ---- faults that need a scripted backend (in-process server) ---------------------------------------------------

class _ScriptedGeneration:
    """A Generation stand-in: yields token 65 every `delay` seconds, `fail_after` tokens then raises, or runs
    until the backend stops reading (cancel) or `release` is set."""

    def __init__(self, fail_after=None, release=None, delay=0.005):
        self.fail_after, self.release, self.delay = fail_after, release, delay
        self.result = types.SimpleNamespace(stop_reason="max_tokens", spec=None)
        self.decoder = None

    def __iter__(self):
        n = 0
        while self.release is None or not self.release.is_set():
            if self.fail_after is not None and n >= self.fail_after:
                raise RuntimeError("injected fault")
            time.sleep(self.delay)
            n += 1
            yield 65


@pytest.fixture(scope="module")
def scripted(tiny, tiny_path):
    from fucina_jax.serve.app import create_app
    from fucina_jax.serve.backend import SerialBackend
    from fucina_jax.serve.protocol import ModelInfo

    class Scripted(SerialBackend):
        release = threading.Event()

        def _generation(self, req):
            if "FAIL" in req.references:
                return _ScriptedGeneration(fail_after=3)
            if "HOLD" in req.references:
                return _ScriptedGeneration(release=self.release)
            return super()._generation(req)

    backend = Scripted(tiny, ctx=512, queue_size=1)
    info = ModelInfo.from_model(tiny, ctx=512, path=tiny_path)
    s = InProcessServer(create_app(backend, info, shutdown_timeout=5))
    s.backend = backend
    yield s
    backend.release.set()
    s.stop()


def test_a_failing_request_fails_alone(scripted, tiny):
    url = scripted.url
    status, _, raw = request(url + "/v1/completions", {"prompt": "x", "max_tokens": 50, "references": ["FAIL"]})
    err = json.loads(raw)["error"]
    assert status == 500 and err["type"] == "server_error" and "injected fault" in err["message"]
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    chunks = []
    with pytest.raises(openai.APIError, match="injected fault"):
        for chunk in c.completions.create(model="qwen3.gguf", prompt="x", max_tokens=50, stream=True,
                                          extra_body={"references": ["FAIL"]}):
            chunks.append(chunk)
    assert len(chunks) == 3  # the tokens before the fault were streamed
    ref = reference(tiny, _ids(tiny, "x"), 5, temperature=0.0)
    r = c.completions.create(model="qwen3.gguf", prompt="x", max_tokens=5, temperature=0)
    assert r.choices[0].text == ref.text
    h = wait_idle(url)
    assert h["failed"] == 2 and h["slots_free"] == 1


def test_full_queue_is_503_with_retry_after_and_disconnects_free_the_slot(scripted):
    url, port, backend = scripted.url, scripted.port, scripted.backend
    backend.release.clear()
    hold = {"prompt": "x", "max_tokens": 400, "stream": True, "references": ["HOLD"]}
    _, before = get_json(url + "/health")
    results = {}
    t1 = threading.Thread(target=lambda: results.setdefault("a", request(url + "/v1/completions", hold)))
    t1.start()
    _until(url, lambda h: h["slots_free"] == 0)
    t2 = threading.Thread(target=lambda: results.setdefault("b", request(url + "/v1/completions", hold)))
    t2.start()
    _until(url, lambda h: h["queued"] == 1)
    status, headers, raw = request(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})  # queue of 1: full
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert json.loads(raw)["error"]["code"] == "server_overloaded"
    backend.release.set()  # both held requests end
    t1.join(30)
    t2.join(30)
    assert results["a"][0] == 200 and sse_events(results["a"][2])[-1] == "[DONE]"
    # a request that would never end, whose client hangs up: cancelled at its next token
    backend.release.clear()
    stream_and_hang_up(port, "/v1/completions", hold, n_events=5)
    h = wait_idle(url)
    assert h["slots_free"] == 1 and h["cancelled"] == before["cancelled"] + 1
    # a non-streaming client that hangs up is noticed too
    import socket

    body = json.dumps({**hold, "stream": False}).encode()
    with socket.create_connection((HOST, port)) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _until(url, lambda h: h["slots_free"] == 0)
    h = wait_idle(url)
    assert h["slots_free"] == 1 and h["cancelled"] == before["cancelled"] + 2
    backend.release.set()


# ---- the command line ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--port", "abc"], "--port must be an integer"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--queue", "-1"], "--queue must be >= 0"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["/no/such/model.gguf"], "model file not found"),
])
def test_bad_flags_one_error_line_exit_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "fucina_jax.serve", *argv], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr


def test_port_in_use_fails_at_once_with_one_line():
    import socket

    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "fucina_jax.serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=60)  # before the model loads
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and f"cannot listen on {HOST}:{port}" in lines[0], p.stderr


def test_scripts_serve_help():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "serve.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "--max-batch" in p.stdout and "127.0.0.1" in p.stdout
