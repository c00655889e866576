"""Token-Recycling matrix: cold start, move-to-front, top-K replacement order, chain drafting."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fucina_jax.index.recycling import SENTINEL, TOPK, RecyclingMatrix

S = SENTINEL


def _draft(m: RecyclingMatrix, last: int, limit: int = 8) -> list[int]:
    buf = np.zeros(16, dtype=np.int32)
    return buf[: m.draft(last, buf, limit)].tolist()


def test_cold_start_is_a_sentinel_fill_and_drafts_nothing():
    m = RecyclingMatrix(151_936)
    assert TOPK == 8 and m.k == 8
    assert m.nbytes == 151_936 * 8 * 4  # 4.64 MiB
    assert (m.table == SENTINEL).all()
    assert _draft(m, 0) == [] and _draft(m, 151_935) == []


def test_move_to_front():
    m = RecyclingMatrix(20, k=4)
    m.table[1] = [5, 6, 7, 8]
    m.move_to_front(1, 7)  # present: the ones before it shift right, order kept
    assert m.row(1).tolist() == [7, 5, 6, 8]
    m.move_to_front(1, 7)  # already first: unchanged
    assert m.row(1).tolist() == [7, 5, 6, 8]
    m.move_to_front(1, 9)  # absent: inserted first, the last candidate drops out
    assert m.row(1).tolist() == [9, 7, 5, 6]
    m.move_to_front(2, 3)  # an unseen row fills from the front
    assert m.row(2).tolist() == [3, S, S, S]


def test_committed_bigrams():
    m = RecyclingMatrix(10, k=3)
    m.observe(-1, np.array([1, 2, 1, 3], dtype=np.int32))
    assert m.row(1).tolist() == [3, 2, S] and m.row(2).tolist() == [1, S, S]
    m.observe(3, np.array([1], dtype=np.int32))  # the bigram across the call boundary counts
    assert m.row(3).tolist() == [1, S, S]
    assert m.row(0).tolist() == [S, S, S]


def test_topk_rows_replace_then_move_the_committed_token_to_front():
    m = RecyclingMatrix(50, k=4)
    m.table[1] = [9, 9, 9, 9]
    prev, nxt = np.array([1, 2]), np.array([2, 7])
    rows = np.array([[2, 3, 4, 5, 6], [8, 7, 10, 11, 12]])  # wider than k: truncated
    m.observe_topk(prev, nxt, rows)
    assert m.row(1).tolist() == [2, 3, 4, 5]
    assert m.row(2).tolist() == [7, 8, 10, 11]  # a sampled (non-top-1) token still goes first
    m.observe_topk(np.array([3]), np.array([4]), np.array([[4, 5]]))  # narrower: padded with the sentinel
    assert m.row(3).tolist() == [4, 5, S, S]


def test_chain_draft_walks_top1_stops_at_unseen_rows_and_respects_the_cap():
    m = RecyclingMatrix(20)
    m.observe(-1, np.array([1, 2, 3, 4], dtype=np.int32))
    assert _draft(m, 1) == [2, 3, 4]  # row 4 is unseen
    assert _draft(m, 1, limit=2) == [2, 3]
    m.observe(4, np.array([1], dtype=np.int32))  # closes the cycle 1 2 3 4 1
    assert _draft(m, 3, limit=8) == [4, 1, 2, 3, 4, 1, 2, 3]
    buf = np.zeros(3, dtype=np.int32)
    assert m.draft(3, buf, 8) == 3  # the buffer bounds it too


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.booleans(), st.integers(0, 6)),
        min_size=1,
        max_size=8,
    )
)
def test_split_updates_equal_the_per_position_order(steps):
    """observe() then observe_topk() per step == for each position: replace the row, then move to front."""
    k, vocab = 3, 6
    m = RecyclingMatrix(vocab, k=k)
    model = {t: [S] * k for t in range(vocab)}
    rng = np.random.default_rng(len(steps))
    stream: list[int] = []
    for committed, with_rows, r in steps:
        r = min(r, len(committed))
        rows = rng.integers(0, vocab, size=(r, k))
        prev = stream[-1] if stream else -1
        m.observe(prev, np.array(committed, dtype=np.int32))
        first = len(stream)
        stream += committed
        if with_rows and r:
            pos = np.arange(len(stream) - r, len(stream))
            keep = pos > 0
            m.observe_topk(np.array(stream)[pos[keep] - 1], np.array(stream)[pos[keep]], rows[keep])
        row_at = {int(p): rows[j] for j, p in enumerate(range(len(stream) - r, len(stream)))} if with_rows else {}
        for p in range(first, len(stream)):  # the model: one position at a time
            if p == 0:
                continue
            a, b = stream[p - 1], stream[p]
            if p in row_at:
                model[a] = [int(x) for x in row_at[p]]
            row = model[a]
            if b in row:
                row.remove(b)
            else:
                row.pop()
            row.insert(0, b)
    for t in range(vocab):
        assert m.row(t).tolist() == model[t], (t, steps)
