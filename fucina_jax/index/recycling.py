"""Token-Recycling matrix: the draft fallback when no index matches (Token Recycling, Luo et al. 2024).

Verification already computes a full logits row per verified position and keeps only the sampled token.
The matrix recycles the rest: row `a` holds the K most recent next-token candidates seen after token `a`
(from `observe_topk`), and every committed bigram (a, b) moves b to the front of row a. A draft is the
top-1 chain walked from the last committed token. vocab x K int32: 4.64 MiB at Qwen3's 151,936 tokens.
Cold start is a sentinel fill (no seen-bitmap): an unseen row drafts nothing.
"""

from __future__ import annotations

import numpy as np

from fucina_jax.errors import DraftIndexError

__all__ = ["RecyclingMatrix", "TOPK", "SENTINEL"]

TOPK = 8  # candidates kept per row
SENTINEL = -1  # an empty slot; a row whose first slot is empty has never been seen


class RecyclingMatrix:
    """vocab x K next-token candidates, most recent first. Pure NumPy; never imports JAX.

    Update order is defined per stream position p (committed token b = stream[p], predecessor a):
    first the row of a is replaced by the top-K candidates of position p (when they were observed), then
    b is moved to the front of row a. `observe` and `observe_topk` together realize exactly that order.
    """

    def __init__(self, vocab_size: int, k: int = TOPK) -> None:
        if vocab_size <= 0 or k <= 0:
            raise DraftIndexError(f"the recycling matrix needs vocab_size > 0 and k > 0; got {vocab_size}, {k}")
        self.table = np.full((vocab_size, k), SENTINEL, dtype=np.int32)  # [V, K] token ids, best first
        # The table as a flat memoryview: the per-token updates and the chain walk index it with Python ints, which
        # costs a fraction of a NumPy index right after a forward, when every instruction is a cache miss.
        self._flat = memoryview(self.table.reshape(-1))
        self._k = k

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    @property
    def k(self) -> int:
        return self.table.shape[1]

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def row(self, token: int) -> np.ndarray:
        """Candidates after `token`, best first (SENTINEL marks empty slots); a copy."""
        return self.table[token].copy()

    def move_to_front(self, a: int, b: int) -> None:
        """Committed bigram (a, b): b becomes row a's first candidate; the others keep their order."""
        flat, base = self._flat, a * self._k
        if flat[base] == b:
            return
        row = flat[base : base + self._k].tolist()
        k = row.index(b) if b in row else len(row) - 1  # absent: the last candidate drops out
        flat[base + 1 : base + k + 1] = flat[base : base + k]  # memoryview copies overlap like memmove
        flat[base] = b

    def observe(self, prev: int, committed) -> None:
        """Move-to-front for the bigrams (prev, c0), (c0, c1), ...; prev < 0: the stream starts here. committed:
        an int array or a list of ids."""
        a = int(prev)
        for b in committed.tolist() if isinstance(committed, np.ndarray) else committed:
            if a >= 0:
                self.move_to_front(a, b)
            a = b

    def observe_topk(self, prev, nxt, rows) -> None:
        """Position by position: row prev[j] := rows[j] (its first K, padded with SENTINEL), then move nxt[j] to
        front. Int arrays or lists (rows: of lists)."""
        K = self._k
        flat = self._flat
        if isinstance(rows, np.ndarray):
            prev, nxt, rows = np.asarray(prev).tolist(), np.asarray(nxt).tolist(), rows.tolist()
        for a, b, cand in zip(prev, nxt, rows):
            cand = cand[:K]
            if b in cand:  # move-to-front on the new row, then write it
                i = cand.index(b)
                cand = [b, *cand[:i], *cand[i + 1 :]]
            else:
                cand = [b, *cand[: K - 1]]
            cand += [SENTINEL] * (K - len(cand))
            base = a * K
            for j, t in enumerate(cand):
                flat[base + j] = t

    def draft(self, last: int, buf: np.ndarray, limit: int) -> int:
        """Top-1 chain from `last` into buf[:n]; stops at an unseen row. Chains may cycle (a -> b -> a)."""
        flat, k = self._flat, self._k
        t = int(last)
        chain = []
        for _ in range(min(limit, len(buf))):
            t = flat[t * k]
            if t < 0:
                break
            chain.append(t)
        if chain:
            buf[: len(chain)] = chain
        return len(chain)
