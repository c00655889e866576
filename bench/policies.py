#!/usr/bin/env python
"""Speculation policies side by side: plain decoding, the design record's gate, and the per-step economics, on the
suite's tasks (bench/tasks/tasks.json), in one process, runs interleaved per task (plain, gate, economics, ...) and
each figure the median of --reps. Every speculative stream is checked against the plain one.

  python bench/policies.py [--models gemma3,smollm2] [--classes a,b] [--gen 96] [--reps 3] [--quick]

Prints per task: decode tok/s of each, spec/plain ratios, tok/step and acceptance; then the geometric mean per
policy over the tasks. (Decode time only: the prompt's prefill is the same for all three.)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import CLASSES, MODELS, _sampler, load_tasks, model_path  # noqa: E402  (bench/run.py's task set)

STYLE = {"gemma3": "continuation", "smollm2": "chat"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="one task per class")
    args = ap.parse_args()

    import fucina_jax
    from fucina_jax import aot
    from fucina_jax.generate import generate, generate_speculative
    from fucina_jax.speculative import SpecOptions

    policies = {"gate": SpecOptions(policy="gate"), "economics": SpecOptions(policy="economics")}
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    print(f"{'model':8s} {'task':28s} {'plain':>7s} " + " ".join(f"{p:>10s} {'x':>5s} {'t/s':>4s} {'acc':>4s}"
                                                               for p in policies))
    for name in args.models.split(","):
        model = fucina_jax.load(model_path(name))
        tasks = load_tasks(model, STYLE[name], quick=args.quick, classes=tuple(args.classes.split(",")))
        for task in tasks:
            kw = dict(max_tokens=args.gen, sampler=_sampler(task, 1), ctx=args.ctx)
            refs = [task.reference_ids] if task.reference_ids else ()

            def plain():
                return generate(model, task.prompt_ids, **kw).run()

            def spec(options):
                return generate_speculative(model, task.prompt_ids, references=refs, options=options, **kw).run()

            want = plain()  # warm-up (compiles), and the reference stream
            for o in policies.values():
                assert spec(o).tokens == want.tokens, f"{name} {task.id}: a speculative stream differs"
            aot.PREPARER.wait_idle()  # the verify programs those runs asked for, compiled in the background
            runs = {"plain": []} | {p: [] for p in policies}
            last = {}
            for _ in range(args.reps):
                runs["plain"].append(plain().decode_tps)
                for p, o in policies.items():
                    r = spec(o)
                    assert r.tokens == want.tokens
                    runs[p].append(r.decode_tps)
                    last[p] = r.spec
            base = statistics.median(runs["plain"])
            cells = []
            for p in policies:
                tps = statistics.median(runs[p])
                ratios[p].append(tps / base)
                cells.append(f"{tps:10.1f} {tps / base:5.2f} {last[p]['tok_per_step']:4.2f} "
                             f"{100 * last[p]['acceptance']:3.0f}%")
            print(f"{name:8s} {task.id[:28]:28s} {base:7.1f} " + " ".join(cells), flush=True)
    print("geometric mean spec/plain: " + ", ".join(
        f"{p} {math.exp(statistics.mean(math.log(r) for r in rs)):.3f}x (min {min(rs):.2f}x)"
        for p, rs in ratios.items() if rs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
