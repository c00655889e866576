"""Speculative decoding == plain decoding, on the tiny Qwen3 fixture (design record section 2, every obligation).

The reference is fucina_jax.generate.generate (the plain loop). Adversarial draft sources (tests/spec_helpers.py)
drive every accept/reject path; the gate is held open (min_speedup 0, no adaptive budget) where a test needs every
step to verify.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import ScriptedSource, all_sources, alternating, garbage, perfect

from fucina_jax import aot, engine, sampling
from fucina_jax.decoder import CONTEXT, Decoder, Request
from fucina_jax.errors import ContextFullError, DraftSourceError, SpecOptionsError
from fucina_jax.generate import generate, generate_speculative
from fucina_jax.index import SpeculationIndex
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import CostPoint, SpecOptions

CTX = 128
GREEDY = SamplerConfig(temperature=0.0, top_k=20, seed=0)  # top_k 20: same candidate cap as SAMPLED
SAMPLED = SamplerConfig(
    temperature=0.8, top_k=20, repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, repeat_last_n=64,
    seed=1234,
)
ALWAYS = SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False)  # the gate never trips: every draft is verified
PROMPTS = {
    "text": "hello world hello world, the quick brown fox",
    "digits": "0 1 2 3 0 1 2 3 0 1 2",
}


@pytest.fixture(scope="module")
def qwen3(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


_PLAIN: dict = {}


def plain_run(model, prompt, sampler=GREEDY, max_tokens=60, ctx=CTX, stop_ids=()):
    """The plain loop's result, computed once per arguments for the whole module."""
    key = (id(model), tuple(prompt), sampler, max_tokens, ctx, tuple(stop_ids) if stop_ids is not None else None)
    if key not in _PLAIN:
        _PLAIN[key] = generate(model, prompt, max_tokens=max_tokens, sampler=sampler, ctx=ctx,
                               stop_ids=stop_ids).run()
    return _PLAIN[key]


def spec_run(model, prompt, source, sampler=GREEDY, max_tokens=60, ctx=CTX, stop_ids=(), options=ALWAYS, **kw):
    return generate_speculative(model, prompt, max_tokens=max_tokens, sampler=sampler, ctx=ctx, stop_ids=stop_ids,
                                source=source, options=options, clock=False, **kw).run()


def ids(model, name):
    return model.tokenizer.encode(PROMPTS[name], add_special=True)


def check_observed(source, prompt, result):
    """observe() saw every committed id exactly once, in order; observe_topk rows align with each observe."""
    assert source.observed == list(prompt) + result.tokens
    for committed, rows in source.topk_calls:
        assert rows.ndim == 2 and rows.shape[1] == engine.TOPK_FEEDBACK and rows.shape[0] == len(committed)


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("kind", ["perfect", "garbage", "alternating", "empty"])
def test_greedy_lossless_adversarial_sources(qwen3, name, kind):
    prompt = ids(qwen3, name)
    plain = plain_run(qwen3, prompt)
    truth = prompt + plain.tokens
    source = all_sources(truth, qwen3.config.n_vocab)[kind]
    res = spec_run(qwen3, prompt, source)
    assert res.tokens == plain.tokens and res.stop_reason == plain.stop_reason
    check_observed(source, prompt, res)
    s = res.spec
    assert s["committed"] == len(res.tokens) - 1  # the first token comes from the prefill logits
    if kind == "perfect":
        assert s["accepted"] == s["drafted"] > 0 and s["rejected"] == 0 and s["tok_per_step"] > 4
    elif kind == "garbage":
        assert s["accepted"] == 0 and s["rejected"] == s["verify_steps"] > 0 and s["committed"] == s["steps"]
    elif kind == "alternating":
        assert 0 < s["accepted"] < s["drafted"] and s["rejected"] > 0
    else:
        assert s["verify_steps"] == 0 and s["fallback_steps"] == s["steps"]


def test_topk_rows_come_from_the_committing_rows(qwen3):
    """observe_topk gets one raw row per committed id, in order: greedy without penalties commits each row's
    top-1 (the fixture's logits have no near-ties)."""
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt)
    src = ScriptedSource(alternating(prompt + plain.tokens, qwen3.config.n_vocab))
    res = spec_run(qwen3, prompt, src)
    assert res.tokens == plain.tokens
    assert len(src.topk_calls) == res.spec["verify_steps"]
    for committed, rows in src.topk_calls:
        assert rows[:, 0].tolist() == committed


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_lossless_cascade(qwen3, name):
    prompt = ids(qwen3, name)
    plain = plain_run(qwen3, prompt)
    res = spec_run(qwen3, prompt, None, options=None)  # the default cascade and default gate
    assert res.tokens == plain.tokens and res.stop_reason == plain.stop_reason
    assert res.spec["verify_steps"] > 0 and res.spec["sources_summary"].startswith("spec sources: conversation")


@pytest.mark.parametrize("seed", [1234, 7])
@pytest.mark.parametrize("kind", ["perfect", "garbage", "alternating", "cascade"])
def test_sampled_lossless(qwen3, kind, seed):
    """Temperature 0.8, top-k 20, repeat/frequency/presence penalties on: the same stream for the same seed."""
    import dataclasses

    sampler = dataclasses.replace(SAMPLED, seed=seed)
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, sampler=sampler)
    truth = prompt + plain.tokens
    source = None if kind == "cascade" else all_sources(truth, qwen3.config.n_vocab)[kind]
    res = spec_run(qwen3, prompt, source, sampler=sampler)
    assert res.tokens == plain.tokens and res.seed == plain.seed == seed
    if kind == "perfect":
        assert res.spec["accepted"] == res.spec["drafted"] > 20


def test_stop_id_inside_an_accepted_run(qwen3):
    """An end-of-generation id drafted and accepted mid-verify ends the run there, uncommitted and unobserved."""
    prompt = ids(qwen3, "text")
    free = plain_run(qwen3, prompt, stop_ids=())
    truth = prompt + free.tokens
    # a stop id whose first occurrence is well inside the stream, so a perfect draft runs through it
    j = next(i for i, t in enumerate(free.tokens) if i >= 5 and t not in free.tokens[:i])
    stop = free.tokens[j]
    plain = plain_run(qwen3, prompt, stop_ids=(stop,))
    assert plain.stop_reason == "stop" and plain.tokens == free.tokens[:j]
    src = ScriptedSource(perfect(truth))
    res = spec_run(qwen3, prompt, src, stop_ids=(stop,))
    assert res.tokens == plain.tokens and res.stop_reason == "stop"
    assert src.observed == prompt + plain.tokens  # the stop id and the rows past it were never shown


@pytest.mark.parametrize("max_tokens, ctx", [(1, CTX), (2, CTX), (13, CTX), (29, CTX), (60, 40), (60, 23)])
def test_max_tokens_and_context_stop_mid_draft(qwen3, max_tokens, ctx):
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, max_tokens=max_tokens, ctx=ctx)
    assert plain.stop_reason == ("context" if ctx < CTX else "max_tokens")
    free = plain_run(qwen3, prompt, max_tokens=120)
    src = ScriptedSource(perfect(prompt + free.tokens))  # drafts run past the stop point
    res = spec_run(qwen3, prompt, src, max_tokens=max_tokens, ctx=ctx)
    assert res.tokens == plain.tokens and res.stop_reason == plain.stop_reason
    assert src.observed == prompt + plain.tokens


def test_max_tokens_zero_and_prompt_validation(qwen3):
    prompt = ids(qwen3, "digits")
    res = spec_run(qwen3, prompt, None, max_tokens=0)
    assert res.tokens == [] and res.stop_reason == "max_tokens"
    with pytest.raises(ValueError):
        spec_run(qwen3, prompt, None, max_tokens=-1)
    with pytest.raises(ValueError):
        spec_run(qwen3, [], None)
    with pytest.raises(ContextFullError):
        spec_run(qwen3, prompt, None, ctx=len(prompt))
    with pytest.raises(DraftSourceError, match="add_reference"):
        spec_run(qwen3, prompt, ScriptedSource(lambda s, k: []), references=[[1, 2, 3]])
    with pytest.raises(SpecOptionsError, match="max_draft"):
        spec_run(qwen3, prompt, None, options=SpecOptions(max_draft=16))


def test_a_decoder_never_writes_past_its_cache_slots(qwen3):
    """A decoder whose KV cache has fewer slots than its context (generate_speculative fits them to prompt +
    max_tokens) commits exactly the plain stream up to its last slot, clamps longer steps, and then stops the row
    with CONTEXT instead of dropping cache rows."""
    from fucina_jax.models import fitted_capacity

    prompt = ids(qwen3, "digits")
    want = plain_run(qwen3, prompt, max_tokens=40).tokens
    slots = -(-(len(prompt) + 5) // 16) * 16  # a multiple of SLOT_ALIGN: the cache holds exactly this many
    src = all_sources(prompt + want, qwen3.config.n_vocab)["perfect"]
    dec = Decoder(qwen3, ctx=CTX, capacity=slots, options=ALWAYS)
    got = list(start(dec, prompt, 40, src, GREEDY).committed)
    assert dec.cache.capacity == slots
    row = dec.rows[0]
    while row.active:  # the newest committed id is not in the cache: n = slots + 1 fills every slot
        got += dec.step()[0].committed  # the row may commit up to 40 ids: the steps are clamped to the slots
        check_state(dec)
    assert row.finish == CONTEXT and row.n == slots + 1
    assert len(got) == slots + 1 - len(prompt) and got == want[: len(got)]
    with pytest.raises(RuntimeError, match="no row is active"):
        dec.step()
    assert fitted_capacity(1, 4096) == 256 and fitted_capacity(257, 4096) == 512 and fitted_capacity(5000, 4096) == 4096
    assert fitted_capacity(300, 100) == 100
    with pytest.raises(ValueError):
        fitted_capacity(0, 4096)


def plain_rows(model, stream, n_prompt, ctx):
    """The plain run's pre-penalty logits row for every generated position: prefill, then one decode_step per
    committed id (an independent loop over engine.decode_step, not the decoder)."""
    logits, cache = model.prefill(stream[:n_prompt], model.new_cache(ctx))
    rows = {n_prompt: np.asarray(logits)}
    for p in range(n_prompt, len(stream) - 1):
        out, cache = engine.decode_step(model.params, jnp.asarray([stream[p]], jnp.int32), cache, model.config)
        rows[p + 1] = np.asarray(out[0])
    return rows


def capture(rows_out):
    def hook(position, index, row):
        rows_out.append((position, index, np.array(row)))

    return hook


def test_replay_equivalence_of_sampler_inputs(qwen3):
    """At every commit position the speculative run's row equals the plain run's row for the same prefix.

    Measured on this fixture: the first token's row is bitwise equal, verify rows differ by up to ~7e-6 (XLA's
    f32 dot products reassociate with the row count) on rows spanning ~13-16 units; asserted at 1e-4.
    """
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED)
    truth = prompt + plain.tokens
    got = []
    src = ScriptedSource(alternating(truth, qwen3.config.n_vocab))
    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS, on_verify_row=capture(got))
    res = drive(dec, prompt, 60, src, SAMPLED)
    assert res == plain.tokens
    ref = plain_rows(qwen3, truth, len(prompt), CTX)
    positions = [p for p, _, _ in got]
    assert positions == list(range(len(prompt), len(truth)))  # one row per committed id, in stream order
    diffs = [float(np.max(np.abs(row - ref[p]))) for p, _, row in got]
    assert max(diffs) < 1e-4, max(diffs)
    assert any(i > 0 for _, i, _ in got)  # verify rows past row 0 were compared too


def start(dec: Decoder, prompt, max_tokens, source, sampler, stops=()):
    """Begin row 0 of a decoder on the prompt and sample its first token; returns that Outcome."""
    req = Request(tuple(prompt), max_tokens, sampler.validate(), frozenset(stops), source)
    return dec.first(dec.begin([req]))[0]


def drive(dec: Decoder, prompt, max_tokens, source, sampler, stops=()):
    """Drive a decoder directly to the end of its row, checking the history invariant after every step."""
    tokens = list(start(dec, prompt, max_tokens, source, sampler, stops).committed)
    while dec.active:
        tokens += dec.step()[0].committed
        check_state(dec)
    return tokens


def check_state(dec: Decoder):
    """The penalty window the next step samples with (the history with the last step's commits pushed, as the
    step pushes them) is the committed stream's tail."""
    row = dec.rows[0]
    history, _ = dec.state()
    want = sampling.history_from_tokens(row.stream[: row.n].tolist(), history.tokens.shape[-1])
    assert int(history.count[0]) == int(want.count)
    np.testing.assert_array_equal(np.asarray(history.tokens[0]), np.asarray(want.tokens))


def test_cached_equals_uncached(qwen3):
    """After a speculative run with rejections, the cache holds exactly the committed stream minus the carried
    token: the carried token's logits over it equal those of a fresh prefill of the whole stream."""
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt)
    truth = prompt + plain.tokens
    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS)
    assert drive(dec, prompt, 30, ScriptedSource(alternating(truth, qwen3.config.n_vocab)), GREEDY) == \
        plain.tokens[:30]
    assert dec.rows[0].stats.rejected > 0  # stale rows were written past the committed length
    row = dec.rows[0]
    _, cache = dec.state()
    assert int(cache.length[0]) == row.n - 1
    carried = np.asarray([row.stream[row.n - 1]], np.int32)
    cached, _ = engine.decode_step(qwen3.params, carried, cache, qwen3.config)
    fresh, _ = qwen3.prefill(row.stream[: row.n], qwen3.new_cache(CTX))
    np.testing.assert_allclose(np.asarray(cached[0]), np.asarray(fresh), rtol=0, atol=1e-4)


def test_penalties_condition_on_the_hypothetical_prefix(qwen3):
    """Re-sampling the captured verify rows with the iteration-start (stale) history changes at least one pick,
    while the hypothetical-prefix history reproduces every committed id: the test can tell the two apart."""
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED)
    truth = prompt + plain.tokens
    got = []
    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS, on_verify_row=capture(got))
    assert drive(dec, prompt, 60, ScriptedSource(perfect(truth)), SAMPLED) == plain.tokens
    cap = SAMPLED.candidate_cap(qwen3.config.n_vocab)
    W = SAMPLED.history_capacity(CTX)
    params = SAMPLED.params()

    def pick(row, p, prefix):
        h = sampling.history_from_tokens(prefix, W)
        return int(sampling.sample_rows(jnp.asarray(row[None]), jnp.asarray([p], jnp.int32), h, None, params,
                                        cap=cap)[0])

    changed = 0
    for p, i, row in got:
        if i > 0:
            assert pick(row, p, truth[:p]) == truth[p]  # the history the decoder used: committed + accepted drafts
            changed += pick(row, p, truth[: p - i]) != truth[p]  # stale: the history at the start of the verify
    assert changed >= 1


def test_cache_never_keeps_unverified_rows_on_exceptions(qwen3):
    """A hook raising mid-verify commits nothing of that step and leaves the cache at the committed length; a
    failing source changes nothing; continuing afterwards still yields the plain stream (so no stale row of an
    aborted verify is ever visible)."""
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED)
    truth = prompt + plain.tokens

    class HookBoom(Exception):
        pass

    class SourceBoom(Exception):
        pass

    third_rows = {"n": 0}

    def hook(position, index, row):
        if index == 2:
            third_rows["n"] += 1
            if third_rows["n"] in (1, 3):
                raise HookBoom  # rows 0 and 1 matched their drafts: a run in progress

    def draft(stream, step):
        if step in (3, 9):
            raise SourceBoom
        if step == 5:
            return [qwen3.config.n_vocab + 5, 1]  # an id outside the vocabulary
        return perfect(truth)(stream, step)

    src = ScriptedSource(draft, max_len=4)  # short drafts: more steps, so every failure point is reached
    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS, on_verify_row=hook)
    tokens = list(start(dec, prompt, 60, src, SAMPLED).committed)
    raised = {HookBoom: 0, SourceBoom: 0, DraftSourceError: 0}
    while dec.active:
        n_before = dec.rows[0].n
        try:
            committed = dec.step()[0].committed
        except (HookBoom, SourceBoom, DraftSourceError) as e:
            raised[type(e)] += 1
            assert dec.rows[0].n == n_before
            check_state(dec)
            continue
        tokens += committed
        check_state(dec)
    assert tokens == plain.tokens
    assert raised == {HookBoom: 2, SourceBoom: 2, DraftSourceError: 1}


def test_source_observe_failure_leaves_cache_settled(qwen3):
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt)
    truth = prompt + plain.tokens
    src = ScriptedSource(perfect(truth))
    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS)
    start(dec, prompt, 20, src, GREEDY)
    real_observe = src.observe
    src.observe = lambda c: (_ for _ in ()).throw(RuntimeError("observe failed"))
    with pytest.raises(RuntimeError):
        dec.step()
    check_state(dec)  # the step's ids are committed (the cache and history agree) though the source missed them
    row = dec.rows[0]
    assert row.n > len(prompt) + 1 and row.generated == plain.tokens[: row.n - len(prompt)]
    src.observe = real_observe


def test_bad_draft_length_is_reported(qwen3):
    class Liar(ScriptedSource):
        def suggest(self, context, buf):
            return len(buf) + 1

    dec = Decoder(qwen3, ctx=CTX, options=ALWAYS)
    start(dec, ids(qwen3, "text"), 30, Liar(lambda s, k: []), GREEDY)
    with pytest.raises(DraftSourceError, match="length"):
        dec.step()
    check_state(dec)


def test_gating_is_orthogonal(qwen3):
    """Identical streams while the gate trips, backs off, fails probes, passes one and re-enables."""
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED, max_tokens=110)
    truth = prompt + plain.tokens
    # garbage for the first 40 generated ids (verifies lose: trip, failed probes), perfect after (a probe passes)
    bad = garbage(truth, qwen3.config.n_vocab)
    good = perfect(truth)
    src = ScriptedSource(lambda s, k: bad(s, k) if len(s) < len(prompt) + 40 else good(s, k))
    opts = SpecOptions(policy="gate", reprobe_after=3, reprobe_max=8, probe_steps=2, rate_window=4,
                       min_window_drafted=4)
    res = spec_run(qwen3, prompt, src, sampler=SAMPLED, max_tokens=110, options=opts)
    assert res.tokens == plain.tokens
    g = res.spec["gate"]
    assert g["trips"] >= 1 and g["probes_failed"] >= 1 and g["probes_passed"] >= 1 and g["state"] == "on"
    assert res.spec["disabled_steps"] > 0

    # a pessimistic cost table: every verify loses, the gate keeps tripping and re-probing
    src = ScriptedSource(perfect(truth))
    opts = SpecOptions(policy="gate", reprobe_after=2, reprobe_max=4, probe_steps=1,
                       cost_table=(CostPoint(1, 100.0),))
    res = spec_run(qwen3, prompt, src, sampler=SAMPLED, max_tokens=110, options=opts)
    assert res.tokens == plain.tokens
    g = res.spec["gate"]
    assert g["trips"] == 1 and g["probes"] >= 3 and g["probes_passed"] == 0 and g["backoff"] == 4


def test_live_cost_model_does_not_change_the_stream(qwen3):
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED)
    gen = generate_speculative(qwen3, prompt, max_tokens=60, sampler=SAMPLED, ctx=CTX, stop_ids=(), clock=True)
    assert gen.run().tokens == plain.tokens
    assert gen.decoder.gate.plain_samples > 0  # the clock fed the live cost model


def test_disabled_speculation_is_the_plain_loop(qwen3):
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt, sampler=SAMPLED)
    src = ScriptedSource(perfect(prompt + plain.tokens))
    res = spec_run(qwen3, prompt, src, sampler=SAMPLED, options=SpecOptions(enabled=False))
    assert res.tokens == plain.tokens
    assert res.spec["disabled_steps"] == res.spec["steps"] and res.spec["drafted"] == 0
    assert src.observed == prompt + plain.tokens


def test_no_recompile_inside_a_bucket(qwen3):
    prompt = ids(qwen3, "digits")
    plain = plain_run(qwen3, prompt)
    truth = prompt + plain.tokens
    spec_run(qwen3, prompt, ScriptedSource(alternating(truth, qwen3.config.n_vocab)))  # warm every width
    before = aot.events()
    other = ids(qwen3, "text")
    spec_run(qwen3, other, ScriptedSource(alternating(other + plain_run(qwen3, other).tokens,
                                                      qwen3.config.n_vocab)))
    assert aot.events() == before


def test_reference_documents_are_drafted(qwen3):
    """A reference document holding the continuation gets drafts accepted (ref0 a > 0)."""
    prompt = ids(qwen3, "text")
    plain = plain_run(qwen3, prompt)
    src = SpeculationIndex(qwen3.config.n_vocab, recycling=False)
    res = spec_run(qwen3, prompt, src, references=[plain.tokens[5:50]], options=None)
    assert res.tokens == plain.tokens
    ref = next(s for s in res.spec["sources"] if s["name"] == "ref0")
    assert ref["accepted"] > 0, res.spec["sources_summary"]
