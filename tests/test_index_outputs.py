"""OutputIndex (the suffix index over past outputs) against brute force, its C counts, eviction, and the cascade with it
as one more source; last, warm shared state keeps speculative == plain on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_jax.errors import DraftIndexError
from fucina_jax.index import DraftSource, OutputIndex, RecyclingMatrix, SpeculationIndex, SuffixAutomaton
from fucina_jax.index.cascade import CascadePolicy

V = 60


def arr(*tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


# ---- the brute-force reference ----------------------------------------------------------------------


def occurrences(outputs: list[list[int]], x: list[int]) -> list[tuple[int, int]]:
    """(output, end position) of every occurrence of x, in stream order."""
    m = len(x)
    return [(i, p + m - 1) for i, o in enumerate(outputs) for p in range(len(o) - m + 1) if o[p : p + m] == x]


def brute(outputs, context, limit, *, max_match, min_count=1, min_prob=0.0, min_match=1):
    """(draft, counts, match_len, match_count) by the definition in fucina_jax/index/outputs.py."""
    outputs = [list(map(int, o)) for o in outputs]
    context = list(map(int, context))
    L = next((l for l in range(min(len(context), max_match), 0, -1) if occurrences(outputs, context[-l:])), 0)
    x = context[len(context) - L :]
    match_count = len(occurrences(outputs, x)) if L else 0
    if L < max(1, min_match):
        return [], [], 0, 0
    draft, counts, parent = [], [], match_count
    while len(draft) < limit:
        cand: dict[int, list] = {}  # next token -> [count, latest (output, position)]
        for i, end in occurrences(outputs, x):
            if end + 1 < len(outputs[i]):
                t = outputs[i][end + 1]
                c = cand.setdefault(t, [0, (-1, -1)])
                c[0] += 1
                c[1] = max(c[1], (i, end + 1))
        if not cand:
            break
        t, (count, _) = max(cand.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        if count < min_count or count < min_prob * parent:
            break
        draft.append(t)
        counts.append(count)
        parent = count
        x = x + [t]
    return draft, counts, L, match_count


def random_outputs(rng, n_outputs: int, alphabet: int, max_len: int = 30) -> list[np.ndarray]:
    outs = []
    for _ in range(n_outputs):
        if outs and rng.random() < 0.4:  # a reworded earlier output: shared spans make counts above 1
            base = outs[int(rng.integers(len(outs)))]
            a = int(rng.integers(0, len(base)))
            piece = np.concatenate([base[a : a + int(rng.integers(2, 12))], rng.integers(0, alphabet, 3)])
            outs.append(piece.astype(np.int32))
        else:
            outs.append(rng.integers(0, alphabet, int(rng.integers(1, max_len))).astype(np.int32))
    return outs


def random_context(rng, outs, alphabet: int) -> np.ndarray:
    parts = [rng.integers(0, alphabet, int(rng.integers(0, 6)))]
    if outs and rng.random() < 0.7:
        o = outs[int(rng.integers(len(outs)))]
        a = int(rng.integers(0, len(o)))
        parts.append(o[a : a + int(rng.integers(1, 10))])
    return np.concatenate(parts).astype(np.int32)


# ---- suggest == brute force ------------------------------------------------------------------------


@pytest.mark.parametrize("alphabet", [2, 3, 6, 40])
def test_suggest_is_the_most_frequent_continuation_of_the_longest_match(alphabet):
    rng = np.random.default_rng(alphabet)
    for trial in range(12):
        outs = random_outputs(rng, int(rng.integers(1, 12)), alphabet)
        max_match = int(rng.choice([1, 3, 8, 64]))
        ix = OutputIndex(V, max_match=max_match, lag=0)
        ix.load_outputs(outs)
        buf = np.zeros(12, np.int32)
        for _ in range(25):
            ctx = random_context(rng, outs, alphabet)
            limit = int(rng.integers(0, 13))
            kw = dict(min_count=int(rng.choice([1, 1, 2, 3])), min_prob=float(rng.choice([0.0, 0.0, 0.3, 0.6])),
                      min_match=int(rng.choice([1, 1, 2])))
            n = ix.suggest(ctx, buf[:limit], **kw)
            draft, counts, L, count = brute(outs, ctx, limit, max_match=max_match, **kw)
            got = ix.last
            assert buf[:n].tolist() == draft, (trial, ctx.tolist(), kw)
            assert got.counts.tolist() == counts
            if n:
                assert (got.match_len, got.match_count) == (L, count)


def test_ties_go_to_the_most_recent_occurrence_and_separators_are_never_drafted():
    ix = OutputIndex(V)
    ix.load_outputs([arr(1, 2, 3), arr(1, 2, 4), arr(9, 1, 2)])
    buf = np.zeros(8, np.int32)
    assert buf[: ix.suggest(arr(1, 2), buf)].tolist() == [4]  # 3 and 4 once each: 4 is the later one
    assert ix.last.match_count == 3 and ix.last.counts.tolist() == [1]  # "1 2" ends an output once: no draft
    ix.add_output(arr(1, 2, 3, 7))
    assert buf[: ix.suggest(arr(1, 2), buf)].tolist() == [3, 7]  # now 3 is seen twice
    assert ix.last.counts.tolist() == [2, 1]
    assert ix.suggest(arr(5, 9, 1, 2, 4), buf) == 0  # "1 2 4" ends its output: no continuation
    assert ix.suggest(arr(8), buf) == 0 and ix.last.match_len == 0  # never seen


def test_min_count_and_min_prob_drop_weak_continuations():
    ix = OutputIndex(V)
    ix.load_outputs([arr(1, 2, 3, 4), arr(1, 2, 3, 5), arr(1, 2, 3, 5), arr(1, 2, 6)])
    buf = np.zeros(8, np.int32)
    assert buf[: ix.suggest(arr(1, 2), buf)].tolist() == [3, 5]
    assert ix.last.counts.tolist() == [3, 2] and ix.last.match_count == 4
    assert buf[: ix.suggest(arr(1, 2), buf, min_count=3)].tolist() == [3]
    assert buf[: ix.suggest(arr(1, 2), buf, min_prob=0.7)].tolist() == [3]  # 2/3 < 0.7
    assert ix.suggest(arr(1, 2), buf, min_prob=0.8) == 0  # 3/4 < 0.8
    assert ix.suggest(arr(1, 2), buf, min_match=3) == 0


# ---- the C counts and the cursor cap ---------------------------------------------------------------


def test_match_count_is_the_number_of_occurrences_on_random_streams():
    rng = np.random.default_rng(7)
    for alphabet in (2, 4, 9):
        stream = rng.integers(0, alphabet, 300).astype(np.int32)
        sam = SuffixAutomaton()
        sam.extend(stream)
        sam.freeze_counted(alphabet)
        assert sam.counted and sam.frozen
        s = stream.tolist()
        for _ in range(60):
            a = int(rng.integers(0, 300))
            pat = s[a : a + int(rng.integers(1, 7))]
            c = sam.cursor()
            c.advance(np.array(pat, np.int32))
            assert c.match_len == len(pat)
            assert c.match_count == sum(s[p : p + len(pat)] == pat for p in range(len(s)))


def test_a_capped_walk_equals_capping_after_every_token():
    rng = np.random.default_rng(8)
    doc = rng.integers(0, 3, 400).astype(np.int32)
    sam = SuffixAutomaton.reference(doc)
    for cap in (0, 1, 2, 5, 17):
        stream = np.concatenate([doc[50:120], rng.integers(0, 3, 80)]).astype(np.int32)
        whole, step = sam.cursor(), sam.cursor()
        whole.advance(stream, cap)
        for t in stream:
            step.advance(arr(int(t)), cap)
        exact = sam.cursor()
        exact.advance(stream)
        assert whole.match_len == step.match_len == min(exact.match_len, cap)
        buf_a, buf_b = np.zeros(8, np.int32), np.zeros(8, np.int32)
        assert whole.draft(buf_a) == step.draft(buf_b) and (buf_a == buf_b).all()
    with pytest.raises(DraftIndexError):
        sam.cursor().advance(arr(1), -1)


def test_freeze_counted_errors_and_an_uncounted_index_drafts_nothing():
    sam = SuffixAutomaton.reference(arr(1, 2, 1, 2))
    with pytest.raises(DraftIndexError, match="frozen"):
        sam.freeze_counted(3)
    c = sam.cursor()
    c.advance(arr(1))
    assert not sam.counted and c.match_count == 0 and c.draft_frequent(np.zeros(4, np.int32)) == 0
    counted = SuffixAutomaton()
    counted.extend(arr(1, 2, 1, 2))
    counted.freeze_counted(3)
    c = counted.cursor()
    c.advance(arr(1))
    with pytest.raises(DraftIndexError, match="counts"):
        c.draft_frequent(np.zeros(4, np.int32), None, np.zeros(2, np.int32))  # shorter than the draft
    buf, cnt = np.zeros(4, np.int32), np.zeros(4, np.int32)
    assert c.draft_frequent(buf, None, cnt) == 3 and buf[:3].tolist() == [2, 1, 2] and cnt[:3].tolist() == [2, 1, 1]
    assert c.draft_frequent(buf, 2, cnt[:2]) == 2 and cnt[:2].tolist() == [2, 1]  # limit: counts need only that


# ---- matchers, eviction, bounds --------------------------------------------------------------------


def test_a_matcher_fed_slice_by_slice_equals_brute_force_across_new_outputs():
    rng = np.random.default_rng(11)
    for trial in range(6):
        alphabet = int(rng.choice([2, 3, 5]))
        ix = OutputIndex(V, max_tokens=int(rng.choice([40, 200])), max_match=int(rng.choice([2, 6, 64])), lag=0)
        ix.load_outputs(random_outputs(rng, 5, alphabet))
        m = ix.matcher()
        stream: list[int] = []
        buf = np.zeros(10, np.int32)
        for step in range(80):
            piece = rng.integers(0, alphabet, int(rng.integers(0, 4))).astype(np.int32)
            m.observe(piece)
            stream += piece.tolist()
            if rng.random() < 0.1:  # another conversation finished: the automaton is rebuilt, m resyncs
                ix.add_output(random_outputs(rng, 1, alphabet)[0])
            n = m.draft(buf, 10)
            draft, counts, L, _ = brute(ix.outputs(), stream, 10, max_match=ix.max_match)
            assert buf[:n].tolist() == draft, (trial, step)
            assert m.last.counts.tolist() == counts and m.match_len == L


def test_eviction_drops_the_oldest_outputs_first_and_the_bound_holds():
    rng = np.random.default_rng(5)
    ix = OutputIndex(V, max_tokens=100, lag=0)
    kept: list[list[int]] = []
    for _ in range(60):
        o = rng.integers(0, V, int(rng.integers(1, 40))).tolist()
        assert ix.add_output(o) == len(o)
        kept.append(o)
        while sum(map(len, kept)) > 100:
            kept.pop(0)
        assert [x.tolist() for x in ix.outputs()] == kept
        assert ix.n_tokens == sum(map(len, kept)) <= 100 and ix.n_outputs == len(kept)
    buf = np.zeros(8, np.int32)
    ctx = np.array(kept[0][:3])
    n = ix.suggest(ctx, buf)
    assert buf[:n].tolist() == brute(kept, ctx, 8, max_match=ix.max_match)[0]
    # a long output keeps its head; an empty one is not stored; bad ids are refused
    assert ix.add_output(np.arange(250) % V) == 100 and ix.n_outputs == 1
    assert ix.add_output([]) == 0 and ix.n_outputs == 1
    for bad in ([V], [-1], [[1, 2]], [1.5]):
        with pytest.raises(DraftIndexError):
            ix.add_output(bad)
    assert ix.n_outputs == 1


def test_rebuilds_are_lazy_and_memory_is_bounded():
    ix = OutputIndex(V, max_tokens=1000, lag=0)
    for _ in range(5):
        ix.add_output(np.arange(20) % V)
    assert ix.rebuilds == 0 and ix.automaton() is not None and ix.rebuilds == 1
    ix.automaton()
    assert ix.rebuilds == 1
    for _ in range(200):
        ix.add_output(np.random.default_rng(1).integers(0, V, 30))
    ix.automaton()
    assert ix.n_tokens <= 1000 and ix.n_indexed <= 1000 and ix.nbytes < 1000 * 200
    ix.clear()
    assert ix.automaton() is None and ix.suggest(arr(1, 2), np.zeros(4, np.int32)) == 0


def test_the_lag_defers_rebuilds_to_a_share_of_the_indexed_size():
    ix = OutputIndex(V, max_tokens=60, lag=0.5)
    buf = np.zeros(8, np.int32)
    a, b, c = np.arange(1, 21, dtype=np.int32), arr(30, 31, 32, 33, 34, 35, 36, 37), arr(40, 41, 42, 43, 44)
    ix.add_output(a)  # nothing indexed yet: due at once
    assert ix.suggest(arr(1, 2), buf) == 8 and ix.n_indexed == 20
    ix.add_output(b)  # 8 changed <= 0.5 * 20: queries keep the old automaton
    assert ix.suggest(arr(30, 31), buf) == 0 and ix.n_indexed == 20 and ix.rebuilds == 1
    ix.add_output(c)  # 13 > 10: due
    assert buf[: ix.suggest(arr(30, 31), buf)].tolist() == [32, 33, 34, 35, 36, 37]
    assert ix.n_indexed == 33 and ix.rebuilds == 2
    ix.add_output(np.arange(40) % 10 + 50)  # 40 tokens: evicts a (stored <= 60), due
    assert [len(o) for o in ix.outputs()] == [8, 5, 40] and ix.suggest(arr(1, 2), buf) == 0
    ix.add_output(arr(7, 8))
    ix.refresh()  # now, whatever the lag
    assert ix.n_indexed == ix.n_tokens == 55 and ix.suggest(arr(7), buf) == 1
    m = ix.matcher()
    m.observe(arr(40, 41))
    assert m.match_len == 2
    ix.add_output(arr(40, 41, 9))  # not due: the matcher keeps its cursor ...
    m.observe(arr(42))
    assert m.match_len == 3 and m.draft(buf, 8) == 2 and m.last.counts.tolist() == [1, 1]


def test_rebuild_work_is_bounded_by_the_lag_per_added_token():
    rng = np.random.default_rng(2)
    for lag in (0.0, 1 / 32, 0.25):
        ix = OutputIndex(V, max_tokens=3000, lag=lag)
        added = rebuilt = 0
        for _ in range(400):
            added += ix.add_output(rng.integers(0, V, int(rng.integers(1, 60))))
            before = ix.rebuilds
            ix.matcher().match_len  # a query
            rebuilt += ix.n_indexed if ix.rebuilds > before else 0
            assert ix.n_indexed <= 3000 and ix.n_tokens <= 3000
        if lag:
            assert rebuilt <= 2 * (1 / lag + 1) * added  # changes count additions and evictions
        else:
            assert ix.rebuilds == 400


# ---- the cascade with past outputs -----------------------------------------------------------------


def suggest(ix: SpeculationIndex, max_draft: int = 32) -> list[int]:
    buf = np.zeros(max_draft, dtype=np.int32)
    return buf[: ix.suggest(ix.stream(), buf)].tolist()


def test_outputs_source_in_the_stats_and_the_default_index_is_unchanged():
    plain = SpeculationIndex(V)
    assert [s.name for s in plain.stats()] == ["conversation", "recycling"] and plain.finish_output() == 0
    ix = SpeculationIndex(V, outputs=OutputIndex(V))
    ix.add_reference(arr(1, 2))
    assert isinstance(ix, DraftSource)
    assert [s.name for s in ix.stats()] == ["conversation", "ref0", "outputs", "recycling"]
    assert ix.summary() == "spec sources: conversation 0/0 ref0 0/0 outputs 0/0 recycling 0/0"
    with pytest.raises(DraftIndexError, match="vocabulary"):
        SpeculationIndex(V, outputs=OutputIndex(V + 1))
    with pytest.raises(DraftIndexError, match="vocabulary"):
        SpeculationIndex(V, recycling_matrix=RecyclingMatrix(V + 1))
    with pytest.raises(DraftIndexError, match="recycling=False"):
        SpeculationIndex(V, recycling=False, recycling_matrix=RecyclingMatrix(V))


def test_finish_output_stores_what_was_generated_and_another_conversation_drafts_it():
    outputs = OutputIndex(V)
    a = SpeculationIndex(V, recycling=False, outputs=outputs)
    a.observe(arr(40, 41, 42))  # the prompt
    a.observe(arr(1, 2, 3))
    a.observe(arr(4, 5, 6, 7))
    assert a.finish_output() == 7 and outputs.outputs()[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert a.finish_output() == 0  # nothing new since
    a.observe(arr(30, 31))  # a chat's next user turn
    a.begin_output()
    a.observe(arr(8, 9))
    assert a.finish_output() == 2 and outputs.outputs()[1].tolist() == [8, 9]
    with pytest.raises(DraftIndexError):
        a.begin_output(a.n_committed + 1)
    b = SpeculationIndex(V, recycling=False, outputs=outputs)
    b.observe(arr(20, 2, 3))  # "2 3" occurs in a's first output
    assert suggest(b) == [4, 5, 6, 7]  # budget 2 * (1 + 2) = 6, cut where the output ended
    b.observe(arr(4, 5, 9))  # 2 accepted + correction
    assert {s.name: (s.accepted, s.drafted) for s in b.stats()}["outputs"] == (2, 4)


def test_ties_order_conversation_references_outputs():
    outputs = OutputIndex(V)
    outputs.add_output(arr(1, 2, 3, 30, 31))
    ix = SpeculationIndex(V, recycling=False, outputs=outputs)
    ix.observe(arr(1, 2, 3))
    assert suggest(ix) == [30, 31]  # only the outputs match
    ix.add_reference(arr(1, 2, 3, 20, 21))
    assert suggest(ix) == [20, 21]  # equal length 3: the reference first
    ix.observe(arr(10, 1, 2, 3))  # all three match "1 2 3" now: the conversation first
    assert suggest(ix)[:2] == [10, 1]  # the conversation's "1 2 3" was continued by 10
    outputs.add_output(arr(9, 10, 1, 2, 3, 50))
    assert suggest(ix) == [50]  # the outputs match "10 1 2 3" (4), longer than the others' 3


def test_muted_outputs_keep_matching_and_weak_drafts_fall_through():
    outputs = OutputIndex(V)
    outputs.load_outputs([arr(1, 2, 3, 4), arr(1, 2, 5, 6), arr(1, 2, 7, 8)])
    strict = SpeculationIndex(V, outputs=outputs, policy=CascadePolicy(outputs_min_prob=0.5))
    strict.observe(arr(1, 2))
    assert suggest(strict) == []  # each continuation of "1 2" is 1/3 < 0.5; recycling has only seen 1 -> 2
    loose = SpeculationIndex(V, outputs=outputs)
    loose.observe(arr(1, 2))
    assert suggest(loose) == [7, 8]
    loose._src_outputs.muted_until = 10**9
    loose.observe(arr(7))
    assert suggest(loose) == [] and loose._matcher.match_len == 3  # muted, still matching


def test_shared_matrix_and_outputs_learn_across_conversations():
    matrix, outputs = RecyclingMatrix(V), OutputIndex(V)
    a = SpeculationIndex(V, recycling_matrix=matrix, outputs=outputs)
    a.observe(arr(3, 4, 5, 6))
    assert a.recycling_matrix is matrix and a.outputs is outputs
    b = SpeculationIndex(V, recycling_matrix=matrix)
    b.observe(arr(4))
    assert suggest(b) == [5, 6]  # a's bigrams, through the shared matrix


def test_simulated_decode_loop_with_outputs_keeps_the_accounting_exact():
    """The DraftSource contract with the outputs source in the cascade: the per-source totals add up to the loop's
    own count, the observed stream is the committed one, and earlier conversations' outputs raise acceptance."""
    rng = np.random.default_rng(4)
    succ = rng.permutation(200).astype(np.int32)  # the fake model: next token = succ[prev] with noise
    outputs, matrix = OutputIndex(200), RecyclingMatrix(200)
    rates = []
    for conv in range(4):
        ix = SpeculationIndex(200, outputs=outputs, recycling_matrix=matrix)
        prompt = arr(int(rng.integers(200)))
        ix.observe(prompt)
        stream = prompt.tolist()
        drafted = accepted = 0
        buf = np.zeros(12, dtype=np.int32)
        noise = np.random.default_rng(conv)

        def model(prev: int, k: int) -> list[int]:  # the next k tokens: the successor, or 5% noise
            out = []
            for _ in range(k):
                prev = int(succ[prev]) if noise.random() > 0.05 else int(noise.integers(200))
                out.append(prev)
            return out

        while len(stream) < 300:
            n = ix.suggest(np.array(stream, np.int32), buf)
            nxt = model(stream[-1], n + 1)  # verify: the draft is accepted up to its first mismatch
            ok = next((j for j, (d, t) in enumerate(zip(buf[:n].tolist(), nxt)) if d != t), n)
            drafted += n
            accepted += ok
            ix.observe(np.array(nxt[: ok + 1], np.int32))
            stream += nxt[: ok + 1]
        assert ix.stream().tolist() == stream
        totals = ix.stats()
        assert sum(s.drafted for s in totals) == drafted and sum(s.accepted for s in totals) == accepted
        rates.append(accepted / max(drafted, 1))
        assert ix.finish_output() == len(stream) - 1
    assert outputs.n_outputs == 4
    assert {s.name for s in totals} == {"conversation", "outputs", "recycling"}
    assert next(s for s in totals if s.name == "outputs").drafted > 0


# ---- warm shared state keeps speculative == plain (the decoder's guarantee, checked here too) ----------


def test_warm_matrix_and_outputs_keep_speculative_equal_to_plain(fixture_path, load_model):
    from fucina_jax.generate import generate, generate_speculative
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.speculative import SpecOptions

    model = load_model(fixture_path("qwen3"))
    nv = model.config.n_vocab
    tok = model.tokenizer
    always = SpecOptions(min_speedup=0.0, adapt_budget=False)
    matrix, outputs = RecyclingMatrix(nv), OutputIndex(nv)
    rng = np.random.default_rng(0)
    # warm with OTHER text: two real runs feeding the shared state, plus noise rows and noise outputs
    for text in ("the cat sat on the mat, the cat sat", "one two three four one two three"):
        ix = SpeculationIndex(nv, recycling_matrix=matrix, outputs=outputs)
        generate_speculative(model, tok.encode(text, add_special=True), max_tokens=24, source=ix,
                             options=always, clock=False).run()
        ix.finish_output()
    matrix.table[rng.integers(0, nv, 200)] = rng.integers(0, nv, (200, matrix.k))
    for _ in range(5):
        outputs.add_output(rng.integers(0, nv, 40))
    assert outputs.n_outputs == 7
    prompt = tok.encode("hello world hello world, the quick brown fox", add_special=True)
    for sampler in (SamplerConfig(temperature=0.0, top_k=20, seed=0),
                    SamplerConfig(temperature=0.8, top_k=20, repeat_penalty=1.3, seed=1234)):
        plain = generate(model, prompt, max_tokens=40, sampler=sampler).run()
        ix = SpeculationIndex(nv, recycling_matrix=matrix, outputs=outputs)
        spec = generate_speculative(model, prompt, max_tokens=40, sampler=sampler, source=ix, options=always,
                                    clock=False).run()
        assert spec.tokens == plain.tokens and spec.stop_reason == plain.stop_reason
        assert sum(s.drafted for s in ix.stats()) > 0  # the warm state did draft
        # the plain stream itself stored as a past output: drafts now follow it, the stream is still the same
        outputs.add_output(plain.tokens)
        ix = SpeculationIndex(nv, recycling_matrix=matrix, outputs=outputs)
        again = generate_speculative(model, prompt, max_tokens=40, sampler=sampler, source=ix, options=always,
                                     clock=False).run()
        assert again.tokens == plain.tokens
        assert {s.name: s.accepted for s in ix.stats()}["outputs"] > 0
