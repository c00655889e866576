#!/usr/bin/env python
"""Throughput vs batch size: B conversations decoded together, plain and speculative, side by side.

For each B in --batch, B different prompts (repetitive or grounded text, so the cascade has drafts) are decoded as one
batch with fucina_jax.generate.generate_batched: once plainly (one token per row per step) and once speculatively (each
row drafts from its own SpeculationIndex). Greedy, no stop ids: every row generates exactly --gen tokens. Each
configuration first brings in every step program B rows may call (Decoder.prepare_steps) and runs once untimed, then
--reps timed runs of each mode, interleaved (plain, spec, then spec, plain, ...), so machine drift hits both alike
(medians).

Printed per B and mode: aggregate tok/s (tokens of all rows / decode wall time), per-row tok/s (what one
conversation sees), tokens per step and acceptance, and the spec/plain ratio.

  python scripts/bench_batch.py [MODEL.gguf] --batch 1,2,4,8 --gen 32 [--devices N [--data D]] [--no-spec]

--devices N forces N host (CPU) devices (XLA_FLAGS, set before JAX starts) and shards the model over them with
fucina_jax.sharding (tensor parallel, or --data D rows of batch parallelism); on a GPU/TPU host it uses the first N
accelerators instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_BATCH = "1,2,4,8"
DEFAULT_GEN = 32
DEFAULT_CTX = 512
DEFAULT_MAX_DRAFT = 7

# Repetitive / grounded prompts: lists, copies and counting give the conversation index something to draft from.
PROMPTS = [
    ("The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. "
     "The days of the week are"),
    "Count from 1 to 100, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8,",
    "Repeat the sentence three times. The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    ("The months of the year are January, February, March, April, May, June, July, August, September, October, "
     "November and December. The months of the year are"),
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z. Again: A, B, C, D,",
    "Red, orange, yellow, green, blue, indigo, violet. The colours of the rainbow are red, orange,",
    "Monday: gym. Tuesday: swim. Wednesday: gym. Thursday: swim. Friday: gym. Saturday: swim. Sunday:",
]


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch {text!r}: give comma-separated positive integers, e.g. 1,2,4,8") from None
    if not out or min(out) < 1:
        raise SystemExit(f"--batch {text!r}: give comma-separated positive integers, e.g. 1,2,4,8")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--batch", default=DEFAULT_BATCH, help=f"batch sizes to measure (default: {DEFAULT_BATCH})")
    ap.add_argument("--gen", type=int, default=DEFAULT_GEN, help=f"tokens per row (default: {DEFAULT_GEN})")
    ap.add_argument("--reps", type=int, default=1, help="timed runs per configuration, after one untimed (default: 1)")
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context size (default: {DEFAULT_CTX})")
    ap.add_argument("--spec", action=argparse.BooleanOptionalAction, default=True,
                    help="also run speculative decoding next to plain (default: on; --no-spec: plain only)")
    ap.add_argument("--max-draft", type=int, default=DEFAULT_MAX_DRAFT,
                    help=f"longest draft per row and step (default: {DEFAULT_MAX_DRAFT})")
    ap.add_argument("--devices", type=int, default=0,
                    help="shard over N devices (CPU: forces N host devices); 0 = one device, no sharding (default)")
    ap.add_argument("--data", type=int, default=1, help="size of the data (batch rows) mesh axis (default: 1)")
    args = ap.parse_args(argv)
    batches = parse_batches(args.batch)

    if args.devices > 1:
        # JAX reads this once, when it starts: it must be set before the first `import jax`.
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

    import jax

    import fucina_jax
    from fucina_jax.model import default_model_path
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.decoder import Decoder, check_request
    from fucina_jax.generate import generate_batched
    from fucina_jax import aot
    from fucina_jax.speculative import SpecOptions

    path = args.model or default_model_path()
    t0 = time.perf_counter()
    if args.devices > 1:
        from fucina_jax import sharding

        mesh = sharding.make_mesh(args.devices, data=args.data)
        model = sharding.load_sharded(path, mesh)
        where = f"{args.devices} devices, mesh {dict(mesh.shape)}"
    else:
        model = fucina_jax.load(path)
        where = f"1 device ({jax.devices()[0].platform})"
    print(f"model: {path}\nloaded in {time.perf_counter() - t0:.1f} s on {where}; greedy, {args.gen} tokens per row, "
          f"max_draft {args.max_draft}", flush=True)

    prompts = [model.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    greedy = SamplerConfig(temperature=0.0, seed=0)
    modes = {"plain": SpecOptions(enabled=False, max_draft=args.max_draft)}
    if args.spec:
        modes["spec"] = SpecOptions.up_to(args.max_draft)

    def prepare(B, options):
        """Bring in every step program a B-row run may call (each row bucket up to B at every width, as the
        server's --warmup-all): which widths a run chooses depends on what the live cost model has measured so
        far, so a warm-up run alone leaves some to compile inside a timed run."""
        rows = [prompts[b % len(prompts)] for b in range(B)]
        reqs = [check_request(model, p, args.gen, greedy, args.ctx, ())[0] for p in rows]
        dec = Decoder(model, B, ctx=args.ctx, options=options)
        dec.begin(reqs)
        dec.prepare_steps()

    def run(B, options):
        rows = [prompts[b % len(prompts)] for b in range(B)]
        res = generate_batched(model, rows, max_tokens=args.gen, sampler=greedy, ctx=args.ctx, stop_ids=(),
                               options=options)
        wall = max(r.decode_seconds for r in res)  # the longest row is active in every step
        return res, wall

    header = f"{'B':>3} {'mode':>5} {'agg tok/s':>10} {'row tok/s':>10} {'tok/step':>9} {'accept':>7} {'compile s':>10}"
    print(header)
    table, ratios = {}, {}
    for B in batches:
        compile_s = {}
        for name, options in modes.items():  # untimed: each mode's programs compile (or load) here
            if options.enabled:
                prepare(B, options)
            warm, _ = run(B, options)
            aot.PREPARER.wait_idle()  # verify widths the warm run asked for, compiled in the background
            compile_s[name] = max(r.compile_seconds for r in warm)
            run(B, options)  # again with those widths in: its rows end at other steps (other row counts' programs)
        aggs = {name: [] for name in modes}
        rows_tps = {name: [] for name in modes}
        last = {}
        names = list(modes)
        for rep in range(args.reps):  # the modes interleaved, the order rotating: drift hits both alike
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                res, wall = run(B, modes[name])
                # the first token of each row comes from the prefill logits; every other token from a decode step
                aggs[name].append(sum(r.n_gen for r in res) / wall)
                rows_tps[name].append(statistics.mean(r.n_gen / r.decode_seconds for r in res))
                last[name] = res
                if res[0].compile_seconds > 0:
                    print(f"  note: B={B} {name}: a timed run compiled ({res[0].compile_seconds:.1f} s); "
                          "its number includes compile time", file=sys.stderr)
        if args.spec:
            ratios[B] = statistics.median(s / p for s, p in zip(aggs["spec"], aggs["plain"]))
        for name in modes:
            st = [r.spec for r in last[name]]
            tok_step = statistics.mean(s["tok_per_step"] for s in st)
            drafted = sum(s["drafted"] for s in st)
            acc = sum(s["accepted"] for s in st) / drafted if drafted else 0.0
            agg, row = statistics.median(aggs[name]), statistics.median(rows_tps[name])
            table[B, name] = agg
            print(f"{B:>3} {name:>5} {agg:>10.1f} {row:>10.1f} {tok_step:>9.2f} {100 * acc:>6.1f}% "
                  f"{compile_s[name]:>10.1f}", flush=True)
    if args.spec:
        print("spec / plain aggregate (median of the interleaved repetitions' ratios): " +
              ", ".join(f"B={B} {ratios[B]:.2f}x" for B in batches))
    base = table[batches[0], "plain"]
    print(f"plain aggregate vs B={batches[0]}: " + ", ".join(f"B={B} {table[B, 'plain'] / base:.2f}x"
                                                             for B in batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
