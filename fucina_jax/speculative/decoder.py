"""The speculative decoder: draft from any DraftSource, verify in one batched forward, commit what the target picks.

The losslessness contract (design record section 2): the committed stream is the one plain decoding commits, for
greedy and sampled decoding, through one code path. A draft source is deterministic (a one-hot proposal), so
speculative rejection sampling reduces to: sample every verified row with the full sampler pipeline, conditioned on
the hypothetical prefix; accept while the sample equals the draft token; the first mismatching sample is the
correction token (distributed as the target's), and when the whole draft matches, the last row's sample is a free
bonus token. Token ids are compared, never probabilities; temperature <= 0 makes the same path an argmax.

Per step (`SpeculativeDecoder.step`):

  1. the cost gate may veto speculation (plain step); else the source drafts up to the gate's acceptance-adaptive
     budget, capped so the step never commits past the stop limits;
  2. a draft shorter than `min_draft` runs a plain step (engine.decode_sample_step, the plain loop's own step);
  3. otherwise ONE jitted verify+sample over [carried token, draft...] padded to a verify bucket
     (spec.steps.verify_sample_step): row i is sampled at stream position n + i with history + drafts[:i];
  4. commit the longest matching prefix + the correction/bonus token, cut at an end-of-generation token (not
     committed, as in the plain loop) or at the step's limit: the plain loop would have stopped there, so no row
     past it may be committed or shown to the source. Padded rows are never looked at;
  5. truncate the cache to the committed length (all committed tokens but the newest, which is fed next step),
     push exactly the committed tokens into the penalty history, feed observe (and observe_topk when wanted),
     and give the verify's outcome and cost to the gate.

Invariant between steps: `stream[:n]` holds every committed token (prompt included), the cache holds positions
0..n-2 (the newest token is "carried"), the history window ends with stream[n-1]. A step is atomic: if anything
raises after the verify forward (a hook, the host logic), nothing of that step is committed and the cache is
truncated back (try/finally), so stale rows are never visible.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from fucina_jax import aot, engine, sampling
from fucina_jax.errors import ContextFullError, DraftSourceError
from fucina_jax.generate import Generation, GenerationResult, Timer, check_request
from fucina_jax.index.protocol import DraftSource
from fucina_jax.models import fitted_capacity, truncate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import steps
from fucina_jax.speculative.gate import MAX_DRAFT, CostGate, SpecOptions

__all__ = ["SpecStats", "SpeculativeDecoder", "VerifyRowHook", "generate_speculative"]

# hook(position, row_index, logits): every logits row the sampler consults, pre-penalty, in stream order.
# `position` is the stream index of the token the row picks (the RNG counter), `row_index` the row within its
# verify (0 for plain steps and the first token). Rows past a verify's first mismatch are not passed.
VerifyRowHook = Callable[[int, int, np.ndarray], None]


def _trace_total() -> int:
    return (sum(engine.TRACE_COUNTS.values()) + sum(sampling.TRACE_COUNTS.values()) + sum(steps.TRACE_COUNTS.values())
            + sum(aot.LOADED.values()))


@dataclasses.dataclass
class SpecStats:
    """Counts over decode steps. The first generated token is sampled from the prefill logits and is counted in
    no step (it needs no forward of its own)."""

    steps: int = 0  # decode steps
    verify_steps: int = 0  # steps that ran a batched verify
    fallback_steps: int = 0  # plain steps: no draft, or a draft shorter than min_draft
    disabled_steps: int = 0  # plain steps because the gate (or enabled=False) switched speculation off
    committed: int = 0  # tokens committed by the steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens committed verbatim
    bonus: int = 0  # whole draft accepted: the extra row's free token
    rejected: int = 0  # verifies that ended in a correction token

    @property
    def tok_per_step(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        return (
            f"spec: steps={self.steps} (verify {self.verify_steps}, fallback {self.fallback_steps}, off "
            f"{self.disabled_steps}) committed={self.committed} ({self.tok_per_step:.2f} tok/step) "
            f"drafted={self.drafted} accepted={self.accepted} ({100 * self.acceptance:.1f}% acc) "
            f"bonus={self.bonus} rejected={self.rejected}"
        )


class SpeculativeDecoder:
    """Stateful decode loop over one conversation stream, batch 1; see the module docstring for the algorithm.

    Drive it as: `logits = begin(prompt)`, `bootstrap(logits, stops)`, then `step(limit, stops)` until done; each
    returns (committed ids, stopped), where stopped means an id in `stops` was sampled right after them (it is not
    committed). `limit` (>= 1) caps the ids one step may commit. `clock` (ns, e.g. time.perf_counter_ns) turns on
    the gate's live cost model; `on_verify_row` is the replay-equivalence instrument (VerifyRowHook). `slots` (default
    ctx) is the KV cache's capacity: generate_speculative fits it to prompt + max_tokens (models.fitted_capacity).
    """

    def __init__(
        self,
        model,
        source: DraftSource,
        *,
        sampler: SamplerConfig | None = None,
        ctx: int | None = None,
        options: SpecOptions | None = None,
        clock: Callable[[], int] | None = None,
        on_verify_row: VerifyRowHook | None = None,
        slots: int | None = None,
    ):
        self.model = model
        self.source = source
        self.options = (options or SpecOptions()).validate()
        self.gate = CostGate(self.options)
        self.sampler = (sampler or SamplerConfig()).validate()  # a concrete seed, fixed for the whole run
        self.ctx = int(ctx or model.default_ctx)
        self.slots = min(int(slots or self.ctx), self.ctx)  # KV cache capacity: a one-shot run fits it to its need
        self.clock = clock
        self.on_verify_row = on_verify_row
        self.stats = SpecStats()
        self.wants_topk = bool(getattr(source, "wants_topk", False))
        self._cap = self.sampler.candidate_cap(model.config.n_vocab)
        self._sparams = self.sampler.params()
        self._buf = np.zeros(MAX_DRAFT, np.int32)  # the source drafts into this
        self.stream = np.zeros(self.ctx, np.int32)
        self.n = 0
        self.cache = None
        self.history = None

    # ---- the loop's entry points --------------------------------------------------------------------------

    def begin(self, prompt: Sequence[int]):
        """Prefill the prompt into a fresh cache and show it to the source; returns the logits [1, V] after it."""
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if not 0 < prompt.size < self.ctx:
            raise ContextFullError(
                f"the prompt has {prompt.size} tokens; it needs 1 to {self.ctx - 1} for a context of {self.ctx}"
            )
        self.stream[: prompt.size] = prompt
        self.n = int(prompt.size)
        self.history = sampling.history_from_tokens(prompt.tolist(), self.sampler.history_capacity(self.ctx))
        self.cache = None
        logits, self.cache = self.model.prefill_rows(prompt, self.model.new_cache(self.slots))
        self.slots = min(self.cache.capacity, self.ctx)  # init_cache rounds the capacity up to SLOT_ALIGN
        self._cache_len = self.n  # the prompt's last token is in the cache until the first token is committed
        self.source.observe(prompt)
        return logits

    def bootstrap(self, logits, stops: Iterable[int] = ()) -> tuple[list[int], bool]:
        """Sample the first token from the prefill logits ([1, V], as begin() returns them), exactly as the plain
        loop does."""
        stops = frozenset(stops)
        n0 = self.n
        committed: list[int] = []
        stopped = False
        try:
            if self.on_verify_row is not None:
                self.on_verify_row(n0, 0, np.asarray(logits)[0])
            tok = sampling.sample_rows(
                logits, np.asarray([n0], np.int32), self.history, None, self._sparams, cap=self._cap
            )
            t = int(np.asarray(tok)[0])
            if t in stops:
                stopped = True
            else:
                committed = [t]
                self._commit(committed, tok)
        finally:
            self._settle_cache()
        if committed:
            self.source.observe(np.asarray(committed, np.int32))
        return committed, stopped

    def step(self, limit: int, stops: Iterable[int] = ()) -> tuple[list[int], bool]:
        """One decode step: commits 1..limit ids (0 when the first id sampled is a stop)."""
        if self.cache is None or self.n < 1:
            raise RuntimeError("call begin() (and bootstrap()) before step()")
        if limit < 1:
            raise ValueError(f"limit = {limit}: a step commits at least one token")
        if self.n > self.slots:
            raise ContextFullError(f"the KV cache's {self.slots} slots are full ({self.n} tokens committed)")
        limit = min(limit, self.slots + 1 - self.n)  # a step writes positions n-1 .. n+limit-2 into the cache
        stops = frozenset(stops)
        o = self.options
        st = self.stats
        st.steps += 1
        if not (o.enabled and self.gate.allows()):
            st.disabled_steps += 1
            return self._plain_step(stops)
        # A step commits at most draft + 1 ids; the loop stops after `limit`, so a longer draft is pure waste.
        max_draft = min(o.max_draft, limit - 1)
        if o.adapt_budget:
            max_draft = min(max_draft, self.gate.budget_cap(o.max_draft, o.min_draft))
        d = self._suggest(max_draft) if max_draft >= o.min_draft else 0
        if d < o.min_draft:
            st.fallback_steps += 1
            return self._plain_step(stops)
        return self._verify_step(d, limit, stops)

    # ---- steps --------------------------------------------------------------------------------------------

    def _suggest(self, max_draft: int) -> int:
        context = self.stream[: self.n]
        context.flags.writeable = False  # the contract says sources must not modify it: make that loud
        buf = self._buf[:max_draft]
        n = self.source.suggest(context, buf)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= max_draft:
            raise DraftSourceError(f"the draft source returned length {n!r}; it must be an int in [0, {max_draft}]")
        n = int(n)
        if n:
            ids = buf[:n]
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.model.config.n_vocab:
                raise DraftSourceError(
                    f"the draft source proposed token id {lo if lo < 0 else hi}, outside the vocabulary "
                    f"[0, {self.model.config.n_vocab})"
                )
        return n

    def _plain_step(self, stops: frozenset) -> tuple[list[int], bool]:
        """One token through the plain loop's own fused step (or decode_step + sampler when a hook wants the
        row); its wall time feeds the gate's live cost model."""
        m = self.model
        n0 = self.n
        tok_in = self.stream[n0 - 1 : n0].copy()  # not a view: a jitted step may read host memory it is given
        committed: list[int] = []
        stopped = False
        traced = _trace_total()
        t0 = self.clock() if self.clock else 0
        cache, self.cache = self.cache, None  # donated below
        try:
            if self.on_verify_row is None:
                tok, self.cache, history = engine.decode_sample_step(
                    m.params, tok_in, cache, self.history, self._sparams, m.config, self._cap
                )
                self._cache_len = n0
            else:
                logits, self.cache = engine.decode_step(m.params, tok_in, cache, m.config)
                self._cache_len = n0
                self.on_verify_row(n0, 0, np.asarray(logits[0]))
                tok = sampling.sample_rows(
                    logits, np.asarray([n0], np.int32), self.history, None, self._sparams, cap=self._cap
                )
                history = sampling.push_history(self.history, tok, np.int32(1))
            t = int(np.asarray(tok)[0])
            if self.clock and _trace_total() == traced:
                self.gate.note_plain_ns(self.clock() - t0)
            if t in stops:
                stopped = True
            else:
                committed = [t]
                self.history = history
                self._append(committed)
                self.stats.committed += 1
        finally:
            if self.cache is None:  # the forward itself failed: its input buffer may be gone
                self.cache = cache
            self._settle_cache()
        if committed:
            self.source.observe(np.asarray(committed, np.int32))
        return committed, stopped

    def _verify_step(self, d: int, limit: int, stops: frozenset) -> tuple[list[int], bool]:
        m = self.model
        st = self.stats
        n0 = self.n
        draft = self._buf[:d].copy()
        width = engine.bucket_for(1 + d, engine.VERIFY_BUCKETS)
        toks = np.zeros((1, width), np.int32)  # padding rows hold token 0: computed, never looked at
        toks[0, 0] = self.stream[n0 - 1]
        toks[0, 1 : 1 + d] = draft
        drafts = np.full((width,), -1, np.int32)
        drafts[:d] = draft
        hook = self.on_verify_row
        traced = _trace_total()
        t0 = self.clock() if self.clock else 0
        cache, self.cache = self.cache, None
        try:
            sampled_dev, logits, topk, self.cache = steps.verify_sample_step(
                m.params, toks, drafts, cache, self.history, self._sparams, m.config,
                self._cap, wants_topk=self.wants_topk, with_logits=hook is not None,
            )
        except BaseException:
            self.cache = cache
            raise
        # From here the cache holds `width` unverified rows past n0 - 1: the finally below drops every one that
        # is not committed, on success and on any exception.
        self._cache_len = n0 - 1 + width
        committed: list[int] = []
        stopped = False
        accepted = 0
        try:
            sampled = np.asarray(sampled_dev)
            verify_ns = self.clock() - t0 if self.clock and _trace_total() == traced else None
            rows = np.asarray(logits) if hook is not None else None
            # The accept rule. Row i predicts stream[n0 + i] given stream[:n0] + draft[:i]; its sample is the
            # target's pick for that prefix, so it is committed iff every earlier row matched its draft token.
            for i in range(d + 1):
                if hook is not None:
                    hook(n0 + i, i, rows[i])
                t = int(sampled[i])
                if t in stops:
                    stopped = True  # the plain loop stops on this id without committing it
                    break
                committed.append(t)
                matched = i < d and t == draft[i]
                if not matched:
                    if i < d:
                        st.rejected += 1  # t is the correction token
                    else:
                        st.bonus += 1  # the whole draft matched: row d's sample is free
                    break
                accepted += 1
                if len(committed) >= limit:
                    break  # the plain loop stops here (max_tokens / context)
            if committed:
                # sampled[:len(committed)] == committed: the history gets exactly the committed ids
                self.history = sampling.push_history(self.history, sampled_dev, np.int32(len(committed)))
                self._append(committed)
            st.verify_steps += 1
            st.drafted += d
            st.accepted += accepted
            st.committed += len(committed)
        finally:
            self._settle_cache()
        if committed:
            self.source.observe(np.asarray(committed, np.int32))
            if self.wants_topk:
                # one row per committed id, in order (DraftSource.observe_topk); rejected rows are not passed
                self.source.observe_topk(np.asarray(topk)[: len(committed)])
        # Priced at the bucket's draft slots: padding rows cost as much as draft rows.
        self.gate.record_verify(len(committed), accepted, d, self.gate.verify_cost(width - 1, verify_ns))
        return committed, stopped

    # ---- state --------------------------------------------------------------------------------------------

    def _append(self, ids: list[int]) -> None:
        self.stream[self.n : self.n + len(ids)] = ids
        self.n += len(ids)

    def _commit(self, ids: list[int], dev_ids) -> None:
        self.history = sampling.push_history(self.history, dev_ids, np.int32(len(ids)))
        self._append(ids)

    def _settle_cache(self) -> None:
        """Truncate the cache to the committed stream minus the carried token (O(1), a length update)."""
        if self._cache_len != self.n - 1:
            self.cache = truncate(self.cache, self.n - 1)
            self._cache_len = self.n - 1

    def spec_stats(self) -> dict:
        """The statistics as plain values (GenerationResult.spec / --json)."""
        st = self.stats
        out = dataclasses.asdict(st)
        out.update(
            tok_per_step=round(st.tok_per_step, 4),
            acceptance=round(st.acceptance, 4),
            summary=st.summary(),
            max_draft=self.options.max_draft,
            gate=self.gate.decisions(),
        )
        if hasattr(self.source, "stats"):
            out["sources"] = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s for s in self.source.stats()]
        if hasattr(self.source, "summary"):
            out["sources_summary"] = self.source.summary()
        return out


def check_spec_args(options, sources, clock) -> None:
    """TypeErrors for generate_speculative's and generate_batched's options, draft sources and clock."""
    if options is not None and not isinstance(options, SpecOptions):
        raise TypeError(f"options must be a fucina_jax.speculative.SpecOptions (or None), got {type(options).__name__}: "
                        "e.g. SpecOptions(max_draft=8)")
    for source in sources:
        if source is not None and not all(callable(getattr(source, f, None)) for f in ("suggest", "observe")):
            raise TypeError(f"source must be a draft source (fucina_jax.index.DraftSource, e.g. a "
                            f"SpeculationIndex), got {type(source).__name__}")
    if not isinstance(clock, bool) and clock is not None and not callable(clock):
        raise TypeError(f"clock must be True, False or a function returning nanoseconds, got {type(clock).__name__}")


def reference_ids(model, doc) -> np.ndarray:
    """A reference document as int32 token ids: text is encoded with the model's tokenizer (no BOS), a sequence
    of ids is checked against the vocabulary."""
    if isinstance(doc, str):
        return np.asarray(model.tokenizer.encode(doc, add_special=False), np.int32)
    if isinstance(doc, (bytes, bytearray)):
        raise TypeError("a reference document is text (str) or token ids, got bytes: decode it first")
    if doc is None or isinstance(doc, (int, np.integer)):
        raise TypeError(f"a reference document is text (str) or token ids, got {type(doc).__name__} {doc!r}")
    return model.check_ids(doc)


def generate_speculative(
    model,
    prompt_ids: Iterable[int],
    *,
    max_tokens: int = 128,
    sampler: SamplerConfig | None = None,
    ctx: int | None = None,
    stop_ids: Iterable[int] | None = None,
    source: DraftSource | None = None,
    references: Sequence[str | Sequence[int]] = (),
    options: SpecOptions | None = None,
    clock: bool | Callable[[], int] = True,
) -> Generation:
    """fucina_jax.generate.generate with speculative decoding: the same tokens, stop rules and result, plus
    `result.spec` statistics.

    source: any DraftSource; None builds a fresh SpeculationIndex (conversation SAM + references + recycling).
    references: documents for the index, token ids or text (encoded with the model's tokenizer, no BOS; the
    tokenize-with-the-model's-tokenizer contract of design record section 8). clock: True uses
    time.perf_counter_ns for the gate's live cost model, False prices verifies from the static table only.
    """
    prompt, cfg, ctx, stops = check_request(model, prompt_ids, max_tokens, sampler, ctx, stop_ids)
    check_spec_args(options, [source], clock)
    if isinstance(references, (str, bytes)):
        raise TypeError(f"references must be a list of documents (text or token ids), got a "
                        f"{type(references).__name__}: pass one document as [doc]")
    if source is None:
        from fucina_jax.index import SpeculationIndex

        source = SpeculationIndex(model.config.n_vocab)
    if references:
        if not hasattr(source, "add_reference"):
            raise DraftSourceError(
                f"references need a draft source with add_reference() (e.g. SpeculationIndex); got "
                f"{type(source).__name__}"
            )
        for doc in references:
            source.add_reference(reference_ids(model, doc))
    tick = time.perf_counter_ns if clock is True else (clock or None)
    decoder = SpeculativeDecoder(model, source, sampler=cfg, ctx=ctx, options=options, clock=tick,
                                 slots=fitted_capacity(len(prompt) + max_tokens, ctx))
    gen = Generation(iter(()))
    gen._it = _spec_loop(model, decoder, prompt, max_tokens, ctx, stops, gen)
    gen.decoder = decoder
    return gen


def _spec_loop(model, decoder: SpeculativeDecoder, prompt, max_tokens, ctx, stops, gen: Generation):
    """generate._plain_loop's stop rules, one step (possibly many tokens) at a time."""
    timer = Timer(traces=_trace_total)  # this package's compiled step counts too
    tokens: list[int] = []
    stop = "max_tokens"
    if max_tokens > 0:
        logits = timer.run("prompt", decoder.begin, prompt)
        committed, stopped = timer.run("decode", decoder.bootstrap, logits, stops)
        while True:
            for t in committed:
                tokens.append(t)
                yield t
            if stopped:
                stop = "eog"
                break
            if len(tokens) >= max_tokens:
                break
            if len(prompt) + len(tokens) >= ctx:
                stop = "context"
                break
            limit = min(max_tokens - len(tokens), ctx - len(prompt) - len(tokens))
            committed, stopped = timer.run("decode", decoder.step, limit, stops)
    result = GenerationResult(
        prompt_ids=prompt,
        tokens=tokens,
        text=model.tokenizer.decode(tokens),
        stop_reason=stop,
        prompt_seconds=timer.seconds.get("prompt", 0.0),
        decode_seconds=timer.seconds.get("decode", 0.0),
        compile_seconds=sum(timer.compile.values()),
        seed=decoder.sampler.seed,
        spec=decoder.spec_stats(),
    )
    result._compile_split = dict(timer.compile)
    gen.result = result
