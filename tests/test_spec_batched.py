"""Batched speculative decoding == each conversation decoded alone by the plain loop (fucina_jax.generate).

B = 1, 3, 8 conversations on the tiny Qwen3 and Gemma 3 fixtures, every row different: prompt length (3 to 45
tokens), draft source (perfect / garbage / none / alternating / the real cascade over a repetitive prompt), sampler
(per-row seeds; greedy and sampled rows mixed, one with another top-k), max_tokens, and stop ids (a stop id that the
perfect source drafts past, so it is sampled inside an accepted run). The plain reference for each row runs alone
with that row's own values. The asserts on the statistics make sure drafts really were accepted (and rejected), so an
equality cannot come from every row stepping one token at a time.

A batch samples every row with its widest candidate cap (row 4's top-k 40 among top-k 20 rows: a wider cap must
change no token). Every run uses one context size and max_draft 7, so the compiled programs (B x widths 1/2/4/8)
are shared by the tests of one architecture.
"""

from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import ScriptedSource, alternating, garbage, perfect

from fucina_jax import aot
from fucina_jax.errors import DraftSourceError
from fucina_jax.generate import generate
from fucina_jax.index import SpeculationIndex
from fucina_jax.sampling import SamplerConfig
from fucina_jax.decoder import Decoder, Request
from fucina_jax.generate import generate_batched
from fucina_jax.speculative import SpecOptions

CTX = 128
OPTIONS = SpecOptions(policy="gate", max_draft=7, min_speedup=0.0, adapt_budget=False)  # the gate never trips: every draft runs
N_ROWS = 8
# Row r: (prompt length, max_tokens, source kind, stop mid-run). The stop row's perfect source drafts past its stop.
ROWS = [
    (11, 40, "perfect", True),
    (3, 25, "garbage", False),
    (30, 33, "none", False),
    (7, 40, "cascade", False),
    (19, 12, "alternating", False),
    (45, 40, "perfect", False),
    (5, 1, "cascade", False),
    (24, 40, "cascade", True),
]
GREEDY = SamplerConfig(temperature=0.0, top_k=20, seed=0)
# Greedy through penalties: the tiny random models' plain greedy streams repeat one or two ids; penalised argmax
# streams vary, so a row mixed up with another cannot pass by accident.
GREEDY_PENALISED = SamplerConfig(temperature=0.0, top_k=20, repeat_penalty=1.5, presence_penalty=3.0,
                                 frequency_penalty=1.0, repeat_last_n=64, seed=0)


def samplers(mode):
    """Per-row samplers: all greedy (penalised, except the rows without a draft source and the cascade rows: the
    cascade drafts from repetition, which penalties take away), or sampled with per-row seeds and values (two greedy
    rows mixed in)."""
    if mode == "greedy":
        return [GREEDY if ROWS[r][2] in ("none", "cascade") else GREEDY_PENALISED for r in range(N_ROWS)]
    out = []
    for r in range(N_ROWS):
        if r in (2, 5):
            out.append(GREEDY)
        else:
            out.append(SamplerConfig(temperature=0.7 + 0.1 * (r % 3), top_k=40 if r == 4 else 20, repeat_penalty=1.2,
                                     frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=64, seed=100 + r))
    return out


def make_prompts(n_vocab):
    rng = np.random.default_rng(3)
    prompts = []
    for r, (n, *_rest) in enumerate(ROWS):
        if ROWS[r][2] == "cascade":  # a repeated phrase: the conversation index has something to draft
            phrase = rng.integers(0, min(n_vocab, 260), 4).tolist()
            prompts.append((phrase * n)[:n])
        else:
            prompts.append(rng.integers(0, min(n_vocab, 260), n).tolist())
    return prompts


def make_source(kind, truth, n_vocab):
    if kind == "none":
        return None
    if kind == "cascade":
        return SpeculationIndex(n_vocab)
    fn = {"perfect": perfect(truth), "garbage": garbage(truth, n_vocab), "alternating": alternating(truth, n_vocab)}
    return ScriptedSource(fn[kind])


class Arch:
    """One fixture model with its prompts and plain references (computed once per module)."""

    def __init__(self, model):
        self.model = model
        self.prompts = make_prompts(model.config.n_vocab)
        self._plain = {}

    def plain(self, r, mode, stop=()):
        key = (r, mode, tuple(stop))
        if key not in self._plain:
            self._plain[key] = generate(self.model, self.prompts[r], max_tokens=ROWS[r][1],
                                        sampler=samplers(mode)[r], ctx=CTX, stop_ids=stop).run()
        return self._plain[key]

    def stop_for(self, r, mode):
        """A stop id the free run first samples at index >= 10 (several steps commit before it); failing that, the
        latest first occurrence (a tiny random model may repeat one id: then the stop is its first token)."""
        toks = self.plain(r, mode).tokens
        firsts = [j for j, t in enumerate(toks) if t not in toks[:j]]
        late = [j for j in firsts if j >= 10]
        return (toks[late[0] if late else firsts[-1]],)

    def case(self, rows, mode):
        """(prompts, max_tokens, samplers, stops, sources, expected results) for the given row indices."""
        n_vocab = self.model.config.n_vocab
        prompts, maxes, samps, stops, sources, expected = [], [], [], [], [], []
        for r in rows:
            _, max_tokens, kind, stop_mid = ROWS[r]
            stop = self.stop_for(r, mode) if stop_mid else ()
            free = self.plain(r, mode)  # no stop: the perfect source drafts past the stop id
            truth = self.prompts[r] + free.tokens
            sources.append(make_source(kind, truth, n_vocab))
            prompts.append(self.prompts[r])
            maxes.append(max_tokens)
            samps.append(samplers(mode)[r])
            stops.append(stop)
            expected.append(self.plain(r, mode, stop) if stop else free)
        return prompts, maxes, samps, stops, sources, expected


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def arch(request, fixture_path, load_model):
    return Arch(load_model(fixture_path(request.param)))


ROW_SETS = {1: [0], 3: [1, 3, 7], 8: list(range(N_ROWS))}


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_batched_equals_each_conversation_alone(arch, B, mode):
    rows = ROW_SETS[B]
    prompts, maxes, samps, stops, sources, expected = arch.case(rows, mode)
    results = generate_batched(arch.model, prompts, max_tokens=maxes, sampler=samps, ctx=CTX, stop_ids=stops,
                               sources=sources, options=OPTIONS, clock=False)
    assert len(results) == B
    for r, res, want, src in zip(rows, results, expected, sources):
        assert res.tokens == want.tokens, f"row {r} ({ROWS[r][2]}) differs from its plain run"
        assert res.stop_reason == want.stop_reason, r
        if isinstance(src, ScriptedSource):  # the source saw exactly the committed stream
            assert src.observed == arch.prompts[r] + res.tokens
    stats = {r: res.spec for r, res in zip(rows, results)}
    # the test can fail: drafts were accepted (several tokens per step) and rejected
    for r, s in stats.items():
        kind = ROWS[r][2]
        if kind == "perfect":
            assert s["rejected"] == 0 and s["accepted"] > 0 and s["tok_per_step"] > 2, (r, s["summary"])
        elif kind == "garbage":
            assert s["accepted"] == 0 and s["rejected"] == s["verify_steps"] > 0, (r, s["summary"])
        elif kind == "none":
            assert s["verify_steps"] == 0 and s["committed"] == s["steps"], (r, s["summary"])
        elif kind == "alternating":
            assert 0 < s["accepted"] < s["drafted"], (r, s["summary"])
    if B == 8:
        assert sum(stats[r]["accepted"] for r in rows if ROWS[r][2] == "cascade") > 0  # the real cascade drafts
        # mixed stop times: eog inside a verify, max_tokens of 1, 12, 25, 33, 40
        assert {res.stop_reason for res in results} == {"stop", "max_tokens"}
        assert len({len(res.tokens) for res in results}) >= 5
        assert len({tuple(res.tokens) for res in results}) == B  # no two rows share a stream


def test_stop_sampled_inside_an_accepted_run(arch):
    """Row 0's perfect source drafts past its stop id: the stop is sampled at a verify row whose earlier rows were
    accepted, and nothing from that row on is committed."""
    prompts, maxes, samps, stops, sources, expected = arch.case([0], "greedy")
    (res,) = generate_batched(arch.model, prompts, max_tokens=maxes, sampler=samps, ctx=CTX, stop_ids=stops,
                              sources=sources, options=OPTIONS, clock=False)
    assert res.stop_reason == "stop" and res.tokens == expected[0].tokens
    free = arch.plain(0, "greedy").tokens
    assert free[len(res.tokens)] == stops[0][0]  # it stopped exactly where the free run samples the stop id
    s = res.spec
    # every step before the last ended with a bonus token; the last committed only accepted drafts, then the stop
    assert s["bonus"] == s["steps"] - 1 and s["committed"] == s["accepted"] + s["steps"] - 1, s["summary"]
    assert s["rejected"] == 0


def test_no_recompile_inside_a_bucket(arch):
    """Once a batch size's shapes are compiled (its step widths, and its row buckets as rows finish), other
    prompts, lengths, seeds, drafts and stop times compile nothing new; and the shapes are bounded by the
    declared buckets."""
    from fucina_jax import engine

    prompts, maxes, samps, stops, sources, _ = arch.case(ROW_SETS[3], "sampled")
    start = aot.events()
    generate_batched(arch.model, prompts, max_tokens=maxes, sampler=samps, ctx=CTX, stop_ids=stops, sources=sources,
                     options=OPTIONS, clock=False)
    rng = np.random.default_rng(9)

    def other(seed):
        r = np.random.default_rng(seed)
        rows = [r.integers(0, 200, n).tolist() for n in (13, 2, 40)]
        samplers = [SamplerConfig(temperature=0.5, top_k=17, seed=seed + s) for s in (1, 2, 3)]
        generate_batched(arch.model, rows, max_tokens=[9, 30, 17], sampler=samplers, ctx=CTX,
                         stop_ids=[(), (5,), ()], sources=[SpeculationIndex(arch.model.config.n_vocab) for _ in rows],
                         options=OPTIONS, clock=False)

    other(int(rng.integers(100)))  # warms the row buckets this finishing order reaches
    n_programs = len(engine.STEP_WIDTHS) * len({engine.row_bucket(n, 3) for n in (1, 2, 3)}) + 8
    assert aot.events() - start <= n_programs  # (+ prefill chunks and the first-token sampler)
    before = aot.events()
    other(int(rng.integers(100, 200)))
    assert aot.events() == before


def test_disabled_speculation_is_batched_plain_decoding(arch):
    prompts, maxes, samps, stops, sources, expected = arch.case(ROW_SETS[3], "sampled")
    results = generate_batched(arch.model, prompts, max_tokens=maxes, sampler=samps, ctx=CTX, stop_ids=stops,
                               sources=sources, options=SpecOptions(max_draft=7, enabled=False), clock=False)
    for res, want in zip(results, expected):
        assert res.tokens == want.tokens
        assert res.spec["disabled_steps"] == res.spec["steps"] and res.spec["drafted"] == 0


@pytest.mark.parametrize("clock", [False, True])
def test_gate_trips_on_a_losing_batch_and_never_changes_the_stream(arch, clock):
    """Default gate: with every row's drafts garbage, the batch's verifies lose (cost > 1 plain step for one token
    per row), the gate switches speculation off for the batch; every stream is still its plain stream. With a
    clock the first step runs plainly (the gate times a plain step before pricing verifies)."""
    prompts, maxes, samps, stops, _, expected = arch.case(ROW_SETS[3], "sampled")
    n_vocab = arch.model.config.n_vocab
    sources = [ScriptedSource(garbage(p + e.tokens, n_vocab)) for p, e in zip(prompts, expected)]
    results = generate_batched(arch.model, prompts, max_tokens=maxes, sampler=samps, ctx=CTX, stop_ids=stops,
                               sources=sources, options=SpecOptions(policy="gate", max_draft=7), clock=clock)
    for res, want in zip(results, expected):
        assert res.tokens == want.tokens
    s = max(results, key=lambda r: r.spec["steps"]).spec
    assert s["gate"]["trips"] == 1 and s["gate"]["state"] == "off", s["gate"]
    assert s["disabled_steps"] > 0 and s["verify_steps"] >= 2
    if clock:
        assert s["fallback_steps"] >= 1  # the calibration step


def test_bad_input(arch):
    m = arch.model
    with pytest.raises(ValueError, match="one per prompt"):
        generate_batched(m, [[1, 2], [3]], max_tokens=[4, 5, 6], ctx=CTX)
    with pytest.raises(ValueError, match="one per row"):
        generate_batched(m, [[1, 2], [3]], sources=[None], ctx=CTX)
    with pytest.raises(ValueError, match="2 requests for a decoder of 3 rows"):
        Decoder(m, 3, ctx=CTX).begin([None, None])
    bad = ScriptedSource(lambda stream, step: [m.config.n_vocab + 3, 1])
    with pytest.raises(DraftSourceError, match="row 1 proposed token id"):
        generate_batched(m, [[1, 2], [3, 4, 5]], max_tokens=5, sampler=GREEDY, ctx=CTX, stop_ids=(),
                         sources=[None, bad], options=OPTIONS, clock=False)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_rows_joining_and_leaving_a_running_batch_equal_each_alone(arch, mode):
    """Continuous batching on the one decoder: requests join free rows between steps (each prefilled alone into
    its slots while the others are mid-stream), finished rows are released and their slots reused; every request
    still gets exactly its plain stream."""
    order = [0, 3, 7, 1, 4, 5, 6, 2]  # eight requests through a decoder of three rows
    prompts, maxes, samps, stops, sources, expected = arch.case(order, mode)
    dec = Decoder(arch.model, 3, ctx=CTX, options=OPTIONS)
    got = {i: [] for i in range(len(order))}
    slot_of = {}  # row -> request index
    waiting = list(range(len(order)))
    joined_mid_stream = 0
    while waiting or dec.active:
        free = [b for b in range(3) if b not in slot_of]
        if waiting and free and (not dec.active or len(got[0]) % 2 == 0):
            b, i = free[0], waiting.pop(0)
            joined_mid_stream += dec.active
            reqs = [None] * 3
            reqs[b] = Request(tuple(prompts[i]), maxes[i], samps[i].validate(), frozenset(stops[i]), sources[i])
            slot_of[b] = i
            outcomes = dec.first(dec.begin(reqs))
        else:
            outcomes = dec.step()
        for b, o in enumerate(outcomes):
            if o is not None:
                got[slot_of[b]] += o.committed
        for b in list(slot_of):
            if not dec.rows[b].active:
                assert dec.rows[b].finish == expected[slot_of[b]].stop_reason
                dec.release(b)
                del slot_of[b]
    assert joined_mid_stream >= 3
    for i, want in enumerate(expected):
        assert got[i] == want.tokens, f"request {i} (row kind {ROWS[order[i]][2]})"
