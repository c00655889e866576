#!/usr/bin/env python
"""What each extra row of a step costs, part by part: the layer stack, its matmuls alone, its attention alone, the
output layer.

A verify of width w (or a batch step over w rows) runs the model over w token rows where a plain step runs one. This
times the four parts of such a step at every engine.STEP_WIDTHS width, in one process, the calls of all parts and
widths shuffled within each repetition (machine load hits every arm alike):

  layers    models.forward_hidden over `--prompt-len` cached tokens (the cache rewound by its start each call):
            every layer's matmuls, norms, RoPE, attention with its cache write, residuals
  matmuls   every layer's quantized matmuls alone, chained in one jitted function (kernels.qlinear; inputs are
            random, the work is the same): how much of `layers` the weights' products are
  attention every layer's attention kernel alone over its own part of the prefilled cache (kernels.attention, the
            layer's head shapes and window, each layer's query rows taken from the one before), chained likewise
  output    the output layer with the greedy pick and the top-8 (kernels.qlinear_pick), or kernels.qlinear for a
            model whose output weight the fused pick does not take

Printed per part: the median and the minimum ms at each width, and each width's median over the part's own width-1
median (the part's C(w)). To compare two kernel builds, run this from each in alternating processes.

    python scripts/bench_rows.py [model.gguf] [--ctx 1024] [--prompt-len 300] [--reps 30] [--cache-type f32|f16]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import _step_probe  # scripts/_step_probe.py (the script's folder is on sys.path)
import fucina_jax
from fucina_jax import engine, kernels
from fucina_jax.models import forward_hidden, truncate
from fucina_jax.models.layers import output_weight


def main(argv=None) -> None:
    ap = _step_probe.parser(__doc__, reps=30)
    args = _step_probe.parse(ap, argv)
    widths = engine.STEP_WIDTHS

    model = fucina_jax.load(args.model, cache_type=args.cache_type)
    cfg, params = model.config, model.params
    if not kernels.available() or not any(isinstance(w, kernels.QWeight) for w in params["layers"][0].values()):
        ap.error("this probe times the quantized kernels: load a quantized GGUF without --f32")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.n_vocab, args.prompt_len).astype(np.int32)
    cache = model.new_cache(args.ctx, batch=1)
    _, cache = engine.prefill(params, cfg, [prompt], cache)
    start = jnp.asarray([args.prompt_len], jnp.int32)

    def layers(params, tokens, cache):
        c = truncate(cache, start)
        pos = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        h, c = forward_hidden(params, tokens, pos, c, cfg)
        return h[:, :, :1], c

    def matmuls(params, x):
        keep = jnp.zeros((x.shape[0],), jnp.float32)
        for layer in params["layers"]:
            for w in layer.values():
                if isinstance(w, kernels.QWeight):
                    keep = keep + kernels.qlinear(jnp.resize(x, (x.shape[0], w.k)), w)[:, 0]
        return keep

    def attention(q, cache):
        pos = start[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
        for spec in cfg.layers:
            q = jnp.resize(q, (1, q.shape[1], cfg.n_heads, spec.head_dim))
            q = kernels.attention(q, cache.k[spec.kv_slot], cache.v[spec.kv_slot], pos, spec.head_dim ** -0.5,
                                  window=cfg.window if spec.sliding else 0)
        return q[0, :, 0, 0]

    out_w = output_weight(params)
    fused = isinstance(out_w, kernels.QWeight) and not cfg.final_softcap
    output = (lambda x: kernels.qlinear_pick(x, out_w, 8)) if fused else (lambda x: kernels.qlinear(x, out_w)[:, :1])
    layers_j, matmuls_j, output_j = jax.jit(layers, donate_argnums=2), jax.jit(matmuls), jax.jit(output)
    attention_j = jax.jit(attention)
    prefilled = cache  # attention reads it; layers' calls donate their own copy
    cache = jax.tree_util.tree_map(jnp.copy, cache)
    state = [cache]

    def call(part: str, w: int) -> float:
        if part == "layers":
            toks = jnp.asarray(rng.integers(0, cfg.n_vocab, (1, w)).astype(np.int32))
            t0 = time.perf_counter()
            h, state[0] = layers_j(params, toks, state[0])
            jax.block_until_ready(h)
            return time.perf_counter() - t0
        if part == "attention":
            q = jnp.asarray(rng.standard_normal((1, w, cfg.n_heads, cfg.layers[0].head_dim)).astype(np.float32))
            t0 = time.perf_counter()
            jax.block_until_ready(attention_j(q, prefilled))
            return time.perf_counter() - t0
        x = jnp.asarray(rng.standard_normal((w, out_w.k if part == "output" else cfg.d_model)).astype(np.float32))
        t0 = time.perf_counter()
        jax.block_until_ready(output_j(x) if part == "output" else matmuls_j(params, x))
        return time.perf_counter() - t0

    parts = ("layers", "matmuls", "attention", "output")
    arms = [(part, w) for part in parts for w in widths]
    times = _step_probe.time_shuffled(arms, call, args.reps, rng)
    print(f"{model.path.split('/')[-1]}: {args.prompt_len} cached tokens, ctx {args.ctx}, {args.cache_type} cache, "
          f"{args.reps} shuffled repetitions; output layer: {'fused pick + top-8' if fused else 'qlinear'}")
    print("part       width  median ms  min ms  C(w)")
    for part in parts:
        one = float(np.median(times[part, 1]))
        for w in widths:
            t = np.asarray(times[part, w]) * 1e3
            print(f"{part:9}  {w:5d}  {np.median(t):9.2f}  {t.min():6.2f}  {np.median(t) / (one * 1e3):4.2f}")


if __name__ == "__main__":
    main()
