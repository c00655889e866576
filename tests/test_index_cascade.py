"""SpeculationIndex: every cascade rule (selection, tie-breaks, budget, fall-through, muting, references)."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_jax.errors import DraftIndexError
from fucina_jax.index import DraftSource, SpeculationIndex
from fucina_jax.index.cascade import CascadePolicy, _Source

V = 5000  # vocabulary of the test indexes


def arr(*tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def suggest(ix: SpeculationIndex, max_draft: int = 32) -> list[int]:
    buf = np.zeros(max_draft, dtype=np.int32)
    return buf[: ix.suggest(ix.stream(), buf)].tolist()


def stats(ix: SpeculationIndex) -> dict[str, tuple[int, int, bool]]:
    return {s.name: (s.accepted, s.drafted, s.muted) for s in ix.stats()}


# ---- contract ---------------------------------------------------------------------------------------


def test_is_a_draft_source_and_wants_topk_only_with_recycling():
    ix = SpeculationIndex(V)
    assert isinstance(ix, DraftSource) and ix.wants_topk
    assert not SpeculationIndex(V, recycling=False).wants_topk
    assert suggest(ix) == []  # nothing observed: nothing to draft
    assert ix.suggest(None, np.zeros(0, np.int32)) == 0  # context is not read; empty buffer drafts 0


def test_bad_tokens_are_rejected_before_any_source_changes():
    ix = SpeculationIndex(V)
    ix.observe(arr(1, 2, 3))
    # int32 arrays take a fast path (the decoder's): every shape but 1-D is refused there as elsewhere
    for bad in (arr(4, V), arr(-1), np.zeros((2, 2), np.int32), np.zeros((0, 2), np.int32), np.int32(5),
                np.array([1.5]), np.array([True]), np.array([4, V], np.int64), np.array([1, "a"], object)):
        with pytest.raises(DraftIndexError):
            ix.observe(bad)
    assert ix.n_committed == 3 and ix.stream().tolist() == [1, 2, 3]
    ix.observe([])  # an empty slice is fine
    ix.observe(np.array([4, 5], np.int64))  # so are other integer types
    assert ix.stream().tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(DraftIndexError):
        SpeculationIndex(0)


# ---- selection --------------------------------------------------------------------------------------


def test_longest_match_wins_and_budget_is_two_times_one_plus_match_len():
    ix = SpeculationIndex(V, recycling=False)
    doc = np.arange(100, 140, dtype=np.int32)
    ix.add_reference(doc)
    # conversation: "7 8 9 ... 7 8" -> conversation match 2; the ref matches "103 104 105" -> 3
    ix.observe(arr(7, 8, 9, 1, 103, 104, 105, 2, 7, 8))
    assert suggest(ix) == [9, 1, 103, 104, 105, 2]  # conversation only: 2 * (1 + 2) = 6 tokens
    ix.observe(arr(9, 103, 104, 105))
    # conversation matches "103 104 105" (3, continued by 2 ...); the ref matches it too (3): tie -> conversation
    assert suggest(ix) == [2, 7, 8, 9, 103, 104, 105, 2]
    ix.observe(arr(106))  # now the ref matches "103 104 105 106" (4) and the conversation nothing
    assert suggest(ix) == list(range(107, 117))  # 2 * (1 + 4) = 10 tokens from the document
    assert suggest(ix, max_draft=4) == [107, 108, 109, 110]  # capped by the caller's buffer


def test_ties_between_references_go_to_the_first_added():
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(arr(1, 2, 3, 10, 11, 12))
    ix.add_reference(arr(1, 2, 3, 20, 21, 22))
    ix.observe(arr(1, 2, 3))
    assert suggest(ix) == [10, 11, 12]  # cut at the document end
    ix.clear_references()
    ix.add_reference(arr(2, 3, 40, 41))  # matches "2 3" (2)
    ix.add_reference(arr(1, 2, 3, 50, 51))  # matches "1 2 3" (3): longer beats first-added
    assert suggest(ix) == [50, 51]


def test_reference_match_at_document_end_falls_to_the_next_candidate():
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(arr(5, 6, 7, 8))  # matches "6 7 8" (3) but nothing follows
    ix.add_reference(arr(7, 8, 30, 31))  # matches "7 8" (2)
    ix.observe(arr(6, 7, 8))
    assert suggest(ix) == [30, 31]
    s = stats(ix)
    assert s["ref0"] == (0, 0, False)


def test_short_matches_fall_through_to_recycling_capped_at_eight():
    ix = SpeculationIndex(V)
    ix.observe(np.arange(1, 20, dtype=np.int32))  # bigram chain 1->2->...->19, no repeats
    ix.observe(arr(1))  # conversation match "1" has length 1 < min_match
    assert ix._conversation.match_len == 1
    assert suggest(ix) == [2, 3, 4, 5, 6, 7, 8, 9]  # the top-1 chain, cap 8
    assert suggest(ix, max_draft=3) == [2, 3, 4]
    ix.observe(arr(2, 3))  # now "1 2 3" matches (3 >= 2): the conversation drafts, not recycling
    assert suggest(ix) == list(range(4, 12))


def test_unseen_recycling_row_drafts_nothing():
    ix = SpeculationIndex(V)
    ix.observe(arr(1, 2, 3))
    assert suggest(ix) == []  # row 3 never seen, no index match
    ix2 = SpeculationIndex(V, recycling=False)
    ix2.observe(np.arange(1, 20, dtype=np.int32))
    ix2.observe(arr(1))
    assert suggest(ix2) == []


# ---- acceptance accounting --------------------------------------------------------------------------


def test_acceptance_is_the_common_prefix_of_draft_and_next_committed_slice():
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(np.arange(100, 130, dtype=np.int32))
    ix.observe(arr(100, 101))
    assert suggest(ix) == [102, 103, 104, 105, 106, 107]
    ix.observe(arr(102, 103, 999))  # 2 accepted + correction
    assert stats(ix)["ref0"] == (2, 6, False)
    ix.observe(arr(104))  # no pending draft: nothing counted
    assert stats(ix)["ref0"] == (2, 6, False)
    ix.observe(arr(110, 111))  # a part of the document the conversation has not seen: only the ref matches
    draft = suggest(ix)
    assert draft == list(range(112, 118))
    ix.observe(np.array(draft + [555], dtype=np.int32))  # full acceptance + bonus
    assert stats(ix)["ref0"] == (8, 12, False)
    assert ix.summary() == "spec sources: conversation 0/0 ref0 8/12"


def test_truncate_pending_keeps_accounting_aligned_with_a_trimmed_turn():
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(np.arange(100, 130, dtype=np.int32))
    ix.observe(arr(100, 101))
    assert len(suggest(ix)) == 6
    ix.truncate_pending(2)  # the turn ends after 2 of the step's tokens (stop marker)
    ix.observe(arr(102, 103))
    assert stats(ix)["ref0"] == (2, 2, False)
    ix.observe(arr(100, 101))
    suggest(ix)
    ix.truncate_pending()  # the whole step is trimmed
    ix.observe(arr(7))
    assert stats(ix)["ref0"] == (2, 2, False)
    ix.truncate_pending(3)  # no pending draft: a no-op


def test_summary_line_format():
    ix = SpeculationIndex(V)
    ix.add_reference(arr(1, 2, 3))
    ix.add_reference(arr(4, 5, 6))
    assert ix.summary() == "spec sources: conversation 0/0 ref0 0/0 ref1 0/0 recycling 0/0"
    ix._src_recycling.muted_until = 10**9
    assert ix.summary().endswith("recycling 0/0 [muted]")


# ---- muting -----------------------------------------------------------------------------------------


def _round(ix: SpeculationIndex, k: int, junk: int, hit: bool) -> None:
    """The reference drafts 6 tokens after 'k k+1'; then its first token and a miss are committed (hit: 1 accepted
    of 2 decided positions) or a miss alone (0 of 1)."""
    ix.observe(arr(k, k + 1))
    assert suggest(ix) == list(range(k + 2, k + 8))
    ix.observe(arr(k + 2, junk) if hit else arr(junk))


def test_mute_after_a_full_window_below_20_percent_then_reprobe_with_a_fresh_window():
    """The window holds decided positions (accepted tokens and first misses), not whole drafts."""
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(np.arange(0, 4000, dtype=np.int32))  # distinct tokens: the conversation never repeats
    k, junk = 0, 4000
    for i in range(53):  # 10 hits (20 decided) + 43 misses: 63 decided positions, the window is not full yet
        _round(ix, k, junk, hit=i < 10)
        k, junk = k + 10, junk + 1
    assert stats(ix)["ref0"] == (10, 318, False)
    _round(ix, k, junk, hit=False)  # 64 decided; 10 accepted = 15.6% < 20%
    k, junk = k + 10, junk + 1
    assert stats(ix)["ref0"] == (10, 324, True)
    muted_at = ix.n_committed
    # muted for 128 committed tokens: no drafts although the cursor matches the document ...
    while ix.n_committed < muted_at + 127:
        ix.observe(arr(k))
        k += 1
        assert suggest(ix) == []
    assert ix._cursors[0].match_len == 127  # ... because it kept observing while muted
    assert stats(ix)["ref0"][2] and "ref0 10/324 [muted]" in ix.summary()
    ix.observe(arr(k))  # the 128th committed token since the mute: re-probe
    k += 1
    assert not stats(ix)["ref0"][2]
    draft = suggest(ix)  # in sync at once: the document's continuation, budget capped at 32
    assert draft == list(range(k, k + 32))
    # a fresh window: a bad round cannot re-mute it, a kept old window would have
    ix.observe(arr(4999))
    assert stats(ix)["ref0"] == (10, 356, False)


def test_mute_threshold_is_strictly_below_20_percent():
    policy = CascadePolicy()
    ok = _Source("s", policy.mute_window)
    ok.record(64, 13, 64, policy, n_committed=100)  # 13/64 = 20.3%
    assert not ok.muted
    bad = _Source("s", policy.mute_window)
    bad.record(64, 12, 64, policy, n_committed=100)  # 12/64 = 18.75%
    assert bad.muted and bad.muted_until == 228
    bad.maybe_reprobe(227)
    assert bad.muted
    bad.maybe_reprobe(228)
    assert not bad.muted and len(bad.window) == 0
    partial = _Source("s", policy.mute_window)
    partial.record(63, 0, 63, policy, n_committed=5)  # not full: no verdict
    assert not partial.muted
    partial.record(1, 1, 1, policy, n_committed=6)  # full: 1/64
    assert partial.muted
    undecided = _Source("s", policy.mute_window)
    for _ in range(64):  # long drafts of which one position was decided each time (cut, or not verified): 1/1
        undecided.record(8, 1, 1, policy, n_committed=7)
    assert not undecided.muted and undecided.window_sum == 64 and undecided.drafted == 512


def test_muted_conversation_falls_back_to_recycling_and_keeps_indexing():
    ix = SpeculationIndex(V)
    ix._src_conversation.muted_until = 10**9
    ix.observe(arr(1, 2, 3, 4, 1, 2, 3))
    assert ix._conversation.match_len == 3  # still indexing while muted
    assert suggest(ix) == [4, 1, 2, 3, 4, 1, 2, 3]  # the recycling chain 3->4->1->2->3..., cap 8
    assert stats(ix)["conversation"] == (0, 0, True)


# ---- references -------------------------------------------------------------------------------------


def test_add_reference_mid_stream_matches_existing_context_at_once():
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 50, size=300).astype(np.int32)
    stream = np.concatenate([rng.integers(0, 50, size=500), doc[100:140]]).astype(np.int32)
    early = SpeculationIndex(V, recycling=False)
    early.add_reference(doc)
    early.observe(stream)
    late = SpeculationIndex(V, recycling=False)
    late.observe(stream)  # 540 committed tokens, longer than the document: catch-up over the tail only
    late.add_reference(doc)
    assert late._cursors[0].match_len >= 40
    assert (late._cursors[0].match_len, late._cursors[0].match_pos) == (
        early._cursors[0].match_len,
        early._cursors[0].match_pos,
    )
    assert suggest(late) == suggest(early)


def test_at_most_eight_references_and_clear():
    ix = SpeculationIndex(V)
    for i in range(8):
        assert ix.add_reference(arr(i, i + 1)) == i
    with pytest.raises(DraftIndexError, match="clear_references"):
        ix.add_reference(arr(1))
    with pytest.raises(DraftIndexError, match="empty"):
        SpeculationIndex(V).add_reference(arr())
    ix.observe(arr(0, 1))
    ix.clear_references()
    assert ix.n_references == 0 and [s.name for s in ix.stats()] == ["conversation", "recycling"]
    assert ix.add_reference(arr(1, 2)) == 0 and ix.stats()[1].name == "ref0"


def test_clear_references_drops_pending_accounting():
    ix = SpeculationIndex(V, recycling=False)
    ix.add_reference(np.arange(10, 30, dtype=np.int32))
    ix.observe(arr(10, 11))
    assert suggest(ix)
    ix.clear_references()
    ix.add_reference(np.arange(10, 30, dtype=np.int32))
    ix.observe(arr(12, 13))
    assert stats(ix)["ref0"] == (0, 0, False)


# ---- degraded mode, top-K, an end-to-end loop ---------------------------------------------------------


def test_poisoned_conversation_index_degrades_quietly():
    ix = SpeculationIndex(V, recycling=False, max_tokens=6)
    ix.add_reference(np.arange(100, 120, dtype=np.int32))
    ix.observe(arr(1, 2, 3, 1, 2, 3, 1, 2))  # past max_tokens: the conversation SAM is poisoned
    assert ix.stats()[0].poisoned and "[poisoned]" in ix.summary()
    assert suggest(ix) == []
    ix.observe(arr(100, 101))  # the other sources keep working
    assert suggest(ix)[:2] == [102, 103]


def test_observe_topk_rows_align_with_the_last_committed_tokens():
    ix = SpeculationIndex(V)
    ix.observe(arr(7))
    ix.observe(arr(8, 9))
    rows = np.array([[8, 1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18]])
    ix.observe_topk(rows)  # row 0 produced 8 (after 7), row 1 produced 9 (after 8)
    assert ix._recycling.row(7).tolist() == [8, 1, 2, 3, 4, 5, 6, 7]
    assert ix._recycling.row(8).tolist() == [9, 11, 12, 13, 14, 15, 16, 17]
    with pytest.raises(DraftIndexError, match="rows"):
        ix.observe_topk(rows)  # a second call for the same slice
    ix.observe(arr(1))
    with pytest.raises(DraftIndexError):
        ix.observe_topk(rows)  # more rows than committed tokens
    fresh = SpeculationIndex(V)
    fresh.observe(arr(3, 4))
    fresh.observe_topk(np.array([[3, 0, 0, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 9, 10, 11]]))
    assert fresh._recycling.row(3).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # the first token has no row
    with pytest.raises(DraftIndexError):
        fresh.observe(arr(1))
        fresh.observe_topk(np.array([[V, 0, 0, 0, 0, 0, 0, 0]]))
    # int32 rows (the decoder's) take a fast path: fewer rows than committed ids align with the last ones, and
    # every shape but 2-D is refused as for other dtypes
    fresh.observe(arr(20, 21, 22))
    fresh.observe_topk(np.array([[22, 30, 31, 32, 33, 34, 35, 36]], np.int32))  # 22 came after 21
    assert fresh._recycling.row(21).tolist() == [22, 30, 31, 32, 33, 34, 35, 36]
    for bad in (np.zeros(3, np.int32), np.zeros((1, 2, 8), np.int32), np.int32(3), np.zeros((1, 8)),
                np.array([[V, 0]], np.int32), np.array([[-1, 0]], np.int32)):
        fresh.observe(arr(5))
        with pytest.raises(DraftIndexError):
            fresh.observe_topk(bad)


def test_simulated_decode_loop_accounting_and_recycling_learning():
    """A fake greedy model whose next token is a fixed function of the previous one: recycling learns it
    through observe_topk, and the per-source totals add up to the loop's own count of accepted drafts."""
    rng = np.random.default_rng(4)
    succ = rng.permutation(200).astype(np.int32)  # next token = succ[prev] (a few long cycles)
    ix = SpeculationIndex(200)
    prompt = np.array([5], dtype=np.int32)
    ix.observe(prompt)
    stream = prompt.tolist()
    loop_drafted = loop_accepted = 0
    buf = np.zeros(12, dtype=np.int32)
    while len(stream) < 600:
        n = ix.suggest(np.array(stream, dtype=np.int32), buf)
        draft = buf[:n].tolist()
        committed, prev = [], stream[-1]
        for d in draft + [None]:  # verify: accept while the draft equals the model's token
            tok = int(succ[prev])
            committed.append(tok)
            prev = tok
            if d != tok:
                break
        loop_drafted += n
        loop_accepted += len(committed) - 1
        ix.observe(np.array(committed, dtype=np.int32))
        rows = np.array([[int(succ[p])] + [0] * 7 for p in [stream[-1]] + committed[:-1]])
        ix.observe_topk(rows)
        stream += committed
    assert ix.stream().tolist() == stream
    totals = ix.stats()
    assert sum(s.drafted for s in totals) == loop_drafted
    assert sum(s.accepted for s in totals) == loop_accepted
    assert loop_accepted / loop_drafted > 0.9  # deterministic successor: drafts are almost always right
