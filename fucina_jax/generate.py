"""The one-shot drivers: `generate` (plain), `generate_speculative` and `generate_batched`, thin loops over the one
decoder (fucina_jax.decoder), with their results built in one place.

Plain decoding is the decoder with speculation off: it commits one token per forward and draws the token at
stream position p from uniform(seed, p) through the full sampler pipeline, the reference the speculative runs are
proven against. A speculative run commits exactly the same tokens, fewer forwards apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import jax
import numpy as np

from fucina_jax import aot
from fucina_jax.decoder import Decoder, Request, check_request
from fucina_jax.index.protocol import DraftSource
from fucina_jax.models import fitted_capacity
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative.gate import SpecOptions
from fucina_jax.speculative.sources import default_source, finish_request

__all__ = ["GenerationResult", "Generation", "generate", "generate_speculative", "generate_batched", "Timer"]

_PLAIN = SpecOptions(enabled=False)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # committed generated ids (a stop id that ended the run is not included)
    text: str
    stop_reason: str  # decoder.STOP | MAX_TOKENS | CONTEXT
    prompt_seconds: float = 0.0  # the prefill's wall time, without loading or compiling its programs
    decode_seconds: float = 0.0
    compile_seconds: float = 0.0  # loading or compiling the prefill's programs, plus the calls that traced or loaded
    #                               one (the first decode steps)
    seed: int | None = None
    spec: dict | None = None  # speculation statistics, when speculation ran
    _compile_split: dict = field(default_factory=dict, repr=False)  # phase -> its calls that compiled something

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_gen(self) -> int:
        return len(self.tokens)

    @property
    def prompt_tps(self) -> float:
        t = self.prompt_seconds - self._compile_split.get("prompt", 0.0)
        return self.n_prompt / t if t > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        t = self.decode_seconds - self._compile_split.get("decode", 0.0)
        return self.n_gen / t if t > 0 else 0.0

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d.update(n_prompt=self.n_prompt, n_gen=self.n_gen, prompt_tps=self.prompt_tps, decode_tps=self.decode_tps)
        return d


class Timer:
    """Wall time per phase; a call during which a program was traced or loaded (aot.events() moved) counts in
    `compile` too, so rates can leave it out."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.compile: dict[str, float] = {}

    def run(self, phase: str, fn: Callable, *args, **kw):
        """fn(*args, **kw), waited for (JAX dispatches asynchronously: an unblocked phase would bill its compute to
        whichever phase next reads a result)."""
        before = aot.events()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        dt = time.perf_counter() - t0
        self.seconds[phase] = self.seconds.get(phase, 0.0) + dt
        if aot.events() != before:
            self.compile[phase] = self.compile.get(phase, 0.0) + dt
        return out


class Generation:
    """An iterator over committed token ids; `.result` holds the GenerationResult once it is exhausted, and
    `.decoder` the decoder that produced them."""

    def __init__(self, steps: Iterator[int], decoder: Decoder):
        self._steps = steps  # a generator that returns the GenerationResult
        self.decoder = decoder
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> int:
        try:
            return next(self._steps)
        except StopIteration as done:
            if done.value is not None:
                self.result = done.value
            raise

    def run(self) -> GenerationResult:
        """Consume the rest and return the result."""
        for _ in self:
            pass
        return self.result


def _drive(decoder: Decoder, requests: Sequence[Request], speculative: bool = True):
    """The loop every one-shot driver runs: start every request, step until each row is done, yield (row, ids) as
    they are committed, and return one GenerationResult per request (with the speculation statistics when
    `speculative`). A row's decode time is the wall time of the steps it took part in (in a batch it shares
    them)."""
    B = len(requests)
    timer = Timer()
    decode_s = np.zeros(B)
    compile_s = np.zeros(B)
    todo = [r.max_tokens > 0 for r in requests]
    if any(todo):
        starting = [r if t else None for r, t in zip(requests, todo)]
        timer.run("load", decoder.prepare, starting)  # the prefill's programs: the prompt's rate leaves them out
        logits = timer.run("prompt", decoder.begin, starting)
        step = decoder.first
        args = (logits,)
        while decoder.active:
            taking_part = np.array([r is not None and r.active for r in decoder.rows])
            before = aot.events()
            t0 = time.perf_counter()
            outcomes = step(*args)  # each step ends in reading its samples on the host: the work is done
            dt = time.perf_counter() - t0
            decode_s[taking_part] += dt
            if aot.events() != before:
                compile_s[taking_part] += dt
            for b, o in enumerate(outcomes):
                if o is not None and o.committed:
                    yield b, o.committed
            step, args = decoder.step, ()
    for row in decoder.rows:  # each request's output joins the model's draft memory (index.persist)
        if row is not None and row.source is not None:
            finish_request(decoder.model, row.source)
    tokenizer = decoder.model.tokenizer
    results = []
    for b, req in enumerate(requests):
        row = decoder.rows[b]
        tokens = row.generated if row is not None else []
        results.append(GenerationResult(
            prompt_ids=list(req.prompt), tokens=tokens, text=tokenizer.decode(tokens),
            stop_reason=row.finish if row is not None else "max_tokens",
            prompt_seconds=timer.seconds.get("prompt", 0.0), decode_seconds=float(decode_s[b]),
            compile_seconds=timer.compile.get("load", 0.0) + timer.compile.get("prompt", 0.0) + float(compile_s[b]),
            seed=req.sampler.seed,
            spec=decoder.spec_stats(b) if row is not None and speculative else None,
            _compile_split={"prompt": timer.compile.get("prompt", 0.0), "decode": float(compile_s[b])},
        ))
    return results


def _one(steps):
    """_drive for one row: yield its ids one by one, return its result."""
    while True:
        try:
            _, ids = next(steps)
        except StopIteration as done:
            return done.value[0]
        yield from ids


def _clock(clock) -> Callable[[], int] | None:
    return time.perf_counter_ns if clock is True else (clock or None)


def check_spec_args(options, sources, clock) -> None:
    """TypeErrors for the speculative drivers' options, draft sources and clock."""
    if options is not None and not isinstance(options, SpecOptions):
        raise TypeError(f"options must be a fucina_jax.speculative.SpecOptions (or None), got "
                        f"{type(options).__name__}: e.g. SpecOptions(max_draft=8)")
    for source in sources:
        if source is not None and not all(callable(getattr(source, f, None)) for f in ("suggest", "observe")):
            raise TypeError(f"source must be a draft source (fucina_jax.index.DraftSource, e.g. a "
                            f"SpeculationIndex), got {type(source).__name__}")
    if not isinstance(clock, bool) and clock is not None and not callable(clock):
        raise TypeError(f"clock must be True, False or a function returning nanoseconds, got {type(clock).__name__}")


def generate(
    model,
    prompt_ids: Iterable[int],
    *,
    max_tokens: int = 128,
    sampler: SamplerConfig | None = None,
    ctx: int | None = None,
    stop_ids: Iterable[int] | None = None,
) -> Generation:
    """Plain decoding of up to max_tokens tokens after prompt_ids (which must include any BOS)."""
    req, ctx = check_request(model, prompt_ids, max_tokens, sampler, ctx, stop_ids)
    dec = Decoder(model, ctx=ctx, capacity=fitted_capacity(len(req.prompt) + max_tokens, ctx), options=_PLAIN)
    return Generation(_one(_drive(dec, [req], speculative=False)), dec)


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
    persist: bool = True,
) -> Generation:
    """generate with speculative decoding: the same tokens, stop rules and result, plus `result.spec` statistics.

    source: any DraftSource; None builds a fresh SpeculationIndex (conversation SAM + references + past outputs +
    recycling) over the model's draft memory, shared by the process and kept on disk (persist=False or
    FUCINA_JAX_NO_PERSIST=1: a private one). references: documents for the index, token ids or text (encoded with
    the model's tokenizer, no BOS). clock: True uses time.perf_counter_ns for the live cost model, False prices
    verifies from the static table.
    """
    req, ctx = check_request(model, prompt_ids, max_tokens, sampler, ctx, stop_ids)
    check_spec_args(options, [source], clock)
    req = replace(req, source=default_source(model, source, references, persist=persist))
    dec = Decoder(model, ctx=ctx, capacity=fitted_capacity(len(req.prompt) + max_tokens, ctx),
                  options=options or SpecOptions(), clock=_clock(clock))
    return Generation(_one(_drive(dec, [req])), dec)


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
    persist: bool = True,
) -> list[GenerationResult]:
    """Decode every prompt (token ids, BOS included) as its own conversation, all in one batch; returns one
    GenerationResult per prompt, each with the tokens `generate` gives for that prompt alone.

    max_tokens, sampler, stop_ids: one value for all rows or a list with one per row (stop_ids None: the model's
    end-of-generation ids; a list of ints is one stop set for all rows). sources: one DraftSource (or None: no
    drafts) per row; sources=None gives each row a fresh SpeculationIndex over the model's draft memory (persist:
as in generate_speculative). options.enabled=False decodes plainly
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
    ctx = checked[0][1]
    if sources is None:
        sources = [default_source(model, persist=persist) for _ in range(B)]
    elif len(sources) != B:
        raise ValueError(f"batch = {B} rows but {len(sources)} sources: give one per row")
    requests = [replace(req, source=src) for (req, _), src in zip(checked, sources)]
    dec = Decoder(model, B, ctx=ctx, options=options or SpecOptions(), clock=_clock(clock))
    steps = _drive(dec, requests)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
