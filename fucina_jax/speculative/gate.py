"""The cost gate: decides WHEN speculation runs (never what is committed), from measured verify economics.

Design record section 4. A verify over a draft costs C(k) plain decode steps and commits 1 + accepted tokens, so
over a rolling window of verify steps

    est_speedup = committed tokens / verify cost in plain-step equivalents

Fallback (plain) steps cost exactly a plain step and never enter the window: only verifies can lose time.

Verify cost is hybrid: a static measured table (the curve's shape) times a live multiplier learned from measured
verify/plain time ratios when the decoder has a clock, an exponentially weighted moving average (alpha 0.2)
clamped to [0.25, 4]. One noisy sample moves the estimate by at most 20% of its clamped deviation, so a scheduler
stall cannot flip the gate, while a machine whose economics differ from the table is learned within a few verifies.
A verify is never cheaper than the plain step it replaces (cost >= 1). Without a clock the table applies as is.

Policy (SpecOptions): speculate while est_speedup >= 1.0; once off, wait `reprobe_after` (128) plain steps, then
probe with `probe_steps` (4) verifies; the probe re-enables only at >= 1.0 + 0.1 (hysteresis), a failed probe
doubles the wait up to `reprobe_max` (1024), a passed one restarts it at the base. The window is evaluated per
verify once it holds >= 8 drafted tokens and >= 2 verifies (one verify is too noisy to act on). The draft budget
follows the window's acceptance: max(min_draft, 2 + ceil(acceptance * max_draft)), capped at max_draft.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

from fucina_jax.checks import is_int, is_real
from fucina_jax.errors import (
    CostTableEmpty,
    ProbeStepsZero,
    RateWindowTooSmall,
    ReprobeAfterZero,
    SpecOptionsError,
)
from fucina_jax.speculative.cost_table import DEFAULT_TABLE_PATH, read_batch_costs, read_cost_points

__all__ = ["CostPoint", "DEFAULT_BATCH_COSTS", "DEFAULT_COST_TABLE", "MAX_DRAFT", "SpecOptions", "CostGate", "table_cost"]


@dataclasses.dataclass(frozen=True)
class CostPoint:
    """A verify over `draft_len` draft tokens costs `cost` plain decode steps."""

    draft_len: int
    cost: float


# Measured on the embedded Gemma 3 270M Q4_K_M by the --spec-bench probe (fucina_jax.speculative.bench: the fused
# verify+sample step of each width against the fused decode+sample step, calls interleaved, best of several pairs per
# round, median of rounds; the CLI's default sampler, ctx 4096, 128 cached tokens) and shipped as package data, one
# file per kernel instruction set (speculative/cost_table.py picks it): the file records the command, date, machine and raw
# ratios. On an AVX-512 VNNI Zen 4 C(width 2, 4, 8, 16) = 1.05, 1.12, 1.40, 2.75; on an AVX2-only Zen 3 1.04, 1.38,
# 1.95, 3.84 (its multi-row int8 products cost ~4x the instructions). A measured cost below 1 is entered as 1.0: a
# verify never costs less than the plain step it replaces. The gate's live multiplier (above) learns the rest.
# A draft of d tokens runs the padded bucket of width bucket_for(d + 1), so the decoder prices a verify at the
# bucket's draft slots (width - 1): the keys are those slots; interpolation only serves custom tables.
DEFAULT_COST_TABLE: tuple[CostPoint, ...] = tuple(CostPoint(d, c) for d, c in read_cost_points(DEFAULT_TABLE_PATH))
# The same file's batch surface, (rows, width, cost): a step of `width` rows per batch row over `rows` batch rows in
# plain steps of that batch (width 1: the batch's plain step in one-row plain steps). CostGate.modelled_cost prices
# what it does not hold.
DEFAULT_BATCH_COSTS: tuple[tuple[int, int, float], ...] = tuple(read_batch_costs(DEFAULT_TABLE_PATH))

# The widest verify bucket (engine.VERIFY_BUCKETS[-1] = 16 rows) holds the carried token + 15 draft tokens.
MAX_DRAFT = 15

POLICIES = ("economics", "gate")


_FIELD_TYPES = {"int": (is_int, "an int"), "float": (is_real, "a number"),
                "bool": (lambda v: isinstance(v, bool), "a bool")}


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """The speculative decoder's knobs; the defaults are the design record's policy constants."""

    max_draft: int = MAX_DRAFT  # longest draft per verify (<= MAX_DRAFT: the widest verify bucket)
    min_draft: int = 2  # shorter drafts run a plain step (a 1-token verify buys at most one token)
    enabled: bool = True  # False: every step is a plain step (the source still observes the stream)
    rate_window: int = 16  # verify steps in the gate's rolling window
    min_window_drafted: int = 8  # evaluate once the window holds this many drafted tokens (and >= 2 verifies)
    min_speedup: float = 1.0  # speculate while est_speedup >= this
    probe_margin: float = 0.10  # a probe re-enables only at >= min_speedup + probe_margin
    reprobe_after: int = 128  # disabled steps before the first re-probe; doubles per failed probe
    reprobe_max: int = 1024  # cap of the re-probe wait
    probe_steps: int = 4  # verify steps one probe runs before deciding
    cost_table: tuple[CostPoint, ...] = DEFAULT_COST_TABLE
    adapt_budget: bool = True  # cap the draft by the window's acceptance rate ("gate" policy)
    # "economics": every step picks its width from the drafts' evidence and the measured cost curve
    # (speculative/economics.py); "gate": the design record's on/off gate with an acceptance-adaptive budget
    policy: str = "economics"
    min_gain: float = 0.02  # "economics": verify only when the best width's value beats a plain step by this
    batch_costs: tuple[tuple[int, int, float], ...] = DEFAULT_BATCH_COSTS  # (rows, width, cost): see above
    # "economics": alternatives to a draft's first token offered as siblings in a tree verify (the source's
    # `siblings`, e.g. the recycling matrix's other candidates); 0: every verify is a chain
    tree_siblings: int = 0

    @classmethod
    def up_to(cls, max_draft: int) -> SpecOptions:
        """The defaults with drafts of at most max_draft tokens; the shortest verified draft follows it down, so
        max_draft 1 verifies 1-token drafts (--max-draft)."""
        return cls(max_draft=max_draft, min_draft=min(cls.min_draft, max_draft))

    def validate(self) -> SpecOptions:
        """Check every value (the gate's four degenerate settings raise their own error types)."""
        for f in dataclasses.fields(self):  # the annotations are strings (postponed evaluation)
            check, what = _FIELD_TYPES.get(f.type, (None, ""))
            if check is not None and not check(getattr(self, f.name)):
                raise SpecOptionsError(f"{f.name} = {getattr(self, f.name)!r} is invalid: it must be {what}")
        if self.policy not in POLICIES:
            raise SpecOptionsError(f"policy = {self.policy!r} is invalid: it must be one of {', '.join(POLICIES)}")
        if not isinstance(self.cost_table, (tuple, list)):
            raise SpecOptionsError(f"cost_table must be a tuple of CostPoint(draft_len, cost), got "
                                   f"{type(self.cost_table).__name__}")
        if self.rate_window < 2:
            raise RateWindowTooSmall(
                f"rate_window = {self.rate_window} is invalid: the gate needs a window of >= 2 verify steps "
                "(one verify is too noisy to act on); the default is 16"
            )
        if self.probe_steps < 1:
            raise ProbeStepsZero(
                f"probe_steps = {self.probe_steps} is invalid: a re-probe runs >= 1 verify step; the default is 4"
            )
        if len(self.cost_table) < 1:
            raise CostTableEmpty(
                "cost_table is empty: give at least one CostPoint(draft_len, cost), or keep DEFAULT_COST_TABLE"
            )
        if self.reprobe_after < 1:
            raise ReprobeAfterZero(
                f"reprobe_after = {self.reprobe_after} is invalid: wait >= 1 disabled step before a re-probe "
                "(the default is 128); to turn speculation off use enabled=False"
            )
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise SpecOptionsError(
                f"max_draft = {self.max_draft} is invalid: it must be in [1, {MAX_DRAFT}] (the widest verify "
                "bucket holds the carried token + 15 drafts)"
            )
        if self.min_draft < 1:
            raise SpecOptionsError(f"min_draft = {self.min_draft} is invalid: it must be >= 1 (the default is 2)")
        if self.min_draft > self.max_draft:
            raise SpecOptionsError(f"min_draft = {self.min_draft} is above max_draft = {self.max_draft}: no draft "
                                   "would ever be verified; to turn speculation off use enabled=False")
        if self.reprobe_max < self.reprobe_after:
            raise SpecOptionsError(
                f"reprobe_max = {self.reprobe_max} is below reprobe_after = {self.reprobe_after}: the backoff "
                "cap must be >= its base"
            )
        if not 0 <= self.tree_siblings <= MAX_DRAFT - 1:
            raise SpecOptionsError(f"tree_siblings = {self.tree_siblings} is invalid: it must be in [0, "
                                   f"{MAX_DRAFT - 1}] (0: chains only)")
        if self.min_window_drafted < 0:
            raise SpecOptionsError(f"min_window_drafted = {self.min_window_drafted} is invalid: it must be >= 0")
        for name in ("min_speedup", "probe_margin", "min_gain"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise SpecOptionsError(f"{name} = {v!r} is invalid: it must be a finite number >= 0")
        last = 0
        for p in self.cost_table:
            if not isinstance(p, CostPoint) or not is_int(p.draft_len) or not is_real(p.cost) or \
                    p.draft_len <= last or not (math.isfinite(p.cost) and p.cost > 0):
                raise SpecOptionsError(
                    f"cost_table = {self.cost_table!r} is invalid: it must be CostPoint(draft_len, cost) entries "
                    "with strictly increasing draft_len >= 1 and finite costs > 0"
                )
            last = p.draft_len
        for e in self.batch_costs:
            if not (isinstance(e, tuple) and len(e) == 3 and is_int(e[0]) and e[0] >= 2 and is_int(e[1]) and
                    e[1] >= 1 and is_real(e[2]) and math.isfinite(e[2]) and e[2] > 0):
                raise SpecOptionsError(f"batch_costs entry {e!r} is invalid: it must be (rows >= 2, width >= 1, "
                                       "finite cost > 0)")
        return self


def table_cost(table: tuple[CostPoint, ...], draft_len: int) -> float:
    """Static verify cost of a draft of `draft_len` tokens: linear between points, clamped at the ends."""
    if draft_len <= table[0].draft_len:
        return float(table[0].cost)
    for a, b in itertools.pairwise(table):
        if draft_len <= b.draft_len:
            t = (draft_len - a.draft_len) / (b.draft_len - a.draft_len)
            return float(a.cost + t * (b.cost - a.cost))
    return float(table[-1].cost)


_Entry = collections.namedtuple("_Entry", "committed accepted drafted cost")


class CostGate:
    """The gate's state machine: "on" -> "off" (after a losing window) -> "probing" -> "on" or "off" again.

    The decoder calls, per step: allows() (False: run a plain step); note_plain_ns(ns) after a timed plain
    step; verify_cost(draft_len, ns) and record_verify(...) after each verify; budget_cap(...) before drafting.
    """

    PLAIN_ALPHA = 0.25  # EWMA weight of a new plain-step time
    SCALE_ALPHA = 0.2  # EWMA weight of a new verify-cost rescale sample
    SCALE_MIN = 0.25
    SCALE_MAX = 4.0

    def __init__(self, options: SpecOptions = SpecOptions()):
        self.options = options.validate()
        self.state = "on"
        self.backoff = options.reprobe_after  # disabled steps before the next probe
        self.off_steps = 0
        self.probe_left = 0
        self.plain_ns = 0.0  # EWMA of the plain step time
        self.plain_samples = 0
        self.cost_scale = 1.0  # live rescale of the static table
        # decision counts, for the statistics
        self.trips = 0  # on -> off
        self.probes = 0  # re-probes started
        self.probes_passed = 0
        self.probes_failed = 0
        self._measured: dict[tuple[int, int], float] = {}  # (batch rows, width) -> measured cost in plain steps
        self._plain_by_rows: dict[int, float] = {}  # batch rows stepped -> EWMA of that plain step's time
        self._batch_costs = {(r, w): c for r, w, c in options.batch_costs}
        self._window: collections.deque[_Entry] = collections.deque(maxlen=options.rate_window)
        self._reset_window()

    # ---- the decoder's calls ------------------------------------------------------------------------

    def allows(self) -> bool:
        """May this step speculate? While off, counts the step toward the next probe."""
        if self.state != "off":
            return True
        self.off_steps += 1
        if self.off_steps >= self.backoff:
            self.state = "probing"
            self.probe_left = self.options.probe_steps
            self.probes += 1
            self._reset_window()
            return True
        return False

    def note_plain_ns(self, ns: float, rows: int | None = None) -> None:
        """Feed one plain step's wall time into the live cost model (rows: the batch rows it computed, when the
        decoder steps fewer than all of them: each row count's plain step is kept apart for note_step)."""
        a = self.PLAIN_ALPHA
        self.plain_ns = float(ns) if self.plain_samples == 0 else a * ns + (1.0 - a) * self.plain_ns
        self.plain_samples += 1
        if rows is not None:
            old = self._plain_by_rows.get(rows)
            self._plain_by_rows[rows] = float(ns) if old is None else a * ns + (1.0 - a) * old

    def verify_cost(self, draft_len: int, verify_ns: float | None = None, rows: int = 1) -> float:
        """One verify's cost in plain-step equivalents.

        One row: the table times the live scale, which a timed verify updates. Several rows (a batch, one forward
        for all of them): the measured ratio to the batch's own plain step (else the table), times the rows, since
        a plain step commits one token per row; so est_speedup is tokens per row per plain-step time. Why not the
        single-stream table: at B > 1 a CPU forward stops being bound by streaming the weights and its cost grows
        with B * k (a width-8 step costs 2.8 width-1 steps at B = 1, 5.4 at B = 2 and 8.4 at B = 4 on Gemma 3 270M,
        2 cores), so the table underprices batches."""
        if rows > 1:
            if verify_ns is not None and self.plain_samples and self.plain_ns > 0:
                return max(verify_ns / self.plain_ns, 1.0) * rows
            return max(table_cost(self.options.cost_table, draft_len), 1.0) * rows
        base = table_cost(self.options.cost_table, draft_len)
        if verify_ns is not None and self.plain_samples > 0 and self.plain_ns > 0:
            measured = max(verify_ns / self.plain_ns, 1.0)
            sample = min(max(measured / base, self.SCALE_MIN), self.SCALE_MAX)
            scale = self.SCALE_ALPHA * sample + (1.0 - self.SCALE_ALPHA) * self.cost_scale
            self.cost_scale = min(max(scale, self.SCALE_MIN), self.SCALE_MAX)
        return max(self.cost_scale * base, 1.0)

    # An unmeasured width is priced this much below the table (times the live scale) while a clock runs, so that a
    # width the table makes a near miss is tried, and measured, once: the table's shape is one machine's.
    UNMEASURED_DISCOUNT = 0.1

    def step_cost(self, width: int, rows: int = 1) -> float:
        """The predicted cost of a step of `width` rows per batch row over `rows` batch rows, in plain steps of the
        same batch (1 for a plain step): the measured cost of that (rows, width) (an EWMA, like the scale) once one
        was timed, else a model (`modelled_cost`), priced UNMEASURED_DISCOUNT lower while a clock runs so that a
        near miss is tried, and measured, once."""
        if width <= 1:
            return 1.0
        measured = self._measured.get((rows, width))
        if measured is not None:
            return measured
        base = self.modelled_cost(width, rows)
        return max(base * (1.0 - self.UNMEASURED_DISCOUNT), 1.0) if self.plain_samples else base

    def single_stream_cost(self, tokens: int) -> float:
        """C_1(T): one row's step over T token rows, in its plain steps: the table times the live scale, extended
        past its widest bucket along the slope of its last two points (a step over more tokens than a verify
        bucket holds only happens in a batch)."""
        if tokens <= 1:
            return 1.0
        table = self.options.cost_table
        last = table[-1]
        c = table_cost(table, tokens - 1)
        if tokens - 1 > last.draft_len and len(table) > 1:
            prev = table[-2]
            slope = max((last.cost - prev.cost) / (last.draft_len - prev.draft_len), 0.0)
            c = last.cost + slope * (tokens - 1 - last.draft_len)
        return max(self.cost_scale * c, 1.0)

    def modelled_cost(self, width: int, rows: int = 1) -> float:
        """The cost of an unmeasured (rows, width) step. One row: C_1(width). A batch: the cost table's batch
        surface where it holds (rows, width), else a model from the single-stream curve: the batch's plain step over
        `rows` rows (measured live, else the surface's width-1 entry, else C_1(rows) one-row steps) plus what C_1
        says the extra rows * (width - 1) token rows cost:

            C_B(w) = 1 + (C_1(B * w) - C_1(B)) * t(1 row, plain) / t(B rows, plain)

        At B > 1 a forward's cost grows with the B * w tokens it carries and each batch row adds its own
        attention and sampling, so the single-stream C_1(w) would underprice a batch verify badly (measured on
        Gemma 3 270M, 2 cores, ctx 4096: C_8(4) = 2.7 plain B = 8 steps against C_1(4) = 1.16). Given the
        surface's plain ratios, this model came within -13%..+19% of the measured surface there, above it at 10 of
        its 12 points (tests/test_spec_economics.py checks it against the shipped file)."""
        if width <= 1:
            return 1.0
        if rows <= 1:
            return self.single_stream_cost(width)
        surface = self._batch_costs.get((rows, width))
        if surface is not None:
            return max(surface, 1.0)
        one, batch = self._plain_by_rows.get(1), self._plain_by_rows.get(rows)
        if one and batch:
            ratio = one / batch
        else:
            ratio = 1.0 / self._batch_costs.get((rows, 1), self.single_stream_cost(rows))
        return max(1.0 + (self.single_stream_cost(rows * width) - self.single_stream_cost(rows)) * min(ratio, 1.0),
                   1.0)

    def note_step(self, width: int, rows: int, ns: float) -> None:
        """A timed verify of `width` rows (per batch row) over `rows` batch rows ("economics" policy; a plain step's
        time goes to note_plain_ns): its cost joins the width's EWMA, and for one row the table's live scale."""
        plain = self._plain_by_rows.get(rows, self.plain_ns)
        if width <= 1 or self.plain_samples == 0 or plain <= 0:
            return
        base = table_cost(self.options.cost_table, width - 1)
        if rows == 1:
            self.verify_cost(width - 1, ns)
        sample = min(max(ns / plain, 1.0), self.SCALE_MAX * base * rows)
        old = self._measured.get((rows, width))
        self._measured[rows, width] = sample if old is None else \
            self.SCALE_ALPHA * sample + (1 - self.SCALE_ALPHA) * old

    def record_verify(self, committed: int, accepted: int, drafted: int, cost: float) -> None:
        """Add one verify's outcome to the window and run the decision."""
        w = self._window
        if len(w) == w.maxlen:
            old = w[0]
            self.sum_committed -= old.committed
            self.sum_accepted -= old.accepted
            self.sum_drafted -= old.drafted
            self.sum_cost -= old.cost
        w.append(_Entry(committed, accepted, drafted, cost))
        self.sum_committed += committed
        self.sum_accepted += accepted
        self.sum_drafted += drafted
        self.sum_cost += cost

        o = self.options
        evaluable = len(w) >= 2 and self.sum_drafted >= o.min_window_drafted
        if self.state == "on":
            if evaluable and self.est_speedup() < o.min_speedup:
                self.trips += 1
                self._to_off(o.reprobe_after)  # a fresh degradation episode backs off from the base wait
        elif self.state == "probing":
            self.probe_left -= 1
            if evaluable and self.est_speedup() < o.min_speedup:
                self._fail_probe()  # a clear loss mid-probe fails early
            elif self.probe_left == 0:
                if self.est_speedup() >= o.min_speedup + o.probe_margin:
                    self.state = "on"
                    self.probes_passed += 1
                    self.backoff = o.reprobe_after  # the next trip waits the base again
                else:
                    self._fail_probe()
        else:
            raise RuntimeError("record_verify while the gate is off: allows() returned False for this step")

    def est_speedup(self) -> float:
        """Committed tokens per plain-step equivalent over the window; infinite on an empty window."""
        return math.inf if self.sum_cost <= 0 else self.sum_committed / self.sum_cost

    def budget_cap(self, max_draft: int, min_draft: int) -> int:
        """Acceptance-adaptive draft budget; an empty window grants max_draft."""
        if self.sum_drafted == 0:
            return max_draft
        ceil_acc = -(-self.sum_accepted * max_draft // self.sum_drafted)  # ceil(acceptance * max_draft), exact
        return min(max_draft, max(min_draft, 2 + ceil_acc))

    def decisions(self) -> dict:
        """Counts and state for the statistics."""
        return dict(
            state=self.state, trips=self.trips, probes=self.probes, probes_passed=self.probes_passed,
            probes_failed=self.probes_failed, backoff=self.backoff, cost_scale=round(self.cost_scale, 4),
            measured_costs={f"{r}x{w}": round(c, 3) for (r, w), c in sorted(self._measured.items())},
        )

    # ---- internals ----------------------------------------------------------------------------------

    def _fail_probe(self) -> None:
        self.probes_failed += 1
        self._to_off(min(self.backoff * 2, self.options.reprobe_max))

    def _to_off(self, next_backoff: int) -> None:
        self.state = "off"
        self.off_steps = 0
        self.backoff = next_backoff
        self._reset_window()

    def _reset_window(self) -> None:
        self._window.clear()
        self.sum_committed = 0
        self.sum_accepted = 0
        self.sum_drafted = 0
        self.sum_cost = 0.0
