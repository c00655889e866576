"""CostGate: every rule of design record section 4, and its loud validation (no JAX, no model)."""

from __future__ import annotations

import math
import re

import pytest

from fucina_jax.engine import VERIFY_BUCKETS
from fucina_jax.errors import (
    CostTableEmpty,
    ProbeStepsZero,
    RateWindowTooSmall,
    ReprobeAfterZero,
    SpecOptionsError,
)
from fucina_jax.speculative import (
    DEFAULT_COST_TABLE,
    MAX_DRAFT,
    CostGate,
    CostPoint,
    SpecOptions,
    table_cost,
)

C8 = CostPoint(8, 2.84)
TABLE = (CostPoint(2, 1.65), CostPoint(4, 1.42), C8, CostPoint(16, 4.5))  # the record's shape, for exact numbers


def gate(**kw) -> CostGate:
    kw.setdefault("cost_table", TABLE)
    return CostGate(SpecOptions(**kw))


def test_defaults_are_the_design_record_constants():
    o = SpecOptions()
    assert (o.min_draft, o.rate_window, o.min_window_drafted, o.min_speedup, o.probe_margin) == (2, 16, 8, 1.0, 0.1)
    assert (o.reprobe_after, o.reprobe_max, o.probe_steps, o.adapt_budget) == (128, 1024, 4, True)
    assert CostGate.SCALE_ALPHA == 0.2 and (CostGate.SCALE_MIN, CostGate.SCALE_MAX) == (0.25, 4.0)
    # the shipped table prices every verify bucket at its draft slots, and never below a plain step
    assert [p.draft_len for p in DEFAULT_COST_TABLE] == [w - 1 for w in VERIFY_BUCKETS]
    assert all(p.cost >= 1.0 for p in DEFAULT_COST_TABLE) and MAX_DRAFT == VERIFY_BUCKETS[-1] - 1


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(rate_window=1), RateWindowTooSmall),
        (dict(rate_window=0), RateWindowTooSmall),
        (dict(probe_steps=0), ProbeStepsZero),
        (dict(cost_table=()), CostTableEmpty),
        (dict(reprobe_after=0), ReprobeAfterZero),
    ],
)
def test_the_four_validation_errors(kw, err):
    with pytest.raises(err) as e:
        CostGate(SpecOptions(**kw))
    assert isinstance(e.value, SpecOptionsError) and isinstance(e.value, ValueError)
    assert str(e.value)  # says what to do


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_draft=0),
        dict(max_draft=MAX_DRAFT + 1),
        dict(min_draft=0),
        dict(reprobe_after=64, reprobe_max=32),
        dict(min_speedup=math.nan),
        dict(probe_margin=-0.1),
        dict(cost_table=(CostPoint(4, 1.0), CostPoint(2, 1.5))),
        dict(cost_table=(CostPoint(0, 1.0),)),
        dict(cost_table=(CostPoint(2, 0.0),)),
        dict(cost_table=((2, 1.5),)),
        dict(min_draft=4, max_draft=3),
    ],
)
def test_other_degenerate_options(kw):
    with pytest.raises(SpecOptionsError):
        CostGate(SpecOptions(**kw))


@pytest.mark.parametrize("kw, needle", [
    (dict(max_draft=2.5), "max_draft = 2.5 is invalid: it must be an int"),
    (dict(max_draft="4"), "max_draft = '4' is invalid"),
    (dict(rate_window=None), "rate_window = None"),
    (dict(reprobe_after=1.5), "reprobe_after = 1.5"),
    (dict(min_speedup=None), "min_speedup = None is invalid: it must be a number"),
    (dict(enabled="no"), "enabled = 'no' is invalid: it must be a bool"),
    (dict(cost_table=(CostPoint(1, "1"),)), "cost_table"),
    (dict(cost_table=(CostPoint(1.5, 1.0),)), "cost_table"),
    (dict(cost_table="table"), "cost_table must be a tuple"),
])
def test_option_types_are_checked_by_name(kw, needle):
    with pytest.raises(SpecOptionsError, match=re.escape(needle)):
        SpecOptions(**kw).validate()


def test_table_cost_interpolates_and_clamps():
    assert table_cost(TABLE, 1) == 1.65 and table_cost(TABLE, 2) == 1.65
    assert table_cost(TABLE, 3) == pytest.approx((1.65 + 1.42) / 2)
    assert table_cost(TABLE, 6) == pytest.approx(1.42 + 0.5 * (2.84 - 1.42))
    assert table_cost(TABLE, 16) == 4.5 and table_cost(TABLE, 40) == 4.5
    assert table_cost((CostPoint(3, 2.0),), 7) == 2.0


def test_trips_only_on_an_evaluable_window():
    g = gate(min_window_drafted=8)
    assert g.allows()
    g.record_verify(1, 0, 8, 2.84)  # one verify is too noisy to act on, however bad
    assert g.state == "on"
    g.record_verify(1, 0, 8, 2.84)  # est = 2 / 5.68 = 0.35 < 1
    assert g.state == "off" and g.trips == 1 and g.backoff == 128

    g = gate(min_window_drafted=8)
    g.record_verify(1, 0, 3, 1.42)
    g.record_verify(1, 0, 3, 1.42)  # two verifies but only 6 drafted tokens: not yet
    assert g.state == "on"
    g.record_verify(1, 0, 3, 1.42)  # 9 drafted
    assert g.state == "off"


def test_backoff_doubles_caps_and_restarts_at_base():
    g = gate(rate_window=8, min_window_drafted=4, reprobe_after=4, reprobe_max=16, probe_steps=2)
    g.record_verify(1, 0, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)
    assert g.state == "off"
    assert [g.allows() for _ in range(4)] == [False, False, False, True]  # the 4th disabled step probes
    assert g.state == "probing" and g.probes == 1 and g.sum_drafted == 0  # a fresh window

    g.record_verify(1, 0, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)  # a clear loss: the probe fails, the wait doubles
    assert g.state == "off" and g.backoff == 8 and g.probes_failed == 1
    assert [g.allows() for _ in range(8)] == [False] * 7 + [True]

    # a marginal probe, est = 4 / 3.8 = 1.05 in [1.0, 1.1): fails the hysteresis at its end
    g.record_verify(2, 1, 2, 1.9)
    assert g.state == "probing"
    g.record_verify(2, 1, 2, 1.9)
    assert g.state == "off" and g.backoff == 16

    for _ in range(16):
        g.allows()
    g.record_verify(1, 0, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)
    assert g.backoff == 16  # min(32, reprobe_max)

    for _ in range(16):
        g.allows()
    g.record_verify(6, 5, 8, 2.84)
    g.record_verify(6, 5, 8, 2.84)  # est = 12 / 5.68 = 2.11 >= 1.1: re-enabled
    assert g.state == "on" and g.probes_passed == 1

    # ON does not apply the margin: est = 1.05 stays on
    g._reset_window()
    g.record_verify(2, 1, 4, 1.9)
    g.record_verify(2, 1, 4, 1.9)
    assert g.state == "on"
    # a fresh trip from ON waits the base again
    g.record_verify(1, 0, 8, 4.5)  # est = 5 / 8.3 = 0.60
    assert g.state == "off" and g.backoff == 4 and g.trips == 2


def test_probe_decides_after_probe_steps_even_if_not_evaluable():
    g = gate(reprobe_after=1, probe_steps=1, min_window_drafted=8)
    g.record_verify(1, 0, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)
    assert g.allows() and g.state == "probing"
    g.record_verify(3, 2, 2, 1.65)  # one verify, 2 drafted: not evaluable, but the probe is over
    assert g.state == "on"  # est = 3 / 1.65 = 1.82 >= 1.1


def test_window_rolls():
    g = gate(rate_window=2, min_window_drafted=0)
    g.record_verify(9, 8, 8, 2.84)
    g.record_verify(9, 8, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)  # drops the first entry: (9 + 1) / 5.68 = 1.76
    assert g.sum_committed == 10 and g.sum_drafted == 16 and g.state == "on"
    assert g.est_speedup() == pytest.approx(10 / 5.68)
    g.record_verify(1, 0, 8, 2.84)  # 2 / 5.68
    assert g.state == "off"


def test_est_speedup_is_infinite_on_an_empty_window():
    assert gate().est_speedup() == math.inf


def test_acceptance_adaptive_budget():
    g = gate()
    assert g.budget_cap(16, 2) == 16  # empty window: the full budget
    g.record_verify(3, 2, 8, 2.84)  # 25% acceptance: 2 + ceil(0.25 * 16) = 6
    g.record_verify(2, 0, 0, 1.0)
    assert g.budget_cap(16, 2) == 6
    g._reset_window()
    g.record_verify(1, 0, 8, 2.84)  # zero acceptance floors at max(min_draft, 2)
    assert g.budget_cap(16, 2) == 2 and g.budget_cap(16, 4) == 4
    g._reset_window()
    g.record_verify(17, 16, 16, 4.5)  # full acceptance: clamped to max_draft
    assert g.budget_cap(15, 2) == 15
    g._reset_window()
    g.record_verify(2, 1, 3, 1.42)  # ceil(1/3 * 15) = 5 exactly (integer ceil, no float rounding)
    assert g.budget_cap(15, 2) == 7


def test_live_cost_model():
    g = gate()
    # no plain-step sample yet: the table, scale untouched
    assert g.verify_cost(8, 2_500_000) == pytest.approx(2.84) and g.cost_scale == 1.0
    assert g.verify_cost(8, None) == pytest.approx(2.84)
    g.note_plain_ns(1_000_000)
    assert g.verify_cost(8, 2_840_000) == pytest.approx(2.84) and g.cost_scale == pytest.approx(1.0)
    # one 2x outlier moves the cost by 20%, not 100%
    assert g.verify_cost(8, 5_680_000) == pytest.approx(1.2 * 2.84) and g.cost_scale == pytest.approx(1.2)
    # sustained 2x converges to 2, and the learned scale applies to unmeasured verifies
    for _ in range(60):
        g.verify_cost(8, 5_680_000)
    assert g.cost_scale == pytest.approx(2.0, abs=1e-3) and g.verify_cost(8) == pytest.approx(5.68, abs=1e-2)

    g = gate()
    g.note_plain_ns(1_000_000)
    g.verify_cost(8, 1_000_000_000)  # a 1000x stall: the sample is clamped to 4
    assert g.cost_scale == pytest.approx(0.8 + 0.2 * 4.0)
    for _ in range(100):
        g.verify_cost(8, 10**12)
    assert g.cost_scale == pytest.approx(4.0)  # the scale itself is clamped too
    for _ in range(200):
        g.verify_cost(16, 1)
    assert g.cost_scale == pytest.approx(0.25)

    g = gate(cost_table=(CostPoint(1, 1.0),))
    g.note_plain_ns(1_000_000)
    for _ in range(60):
        assert g.verify_cost(2, 100_000) >= 1.0  # a verify never costs less than the plain step it replaces
    assert g.cost_scale == pytest.approx(1.0)  # measured below 1 counts as 1

    g.note_plain_ns(2_000_000)  # the plain EWMA: 0.25 * new + 0.75 * old
    assert g.plain_ns == pytest.approx(1_250_000)


def test_one_noisy_sample_cannot_flip_a_winning_gate():
    g = gate(min_window_drafted=0)
    g.note_plain_ns(1_000_000)
    for _ in range(3):
        g.record_verify(4, 3, 8, g.verify_cost(8, 2_840_000))  # 4 / 2.84 = 1.41 per verify
    g.record_verify(4, 3, 8, g.verify_cost(8, 50_000_000))  # a 50 ms stall
    assert g.state == "on"


def test_decisions_counts():
    g = gate(reprobe_after=1, probe_steps=1)
    g.record_verify(1, 0, 8, 2.84)
    g.record_verify(1, 0, 8, 2.84)
    g.allows()
    g.record_verify(1, 0, 8, 2.84)
    d = g.decisions()
    assert d == dict(state="off", trips=1, probes=1, probes_passed=0, probes_failed=1, backoff=2, cost_scale=1.0,
                     measured_costs={})
    with pytest.raises(RuntimeError):
        g.record_verify(1, 0, 8, 2.84)  # the decoder must not verify while the gate is off
