"""BPE merges of `gpt2` (byte-level) and `gemma4` vocabularies: HF `tokenizers` when it can hold the merge table
exactly, else llama.cpp's loop in Python.

* `gpt2` - the pre-tokenizer's pieces (`pretokenize`), in GPT-2's byte-level alphabet, merged in HF `tokenizers`.
* `gemma4` - merges run over raw UTF-8 characters with `<0xXX>` byte fallback in HF `tokenizers`; the newline-run
  rule of llama.cpp PR #21343 is applied here before.

A pure-Python BPE (llama.cpp's merge loop) stands in for HF whenever the merge table cannot be given to HF exactly
(a merge whose parts or result are not tokens, a gemma4 vocabulary without all 256 `<0xXX>` tokens); the tests
check that both engines agree.
"""

from __future__ import annotations

import heapq
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models

from fucina_jax.errors import TokenizerError
from fucina_jax.tokenizer.pretokenize import (
    _MEMO_MAX_LEN,
    _NEWLINE_RUNS,
    _SURROGATE,
    _SURROGATE_SPLIT,
    _byte_level,
    _compiled_pre,
    _llama_cpts,
    _split_pieces,
)


# ---------------------------------------------------------------------------------------------------------------------
# The merge engines: llama.cpp's loop in Python, and HF `tokenizers`
# ---------------------------------------------------------------------------------------------------------------------

class _PyBPE:
    """llama.cpp's `llm_tokenizer_bpe_session` merge loop: adjacent pair with the lowest merge rank first, ties to
    the leftmost; a merged piece that is not a token falls back to bytes (`fallback`)."""

    def __init__(self, ranks: dict[tuple[str, str], int], vocab: Mapping[str, int], fallback, ignore_merges: bool):
        self.ranks, self.vocab, self.fallback, self.ignore_merges = ranks, vocab, fallback, ignore_merges
        self.memo: dict[str, tuple[int, ...]] = {}

    def merge(self, word: str) -> list[str]:
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        ranks = self.ranks
        heap: list[tuple[int, int, int, str]] = []

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                r = ranks.get((syms[left], syms[right]))
                if r is not None:
                    heapq.heappush(heap, (r, left, right, syms[left] + syms[right]))

        for i in range(n - 1):
            add(i, i + 1)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
                continue  # outdated pair
            syms[left], syms[right] = text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])
        return [s for s in syms if s]

    def word_ids(self, word: str) -> tuple[int, ...]:
        got = self.memo.get(word)
        if got is not None:
            return got
        if self.ignore_merges and word in self.vocab:
            pieces = [word]
        else:
            pieces = self.merge(word)
        out: list[int] = []
        for p in pieces:
            tid = self.vocab.get(p)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.fallback(p))
        got = tuple(out)
        if len(word) <= _MEMO_MAX_LEN:
            if len(self.memo) > 200_000:
                self.memo.clear()
            self.memo[word] = got
        return got

    def encode_words(self, words: Sequence[str]) -> list[int]:
        out: list[int] = []
        for w in words:
            out.extend(self.word_ids(w))
        return out


class _HfBPE:
    """The same merges in HF `tokenizers` (Rust): no normalizer, no pre-tokenizer; words arrive already split."""

    def __init__(self, vocab: Mapping[str, int], merges: list[tuple[str, str]], byte_fallback: bool,
                 ignore_merges: bool):
        # A character missing from the vocabulary stays a symbol in llama.cpp (nothing merges across it) and then
        # yields no token; HF without an unk token drops it *before* merging, letting its neighbours merge. So HF
        # gets a sentinel unk token that keeps the gap, and the sentinel is removed from the output.
        vocab = dict(vocab)
        self.unk_id = len(vocab)
        sentinel = "<fucina_jax:missing-character>"
        while sentinel in vocab:
            sentinel += "_"
        vocab[sentinel] = self.unk_id
        self.tok = HfTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=byte_fallback,
                                          ignore_merges=ignore_merges, unk_token=sentinel))

    def encode_words(self, words: Sequence[str]) -> list[int]:
        if not words:
            return []
        ids = self.tok.encode(list(words), is_pretokenized=True, add_special_tokens=False).ids
        unk = self.unk_id
        return [i for i in ids if i != unk] if unk in ids else ids


# ---------------------------------------------------------------------------------------------------------------------
# The merge table of a GGUF file, and the fragment encoders of the two BPE vocabulary kinds
# ---------------------------------------------------------------------------------------------------------------------

def _merges(md: Mapping[str, Any], model: str) -> list[str]:
    """`tokenizer.ggml.merges`: one "left right" string per merge, highest priority first."""
    merges = md.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError(f"a {model} vocabulary needs tokenizer.ggml.merges, which this GGUF lacks; "
                             "convert the model again")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise TokenizerError("tokenizer.ggml.merges must be a list of strings; the GGUF is malformed")
    return merges


def _merge_ranks(merges: Sequence[str]) -> dict[tuple[str, str], int]:
    """(left, right) -> merge rank, read the way llama.cpp reads the merge strings."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, m in enumerate(merges):
        pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if pos < 0:
            continue
        pair = (m[:pos], m[pos + 1:])
        ranks.setdefault(pair, rank)  # llama.cpp's emplace keeps the first rank of a repeated pair
    return ranks


class _BPEEncoder:
    """A BPE vocabulary's fragment encoder: its merge table in llama.cpp's loop (`py`) and `engine`, the one words are
    merged with (HF when it can hold the table exactly, else `py`)."""

    byte_fallback = False  # pieces that are not tokens fall back to <0xXX> tokens (HF's `byte_fallback`)

    def __init__(self, vocab: Mapping[str, int], merges: Sequence[str], ignore_merges: bool):
        self.vocab = vocab
        ranks = _merge_ranks(merges)
        self.py = _PyBPE(ranks, vocab, self.fallback, ignore_merges)
        self.engine: _PyBPE | _HfBPE = self._hf(ranks, ignore_merges) or self.py

    def _hf(self, ranks: dict[tuple[str, str], int], ignore_merges: bool) -> _HfBPE | None:
        # HF's BPE holds the same table only if every merge's parts and result are tokens (llama.cpp tolerates
        # others) and, for gemma4, all 256 <0xXX> tokens exist (HF would emit its unk token where llama.cpp skips
        # a missing byte).
        vocab = self.vocab
        ordered = sorted(ranks.items(), key=lambda kv: kv[1])
        if any(a not in vocab or b not in vocab or a + b not in vocab for (a, b), _ in ordered):
            return None
        if self.byte_fallback and any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        try:
            return _HfBPE(vocab, [pair for pair, _ in ordered], byte_fallback=self.byte_fallback,
                          ignore_merges=ignore_merges)
        except Exception:  # noqa: BLE001 - HF rejects the table for a reason of its own: stay exact in Python
            return None

    @property
    def engine_name(self) -> str:
        """Which engine merges: "hf" or "python"."""
        return "hf" if isinstance(self.engine, _HfBPE) else "python"

    def encode(self, text: str, raw: bytes | None, after_special: bool) -> list[int]:
        """Ids of one fragment between special tokens; `raw` is its bytes when they are not valid UTF-8
        (`encode_bytes(errors="replace")`), which llama.cpp decodes its lenient way. BPE does not look at
        `after_special`."""
        return self.encode_text(text if raw is None else _llama_cpts(raw))

    def fallback(self, piece: str) -> list[int]:
        """Byte tokens of a piece that is not a token (a byte without a token yields nothing, as in llama.cpp)."""
        raise NotImplementedError

    def encode_text(self, text: str) -> list[int]:
        """Ids of one fragment, its invalid UTF-8 already decoded llama.cpp's way."""
        raise NotImplementedError


class _ByteLevelBPE(_BPEEncoder):
    """A `gpt2` vocabulary: the pieces of the pre-tokenizer `pre_kind`, mapped to the byte-level alphabet, merged."""

    def __init__(self, vocab: Mapping[str, int], merges: Sequence[str], ignore_merges: bool, pre_kind: str):
        self.pre_kind = pre_kind
        super().__init__(vocab, merges, ignore_merges)

    def fallback(self, piece: str) -> list[int]:
        # llama.cpp looks each byte of the piece's text up as a one-byte token
        out = []
        for b in piece.encode("utf-8"):
            tid = self.vocab.get(chr(b)) if b < 0x80 else None
            if tid is not None:
                out.append(tid)
        return out

    def encode_text(self, text: str) -> list[int]:
        words = [_byte_level(w) for w in _split_pieces(text, _compiled_pre(self.pre_kind))]
        return self.engine.encode_words(words)


class _Gemma4BPE(_BPEEncoder):
    """A `gemma4` vocabulary: spaces as U+2581, newline runs and the rest merged over raw UTF-8 characters."""

    byte_fallback = True

    def fallback(self, piece: str) -> list[int]:
        out = []
        for b in piece.encode("utf-8", "surrogatepass"):
            tid = self.vocab.get(f"<0x{b:02X}>")
            if tid is not None:
                out.append(tid)
        return out

    def encode_text(self, text: str) -> list[int]:
        out: list[int] = []
        batch: list[str] = []
        vocab = self.vocab
        for w in _NEWLINE_RUNS.findall(text.replace(" ", "\u2581")):
            if w[0] == "\n" and w in vocab:
                # llama.cpp PR #21343: a newline run that is itself a token is emitted whole, merges or not
                out.extend(self.engine.encode_words(batch))
                batch = []
                out.append(vocab[w])
            elif _SURROGATE.search(w):
                # a surrogate from invalid input (errors="replace") can merge with nothing: cut the word there
                for part in _SURROGATE_SPLIT.split(w):
                    if len(part) == 1 and 0xD800 <= ord(part) <= 0xDFFF:
                        out.extend(self.engine.encode_words(batch))
                        batch = []
                        out.extend(self.fallback(part))
                    elif part:
                        batch.append(part)
            else:
                batch.append(w)
        out.extend(self.engine.encode_words(batch))
        return out
