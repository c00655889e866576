"""Draft sources and drivers shared by the speculative-decoding tests (tests/test_spec_*.py).

Adversarial sources are built from the plain run's stream `truth` (prompt + generated ids): they know what the
target will pick and draft it (perfect), never draft it (garbage), or mix both, so every accept/reject path runs.
"""

from __future__ import annotations

import numpy as np


class ScriptedSource:
    """A DraftSource drafting `draft_fn(stream, step)` (a list of ids) and recording what it observes."""

    def __init__(self, draft_fn, wants_topk: bool = True, max_len: int = 16):
        self.draft_fn = draft_fn
        self.wants_topk = wants_topk  # True by default: shares the compiled verify variant with the cascade
        self.max_len = max_len
        self.observed: list[int] = []
        self.topk_calls: list[tuple[list[int], np.ndarray]] = []  # (ids of the preceding observe, rows)
        self.last_observed: list[int] = []
        self.suggests = 0  # calls so far; draft_fn gets the call's number

    def suggest(self, context, buf):
        assert list(context) == self.observed, "the context must be exactly the observed stream"
        step = self.suggests
        self.suggests += 1
        draft = list(self.draft_fn(self.observed, step))[: min(len(buf), self.max_len)]
        buf[: len(draft)] = draft
        return len(draft)

    def observe(self, committed):
        assert committed.dtype == np.int32 and committed.ndim == 1
        self.observed.extend(int(t) for t in committed)
        self.last_observed = [int(t) for t in committed]

    def observe_topk(self, rows):
        assert self.wants_topk
        self.topk_calls.append((self.last_observed, np.array(rows)))


def perfect(truth):
    """Drafts exactly the ids the plain run commits next (beyond the known stream: nothing)."""
    return lambda stream, step: truth[len(stream) : len(stream) + 16]


def garbage(truth, n_vocab):
    """Every drafted id differs from the plain run's id at its position: every verify rejects at row 0."""
    return lambda stream, step: [(t + 7) % n_vocab for t in truth[len(stream) : len(stream) + 16]] or [1, 2]


def alternating(truth, n_vocab):
    """Step by step: perfect, garbage, then a draft correct for its first (step % 5) ids and wrong after."""

    def fn(stream, step):
        good = truth[len(stream) : len(stream) + 16]
        bad = [(t + 3) % n_vocab for t in good] or [1, 2]
        if step % 3 == 0:
            return good
        if step % 3 == 1:
            return bad
        j = step % 5
        return good[:j] + bad[j:]

    return fn


def empty():
    return lambda stream, step: []


def all_sources(truth, n_vocab):
    return {
        "perfect": ScriptedSource(perfect(truth)),
        "garbage": ScriptedSource(garbage(truth, n_vocab)),
        "alternating": ScriptedSource(alternating(truth, n_vocab)),
        "empty": ScriptedSource(empty()),
    }
