"""Unit tests of the suffix automaton: recency, frozen cursors, poisoning, input validation, bounds."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from fucina_jax.errors import DraftIndexError, IndexFrozenError, IndexPoisonedError
from fucina_jax.index import sam_ref
from fucina_jax.index.sam import Cursor, SuffixAutomaton
from fucina_jax.index.sam_ref import SuffixAutomatonRef

BOTH = [SuffixAutomaton, SuffixAutomatonRef]


def _draft(index, limit=8):
    buf = np.zeros(limit, dtype=np.int32)
    return buf[: index.draft(buf)].tolist()


@pytest.mark.parametrize("cls", BOTH)
def test_recency_drafts_follow_the_latest_revision(cls):
    a, b, c, d, e = 1, 2, 3, 4, 5
    s = cls()
    s.extend([a, b, c, d, 8, a, b, c, e, 9, a, b, c])
    assert s.match_len == 3
    assert s.match_pos == 7  # the second "a b c", not the first one (ending at 2)
    assert _draft(s, 3) == [e, 9, a]


@pytest.mark.parametrize("cls", BOTH)
def test_no_self_match(cls):
    s = cls()
    s.extend([7, 8, 9])
    assert s.match_len == 0 and s.match_pos == -1 and _draft(s) == []
    s.append(7)
    assert s.match_len == 1 and s.match_pos == 0 and _draft(s, 4) == [8, 9, 7, 8]


@pytest.mark.parametrize("cls", BOTH)
def test_overlapping_draft_continues_the_period(cls):
    s = cls()
    s.extend([5] * 10)
    assert s.match_len == 9 and s.match_pos == 8
    assert _draft(s, 12) == [5] * 12
    p = cls()
    p.extend([1, 2, 3] * 4)
    assert _draft(p, 7) == [1, 2, 3, 1, 2, 3, 1]


@pytest.mark.parametrize("cls", BOTH)
def test_draft_limit_and_buffer_length(cls):
    s = cls()
    s.extend([1, 2, 3, 4, 1, 2])
    buf = np.zeros(10, dtype=np.int32)
    assert s.draft(buf, 2) == 2 and buf[:2].tolist() == [3, 4]
    assert s.draft(buf, 0) == 0
    assert s.draft(buf[:3]) == 3
    assert s.draft(buf, 99) == 10


def test_large_token_ids():
    big = [151935, 2**31 - 1, 0, 151935, 2**31 - 1]
    fast, ref = SuffixAutomaton(), SuffixAutomatonRef()
    fast.extend(np.array(big, dtype=np.int64))
    ref.extend(big)
    assert fast.match_len == ref.match_len == 2 and fast.match_pos == ref.match_pos == 1
    assert _draft(fast, 3) == _draft(ref, 3) == [0, 151935, 2**31 - 1]


def test_c_equals_reference_on_a_long_stream_with_a_large_vocabulary():
    """Exercises hash growth and many clones: C and reference agree after every one of 6000 appends."""
    rng = np.random.default_rng(0)
    stream: list[int] = []
    while len(stream) < 6000:  # text-like: fresh Zipf tokens mixed with copies of earlier spans
        if stream and rng.random() < 0.3:
            a = int(rng.integers(0, len(stream)))
            stream += stream[a : a + int(rng.integers(2, 40))]
        else:
            stream += (rng.zipf(1.2, size=int(rng.integers(1, 20))) % 50_000).tolist()
    fast, ref = SuffixAutomaton(), SuffixAutomatonRef()
    buf_f, buf_r = np.zeros(16, np.int32), np.zeros(16, np.int32)
    for t in stream:
        fast.append(t)
        ref.append(t)
        assert (fast.match_len, fast.match_pos) == (ref.match_len, ref.match_pos)
    assert fast.draft(buf_f) == ref.draft(buf_r) and np.array_equal(buf_f, buf_r)
    assert (fast.n_states, fast.n_transitions) == (ref.n_states, ref.n_transitions)
    assert fast._check_cursor_invariant()


@pytest.mark.parametrize("cls", BOTH)
def test_classical_bounds_are_reached_exactly(cls):
    """'a b..b' has 2n-1 states and 'a b..b c' has 3n-4 transitions: the counts are the real ones."""
    n = 40
    s = cls()
    s.extend([0] + [1] * (n - 1))
    assert s.n_states == 2 * n - 1
    t = cls()
    t.extend([0] + [1] * (n - 2) + [2])
    assert t.n_transitions == 3 * n - 4


# ---- frozen mode and external cursors ---------------------------------------------------------------


@pytest.mark.parametrize("cls", BOTH)
def test_append_to_frozen_index_raises(cls):
    s = cls()
    s.extend([1, 2, 3, 1, 2])
    s.freeze()
    s.freeze()  # idempotent
    with pytest.raises(IndexFrozenError):
        s.append(3)
    with pytest.raises(IndexFrozenError):
        s.extend([3, 4])
    assert len(s) == 5 and not s.poisoned and s.match_len == 2


@pytest.mark.parametrize("cls", BOTH)
def test_cursor_needs_a_frozen_index(cls):
    s = cls()
    s.extend([1, 2, 3])
    with pytest.raises(DraftIndexError, match="freeze"):
        s.cursor()


def test_many_cursors_over_one_document():
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 6, size=400)
    sam = SuffixAutomaton.reference(doc)
    ref = SuffixAutomatonRef()
    ref.extend(doc)
    ref.freeze()
    streams = [rng.integers(0, 7, size=int(rng.integers(1, 60))) for _ in range(64)]
    cursors = [sam.cursor() for _ in streams]
    # interleaved feeding: cursors share the automaton but not their position
    for step in range(60):
        for cursor, stream in zip(cursors, streams):
            if step < len(stream):
                cursor.advance(stream[step : step + 1])
    buf, buf_ref = np.zeros(12, np.int32), np.zeros(12, np.int32)
    for cursor, stream in zip(cursors, streams):
        fresh = ref.cursor()
        fresh.advance(stream)
        assert (cursor.match_len, cursor.match_pos) == (fresh.match_len, fresh.match_pos)
        n = cursor.draft(buf)
        assert n == fresh.draft(buf_ref) and np.array_equal(buf[:n], buf_ref[:n])
        if cursor.match_len:
            pos, length = cursor.match_pos, cursor.match_len
            assert doc[pos - length + 1 : pos + 1].tolist() == stream[len(stream) - length :].tolist()
            assert buf[:n].tolist() == doc[pos + 1 : pos + 1 + 12].tolist()


def test_cursor_reset_and_owner_lifetime():
    sam = SuffixAutomaton.reference([4, 5, 6, 7])
    cursor = sam.cursor()
    assert isinstance(cursor, Cursor) and cursor.index is sam
    del sam  # the cursor keeps its automaton alive
    cursor.advance([4, 5])
    assert cursor.match_len == 2 and cursor.match_pos == 1
    buf = np.zeros(5, np.int32)
    assert cursor.draft(buf) == 2 and buf[:2].tolist() == [6, 7]  # cut at the document's end
    cursor.reset()
    assert cursor.match_len == 0 and cursor.draft(buf) == 0


def test_frozen_index_applies_the_pending_refresh():
    """After freeze the most recent occurrence seen by the construction is a legal sample."""
    s = SuffixAutomaton()
    s.extend([1, 2, 9, 1, 2])
    before = s.match_pos
    s.freeze()
    c = s.cursor()
    c.advance([1, 2])
    assert before == 1 and c.match_pos == 4


# ---- poisoning --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BOTH)
def test_failed_append_poisons_the_index(cls):
    s = cls(max_tokens=6)
    s.extend([1, 2, 3, 1, 2])
    assert s.match_len == 2
    with pytest.raises(IndexPoisonedError, match="max_tokens"):
        s.extend([3, 1, 2])  # the 7th token does not fit
    assert s.poisoned
    assert s.match_len == 0 and s.match_pos == -1 and _draft(s) == []
    s.extend([1, 2, 3])  # ignored: the failure was reported once, the index stays dark
    s.append(1)
    assert s.poisoned and s.match_len == 0 and _draft(s) == []
    s.freeze()
    c = s.cursor()
    c.advance([1, 2, 3])
    assert c.match_len == 0 and c.draft(np.zeros(4, np.int32)) == 0


def test_zero_capacity_index_poisons_on_first_append():
    s = SuffixAutomaton(max_tokens=0)
    with pytest.raises(IndexPoisonedError):
        s.append(1)
    assert s.poisoned


# ---- input validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BOTH)
def test_bad_tokens_raise_before_appending(cls):
    s = cls()
    s.extend([1, 2])
    for bad in ([3, -1, 4], np.array([3, 2**31], dtype=np.int64), np.array([-5], dtype=np.int32)):
        with pytest.raises(DraftIndexError):
            s.extend(bad)
    with pytest.raises(DraftIndexError):
        s.append(-1)
    assert len(s) == 2 and not s.poisoned


def test_token_array_types():
    expected = [3, 1, 4, 1, 5, 9, 2, 6]
    arrays = [
        expected,
        tuple(expected),
        np.array(expected, dtype=np.int32),
        np.array(expected, dtype=np.int64),
        np.array(expected, dtype=np.uint16),
        np.array(expected, dtype=np.uint8),
        np.repeat(np.array(expected, dtype=np.int32), 2)[::2],  # strided: the slow path
        [np.int64(t) for t in expected],
    ]
    for arr in arrays:
        s = SuffixAutomaton()
        s.extend(arr)
        assert s.stream().tolist() == expected
    s = SuffixAutomaton()
    for bad in (np.zeros(3, np.float32), np.zeros((2, 2), np.int32), ["a"], 3.5):
        with pytest.raises((DraftIndexError, TypeError)):
            s.extend(bad)


def test_draft_buffer_must_be_writable_int32():
    s = SuffixAutomaton()
    s.extend([1, 2, 1])
    for bad in (np.zeros(4, np.int64), np.zeros(4, np.float32), np.zeros((2, 2), np.int32), b"abcd"):
        with pytest.raises(DraftIndexError):
            s.draft(bad)
    ro = np.zeros(4, np.int32)
    ro.flags.writeable = False
    with pytest.raises(DraftIndexError):
        s.draft(ro)


def test_reference_builder_and_memory_release():
    doc = np.random.default_rng(2).integers(0, 1000, size=5000)
    grown = SuffixAutomaton()
    grown.extend(doc)
    nbytes_growing = grown.nbytes
    grown.freeze()
    ref = SuffixAutomaton.reference(doc)
    assert ref.frozen and len(ref) == 5000
    assert (ref.n_states, ref.n_transitions) == (grown.n_states, grown.n_transitions)
    assert grown.nbytes < nbytes_growing  # freeze releases the edge pool and trims the arrays
    assert "frozen" in repr(ref)


def test_index_package_never_imports_jax():
    """fucina_jax.index is JAX-free: no module in it imports jax (or package modules that would)."""
    root = pathlib.Path(sam_ref.__file__).parent
    allowed = {"fucina_jax.errors"}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("jax"), (path.name, name)
                if name.startswith("fucina_jax"):
                    assert name in allowed or name.startswith("fucina_jax.index"), (path.name, name)
