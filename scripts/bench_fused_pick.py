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

import time

import jax
import numpy as np

import _step_probe  # scripts/_step_probe.py (the script's folder is on sys.path)
import fucina_jax
from fucina_jax import engine, sampling
from fucina_jax.sampling import GREEDY_UNPENALIZED, SamplerConfig


def main(argv=None) -> None:
    ap = _step_probe.parser(__doc__, reps=15)
    args = _step_probe.parse(ap, argv)

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
    times = _step_probe.time_shuffled(arms, call, args.reps, rng)
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
