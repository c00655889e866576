#!/usr/bin/env python
"""Speed and memory of fucina_jax against llama.cpp on one GGUF file, side by side in one run.

Prints, in this order:
  1. cold and warm start to the first generated token (fresh processes: an empty persistent compilation cache,
     then three that use the cache the first run wrote; the median warm run), with the time split into
     import / load / first token;
  2. load time and peak RSS of fucina_jax alone (before llama.cpp is loaded), against the GGUF file size;
  3. plain greedy decode tok/s of fucina_jax and llama.cpp, runs interleaved (fucina, llama.cpp, ...) so machine
     drift hits both, the ratio of the medians, and whether the greedy streams agree;
  4. the verify cost table C(k) = (one forward over k rows with full logits) / (one plain decode step) of both:
     fucina_jax's decoder steps (speculative/bench.py's probe) and llama.cpp with logits_all=True;
  5. the decoder's own cost: one Decoder.step() with speculation off (all its host bookkeeping included) against
     the bare compiled plain step it calls, at the same stream position, calls interleaved (goal: within 1%).

  python scripts/bench_speed.py [MODEL.gguf] [--gen 64] [--reps 3] [--ctx 1024] [--threads 2] [--f32]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

START_CODE = r"""
import sys, time
t0 = time.perf_counter()
import jax, fucina_jax
t1 = time.perf_counter()
m = fucina_jax.load(sys.argv[1] or None, f32=sys.argv[2] == "1")
t2 = time.perf_counter()
gen = m.generate(sys.argv[3], max_tokens=1, temperature=0)
next(iter(gen))
t3 = time.perf_counter()
print(f"FIRST {time.monotonic():.6f} {t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}", flush=True)
"""


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def start_times(path: str, f32: bool, prompt: str, warm_runs: int = 3) -> list[tuple[float, float, list[float]]]:
    """A cold start, then `warm_runs` warm ones, sharing one fresh compilation cache directory: per run (seconds from
    process launch to the first generated token, the process's whole wall time (the same plus exiting, which is
    JAX's interpreter teardown), [import, load, first token])."""
    out = []
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "FUCINA_JAX_CACHE_DIR": cache_dir}
        for _ in range(1 + warm_runs):
            t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for this process and the child
            proc = subprocess.run([sys.executable, "-c", START_CODE, path or "", "1" if f32 else "0", prompt],
                                  env=env, capture_output=True, text=True)
            wall = time.monotonic() - t0
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST")), None)
            if proc.returncode or line is None:
                raise SystemExit(f"start-time run failed:\n{proc.stderr[-2000:]}")
            at, *parts = (float(v) for v in line.split()[1:])
            out.append((at - t0, wall, parts))
    return out


def llama_cost_table(llm, ids, widths, reps: int) -> dict[int, float]:
    """llama.cpp's C(k): best time to evaluate k tokens after the prompt (logits of every row) over the best time
    of 1, interleaved, rewinding the KV cache to the prompt each time."""
    base = len(ids)
    rng = np.random.default_rng(0)
    rows = {w: rng.integers(0, llm.n_vocab(), w).tolist() for w in widths}

    def timed(toks):
        llm.n_tokens = base  # eval() drops the KV cells past n_tokens first
        t = time.perf_counter()
        llm.eval(toks)
        return time.perf_counter() - t

    llm.reset()
    llm.eval(ids)
    plain = []
    best = {w: [] for w in widths}
    for w in widths:
        timed(rows[w])  # warm-up
        for _ in range(reps):
            plain.append(timed(rows[1] if 1 in rows else rows[w][:1]))
            best[w].append(timed(rows[w]))
    p = min(plain)
    return {w: min(best[w]) / p for w in widths}


def decoder_overhead(model, ids, ctx: int, reps: int) -> tuple[float, float]:
    """(median ms of Decoder.step() with speculation off, median ms of the bare engine.decode_sample_step it runs),
    interleaved call by call at the same stream position: the bare call rewinds to the position the decoder's next
    step starts at and writes the same row, so the decoder's state is unchanged by it."""
    from fucina_jax import engine
    from fucina_jax.decoder import Decoder, Request
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.speculative import SpecOptions

    dec = Decoder(model, ctx=ctx, options=SpecOptions(enabled=False))
    req = Request(tuple(ids), 2 * reps + 8, SamplerConfig(temperature=0.0, seed=0).validate(), frozenset(), None)
    dec.first(dec.begin([req]))
    no_push, n_push = np.full((1, engine.STEP_WIDTHS[-1]), -1, np.int32), np.zeros(1, np.int32)
    drafts = np.full((1, 1), -1, np.int32)

    def bare():
        row = dec.rows[0]
        toks = np.asarray([[row.stream[row.n - 1]]], np.int32)
        start = np.asarray([row.n - 1], np.int32)
        t = time.perf_counter()
        sampled, _, _, _, dec.cache = engine.decode_sample_step(
            model.params, toks, drafts, start, dec.cache, dec.history, no_push, n_push, dec._sparams, model.config,
            dec._cap)
        np.asarray(sampled)
        return time.perf_counter() - t

    def through_decoder():
        t = time.perf_counter()
        dec.step()
        return time.perf_counter() - t

    bare(), through_decoder()  # warm-up: both programs are in
    ours, base = [], []
    for _ in range(reps):
        base.append(bare())
        ours.append(through_decoder())
    return statistics.median(ours) * 1e3, statistics.median(base) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompt", default="The history of the printing press begins", help="prompt text")
    ap.add_argument("--gen", type=int, default=64, help="tokens to generate per decode run")
    ap.add_argument("--reps", type=int, default=3, help="timed decode runs per system")
    ap.add_argument("--ctx", type=int, default=1024, help="context size for both systems")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (XLA uses all cores)")
    ap.add_argument("--f32", action="store_true", help="measure fucina_jax's f32 reference path")
    ap.add_argument("--skip-start", action="store_true", help="skip the cold/warm start measurement")
    args = ap.parse_args()

    import fucina_jax
    from fucina_jax import engine
    from fucina_jax.generate import generate
    from fucina_jax.model import default_model_path
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.speculative.bench import measure_cost_table

    path = args.model or default_model_path()
    gguf_mb = os.path.getsize(path) / 2**20
    print(f"model: {path} ({gguf_mb:.0f} MiB)   path: {'f32 reference' if args.f32 else 'kernels'}")
    try:
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    except OSError:
        pass

    if not args.skip_start:
        (cold, cwall, cparts), *warms = start_times(args.model or "", args.f32, args.prompt)
        warm, wwall, wparts = sorted(warms)[len(warms) // 2]  # the median warm run
        print(f"start to first token: cold {cold:.2f} s (import {cparts[0]:.2f}, load {cparts[1]:.2f}, "
              f"compile+prefill+token {cparts[2]:.2f}), warm {warm:.2f} s (median of {len(warms)}: "
              f"{', '.join(f'{w[0]:.2f}' for w in warms)}; import {wparts[0]:.2f}, load {wparts[1]:.2f}, compile "
              f"cache+prefill+token {wparts[2]:.2f}); the processes exit {cwall - cold:.2f} / {wwall - warm:.2f} s "
              f"later (JAX's teardown)")

    t0 = time.perf_counter()
    model = fucina_jax.load(path, f32=args.f32)
    load_s = time.perf_counter() - t0
    ids = model.tokenizer.encode(args.prompt)
    greedy = SamplerConfig(temperature=0.0, seed=0)
    first = generate(model, ids, max_tokens=args.gen, sampler=greedy, ctx=args.ctx, stop_ids=()).run()
    rss_gen = rss_mb()
    ours_cost = measure_cost_table(model, ctx=args.ctx, reps=3, rounds=3)
    rss = rss_mb()
    print(f"load {load_s:.2f} s; first generate compiled in {first.compile_seconds:.1f} s; peak RSS of fucina_jax "
          f"after loading and generating: {rss_gen:.0f} MiB = {rss_gen / gguf_mb:.2f}x the GGUF file, after the verify probe "
          f"too (every verify width compiled): {rss:.0f} MiB = {rss / gguf_mb:.2f}x (scripts/bench_memory.py splits "
          f"these from the JAX runtime's own ~200 MiB)")

    from fucina_jax.testing import open_llama_cpp
    from fucina_jax.testing.llama_cpp import amx_build

    if amx_build():
        print("note: this llama.cpp build has its AMX backend, which segfaults on some AMX CPUs (llama.cpp #20824), so it "
              "runs without its extra buffer types (no AMX, no CPU_REPACK): a slower baseline than llama.cpp built "
              "without AMX (see README, Benchmarks)")
    llm = open_llama_cpp(path, n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                logits_all=True)

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

    ours, theirs, same = [], [], []
    for _ in range(args.reps):
        r = generate(model, ids, max_tokens=args.gen, sampler=greedy, ctx=args.ctx, stop_ids=()).run()
        ours.append(r.decode_tps)
        toks, tps = llama_run()
        theirs.append(tps)
        same.append(next((i for i, (a, b) in enumerate(zip(toks, r.tokens)) if a != b), None))
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"decode tok/s  fucina_jax {o:.1f}  llama.cpp {t:.1f}  ratio {o / t:.2f}x  "
          f"(median of {args.reps}, {args.gen} tokens, ctx {args.ctx}, llama.cpp threads {args.threads})")
    split = same[-1]
    print("greedy streams: " + ("identical" if split is None else f"part at generated token {split}"))

    widths = engine.VERIFY_BUCKETS
    theirs_cost = llama_cost_table(llm, ids, (1,) + tuple(widths), reps=5)
    print(f"verify cost C(k) in plain steps (fucina plain step {ours_cost.plain_ms:.2f} ms):")
    print("   k   fucina_jax   llama.cpp")
    for w, _, _, measured, _ in ours_cost.rows:
        print(f"  {w:2d}   {measured:10.2f}   {theirs_cost[w]:9.2f}")
    llm.close()
    d_ms, b_ms = decoder_overhead(model, ids, args.ctx, reps=200)
    print(f"decoder step, speculation off: {d_ms:.3f} ms against the bare plain step {b_ms:.3f} ms = {d_ms / b_ms:.3f}x "
          f"(median of 200 interleaved pairs; goal within 1%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
