"""The row-mapped decoder step against the full-batch one, side by side in one process (interleaved calls, median).

  python scripts/bench_rows_step.py [--ctx 1024] [--batch 8] [--prompt 200] [--rounds 200] [--width 1]

On the embedded model (fucina_jax.load()), each variant steps the same rows again and again from the same start
(the cache rewound by `start`, as the decoder does), one call of each variant per round (the order rotating):

  plain B=1        engine.decode_sample_step over a 1-row cache
  plain B=<B>      engine.decode_sample_step over a B-row cache (every row computed)
  rows n=1 / B=<B> engine.decode_sample_rows_step: one active row (rows = [B - 1]) over the B-row cache
  rows n=1 / B=1   engine.decode_sample_rows_step with the identity map over the 1-row cache (what the plain step
                   would cost as the identity-map case of the rows step)
  rows n=B / B=<B> the same for the full batch
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import fucina_jax
from fucina_jax import engine, sampling
from fucina_jax.sampling import SamplerConfig


def stack(trees):
    return jax.device_put(jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens prefilled into every row")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--width", type=int, default=1, help="step width k (1: a plain decode step)")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    model = fucina_jax.load()
    params, cfg = model.params, model.config
    sampler = SamplerConfig(temperature=args.temperature, seed=1).validate()
    cap, window = sampler.candidate_cap(cfg.n_vocab), sampler.history_capacity(args.ctx)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(cfg.n_vocab, 20000), args.prompt).astype(np.int32)
    k, N = args.width, engine.STEP_WIDTHS[-1]

    def state(B):
        cache = model.new_cache(args.ctx, batch=B)
        _, cache = engine.prefill(params, cfg, [prompt] * B, cache)
        history = stack([sampling.history_from_tokens(prompt.tolist(), window)] * B)
        sparams = stack([sampler.params()] * B)
        pushed = jax.device_put(np.full((B, N), -1, np.int32))
        return cache, history, sparams, pushed, np.zeros(B, np.int32)

    def inputs(n):
        toks = np.full((n, k), int(prompt[-1]), np.int32)
        drafts = np.full((n, k), -1, np.int32)
        start = np.full(n, args.prompt - 1, np.int32)
        return toks, drafts, start

    B = args.batch
    variants = {}

    def plain(b):
        st = dict(zip(("cache", "history", "sparams", "pushed", "n_pushed"), state(b)))
        toks, drafts, start = inputs(b)

        def run():
            out = engine.decode_sample_step(params, toks, drafts, start, st["cache"], st["history"], st["pushed"],
                                            st["n_pushed"], st["sparams"], cfg, cap)
            st["cache"] = out[-1]
            return out[0]
        return run

    def rows_step(b, rows):
        st = dict(zip(("cache", "history", "sparams", "pushed", "n_pushed"), state(b)))
        rows = np.asarray(rows, np.int32)
        toks, drafts, start = inputs(len(rows))

        def run():
            out = engine.decode_sample_rows_step(params, toks, drafts, rows, start, st["cache"], st["history"],
                                                 st["pushed"], st["n_pushed"], st["sparams"], cfg, cap)
            st["cache"] = out[-1]
            return out[0]
        return run

    variants["plain B=1"] = plain(1)
    variants[f"plain B={B}"] = plain(B)
    variants[f"rows n=1 / B={B}"] = rows_step(B, [B - 1])
    variants["rows n=1 / B=1"] = rows_step(1, [0])
    variants[f"rows n={B} / B={B}"] = rows_step(B, np.arange(B))
    for run in variants.values():  # bring every program in, then warm up
        for _ in range(3):
            np.asarray(run())
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each variant in every place of a round
            run = variants[name]
            t0 = time.perf_counter()
            np.asarray(run())
            times[name].append(time.perf_counter() - t0)
    base = np.asarray(times["plain B=1"])
    print(f"ctx {args.ctx}, prompt {args.prompt}, width {k}, temperature {args.temperature}, {args.rounds} "
          "interleaved rounds: median ms (p10-p90), and the median over rounds of the time / plain B=1's that round")
    for name, ts in times.items():
        ts = np.asarray(ts)
        ms = ts * 1e3
        print(f"  {name:18s} {np.median(ms):7.3f} ms  ({np.percentile(ms, 10):.3f}-{np.percentile(ms, 90):.3f})  "
              f"x{np.median(ts / base):.3f}")


if __name__ == "__main__":
    main()
