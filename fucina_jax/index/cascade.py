"""The cascade draft source: conversation SAM -> frozen reference SAMs -> past outputs -> Token-Recycling fallback.

`SpeculationIndex` composes the package's draft sources behind one `DraftSource`:

  1. conversation: an online suffix automaton over every committed token (prompt + generated), fed by
     `observe`;
  2. references: up to 8 frozen suffix automata over caller-tokenized documents (`add_reference`), each
     walked by this conversation's own cursor;
  3. outputs (when an `OutputIndex` is given): the most frequent continuation in the process's past outputs
     (`outputs.py`), walked by this conversation's own matcher; `finish_output()` adds this conversation's
     output to it;
  4. recycling: the top-1 chain of the Token-Recycling matrix, capped at 8 tokens (a private matrix, or one
     shared by the process's conversations: `recycling_matrix=`).

Selection: the longest match among the unmuted index sources wins (ties: conversation, then the
first-added reference, then the outputs: recency in the live stream beats a static document, and a document
the caller chose beats what other requests happened to produce); its budget is beta * (1 + match_len)
tokens, capped by the caller's buffer (the outputs' draft also stops where a continuation occurred fewer
than `outputs_min_count` times or in less than `outputs_min_prob` of its prefix's occurrences). Matches
shorter than `min_match` fall through to recycling; an unseen recycling row drafts 0 and the decoder does a
plain step.

Per-source muting (the source-selection gate; the decoder's cost gate owns the global economics): each
source keeps a rolling window over its last 64 decided draft positions (the accepted tokens and each first
miss: a position past a miss was never tried, and the decoder may verify a cut draft or none of it); when a
full window is below 20% accepted the source sits out the next 128 committed tokens, then is re-probed with a
fresh window. Muted sources
keep observing, so they are in sync when they come back. Acceptance is inferred at the suggest -> observe
seam as the longest common prefix of the draft and the next committed slice: a heuristic for selection
only; what gets committed never depends on it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from fucina_jax.errors import DraftIndexError, IndexPoisonedError
from fucina_jax.index.outputs import OutputIndex
from fucina_jax.index.protocol import match_bucket
from fucina_jax.index.recycling import RecyclingMatrix
from fucina_jax.index.sam import SuffixAutomaton

__all__ = ["CascadePolicy", "SourceStats", "SpeculationIndex"]

_NEVER = 1 << 62  # a committed count no stream reaches
_INT32 = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class CascadePolicy:
    """The cascade's constants (design record section 7); the defaults are the specified values."""

    beta: int = 2  # draft budget = beta * (1 + match_len) tokens
    min_match: int = 2  # shorter index matches fall through to recycling
    recycling_cap: int = 8  # longest recycling chain, tokens
    mute_window: int = 64  # drafted tokens in a source's rolling acceptance window
    mute_below: float = 0.2  # a full window under this acceptance rate mutes the source
    mute_tokens: int = 128  # committed tokens a muted source sits out before its re-probe
    max_references: int = 8  # reference documents per conversation
    outputs_min_count: int = 1  # the outputs' draft stops at a continuation seen fewer times
    # ... or in less than this share of its prefix's occurrences: in 72 recorded greedy SmolLM2 chat replies, a
    # first draft token under a 0.3 share was right 6% of the time, far below what pays for a verify row
    outputs_min_prob: float = 0.3

    def __post_init__(self) -> None:
        if min(self.beta, self.min_match, self.mute_window, self.max_references, self.outputs_min_count) < 1 or \
                self.recycling_cap < 0:
            raise DraftIndexError(f"cascade policy values must be positive: {self}")
        if not 0.0 <= self.mute_below <= 1.0 or self.mute_tokens < 0 or not 0.0 <= self.outputs_min_prob <= 1.0:
            raise DraftIndexError(f"mute_below and outputs_min_prob must be in [0, 1] and mute_tokens >= 0: {self}")


@dataclasses.dataclass(frozen=True)
class SourceStats:
    """Cumulative acceptance of one source: accepted of drafted tokens."""

    name: str
    accepted: int
    drafted: int
    muted: bool
    poisoned: bool = False


class _Source:
    """Accounting for one source: totals, the rolling window, the mute deadline."""

    __slots__ = ("name", "accepted", "drafted", "window", "window_sum", "muted_until", "_keys")

    def __init__(self, name: str, window: int) -> None:
        self.name = name
        self.accepted = 0
        self.drafted = 0
        self.window: collections.deque[int] = collections.deque(maxlen=window)  # 1 accepted, 0 rejected
        self.window_sum = 0
        self.muted_until = -1  # committed-token count at which a muted source is re-probed; -1: not muted
        self._keys: dict[int, str] = {}  # match bucket -> evidence key

    def key(self, match_len: int) -> str:
        """The evidence key of a draft of this source on a match of match_len tokens: "name:bucket"."""
        bucket = match_bucket(match_len)
        key = self._keys.get(bucket)
        if key is None:
            key = self._keys[bucket] = f"{self.name}:{bucket}"
        return key

    @property
    def muted(self) -> bool:
        return self.muted_until >= 0

    def record(self, drafted: int, accepted: int, decided: int, policy: CascadePolicy, n_committed: int) -> None:
        """A draft of `drafted` tokens met the next committed slice: the first `accepted` matched. The window takes
        only the `decided` positions (the accepted ones and the first miss): past a miss a token was never tried,
        and a draft the decoder cut or did not verify (the economics, a plain step) is no evidence against its
        tail."""
        self.drafted += drafted
        self.accepted += accepted
        w = self.window
        for i in range(decided):
            outcome = 1 if i < accepted else 0
            if len(w) == w.maxlen:
                self.window_sum -= w[0]
            w.append(outcome)
            self.window_sum += outcome
        if len(w) == w.maxlen and self.window_sum < policy.mute_below * w.maxlen:
            self.muted_until = n_committed + policy.mute_tokens

    def maybe_reprobe(self, n_committed: int) -> None:
        if 0 <= self.muted_until <= n_committed:
            self.muted_until = -1
            self.window.clear()  # a fresh window: the old verdict must not re-mute it at once
            self.window_sum = 0


class SpeculationIndex:
    """The cascade as one `DraftSource` (see the module docstring for the policy).

    SpeculationIndex(vocab_size, *, policy=CascadePolicy(), recycling=True, max_tokens=None,
    recycling_matrix=None, outputs=None): `vocab_size` bounds token ids and sizes the recycling matrix;
    `recycling=False` drops the fallback (and `wants_topk` becomes False); `max_tokens` caps the conversation
    index (past it the index is poisoned and drafts nothing, the other sources keep working).
    `recycling_matrix` is a RecyclingMatrix to learn into and draft from instead of a fresh private one (shared
    by a process's conversations, loaded by `IndexStore.load_recycling`); `outputs` is an OutputIndex of past
    outputs (shared likewise) to draft from and to feed with `finish_output()`; None leaves that source out.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        policy: CascadePolicy = CascadePolicy(),
        recycling: bool = True,
        max_tokens: int | None = None,
        recycling_matrix: RecyclingMatrix | None = None,
        outputs: OutputIndex | None = None,
    ) -> None:
        if vocab_size <= 0:
            raise DraftIndexError(f"vocab_size must be positive; got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.policy = policy
        for what, shared in (("recycling_matrix", recycling_matrix), ("outputs", outputs)):
            if shared is not None and shared.vocab_size != self.vocab_size:
                raise DraftIndexError(f"{what} has a vocabulary of {shared.vocab_size} tokens, the index "
                                      f"{self.vocab_size}: share state only between indexes of one model")
        if recycling_matrix is not None and not recycling:
            raise DraftIndexError("recycling=False and a recycling_matrix: pass one or the other")
        self._conversation = SuffixAutomaton(max_tokens=max_tokens)
        self._references: list[SuffixAutomaton] = []
        self._cursors = []  # one Cursor per reference, walked over this conversation's stream
        if recycling:
            self._recycling = recycling_matrix if recycling_matrix is not None else RecyclingMatrix(self.vocab_size)
        else:
            self._recycling = None
        self._outputs = outputs
        self._matcher = outputs.matcher(self._tail) if outputs is not None else None
        self._output_start = -1  # stream position where this conversation's output begins; -1: after the prompt
        self._src_conversation = _Source("conversation", policy.mute_window)
        self._src_references: list[_Source] = []
        self._src_outputs = _Source("outputs", policy.mute_window)
        self._src_recycling = _Source("recycling", policy.mute_window)
        self._stream = np.zeros(1024, dtype=np.int32)  # [capacity] committed tokens; the first _n are live
        self._n = 0
        self._last = -1  # the newest committed id (-1: none yet), where the recycling chain starts
        self._slice: tuple[int, list[int]] = (-1, [])  # the latest observed slice (see observe)
        self._reprobe_at = _NEVER  # the earliest committed count at which a muted source is re-probed
        self._pending: tuple[_Source, list[int]] | None = None  # the last draft, awaiting its verdict
        self._evidence = "none"  # what the last draft rests on (evidence())
        self._topk_budget = 0  # rows observe_topk may still take: the size of the latest observed slice

    # ---- DraftSource --------------------------------------------------------------------------------

    @property
    def wants_topk(self) -> bool:
        return self._recycling is not None

    def suggest(self, context: np.ndarray, buf: np.ndarray) -> int:
        """Draft into buf[:n]; returns n. `context` is not read: the committed stream arrives via observe."""
        # Every step of every row runs this right after a forward has streamed the weights through the caches, so
        # each object it touches is a cache miss: it reads plain attributes and builds nothing it can skip.
        self._pending = None
        limit = len(buf)
        if limit <= 0:
            return 0
        p = self.policy
        min_match = p.min_match
        # (match_len, source order, index or cursor, accounting); conversation is order 0
        candidates = None
        src = self._src_conversation
        if src.muted_until < 0:
            length = self._conversation.match_len
            if length >= min_match:
                candidates = [(length, 0, self._conversation, src)]
        if self._cursors:
            for order, (cursor, src) in enumerate(zip(self._cursors, self._src_references), start=1):
                if src.muted_until < 0:
                    length = cursor.match_len
                    if length >= min_match:
                        candidates = (candidates or []) + [(length, order, cursor, src)]
        matcher = self._matcher
        if matcher is not None and self._src_outputs.muted_until < 0:
            length = matcher.match_len
            if length >= min_match:
                candidates = (candidates or []) + [(length, len(self._cursors) + 1, matcher, self._src_outputs)]
        if candidates:
            if len(candidates) > 1:
                candidates.sort(key=lambda c: (-c[0], c[1]))  # longest first; ties keep conversation/add order
            for length, _, index, src in candidates:
                # a reference match that ends its document has no continuation: try the next candidate (and the
                # outputs' draft may stop at once on a weak continuation)
                budget = min(p.beta * (1 + length), limit)
                if index is matcher:
                    n = matcher.draft(buf, budget, min_count=p.outputs_min_count, min_prob=p.outputs_min_prob)
                else:
                    n = index.draft(buf, budget)
                if n > 0:
                    self._pending = (src, buf[:n].tolist())
                    self._evidence = src.key(length)
                    return n
        if self._recycling is not None and self._src_recycling.muted_until < 0 and self._last >= 0:
            n = self._recycling.draft(self._last, buf, min(p.recycling_cap, limit))
            if n > 0:
                self._pending = (self._src_recycling, buf[:n].tolist())
                self._evidence = "recycling"
                return n
        return 0

    def observe(self, committed: np.ndarray) -> None:
        """Feed newly committed tokens to every source (muted ones included) and settle the pending draft."""
        toks, ids = self._checked(committed, "committed tokens")
        k = len(ids)
        n_after = self._n + k
        if self._pending is not None:
            src, draft = self._pending  # draft: a list of ids
            self._pending = None
            m = min(len(draft), k)
            accepted = 0
            while accepted < m and draft[accepted] == ids[accepted]:
                accepted += 1
            src.record(len(draft), accepted, min(accepted + 1, m), self.policy, n_after)
            if 0 <= src.muted_until < self._reprobe_at:
                self._reprobe_at = src.muted_until
        if k:
            if not self._conversation.poisoned:
                try:
                    self._conversation.extend(toks)
                except IndexPoisonedError:
                    pass  # degraded mode: the conversation index drafts nothing from now on
            for cursor in self._cursors:
                cursor.advance(toks)
            if self._matcher is not None:
                self._matcher.observe(toks)
            if self._output_start < 0:  # the first slice observed is the prompt
                self._output_start = n_after
            if self._recycling is not None:
                self._recycling.observe(self._last, ids)
            if n_after > len(self._stream):
                grown = np.zeros(max(2 * len(self._stream), n_after), dtype=np.int32)
                grown[: self._n] = self._stream[: self._n]
                self._stream = grown
            if k == 1:
                self._stream[self._n] = ids[0]
            else:
                self._stream[self._n : n_after] = toks
            self._n = n_after
            self._slice = (self._last, ids)  # (the id before the slice or -1, the slice's ids): observe_topk's
            self._last = ids[-1]
        self._topk_budget = k
        if n_after >= self._reprobe_at:  # a muted source's time is up: re-probe it
            self._reprobe_at = _NEVER
            for src in self._sources():
                src.maybe_reprobe(n_after)
                if 0 <= src.muted_until < self._reprobe_at:
                    self._reprobe_at = src.muted_until

    def observe_topk(self, rows: np.ndarray) -> None:
        """Top-K rows aligned with the last committed tokens (see `DraftSource.observe_topk`)."""
        rows = rows if type(rows) is np.ndarray else np.asarray(rows)
        if rows.dtype is _INT32:  # the decoder's rows: a 2-D array is one whose tolist() is a list of lists of ints
            cand = rows.tolist()
            shaped = type(cand) is list and (type(cand[0]) is list and (not cand[0] or type(cand[0][0]) is int)
                                             if cand else rows.ndim == 2)
        else:
            shaped = rows.ndim == 2 and (rows.size == 0 or rows.dtype.kind in "iu")
            cand = rows.tolist() if shaped else []
        if not shaped:
            raise DraftIndexError(f"top-K rows must be a 2-D integer array [R, K]; got shape {rows.shape}")
        r = len(cand)
        if r > self._topk_budget:
            raise DraftIndexError(
                f"observe_topk got {r} rows but only {self._topk_budget} tokens were committed by the "
                "preceding observe(); pass one row per committed token, right after observe()"
            )
        self._topk_budget = 0
        if r == 0 or self._recycling is None:
            return
        if cand[0]:
            lo, hi = min(map(min, cand)), max(map(max, cand))
            if lo < 0 or hi >= self.vocab_size:
                raise DraftIndexError(f"top-K candidate ids must be in [0, {self.vocab_size}); got {lo}..{hi}")
        # rows[j] produced the j-th of the slice's last r ids; its row is the one of the id before that
        before, ids = self._slice
        seq = [before, *ids]
        k = len(ids)
        prev, nxt = seq[k - r : k], seq[k - r + 1 :]
        if prev[0] < 0:  # the first token of the stream has no predecessor row to update
            prev, nxt, cand = prev[1:], nxt[1:], cand[1:]
        self._recycling.observe_topk(prev, nxt, cand)

    # ---- references and turn trimming ---------------------------------------------------------------

    def add_reference(self, tokens) -> int:
        """Index a reference document (tokenized with the model's own tokenizer); returns its number.

        Its cursor is caught up over the committed stream, so a document injected mid-conversation
        matches the existing context at once.
        """
        if len(self._references) >= self.policy.max_references:
            raise DraftIndexError(
                f"at most {self.policy.max_references} reference documents per conversation; "
                "call clear_references() first"
            )
        toks, _ = self._checked(tokens, "reference tokens")
        if len(toks) == 0:
            raise DraftIndexError("the reference document is empty (did its tokenization fail?)")
        sam = SuffixAutomaton.reference(toks)
        cursor = sam.cursor()
        # The longest suffix of the stream that occurs in the document is at most len(document) long, and
        # a cursor's (state, length) depends only on that matched string, so the tail is enough.
        cursor.advance(self._stream[max(0, self._n - len(toks)) : self._n])
        self._references.append(sam)
        self._cursors.append(cursor)
        self._src_references.append(_Source(f"ref{len(self._src_references)}", self.policy.mute_window))
        return len(self._references) - 1

    def clear_references(self) -> None:
        """Drop every reference document, its statistics and any pending draft accounting."""
        self._references.clear()
        self._cursors.clear()
        self._src_references.clear()
        self._pending = None

    # ---- past outputs -------------------------------------------------------------------------------

    def begin_output(self, start: int | None = None) -> None:
        """Mark where this conversation's next output begins (default: now, the committed count). Without a mark
        the output begins after the first observed slice (the prompt); a chat turn calls this once the user's
        turn is observed, before the reply is decoded."""
        n = self._n if start is None else int(start)
        if not 0 <= n <= self._n:
            raise DraftIndexError(f"an output cannot begin at {n}: the stream has {self._n} tokens")
        self._output_start = n

    def finish_output(self) -> int:
        """Store the output since the mark (`begin_output`, or the end of the prompt) in the shared OutputIndex and
        move the mark to the end; returns the tokens stored (0 without an OutputIndex or an empty output). Call it
        when a request or a chat turn ends, after its last observe. This conversation's own matcher sees the new
        output too (other conversations' matchers resynchronize at their next draft)."""
        start = max(self._output_start, 0)
        self._output_start = self._n
        if self._outputs is None or start >= self._n:
            return 0
        return self._outputs.add_output(self._stream[start : self._n])

    def siblings(self, k: int) -> list[tuple[int, str]]:
        """Up to k alternatives to the last draft's first token, for a tree verify: the recycling matrix's other
        candidates after the newest committed token, best first, each with its evidence key ("sibling<rank>", the
        rank in the matrix's row). Empty without the matrix, before any token, or after a suggest that drafted
        nothing."""
        if self._recycling is None or self._n == 0 or k <= 0 or self._pending is None:
            return []
        first = int(self._pending[1][0])
        out = []
        for rank, t in enumerate(self._recycling.row(self._last).tolist()):
            if t >= 0 and t != first:
                out.append((t, f"sibling{rank}"))
                if len(out) == k:
                    break
        return out

    def evidence(self) -> str:
        """What the last draft rests on, for the decoder's per-step economics (speculative/economics.py): its
        source and, for the automata, its match length in log-spaced buckets (e.g. "conversation:8" = a match of
        8-15 tokens); "recycling" for the matrix's chain."""
        return self._evidence

    def truncate_pending(self, keep: int = 0) -> None:
        """Limit the pending draft's accounting to its first `keep` tokens (0 drops it).

        For a caller that trims the committed slice before `observe` (a chat turn ending at a stop
        marker): drafted tokens past the kept part were never shown to the index, so they must count as
        neither accepted nor rejected.
        """
        if self._pending is None:
            return
        src, draft = self._pending
        self._pending = (src, draft[: max(0, int(keep))]) if keep > 0 else None

    # ---- statistics ---------------------------------------------------------------------------------

    @property
    def n_committed(self) -> int:
        return self._n

    @property
    def n_references(self) -> int:
        return len(self._references)

    def stream(self) -> np.ndarray:
        """A copy of the committed stream the index has observed, int32."""
        return self._stream[: self._n].copy()

    def stats(self) -> list[SourceStats]:
        """Per-source totals, in cascade order: conversation, ref0.., outputs, recycling (when enabled)."""
        out = []
        for src in self._sources():
            poisoned = src is self._src_conversation and self._conversation.poisoned
            out.append(SourceStats(src.name, src.accepted, src.drafted, src.muted, poisoned))
        return out

    def summary(self) -> str:
        """One line: `spec sources: conversation a/d ref0 a/d outputs a/d recycling a/d [muted]`."""
        parts = []
        for s in self.stats():
            flags = (" [muted]" if s.muted else "") + (" [poisoned]" if s.poisoned else "")
            parts.append(f"{s.name} {s.accepted}/{s.drafted}{flags}")
        return "spec sources: " + " ".join(parts)

    @property
    def nbytes(self) -> int:
        """Heap bytes of every index (SAMs, recycling matrix, output index, the stream copy); shared ones included."""
        total = self._conversation.nbytes + sum(s.nbytes for s in self._references) + self._stream.nbytes
        total += self._outputs.nbytes if self._outputs is not None else 0
        return total + (self._recycling.nbytes if self._recycling is not None else 0)

    @property
    def recycling_matrix(self) -> RecyclingMatrix | None:
        """The matrix this index learns into (to save it, or to share it with the next conversation)."""
        return self._recycling

    @property
    def outputs(self) -> OutputIndex | None:
        return self._outputs

    # ---- helpers ------------------------------------------------------------------------------------

    def _tail(self, m: int) -> np.ndarray:
        """The last m committed tokens (the output matcher re-walks them after the output index changes)."""
        return self._stream[max(0, self._n - m) : self._n]

    def _sources(self) -> list[_Source]:
        tail = [self._src_outputs] if self._outputs is not None else []
        tail += [self._src_recycling] if self._recycling is not None else []
        return [self._src_conversation, *self._src_references, *tail]

    def _checked(self, tokens, what: str) -> tuple[np.ndarray, list[int]]:
        """(the tokens as int32, as a list of ids), checked: a 1-D integer array of ids in the vocabulary."""
        a = tokens if type(tokens) is np.ndarray else np.asarray(tokens)
        if a.dtype is _INT32:  # the decoder's ids: a 1-D array is one whose tolist() is a list of ints
            ids = a.tolist()
            shaped = type(ids) is list and (type(ids[0]) is int if ids else a.ndim == 1)
        else:
            shaped = a.ndim == 1 and (a.size == 0 or a.dtype.kind in "iu")
            ids = a.tolist() if shaped else []
        if not shaped:
            raise DraftIndexError(f"{what} must be a 1-D integer array; got shape {a.shape} dtype {a.dtype}")
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise DraftIndexError(f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return (a if a.dtype is _INT32 else a.astype(np.int32)), ids
