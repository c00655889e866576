"""The DraftSource contract between draft proposers and the speculative decoder.

A draft source proposes a continuation of the committed token stream; the decoder verifies it with one
batched forward and commits the longest prefix the target model itself produces (plus one correction or
bonus token). Sources are deterministic and never affect what is committed, only how fast: any object with
these members can be plugged into the decoder (the cascade `SpeculationIndex` is the package's own).

Call order per decode step, as the decoder drives it:

    n = source.suggest(context, buf)        # draft into buf[:n]; n == 0 means "no draft, plain step"
    ... verify, commit `committed` (1 + accepted tokens) ...
    source.observe(committed)               # every committed token, exactly once, in stream order
    if source.wants_topk:
        source.observe_topk(rows)           # right after observe(), rows aligned with `committed`

Optional: `source.evidence()` (called right after a suggest that drafted) returns a hashable key saying what the
draft rests on (e.g. "conversation:8"); the decoder's per-step economics learn acceptance per key. Without it every
draft of the source shares one key.

Optional: `source.siblings(k)` (called right after a suggest that drafted) returns up to k (token, evidence key)
alternatives to the draft's first token, best first; the decoder may verify them as siblings in a tree
(SpecOptions.tree_siblings).

The prompt is committed too: after prefill the decoder calls `observe(prompt_tokens)` once (no top-K rows).
Token ids travel as 1-D NumPy int32 arrays (int64 is accepted); nothing here imports JAX.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["DraftSource", "match_bucket"]


def match_bucket(n: int) -> int:
    """A match length in log-spaced buckets, for evidence keys: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+ -> 0, 1, 2, 4, 8,
    16, 32."""
    return 0 if n <= 0 else min(1 << (int(n).bit_length() - 1), 32)


@runtime_checkable
class DraftSource(Protocol):
    """What the speculative decoder needs from a draft proposer."""

    @property
    def wants_topk(self) -> bool:
        """False lets the decoder skip computing top-K candidates (and never call `observe_topk`)."""
        ...

    def suggest(self, context: np.ndarray, buf: np.ndarray) -> int:
        """Write a proposed continuation of `context` into `buf[:n]` and return n (0 <= n <= len(buf)).

        `context` is the committed stream so far (int32 [n_committed]); sources fed through `observe` may
        ignore it. `buf` is a writable int32 [max_draft] array owned by the decoder; len(buf) is the
        caller's draft cap. Must not modify `context`.
        """
        ...

    def observe(self, committed: np.ndarray) -> None:
        """Feed the tokens committed since the last call (int32 [k], k >= 0), in stream order."""
        ...

    def observe_topk(self, rows: np.ndarray) -> None:
        """Top-K candidates of verification logits: int32 [R, K], best first, R <= len(last committed).

        Called right after `observe(committed)`. rows[j] comes from the logits row that produced the
        committed token committed[len(committed) - R + j], i.e. it lists the model's candidates for the
        token that follows the one before it. Rows of rejected draft positions are not passed.
        """
        ...
