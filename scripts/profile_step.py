#!/usr/bin/env python
"""Where a step's time goes, op by op: the decoder's fused step profiled at each width, its ops grouped by kind.

A verify of width w runs the model over w rows where a plain step runs one. The timed probes (bench_speed.py,
bench_rows.py, `python -m fucina_jax.speculative.bench`) say what a width costs in all; this says which ops the extra
rows go to. Each width's step (engine.decode_sample_step, greedy, with the recycling matrix's top-8 feedback at
widths > 1, as a speculative decoder's verify runs it; the cache rewound to `--prompt-len` tokens each call) runs
`--steps` times under jax.profiler. The trace's op events are matched to the step's compiled program: each FFI call
by its kernel (fucina_qmatmul, fucina_attention_write, ...), each XLA fusion by its kind. Printed per width: each
kind's microseconds a step, its calls a step, and its share of the ops' total.

Profiled times carry the profiler's own overhead and this machine's noise: read the shares and the growth with the
width, and time what a change buys with the probes above, side by side.

    python scripts/profile_step.py [model.gguf] [--widths 1,4,16] [--prompt-len 300] [--ctx 1024] [--steps 20]
        [--cache-type f32|f16]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import numpy as np

import fucina_jax
from fucina_jax import engine, sampling
from fucina_jax.models.cache import CACHE_DTYPES
from fucina_jax.sampling import SamplerConfig

# An HLO instruction: its name, and the custom call's target or the op (fusion kinds are named by XLA: "loop_fusion",
# "multiply_bitcast_fusion", ...; the instruction's name before its ".N" says which).
_CUSTOM = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = .*?custom_call_target="([\w.]+)"')
_OP = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its kind: the FFI target of a custom call, "fusion:<name before .N>" of a fusion, else
    the op. Only the entry computation's instructions become events; the others map to kinds that never match."""
    kinds = {}
    for line in hlo_text.splitlines():
        m = _CUSTOM.match(line)
        if m:
            kinds[m.group(1)] = m.group(2)
            continue
        m = _OP.match(line)
        if m and m.group(1) not in kinds:
            name, op = m.groups()
            kinds[name] = f"fusion:{name.rsplit('.', 1)[0]}" if op == "fusion" else op
    return kinds


def by_kind(trace_events: list[dict], kinds: dict[str, str], steps: int) -> dict[str, tuple[float, float]]:
    """kind -> (microseconds a step, calls a step) of the trace's complete events named as the program's ops."""
    total: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    for e in trace_events:
        if e.get("ph") == "X" and e.get("name") in kinds:
            total[kinds[e["name"]]] += float(e["dur"])
            calls[kinds[e["name"]]] += 1
    return {k: (total[k] / steps, calls[k] / steps) for k in total}


def profile(model, widths, *, prompt_len: int, ctx: int, steps: int, seed: int = 0) -> dict[int, dict]:
    """width -> {kind: (us a step, calls a step)} of the decoder's greedy fused step over `prompt_len` cached tokens."""
    cfg = SamplerConfig(temperature=0.0, seed=seed).validate()
    n_vocab = model.config.n_vocab
    cap = cfg.candidate_cap(n_vocab)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, n_vocab, prompt_len).astype(np.int32)
    cache = model.new_cache(ctx, batch=1)
    _, cache = engine.prefill(model.params, model.config, [prompt], cache)
    stack = lambda tree: jax.device_put(jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)]), tree))
    history = stack(sampling.history_from_tokens(prompt.tolist(), cfg.history_capacity(ctx)))
    sparams = stack(cfg.params())
    start = np.asarray([prompt_len], np.int32)
    no_push, n_push = np.full((1, engine.STEP_WIDTHS[-1]), -1, np.int32), np.zeros(1, np.int32)
    state = [cache]
    out = {}
    for w in widths:
        toks = rng.integers(0, n_vocab, (1, w)).astype(np.int32)
        drafts = np.concatenate([toks[:, 1:], np.full((1, 1), -1, np.int32)], axis=1)
        kw = dict(wants_topk=w > 1)

        def call():
            sampled, _, _, _, state[0] = engine.decode_sample_step(
                model.params, toks, drafts, start, state[0], history, no_push, n_push, sparams, model.config, cap, **kw)
            np.asarray(sampled)

        for _ in range(3):  # compile (or load) and warm
            call()
        hlo = engine.decode_sample_step.jitted.lower(model.params, toks, drafts, start, state[0], history, no_push,
                                                     n_push, sparams, model.config, cap, **kw).compile().as_text()
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(steps):
                    call()
            files = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
            if not files:
                raise RuntimeError("jax.profiler wrote no trace")
            with gzip.open(files[0]) as f:
                events = json.load(f)["traceEvents"]
        out[w] = by_kind(events, op_kinds(hlo), steps)
    return out


def report(result: dict[int, dict], top: int = 12) -> str:
    lines = []
    for w, kinds in result.items():
        total = sum(t for t, _ in kinds.values())
        lines.append(f"width {w}: ops {total / 1e3:.2f} ms a step")
        for k, (t, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {k:40s} {t:9.1f} us  {n:6.1f} calls  {100 * t / max(total, 1e-9):5.1f}%")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--widths", default="1,4,16", help="comma-separated step widths (engine.STEP_WIDTHS)")
    ap.add_argument("--prompt-len", type=int, default=300, help="cached tokens before the step")
    ap.add_argument("--ctx", type=int, default=1024, help="cache size")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per width")
    ap.add_argument("--cache-type", choices=sorted(CACHE_DTYPES), default="f32", help="KV cache type (default f32)")
    args = ap.parse_args(argv)
    try:
        widths = [int(x) for x in args.widths.split(",")]
    except ValueError:
        ap.error(f"--widths {args.widths!r}: comma-separated integers")
    if any(w not in engine.STEP_WIDTHS for w in widths):
        ap.error(f"--widths: each must be one of {engine.STEP_WIDTHS}")
    if args.steps < 1 or args.prompt_len < 1 or args.ctx < args.prompt_len + max(widths):
        ap.error("need --steps >= 1, --prompt-len >= 1 and --ctx >= prompt-len + the widest width")
    model = fucina_jax.load(args.model, cache_type=args.cache_type)
    print(f"{model.path.split('/')[-1]}: greedy fused steps, {args.prompt_len} cached tokens, ctx {args.ctx}, "
          f"{args.cache_type} cache, {args.steps} profiled steps a width")
    print(report(profile(model, widths, prompt_len=args.prompt_len, ctx=args.ctx, steps=args.steps)))


if __name__ == "__main__":
    main()
