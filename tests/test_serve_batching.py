"""The continuous-batching backend in-process (serve/batching.py): many requests through a few decoder rows, each
answer equal to the same request alone (fucina_jax.generate), with joins, cancellations, stop strings, prompt-cache
reuse and a failing draft source along the way; no slot leaks.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from fucina_jax.generate import generate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.serve.backend import Delta, Done, Failed, GenRequest
from fucina_jax.serve.batching import MIN_REUSE, BatchingBackend
from fucina_jax.speculative import SpecOptions

CTX = 256
ALWAYS = SpecOptions(policy="gate", max_draft=7, min_speedup=0.0, adapt_budget=False)  # every draft is verified


@pytest.fixture(scope="module")
def model(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


def collect(ticket, timeout=120.0):
    """(token ids, text, the final event) of one ticket."""
    ids, text = [], ""
    deadline = time.monotonic() + timeout
    while True:
        ev = ticket.events.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(ev, Delta):
            ids += ev.token_ids
            text += ev.text
        else:
            return ids, text, ev


def requests(model, n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(5, 200, int(rng.integers(3, 9))).tolist()
        prompt = (base * 8)[: int(rng.integers(4, 60))]  # repetitive: the index has drafts to offer
        sampler = SamplerConfig(temperature=0.0, seed=0) if i % 3 == 0 else SamplerConfig(
            temperature=0.8, top_k=20, repeat_penalty=1.2, seed=1000 + i)
        stops = frozenset() if i % 4 else frozenset({int(rng.integers(5, 200))})
        out.append(GenRequest(prompt, int(rng.integers(1, 40)), sampler.validate(), stops, speculation=i % 2 == 0))
    return out


def alone(model, req):
    return generate(model, req.prompt_ids, max_tokens=req.max_tokens, sampler=req.sampler, ctx=CTX,
                    stop_ids=req.stop_ids).run()


def test_concurrent_requests_equal_each_alone(model):
    """24 requests submitted from 6 threads into 3 rows (greedy and sampled, speculative and plain, stop ids, mixed
    lengths): every answer is the request's plain stream, finish reasons map, and every slot is free at the end."""
    reqs = requests(model, 24)
    backend = BatchingBackend(model, ctx=CTX, max_batch=3, queue_size=32, spec_options=ALWAYS)
    results = [None] * len(reqs)

    def client(idx):
        for i in idx:
            results[i] = collect(backend.submit(reqs[i]))

    threads = [threading.Thread(target=client, args=(range(k, len(reqs), 6),)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    try:
        for req, (ids, text, done) in zip(reqs, results):
            want = alone(model, req)
            assert isinstance(done, Done), done
            assert ids == want.tokens
            assert done.finish_reason == {"stop": "stop", "max_tokens": "length", "context": "length"}[
                want.stop_reason]
            assert done.usage["completion_tokens"] == len(want.tokens)
            assert text == model.tokenizer.decode(want.tokens)
        spec = [done.spec_stats for req, (_, _, done) in zip(reqs, results) if req.speculation]
        assert sum(s["accepted"] for s in spec) > 0  # speculation ran in the batch
        h = backend.health()
        assert h["slots_free"] == 3 and h["queued"] == 0 and h["failed"] == 0 and h["served"] == len(reqs)
    finally:
        backend.shutdown(10)


def test_cancel_stop_strings_reuse_and_a_failing_source(model):
    backend = BatchingBackend(model, ctx=CTX, max_batch=2, queue_size=8, spec_options=ALWAYS)
    try:
        greedy = SamplerConfig(temperature=0.0, seed=0).validate()
        long = GenRequest(list(range(10, 30)), 200, greedy, frozenset())
        # a cancelled request frees its row at the next step; the one waiting behind it then runs
        t1 = backend.submit(long)
        first = t1.events.get(timeout=60)
        assert isinstance(first, Delta)
        t1.cancel()
        ids, _, done = collect(t1)
        assert done.finish_reason == "cancelled" and len(ids) < 200
        # a stop string: the text is cut before it, the tokens are a prefix of the plain stream
        want = alone(model, GenRequest(list(range(40, 52)), 30, greedy, frozenset()))
        text = model.tokenizer.decode(want.tokens)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        ids, got_text, done = collect(backend.submit(GenRequest(list(range(40, 52)), 30, greedy, frozenset(),
                                                                stop_strings=(stop,))))
        assert done.finish_reason == "stop" and got_text == text[: text.find(stop)]
        assert ids == want.tokens[: len(ids)]
        # prompt-cache reuse: a request extending a finished one's stream takes its row, prefills only the rest
        base = GenRequest(list(range(60, 60 + MIN_REUSE + 4)), 12, greedy, frozenset(), speculation=True)
        ids, _, _ = collect(backend.submit(base))
        before = backend.health()["reused_prompt_tokens"]
        follow = GenRequest(base.prompt_ids + ids + [7, 8, 9], 12, greedy, frozenset(), speculation=True)
        ids2, _, done = collect(backend.submit(follow))
        assert backend.health()["reused_prompt_tokens"] - before >= len(base.prompt_ids) + len(ids) - 1
        assert ids2 == alone(model, follow).tokens
        # a draft source that raises fails its own request; a request beside it is served
        import fucina_jax.serve.batching as batching

        real = batching.default_source

        class Boom:
            wants_topk = False

            def suggest(self, context, buf):
                raise RuntimeError("source exploded")

            def observe(self, committed):
                pass

        batching.default_source = lambda model, references=(): Boom()
        try:
            bad = backend.submit(GenRequest(list(range(90, 100)), 10, greedy, frozenset(), speculation=True))
            good = backend.submit(GenRequest(list(range(100, 110)), 10, greedy, frozenset()))
            _, _, bad_done = collect(bad)
            good_ids, _, good_done = collect(good)
        finally:
            batching.default_source = real
        assert isinstance(bad_done, Failed) and "exploded" in str(bad_done.error)
        assert isinstance(good_done, Done) and good_ids == alone(model, good.request).tokens
        h = backend.health()
        assert h["slots_free"] == 2 and h["failed"] == 1 and h["cancelled"] == 1
    finally:
        backend.shutdown(10)


def test_prepare_steps_brings_in_every_row_bucket_and_width(model):
    """--warmup-all: after one request, prepare_steps() brings in the step program of every row bucket up to
    max_batch at every width (verifies with the recycling feedback), so a later step of any shape only runs; a
    second call has nothing left to bring in."""
    from fucina_jax import engine

    backend = BatchingBackend(model, ctx=CTX, max_batch=3, queue_size=4, spec_options=ALWAYS)
    try:
        collect(backend.submit(requests(model, 1)[0]))
        brought = backend.prepare_steps()
        dec = backend.decoder
        for n_step in (1, 2, 3):
            for width in engine.STEP_WIDTHS:
                spec = jax.ShapeDtypeStruct((n_step, width), np.int32)
                fn, args, kwargs = dec._step_call(spec, spec, list(range(n_step)), np.zeros(n_step, np.int32),
                                                  dec.cache, width > 1)
                assert fn.has(fn.program_key(*args, **kwargs)), (n_step, width)
        assert brought >= 1 and backend.prepare_steps() == 0
    finally:
        backend.shutdown(10)
