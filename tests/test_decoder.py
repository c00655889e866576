"""The decoder's accept rule and statistics as pure functions (no model): fucina_jax.decoder.accept against an
independent plain-decoding loop over a deterministic "target", on random and adversarial drafts.

The target is a function from a prefix to its next token (what the sampler would draw at that position, which is
all the rule may depend on). Plain decoding commits target(stream) one token at a time, stopping before a stop id
and after `limit` ids; a verify's row i is target(stream + draft[:i]). accept() over those rows must commit exactly
what the plain loop commits in the same number of ids or fewer: the longest matching prefix plus one.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from fucina_jax.decoder import Outcome, SpecStats, accept

V = 6  # a tiny vocabulary: drafts often match and often not


def target(prefix: tuple[int, ...]) -> int:
    """A deterministic next-token function with some structure (repeats and a rare stop-prone token)."""
    h = 0
    for t in prefix[-3:]:
        h = (h * 31 + t + 7) % 1009
    return h % V


def plain(stream: tuple[int, ...], stops: frozenset[int], limit: int) -> tuple[list[int], bool]:
    """What plain decoding commits from `stream` before it would stop or reach `limit` ids, and whether it stopped
    on a stop id (it commits one id at a time: the reference the rule is checked against)."""
    out: list[int] = []
    while len(out) < limit:
        t = target(stream + tuple(out))
        if t in stops:
            return out, True
        out.append(t)
    return out, False


def rows(stream, draft):
    """A verify's samples: row i is the target's pick after stream + draft[:i] (rows 0..d)."""
    return [target(tuple(stream) + tuple(draft[:i])) for i in range(len(draft) + 1)]


@settings(max_examples=600, deadline=None)
@given(stream=st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
       draft=st.lists(st.integers(0, V - 1), max_size=8),
       stops=st.frozensets(st.integers(0, V - 1), max_size=2),
       limit=st.integers(1, 12),
       truthful=st.integers(0, 8))
def test_accept_commits_a_prefix_of_the_plain_stream(stream, draft, stops, limit, truthful):
    stream = tuple(stream)
    # the first `truthful` draft tokens are the target's own (accepted), the rest random (usually rejected)
    good, _ = plain(stream, frozenset(), truthful)
    draft = (good + draft)[: max(len(draft), len(good))][: max(0, limit - 1)]
    o = accept(rows(stream, draft), draft, stops, limit)
    want, stopped = plain(stream, stops, limit)
    k = len(o.committed)
    # commits the plain stream's next ids, as many as the matching prefix allows, never past a stop or the limit
    assert list(o.committed) == want[:k]
    assert 1 <= k + o.stopped and k <= limit
    assert o.accepted == sum(1 for i in range(min(k, len(draft))) if draft[i] == o.committed[i])
    # it stops exactly where plain decoding does, or ends at its first mismatch / the whole draft
    if o.stopped:
        assert stopped and k == len(want)
    elif k < len(want):
        assert o.rejected or o.bonus or k == limit or not draft  # a plain step commits one id
    assert not (o.rejected and o.bonus)
    assert o.drafted == len(draft)
    # the whole draft accepted -> the bonus row's sample is committed too (unless a stop or the limit came first)
    if draft and all(a == b for a, b in zip(draft, want)) and len(want) > len(draft) and limit > len(draft):
        assert o.bonus and k == len(draft) + 1


def test_accept_cases():
    # perfect draft of 3: 3 accepted + the bonus row's token
    assert accept([5, 6, 7, 8], [5, 6, 7], set(), 10) == Outcome((5, 6, 7, 8), False, 3, 3)
    # a mismatch at row 1: one accepted, the correction committed
    o = accept([5, 9, 7, 8], [5, 6, 7], set(), 10)
    assert o == Outcome((5, 9), False, 3, 1) and o.rejected and not o.bonus
    # a stop sampled at row 2: rows 0-1 committed, the stop id not
    o = accept([5, 6, 2, 8], [5, 6, 7], {2}, 10)
    assert o == Outcome((5, 6), True, 3, 2) and not o.rejected and not o.bonus
    # a stop at row 0: nothing committed
    assert accept([2, 6], [5], {2}, 10) == Outcome((), True, 1, 0)
    # the limit cuts an accepted run: neither rejected nor bonus
    o = accept([5, 6, 7, 8], [5, 6, 7], set(), 2)
    assert o == Outcome((5, 6), False, 3, 2) and not o.rejected and not o.bonus
    # a plain step: one id, counted as neither
    o = accept([4], [], set(), 1)
    assert o == Outcome((4,), False, 0, 0) and not o.rejected and not o.bonus
    # a sampled row past the draft is never read
    assert accept([4, 99], [], set(), 5) == Outcome((4,), False, 0, 0)


def test_stats_count_verifies_only():
    s = SpecStats()
    s.record(accept([4], [], set(), 1))  # plain
    s.record(accept([5, 9, 7], [5, 6], set(), 10))  # correction
    s.record(accept([5, 6, 7], [5, 6], set(), 10))  # bonus
    s.record(accept([5, 2], [5, 6], {2}, 10))  # a stop after one accepted
    s.steps = 4
    assert (s.verify_steps, s.drafted, s.accepted, s.rejected, s.bonus, s.committed) == (3, 6, 4, 1, 1, 7)
    assert s.tok_per_step == pytest.approx(7 / 4) and s.acceptance == pytest.approx(4 / 6)
