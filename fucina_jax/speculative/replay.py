"""The replay harness: record a plain run once, then replay any speculation policy offline, in seconds.

Losslessness makes this exact. Speculative decoding commits the stream plain decoding commits, and a verify row
whose prefix is the committed stream samples what plain decoding sampled at that position (the counter-based RNG
keys on the position; penalties see the same history). So a recorded plain run answers every question a verify
asks: row j of a verify at stream position n samples `recorded[n + j]` as long as the draft before it matched, and
the accept rule never looks past the first row that did not. The recycling matrix's feedback is the same: the
top-K of each recorded position's raw logits (engine.feedback_topk), which is what a verify row computes there.

`record(model, prompt, ...)` runs plain decoding and keeps every sampled id (the stop id too) and its top-K. A
Recording saves to and loads from one .npz file.
`replay(recordings, sources=..., options=...)` runs the real `Decoder` (its drafting, its economics, its gate, its
accept rule: nothing is re-implemented) on `OracleSteps`, which stands in for the compiled steps and answers from
the recordings, under a virtual clock that advances each step by the cost model's price of its (rows, width): the
policy sees the measured cost curve, not this machine's noise. The replayed streams are checked against the
recordings (a mismatch raises: the harness would be wrong). The same recordings replayed with speculation off
give the plain time, so `Replay.speedup` is the predicted decode speed-up at that cost curve.

No weights are needed to replay: a recording carries the vocabulary size, and the decoder runs on a stand-in model
whose cache holds no K/V.

`replay(..., hindsight=True)` is the policy's ceiling for the same drafts: each draft source is wrapped so that its
evidence is how much of the draft the recording says will be accepted, and whether each tree sibling is the next
token (`Hindsight`), and the decoder's acceptance model takes that as certain (`HindsightModel`): every step picks
the width a perfect predictor would, at the cost curve. What the real policy gets against it is what better
prediction could still win; the rest needs better drafts or cheaper verify rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from fucina_jax import engine
from fucina_jax.decoder import STOP, Decoder, Request, check_request
from fucina_jax.index.protocol import DraftSource
from fucina_jax.models.cache import KVCache
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative.economics import MAX_DEPTH, AcceptanceModel
from fucina_jax.speculative.gate import CostGate, SpecOptions

__all__ = ["Recording", "Replay", "OracleSteps", "Hindsight", "HindsightModel", "record", "replay", "cost_model"]

FORMAT = "fucina_jax.recording"
PLAIN_NS = 10_000_000  # the virtual clock's one-row plain step (10 ms); only ratios matter


@dataclasses.dataclass(frozen=True, eq=False)
class Recording:
    """One plain run: `sampled[i]` is the id sampled at stream position len(prompt) + i (the last one is the stop id
    when finish == "stop": sampled, not committed), `topk[i]` the top-K ids of that position's raw logits."""

    prompt: np.ndarray  # int32 [P]
    sampled: np.ndarray  # int32 [N]
    topk: np.ndarray  # int32 [N, K]
    finish: str
    max_tokens: int
    stops: frozenset[int]
    n_vocab: int
    ctx: int

    @property
    def generated(self) -> np.ndarray:
        """The committed ids (the stop id excluded)."""
        return self.sampled[:-1] if self.finish == STOP else self.sampled

    def save(self, path: str | os.PathLike) -> None:
        meta = dict(format=FORMAT, finish=self.finish, max_tokens=self.max_tokens, stops=sorted(self.stops),
                    n_vocab=self.n_vocab, ctx=self.ctx)
        with open(path, "wb") as f:
            np.savez(f, prompt=self.prompt, sampled=self.sampled, topk=self.topk, meta=np.asarray(json.dumps(meta)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Recording:
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != FORMAT:
                    raise ValueError(f"format {meta.get('format')!r}")
                return cls(z["prompt"].astype(np.int32), z["sampled"].astype(np.int32), z["topk"].astype(np.int32),
                           meta["finish"], int(meta["max_tokens"]), frozenset(meta["stops"]), int(meta["n_vocab"]),
                           int(meta["ctx"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{os.fspath(path)} is not a fucina_jax recording ({e})") from None


def record(model, prompt_ids, *, max_tokens: int = 128, sampler: SamplerConfig | None = None,
           stop_ids=None, ctx: int | None = None) -> Recording:
    """Decode `prompt_ids` plainly and keep every sampled id (the stop id too) and its top-K: the decoder runs on
    `_RecordingSteps`, the engine's own steps with the top-K feedback asked of every step."""
    request, ctx = check_request(model, prompt_ids, max_tokens, sampler, ctx, stop_ids)
    steps = _RecordingSteps()
    dec = Decoder(model, 1, ctx=ctx, options=SpecOptions(enabled=False), steps=steps)
    dec.first(dec.begin([request]))
    while dec.active:
        dec.step()
    row = dec.rows[0]
    P = len(request.prompt)
    n = row.n - P + (row.finish == STOP)  # a stop id was sampled at position row.n, not committed
    sampled = np.asarray([steps.sampled[P + i] for i in range(n)], np.int32)
    if not np.array_equal(sampled[: row.n - P], row.stream[P: row.n]):
        raise AssertionError("the recorded samples differ from the committed stream")
    return Recording(np.asarray(request.prompt, np.int32), sampled,
                     np.stack([steps.topk[P + i] for i in range(n)]).astype(np.int32).reshape(n, -1), row.finish,
                     request.max_tokens, request.stops, model.config.n_vocab, ctx)


class _RecordingSteps:
    """engine's steps for one row, keeping the id each sampled at each stream position and its top-K."""

    def __init__(self):
        self.sampled: dict[int, int] = {}
        self.topk: dict[int, np.ndarray] = {}
        self._logits = None

    prepare_prefill = staticmethod(engine.prepare_prefill)

    def prefill(self, params, cfg, prompts, cache):
        logits, cache = engine.prefill(params, cfg, prompts, cache)
        self._logits = logits
        return logits, cache

    def sample_step(self, logits, positions, history, sparams, cap):
        out = engine.sample_step(logits, positions, history, sparams, cap)
        p = int(np.asarray(positions)[0])
        self.sampled[p] = int(np.asarray(out)[0, 0])
        self.topk[p] = np.asarray(engine.feedback_topk(logits[:1]))[0]
        return out

    def decode_sample_step(self, params, toks, drafts, start, cache, *rest, wants_topk=False, with_logits=False):
        out = engine.decode_sample_step(params, toks, drafts, start, cache, *rest, wants_topk=True,
                                        with_logits=with_logits)
        sampled, topk = np.asarray(out[0]), np.asarray(out[3])
        p = int(np.asarray(start)[0]) + 1
        for j in range(toks.shape[1]):
            self.sampled.setdefault(p + j, int(sampled[0, j]))
            self.topk.setdefault(p + j, topk[0, j])
        return out[:3] + ((out[3] if wants_topk else None), out[4])


def cost_model(options: SpecOptions = SpecOptions()) -> Callable[[int, int], float]:
    """cost(width, rows): a step's cost in one-row plain steps, from the cost table and its batch surface (what the
    gate prices an unmeasured step at, without the live rescale): the B-row plain step times C_B(width)."""
    gate = CostGate(options)
    plain = {r: c for r, w, c in options.batch_costs if w == 1}

    def cost(width: int, rows: int) -> float:
        base = 1.0 if rows <= 1 else plain.get(rows, gate.single_stream_cost(rows))
        return base * gate.modelled_cost(width, rows)
    return cost


class _StandInModel:
    """What the decoder needs of a model to replay: the vocabulary, the context, a cache without K/V."""

    def __init__(self, n_vocab: int, ctx: int):
        self.config = dataclasses.make_dataclass("Config", [("n_vocab", int)])(n_vocab)
        self.ctx = ctx
        self.params = None
        self.path = "replay"

    def check_ctx(self, ctx):
        return int(ctx or self.ctx)

    def new_cache(self, ctx=None, batch: int = 1) -> KVCache:
        empty = np.zeros((batch, int(ctx or self.ctx), 0, 0), np.float16)
        return KVCache(k=(empty,), v=(empty,), length=np.zeros(batch, np.int32))


class OracleSteps:
    """The compiled steps' stand-in (Decoder(steps=...)): cache row b samples recordings[b]'s ids. Each step moves
    the virtual clock on by cost(width, step rows) plain steps."""

    def __init__(self, recordings: Sequence[Recording], cost: Callable[[int, int], float]):
        self.full = [np.concatenate([r.prompt, r.sampled]) for r in recordings]
        self.topk = [np.concatenate([np.zeros((len(r.prompt), r.topk.shape[1]), np.int32), r.topk])
                     for r in recordings]
        self.cost = cost
        self.now = 0  # virtual ns
        self.steps = 0
        self.compactions = 0

    def clock(self) -> int:
        return self.now

    def _at(self, b: int, positions: np.ndarray) -> np.ndarray:
        full = self.full[b]
        ok = positions < len(full)
        return np.where(ok, full[np.minimum(positions, len(full) - 1)], 0).astype(np.int32)

    def _sampled(self, rows, start, width: int, parents=None):
        # a tree's row is sampled at its depth: a row whose path is the committed stream gets the recorded id there;
        # any other row is never consulted (accept_tree follows only matching children)
        pos = np.asarray(start)[:, None] + 1 + (np.arange(width)[None] if parents is None else _depths(parents))
        out = np.zeros((len(rows), engine.STEP_WIDTHS[-1]), np.int32)
        for i, b in enumerate(rows):
            out[i, :width] = self._at(b, pos[i])
        return out, pos

    def _topk(self, rows, pos):
        return np.stack([self.topk[b][np.minimum(pos[i], len(self.topk[b]) - 1)] for i, b in enumerate(rows)])

    def prepare_prefill(self, params, cfg, prompts, cache) -> None:
        pass

    def prefill(self, params, cfg, prompts, cache):
        return np.zeros((len(prompts), 1), np.float32), cache

    def sample_step(self, logits, positions, history, sparams, cap):
        out = np.zeros((len(positions), engine.STEP_WIDTHS[-1]), np.int32)
        for b, p in enumerate(np.asarray(positions)):
            if b < len(self.full):
                out[b, 0] = self._at(b, np.asarray([p]))[0]
        return out

    def decode_sample_step(self, params, toks, drafts, start, cache, history, pushed, n_pushed, sparams, cfg, cap,
                           wants_topk=False, with_logits=False):
        return self._step(list(range(toks.shape[0])), toks, start, cache, history, wants_topk, drafts)

    def decode_sample_rows_step(self, params, toks, drafts, rows, start, cache, history, pushed, n_pushed, sparams,
                                cfg, cap, wants_topk=False, with_logits=False):
        return self._step([int(b) for b in rows], toks, start, cache, history, wants_topk, drafts)

    def compact_step(self, cache, start, path):
        self.compactions += 1
        return cache

    def _step(self, rows, toks, start, cache, history, wants_topk, drafts):
        width = toks.shape[1]
        parents = drafts.parents if isinstance(drafts, engine.TreeDraft) else None
        live = [b if b < len(self.full) else 0 for b in rows]
        sampled, pos = self._sampled(live, start, width, parents)
        self.now += int(round(self.cost(width, len(rows)) * PLAIN_NS))
        self.steps += 1
        return sampled, history, None, self._topk(live, pos) if wants_topk else None, cache


class Hindsight:
    """A draft source's stand-in that knows the future: it drafts what `inner` drafts, and its evidence is
    ("hindsight", a), a = how many of the draft's tokens the recorded stream `full` (prompt + sampled ids) confirms.
    The inner source's siblings (a tree verify's alternatives to the first token) come keyed ("hindsight-sibling",
    1 if the token is the next one, else 0). Everything else is the inner source's."""

    def __init__(self, inner, full: np.ndarray):
        self.inner = inner
        self.full = full
        self._evidence = ("hindsight", 0)
        self._next = -1  # the recorded token after the context of the latest suggest

    @property
    def wants_topk(self) -> bool:
        return bool(getattr(self.inner, "wants_topk", False))

    def suggest(self, context: np.ndarray, buf: np.ndarray) -> int:
        n = self.inner.suggest(context, buf)
        self._next = int(self.full[len(context)]) if len(context) < len(self.full) else -1
        truth = self.full[len(context): len(context) + n]
        a = 0
        while a < len(truth) and buf[a] == truth[a]:
            a += 1
        self._evidence = ("hindsight", a)
        return n

    def observe(self, committed: np.ndarray) -> None:
        self.inner.observe(committed)

    def observe_topk(self, rows: np.ndarray) -> None:
        self.inner.observe_topk(rows)

    def evidence(self):
        return self._evidence

    def siblings(self, k: int) -> list:
        fn = getattr(self.inner, "siblings", None)
        if not callable(fn):
            return []
        return [(t, ("hindsight-sibling", int(t == self._next))) for t, _ in fn(k)]


class HindsightModel(AcceptanceModel):
    """The acceptance a perfect predictor knows: a ("hindsight", a) draft's first a tokens are accepted, the next is
    not; a ("hindsight-sibling", 1) alternative is the next token, a ("hindsight-sibling", 0) one is not (other keys:
    the ordinary model)."""

    _certain = [[1.0] * a + [0.0] * (MAX_DEPTH - a) for a in range(MAX_DEPTH + 1)]

    def cumulative(self, key):
        if isinstance(key, tuple) and len(key) == 2 and key[0] in ("hindsight", "hindsight-sibling"):
            return self._certain[min(int(key[1]), MAX_DEPTH)]
        return super().cumulative(key)


def _depths(parents: np.ndarray) -> np.ndarray:
    """Each tree row's depth, [n, k], from parents [n, k] (engine.tree_layout's, on the host)."""
    parents = np.asarray(parents)
    depth = np.zeros(parents.shape, np.int64)
    for t in range(1, parents.shape[1]):
        depth[:, t] = depth[np.arange(len(parents)), np.clip(parents[:, t], 0, t - 1)] + 1
    return depth


@dataclasses.dataclass(frozen=True)
class Replay:
    """A replayed run: the virtual decode time (one-row plain steps), the steps, each row's statistics, and the
    same recordings' plain time under the same cost model."""

    time: float
    plain_time: float
    steps: int
    stats: tuple[dict, ...]
    widths: dict[int, int]

    @property
    def speedup(self) -> float:
        return self.plain_time / self.time if self.time else 1.0

    @property
    def tok_per_step(self) -> float:
        return sum(s["committed"] for s in self.stats) / max(sum(s["steps"] for s in self.stats), 1)


def replay(recordings: Sequence[Recording], *, sources: Sequence[DraftSource | None] | None = None,
           options: SpecOptions | None = None, cost: Callable[[int, int], float] | None = None,
           clock: bool = True, hindsight: bool = False) -> Replay:
    """Replay the recordings as one batch (one row each) through the real Decoder on OracleSteps. sources: one
    DraftSource (or None) per recording, e.g. fresh SpeculationIndex objects or warm ones. cost: cost(width, rows)
    in one-row plain steps (default: cost_model(options)). clock=False runs the decoder without a clock (the gate
    and the economics price from the table alone, as a live run without a clock does). hindsight: the same drafts
    (and with tree_siblings, the same alternatives) weighed by a perfect predictor (Hindsight; the "economics"
    policy): the ceiling of better prediction."""
    recordings = list(recordings)
    if not recordings:
        raise ValueError("nothing to replay: give at least one Recording")
    options = options or SpecOptions()
    cost = cost or cost_model(options)
    sources = list(sources) if sources is not None else [None] * len(recordings)
    if len(sources) != len(recordings):
        raise ValueError(f"{len(sources)} sources for {len(recordings)} recordings")
    if hindsight:
        if options.policy != "economics":
            raise ValueError("hindsight weighs the drafts by the economics: use policy='economics'")
        sources = [None if s is None else Hindsight(s, np.concatenate([r.prompt, r.sampled]))
                   for s, r in zip(sources, recordings)]
    spec = _run(recordings, sources, options, cost, clock, hindsight)
    plain = _run(recordings, [None] * len(recordings), SpecOptions(enabled=False), cost, clock)
    return dataclasses.replace(spec, plain_time=plain.time)


def _run(recordings, sources, options, cost, clock, hindsight: bool = False) -> Replay:
    ctx = max(r.ctx for r in recordings)
    model = _StandInModel(max(r.n_vocab for r in recordings), ctx)
    oracle = OracleSteps(recordings, cost)
    dec = Decoder(model, len(recordings), ctx=ctx, options=options, clock=oracle.clock if clock else None,
                  steps=oracle)
    if hindsight:
        dec.acceptance = HindsightModel()
    greedy = SamplerConfig(temperature=0.0)  # the oracle samples; the sampler only sizes the decoder's windows
    requests = [Request(tuple(int(t) for t in r.prompt), r.max_tokens, greedy, r.stops, s)
                for r, s in zip(recordings, sources)]
    dec.first(dec.begin(requests))
    while dec.active:
        dec.step()
    for b, r in enumerate(recordings):
        got = dec.rows[b].generated
        if got != r.generated.tolist() or dec.rows[b].finish != r.finish:
            raise AssertionError(f"replay of row {b} diverged from its recording (finish {dec.rows[b].finish} vs "
                                 f"{r.finish}): the harness is wrong")
    return Replay(time=oracle.now / PLAIN_NS, plain_time=0.0, steps=oracle.steps,
                  stats=tuple(dec.spec_stats(b) for b in range(len(recordings))), widths=dict(dec.widths))
