"""Readable pure-Python reference of the suffix automaton in sam.c.

Same algorithm, same sample discipline, same answers: the tests run both on every stream and require
identical match lengths, sampled positions, drafts and state/transition counts. It is slow (~20x) and
exists to be read and to check the C core; the package itself uses `fucina_jax.index.sam.SuffixAutomaton`.

Vocabulary (see sam.c for the full argument):
  state     an endpos-equivalence class of substrings; `len[v]` is the length of its longest string
  link[v]   the state of the longest suffix of v's strings that lies in a different class
  pos[v]    one end index of an occurrence of v's strings, written only with indices that are provably in
            v's endpos set and earlier than the stream end at every later query (the sample discipline)
  cursor    (state, length) of the longest suffix of the stream with an occurrence ending strictly
            before the end; advanced BEFORE the automaton is extended with the same token
"""

from __future__ import annotations

import operator

import numpy as np

from fucina_jax.errors import DraftIndexError, IndexFrozenError, IndexPoisonedError

__all__ = ["SuffixAutomatonRef", "CursorRef", "MAX_TOKENS"]

MAX_TOKENS = (2**31 - 1 - 3) // 3  # keeps states <= 2n+1 and transitions <= 3n inside int32, as in C
_MAX_ID = 2**31 - 1


def _token_list(tokens) -> list[int]:
    items = tokens if isinstance(tokens, (list, tuple)) else np.asarray(tokens).reshape(-1).tolist()
    try:
        out = [operator.index(t) for t in items]
    except TypeError as exc:
        raise DraftIndexError(f"token ids must be integers: {exc}") from None
    for k, t in enumerate(out):
        if not 0 <= t <= _MAX_ID:
            raise DraftIndexError(f"token ids must be in [0, {_MAX_ID}]; got {t} at position {k}")
    return out


class SuffixAutomatonRef:
    """Online suffix automaton over token ids; the reference twin of the C `SuffixAutomaton`."""

    def __init__(self, *, max_tokens: int | None = None, reserve: int = 0) -> None:
        del reserve  # lists grow on their own; accepted so both classes take the same arguments
        self.max_tokens = MAX_TOKENS if max_tokens is None else int(max_tokens)
        self.stream: list[int] = []
        # struct of arrays, one entry per state; state 0 is the root
        self.len: list[int] = [0]
        self.link: list[int] = [-1]
        self.pos: list[int] = [-1]
        self.next: list[dict[int, int]] = [{}]  # transitions token -> target
        self.last = 0
        self.cur_state, self.cur_len = 0, 0
        self.refresh: tuple[int, int] | None = None  # (state, end index) applied at the next append
        self.frozen = False
        self.poisoned = False

    # ---- construction -------------------------------------------------------------------------------

    def _new_state(self, length: int, link: int, pos: int, edges: dict[int, int]) -> int:
        self.len.append(length)
        self.link.append(link)
        self.pos.append(pos)
        self.next.append(edges)
        return len(self.len) - 1

    def append(self, token: int) -> None:
        """Index one more token (see the C docstring for the error behaviour)."""
        if self.poisoned:
            return
        if self.frozen:
            raise IndexFrozenError("this suffix automaton is frozen; index more tokens in a new one")
        (c,) = _token_list([token])
        if len(self.stream) >= self.max_tokens:
            self.poisoned = True
            raise IndexPoisonedError(
                f"append failed (max_tokens reached) after {len(self.stream)} tokens; the index is poisoned"
            )
        if self.refresh is not None:  # its end index is no longer the current end
            state, end = self.refresh
            self.pos[state] = end
            self.refresh = None
        i = len(self.stream)
        self.stream.append(c)

        # cursor-before-extend: a transition found in the automaton of stream[:i] proves an earlier occurrence
        v, length = self.cur_state, self.cur_len
        while v != -1 and c not in self.next[v]:
            v = self.link[v]
            if v != -1:
                length = self.len[v]
        if v == -1:
            self.cur_state, self.cur_len = 0, 0
        else:
            self.cur_state, self.cur_len = self.next[v][c], length + 1

        # extend (the classical construction); the new state's only end index is i
        cur = self._new_state(self.len[self.last] + 1, 0, i, {})
        p = self.last
        while p != -1 and c not in self.next[p]:
            self.next[p][c] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][c]
            if self.len[p] + 1 == self.len[q]:
                self.link[cur] = q
            else:
                # the clone inherits q's sample: an earlier member of its endpos, never the current end i
                clone = self._new_state(self.len[p] + 1, self.link[q], self.pos[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(c) == q:
                    self.next[p][c] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
                if self.cur_state == q:  # clone fix-up
                    assert self.cur_len <= self.len[clone]
                    self.cur_state = clone
        self.last = cur

        if self.cur_len > 0:  # recency refresh, deferred: i is the current end until the next append
            self.refresh = (self.cur_state, i)
        n = len(self.stream)
        assert self.n_states <= 2 * n + 1 and self.n_transitions <= 3 * n

    def extend(self, tokens) -> None:
        """Append every token of a 1-D integer array or sequence; bad ids raise before anything is appended."""
        if self.frozen and not self.poisoned:
            raise IndexFrozenError("this suffix automaton is frozen; index more tokens in a new one")
        for t in _token_list(tokens):
            self.append(t)

    def freeze(self) -> None:
        """Stop growing; external cursors become legal. The pending refresh is applied (no current end any more)."""
        if self.frozen:
            return
        self.frozen = True
        if not self.poisoned and self.refresh is not None:
            state, end = self.refresh
            self.pos[state] = end
            self.refresh = None

    # ---- queries ------------------------------------------------------------------------------------

    @property
    def match_len(self) -> int:
        return 0 if self.poisoned else self.cur_len

    @property
    def match_pos(self) -> int:
        return -1 if self.poisoned or self.cur_len == 0 else self.pos[self.cur_state]

    def draft(self, buf: np.ndarray, limit: int | None = None) -> int:
        """Continuation of the sampled earlier occurrence; self-overlapping (periodic) past the stream end."""
        limit = len(buf) if limit is None else max(0, min(int(limit), len(buf)))
        start = self.match_pos + 1
        if start <= 0:
            return 0
        n = len(self.stream)
        for j in range(limit):
            k = start + j
            buf[j] = self.stream[k] if k < n else buf[k - n]
        return limit

    def cursor(self) -> CursorRef:
        if not self.frozen:
            raise DraftIndexError("external cursors need a frozen automaton: call freeze() first")
        return CursorRef(self)

    def tokens(self) -> bytes:
        return np.asarray(self.stream, dtype=np.int32).tobytes()

    def _check_cursor_invariant(self) -> bool:
        if self.poisoned:
            return True
        if not self.stream:
            return (self.cur_state, self.cur_len) == (0, 0)
        link = self.link[self.last]
        return (self.cur_state, self.cur_len) == (link, self.len[link])

    @property
    def n_states(self) -> int:
        return len(self.len)

    @property
    def n_transitions(self) -> int:
        return sum(len(e) for e in self.next)

    def __len__(self) -> int:
        return len(self.stream)


class CursorRef:
    """External cursor over a frozen `SuffixAutomatonRef`."""

    def __init__(self, index: SuffixAutomatonRef) -> None:
        self.index = index
        self.state, self.len = 0, 0

    def reset(self) -> None:
        self.state, self.len = 0, 0

    def advance(self, tokens) -> None:
        s = self.index
        if s.poisoned:
            return
        for c in _token_list(tokens):
            v, length = self.state, self.len
            while v != -1 and c not in s.next[v]:
                v = s.link[v]
                if v != -1:
                    length = s.len[v]
            if v == -1:
                self.state, self.len = 0, 0
            else:
                self.state, self.len = s.next[v][c], length + 1

    @property
    def match_len(self) -> int:
        return 0 if self.index.poisoned else self.len

    @property
    def match_pos(self) -> int:
        return -1 if self.index.poisoned or self.len == 0 else self.index.pos[self.state]

    def draft(self, buf: np.ndarray, limit: int | None = None) -> int:
        """The indexed stream after the sampled occurrence, cut at its end."""
        limit = len(buf) if limit is None else max(0, min(int(limit), len(buf)))
        start = self.match_pos + 1
        if start <= 0:
            return 0
        k = min(limit, len(self.index.stream) - start)
        buf[:k] = self.index.stream[start : start + k]
        return k
