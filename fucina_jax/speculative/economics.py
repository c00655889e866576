"""Per-step speculation economics: how wide each step verifies (1 = a plain step), never what it commits.

A step that verifies a chain of d draft tokens runs w = bucket(d + 1) rows and costs C(w) plain steps of the same
batch. With p_i the probability that draft token i is accepted given that tokens 1..i-1 were,

    E[committed] = 1 + sum_{i <= d} prod_{j <= i} p_j        (the 1 is the correction or bonus token)

and a step of width w over the active rows is worth sum_rows E_row(w) / (rows * C(w)) tokens per row per plain-step
time; a plain step is worth 1. Each step picks the width with the highest value, and verifies only when that beats
1 by `margin` (SpecOptions.min_gain): nothing else switches speculation on or off.

p comes from evidence, counted per evidence key and draft depth (`AcceptanceModel`): the key is what the draft
source says about its draft (`DraftSource.evidence()`, e.g. the cascade's "conversation:8" = the conversation
automaton with a match of 8-15 tokens), so a long verbatim match verifies even right after a losing streak of weak
matches: its key is not the one that lost. Counts start from a pessimistic prior (an unknown key is worth little) and
are windowed (halved past `window` observations), so they follow the text. C(w) comes from the cost gate's model
(CostGate.step_cost: the measured cost table times a live, clamped rescale for one row; the batch's own measured
width costs for several).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from fucina_jax.index.protocol import match_bucket

__all__ = ["AcceptanceModel", "DEPTH_BUCKETS", "MATCH_PRIOR", "expected_committed", "choose_width", "key_prior",
           "MAX_DEPTH"]

# Draft depths 1..15 pooled into buckets (acceptance decays with depth; deep positions are rarer)
DEPTH_BUCKETS = (1, 2, 3, 5, 9)  # bucket i holds depths [DEPTH_BUCKETS[i], DEPTH_BUCKETS[i + 1])
MAX_DEPTH = 15
_DEPTH_OF = [0] + [max(i for i, lo in enumerate(DEPTH_BUCKETS) if d >= lo) for d in range(1, MAX_DEPTH + 1)]


class AcceptanceModel:
    """Counts of (accepted, rejected) per (evidence key, depth bucket): p(key, depth) estimates the conditional
    probability that a draft token at that depth is accepted given the ones before it were.

    Each depth's estimate is shrunk toward the one above it: p_j = (a_j + s * p_{j-1}) / (a_j + r_j + s), with
    p_0 = prior(key) for the first depth: what the key itself says before any verify (`key_prior`: a long verbatim
    match is near-certain, a 1-token match or a recycled candidate a weak guess). A depth that has not been verified
    yet is assumed as good as the depth before it, not as bad as an unknown key, so a source that keeps being right
    earns wider verifies. window: once a cell holds more than this many observations its counts are halved, so old
    evidence fades.

    Plain Python floats, not NumPy: it runs on every step that has a draft, on arrays of 5, where each NumPy call
    costs more than the arithmetic (and more still with the forward's working set in the caches). A key's chain is
    computed once and kept until its counts change."""

    def __init__(self, prior_mean: float | None = None, strength: float = 4.0, window: float = 64.0):
        self.prior_mean = prior_mean  # None: key_prior(key)
        self.strength = strength
        self.window = window
        self._cells: dict[Hashable, list[list[float]]] = {}  # key -> per depth bucket [accepted, rejected]
        self._chains: dict[Hashable, list[float]] = {}  # key -> cumulative(key), until its counts change
        self._priors: dict[Hashable, float] = {}  # key -> key_prior(key), kept (it parses the key)

    def _p(self, key: Hashable) -> list[float]:
        """The estimate per depth bucket."""
        cells = self._cells.get(key)
        if self.prior_mean is not None:
            above = self.prior_mean
        else:
            above = self._priors.get(key)
            if above is None:
                above = self._priors[key] = key_prior(key)
        if cells is None:
            return [above] * len(DEPTH_BUCKETS)
        s = self.strength
        p = []
        for a, r in cells:
            above = (a + s * above) / (a + r + s)
            p.append(above)
        return p

    def cumulative(self, key: Hashable) -> list[float]:
        """P(the first i draft tokens are all accepted) for i = 1..MAX_DEPTH, kept per key (do not modify)."""
        c = self._chains.get(key)
        if c is None:
            p = self._p(key)
            c, run = [], 1.0
            for d in range(1, MAX_DEPTH + 1):
                run *= p[_DEPTH_OF[d]]
                c.append(run)
            self._chains[key] = c
        return c

    def chain(self, key: Hashable, d: int) -> np.ndarray:
        """P(the first i draft tokens are all accepted) for i = 1..d (float64 [d])."""
        return np.asarray(self.cumulative(key)[: max(d, 0)], np.float64)

    def record(self, key: Hashable, drafted: int, accepted: int) -> None:
        """A verify offered `drafted` tokens of this key and the first `accepted` were committed: depths
        1..accepted were accepted, depth accepted + 1 (if offered) was rejected, deeper ones were never tried."""
        if drafted <= 0:
            return
        cells = self._cells.get(key)
        if cells is None:
            cells = self._cells[key] = [[0.0, 0.0] for _ in DEPTH_BUCKETS]
        self._chains.pop(key, None)
        for depth in range(1, min(drafted, accepted + 1, MAX_DEPTH) + 1):
            row = cells[_DEPTH_OF[depth]]
            row[0 if depth <= accepted else 1] += 1.0
            if row[0] + row[1] > self.window:
                row[0] *= 0.5
                row[1] *= 0.5

    def snapshot(self) -> dict:
        """{key: [p per depth bucket]} (statistics)."""
        return {str(k): [round(float(x), 3) for x in self._p(k)] for k in self._cells}


# The first-token acceptance a draft's match length promises before any evidence (a "source:bucket" key,
# index.protocol.match_bucket): a long verbatim match is near-certain, a short one a weak guess.
MATCH_PRIOR = {0: 0.15, 1: 0.2, 2: 0.3, 4: 0.5, 8: 0.7, 16: 0.85, 32: 0.9}
DEFAULT_PRIOR = 0.25  # a key that says nothing (a source without evidence(), the recycling matrix)
SIBLING_PRIOR = 0.05  # an alternative first token (a "sibling..." key): verified only once it has earned it


def key_prior(key: Hashable) -> float:
    """The prior first-token acceptance of an evidence key: MATCH_PRIOR by the key's match bucket ("name:8"),
    SIBLING_PRIOR for a tree's alternative first token ("sibling1", ...), else DEFAULT_PRIOR."""
    if isinstance(key, str) and key.startswith("sibling"):
        return SIBLING_PRIOR
    if isinstance(key, str):
        _, sep, bucket = key.rpartition(":")
        if sep and bucket.isdigit():
            return MATCH_PRIOR.get(int(bucket), DEFAULT_PRIOR)
    return DEFAULT_PRIOR


def expected_committed(chain: Sequence[float], width: int) -> float:
    """E[committed] of a step of `width` rows over a draft whose cumulative acceptance is `chain` (the draft is
    cut to width - 1 tokens)."""
    return 1.0 + float(sum(chain[: max(0, width - 1)]))


def choose_width(chains: Sequence[Sequence[float]], widths: Sequence[int], cost, margin: float) -> tuple[int, float]:
    """(the step width with the highest value, that value) over `widths` (1 = a plain step, value 1). chains: each
    active row's cumulative acceptance of its draft (empty: no draft); cost(w): the step's cost in plain steps of the
    same batch. A width wider than the longest draft + 1 buys nothing and is not considered; a verify is chosen only
    when its value exceeds 1 + margin."""
    rows = len(chains)
    chains = [c.tolist() if isinstance(c, np.ndarray) else c for c in chains]
    longest = max((len(c) for c in chains), default=0)
    best, best_value = 1, 1.0
    if rows == 0 or longest == 0:
        return best, best_value
    # prefix[i]: the rows' summed P over their first i draft tokens (a shorter draft adds nothing past its end)
    prefix = [0.0] * (longest + 1)
    for c in chains:
        run = 0.0
        for i, p in enumerate(c, 1):
            run += p
            prefix[i] += run
        for i in range(len(c) + 1, longest + 1):
            prefix[i] += run
    top = _next_width(widths, longest + 1)
    for w in widths:
        if w <= 1 or w > top:
            continue
        c = cost(w)
        if not math.isfinite(c) or c <= 0:
            continue
        value = (rows + prefix[min(w - 1, longest)]) / (rows * c)
        if value > best_value * (1.0 + 1e-9) and value > 1.0 + margin:
            best, best_value = w, value
    return best, best_value


def _next_width(widths: Sequence[int], n: int) -> int:
    """The smallest width >= n (the bucket a draft of n - 1 tokens runs in)."""
    for w in widths:
        if w >= n:
            return w
    return widths[-1]
