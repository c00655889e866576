"""What the step probes (bench_fused_pick.py, bench_rows.py) share: their command line, and the timing of arms whose
calls are shuffled within each repetition (machine load then hits every arm alike)."""

from __future__ import annotations

import argparse
from typing import Callable, Hashable

import numpy as np

from fucina_jax import engine
from fucina_jax.models.cache import CACHE_DTYPES


def parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The probes' arguments: model, --ctx, --prompt-len, --reps, --cache-type (parse with parse())."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--ctx", type=int, default=1024, help="cache size")
    ap.add_argument("--prompt-len", type=int, default=300, help="cached tokens before the step")
    ap.add_argument("--reps", type=int, default=reps, help="repetitions (each arm keeps its median)")
    ap.add_argument("--cache-type", choices=sorted(CACHE_DTYPES), default="f32", help="KV cache type (default f32)")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if args.reps < 1 or args.prompt_len < 1 or args.ctx < args.prompt_len + engine.STEP_WIDTHS[-1]:
        ap.error(f"need reps >= 1, prompt-len >= 1 and ctx >= prompt-len + {engine.STEP_WIDTHS[-1]}")
    return args


def time_shuffled(arms: list[Hashable], call: Callable[..., float], reps: int,
                  rng: np.random.Generator) -> dict[Hashable, list[float]]:
    """Each arm (a tuple of call's arguments) called twice untimed (compile or load, then warm), then `reps` rounds of
    every arm in a fresh random order; call returns its own seconds. Returns arm -> the seconds of its rounds."""
    for arm in arms:
        call(*arm)
        call(*arm)
    times = {arm: [] for arm in arms}
    for _ in range(reps):
        for i in rng.permutation(len(arms)):
            times[arms[i]].append(call(*arms[i]))
    return times
