"""Plain decoding (the host loop): prefill the prompt, then one fused decode+sample step per token.

This loop is the reference the speculative decoder is proven against: it commits one token per forward and draws
the token at stream position p from uniform(seed, p) through the full sampler pipeline.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterable, Iterator

import jax.numpy as jnp
import numpy as np

from fucina_jax import aot, engine, sampling
from fucina_jax.checks import is_int
from fucina_jax.errors import ContextFullError
from fucina_jax.model import Model
from fucina_jax.models import fitted_capacity
from fucina_jax.sampling import SamplerConfig

__all__ = ["GenerationResult", "Generation", "generate", "check_request", "Timer"]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # committed generated ids (an end-of-generation token that stopped the run is not included)
    text: str
    stop_reason: str  # "eog" | "max_tokens" | "context"
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    compile_seconds: float = 0.0  # wall time of calls that traced/compiled a new shape (included in the above)
    seed: int | None = None
    spec: dict | None = None  # speculation statistics, when speculation ran

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_gen(self) -> int:
        return len(self.tokens)

    @property
    def prompt_tps(self) -> float:
        t = self.prompt_seconds - self._compile_in("prompt")
        return self.n_prompt / t if t > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        t = self.decode_seconds - self._compile_in("decode")
        return self.n_gen / t if t > 0 else 0.0

    _compile_split: dict = field(default_factory=dict, repr=False)

    def _compile_in(self, phase: str) -> float:
        return self._compile_split.get(phase, 0.0)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d.update(n_prompt=self.n_prompt, n_gen=self.n_gen, prompt_tps=self.prompt_tps, decode_tps=self.decode_tps)
        return d


class Timer:
    """Wall time per phase, with the calls that compiled something (a trace counter moved, or aot loaded a program)
    counted apart."""

    def __init__(self, traces: Callable[[], int] | None = None):
        self.seconds: dict[str, float] = {}
        self.compile: dict[str, float] = {}
        # how many traces happened so far (a change during a call means it compiled something)
        self.traces = traces or (lambda: sum(engine.TRACE_COUNTS.values()) + sum(sampling.TRACE_COUNTS.values())
                                  + sum(aot.LOADED.values()))

    def run(self, phase: str, fn: Callable, *args, **kw):
        """fn(*args, **kw), waited for (JAX dispatches asynchronously: an unblocked phase would bill its compute to
        whichever phase next reads a result)."""
        before = self.traces()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        out = _block(out)
        dt = time.perf_counter() - t0
        self.seconds[phase] = self.seconds.get(phase, 0.0) + dt
        if self.traces() != before:
            self.compile[phase] = self.compile.get(phase, 0.0) + dt
        return out


def _block(out):
    import jax

    return jax.block_until_ready(out)


class Generation:
    """An iterator over committed token ids; `.result` holds the GenerationResult once it is exhausted."""

    def __init__(self, it: Iterator[int]):
        self._it = it
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> int:
        return next(self._it)

    def run(self) -> GenerationResult:
        """Consume the rest and return the result."""
        for _ in self:
            pass
        return self.result


def check_request(model, prompt_ids, max_tokens: int, sampler, ctx, stop_ids):
    """Validate one generation request (shared by plain and speculative decoding, so both refuse the same input
    with the same errors). Returns (prompt ids, validated SamplerConfig, ctx, stop ids)."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a fucina_jax Model (fucina_jax.load(path)), got {type(model).__name__}")
    prompt = model.check_ids(prompt_ids).tolist()
    if not is_int(max_tokens):
        raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__} {max_tokens!r}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens = {max_tokens} is invalid: it must be >= 0")
    if not prompt:
        raise ValueError("the prompt is empty: at least one token (e.g. BOS) is needed to start generating")
    cfg = sampling.validated_config(sampler)
    ctx = model.check_ctx(ctx)
    if len(prompt) >= ctx:
        raise ContextFullError(
            f"the prompt has {len(prompt)} tokens but the context holds {ctx}: use a larger --ctx (max "
            f"{model.config.context_length}) or a shorter prompt"
        )
    if stop_ids is None:
        return prompt, cfg, ctx, frozenset(model.tokenizer.eog_ids)
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
        raise TypeError(f"stop_ids must be a collection of token ids (ints), got {type(stop_ids).__name__}")
    stop_ids = list(stop_ids)
    V = model.config.n_vocab
    bad = [t for t in stop_ids if not is_int(t) or not 0 <= t < V]
    if bad:
        raise ValueError(f"stop_ids {bad} are not token ids of this model (0..{V - 1})")
    return prompt, cfg, ctx, frozenset(int(t) for t in stop_ids)


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
    prompt, cfg, ctx, stops = check_request(model, prompt_ids, max_tokens, sampler, ctx, stop_ids)
    gen = Generation(iter(()))
    gen._it = _plain_loop(model, prompt, max_tokens, cfg, ctx, stops, gen)
    return gen


def _plain_loop(model, prompt, max_tokens, cfg: SamplerConfig, ctx, stops, gen: Generation):
    timer = Timer()
    cap = cfg.candidate_cap(model.config.n_vocab)
    history = sampling.history_from_tokens(prompt, cfg.history_capacity(ctx))
    sparams = cfg.params()
    cache = model.new_cache(fitted_capacity(len(prompt) + max_tokens, ctx))
    tokens: list[int] = []
    stop = "max_tokens"
    if max_tokens > 0:
        logits, cache = timer.run("prompt", model.prefill_rows, prompt, cache)
        tok = timer.run(
            "decode", sampling.sample_rows, logits, np.asarray([len(prompt)], np.int32), history, None,
            sparams, cap=cap,
        )
        history = sampling.push_history(history, tok, np.int32(1))
        while True:
            t = int(np.asarray(tok)[0])
            if t in stops:
                stop = "eog"
                break
            tokens.append(t)
            yield t
            if len(tokens) >= max_tokens:
                break
            if len(prompt) + len(tokens) >= ctx:
                stop = "context"
                break
            tok, cache, history = timer.run(
                "decode", engine.decode_sample_step, model.params, tok, cache, history, sparams, model.config, cap
            )
    result = GenerationResult(
        prompt_ids=prompt,
        tokens=tokens,
        text=model.tokenizer.decode(tokens),
        stop_reason=stop,
        prompt_seconds=timer.seconds.get("prompt", 0.0),
        decode_seconds=timer.seconds.get("decode", 0.0),
        compile_seconds=sum(timer.compile.values()),
        seed=cfg.seed,
    )
    result._compile_split = dict(timer.compile)
    gen.result = result
