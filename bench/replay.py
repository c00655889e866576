#!/usr/bin/env python
"""Speculation policies replayed offline (fucina_jax.speculative.replay) on the suite's tasks, and confirmed live.

    python bench/replay.py                                  # SmolLM2 chat + Gemma 3 completion, the spec_bench group
    python bench/replay.py --models smollm2 --classes qa,rag --gen 64 --live 3
    python bench/replay.py --classes spec_bench,grounded_copy --policies economics,gate,fixed3
    python bench/replay.py --models smollm2 --cost-table smollm2=measure --live 3  # priced with SmolLM2's own curve

Each task (bench/tasks/tasks.json, as bench/run.py loads it: chat on SmolLM2, continuation on Gemma 3) is decoded
plainly once and recorded (every sampled id and its top-K; kept in --cache, keyed by model, task, tokens and
sampler, so a second run replays at once). Each policy is then replayed through the real decoder against the
shipped cost model (the cost table and its batch surface, speculative/replay.cost_model; --cost-table prices a model
with its own --spec-bench table, which the policy then starts from too, and MODEL=measure measures that table first:
the shipped one is Gemma 3's, and a model whose verify rows cost more, as SmolLM2's do, is overpredicted by it)
with a cold source: a
private SpeculationIndex with the task's reference, as bench/run.py's default. Printed: the predicted decode
speed-up (plain time / speculative time at that cost curve), tokens per step, and per class and group the
geometric means.

--live N also decodes each task live, plain and speculative (--live-policy, default economics; several
comma-separated policies share one interleaved rotation) N times, and prints the measured speed-up (median of the
per-repetition ratios) next to the prediction: the replay's check. Next to it, "@live" is the replay priced at the
cost curve those live runs measured (each width's mean whole step, host work included, in the plain runs' steps,
and the speculative run's plain steps at their own live cost; replay_at): where it matches the live figure and the
table's prediction does not, the difference is the cost curve, not the policy. The live curves' medians over the
tasks are printed at the end. With hindsight among --policies, "hindsight@live" is the hindsight replay at the live
economics runs' curve: what a perfect predictor of today's drafts would reach live.

Policies: economics (the default SpecOptions), gate (the design record's gate), fixed3 (the gate never off, drafts
of 1-3 tokens, no adaptive budget: issue 27's fixed setting), treeK (economics with K siblings: tree verifies),
hindsight (replay only: the economics' drafts, each step's width chosen knowing how much of the draft is accepted:
the ceiling of better prediction at that cost curve), hindsight-treeK (the same with K siblings, each known to be the
next token or not: the ceiling of tree verifies over today's alternatives).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import GROUPS, _sampler, load_tasks, model_path  # noqa: E402  (bench/run.py's task set)

STYLE = {"gemma3": "continuation", "smollm2": "chat"}
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fucina_jax", "recordings")


def policies():
    from fucina_jax.speculative import SpecOptions

    return {
        "economics": SpecOptions(),
        "gate": SpecOptions(policy="gate"),
        "fixed3": SpecOptions(policy="gate", max_draft=3, min_draft=1, min_speedup=0.0, adapt_budget=False),
        **{f"tree{k}": SpecOptions(tree_siblings=k) for k in (1, 2, 3, 5)},
        # the same drafts weighed by a perfect predictor (replay only): the ceiling of better prediction
        "hindsight": SpecOptions(min_gain=0.0),
        **{f"hindsight-tree{k}": SpecOptions(min_gain=0.0, tree_siblings=k) for k in (1, 2, 3)},
    }


def replay_only(policy: str) -> bool:
    """The hindsight policies need the recording's future: only a replay can run them."""
    return policy.startswith("hindsight")


def _geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs else float("nan")


def recording(model, name, task, gen, ctx, cache_dir):
    """The task's plain run, recorded once (cached on disk)."""
    from fucina_jax.speculative import replay as R

    sampler = _sampler(task, 1)
    key = hashlib.sha256(repr((os.path.basename(model.path), task.id, task.prompt_ids, gen, ctx,
                               sampler)).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"{name}-{task.id.replace(os.sep, '_')}-{key}.npz")
    if os.path.exists(path):
        try:
            return R.Recording.load(path)
        except ValueError as e:
            print(f"  (re-recording {task.id}: {e})", file=sys.stderr)
    rec = R.record(model, task.prompt_ids, max_tokens=gen, sampler=sampler, ctx=ctx)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    rec.save(tmp)
    os.replace(tmp, path)
    return rec


def live_ratios(model, task, gen, ctx, reps, options):
    """Measured decode speed-up over plain of each policy in `options` (name -> SpecOptions), all interleaved with
    plain in one rotation (the order shifts by one each repetition), the median of per-repetition ratios; and each
    policy's live cost curve (live_costs)."""
    from fucina_jax.generate import generate, generate_speculative
    from fucina_jax.speculative.sources import default_source

    kw = dict(max_tokens=gen, sampler=_sampler(task, 1), ctx=ctx)
    refs = [task.reference_ids] if task.reference_ids else []

    def spec(opts):
        def run():
            src = default_source(model, None, refs, persist=False)
            return generate_speculative(model, task.prompt_ids, source=src, persist=False, options=opts, **kw).run()
        return run

    runs = {"plain": lambda: generate(model, task.prompt_ids, **kw).run()}
    runs.update({name: spec(opts) for name, opts in options.items()})
    want = runs["plain"]().tokens  # warm-up (compiles)
    for name in options:
        assert runs[name]().tokens == want, f"{task.id}: the {name} stream differs from the plain one"
    from fucina_jax import aot

    aot.PREPARER.wait_idle()  # every verify width's program in before the timed runs
    names = list(runs)
    ratios = {name: [] for name in options}
    plain_ms, steps = [], {name: {} for name in options}
    for i in range(reps):
        order = names[i % len(names):] + names[:i % len(names)]
        got = {name: runs[name]() for name in order}
        plain_ms.append(1e3 / got["plain"].decode_tps)  # one token a plain step
        for name in options:
            assert got[name].tokens == want, f"{task.id}: the {name} stream differs from the plain one"
            ratios[name].append(got[name].decode_tps / got["plain"].decode_tps)
            for w, (n, ms) in (got[name].spec or {}).get("step_ms", {}).items():
                tally = steps[name].setdefault(int(w), [0, 0.0])
                tally[0] += n
                tally[1] += ms
    plain = statistics.median(plain_ms)
    return {name: (statistics.median(r), live_costs(steps[name], plain)) for name, r in ratios.items()}


def live_costs(steps: dict[int, list], plain_ms: float) -> dict[int, float]:
    """width -> what a step of that width cost in a live speculative run (its mean whole step, host work included:
    the decoder's spec_stats()["step_ms"], pooled over runs) in plain steps of the plain runs (plain_ms). Width 1 is
    the speculative run's own plain step: above 1 by its host work and a verify's wake (docs/speculation-policy.md)."""
    return {w: ms / n / plain_ms for w, (n, ms) in sorted(steps.items()) if n}


def replay_at(rec, source, options, costs: dict[int, float], hindsight: bool = False):
    """The speed-up the replay predicts at a live cost curve (live_costs): each verify width at its live cost (the
    priced table's where the live runs never used the width), the policy starting from those costs, and every plain
    step of the speculative run at its live cost (costs[1]) where the replay prices it at 1. hindsight: the same
    drafts weighed by a perfect predictor (replay.replay's), the ceiling of better prediction at that curve."""
    from fucina_jax import engine
    from fucina_jax.speculative import replay as R
    from fucina_jax.speculative.gate import CostPoint, table_cost

    table = tuple(CostPoint(w - 1, costs.get(w, table_cost(options.cost_table, w - 1)))
                  for w in engine.VERIFY_BUCKETS)
    rp = R.replay([rec], sources=[source], options=dataclasses.replace(options, cost_table=table),
                  hindsight=hindsight)
    plain_steps = rp.steps - sum(n for w, n in rp.widths.items() if w > 1)
    return rp.plain_time / (rp.time + (costs.get(1, 1.0) - 1.0) * plain_steps)


def _note_shipped_table(model, name: str) -> None:
    """One line when the shipped table, which prices `model` here, was measured on another model."""
    import json

    from fucina_jax.speculative.bench import DEFAULT_TABLE_PATH

    with open(DEFAULT_TABLE_PATH) as f:
        measured_on = json.load(f).get("model", "")
    if measured_on != os.path.basename(model.path):
        print(f"note: {name} is priced with the shipped cost table, measured on {measured_on}; "
              f"--cost-table {name}=measure prices it with its own", flush=True)


def measured_prices(model, sampler, ctx: int):
    """SpecOptions priced with `model`'s own cost table, measured now with `sampler` (the probe of `--spec-bench`,
    without the batch surface: a replay steps one row). The shipped table is one model's (Gemma 3's): a model whose
    verify rows cost more than Gemma 3's would be priced too cheaply by it, and the replay would overpredict."""
    from fucina_jax.speculative import SpecOptions
    from fucina_jax.speculative.bench import format_cost_table, measure_cost_table

    result = measure_cost_table(model, ctx=ctx, sampler=sampler, reps=5, rounds=3, batch_rows=(),
                                command="bench/replay.py --cost-table MODEL=measure")
    print(format_cost_table(result), flush=True)
    return SpecOptions(cost_table=result.cost_table())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--classes", default="spec_bench", help="class names or groups (spec_bench), comma-separated")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--policies", default="economics,gate,fixed3")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where recordings are kept ('' = a temporary directory)")
    ap.add_argument("--live", type=int, default=0, help="also measure each task live, N interleaved repetitions")
    ap.add_argument("--live-policy", default="economics",
                    help="the policies --live measures, comma-separated, interleaved with plain (any of policies())")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sample every task at this temperature (with bench/run.py's top-k/top-p/min-p) instead of "
                         "each task's own setting")
    ap.add_argument("--cost-table", action="append", default=[], metavar="MODEL=FILE",
                    help="price MODEL's steps with a --spec-bench table (default: the shipped one), repeatable; "
                         "MODEL=measure: measure MODEL's own table first, with the first task's sampler (~30 s, "
                         "printed)")
    args = ap.parse_args(argv)

    import tempfile

    import fucina_jax
    from fucina_jax.speculative import replay as R
    from fucina_jax.speculative.sources import default_source

    classes = []
    for c in args.classes.split(","):
        classes.extend(GROUPS.get(c.strip(), (c.strip(),)))
    pols = policies()
    chosen = [p.strip() for p in args.policies.split(",")]
    bad = [p for p in chosen if p not in pols]
    if bad:
        ap.error(f"--policies: unknown {bad}; known: {', '.join(pols)}")
    cache_dir = args.cache or tempfile.mkdtemp(prefix="fucina_recordings_")
    from fucina_jax.speculative import SpecOptions
    from fucina_jax.speculative.bench import load_batch_costs, load_cost_table

    tables, measure = {}, set()
    for item in args.cost_table:
        name, sep, path = item.partition("=")
        if not sep:
            ap.error(f"--cost-table {item!r}: give MODEL=FILE or MODEL=measure, e.g. smollm2=spec_bench.json")
        if path == "measure":
            measure.add(name)
        else:
            tables[name] = SpecOptions(cost_table=load_cost_table(path), batch_costs=load_batch_costs(path))
    header = f"{'model':8s} {'task':26s} {'tok':>4s} " + " ".join(f"{p:>9s} {'t/st':>4s}" for p in chosen)
    live_pols = [p.strip() for p in args.live_policy.split(",")] if args.live else []
    bad = [p for p in live_pols if p not in pols or replay_only(p)]
    if bad:
        live = ", ".join(p for p in pols if not replay_only(p))
        ap.error(f"--live-policy: unknown or replay-only {bad}; live: {live}")
    header += "".join(f" {'live:' + p:>10s} {'@live':>6s}" for p in live_pols)
    # with hindsight among the policies: the ceiling at the live economics' own curve too
    ceiling = "hindsight" in chosen and "economics" in live_pols
    header += f" {'hindsight@live':>14s}" if ceiling else ""
    print(header, flush=True)
    per_class: dict[tuple[str, str], dict[str, list[float]]] = {}
    live_curves: dict[tuple[str, str], list[dict[int, float]]] = {}  # (model, policy) -> each task's live costs
    for name in args.models.split(","):
        model = fucina_jax.load(model_path(name))
        tasks = load_tasks(model, STYLE[name], classes=tuple(classes))
        if args.temperature is not None:
            tasks = [dataclasses.replace(t, temperature=args.temperature) for t in tasks]
        if name in measure and tasks:  # with the first task's sampler (a group's tasks share theirs)
            tables[name] = measured_prices(model, _sampler(tasks[0], 0), args.ctx)
        priced = tables.get(name, SpecOptions())
        if name not in tables:
            _note_shipped_table(model, name)
        cost = R.cost_model(priced)
        for task in tasks:
            rec = recording(model, name, task, args.gen, args.ctx, cache_dir)
            refs = [task.reference_ids] if task.reference_ids else []
            cells, cls = [], per_class.setdefault((name, task.cls), {})
            for p in chosen:
                options = dataclasses.replace(pols[p], cost_table=priced.cost_table, batch_costs=priced.batch_costs)
                rp = R.replay([rec], sources=[default_source(model, None, refs, persist=False)], options=options,
                              cost=cost, hindsight=replay_only(p))
                cls.setdefault(p, []).append(rp.speedup)
                cells.append(f"{rp.speedup:8.2f}x {rp.tok_per_step:4.2f}")
            line = f"{name:8s} {task.id[:26]:26s} {len(rec.generated):4d} " + " ".join(cells)
            if args.live:
                live_opts = {p: dataclasses.replace(pols[p], cost_table=priced.cost_table,
                                                    batch_costs=priced.batch_costs) for p in live_pols}
                for p, (r, costs) in live_ratios(model, task, args.gen, args.ctx, args.live, live_opts).items():
                    at = replay_at(rec, default_source(model, None, refs, persist=False), live_opts[p], costs)
                    cls.setdefault(f"live:{p}", []).append(r)
                    cls.setdefault(f"@live:{p}", []).append(at)
                    line += f" {r:9.2f}x {at:5.2f}x"
                    live_curves.setdefault((name, p), []).append(costs)
                    if ceiling and p == "economics":
                        hindsight = dataclasses.replace(pols["hindsight"], cost_table=priced.cost_table,
                                                        batch_costs=priced.batch_costs)
                        top = replay_at(rec, default_source(model, None, refs, persist=False), hindsight, costs,
                                        hindsight=True)
                        cls.setdefault("hindsight@live", []).append(top)
                        line += f" {top:13.2f}x"
            print(line, flush=True)
    for (name, p), curves in live_curves.items():
        widths = sorted({w for c in curves for w in c})
        print(f"live cost curve, {name} {p} (median over tasks, in the plain runs' steps): " +
              ", ".join(f"C({w}) {statistics.median(c[w] for c in curves if w in c):.2f}" for w in widths))
    cols = chosen + [f"{k}:{p}" for p in live_pols for k in ("live", "@live")] + (["hindsight@live"] if ceiling else [])
    print("\nper class (geometric mean over its tasks):")
    for (name, c), d in per_class.items():
        print(f"  {name:8s} {c:24s} " + " ".join(f"{k} {_geomean(v):.2f}x" for k, v in d.items()))
    for group, members in GROUPS.items():
        for name in args.models.split(","):
            means = {k: [_geomean(d[k]) for (n, c), d in per_class.items() if n == name and c in members and k in d]
                     for k in cols}
            if any(means.values()):
                print(f"{group} {name}: " + ", ".join(f"{k} {_geomean(v):.3f}x" for k, v in means.items() if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
