"""The per-step economics (speculative/economics.py) as pure functions, and the decoder under the "economics"
policy: the stream is still plain decoding's, widths follow the evidence, and a step that verifies nothing is one
compiled call like a plain step."""

from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import ScriptedSource, garbage, perfect

from fucina_jax import aot, engine
from fucina_jax.decoder import Decoder, Request
from fucina_jax.generate import generate, generate_speculative
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import CostPoint, SpecOptions
from fucina_jax.index.protocol import match_bucket
from fucina_jax.speculative.economics import AcceptanceModel, choose_width, expected_committed, key_prior

CTX = 128
GREEDY = SamplerConfig(temperature=0.0, top_k=20, seed=0)
SAMPLED = SamplerConfig(temperature=0.8, top_k=20, repeat_penalty=1.3, repeat_last_n=64, seed=77)
# a cost curve like this machine class's: C(2, 4, 8, 16) = 1.05, 1.14, 1.5, 2.5
TABLE = (CostPoint(1, 1.05), CostPoint(3, 1.14), CostPoint(7, 1.5), CostPoint(15, 2.5))
ECON = SpecOptions(cost_table=TABLE)


def cost(w):
    return {1: 1.0, 2: 1.05, 4: 1.14, 8: 1.5, 16: 2.5}[w]


def test_acceptance_model_counts_conditional_acceptance_per_depth():
    m = AcceptanceModel(prior_mean=0.25, strength=4.0, window=1e9)
    np.testing.assert_allclose(m.chain("k", 2), [0.25, 0.0625])  # the prior alone, every depth
    for _ in range(6):
        m.record("k", drafted=4, accepted=1)  # depth 1 accepted, depth 2 rejected, 3-4 never tried
    c = m.chain("k", 4)
    p1 = (6 + 4 * 0.25) / (6 + 4)
    p2 = (0 + 4 * p1) / (6 + 4)  # shrunk toward depth 1
    np.testing.assert_allclose(c, np.cumprod([p1, p2, p2, p2]))  # depths 3-4: no evidence, as good as depth 2
    for _ in range(20):
        m.record("sure", drafted=2, accepted=2)
    sure = m.chain("sure", 8)
    assert sure[1] > 0.8 and sure[7] > 0.7  # untried depths inherit the tried ones' estimate
    assert m.chain("other", 1)[0] == pytest.approx(0.25)  # keys are independent
    windowed = AcceptanceModel(window=8.0)
    for _ in range(100):
        windowed.record("k", 1, 1)
    for _ in range(8):
        windowed.record("k", 1, 0)
    assert windowed.chain("k", 1)[0] < 0.6  # old evidence fades: the recent rejections weigh
    # a key's match length is evidence before any verify: long verbatim matches start near-certain
    assert AcceptanceModel().chain("conversation:32", 1)[0] == pytest.approx(0.9)
    # a key's kept chain follows its counts: recomputed after every record, equal to a fresh model's
    kept, fresh = AcceptanceModel(), None
    for i in range(30):
        assert len(kept.cumulative("ref0:4")) == 15
        kept.record("ref0:4", 1 + i % 7, i % 3)
        fresh = AcceptanceModel()
        for j in range(i + 1):
            fresh.record("ref0:4", 1 + j % 7, j % 3)
        assert kept.cumulative("ref0:4") == fresh.cumulative("ref0:4")
    assert key_prior("ref0:1") < key_prior("outputs:8") < key_prior("conversation:16") and key_prior("x") == 0.25
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 1000)] == [0, 1, 2, 2, 4, 4, 8, 16, 32, 32]


def test_choose_width_maximises_expected_tokens_per_cost():
    widths = engine.STEP_WIDTHS
    sure = np.cumprod(np.full(15, 0.99))
    weak = np.cumprod(np.full(15, 0.05))
    w, v = choose_width([sure], widths, cost, 0.02)
    assert w == 16 and v == pytest.approx(expected_committed(sure, 16) / 2.5)
    assert choose_width([weak], widths, cost, 0.02) == (1, 1.0)  # nothing pays: a plain step
    # p1 = 0.3 and nothing after: 1.3 / 1.05 beats every wider width
    assert choose_width([np.array([0.3, 0.03, 0.003])], widths, cost, 0.02)[0] == 2
    # a 3-token draft never buys a 16-row step; an empty draft counts as a plain row
    assert choose_width([sure[:3]], widths, cost, 0.02)[0] == 4
    w, v = choose_width([sure[:3], np.zeros(0)], widths, cost, 0.02)
    assert w == 4 and v == pytest.approx((expected_committed(sure[:3], 4) + 1) / (2 * 1.14))
    assert choose_width([np.array([0.06])], widths, cost, 0.02)[0] == 1  # 1.06 / 1.05 is within the margin
    # the decoder passes lists (AcceptanceModel.cumulative): the same choice as arrays, and as a direct evaluation
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows = [np.cumprod(rng.uniform(0.0, 1.0, rng.integers(0, 16))) for _ in range(rng.integers(1, 5))]
        got = choose_width([r.tolist() for r in rows], widths, cost, 0.02)
        assert got == choose_width(rows, widths, cost, 0.02)
        longest = max(len(r) for r in rows)
        values = {w: sum(expected_committed(r, w) for r in rows) / (len(rows) * cost(w)) for w in widths
                  if 1 < w and longest and w <= next(x for x in widths if x >= longest + 1)}
        best = max(values, key=lambda w: (values[w], -w), default=1)
        want = best if values and values[best] > 1.02 else 1
        assert got[0] == want, (rows, values)


@pytest.fixture(scope="module")
def qwen3(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


def prompt_of(model):
    return model.tokenizer.encode("0 1 2 3 0 1 2 3 0 1 2", add_special=True)


@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["perfect", "garbage", "mixed"])
def test_economics_policy_is_lossless_and_follows_the_evidence(qwen3, sampler, kind):
    prompt = prompt_of(qwen3)
    plain = generate(qwen3, prompt, max_tokens=60, sampler=sampler, ctx=CTX, stop_ids=()).run()
    truth = prompt + plain.tokens
    good, bad = perfect(truth), garbage(truth, qwen3.config.n_vocab)
    fn = {"perfect": good, "garbage": bad,
          "mixed": lambda s, k: bad(s, k) if (len(s) // 10) % 2 else good(s, k)}[kind]
    src = ScriptedSource(fn)
    src.evidence = lambda: "scripted"
    res = generate_speculative(qwen3, prompt, max_tokens=60, sampler=sampler, ctx=CTX, stop_ids=(), source=src,
                               options=ECON, clock=False).run()
    assert res.tokens == plain.tokens
    s = res.spec
    assert s["policy"] == "economics"
    if kind == "perfect":
        # the prior (p = 0.25) pays at width 2; acceptance then makes wider verifies pay
        assert s["verify_steps"] >= 1 and max(int(w) for w in s["widths"]) >= 8 and s["tok_per_step"] > 3
    elif kind == "garbage":
        # the prior pays for width 2 (C = 1.05) until about ten rejections bring p1 below 7%; from then on
        # nothing is verified, and the unverified drafts' first tokens keep the evidence low
        assert s["verify_steps"] <= 12 and s["rejected"] == s["verify_steps"] and set(s["widths"]) <= {"1", "2"}
        assert s["widths"]["1"] >= s["steps"] - 12
    else:
        assert s["verify_steps"] >= 2 and s["accepted"] > 0


def test_a_step_that_verifies_nothing_is_one_compiled_call(qwen3, monkeypatch):
    """With drafts the evidence does not back, each step is exactly one compiled call (the plain step's width 1),
    nothing traced or compiled after the first: the economics add host arithmetic only."""
    prompt = prompt_of(qwen3)
    plain = generate(qwen3, prompt, max_tokens=40, sampler=GREEDY, ctx=CTX, stop_ids=()).run()
    src = ScriptedSource(garbage(prompt + plain.tokens, qwen3.config.n_vocab))
    src.evidence = lambda: "hopeless"
    dec = Decoder(qwen3, ctx=CTX, options=ECON)
    dec.acceptance.record("hopeless", 1, 0)  # some evidence that this key loses
    for _ in range(30):
        dec.acceptance.record("hopeless", 1, 0)
    dec.first(dec.begin([Request(tuple(prompt), 40, GREEDY.validate(), frozenset(), src)]))
    dec.step()  # warm
    calls = []
    real = aot.Step.__call__
    monkeypatch.setattr(aot.Step, "__call__", lambda self, *a, **k: (calls.append(self.name), real(self, *a, **k))[1])
    events = aot.events()
    n = 0
    while dec.active:
        dec.step()
        n += 1
    assert n > 10 and calls == ["fucina_jax.engine.decode_sample_step"] * n
    assert aot.events() == events
    assert dec.rows[0].generated == plain.tokens and set(dec.widths) == {1}


def test_step_costs_are_learned_per_width():
    """The cost model: the table (times the live scale) until a width is timed, slightly optimistic for unmeasured
    widths while a clock runs (so a near miss is tried once), then the measured EWMA, per batch size."""
    from fucina_jax.speculative import CostGate

    gate = CostGate(SpecOptions(cost_table=TABLE))
    assert gate.step_cost(1) == 1.0 and gate.step_cost(16) == pytest.approx(2.5)  # no clock yet: the table
    gate.note_plain_ns(1000.0)
    assert gate.step_cost(16) == pytest.approx(2.5 * (1 - CostGate.UNMEASURED_DISCOUNT))
    gate.note_step(16, 1, 1800.0)  # this machine's 16-row step costs 1.8 plain steps, not 2.5
    assert gate.step_cost(16) == pytest.approx(1.8)
    gate.note_step(16, 1, 2800.0)
    assert gate.step_cost(16) == pytest.approx(0.2 * 2.8 + 0.8 * 1.8)
    assert gate.step_cost(16, rows=4) != gate.step_cost(16)  # a batch's costs are its own
    gate.note_step(8, 4, 6000.0)
    assert gate.step_cost(8, rows=4) == pytest.approx(6.0)


def test_batch_steps_are_priced_from_the_batch_surface_then_a_model():
    """A batch step: the cost table's batch surface, else the model from the single-stream curve (the batch's plain
    step from the surface, else measured live, else C_1(rows)), then the batch's own measured EWMA."""
    from fucina_jax.speculative import CostGate

    gate = CostGate(SpecOptions(cost_table=TABLE, batch_costs=((4, 1, 1.2), (4, 4, 1.6))))
    assert gate.step_cost(4, rows=4) == pytest.approx(1.6)  # the surface
    c1_32 = 2.5 + (31 - 15) * (2.5 - 1.5) / 8  # past the table: along its last slope
    assert gate.single_stream_cost(32) == pytest.approx(c1_32)
    assert gate.step_cost(8, rows=4) == pytest.approx(1 + (c1_32 - 1.14) / 1.2)  # the model, the surface's plain
    assert gate.step_cost(8, rows=2) == pytest.approx(1 + (2.5 - 1.05) / 1.05)  # no plain entry: C_1(2)
    assert gate.step_cost(8, rows=2) > gate.step_cost(8)  # a batch verify costs more than one row's
    gate.note_plain_ns(1000.0, rows=1)
    gate.note_plain_ns(2000.0, rows=2)  # measured: the 2-row plain step costs 2 one-row steps
    d = 1 - CostGate.UNMEASURED_DISCOUNT
    assert gate.step_cost(8, rows=2) == pytest.approx((1 + (2.5 - 1.05) / 2) * d)
    gate.note_step(8, 2, 3000.0)
    assert gate.step_cost(8, rows=2) == pytest.approx(1.5)  # the batch's own measurement wins


def test_batch_cost_model_against_the_shipped_surface():
    """The model, given only the shipped surface's plain ratios, against the widths the surface measured: within
    -20%..+25% everywhere, and above the measurement (an unmeasured width is not overbought) at most points."""
    from fucina_jax.speculative import DEFAULT_BATCH_COSTS, CostGate

    plain = tuple(e for e in DEFAULT_BATCH_COSTS if e[1] == 1)
    gate = CostGate(SpecOptions(batch_costs=plain))
    ratios = [gate.modelled_cost(w, r) / c for r, w, c in DEFAULT_BATCH_COSTS if w > 1]
    assert len(ratios) >= 9 and all(0.8 <= x <= 1.25 for x in ratios)
    assert sum(x >= 1 for x in ratios) >= 0.75 * len(ratios)


def test_a_live_decoder_verifies_only_at_widths_whose_program_is_in(qwen3, monkeypatch):
    """With a clock, a verify width whose step program is not in the process is not chosen: the background
    preparer brings it in while the row steps at the widths that are ready. No verify call ever brings its program
    in itself (so no request waits for the compiler), verifies happen once the programs are in, and the stream is
    the plain one."""
    import time

    prompt = prompt_of(qwen3)
    plain = generate(qwen3, prompt, max_tokens=120, sampler=GREEDY, ctx=CTX, stop_ids=()).run()
    aot.clear()  # no verify program in the process; the plain step's comes back from the store at its first call
    calls = []
    real = aot.Step.__call__

    def spy(self, *a, **k):
        if self.name.endswith("decode_sample_step") and a[1].shape[1] > 1:
            calls.append(self.has(self.program_key(*a, **k)))
        return real(self, *a, **k)

    monkeypatch.setattr(aot.Step, "__call__", spy)
    background = sum(aot.BACKGROUND.values())
    src = ScriptedSource(perfect(prompt + plain.tokens))
    dec = Decoder(qwen3, ctx=CTX, options=ECON, clock=time.perf_counter_ns, background_compile=True)
    dec.first(dec.begin([Request(tuple(prompt), 120, GREEDY.validate(), frozenset(), src)]))
    while dec.active:
        dec.step()
        if not calls:
            time.sleep(0.02)  # give the background preparer time while the row steps plainly
    assert dec.rows[0].generated == plain.tokens
    assert calls and all(calls)  # verified, and only with programs already in
    assert dec.widths.get(1, 0) >= 1  # at least one step ran plainly while a width was being prepared
    assert sum(aot.BACKGROUND.values()) > background
    assert aot.PREPARER.wait_idle(120)  # nothing left queued
