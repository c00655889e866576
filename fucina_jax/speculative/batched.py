"""Batched speculative decoding: B independent conversations share one jitted verify+sample per step.

Each row is its own conversation: its own prompt length, draft source (a SpeculationIndex or any DraftSource), sampler
values and seed, penalty history, stop ids and token budget. They meet only in the forward pass. One step:

  1. every active row drafts from its own source (up to its budget: max_draft, and never past its own limit);
  2. the batch runs ONE verify over tokens [B, k]: row b = [its carried token, its draft..., padding], k the verify
     bucket of the longest draft this step (k = 1 when no row drafted: a batched plain step). A row with a shorter
     draft or none pads; a finished row rides along with its frozen cache length and commits nothing. Shapes come
     only from (B, k in STEP_WIDTHS), so a row finishing or a draft changing length never recompiles;
  3. the sampler runs on every verified row of every conversation, row b's row i at that conversation's stream
     position n_b + i with that conversation's history + drafts[:i] (the counter-based RNG keys on (seed, position),
     design record section 2, obligations 1 and 3);
  4. on the host, each row keeps its longest accepted prefix + correction/bonus token, exactly as the single
     decoder (speculative/decoder.py) does, cut at a stop id or at its limit; its committed ids enter its penalty history;
  5. per-row rewind is a per-row cache length: the next step starts each row at (its committed length - 1), so the
     rejected rows of this step are stale and never visible (no copy, no separate truncate call).

So every row's stream is the stream that conversation alone produces with plain decoding (fucina_jax.generate) for
the same sampler values and seed. The logits of a row in a batch can differ from the same row alone in the last
bits (the matmuls see B*k rows instead of 1), the same caveat the single decoder has between verify and decode.

Gate: ONE CostGate for the whole batch, fed the batch's economics. A step is one forward for every row, so the
question is whether the batch's verify beats the batch's plain step (k = 1): a verify step commits C tokens over the
n active rows where a plain step commits n, at a cost of c plain steps, so it enters the gate's window as
(C committed, cost c * n): est_speedup = C / (c * n), tokens per row per plain-step time. With a clock, c is the
measured verify/plain wall-time ratio of this batch (the first steps run plain until one plain step is timed), else
the static cost table at the step's width. Why not the single-stream table alone: at B > 1 a CPU forward stops being
bound by streaming the weights and its cost grows with B * k: a width-8 step costs 2.8 width-1 steps at B = 1, 5.4 at
B = 2 and 8.4 at B = 4 (Gemma 3 270M, 2 CPU cores, ctx 512), so the single-stream table underprices batches. When
the gate is off every row steps plainly; the rows' drafts are capped by the gate's acceptance-adaptive budget (the
batch's acceptance). The gate never changes what is committed.
`enabled=False` turns every step into a batched plain step: the plain baseline of scripts/bench_batch.py.

Prefill: the prompts are prefilled together in chunks of the largest prefill bucket (engine.prefill_step with the
per-row number of valid tokens; a row whose prompt ended in an earlier chunk gets n_valid = 0 and only rides along).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax import aot, engine, sampling
from fucina_jax.errors import DraftSourceError
from fucina_jax.generate import GenerationResult, check_request
from fucina_jax.index.protocol import DraftSource
from fucina_jax.models import forward_hidden, truncate, unembed
from fucina_jax.models.cache import KVCache
from fucina_jax.models.config import ModelConfig
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative.decoder import SpecStats, check_spec_args
from fucina_jax.speculative.gate import MAX_DRAFT, CostGate, SpecOptions, table_cost
from fucina_jax.speculative.steps import feedback_topk

__all__ = [
    "STEP_WIDTHS",
    "TRACE_COUNTS",
    "BatchedSpeculativeDecoder",
    "batched_prefill",
    "batched_sample_step",
    "batched_verify_sample_step",
    "generate_batched",
]

# Step widths (carried token + draft): 1 is the batched plain step, the rest are the engine's verify buckets.
STEP_WIDTHS = (1, *engine.VERIFY_BUCKETS)

# Incremented at trace time only: tests assert nothing recompiles inside a bucket.
TRACE_COUNTS: collections.Counter = collections.Counter()


# ---- the compiled steps -------------------------------------------------------------------------------------------


def _sample_each(logits, positions, history, drafts, sparams, cap: int):
    """sampling.sample_rows for each conversation b: logits [B, R, V], positions [B, R], history/sparams with a
    leading batch axis, drafts [B, R] or None. lax.map, not vmap: vmap would turn the sampler's lax.conds (greedy
    vs sort, top-`cap` vs full sort) into selects that always pay for the full vocab sort, and per conversation the
    program is then the very one the single-conversation loops run."""

    def one(x):
        l, p, hist, d, sp = x
        return sampling.sample_rows(l, p, sampling.History(*hist), d, sampling.SamplerParams(*sp), cap=cap)

    if drafts is None:
        return jax.lax.map(lambda x: one((*x[:3], None, x[3])), (logits, positions, tuple(history), tuple(sparams)))
    return jax.lax.map(one, (logits, positions, tuple(history), drafts, tuple(sparams)))


@aot.jit(static_argnames=("cfg", "cap", "wants_topk"), donate_argnames=("cache",))
def batched_verify_sample_step(
    params,
    tokens: jax.Array,
    drafts: jax.Array,
    start: jax.Array,
    cache: KVCache,
    history: sampling.History,
    sparams: sampling.SamplerParams,
    cfg: ModelConfig,
    cap: int,
    wants_topk: bool = False,
):
    """Rewind each row to start[b], verify tokens [B, k] and sample every row of every conversation.

    drafts int32 [B, k]: drafts[b, i] is the token row (b, i) is checked against, -1 past row b's draft.
    start int32 [B]: row b's committed length - 1 (its carried token goes to that position).
    history: History with tokens [B, W], count [B]; sparams: SamplerParams with [B] leaves (per-row values, seeds).
    Returns (sampled int32 [B, k], top-K ids int32 [B, k, TOPK_FEEDBACK] or None, cache advanced to start + k)."""
    TRACE_COUNTS["batched_verify_sample", tokens.shape, cap, wants_topk] += 1
    cache = truncate(cache, start)
    k = tokens.shape[1]
    in_pos = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    h, cache = forward_hidden(params, tokens, in_pos, cache, cfg)
    logits = unembed(params, h, cfg)  # [B, k, V]
    # Row (b, i)'s token lands at stream position in_pos + 1: the plain loop's position for the same prefix.
    sampled = _sample_each(logits, in_pos + 1, history, drafts, sparams, cap)
    topk = feedback_topk(logits) if wants_topk else None
    return sampled, topk, cache


@aot.jit(static_argnames=("cap",))
def batched_sample_step(logits: jax.Array, positions: jax.Array, history: sampling.History,
                        sparams: sampling.SamplerParams, cap: int) -> jax.Array:
    """Each conversation's first token from its prefill logits [B, V] at positions [B]; int32 [B]."""
    TRACE_COUNTS["batched_sample", logits.shape, cap] += 1
    return _sample_each(logits[:, None], positions[:, None], history, None, sparams, cap)[:, 0]


# Each row appends its own count of committed ids (n_new [B]) to its own window.
_push_each = jax.jit(jax.vmap(sampling.push_history))


def batched_prefill(model, prompts: Sequence[Sequence[int]], cache: KVCache):
    """Prefill prompt b into row b of a fresh cache, all rows in each chunk's one forward; returns (logits [B, V]
    after each row's last prompt token, cache with length[b] = len(prompts[b]))."""
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    biggest = engine.PREFILL_BUCKETS[-1]
    final = None
    for s in range(0, int(lens.max()), biggest):
        n_valid = np.clip(lens - s, 0, biggest).astype(np.int32)
        T = engine.bucket_for(int(n_valid.max()), engine.PREFILL_BUCKETS)
        toks = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            toks[b, : n_valid[b]] = p[s : s + n_valid[b]]
        # n_valid 0: the row's prompt ended in an earlier chunk; its rows here are written past its length (stale)
        logits, cache = engine.prefill_step(model.params, toks, n_valid, cache, model.config)
        ends_here = jnp.asarray((lens > s) & (lens <= s + biggest))[:, None]
        final = logits if final is None else jnp.where(ends_here, logits, final)
    return final, cache


def _trace_total() -> int:
    return (sum(TRACE_COUNTS.values()) + sum(engine.TRACE_COUNTS.values()) + sum(sampling.TRACE_COUNTS.values())
            + sum(aot.LOADED.values()))


def _stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


# ---- the host loop ------------------------------------------------------------------------------------------------


class BatchedSpeculativeDecoder:
    """B conversations decoded in lockstep; see the module docstring for the algorithm.

    Drive it as: `logits = begin(prompts)`, `bootstrap(logits, stops)`, then `step(limits, stops)` until every row
    is done. `limits[b]` caps the ids row b may commit this step; 0 marks a finished row (it rides along, commits
    nothing, its source sees nothing). `stops[b]` is row b's set of stop ids. Both calls return per-row lists
    (committed ids, stopped), as SpeculativeDecoder.step does for one row.

    sources[b]: row b's DraftSource; None gives the row no drafts (it always rides with width 1).
    samplers: one SamplerConfig for every row or one per row (each validated: a None seed becomes a concrete one).
    clock (ns, e.g. time.perf_counter_ns): prices verifies by measured wall time; None uses the static cost table.
    """

    def __init__(
        self,
        model,
        batch: int,
        *,
        sources: Sequence[DraftSource | None] | None = None,
        samplers: SamplerConfig | Sequence[SamplerConfig] | None = None,
        ctx: int | None = None,
        options: SpecOptions | None = None,
        clock: Callable[[], int] | None = None,
    ):
        if batch < 1:
            raise ValueError(f"batch = {batch}: at least one row is needed")
        self.model = model
        self.B = int(batch)
        self.ctx = int(ctx or model.default_ctx)
        self.options = (options or SpecOptions()).validate()
        self.gate = CostGate(self.options)
        self.clock = clock
        self.sources = list(sources) if sources is not None else [None] * self.B
        if isinstance(samplers, SamplerConfig) or samplers is None:
            samplers = [samplers or SamplerConfig()] * self.B
        self.samplers = [s.validate() for s in samplers]
        if len(self.sources) != self.B or len(self.samplers) != self.B:
            raise ValueError(f"batch = {self.B} rows but {len(self.sources)} sources and {len(self.samplers)} "
                             "samplers: give one per row (or one sampler for all)")
        n_vocab = model.config.n_vocab
        # The widest candidate cap and history window serve every row: any cap gives the same tokens (it only
        # sets the cost) and a wider window is cut to each row's own repeat_last_n in the sampler.
        self._cap = max(s.candidate_cap(n_vocab) for s in self.samplers)
        self._hist_cap = max(s.history_capacity(self.ctx) for s in self.samplers)
        self._sparams = _stack([s.params() for s in self.samplers])
        self.wants_topk = any(bool(getattr(s, "wants_topk", False)) for s in self.sources if s is not None)
        self.stats = [SpecStats() for _ in range(self.B)]
        self.streams = np.zeros((self.B, self.ctx), np.int32)
        self.n = np.zeros(self.B, np.int64)
        self._buf = np.zeros(MAX_DRAFT, np.int32)
        self._last_accepted = [0] * self.B  # per row, of the current step
        self.cache = None
        self.history = None

    def begin(self, prompts: Sequence[Sequence[int]]):
        """Prefill every row's prompt into a fresh [B] cache and show each to its source; returns logits [B, V]."""
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        if len(prompts) != self.B:
            raise ValueError(f"{len(prompts)} prompts for a batch of {self.B} rows")
        for b, p in enumerate(prompts):
            if not 0 < p.size < self.ctx:
                from fucina_jax.errors import ContextFullError

                raise ContextFullError(
                    f"prompt {b} has {p.size} tokens; it needs 1 to {self.ctx - 1} for a context of {self.ctx}")
            self.model.check_ids(p)
            self.streams[b, : p.size] = p
            self.n[b] = p.size
        self.history = _stack([sampling.history_from_tokens(p.tolist(), self._hist_cap) for p in prompts])
        self.cache = None
        logits, self.cache = batched_prefill(self.model, prompts, self.model.new_cache(self.ctx, self.B))
        for src, p in zip(self.sources, prompts):
            if src is not None:
                src.observe(p)
        return logits

    def bootstrap(self, logits, stops: Sequence[Iterable[int]]) -> list[tuple[list[int], bool]]:
        """Sample each row's first token from its prefill logits, exactly as the plain loop does."""
        toks_dev = batched_sample_step(logits, np.asarray(self.n, np.int32), self.history, self._sparams,
                                       self._cap)
        toks = np.asarray(toks_dev)
        out = []
        n_new = np.zeros(self.B, np.int32)
        for b in range(self.B):
            t = int(toks[b])
            if t in frozenset(stops[b]):
                out.append(([], True))
                continue
            n_new[b] = 1
            self.streams[b, self.n[b]] = t
            self.n[b] += 1
            out.append(([t], False))
        self.history = _push_each(self.history, toks_dev[:, None], np.asarray(n_new, np.int32))
        for b, (committed, _) in enumerate(out):
            if committed and self.sources[b] is not None:
                self.sources[b].observe(np.asarray(committed, np.int32))
        return out

    def step(self, limits: Sequence[int], stops: Sequence[Iterable[int]]) -> list[tuple[list[int], bool]]:
        """One batched step: active row b commits 1..limits[b] ids (0 when its first sample is a stop)."""
        if self.cache is None:
            raise RuntimeError("call begin() (and bootstrap()) before step()")
        o = self.options
        B = self.B
        gate = self.gate
        # With a clock, the gate needs the plain step's time before it can price a verify: step plainly until one
        # plain step ran without compiling.
        calibrating = self.clock is not None and gate.plain_samples == 0
        speculate = o.enabled and not calibrating and gate.allows()
        budget = o.max_draft
        if o.adapt_budget:
            budget = min(budget, gate.budget_cap(o.max_draft, o.min_draft))
        drafts: list[np.ndarray] = []
        for b in range(B):
            d = np.zeros(0, np.int32)
            if limits[b] > 0:
                self.stats[b].steps += 1
                max_draft = min(budget, limits[b] - 1)
                if speculate and self.sources[b] is not None and max_draft >= o.min_draft:
                    d = self._suggest(b, max_draft)
                    if d.size < o.min_draft:
                        d = d[:0]
                if not o.enabled or not (speculate or calibrating):
                    self.stats[b].disabled_steps += 1
                elif d.size == 0:
                    self.stats[b].fallback_steps += 1
            drafts.append(d)
        longest = max(d.size for d in drafts)
        width = engine.bucket_for(1 + longest, STEP_WIDTHS)
        toks = np.zeros((B, width), np.int32)  # padding holds token 0: computed, never looked at
        dr = np.full((B, width), -1, np.int32)
        for b, d in enumerate(drafts):
            toks[b, 0] = self.streams[b, self.n[b] - 1]
            toks[b, 1 : 1 + d.size] = d
            dr[b, : d.size] = d
        start = np.asarray(self.n - 1, np.int32)
        traced = _trace_total()
        t0 = self.clock() if self.clock else 0
        cache, self.cache = self.cache, None  # donated below
        try:
            sampled_dev, topk, self.cache = batched_verify_sample_step(
                self.model.params, toks, dr, start, cache, self.history, self._sparams,
                # top-K rows only for verifies, as the single decoder (its plain steps feed no observe_topk)
                self.model.config, self._cap, wants_topk=self.wants_topk and width > 1,
            )
        except BaseException:
            self.cache = cache
            raise
        # Nothing below touches the cache: the next step's `start` rewinds every row to what it committed (until
        # then, slots past a row's committed length - 1 are stale, and no step ever reads them).
        sampled = np.asarray(sampled_dev)
        step_ns = self.clock() - t0 if self.clock and _trace_total() == traced else None
        out = []
        n_new = np.zeros(B, np.int32)
        for b, d in enumerate(drafts):
            if limits[b] <= 0:
                out.append(([], False))
                continue
            committed, stopped = self._accept(b, sampled[b], d, int(limits[b]), frozenset(stops[b]))
            n_new[b] = len(committed)
            self.streams[b, self.n[b] : self.n[b] + len(committed)] = committed
            self.n[b] += len(committed)
            out.append((committed, stopped))
        # sampled[b, :n_new[b]] == row b's committed ids: each history gets exactly its row's committed ids
        self.history = _push_each(self.history, sampled_dev, np.asarray(n_new, np.int32))
        if width == 1:
            if step_ns is not None:
                gate.note_plain_ns(step_ns)
        else:
            # The batch's verify against the batch's plain step: cost in plain steps, times the active rows (a plain
            # step commits one token per active row), so est_speedup is tokens per row per plain-step time.
            if step_ns is not None and gate.plain_samples:
                cost = max(step_ns / gate.plain_ns, 1.0)
            else:
                cost = max(table_cost(o.cost_table, width - 1), 1.0)
            active = [b for b in range(B) if limits[b] > 0]
            gate.record_verify(int(n_new.sum()), sum(self._last_accepted[b] for b in active),
                               sum(drafts[b].size for b in active), cost * len(active))
        # Streams, lengths and histories are settled: a source raising below leaves the decoder consistent.
        topk_rows = np.asarray(topk) if topk is not None else None
        for b, (committed, _) in enumerate(out):
            src = self.sources[b]
            if committed and src is not None:
                src.observe(np.asarray(committed, np.int32))
                if topk_rows is not None and getattr(src, "wants_topk", False):
                    src.observe_topk(topk_rows[b, : len(committed)])
        return out

    def _accept(self, b: int, sampled: np.ndarray, draft: np.ndarray, limit: int, stops: frozenset):
        """The single decoder's accept rule for one row: row i's sample is the target's pick after draft[:i], so it
        is committed iff every earlier row matched its draft token."""
        st = self.stats[b]
        d = draft.size
        committed: list[int] = []
        stopped = False
        accepted = 0
        for i in range(d + 1):
            t = int(sampled[i])
            if t in stops:
                stopped = True  # the plain loop stops on this id without committing it
                break
            committed.append(t)
            if not (i < d and t == draft[i]):
                if d:
                    if i < d:
                        st.rejected += 1
                    else:
                        st.bonus += 1
                break
            accepted += 1
            if len(committed) >= limit:
                break  # the plain loop stops here (max_tokens / context)
        if d:
            st.verify_steps += 1
            st.drafted += d
            st.accepted += accepted
        self._last_accepted[b] = accepted
        st.committed += len(committed)
        return committed, stopped

    def _suggest(self, b: int, max_draft: int) -> np.ndarray:
        context = self.streams[b, : self.n[b]]
        context.flags.writeable = False  # sources must not modify it: make that loud
        buf = self._buf[:max_draft]
        n = self.sources[b].suggest(context, buf)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= max_draft:
            raise DraftSourceError(f"the draft source of row {b} returned length {n!r}; it must be an int in "
                                   f"[0, {max_draft}]")
        ids = buf[: int(n)].copy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.model.config.n_vocab):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise DraftSourceError(f"the draft source of row {b} proposed token id {bad}, outside the vocabulary "
                                   f"[0, {self.model.config.n_vocab})")
        return ids

    def spec_stats(self, b: int) -> dict:
        st = self.stats[b]
        out = dataclasses.asdict(st)
        out.update(tok_per_step=round(st.tok_per_step, 4), acceptance=round(st.acceptance, 4), summary=st.summary(),
                   max_draft=self.options.max_draft, batch=self.B, gate=self.gate.decisions())
        src = self.sources[b]
        if src is not None and hasattr(src, "summary"):
            out["sources_summary"] = src.summary()
        return out


def _per_row(value, B: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{name}: {len(value)} values for {B} prompts; give one per prompt or a single value")
        return list(value)
    return [value] * B


def generate_batched(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int | Sequence[int] = 128,
    sampler: SamplerConfig | Sequence[SamplerConfig] | None = None,
    ctx: int | None = None,
    stop_ids: Iterable[int] | Sequence[Iterable[int]] | None = None,
    sources: Sequence[DraftSource | None] | None = None,
    options: SpecOptions | None = None,
    clock: bool | Callable[[], int] = True,
) -> list[GenerationResult]:
    """Decode every prompt (token ids, BOS included) as its own conversation, all in one batch; returns one
    GenerationResult per prompt, each with the tokens fucina_jax.generate.generate gives for that prompt alone.

    max_tokens, sampler, stop_ids: one value for all rows or a list with one per row (stop_ids None: the model's
    end-of-generation ids; a list of ints is one stop set for all rows). sources: one DraftSource (or None: no
    drafts) per row; sources=None gives each row a fresh SpeculationIndex. options.enabled=False decodes plainly
    (one token per row per step). clock: True prices the batch gate's verifies with time.perf_counter_ns, False
    with the static cost table only. Timing: prompt_seconds is the shared prefill; decode_seconds is the wall time
    of the steps the row was active in (the row shares them with the batch).
    """
    if isinstance(prompts, np.ndarray):
        prompts = list(prompts)  # a [B, T] array: its rows
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or (
            len(prompts) and all(isinstance(p, (int, np.integer)) for p in prompts)):
        raise TypeError("prompts must be a list of prompts, each a list of token ids (one prompt: [ids])")
    B = len(prompts)
    if B < 1:
        raise ValueError("no prompts: give at least one")
    check_spec_args(options, sources or [], clock)
    maxes = _per_row(max_tokens, B, "max_tokens")
    if stop_ids is None or (isinstance(stop_ids, (list, tuple, set, frozenset)) and
                            all(isinstance(t, (int, np.integer)) for t in stop_ids)):
        stop_ids = [stop_ids] * B
    stop_ids = _per_row(list(stop_ids), B, "stop_ids")
    samplers = _per_row(sampler, B, "sampler")
    checked = [check_request(model, p, m, s, ctx, st) for p, m, s, st in zip(prompts, maxes, samplers, stop_ids)]
    prompts = [c[0] for c in checked]
    ctx = checked[0][2]
    stops = [c[3] for c in checked]
    if sources is None:
        from fucina_jax.index import SpeculationIndex

        sources = [SpeculationIndex(model.config.n_vocab) for _ in range(B)]
    tick = time.perf_counter_ns if clock is True else (clock or None)
    dec = BatchedSpeculativeDecoder(model, B, sources=sources, samplers=[c[1] for c in checked], ctx=ctx,
                                    options=options, clock=tick)
    tokens: list[list[int]] = [[] for _ in range(B)]
    reason = ["max_tokens"] * B
    done = [m <= 0 for m in maxes]
    decode_s = np.zeros(B)
    compile_s = np.zeros(B)

    def timed(fn, *args):
        before = _trace_total()
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0  # the steps end in np.asarray of their samples: the work is done
        active = ~np.asarray(done)
        decode_s[active] += dt
        if _trace_total() != before:
            compile_s[active] += dt
        return out

    t0 = time.perf_counter()
    before = _trace_total()
    prompt_s = prompt_compile = 0.0
    if not all(done):
        logits = dec.begin(prompts)
        jax.block_until_ready(logits)
        prompt_s = time.perf_counter() - t0
        prompt_compile = prompt_s if _trace_total() != before else 0.0
        results = timed(dec.bootstrap, logits, stops)
        while True:
            for b, (committed, stopped) in enumerate(results):
                if done[b]:
                    continue
                tokens[b].extend(committed)
                if stopped:
                    reason[b], done[b] = "eog", True
                elif len(tokens[b]) >= maxes[b]:
                    done[b] = True
                elif len(prompts[b]) + len(tokens[b]) >= ctx:
                    reason[b], done[b] = "context", True
            if all(done):
                break
            limits = [0 if done[b] else min(maxes[b] - len(tokens[b]), ctx - len(prompts[b]) - len(tokens[b]))
                      for b in range(B)]
            results = timed(dec.step, limits, stops)
    out = []
    for b in range(B):
        res = GenerationResult(
            prompt_ids=prompts[b], tokens=tokens[b], text=model.tokenizer.decode(tokens[b]), stop_reason=reason[b],
            prompt_seconds=prompt_s, decode_seconds=float(decode_s[b]),
            compile_seconds=float(compile_s[b]) + prompt_compile, seed=dec.samplers[b].seed, spec=dec.spec_stats(b),
        )
        res._compile_split = {"prompt": prompt_compile, "decode": float(compile_s[b])}
        out.append(res)
    return out
