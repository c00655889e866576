"""A suffix index over the model's own past outputs (SuffixDecoding's global tree, as one counted suffix automaton).

What a model wrote for earlier requests predicts what it writes now: the same phrasings, list formats, code
idioms, refusals. `OutputIndex` holds the finished outputs of a process (oldest evicted first once they exceed
`max_tokens` in all) and proposes, after the current stream's longest suffix that occurs in them, the continuation
they most often had, each token with its count, so a caller can drop weak drafts.

Definition (what `tests/test_index_outputs.py` checks against brute force). For a context c and the indexed
outputs O_1..O_m, oldest first (those of the latest rebuild: see `lag`; with lag=0, exactly the stored ones):
  - the match x is the longest suffix of c, at most `max_match` tokens, that occurs in some O_i (L = |x|);
  - draft token j is the t maximising count(x t_1 .. t_{j-1} t), the number of places in the outputs where that
    string occurs; ties go to the t whose latest occurrence is the most recent (later output, later position);
  - the walk stops at `limit` tokens, where no output continues the string, or where the best count is below
    `min_count` or below `min_prob` times the previous count (count(x) for the first token).

Data structure, by its cost per token. The outputs are concatenated with a separator (the id `vocab_size`, never a
continuation) into one suffix automaton (sam.c) whose `freeze_counted` stores, per state, its occurrence count and
its most frequent continuation. A conversation's `OutputMatcher` advances one cursor per committed token (amortized
O(1), what a reference cursor costs) and drafts at one hash lookup per token, however many outputs are stored
(scripts/bench_index.py: ~0.2 us observe + ~0.3 us draft a token, next to the conversation automaton's ~0.3 us
append+draft). A bounded-depth suffix trie (SuffixDecoding's) would take O(depth) per inserted token and, without
suffix links, O(depth^2) per match; one frozen automaton per output would take O(outputs) per token. What an
automaton cannot do is forget or grow under its cursors, so a change is a rebuild over the stored outputs: ~0.2 us
a stored token, 24-30 ms at the default cap of 131,072 tokens. Rebuilding once the changes exceed `lag` (1/32) of
the indexed size makes that 7-14 us per added token, like a growing array's doublings, at the price of the newest
outputs waiting (at the cap, ~4,000 tokens: 32 replies of 128) before they are found; within a conversation its own
earlier turns are the conversation automaton's anyway. After a rebuild every matcher re-walks its last
`max_match` tokens, which is why the match is capped (beyond a few dozen tokens a match is one occurrence and the
cap changes nothing; SuffixDecoding caps its tree's depth too). Memory: ~80 B a stored token.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from fucina_jax.errors import DraftIndexError
from fucina_jax.index.sam import SuffixAutomaton

__all__ = ["OutputIndex", "OutputMatcher", "OutputDraft", "DEFAULT_MAX_TOKENS", "MAX_MATCH", "DEFAULT_LAG"]

DEFAULT_MAX_TOKENS = 1 << 17  # stored output tokens (131,072: ~1,000 replies of 128 tokens)
MAX_MATCH = 64  # longest match, tokens
DEFAULT_LAG = 1 / 32  # rebuild once the changes since the latest rebuild exceed this share of it


@dataclasses.dataclass(frozen=True)
class OutputDraft:
    """What backs the latest draft: the match length, the matched string's occurrences, and per drafted token the
    occurrences of the match extended through it (non-increasing; counts[j] / counts[j-1] is the confidence)."""

    match_len: int
    match_count: int
    counts: np.ndarray  # int32 [n]


_NO_DRAFT = OutputDraft(0, 0, np.zeros(0, np.int32))


class OutputIndex:
    """Past outputs of a process, searchable by suffix (see the module docstring).

    OutputIndex(vocab_size, *, max_tokens=DEFAULT_MAX_TOKENS, max_match=MAX_MATCH, lag=DEFAULT_LAG). Share one per
    model across a process's conversations; each conversation reads it through its own `matcher()`. Queries see
    the automaton of the latest rebuild, which happens (lazily, at the next query) once the tokens added and
    evicted since the previous one exceed `lag` times its size: lag=0 rebuilds after every change, so queries see
    exactly the stored outputs; the default 1/32 bounds the rebuild work at ~64x the build cost per added token
    (adds and evictions both count; 7-14 us) while a small index still rebuilds after every output. `refresh()`
    rebuilds now. Not thread-safe.
    """

    def __init__(self, vocab_size: int, *, max_tokens: int = DEFAULT_MAX_TOKENS, max_match: int = MAX_MATCH,
                 lag: float = DEFAULT_LAG):
        if vocab_size <= 0 or max_tokens <= 0 or max_match <= 0 or not 0 <= lag:
            raise DraftIndexError(f"vocab_size, max_tokens and max_match must be positive and lag >= 0; got "
                                  f"{vocab_size}, {max_tokens}, {max_match}, {lag}")
        self.vocab_size = int(vocab_size)
        self.max_tokens = int(max_tokens)
        self.max_match = int(max_match)
        self.lag = float(lag)
        self._outputs: collections.deque[np.ndarray] = collections.deque()
        self._n_tokens = 0
        self._sam: SuffixAutomaton | None = None  # over the outputs of the latest rebuild; None if there were none
        self._n_indexed = 0  # tokens in _sam
        self._changed = 0  # tokens added or evicted since the latest rebuild
        self._due = False  # a rebuild is due at the next query
        self.generation = 0  # bumped when a rebuild becomes due (or clear()); matchers resynchronize then
        self.rebuilds = 0
        self.last = _NO_DRAFT  # what backs the latest suggest()

    # ---- contents -----------------------------------------------------------------------------------

    def add_output(self, tokens) -> int:
        """Store one finished output (token ids; a copy is kept); returns how many tokens were stored.

        An output longer than max_tokens keeps its first max_tokens tokens; an empty one is not stored. The oldest
        outputs are evicted until the total fits. Cheap: the automaton is rebuilt at a later query (see `lag`).
        """
        a = np.asarray(tokens)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise DraftIndexError(f"an output must be a 1-D integer array; got shape {a.shape} dtype {a.dtype}")
        if a.size == 0:
            return 0
        if int(a.min()) < 0 or int(a.max()) >= self.vocab_size:
            raise DraftIndexError(f"output token ids must be in [0, {self.vocab_size})")
        a = np.array(a[: self.max_tokens], dtype=np.int32)
        self._outputs.append(a)
        self._n_tokens += len(a)
        self._changed += len(a)
        while self._n_tokens > self.max_tokens:
            gone = len(self._outputs.popleft())
            self._n_tokens -= gone
            self._changed += gone
        if not self._due and self._changed > self.lag * self._n_indexed:
            self._due = True
            self.generation += 1
        return len(a)

    def load_outputs(self, outputs) -> None:
        """add_output for each, oldest first (the newest that fit are kept)."""
        for o in outputs:
            self.add_output(o)

    def refresh(self) -> None:
        """Rebuild now if anything changed since the latest rebuild (queries then see exactly the stored outputs)."""
        if self._changed and not self._due:
            self._due = True
            self.generation += 1
        self.automaton()

    def clear(self) -> None:
        self._outputs.clear()
        self._n_tokens = self._n_indexed = self._changed = 0
        self._sam = None
        self._due = False
        self.generation += 1

    def outputs(self) -> list[np.ndarray]:
        """The stored outputs, oldest first (int32 copies)."""
        return [o.copy() for o in self._outputs]

    @property
    def n_outputs(self) -> int:
        return len(self._outputs)

    @property
    def n_tokens(self) -> int:
        """Stored output tokens (<= max_tokens)."""
        return self._n_tokens

    @property
    def n_indexed(self) -> int:
        """Tokens in the automaton queries see (those of the latest rebuild, <= max_tokens)."""
        return self._n_indexed

    @property
    def nbytes(self) -> int:
        """Heap bytes: the stored outputs and the automaton."""
        return self._n_tokens * 4 + (self._sam.nbytes if self._sam is not None else 0)

    def automaton(self) -> SuffixAutomaton | None:
        """The counted, frozen automaton queries read (rebuilt now over the stored outputs when a rebuild is due);
        None when there were no outputs."""
        if self._due:
            self._due = False
            self._sam, self._n_indexed, self._changed = None, self._n_tokens, 0
            if self._outputs:
                sep = np.array([self.vocab_size], np.int32)
                sam = SuffixAutomaton(reserve=self._n_tokens + len(self._outputs))
                sam.extend(np.concatenate([p for o in self._outputs for p in (o, sep)]))
                sam.freeze_counted(self.vocab_size)
                self._sam = sam
            self.rebuilds += 1
        return self._sam

    # ---- queries ------------------------------------------------------------------------------------

    def matcher(self, tail=None) -> OutputMatcher:
        """A new matcher for one conversation (fed with `observe`, like a DraftSource; `tail`: see OutputMatcher)."""
        return OutputMatcher(self, tail)

    def suggest(self, context, buf: np.ndarray, *, min_count: int = 1, min_prob: float = 0.0,
                min_match: int = 1) -> int:
        """Draft the outputs' most frequent continuation of `context` into buf[:n]; returns n (0 when the match is
        shorter than min_match). Matches the context's tail afresh: one O(max_match) walk a call; a conversation
        drafting every step should use a `matcher()`. `self.last` tells the match and the counts behind it."""
        m = self.matcher()
        m.observe(np.asarray(context)[-self.max_match :])
        n = m.draft(buf, len(buf), min_count=min_count, min_prob=min_prob, min_match=min_match)
        self.last = m.last
        return n


class OutputMatcher:
    """One conversation's match against an OutputIndex: the longest suffix (<= max_match tokens) of the tokens it
    observed that occurs in the live outputs, kept current with one cursor step per token.

    OutputMatcher(index, tail=None): after the index changes, the matcher re-walks the last max_match tokens it
    observed. `tail(m)`, when given, returns them (a caller that keeps the stream anyway, like the cascade, saves
    the copy); without it the matcher keeps its own.
    """

    __slots__ = ("index", "_cursor", "_gen", "_tail_fn", "_tail", "_n_tail", "_counts", "_last")

    def __init__(self, index: OutputIndex, tail=None) -> None:
        self.index = index
        self._cursor = None
        self._gen = -1  # the index generation the cursor walks; -1: resynchronize at the next query
        self._tail_fn = tail
        m = index.max_match
        self._tail = np.zeros(2 * m, np.int32) if tail is None else None  # own tail: [_n_tail - m, _n_tail)
        self._n_tail = 0
        self._counts = np.zeros(64, np.int32)  # counts of the latest draft, [:n]
        self._last = (0, 0, 0)  # (match_len, match_count, n) of the latest draft

    def observe(self, committed: np.ndarray) -> None:
        """Feed the tokens committed since the last call (int32, ids < 2^31; not range-checked here)."""
        tail = self._tail
        if tail is not None:
            k, m, n = len(committed), self.index.max_match, self._n_tail
            if k >= m:
                tail[:m] = committed[-m:]
                self._n_tail = m
            elif k:
                if n + k > 2 * m:  # slide: keep the last m - k tokens, then append
                    keep = m - k
                    tail[:keep] = tail[n - keep : n]
                    n = keep
                tail[n : n + k] = committed
                self._n_tail = n + k
        if self._gen == self.index.generation and self._cursor is not None:
            self._cursor.advance(committed, self.index.max_match)

    def _sync(self):
        """The cursor over the index's current automaton (None without outputs), re-walked if the index changed."""
        index = self.index
        if self._gen != index.generation:
            sam = index.automaton()
            self._gen = index.generation
            self._cursor = None
            if sam is not None:
                m = index.max_match
                if self._tail_fn is not None:
                    recent = self._tail_fn(m)
                else:
                    recent = self._tail[max(0, self._n_tail - m) : self._n_tail]
                self._cursor = sam.cursor()
                self._cursor.advance(recent, m)
        return self._cursor

    @property
    def match_len(self) -> int:
        cursor = self._cursor if self._gen == self.index.generation else self._sync()
        return cursor.match_len if cursor is not None else 0

    def draft(self, buf: np.ndarray, limit: int, *, min_count: int = 1, min_prob: float = 0.0,
              min_match: int = 1) -> int:
        """The most frequent continuation into buf[:n], n <= limit (see the module docstring); `last` tells why."""
        cursor = self._cursor if self._gen == self.index.generation else self._sync()
        if cursor is None or cursor.match_len < min_match or limit <= 0:
            self._last = (0, 0, 0)
            return 0
        if limit > len(self._counts):
            self._counts = np.zeros(min(limit, len(buf)), np.int32)
        n = cursor.draft_frequent(buf, limit, self._counts, min_count, min_prob)
        self._last = (cursor.match_len, cursor.match_count, n)
        return n

    @property
    def last(self) -> OutputDraft:
        """The match and the counts behind the latest draft (0s after a query that drafted nothing)."""
        match_len, match_count, n = self._last
        return OutputDraft(match_len, match_count, self._counts[:n].copy())
