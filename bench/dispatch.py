#!/usr/bin/env python
"""Process-wide runtime settings side by side: how CPU programs are dispatched, which threads run the kernels, and
whether greedy steps pick their tokens in the output layer.

    python bench/dispatch.py                              # async vs inline dispatch: SmolLM2 chat, spec_bench, 2 rounds
    python bench/dispatch.py --setting pool               # XLA's intra-op pool vs the kernels' own workers
    python bench/dispatch.py --setting pick               # greedy steps through the logits vs the fused pick
    python bench/dispatch.py --model gemma3 --classes qa,rag --rounds 3 --reps 3

--setting dispatch: JAX's CPU async dispatch (FUCINA_JAX_ASYNC_DISPATCH=1) against inline dispatch (what load()
chooses: fucina_jax.model.prefer_inline_dispatch). --setting pool: the kernels' parallel_for on XLA's intra-op pool
(FUCINA_KERNEL_POOL=xla) against their own spinning workers (the default, fucina_jax/kernels/parallel.h).
--setting pick: greedy steps through the logits and the sampler (FUCINA_FUSED_PICK=0) against the output layer's
fused pick (the default, sampling.GREEDY_UNPENALIZED; the spec_bench tasks are greedy). All are read once per
process, so each measurement is a child process in one mode; rounds alternate the order (A, B, then B, A, ...) to
cancel drift. A child decodes every task plainly and
speculatively (the default SpecOptions, a cold source with the task's reference, as bench/run.py), interleaved --reps
times, and reports each task's median ms per token; printed: per mode the geometric means over tasks and rounds, and
inline / async speed ratios, plain and speculative.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHILD = "--child"

# setting -> ((name, environment) of A, (name, environment) of B); B is the default the engine ships
SETTINGS = {
    "dispatch": (("async", {"FUCINA_JAX_ASYNC_DISPATCH": "1"}), ("inline", {"FUCINA_JAX_ASYNC_DISPATCH": "0"})),
    "pool": (("xla-pool", {"FUCINA_KERNEL_POOL": "xla"}), ("own-workers", {"FUCINA_KERNEL_POOL": "own"})),
    "pick": (("logits", {"FUCINA_FUSED_PICK": "0"}), ("fused-pick", {"FUCINA_FUSED_PICK": "1"})),
}


def child(model_name: str, classes: list[str], gen: int, ctx: int, reps: int) -> None:
    from run import GROUPS, _sampler, load_tasks, model_path

    import fucina_jax
    from fucina_jax import aot
    from fucina_jax.generate import generate, generate_speculative
    from fucina_jax.speculative.sources import default_source

    import jax

    names = [c for group in classes for c in GROUPS.get(group, (group,))]
    model = fucina_jax.load(model_path(model_name))
    tasks = load_tasks(model, "continuation" if model_name == "gemma3" else "chat", classes=names)
    from fucina_jax import sampling

    out = {"async": jax.config.values["jax_cpu_enable_async_dispatch"], "pool": os.environ.get("FUCINA_KERNEL_POOL"),
           "pick": sampling._FUSED_PICK, "tasks": {}}
    for task in tasks:
        kw = dict(max_tokens=gen, sampler=_sampler(task, 1), ctx=ctx)
        refs = [task.reference_ids] if task.reference_ids else []
        runs = {"plain": lambda: generate(model, task.prompt_ids, **kw).run(),
                "spec": lambda: generate_speculative(model, task.prompt_ids, persist=False, **kw,
                                                     source=default_source(model, None, refs, persist=False)).run()}
        want = runs["plain"]().tokens  # warm-up (compiles)
        assert runs["spec"]().tokens == want, f"{task.id}: the speculative stream differs from the plain one"
        aot.PREPARER.wait_idle()
        ms = {"plain": [], "spec": []}
        for i in range(reps):
            for name in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
                r = runs[name]()
                assert r.tokens == want, f"{task.id}: the {name} stream differs"
                ms[name].append(r.decode_seconds * 1e3 / len(r.tokens))
        out["tasks"][task.id] = {k: statistics.median(v) for k, v in ms.items()}
    print(json.dumps(out))


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="dispatch", choices=sorted(SETTINGS))
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--classes", default="spec_bench", help="class names or groups, comma-separated")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3, help="interleaved plain/speculative repetitions per task")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of one child per mode, the order alternating")
    ap.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.gen, args.ctx, args.reps, args.rounds) < 1:
        ap.error("--gen, --ctx, --reps and --rounds must be positive")
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    if args.child:
        child(args.model, classes, args.gen, args.ctx, args.reps)
        return 0
    (name_a, env_a), (name_b, env_b) = SETTINGS[args.setting]
    per = {name_a: {"plain": [], "spec": []}, name_b: {"plain": [], "spec": []}}
    for rnd in range(args.rounds):
        for mode, extra in (((name_a, env_a), (name_b, env_b)) if rnd % 2 == 0 else ((name_b, env_b), (name_a, env_a))):
            env = dict(os.environ, **extra)
            cmd = [sys.executable, os.path.abspath(__file__), CHILD, "--model", args.model, "--classes",
                   args.classes, "--gen", str(args.gen), "--ctx", str(args.ctx), "--reps", str(args.reps)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {mode} child failed:\n{done.stderr[-4000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            if args.setting == "dispatch" and got["async"] != (mode == name_a):
                sys.exit(f"the {mode} child ran with async dispatch {got['async']}")
            if args.setting == "pick" and got["pick"] != (mode == name_b):
                sys.exit(f"the {mode} child ran with the fused pick {'on' if got['pick'] else 'off'}")
            for kind in ("plain", "spec"):
                g = _geomean([t[kind] for t in got["tasks"].values()])
                per[mode][kind].append(g)
            print(f"round {rnd + 1} {mode:11s} plain {per[mode]['plain'][-1]:.3f} ms/tok  "
                  f"spec {per[mode]['spec'][-1]:.3f} ms/tok  ({len(got['tasks'])} tasks)", flush=True)
    a, b = ({k: _geomean(v) for k, v in per[m].items()} for m in (name_a, name_b))
    print(f"\n{args.model}: {name_b} / {name_a} speed: plain {a['plain'] / b['plain']:.3f}x, "
          f"speculative {a['spec'] / b['spec']:.3f}x; speculative / plain: {name_a} {a['plain'] / a['spec']:.3f}x, "
          f"{name_b} {b['plain'] / b['spec']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
