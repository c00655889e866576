"""The one decoder: B rows (conversations) over one KV cache, each decoded plainly or speculatively.

Every driver runs on it: `generate` (B = 1, speculation off), `generate_speculative` (B = 1), `generate_batched`
(B rows) and `chat.Conversation` (B = 1, its stream carried across turns). Plain decoding is this decoder with
speculation off: the same step, one token wide.

The losslessness contract (design record section 2): the committed stream is the one plain decoding commits, for
greedy and sampled decoding, through one code path. A draft source is deterministic (a one-hot proposal), so
speculative rejection sampling reduces to the accept rule (`accept`, below): sample every verified row with the
full sampler pipeline, conditioned on its hypothetical prefix; accept while the sample equals the draft token; the
first mismatching sample is the correction token (distributed as the target's), and when the whole draft matches,
the last row's sample is a free bonus token. Token ids are compared, never probabilities; temperature <= 0 makes
the same path an argmax.

One step (`Decoder.step`):

  1. the cost gate may veto speculation (every row steps plainly); else each active row drafts from its own source
     up to the gate's acceptance-adaptive budget, capped so the row never commits past its limit; a draft shorter
     than `min_draft` is dropped;
  2. ONE fused forward + sampler over tokens [B, k] (engine.decode_sample_step): row b = [its carried token, its
     draft..., padding], k the step width of the longest draft (k = 1: a plain step). Row (b, i) is sampled at
     row b's stream position n_b + i with its history + draft[:i] (the counter-based RNG keys on (seed, position));
  3. each row commits what `accept` keeps, cut at a stop id (not committed, as plain decoding stops on it) or at
     its limit: plain decoding would have stopped there, so no row past it is committed or shown to the source;
  4. the committed ids enter the row's stream and (fused into the next step) its penalty history, its source
     observes them (and their top-K rows when it wants them), and the gate gets the step's outcome and cost.

The invariant, held here and nowhere else: between steps row b's stream[:n] is committed (prompt included), its
cache holds positions 0..n-2 (the newest token is "carried": it is the next step's first input) and its history
window ends with stream[n-1]. No truncate call keeps it: each step passes `start = n - 1` per row and the step
rewinds the cache to it first, so rows a step wrote past what it committed (rejected drafts) are stale and never
visible. A step is atomic: if anything raises before its commit (a hook, a bad draft, the forward), nothing of it
is committed.

Stop reasons, one vocabulary across the API, the CLI's --json and chat: STOP (an end-of-generation or stop id was
sampled), MAX_TOKENS, CONTEXT (the context is full); the chat driver adds STOP_SEQUENCE and INTERRUPTED.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Container, Iterable, Sequence

import jax
import numpy as np

from fucina_jax import aot, engine, sampling
from fucina_jax.checks import is_int
from fucina_jax.errors import ContextFullError, DraftSourceError
from fucina_jax.index.protocol import DraftSource
from fucina_jax.models import truncate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative.economics import AcceptanceModel, choose_width
from fucina_jax.speculative.gate import MAX_DRAFT, CostGate, SpecOptions

__all__ = [
    "STOP",
    "STOP_SEQUENCE",
    "MAX_TOKENS",
    "CONTEXT",
    "INTERRUPTED",
    "STOP_REASONS",
    "Decoder",
    "Outcome",
    "Request",
    "Row",
    "SpecStats",
    "VerifyRowHook",
    "accept",
    "accept_tree",
    "check_request",
]

STOP = "stop"  # an end-of-generation or stop id was sampled (it is not committed)
STOP_SEQUENCE = "stop_sequence"  # the reply text reached a stop sequence (chat)
MAX_TOKENS = "max_tokens"
CONTEXT = "context"  # the context (or the cache) is full
INTERRUPTED = "interrupted"  # KeyboardInterrupt, an error, or the consumer closed the stream (chat)
STOP_REASONS = (STOP, STOP_SEQUENCE, MAX_TOKENS, CONTEXT, INTERRUPTED)

# hook(position, row_index, logits): every logits row the sampler consults, pre-penalty, in stream order.
# `position` is the stream index of the token the row picks (the RNG counter), `row_index` the row within its
# verify (0 for plain steps and the first token). Rows past a verify's first mismatch are not passed. B = 1 only.
VerifyRowHook = Callable[[int, int, np.ndarray], None]


# ---- the accept rule ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Outcome:
    """What one row commits in one step (a value: nothing changes one after it is made; not frozen, since a frozen
    dataclass's __init__ costs twice as much, and every row of every step makes one)."""

    committed: tuple[int, ...]
    stopped: bool  # a stop id was sampled right after `committed` (not committed)
    drafted: int  # draft tokens verified (0: a plain step); a tree's: its nodes
    accepted: int  # draft tokens committed verbatim
    # A tree verify (accept_tree): the step rows of the accepted path, the root first (accepted + 1 of them; row j of
    # it holds the logits after committed[:j]), and whether it ends at a leaf. Empty for a chain, whose path is
    # rows 0 .. accepted.
    path: tuple[int, ...] = ()
    leaf: bool = False

    @property
    def rejected(self) -> bool:
        """The verify ended in a correction token (a sample that differed from its draft token)."""
        if self.path:
            return not self.stopped and not self.leaf and self.accepted < len(self.committed)
        return not self.stopped and self.accepted < min(len(self.committed), self.drafted)

    @property
    def bonus(self) -> bool:
        """The whole draft matched: the row after it gave a free token (a tree: the path reached a leaf)."""
        if self.path:
            return self.leaf and len(self.committed) == self.accepted + 1
        return self.drafted > 0 and len(self.committed) == self.drafted + 1

    @property
    def rows(self) -> tuple[int, ...]:
        """The step rows whose samples were committed, in stream order (their logits produced `committed`)."""
        return self.path[: len(self.committed)] if self.path else tuple(range(len(self.committed)))


def accept(sampled: Sequence[int], draft: Sequence[int], stops: Container[int], limit: int) -> Outcome:
    """The accept rule of one row's step: sampled[i] is the target's pick for the prefix stream + draft[:i] (row i
    of the verify, drawn at its own stream position), draft the d tokens verified (empty for a plain step),
    sampled at least d + 1 long.

    Row i's sample is committed iff every earlier row's sample equalled its draft token: then the prefix row i is
    conditioned on is the committed stream, and its sample is exactly what plain decoding draws there. So: walk
    the rows in order, commit each sample, and go on to the next row only while the sample equals the row's draft
    token (accepted); the first sample that differs is the correction token, and when all d match, row d's sample
    is the bonus token. A stop id ends the walk before it is committed (plain decoding stops on it), and so does
    `limit` (>= 1) after that many ids (plain decoding stops at max_tokens or a full context).
    """
    committed: list[int] = []
    d = len(draft)
    # Python ints, not NumPy scalars: every step of every row runs this walk
    sampled = sampled.tolist() if isinstance(sampled, np.ndarray) else sampled
    draft = draft.tolist() if isinstance(draft, np.ndarray) else draft
    for i in range(d + 1):
        t = int(sampled[i])
        if t in stops:
            return Outcome(tuple(committed), True, d, i)  # rows 0..i-1 all matched
        committed.append(t)
        if i == d or t != draft[i]:
            return Outcome(tuple(committed), False, d, i)  # bonus (i == d) or correction
        if len(committed) >= limit:
            return Outcome(tuple(committed), False, d, i + 1)
    raise AssertionError("unreachable: the walk ends at row d")


def accept_tree(sampled: Sequence[int], tokens: Sequence[int], parents: Sequence[int], stops: Container[int],
                limit: int) -> Outcome:
    """The accept rule over a tree verify: rows 0..m (tokens[0] the carried token, the root; parents[t] < t the
    row row t hangs from, parents[0] ignored), sampled[t] the target's pick after row t's path (its own stream
    position, its path's penalties).

    Walk from the root: commit the current row's sample; follow the first child whose token equals it (that child's
    path is then the committed stream, so its sample is what plain decoding draws next); no such child makes the
    sample the correction token, and a leaf's sample is the bonus. A stop id ends the walk before it is committed,
    and so does `limit` after that many ids, as in `accept` (a chain is the tree parents[t] = t - 1, with the same
    outcome). Only the accepted path is committed; every other row is discarded unread."""
    m = len(tokens) - 1
    children: dict[int, list[int]] = {}
    for t in range(1, m + 1):
        children.setdefault(int(parents[t]), []).append(t)
    committed: list[int] = []
    path = [0]
    node = 0
    while True:
        t = int(sampled[node])
        if t in stops:
            return Outcome(tuple(committed), True, m, len(path) - 1, tuple(path), node not in children)
        committed.append(t)
        nxt = next((c for c in children.get(node, ()) if int(tokens[c]) == t), None)
        if nxt is None:
            return Outcome(tuple(committed), False, m, len(path) - 1, tuple(path), node not in children)
        path.append(nxt)
        node = nxt
        if len(committed) >= limit:
            return Outcome(tuple(committed), False, m, len(path) - 1, tuple(path), False)


@dataclasses.dataclass
class SpecStats:
    """Counts over one row's decode steps. The first generated token is sampled from the prefill logits and is
    counted in no step (it needs no forward of its own)."""

    steps: int = 0  # decode steps
    verify_steps: int = 0  # steps that verified a draft
    fallback_steps: int = 0  # plain steps while speculation was on: no draft, or one shorter than min_draft
    disabled_steps: int = 0  # plain steps because the gate (or enabled=False) switched speculation off
    committed: int = 0  # tokens committed by the steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens committed verbatim
    bonus: int = 0  # whole draft accepted: the extra row's free token
    rejected: int = 0  # verifies that ended in a correction token

    def record(self, o: Outcome) -> None:
        self.committed += len(o.committed)
        if o.drafted:
            self.verify_steps += 1
            self.drafted += o.drafted
            self.accepted += o.accepted
            self.bonus += o.bonus
            self.rejected += o.rejected

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


# ---- requests and rows --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One validated generation request (check_request builds it)."""

    prompt: tuple[int, ...]  # token ids, BOS included
    max_tokens: int  # generated tokens at most
    sampler: SamplerConfig  # validated: a concrete seed
    stops: frozenset[int]  # ids that end the generation when sampled (not committed)
    source: DraftSource | None = None  # the row's drafts; None: it never drafts


def check_request(model, prompt_ids, max_tokens: int, sampler, ctx, stop_ids) -> tuple[Request, int]:
    """Validate one generation request (every driver refuses the same input with the same errors). Returns the
    Request (without a source) and the context size."""
    if not all(hasattr(model, a) for a in ("params", "config", "check_ids", "check_ctx")):
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
        stops = frozenset(model.tokenizer.eog_ids)
    else:
        if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
            raise TypeError(f"stop_ids must be a collection of token ids (ints), got {type(stop_ids).__name__}")
        stop_ids = list(stop_ids)
        V = model.config.n_vocab
        bad = [t for t in stop_ids if not is_int(t) or not 0 <= t < V]
        if bad:
            raise ValueError(f"stop_ids {bad} are not token ids of this model (0..{V - 1})")
        stops = frozenset(int(t) for t in stop_ids)
    return Request(tuple(prompt), int(max_tokens), cfg, stops), ctx


@dataclasses.dataclass(eq=False)
class Row:
    """One conversation inside the decoder: its committed stream and what decodes it."""

    stream: np.ndarray  # int32 [ctx]: stream[:n] is committed, prompt included
    n: int
    first: int  # stream[first:n] is what this request generated (first = its prompt's length)
    max_tokens: int
    sampler: SamplerConfig
    stops: frozenset[int]
    source: DraftSource | None
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    reused: int = 0  # prompt ids the row found in the cache when it started (a chat's earlier turns)
    finish: str | None = None  # why the row stopped (a STOP_REASONS value); None while it decodes
    context: np.ndarray = dataclasses.field(init=False, repr=False)  # a read-only view of stream (the sources')

    def __post_init__(self) -> None:
        self.context = self.stream.view()
        self.context.flags.writeable = False  # the contract says sources must not modify it: make that loud

    @property
    def generated(self) -> list[int]:
        return self.stream[self.first : self.n].tolist()

    @property
    def active(self) -> bool:
        return self.finish is None


# ---- the decoder --------------------------------------------------------------------------------------------------


class Decoder:
    """B rows decoded in lockstep over one KV cache; see the module docstring.

    Drive it as: `logits = begin(requests)` (prefill), `first(logits)` (each new row's first token), then
    `step()` while any row is active. `first` and `step` return one Outcome per row (None for a row that did not
    take part); a row that is done has `finish` set. `begin(..., keep=...)` and `rewind` continue a row's stream
    across chat turns; `release` frees a row.

    ctx: token positions per row (default: the model's). capacity: KV cache slots per row (default ctx; a one-shot
    run fits it to prompt + max_tokens, models.fitted_capacity). options: the speculation knobs and gate policy
    (enabled=False: plain decoding). clock (ns, e.g. time.perf_counter_ns) turns on the gate's live cost model.
    on_verify_row: the replay-equivalence instrument (VerifyRowHook), B = 1 only. steps: where the compiled steps
    come from (prefill, prepare_prefill, sample_step, decode_sample_step, decode_sample_rows_step with engine's
    signatures): engine itself, or speculative.replay's oracle, which answers from a recorded plain run.
    background_compile (with a clock): verify only at widths whose program is in, preparing the others in the
    background (_ready): for a long-lived decoder, the server's.
    """

    def __init__(
        self,
        model,
        batch: int = 1,
        *,
        ctx: int | None = None,
        capacity: int | None = None,
        options: SpecOptions | None = None,
        clock: Callable[[], int] | None = None,
        on_verify_row: VerifyRowHook | None = None,
        steps=engine,
        background_compile: bool = False,
    ):
        if not is_int(batch) or batch < 1:
            raise ValueError(f"batch = {batch!r}: at least one row is needed")
        if on_verify_row is not None and batch != 1:
            raise ValueError("on_verify_row instruments one row: use batch = 1")
        self.model = model
        self.steps = steps
        self.background_compile = background_compile
        self.B = int(batch)
        self.ctx = model.check_ctx(ctx)
        self.capacity = min(int(capacity or self.ctx), self.ctx)
        self.options = (options or SpecOptions()).validate()
        self.gate = CostGate(self.options)  # the cost model (both policies) and the "gate" policy's on/off state
        self.acceptance = AcceptanceModel()  # the "economics" policy's evidence
        self.widths: dict[int, int] = {}  # steps per chosen width ("economics")
        # width -> [timed steps, their whole wall time in ns] ("economics" with a clock; steps that compiled are not
        # timed): what a step of each width cost live, host work included (spec_stats' step_ms)
        self.step_times: dict[int, list[int]] = {}
        self.tree_steps = 0  # verifies that ran as a tree ("economics" with tree_siblings)
        self.clock = clock
        self.on_verify_row = on_verify_row
        self.rows: list[Row | None] = [None] * self.B
        self.cache = None
        self.history = None  # sampling.History, tokens [B, W], count [B]
        self._pushed = None  # the last step's samples [B, N] (device) and how many of each row's were committed:
        self._n_pushed = np.zeros(self.B, np.int32)  # the next step pushes them into the history, fused
        self._sparams = None  # SamplerParams with [B] leaves
        # the sampler's static candidate cap: one that serves every row (SamplerConfig.candidate_cap, widen_cap)
        self._cap = sampling.GREEDY_UNPENALIZED
        self._window = 0  # the history window: the longest any row needs (each row cuts it to its own)
        self._buf = np.zeros(MAX_DRAFT, np.int32)  # sources draft into this
        self._buf_views = [self._buf[:n] for n in range(MAX_DRAFT + 1)]  # its first n slots (kept: a slice costs)
        self._blanks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (rows, width) -> (toks, drafts)
        self._program_keys: dict = {}  # (rows, width, ...) -> the step program's key, for _ready
        self._fresh = [False] * self.B  # rows begun whose first token first() has not sampled yet
        # the row whose draft source raised in the last step() (None: none did); with a source failing in
        # suggest() nothing of the step ran, in observe() every row's commit stands
        self.failed_row: int | None = None

    # ---- starting rows ------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return any(r is not None and r.active for r in self.rows)

    def begin(self, requests: Sequence[Request | None], keep: Sequence[int] | None = None) -> jax.Array:
        """Start row b on requests[b] (None leaves row b as it is): prefill every new prompt together and show each
        to its row's source. keep[b] (a chat's next turn) is how many leading ids of the prompt equal row b's
        committed stream: the cache keeps those and only the rest is prefilled, the row's statistics go on, and its
        source is shown nothing (the chat driver syncs it). Returns the logits [B, V] after each new prompt
        (first() samples from them)."""
        if len(requests) != self.B or (keep is not None and len(keep) != self.B):
            raise ValueError(f"{len(requests)} requests for a decoder of {self.B} rows")
        alive = self.cache_alive()
        if not alive:
            self.cache = None  # donated to a step that never returned: every row is prefilled again
        prompts: list[np.ndarray | None] = [None] * self.B
        lengths: dict[int, int] = {}
        for b, req in enumerate(requests):
            if req is None:
                continue
            p = np.asarray(req.prompt, np.int32).reshape(-1)
            if not 0 < p.size < self.ctx:
                raise ContextFullError(
                    f"the prompt has {p.size} tokens but the context holds {self.ctx}: use a larger --ctx, or a "
                    "shorter prompt (in a chat: start a new conversation, /reset in the REPL)")
            old = self.rows[b]
            # the invariant: the cache holds stream[:n-1]; keep at least one id to prefill (its logits pick the
            # first token)
            cached = max(old.n - 1, 0) if keep is not None and old is not None and alive else 0
            c = min(int(keep[b]), cached, p.size - 1) if cached else 0
            prompts[b] = p[c:]
            lengths[b] = c
            stream = old.stream if c else np.zeros(self.ctx, np.int32)
            stats = old.stats if keep is not None and old is not None else SpecStats()
            # Until the prefill is done only stream[:c] is known to be in the cache: should it fail, the invariant
            # holds with the committed stream cut there (the next start prefills the rest again).
            self.rows[b] = Row(stream, c + 1 if c else 0, c, req.max_tokens, req.sampler, req.stops, req.source,
                               stats, reused=c)
        if self.cache is not None:
            self.cache = _truncated_rows(self.cache, lengths)
        logits = self._prefill([None if p is None else p for p in prompts])
        for b, req in enumerate(requests):
            if req is not None:
                row = self.rows[b]
                row.stream[: len(req.prompt)] = req.prompt
                row.n = row.first = len(req.prompt)
        self._rows_changed()
        if keep is None:
            for b, req in enumerate(requests):
                if req is not None and req.source is not None:
                    req.source.observe(np.asarray(req.prompt, np.int32))
        self._fresh = [req is not None for req in requests]
        return logits

    def rewind(self, b: int, n: int) -> None:
        """Drop row b's committed tokens past n (its cache follows by the invariant: the next step starts there)."""
        row = self.rows[b]
        if n < row.n:
            row.n = max(int(n), 0)
            self._rows_changed()

    def stop(self, b: int, reason: str) -> None:
        """End row b's decoding from outside (a stop string in its text, a client gone): it takes no further step;
        its stream and cache stay, so a later begin(..., keep=...) can reuse them."""
        row = self.rows[b]
        if row is not None and row.finish is None:
            row.finish = reason

    def release(self, b: int) -> None:
        """Free row b (its slot in the cache rides along, unread, until a request takes it)."""
        self.rows[b] = None

    def first(self, logits: jax.Array) -> list[Outcome | None]:
        """Sample each new row's first token from its prefill logits ([B, V], as begin() returns them),
        exactly as plain decoding does."""
        fresh = [b for b in range(self.B) if self._fresh[b]]
        self._fresh = [False] * self.B
        positions = np.asarray([r.n if r is not None else 0 for r in self.rows], np.int32)
        if self.on_verify_row is not None:
            self.on_verify_row(int(positions[0]), 0, np.asarray(logits)[0])
        sampled_dev = self.steps.sample_step(logits, positions, self.history, self._sparams, self._cap)
        sampled = np.asarray(sampled_dev)
        out: list[Outcome | None] = [None] * self.B
        n_new = np.zeros(self.B, np.int32)
        for b in fresh:
            row = self.rows[b]
            o = accept(sampled[b], (), row.stops, 1)
            self._commit(row, o, count=False)
            n_new[b] = len(o.committed)
            out[b] = o
        self._pushed, self._n_pushed = sampled_dev, n_new
        for b in fresh:
            self._observe(self.rows[b], out[b], None)
        return out

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[Outcome | None]:
        """One step of every active row: each commits 1..limit ids (0 when its first sample is a stop)."""
        if self.cache is None:
            raise RuntimeError("call begin() (and first()) before step()")
        rows = self.rows
        active = [b for b in range(self.B) if rows[b] is not None and rows[b].finish is None]
        if not active:
            raise RuntimeError("no row is active: every one has finished or been released")
        o = self.options
        gate = self.gate
        self.failed_row = None
        # With a clock, the gate needs the plain step's time before it can price a verify: step plainly until one
        # plain step ran without compiling.
        calibrating = self.clock is not None and gate.plain_samples == 0
        economics = o.policy == "economics"
        # the economics price whole steps: the drafts, the weighing, the forward and feeding the sources
        t_begin = self.clock() if self.clock and economics else 0
        speculate = o.enabled and not calibrating and (economics or gate.allows())
        budget = o.max_draft
        if speculate and o.adapt_budget and not economics:
            budget = min(budget, gate.budget_cap(o.max_draft, o.min_draft))
        min_draft = 1 if economics else o.min_draft  # the economics weigh every draft length themselves
        limits = {}
        drafts = {}
        siblings = {}  # b -> [(token, evidence key)]: alternatives to its draft's first token (a tree verify)
        for b in active:
            row = rows[b]
            row.stats.steps += 1
            limits[b] = limit = self._limit(row)
            d = 0
            max_draft = min(budget, limit - 1)
            if speculate and row.source is not None and max_draft >= min_draft:
                self.failed_row = b  # a source that raises fails the step before anything runs
                d = self._suggest(b, row, max_draft)
                if d < min_draft:
                    d = 0
                if d and economics and o.tree_siblings and max_draft >= 2:
                    siblings[b] = self._siblings(b, row, o.tree_siblings)
                self.failed_row = None
            if d:
                drafts[b] = self._buf[:d].copy()
        keys = {}
        chosen = 0
        # b -> (tokens [m], parent rows [m] (0: the root), its chain's nodes in it, the step row of the chain's first
        # node or -1) of a row verified as a tree
        trees = {}
        firsts = {b: int(x[0]) for b, x in drafts.items()} if drafts else {}  # each draft's first, before any cut
        # The step's rows: every cache row, or (a batch with rows not decoding) only the active ones, padded to a
        # row bucket with other rows, which are computed and never looked at (engine.decode_sample_rows_step).
        n_step = engine.row_bucket(len(active), self.B) if self.B > 1 else 1
        if economics and drafts:
            chosen, drafts, keys, shadow, trees = self._weigh(active, n_step, drafts, siblings, limits)
        else:
            shadow = {}
        for b in active:
            if not o.enabled or not (speculate or calibrating):
                rows[b].stats.disabled_steps += 1
            elif b not in drafts:
                rows[b].stats.fallback_steps += 1
        # the economics' width (a ready program's: the drafts may be shorter), else the longest draft's bucket
        width = chosen or engine.bucket_for(1 + max((len(x) for x in drafts.values()), default=0), engine.STEP_WIDTHS)
        order = list(range(self.B)) if n_step == self.B else \
            active + [b for b in range(self.B) if b not in active][: n_step - len(active)]
        at = {b: i for i, b in enumerate(order)}
        blank = self._blanks.get((n_step, width))
        if blank is None:
            blank = self._blanks[(n_step, width)] = (np.zeros((n_step, width), np.int32),
                                                     np.full((n_step, width), -1, np.int32))
        toks = blank[0].copy()  # padding holds token 0: computed, never looked at
        dr = blank[1].copy()  # (copies of kept blanks: np.full costs ~10x a copy)
        start = np.zeros(n_step, np.int32)
        for i, b in enumerate(order):
            row = rows[b]
            if row is not None and row.n:
                start[i] = row.n - 1
                toks[i, 0] = row.stream[row.n - 1]
        for b, x in drafts.items():
            toks[at[b], 1 : 1 + x.size] = x
            dr[at[b], : x.size] = x
        parents = None
        if trees:  # every row's rows as a tree: chains as chains, the tree rows with their own parents
            parents = np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32), (n_step, width)).copy()
            for b, (tt, pp, _, _) in trees.items():
                toks[at[b], 1 : 1 + tt.size] = tt
                parents[at[b], 1 : 1 + pp.size] = pp
        hook = self.on_verify_row
        wants_topk = width > 1 and any(getattr(rows[b].source, "wants_topk", False) for b in drafts)
        events = aot.events()
        t0 = self.clock() if self.clock else 0
        cache, self.cache = self.cache, None  # donated below
        try:
            fn, args, kwargs = self._step_call(toks, dr, order, start, cache, wants_topk, parents)
            sampled_dev, self.history, logits, topk, self.cache = fn(*args, **kwargs)
        except BaseException:
            self.cache = cache  # the forward failed: its input may still be whole (cache_alive tells)
            raise
        self._n_pushed = np.zeros(self.B, np.int32)  # pushed: until this step commits, nothing is pending
        sampled = np.asarray(sampled_dev)
        picks = sampled.tolist()  # every row's samples as Python ints, in one call
        out: list[Outcome | None] = [None] * self.B
        for b in active:
            if b in trees:
                m = trees[b][0].size
                out[b] = accept_tree(picks[at[b]], toks[at[b], : m + 1], parents[at[b], : m + 1], rows[b].stops,
                                     limits[b])
            else:
                out[b] = accept(picks[at[b]], drafts.get(b, ()), rows[b].stops, limits[b])
        if trees:
            self._compact(out, order, start)
        step_ns = self.clock() - t0 if self.clock and aot.events() == events else None
        if hook is not None:  # before anything is committed: a hook that raises leaves the step uncommitted
            rows_np = np.asarray(logits)[0]
            o0 = out[0]
            consulted = o0.path or range(len(o0.committed) + o0.stopped)
            for i, r in enumerate(consulted[: len(o0.committed) + o0.stopped]):
                hook(rows[0].n + i, i, rows_np[r])
        n_new = np.zeros(self.B, np.int32)
        for b in active:
            self._commit(rows[b], out[b])
            n_new[b] = len(out[b].committed)
        if trees:  # the committed ids are the samples of each row's path, not of its first rows: push those
            self._pushed = np.full((self.B, sampled.shape[1]), -1, np.int32)
            for b in active:
                self._pushed[b, : len(out[b].committed)] = out[b].committed
        elif n_step == self.B:
            self._pushed = sampled_dev
        else:  # the next step pushes from every cache row's samples: these rows' from the host copy
            self._pushed = np.full((self.B, sampled.shape[1]), -1, np.int32)
            self._pushed[order] = sampled
        self._n_pushed = n_new
        if economics:
            for b, key in keys.items():  # what the verified drafts earned; unverified ones, their first token
                if b in trees:  # the chain's part of the tree; below its first node only chain nodes hang
                    _, _, n_chain, first_row = trees[b]
                    followed = first_row > 0 and out[b].path[1:2] == (first_row,)
                    if n_chain:
                        self.acceptance.record(key, n_chain, out[b].accepted if followed else 0)
                    else:
                        self.acceptance.record(key, 1, int(bool(out[b].committed) and
                                                           out[b].committed[0] == firsts[b]))
                else:
                    self.acceptance.record(key, out[b].drafted, out[b].accepted)
            for b, (key, first) in shadow.items():
                self.acceptance.record(key, 1, int(bool(out[b].committed) and out[b].committed[0] == first))
            for b, sibs in siblings.items():  # every alternative offered, verified or not: was it the next token?
                for tok, key in sibs:
                    self.acceptance.record(key, 1, int(bool(out[b].committed) and out[b].committed[0] == tok))
            timed = step_ns is not None
        else:
            self._price(width, active, out, step_ns)
        # streams, lengths and histories are settled: a source raising below leaves the decoder consistent
        topk_rows = np.asarray(topk) if topk is not None else None
        failure = None
        for b in active:  # every row's source is fed even when another's raises; the first error is raised after
            try:
                self._observe(rows[b], out[b], None if topk_rows is None or b not in drafts else
                              topk_rows[at[b]][list(out[b].rows)])
            except Exception as e:
                if failure is None:
                    failure, self.failed_row = e, b
        if failure is not None:
            raise failure
        if economics and timed:
            whole_ns = self.clock() - t_begin  # a step that compiled was not timed (step_ns)
            tally = self.step_times.get(width)
            if tally is None:
                tally = self.step_times[width] = [0, 0]
            tally[0] += 1
            tally[1] += whole_ns
            if width > 1:
                gate.note_step(width, n_step, whole_ns)
            else:
                gate.note_plain_ns(whole_ns, rows=n_step)
        return out

    # ---- internals ----------------------------------------------------------------------------------------

    def _step_call(self, toks, dr, order, start, cache, wants_topk: bool, parents=None):
        """(the compiled step, its arguments, its keywords) of a step over tokens [n, width] of the cache rows
        `order`: every row's step (n = B), or the rows step over n of them; parents [n, width]: a tree verify."""
        kwargs = dict(wants_topk=wants_topk, with_logits=self.on_verify_row is not None)
        if parents is not None:
            dr = engine.TreeDraft(parents)
        tail = (cache, self.history, self._pushed, self._n_pushed, self._sparams, self.model.config, self._cap)
        if len(order) == self.B:
            return self.steps.decode_sample_step, (self.model.params, toks, dr, start, *tail), kwargs
        return (self.steps.decode_sample_rows_step,
                (self.model.params, toks, dr, np.asarray(order, np.int32), start, *tail), kwargs)

    def prepare_steps(self) -> int:
        """Bring in (load, or compile) the step program of every row count this decoder may step (each row bucket up
        to B) at every width, verifies with the recycling feedback (the default draft source's), with the current
        sampler cap and history window; returns how many were not in the process yet. A server calls it at start-up
        (`--warmup-all`) so that no verify width is ever first used under load. Call after begin()."""
        if self.cache is None or self.history is None:
            raise RuntimeError("call begin() first: the step programs are keyed on the cache and sampler state")
        brought = 0
        for n_step in sorted({engine.row_bucket(k, self.B) for k in range(1, self.B + 1)}):
            for width, tree in [(w, False) for w in engine.STEP_WIDTHS] + \
                    [(w, True) for w in engine.VERIFY_BUCKETS if self.options.tree_siblings]:
                fn, key, args, kwargs = self._program(n_step, width, width > 1, tree)
                if key is not None and fn.has(key):
                    continue
                fn.prepare(*args, **kwargs)
                brought += 1
        return brought

    def _ready(self, n_step: int, width: int, wants_topk: bool, tree: bool = False) -> bool:
        """Whether the step program of (n_step rows, width) is in the process. A live decoder (one with a clock, on
        the engine's steps) verifies only at widths whose program is: one that is not is brought in by the
        background preparer (aot.PREPARER) while the rows step at other widths, so no request waits for the
        compiler because a verify width came up for the first time. Only with background_compile (the server's
        long-lived decoder): a one-shot run on a cold process would spend its few hundred steps plainly while its
        programs compile beside it, so it compiles a width inline at its first use, excluded from the rates; and
        without a clock (the tests, a replay) every width is ready."""
        if self._all_ready():
            return True
        sig = (n_step, width, wants_topk, tree, self._cap, self._window, self.cache.capacity)
        known = self._program_keys.get(sig)
        if known is None:
            known = self._program_keys[sig] = self._program(n_step, width, wants_topk, tree)[:2]
        fn, key = known
        if key is None or fn.has(key):
            return True
        aot.PREPARER.submit(*self._program(n_step, width, wants_topk, tree))
        return False

    def _all_ready(self) -> bool:
        """Every step program counts as ready (see _ready): no background compiles, no clock, or other steps."""
        return not self.background_compile or self.clock is None or self.steps is not engine

    def _program(self, n_step: int, width: int, wants_topk: bool, tree: bool = False):
        """(the step, its program key, its arguments, its keywords) of a step of (n_step rows, width) (a tree
        verify's with tree) over the current cache and sampler state, the token arrays as shapes (for Step.prepare
        and Step.has)."""
        spec = jax.ShapeDtypeStruct((n_step, width), np.int32)
        fn, args, kwargs = self._step_call(spec, spec, list(range(n_step)), np.zeros(n_step, np.int32), self.cache,
                                           wants_topk, spec if tree else None)
        key = fn.program_key(*args, **kwargs) if hasattr(fn, "program_key") else None
        return fn, key, args, kwargs

    def _limit(self, row: Row) -> int:
        """The most ids the row may commit this step: its token budget, the context, and the cache (a step writes
        positions n-1 .. n+limit-2)."""
        return min(row.max_tokens - (row.n - row.first), self.ctx - row.n, self.cache.capacity + 1 - row.n)

    def _commit(self, row: Row, o: Outcome, count: bool = True) -> None:
        """Append the outcome to the row's stream, count it in the row's statistics (a step's; not the first token)
        and decide whether the row is done: the stop rules, here only."""
        k = len(o.committed)
        if k:
            if k == 1:  # a scalar store costs a fraction of a sequence's (NumPy converts the tuple first)
                row.stream[row.n] = o.committed[0]
            else:
                row.stream[row.n : row.n + k] = o.committed
            row.n += k
        if count:
            row.stats.record(o)
        if o.stopped:
            row.finish = STOP
        elif row.n - row.first >= row.max_tokens:
            row.finish = MAX_TOKENS
        elif row.n >= min(self.ctx, self.cache.capacity + 1):
            row.finish = CONTEXT

    def _observe(self, row: Row, o: Outcome, topk_rows) -> None:
        src = row.source
        if src is None or not o.committed:
            return
        src.observe(row.context[row.n - len(o.committed) : row.n])  # committed: the stream's newest ids
        if topk_rows is not None and getattr(src, "wants_topk", False):
            # one row per committed id, in order (DraftSource.observe_topk); rejected rows are not passed
            src.observe_topk(topk_rows[: len(o.committed)])

    def _weigh(self, active: list[int], n_step: int, drafts: dict, siblings: dict, limits: dict):
        """The "economics" policy: the step width with the best expected tokens per unit of measured time for these
        drafts (speculative/economics.py), among the widths whose program is ready (_ready). Returns (that width,
        the drafts cut to it, each verified row's evidence key, for each row whose draft is not verified (key,
        its first token): the step still shows whether it was right, and the rows verified as trees).

        A row with siblings (alternatives to its draft's first token) offers a tree: its chain's nodes, with
        P(node) = the chain's cumulative acceptance, and each sibling as a leaf under the root, with P = its key's
        first-token acceptance. A step of width w verifies each row's w - 1 likeliest nodes (a node is never
        likelier than its parent, so they form a tree), which is worth 1 + the sum of their P: the chain's value
        when the likeliest nodes are its first ones, so a chain stays a chain."""
        keys = {}
        ranked = []  # per active row: its nodes' P, best first (what choose_width weighs)
        nodes = {}  # b -> (its candidates best first, their tokens, their parents (-1: the root)) for a tree row
        for b in active:
            if b not in drafts:
                ranked.append(())
                continue
            src = self.rows[b].source
            keys[b] = src.evidence() if callable(getattr(src, "evidence", None)) else "draft"
            x = drafts[b]
            p = self.acceptance.cumulative(keys[b])[: len(x)]
            sibs = siblings.get(b, ())
            if not sibs:
                ranked.append(p)
                continue
            toks = np.concatenate([x, np.asarray([t for t, _ in sibs], np.int32)])
            par = np.concatenate([np.arange(-1, len(x) - 1), np.full(len(sibs), -1)]).astype(np.int32)
            prob = np.concatenate([p, [self.acceptance.cumulative(k)[0] for _, k in sibs]])
            order = sorted(range(len(toks)), key=lambda i: (-prob[i], i))[: max(limits[b] - 1, 0)]
            nodes[b] = (order, toks, par)
            ranked.append(prob[order])
        wants_topk = any(getattr(self.rows[b].source, "wants_topk", False) for b in drafts)
        if self._all_ready():
            widths = engine.STEP_WIDTHS
        else:
            widths = [w for w in engine.STEP_WIDTHS if w == 1 or self._ready(n_step, w, wants_topk)]
        width, value = choose_width(ranked, widths, lambda w: self.gate.step_cost(w, n_step),
                                    self.options.min_gain)
        self.widths[width] = self.widths.get(width, 0) + 1
        if width == 1:
            return 1, {}, {}, {b: (keys[b], int(x[0])) for b, x in drafts.items()}, {}
        trees = {}
        cut = {b: x[: width - 1] for b, x in drafts.items()}
        for b, (order, toks, par) in nodes.items():
            chosen = order[: width - 1]
            if chosen == list(range(len(chosen))):  # the chain's first nodes: a chain
                cut[b] = toks[: len(chosen)]
                continue
            row_of = {g: 1 + i for i, g in enumerate(chosen)}  # candidate -> its step row
            n_chain = sum(g < len(drafts[b]) for g in chosen)  # the chain's first n_chain tokens are in the tree
            trees[b] = (toks[chosen], np.asarray([0 if par[g] < 0 else row_of[par[g]] for g in chosen], np.int32),
                        n_chain, row_of.get(0, -1))
            cut[b] = drafts[b][:n_chain]
        if trees and not self._ready(n_step, width, wants_topk, tree=True):
            trees = {}  # the tree program is not in yet (a server's warm-up): chains meanwhile
        if trees:
            self.tree_steps += 1
        return width, cut, keys, {}, trees

    def _siblings(self, b: int, row: Row, k: int) -> list[tuple[int, object]]:
        """The row's source's alternatives to its draft's first token (DraftSource.siblings), checked."""
        fn = getattr(row.source, "siblings", None)
        if not callable(fn):
            return []
        sibs = list(fn(k))[:k]
        V = self.model.config.n_vocab
        first = int(self._buf[0])
        out, seen = [], {first}
        who = "the draft source" if self.B == 1 else f"the draft source of row {b}"
        for item in sibs:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise DraftSourceError(f"{who} offered sibling {item!r}: siblings(k) must give (token, key) pairs")
            tok, key = item
            if not is_int(tok) or not 0 <= tok < V:
                raise DraftSourceError(f"{who} offered sibling {tok!r}, outside the vocabulary [0, {V})")
            if int(tok) not in seen:  # a duplicate would be verified twice for nothing
                seen.add(int(tok))
                out.append((int(tok), key))
        return out

    def _compact(self, out: list, order: list[int], start: np.ndarray) -> None:
        """After a tree verify: move each row's accepted path into the slots plain decoding keeps it in
        (engine.compact_step), where it is not already there (a path along rows 1, 2, ...: a chain's)."""
        moves = np.full((self.B, engine.COMPACT_SLOTS), -1, np.int32)
        starts = np.zeros(self.B, np.int32)
        needed = False
        for i, b in enumerate(order):
            o = out[b]
            if o is None or not o.path:
                continue
            nodes = o.path[1:]
            if list(nodes) != list(range(1, len(nodes) + 1)):
                moves[b, : len(nodes)] = nodes
                starts[b] = start[i]
                needed = True
        if needed:
            cache, self.cache = self.cache, None
            try:
                self.cache = self.steps.compact_step(cache, starts, moves)
            except BaseException:
                self.cache = cache
                raise

    def _price(self, width: int, active: list[int], out: list, step_ns) -> None:
        """Feed the step's outcome and cost to the gate: a plain step's time, or a verify's tokens and cost."""
        if width == 1:
            if step_ns is not None:
                self.gate.note_plain_ns(step_ns)
            return
        cost = self.gate.verify_cost(width - 1, step_ns, rows=len(active))
        self.gate.record_verify(sum(len(out[b].committed) for b in active), sum(out[b].accepted for b in active),
                                sum(out[b].drafted for b in active), cost)

    def _suggest(self, b: int, row: Row, max_draft: int) -> int:
        n = row.source.suggest(row.context[: row.n], self._buf_views[max_draft])
        who = "the draft source" if self.B == 1 else f"the draft source of row {b}"
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= max_draft:
            raise DraftSourceError(f"{who} returned length {n!r}; it must be an int in [0, {max_draft}]")
        n = int(n)
        if n:
            ids = self._buf[:n].tolist()  # at most max_draft ids: list min/max beat two NumPy reductions
            lo, hi = min(ids), max(ids)
            V = self.model.config.n_vocab
            if lo < 0 or hi >= V:
                raise DraftSourceError(f"{who} proposed token id {lo if lo < 0 else hi}, outside the vocabulary "
                                       f"[0, {V})")
        return n

    def _rows_changed(self) -> None:
        """Rows were started or rewound: rebuild every row's sampler values and history window from the
        host streams (nothing left pending), widening the static cap and window if a row needs more."""
        V = self.model.config.n_vocab
        samplers = [r.sampler for r in self.rows if r is not None]
        self._cap = functools.reduce(sampling.widen_cap, (s.candidate_cap(V) for s in samplers), self._cap)
        self._window = max([self._window, *(s.history_capacity(self.ctx) for s in samplers)])
        # a free row rides along with another row's sampler values
        self._sparams = _stack([(r.sampler if r is not None else samplers[0]).params() for r in self.rows])
        self.history = _stack([sampling.history_from_tokens(r.stream[: r.n].tolist() if r else [], self._window)
                               for r in self.rows])
        self._pushed = jax.device_put(np.full((self.B, engine.STEP_WIDTHS[-1]), -1, np.int32))
        self._n_pushed = np.zeros(self.B, np.int32)

    def prepare(self, requests: Sequence[Request | None]) -> None:
        """Bring in (load from the persistent store, or compile) the prefill programs begin(requests) will run,
        without running them, so the prefill can be timed on its own (the cache is allocated here if need be)."""
        if self.cache is None:
            self.cache = self.model.new_cache(self.capacity, self.B)
        prompts = [None if r is None else np.asarray(r.prompt, np.int32) for r in requests]
        self.steps.prepare_prefill(self.model.params, self.model.config, prompts, self.cache)

    def _prefill(self, prompts: list[np.ndarray | None]) -> jax.Array:
        if self.cache is None:
            self.cache = self.model.new_cache(self.capacity, self.B)
        cache, self.cache = self.cache, None
        logits, self.cache = self.steps.prefill(self.model.params, self.model.config, prompts, cache)
        return logits

    def state(self):
        """(History, KVCache) as the next step sees them: every row's penalty window with the last step's commits
        pushed, and the cache with each row's length at its committed stream minus the carried token. For
        inspection, and for callers that take a row's state out (eager ops: not for the hot path)."""
        history = engine.push_rows(self.history, self._pushed, np.asarray(self._n_pushed))
        lengths = {b: max(r.n - 1, 0) for b, r in enumerate(self.rows) if r is not None}
        return history, _truncated_rows(self.cache, lengths)

    def cache_alive(self) -> bool:
        """False when the cache's buffers were donated to a step that never returned (an interrupt): the rows'
        streams are intact but must be prefilled again."""
        return self.cache is not None and not any(getattr(x, "is_deleted", lambda: False)()
                                                  for x in jax.tree_util.tree_leaves(self.cache))

    def spec_stats(self, b: int = 0) -> dict:
        """Row b's statistics as plain values (GenerationResult.spec / --json)."""
        row = self.rows[b]
        st = row.stats
        out = dataclasses.asdict(st)
        out.update(tok_per_step=round(st.tok_per_step, 4), acceptance=round(st.acceptance, 4), summary=st.summary(),
                   max_draft=self.options.max_draft, policy=self.options.policy, gate=self.gate.decisions())
        if self.options.policy == "economics":
            out["widths"] = {str(w): n for w, n in sorted(self.widths.items())}
            out["step_ms"] = {str(w): [n, round(ns / 1e6, 3)] for w, (n, ns) in sorted(self.step_times.items())}
            if self.options.tree_siblings:
                out["tree_steps"] = self.tree_steps
            out["evidence"] = self.acceptance.snapshot()
        if self.B > 1:
            out["batch"] = self.B
        src = row.source
        if src is not None and hasattr(src, "stats"):
            out["sources"] = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s for s in src.stats()]
        if src is not None and hasattr(src, "summary"):
            out["sources_summary"] = src.summary()
        return out


def _stack(trees):
    """Host pytrees stacked along a new leading axis, placed on the device in one transfer."""
    return jax.device_put(jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees))


def _truncated_rows(cache, lengths: dict[int, int]):
    """The cache with row b's length set to lengths[b] (prefill appends there; a step passes its own starts)."""
    new = np.asarray(cache.length).copy()
    for b, n in lengths.items():
        new[b] = n
    return truncate(cache, new)
