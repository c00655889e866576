"""The SentencePiece encoder of `llama` vocabularies (Gemma 3): highest-score-bigram merging over the vocabulary with
`<0xXX>` byte fallback (llama.cpp `llm_tokenizer_spm`).

Written by hand: HF `tokenizers` has no score-ordered bigram merge (its BPE needs a merge table, which would differ
from llama.cpp on ties and on merges into control/user-defined pieces).
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence

import numpy as np

from fucina_jax.errors import TokenizerError
from fucina_jax.tokenizer.pretokenize import _MEMO_MAX_LEN, _OPAQUE_BASE, _llama_spm_chars

# SentencePiece fragments shorter than this are merged whole; longer ones are cut where no merge can cross first.
_SPM_CHUNK_MIN = 256


def _vocab_bigrams(texts: Sequence[str]) -> np.ndarray:
    """Sorted keys (c1 << 21 | c2) of every adjacent character pair inside any vocabulary string."""
    lens = np.array(list(map(len, texts)), dtype=np.int64)
    cps = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
    if len(cps) < 2:
        return np.zeros(0, dtype=np.int64)
    keys = (cps[:-1] << 21) | cps[1:]
    inside = np.ones(len(keys), dtype=bool)
    ends = np.cumsum(lens)[:-1] - 1  # pair positions that straddle two vocabulary strings
    inside[ends[(ends >= 0) & (ends < len(keys))]] = False
    return np.unique(keys[inside])


class _SpmEncoder:
    """A SentencePiece vocabulary's fragment encoder: spaces as U+2581 (and one in front of a fragment that starts the
    text or follows a special token, with `add_space_prefix`), merged by piece score, byte tokens for what is left."""

    def __init__(self, texts: Sequence[str], vocab: Mapping[str, int], scores: Sequence[float],
                 add_space_prefix: bool):
        self.texts, self.vocab, self.scores, self.add_space_prefix = texts, vocab, scores, add_space_prefix
        self.bigrams: np.ndarray | None = None  # built by the first long fragment
        self.memo: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, raw: bytes | None, after_special: bool) -> list[int]:
        """Ids of one fragment between special tokens; `raw` is its bytes when they are not valid UTF-8
        (`encode_bytes(errors="replace")`), split into symbols the way llama.cpp does."""
        prefix = " " if self.add_space_prefix and after_special else ""
        if raw is None:
            chars = (prefix + text).replace(" ", "\u2581")
        else:
            chars = _llama_spm_chars((prefix.encode() + raw).replace(b" ", "\u2581".encode()))
        return self.fragment(chars)

    def fragment(self, text: str) -> list[int]:
        """Ids of a fragment already in SentencePiece symbols (U+2581 for spaces), merged chunk by chunk."""
        out: list[int] = []
        memo = self.memo
        for chunk in self.chunks(text):
            got = memo.get(chunk)
            if got is None:
                got = tuple(self.chunk(chunk))
                if len(chunk) <= _MEMO_MAX_LEN:
                    if len(memo) > 200_000:
                        memo.clear()
                    memo[chunk] = got
            out.extend(got)
        return out

    def chunks(self, text: str) -> list[str]:
        """Cut `text` wherever two adjacent characters occur together in no vocabulary piece: no merge can cross
        such a point, so the merge loop runs on each chunk independently and the result is the same as on the
        whole fragment (which is what llama.cpp does), but chunks repeat and are memoized."""
        n = len(text)
        if n < _SPM_CHUNK_MIN:  # short text: one chunk, and no need to build the bigram table (~0.15 s)
            return [text] if text else []
        if self.bigrams is None:
            self.bigrams = _vocab_bigrams(self.texts)
        big = self.bigrams
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
        keys = (cps[:-1] << 21) | cps[1:]
        idx = np.searchsorted(big, keys)
        idx[idx == len(big)] = 0
        cuts = (np.flatnonzero(big[idx] != keys) + 1).tolist()
        bounds = [0, *cuts, n]
        return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def chunk(self, chunk: str) -> list[int]:
        """llama.cpp `llm_tokenizer_spm_session::tokenize` on one chunk: repeatedly merge the adjacent pair whose
        concatenation is the highest-scoring vocabulary piece (ties to the leftmost); pieces left that are not
        tokens are emitted as bytes."""
        vocab, scores = self.vocab, self.scores
        syms = list(chunk)
        n = len(syms)
        heap: list[tuple[float, int, int, int]] = []

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                text = syms[left] + syms[right]
                tid = vocab.get(text)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, right, len(text)))

        if n > 1:
            nxt = list(range(1, n)) + [-1]
            prv = list(range(-1, n - 1))
            for i in range(n - 1):
                add(i, i + 1)
            while heap:
                _, left, right, size = heapq.heappop(heap)
                if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                    continue  # one side already merged elsewhere
                syms[left] += syms[right]
                syms[right] = ""
                nxt[left] = nxt[right]
                if nxt[right] >= 0:
                    prv[nxt[right]] = left
                add(prv[left], left)
                add(left, nxt[left])
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_tokens(s))
        return out

    def byte_tokens(self, piece: str) -> list[int]:
        """The `<0xXX>` tokens (else one-byte tokens) of a piece's bytes; an opaque character is its one byte."""
        out = []
        for c in piece:
            o = ord(c)
            bs = bytes([o - _OPAQUE_BASE]) if _OPAQUE_BASE <= o <= _OPAQUE_BASE + 0xFF else c.encode("utf-8")
            for b in bs:
                tid = self.vocab.get(f"<0x{b:02X}>")
                if tid is None and b < 0x80:
                    tid = self.vocab.get(chr(b))
                if tid is None:
                    raise TokenizerError(
                        f"byte 0x{b:02X} has no token in this SentencePiece vocabulary (no <0x{b:02X}> piece), so "
                        "the text cannot be encoded; llama.cpp fails on it too"
                    )
                out.append(tid)
        return out
