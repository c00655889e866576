"""The suffix-automaton draft index the package uses: the C core (sam.c) with a thin Python face.

`SuffixAutomaton` indexes a token stream online and answers, after every append, the longest suffix with
an occurrence ending strictly before the end (`match_len`), where that occurrence ended (`match_pos`) and
what followed it (`draft`). `freeze()` turns an index over a reference document into a read-only one that
any number of `Cursor`s (one per conversation) walk. The pure-Python twin is `sam_ref.SuffixAutomatonRef`.
"""

from __future__ import annotations

import numpy as np

try:
    from fucina_jax.index import _sam
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "the suffix-automaton C core (fucina_jax/index/_sam, built from sam.c) is not compiled: "
        "install the package with `pip install -e .` (needs a C compiler and the Python headers)"
    ) from exc

__all__ = ["SuffixAutomaton", "Cursor", "MAX_TOKENS"]

Cursor = _sam.Cursor
MAX_TOKENS: int = _sam.MAX_TOKENS


class SuffixAutomaton(_sam.SuffixAutomaton):
    """Online suffix automaton over token ids (C core; every method below the Python ones is C).

    SuffixAutomaton(*, max_tokens=None, reserve=0): `max_tokens` caps the stream (an append past it fails
    and poisons the index, bounding memory at ~110 B/token); `reserve` preallocates for a known length.
    """

    __slots__ = ()

    @classmethod
    def reference(cls, tokens) -> SuffixAutomaton:
        """A frozen index over a reference document, ready for `cursor()`."""
        tokens = np.asarray(tokens).reshape(-1)
        sam = cls(reserve=len(tokens))
        sam.extend(tokens)
        sam.freeze()
        return sam

    def stream(self) -> np.ndarray:
        """A copy of the indexed tokens, int32."""
        return np.frombuffer(self.tokens(), dtype=np.int32).copy()

    def __repr__(self) -> str:
        flags = "".join([" frozen" if self.frozen else "", " poisoned" if self.poisoned else ""])
        return (
            f"<SuffixAutomaton n={len(self)} states={self.n_states} transitions={self.n_transitions} "
            f"match_len={self.match_len} nbytes={self.nbytes}{flags}>"
        )
