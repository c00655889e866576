#!/usr/bin/env python
"""Plain greedy decode speed of fucina_jax and llama.cpp side by side, same model file, prompt, token count, threads.

Runs are interleaved (fucina, llama.cpp, fucina, ...) so machine drift hits both; the ratio of the medians is the
number to read. Also prints load time, compile time per step, peak RSS.

  python scripts/bench_decode.py [MODEL.gguf] [--gen 64] [--reps 3] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import numpy as np


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompt", default="The history of the printing press begins", help="prompt text")
    ap.add_argument("--gen", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per system")
    ap.add_argument("--ctx", type=int, default=1024, help="context size for both systems")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (XLA uses all cores)")
    args = ap.parse_args()

    import fucina_jax
    from fucina_jax.generate import generate
    from fucina_jax.model import default_model_path
    from fucina_jax.sampling import SamplerConfig

    path = args.model or default_model_path()
    t0 = time.perf_counter()
    model = fucina_jax.load(path)
    load_s = time.perf_counter() - t0
    rss_after_load = rss_mb()
    ids = model.tokenizer.encode(args.prompt)
    greedy = SamplerConfig(temperature=0.0, seed=0)

    t0 = time.perf_counter()
    first = generate(model, ids, max_tokens=args.gen, sampler=greedy, ctx=args.ctx, stop_ids=()).run()
    first_run_s = time.perf_counter() - t0

    from llama_cpp import Llama

    llm = Llama(path, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)

    def llama_run():
        llm.reset()
        llm.eval(ids)
        out = []
        t = time.perf_counter()
        for _ in range(args.gen):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        return out, args.gen / (time.perf_counter() - t)

    ours, theirs = [], []
    same = None
    for _ in range(args.reps):
        r = generate(model, ids, max_tokens=args.gen, sampler=greedy, ctx=args.ctx, stop_ids=()).run()
        ours.append(r.decode_tps)
        toks, tps = llama_run()
        theirs.append(tps)
        same = toks == r.tokens
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"model: {path}")
    print(f"load: {load_s:.2f} s, peak RSS after load {rss_after_load:.0f} MB, peak RSS now {rss_mb():.0f} MB")
    print(f"first generate (prefill + compile + {args.gen} tokens): {first_run_s:.1f} s, of which compile "
          f"{first.compile_seconds:.1f} s")
    print(f"decode tok/s  fucina_jax {o:.1f}  llama.cpp {t:.1f}  ratio {o / t:.2f}x  "
          f"(median of {args.reps}, {args.gen} tokens, ctx {args.ctx})")
    print(f"greedy streams identical: {same}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
