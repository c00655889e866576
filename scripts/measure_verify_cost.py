"""Measure the verify economics: cost of one fused verify+sample step of width k in plain decode-step units.

    python scripts/measure_verify_cost.py [--model PATH] [--ctx 4096] [--prompt-len 128] [--reps 7]
                                          [--rounds 5] [--sampler greedy|default]

For each verify width k in engine.VERIFY_BUCKETS, after a warm-up (compile) call of every step: `reps` pairs of
(engine.decode_sample_step, spec.steps.verify_sample_step) calls, interleaved call by call on the same cache state,
give C(k) = best verify time / best plain time of that round. Interleaving makes both bests come from the same
few seconds, so load from other processes (this machine is shared) hits numerator and denominator alike; the
table is the median over `rounds` rounds. The output is what fucina_jax.spec.gate.DEFAULT_COST_TABLE ships
(key = draft slots = k - 1, see gate.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import fucina_jax
from fucina_jax import engine, sampling
from fucina_jax.models import truncate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.spec.steps import verify_sample_step

DEFAULT_CTX = 4096
DEFAULT_PROMPT_LEN = 128
DEFAULT_REPS = 7
DEFAULT_ROUNDS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded Gemma 3 270M)")
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="cache capacity (attention spans all of it)")
    ap.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="tokens in the cache when timing")
    ap.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed calls per measurement (best is kept)")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="interleaved rounds (median is reported)")
    ap.add_argument("--sampler", choices=("greedy", "default"), default="greedy",
                    help="greedy (temperature 0) or SamplerConfig() defaults (T 0.8, top-k 40, top-p, min-p)")
    args = ap.parse_args()

    model = fucina_jax.load(args.model)
    cfg = SamplerConfig(temperature=0.0, seed=0) if args.sampler == "greedy" else SamplerConfig(seed=0)
    cfg = cfg.validate()
    sparams = cfg.params()
    cap = cfg.candidate_cap(model.config.n_vocab)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.n_vocab, args.prompt_len).tolist()
    history = sampling.history_from_tokens(prompt, cfg.history_capacity(args.ctx))
    cache = model.new_cache(args.ctx)
    _, cache = model.prefill(prompt, cache)
    base = int(cache.length[0])

    last = jnp.asarray([prompt[-1]], jnp.int32)

    def plain(cache):
        t0 = time.perf_counter()
        tok, cache, _ = engine.decode_sample_step(model.params, last, cache, history, sparams, model.config, cap)
        np.asarray(tok)
        return time.perf_counter() - t0, truncate(cache, base)

    def verify(cache, k):
        toks = jnp.asarray(rng.integers(0, model.config.n_vocab, (1, k)), jnp.int32)
        drafts = jnp.concatenate([toks[0, 1:], jnp.asarray([-1], jnp.int32)])
        t0 = time.perf_counter()
        sampled, _, _, cache = verify_sample_step(
            model.params, toks, drafts, cache, history, sparams, model.config, cap
        )
        np.asarray(sampled)
        return time.perf_counter() - t0, truncate(cache, base)

    load_before = os.getloadavg()[0]
    _, cache = plain(cache)  # warm-up: compile
    for k in engine.VERIFY_BUCKETS:
        _, cache = verify(cache, k)
    ratios: dict[int, list[float]] = {k: [] for k in engine.VERIFY_BUCKETS}
    plains = []
    for r in range(args.rounds):
        for k in engine.VERIFY_BUCKETS:
            tp, tv = [], []
            for _ in range(args.reps):
                t, cache = plain(cache)
                tp.append(t)
                t, cache = verify(cache, k)
                tv.append(t)
            plains.append(min(tp))
            ratios[k].append(min(tv) / min(tp))
        print(f"round {r}: plain {min(plains[-len(ratios):]) * 1e3:.1f} ms; " + ", ".join(
            f"k={k} {ratios[k][-1]:.2f}" for k in engine.VERIFY_BUCKETS), flush=True)
    print(f"\n{os.path.basename(model.path)}  ctx={args.ctx}  cached={base}  sampler={args.sampler}  "
          f"plain step {statistics.median(plains) * 1e3:.1f} ms  loadavg {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f}  "
          f"jax {jax.__version__}")
    print("width k  draft slots  C(k) plain steps (median of rounds)")
    for k in engine.VERIFY_BUCKETS:
        print(f"{k:7d}  {k - 1:11d}  {statistics.median(ratios[k]):.2f}")


if __name__ == "__main__":
    main()
