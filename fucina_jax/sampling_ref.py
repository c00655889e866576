"""A slow pure-NumPy reference of llama.cpp's sampler chain, written independently of fucina_jax.sampling.

It follows llama.cpp's data flow literally (src/llama-sampler.cpp): a candidate list of (id, logit) that each
sampler shrinks or rewrites in place, a `sorted` flag, float32 arithmetic with sequential sums where llama.cpp sums
in a loop, and the dist sampler's walk over the list with a double-precision running sum. The one thing llama.cpp
leaves unspecified, the order of equal logits after a sort, is fixed here as lower token id first. Only the uniform
draw is an input (llama.cpp's comes from mt19937; ours from the counter-based key).

For tests and debugging only: loops over the vocab in Python.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["Candidates", "ref_window", "ref_penalties", "ref_top_k", "ref_top_p", "ref_min_p", "ref_temperature",
           "ref_dist", "ref_chain", "ref_sample"]

F32 = np.float32


class Candidates:
    """llama_token_data_array: ids and logits in the current order, plus whether that order is sorted."""

    def __init__(self, logits: np.ndarray):
        self.ids = np.arange(len(logits), dtype=np.int64)
        self.logits = np.asarray(logits, dtype=F32).copy()
        self.sorted = False

    def sort(self) -> None:
        order = sorted(range(len(self.ids)), key=lambda i: (-float(self.logits[i]), int(self.ids[i])))
        self.ids, self.logits = self.ids[order], self.logits[order]
        self.sorted = True

    def keep(self, n: int) -> None:
        self.ids, self.logits = self.ids[:n], self.logits[:n]

    def kept(self) -> list[int]:
        return [int(i) for i in self.ids]


def _softmax_f32(logits: np.ndarray) -> np.ndarray:
    mx = F32(np.max(logits))
    p = np.array([np.exp(F32(l - mx), dtype=F32) for l in logits], dtype=F32)
    total = F32(0.0)
    for x in p:
        total = F32(total + x)
    return (p / total).astype(F32)


def ref_window(stream: Sequence[int], repeat_last_n: int) -> list[int]:
    """The tokens the penalties sampler counts: the last repeat_last_n of the committed stream (-1: all, 0: none)."""
    if repeat_last_n == 0:
        return []
    if repeat_last_n < 0:
        return list(stream)
    return list(stream)[-repeat_last_n:] if len(stream) else []


def ref_penalties(c: Candidates, window: Sequence[int], repeat: float, freq: float, presence: float) -> None:
    counts: dict[int, int] = {}
    for t in window:
        counts[int(t)] = counts.get(int(t), 0) + 1
    for i in range(len(c.ids)):
        n = counts.get(int(c.ids[i]), 0)
        if n == 0:
            continue
        l = c.logits[i]
        l = F32(l * F32(repeat)) if l <= 0 else F32(l / F32(repeat))
        c.logits[i] = F32(l - F32(F32(F32(n) * F32(freq)) + F32(presence)))
    c.sorted = False


def ref_top_k(c: Candidates, k: int) -> None:
    if k <= 0:
        return
    k = min(k, len(c.ids))
    c.sort()
    c.keep(k)


def ref_top_p(c: Candidates, p: float, min_keep: int = 0) -> None:
    if p >= 1.0:
        return
    if not c.sorted:
        c.sort()
    probs = _softmax_f32(c.logits)
    cum = F32(0.0)
    last = len(c.ids)
    for i in range(len(c.ids)):
        cum = F32(cum + probs[i])
        if cum >= F32(p) and i + 1 >= min_keep:
            last = i + 1
            break
    c.keep(last)


def ref_min_p(c: Candidates, p: float, min_keep: int = 0) -> None:
    if p <= 0.0 or len(c.ids) == 0:
        return
    if not c.sorted:
        # unsorted path: filter in place, order preserved
        thr = F32(F32(np.max(c.logits)) + F32(np.log(F32(p))))
        sel = [i for i in range(len(c.ids)) if c.logits[i] >= thr]
        if sel and len(sel) >= min_keep:
            c.ids, c.logits = c.ids[sel], c.logits[sel]
            return
        c.sort()
    thr = F32(c.logits[0] + F32(np.log(F32(p))))
    i = 1
    while i < len(c.ids):
        if c.logits[i] < thr and i >= min_keep:
            break
        i += 1
    c.keep(i)


def ref_temperature(c: Candidates, t: float) -> None:
    if len(c.ids) == 0:
        return
    if t <= 0.0:
        # greedy: the first maximum in the current order survives, everything else becomes -inf
        best = 0
        for i in range(1, len(c.ids)):
            if c.logits[i] > c.logits[best]:
                best = i
        keep = c.logits[best]
        c.logits[:] = -np.inf
        c.logits[best] = keep
        return
    c.logits = (c.logits / F32(t)).astype(F32)


def ref_dist(c: Candidates, u: float) -> int:
    # llama.cpp walks the current order, which is descending whenever top-k/top-p/min-p sorted it; walking in
    # descending order always only changes which u maps to which token, not the distribution, and makes the map
    # independent of which filters ran. Zero-probability entries are never picked (llama.cpp can pick one only
    # for a draw of exactly 0 in unsorted order).
    if not c.sorted:
        c.sort()
    mx = F32(np.max(c.logits))
    p = [F32(np.exp(F32(l - mx))) for l in c.logits]
    total = 0.0
    for x in p:
        total += float(x)
    target = total * float(u)
    run = 0.0
    for i, x in enumerate(p):
        run += float(x)
        if run >= target and x > 0:
            return int(c.ids[i])
    return int(c.ids[len(p) - 1])


def ref_chain(logits: np.ndarray, stream: Sequence[int], cfg) -> Candidates:
    """penalties -> top_k -> top_p -> min_p -> temperature on one row; cfg is a SamplerConfig."""
    c = Candidates(logits)
    ref_penalties(c, ref_window(stream, cfg.repeat_last_n), cfg.repeat_penalty, cfg.frequency_penalty,
                  cfg.presence_penalty)
    ref_top_k(c, cfg.top_k)
    ref_top_p(c, cfg.top_p, cfg.min_keep)
    ref_min_p(c, cfg.min_p, cfg.min_keep)
    ref_temperature(c, cfg.temperature)
    return c


def ref_sample(logits: np.ndarray, stream: Sequence[int], cfg, u: float) -> int:
    """The token llama.cpp's chain picks for this row given the uniform draw u."""
    return ref_dist(ref_chain(logits, stream, cfg), u)
