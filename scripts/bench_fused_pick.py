#!/usr/bin/env python
"""The step with the output layer's fused pick against the same step through the logits, side by side.

A greedy sampler with neutral penalties (SamplerConfig.candidate_cap = GREEDY_UNPENALIZED) takes each row's token
and its recycling candidates in the output layer's kernel (kernels.qlinear_pick) instead of writing the logits
[rows, V], penalising them and selecting from them; a sampled one with neutral penalties and top-k on (cap -c) takes
its top c candidates there (kernels.qlinear_candidates) and samples from those. Both paths give the same tokens
(tests/test_fused_pick.py); this times them: engine.decode_sample_step at every width, with and without the top-K
recycling feedback (a speculative decoder's verify asks for it), fused and through the logits (greedy: cap 0, the
penalised greedy path with neutral values, what every greedy step ran before; sampled: cap c), on one cache state.
The calls of all arms are shuffled within each repetition and each arm keeps the median, so machine load hits every
arm alike. Printed: each arm's ms, its cost in plain steps of its own path (the verify-cost table's C(w)), and
logits/fused.

    python scripts/bench_fused_pick.py [model.gguf] [--ctx 1024] [--prompt-len 300] [--reps 15] [--temperature 0.8]
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
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy steps; > 0: sampled steps with the CLI's other defaults (top-k 40)")
    args = _step_probe.parse(ap, argv)
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")

    model = fucina_jax.load(args.model, cache_type=args.cache_type)
    V = model.config.n_vocab
    cfg = SamplerConfig(temperature=args.temperature, seed=0)
    fused = cfg.candidate_cap(V)
    if sampling.fused_candidates(fused) is None:
        ap.error(f"this sampler's steps have no fused path (cap {fused}): FUCINA_FUSED_PICK=0, or a vocabulary of "
                 f"{V} that top-k {cfg.top_k} does not fit under")
    caps = (fused, 0 if fused == GREEDY_UNPENALIZED else sampling.logits_cap(fused))  # (fused, through the logits)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, args.prompt_len).astype(np.int32)
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

    arms = [(w, cap, topk) for w in engine.STEP_WIDTHS for topk in (False, True) for cap in caps]
    times = _step_probe.time_shuffled(arms, call, args.reps, rng)
    ms = {arm: 1e3 * float(np.median(t)) for arm, t in times.items()}
    plain = {cap: ms[1, cap, False] for cap in caps}
    kind = "greedy" if cfg.greedy else f"sampled (T {cfg.temperature}, top-k {cfg.top_k}, fused cap {fused})"
    print(f"{model.path.split('/')[-1]}: {kind} steps, {args.prompt_len} cached tokens, ctx {args.ctx}, "
          f"medians of {args.reps} shuffled repetitions")
    print("width  top-K   logits ms  C(w)    fused ms  C(w)   logits/fused")
    for w in engine.STEP_WIDTHS:
        for topk in (False, True):
            u, f = ms[w, caps[1], topk], ms[w, fused, topk]
            print(f"{w:5d}  {'yes' if topk else 'no':5}  {u:9.2f}  {u / plain[caps[1]]:4.2f}  {f:9.2f}  "
                  f"{f / plain[fused]:4.2f}   {u / f:6.3f}x")


if __name__ == "__main__":
    main()
