"""The verify-economics probe (`--spec-bench`): the cost table C(k) of the loaded model on this machine.

Design record section 3. A verify over k draft tokens costs C(k) plain decode steps and commits a + 1 tokens (a =
accepted prefix, the +1 correction/bonus is free), so it wins iff a + 1 > C(k): strict break-even a = C(k) - 1
accepted tokens, i.e. acceptance (C(k) - 1) / k; the conservative planning figure C(k) / k ignores the free token.

Measured with the decoder's own compiled step, engine.decode_sample_step, at every engine.VERIFY_BUCKETS width
against its width-1 plain step, on the same cache state (`prompt_len` cached tokens in a `ctx`-slot cache: the
attention spans every slot, so the context size is part of the measurement). After one warm-up (compile) call of
every step, each round times `reps` (plain, verify) pairs interleaved call by call for each width and keeps
best verify / best plain; the table is the median over rounds. Interleaving puts numerator and denominator in the
same few seconds, so load from other processes hits both alike.

The batch surface: for each B in `batch_rows` (default 2, 4, 8), the same prompt in a B-row cache; each round
times `reps` passes over the one-row plain step, the B-row plain step and the B-row step of every width, and keeps
best / best: the B-row plain step in one-row plain steps, and each width in B-row plain steps. The decoder prices
a batch step from it (CostGate.modelled_cost) until it has timed that step itself.

A draft of d tokens runs the padded bucket of width bucket_for(d + 1), so the table is keyed by the bucket's draft
slots (width - 1), the key the decoder prices a verify at (see speculative/gate.py). A measured cost below 1 (noise, or a
verify of width 2 as cheap as a decode step) is entered as 1: a verify never costs less than the plain step it
replaces. The raw ratio stays in the JSON as `measured`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from fucina_jax import engine, sampling
from fucina_jax.models.cache import CACHE_DTYPES
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative.cost_table import (
    DEFAULT_TABLE_PATH,
    FORMAT,
    FORMAT_VERSION,
    read_batch_costs,
    read_cost_points,
)
from fucina_jax.speculative.gate import CostPoint, SpecOptions

__all__ = [
    "DEFAULT_TABLE_PATH",
    "CostTableResult",
    "format_cost_table",
    "load_batch_costs",
    "load_cost_table",
    "machine_description",
    "measure_cost_table",
    "plot_cost_table",
    "run_spec_bench",
    "save_cost_table",
]

DEFAULT_PROMPT_LEN = 128  # cached tokens while timing
DEFAULT_REPS = 5  # (plain, verify) pairs per width per round; the best of each is kept
DEFAULT_ROUNDS = 3  # rounds; the median ratio is reported
DEFAULT_BATCH_ROWS = (2, 4, 8)  # batch sizes of the batch surface


@dataclasses.dataclass(frozen=True)
class CostTableResult:
    """One probe run. rows: (width, draft_len, cost, measured ratio, best verify ms) per verify bucket."""

    model: str
    date: str
    machine: str
    plain_ms: float  # median over rounds of the best plain (decode+sample) step
    rows: tuple[tuple[int, int, float, float, float], ...]
    ctx: int
    cached_tokens: int
    sampler: str
    reps: int
    rounds: int
    command: str
    seconds: float = 0.0  # wall time of the whole probe, compile included
    # the batch surface, (rows, width, cost): width 1 = the B-row plain step in one-row plain steps, else the B-row
    # step of that width in B-row plain steps (median over rounds of best / best)
    batch: tuple[tuple[int, int, float], ...] = ()
    # tree verifies (width, cost): the same step over a tree of that width (siblings under the root and chains
    # below them, the shape the decoder verifies), in one-row plain steps; () when not measured
    tree: tuple[tuple[int, float], ...] = ()

    def cost_table(self) -> tuple[CostPoint, ...]:
        return tuple(CostPoint(d, c) for _, d, c, _, _ in self.rows)

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "model": self.model, "date": self.date, "machine": self.machine,
            "plain_ms": round(self.plain_ms, 3), "ctx": self.ctx, "cached_tokens": self.cached_tokens, "sampler": self.sampler,
            "reps": self.reps, "rounds": self.rounds, "seconds": round(self.seconds, 1), "command": self.command,
            "table": [
                {"width": w, "draft_len": d, "cost": round(c, 4), "measured": round(m, 4), "verify_ms": round(v, 3)}
                for w, d, c, m, v in self.rows
            ],
            "batch": [{"rows": r, "width": w, "cost": round(c, 4)} for r, w, c in self.batch],
            "tree": [{"width": w, "cost": round(c, 4)} for w, c in self.tree],
        }


def machine_description() -> str:
    """CPU model, core count, OS, jax version and the current 1-minute load average (the machine may be shared)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = f", load average {os.getloadavg()[0]:.2f}"
    except OSError:
        load = ""
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, jax {jax.__version__}{load}"


def measure_cost_table(
    model,
    *,
    ctx: int | None = None,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    reps: int = DEFAULT_REPS,
    rounds: int = DEFAULT_ROUNDS,
    sampler: SamplerConfig | None = None,
    widths: Sequence[int] = engine.VERIFY_BUCKETS,
    batch_rows: Sequence[int] = DEFAULT_BATCH_ROWS,
    progress: bool = False,
    command: str = "",
) -> CostTableResult:
    """Time one verify at every width against one plain step, and each batch size's steps against its plain step;
    see the module docstring for the method."""
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps = {reps} and rounds = {rounds}: both must be >= 1")
    for w in widths:
        if w not in engine.VERIFY_BUCKETS:
            raise ValueError(f"width {w} is not a verify bucket {engine.VERIFY_BUCKETS}")
    t_start = time.perf_counter()
    ctx = int(ctx or model.default_ctx)
    prompt_len = max(1, min(prompt_len, ctx - max(widths) - 1))
    cfg = (sampler or SamplerConfig(seed=0)).validate()
    cap = cfg.candidate_cap(model.config.n_vocab)
    rng = np.random.default_rng(0)
    n_vocab = model.config.n_vocab
    prompt = rng.integers(0, n_vocab, prompt_len).tolist()
    start = np.asarray([len(prompt)], np.int32)  # each call rewinds the cache to the prompt: no truncate needed
    # Random drafts: the cost of a verify does not depend on whether its rows are accepted.
    drafts_of = lambda toks: np.concatenate([toks[:, 1:], np.full((toks.shape[0], 1), -1, np.int32)], axis=1)

    def stepper(B: int):
        """A function timing one fused step of width w (1: the plain decode step) over a B-row cache of the
        prompt, as the decoder calls it."""
        cache = model.new_cache(ctx, batch=B)
        _, cache = engine.prefill(model.params, model.config, [np.asarray(prompt, np.int32)] * B, cache)
        stack = lambda tree: jax.device_put(jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * B), tree))
        history = stack(sampling.history_from_tokens(prompt, cfg.history_capacity(ctx)))
        sparams = stack(cfg.params())
        starts = np.repeat(start, B)
        no_push, n_push = np.full((B, engine.STEP_WIDTHS[-1]), -1, np.int32), np.zeros(B, np.int32)
        inputs = {1: (np.full((B, 1), prompt[-1], np.int32), np.full((B, 1), -1, np.int32))}
        for w in widths:
            toks = rng.integers(0, n_vocab, (B, w)).astype(np.int32)
            inputs[w] = (toks, drafts_of(toks))
            inputs[-w] = (toks, engine.TreeDraft(np.broadcast_to(tree_parents(w), (B, w)).copy()))  # -w: a tree
        state = [cache]

        def timed(w):
            toks, drafts = inputs[w]
            t0 = time.perf_counter()
            sampled, _, _, _, state[0] = engine.decode_sample_step(
                model.params, toks, drafts, starts, state[0], history, no_push, n_push, sparams, model.config, cap)
            np.asarray(sampled)  # waits for the result
            return time.perf_counter() - t0
        return timed

    one = stepper(1)
    plain = lambda: one(1)
    verify = one
    batches = {B: stepper(B) for B in batch_rows}

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=(len(widths) + len(batches)) * (rounds + 1), desc="spec-bench", unit="step",
                   file=sys.stderr, leave=False)
    plain()  # warm-up: compile every step once
    for w in widths:
        verify(w)
        if bar is not None:
            bar.update(1)
    for step in batches.values():
        for w in (1, *widths):
            step(w)
        if bar is not None:
            bar.update(1)
    for w in widths:
        verify(-w)
    ratios: dict[int, list[float]] = {w: [] for w in widths}
    tree_ratios: dict[int, list[float]] = {w: [] for w in widths}
    verify_s: dict[int, list[float]] = {w: [] for w in widths}
    batch_ratios: dict[tuple[int, int], list[float]] = {(B, w): [] for B in batches for w in (1, *widths)}
    plains: list[float] = []
    for _ in range(rounds):
        for w in widths:
            tp, tv, tt = [], [], []
            for _ in range(reps):
                tp.append(plain())
                tv.append(verify(w))
                tt.append(verify(-w))
            plains.append(min(tp))
            verify_s[w].append(min(tv))
            ratios[w].append(min(tv) / min(tp))
            tree_ratios[w].append(min(tt) / min(tp))
            if bar is not None:
                bar.update(1)
        for B, step in batches.items():  # each batch width against the batch's plain step, and that one against 1
            best = {w: math.inf for w in (1, *widths)}
            best_one = math.inf
            for _ in range(reps):
                best_one = min(best_one, plain())
                for w in best:
                    best[w] = min(best[w], step(w))
            batch_ratios[B, 1].append(best[1] / best_one)
            for w in widths:
                batch_ratios[B, w].append(best[w] / best[1])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    rows = []
    for w in widths:
        measured = statistics.median(ratios[w])
        rows.append((w, w - 1, max(measured, 1.0), measured, statistics.median(verify_s[w]) * 1e3))
    return CostTableResult(
        model=os.path.basename(model.path), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), machine=machine_description(), plain_ms=statistics.median(plains) * 1e3,
        rows=tuple(rows), ctx=ctx, cached_tokens=len(prompt), sampler=_sampler_name(cfg), reps=reps, rounds=rounds,
        command=command, seconds=time.perf_counter() - t_start,
        batch=tuple((B, w, max(statistics.median(r), 1.0)) for (B, w), r in batch_ratios.items()),
        tree=tuple((w, max(statistics.median(tree_ratios[w]), 1.0)) for w in widths),
    )


def tree_parents(width: int) -> np.ndarray:
    """The tree the probe times at a width: up to 3 siblings under the root, then a chain below the first one
    (int32 [width], engine.TreeDraft's parents)."""
    sib = min(3, width - 1)
    parents = [-1] + [0] * sib + [1 if t == sib + 1 else t - 1 for t in range(sib + 1, width)]
    return np.asarray(parents, np.int32)


def _sampler_name(cfg: SamplerConfig) -> str:
    if cfg.greedy:
        return "greedy"
    return f"temperature {cfg.temperature}, top-k {cfg.top_k}, top-p {cfg.top_p}, min-p {cfg.min_p}"


def format_cost_table(result: CostTableResult) -> str:
    """The table as printed by --spec-bench: cost and both break-even acceptance bounds per width."""
    lines = [
        (f"{result.model}: plain step {result.plain_ms:.1f} ms (ctx {result.ctx}, {result.cached_tokens} cached, "
         f"{result.sampler}; best of {result.reps}, median of {result.rounds} rounds)"),
        f"machine: {result.machine}",
        "width  draft slots k  C(k) plain steps  verify ms  break-even acc: strict (C-1)/k  conservative C/k",
    ]
    for w, d, c, m, v in result.rows:
        raw = f" (measured {m:.2f})" if m < c else ""
        lines.append(
            f"{w:5d}  {d:13d}  {c:16.2f}{raw}  {v:9.1f}  {100 * (c - 1) / d:27.0f}%  {100 * min(c / d, 9.99):15.0f}%"
        )
    if result.tree:
        lines.append("tree verifies (3 siblings + a chain), plain steps: " +
                     "  ".join(f"C_tree({w}) {c:.2f}" for w, c in result.tree))
    if result.batch:
        widths = sorted({w for _, w, _ in result.batch if w > 1})
        lines.append("batch rows B  plain B-row step (1-row steps)  " +
                     "  ".join(f"C_B({w})" for w in widths) + "  (B-row plain steps)")
        cost = {(r, w): c for r, w, c in result.batch}
        for r in sorted({r for r, _, _ in result.batch}):
            lines.append(f"{r:12d}  {cost.get((r, 1), math.nan):30.2f}  " +
                         "  ".join(f"{cost.get((r, w), math.nan):7.2f}" for w in widths))
    return "\n".join(lines)


def save_cost_table(result: CostTableResult, path: str | os.PathLike) -> str:
    """Write the JSON that load_cost_table (and `--cost-table FILE`) reads; returns the path."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=2)
        f.write("\n")
    return path


def load_cost_table(path: str | os.PathLike) -> tuple[CostPoint, ...]:
    """The gate's table from a --spec-bench JSON file: pass it as SpecOptions(cost_table=...).

    Raises CostTableError (a SpecOptionsError) naming the file and what is wrong with it.
    """
    table = tuple(CostPoint(d, c) for d, c in read_cost_points(path))
    SpecOptions(cost_table=table).validate()  # the gate's own rules; read_cost_points' checks make this pass
    return table


def load_batch_costs(path: str | os.PathLike) -> tuple[tuple[int, int, float], ...]:
    """The batch surface of a --spec-bench JSON file (() when it has none): pass it as
    SpecOptions(batch_costs=...). Raises CostTableError like load_cost_table."""
    return tuple(read_batch_costs(path))


# How to get the plot when matplotlib is missing (it is in the [bench] extra only, not a dependency).
PLOT_HINT = "to get it: pip install matplotlib, or the project's [bench] extra (pip install -e '.[bench]')"


def plot_cost_table(result: CostTableResult, path: str | os.PathLike) -> str:
    """PNG: C(k) in plain steps (left) and the break-even acceptance bounds (C(k) - 1)/k and C(k)/k (right).
    Needs matplotlib (ImportError without it: see PLOT_HINT)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    k = [d for _, d, _, _, _ in result.rows]
    c = [c for _, _, c, _, _ in result.rows]
    m = [m for _, _, _, m, _ in result.rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(k, c, "o-", label="C(k) (gate table)")
    a1.plot(k, m, "x:", color="grey", label="measured ratio")
    if result.tree:
        a1.plot([w - 1 for w, _ in result.tree], [c for _, c in result.tree], "^--", label="tree verify")
    a1.axhline(1.0, color="black", lw=0.7)
    a1.set_xscale("log", base=2)
    a1.set_xticks(k, [str(x) for x in k])
    a1.set_xlabel("draft slots k (verify width - 1)")
    a1.set_ylabel("verify cost (plain decode steps)")
    a1.set_title(f"verify cost, plain step {result.plain_ms:.0f} ms")
    a1.legend()
    a2.plot(k, [100 * (x - 1) / d for x, d in zip(c, k)], "o-", label="strict: a = C(k) - 1  ->  (C(k) - 1)/k")
    a2.plot(k, [100 * x / d for x, d in zip(c, k)], "s--", label="conservative: C(k)/k")
    a2.set_xscale("log", base=2)
    a2.set_xticks(k, [str(x) for x in k])
    a2.set_ylim(0, 105)
    a2.set_xlabel("draft slots k")
    a2.set_ylabel("break-even acceptance (%)")
    a2.set_title("speculation wins above the curve")
    a2.legend()
    fig.suptitle(f"{result.model} - {result.date[:10]}", fontsize=9)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_spec_bench(model, *, json_path: str | None, png_path: str | None, ctx: int | None = None,
                   sampler: SamplerConfig | None = None, reps: int = DEFAULT_REPS, rounds: int = DEFAULT_ROUNDS,
                   prompt_len: int = DEFAULT_PROMPT_LEN, batch_rows: Sequence[int] = DEFAULT_BATCH_ROWS,
                   progress: bool = True, command: str = "", out=None) -> CostTableResult:
    """Measure, print the table (to `out`, default stdout), write the JSON and the PNG (either path may be None
    to skip it). Without matplotlib the PNG is skipped with one line saying so and how to get it."""
    out = out or sys.stdout
    result = measure_cost_table(model, ctx=ctx, sampler=sampler, reps=reps, rounds=rounds, prompt_len=prompt_len,
                                batch_rows=batch_rows, progress=progress, command=command)
    print(format_cost_table(result), file=out)
    if json_path:
        save_cost_table(result, json_path)
        print(f"wrote {json_path} (use it with --cost-table {json_path})", file=out)
    if png_path:
        try:
            plot_cost_table(result, png_path)
        except ImportError as e:  # its only imports are matplotlib's: missing, or an install that cannot load
            reason = str(e).partition("\n")[0]
            why = "is not installed" if e.name == "matplotlib" else f"failed to import ({reason})"
            print(f"skipped the plot {png_path}: it needs matplotlib, which {why}; {PLOT_HINT}", file=out)
        else:
            print(f"wrote {png_path}", file=out)
    return result


def main(argv=None) -> int:
    """`python -m fucina_jax.speculative.bench [MODEL] [--json F] [--png F]`: the probe without the generation CLI."""
    import argparse

    import fucina_jax

    ap = argparse.ArgumentParser(prog="python -m fucina_jax.speculative.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--json", default="spec_bench.json", help="cost-table JSON to write ('' = none)")
    ap.add_argument("--png", default="spec_bench.png", help="plot to write ('' = none)")
    ap.add_argument("--ctx", type=int, default=0, help="cache size (default: the model's default context)")
    ap.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed pairs per width per round")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds (the median is kept)")
    ap.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN,
                    help="cached tokens before the timed steps (attention grows with them)")
    ap.add_argument("--greedy", action="store_true", help="time the greedy sampler (default: the CLI's sampler)")
    ap.add_argument("--cache-type", choices=sorted(CACHE_DTYPES), default="f32",
                    help="KV cache type, as the CLI's --cache-type (default f32)")
    ap.add_argument("--batch-rows", default=",".join(map(str, DEFAULT_BATCH_ROWS)),
                    help="batch sizes of the batch surface, comma-separated ('' = none)")
    args = ap.parse_args(argv)
    try:
        batch_rows = tuple(int(x) for x in args.batch_rows.split(",") if x.strip())
    except ValueError:
        batch_rows = (0,)
    if any(b < 2 for b in batch_rows):
        ap.error(f"--batch-rows {args.batch_rows!r}: give comma-separated integers >= 2, e.g. 2,4,8 (or '')")
    if args.prompt_len < 1:
        ap.error(f"--prompt-len {args.prompt_len}: give at least 1 cached token")
    model = fucina_jax.load(args.model, cache_type=args.cache_type)
    sampler = SamplerConfig(temperature=0.0, seed=0) if args.greedy else SamplerConfig(seed=0)
    command = "python -m fucina_jax.speculative.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    run_spec_bench(model, json_path=args.json or None, png_path=args.png or None, ctx=args.ctx or None,
                   sampler=sampler, reps=args.reps, rounds=args.rounds, prompt_len=args.prompt_len,
                   batch_rows=batch_rows, command=command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
