#!/usr/bin/env python
"""The greedy step with the output layer's fused pick against the same step through the logits, side by side.

A greedy sampler with neutral penalties (SamplerConfig.candidate_cap = GREEDY_UNPENALIZED) takes each row's token
and its recycling candidates in the output layer's kernel (kernels.qlinear_pick) instead of writing the logits
[rows, V], penalising them and selecting from them. Both paths give the same tokens (tests/test_fused_pick.py); this
times them: engine.decode_sample_step at every width, with and without the top-K recycling feedback (a speculative
decoder's verify asks for it), fused (cap -1) and through the logits (cap 0: the penalised greedy path with neutral
values, what every greedy step ran before), on one cache state. The calls of all arms are shuffled within each
repetition and each arm keeps the median, so machine load hits every arm alike. Printed: each arm's ms, its cost in
plain steps of its own path (the verify-cost table's C(w)), and logits/fused.

    python scripts/bench_fused_pick.py [model.gguf] [--ctx 1024] [--prompt-len 300] [--reps 15]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import fucina_jax
from fucina_jax import engine, sampling
from fucina_jax.sampling import GREEDY_UNPENALIZED, SamplerConfig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--ctx", type=int, default=1024, help="cache size")
    ap.add_argument("--prompt-len", type=int, default=300, help="cached tokens before the step")
    ap.add_argument("--reps", type=int, default=15, help="repetitions (each arm's median is kept)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.prompt_len < 1 or args.ctx < args.prompt_len + engine.STEP_WIDTHS[-1]:
        ap.error("need reps >= 1, prompt-len >= 1 and ctx >= prompt-len + 16")

    model = fucina_jax.load(args.model)
    V = model.config.n_vocab
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, args.prompt_len).astype(np.int32)
    cfg = SamplerConfig(temperature=0, seed=0)
    one = lambda tree: jax.device_put(jax.tree_util.tree_map(lambda x: np.asarray(x)[None], tree))
    history = one(sampling.history_from_tokens(prompt.tolist(), cfg.history_capacity(args.ctx)))
    sparams = one(cfg.params())
    start = np.asarray([len(prompt) - 1], np.int32)
    no_push, n_push = np.full((1, engine.STEP_WIDTHS[-1]), -1, np.int32), np.zeros(1, np.int32)
    cache = model.new_cache(args.ctx, batch=1)
    _, cache = engine.prefill(model.params, model.config, [prompt[:-1]], cache)
    state = [cache]

    def call(width: int, cap: int, topk: bool) -> float:
        toks = rng.integers(0, V, (1, width)).astype(np.int32)
        drafts = np.concatenate([toks[:, 1:], np.full((1, 1), -1, np.int32)], axis=1)
        t0 = time.perf_counter()
        out = engine.decode_sample_step(model.params, toks, drafts, start, state[0], history, no_push, n_push,
                                        sparams, model.config, cap, wants_topk=topk)
        np.asarray(out[0])
        state[0] = out[4]
        return time.perf_counter() - t0

    arms = [(w, cap, topk) for w in engine.STEP_WIDTHS for topk in (False, True) for cap in (GREEDY_UNPENALIZED, 0)]
    for arm in arms:  # compile (or load) every program, then one warm call
        call(*arm)
        call(*arm)
    times = {arm: [] for arm in arms}
    for _ in range(args.reps):
        for i in rng.permutation(len(arms)):
            times[arms[i]].append(call(*arms[i]))
    ms = {arm: 1e3 * float(np.median(t)) for arm, t in times.items()}
    plain = {cap: ms[1, cap, False] for cap in (GREEDY_UNPENALIZED, 0)}
    print(f"{model.path.split('/')[-1]}: greedy steps, {args.prompt_len} cached tokens, ctx {args.ctx}, "
          f"medians of {args.reps} shuffled repetitions")
    print("width  top-K   logits ms  C(w)    fused ms  C(w)   logits/fused")
    for w in engine.STEP_WIDTHS:
        for topk in (False, True):
            u, f = ms[w, 0, topk], ms[w, GREEDY_UNPENALIZED, topk]
            print(f"{w:5d}  {'yes' if topk else 'no':5}  {u:9.2f}  {u / plain[0]:4.2f}  {f:9.2f}  {f / plain[GREEDY_UNPENALIZED]:4.2f}"
                  f"   {u / f:6.3f}x")


if __name__ == "__main__":
    main()
