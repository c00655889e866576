"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, token-for-token identical to llama.cpp.

The speculative decoder's reference documents must be encoded exactly as the model's own tokenizer would, or the
suffix automaton never aligns with the committed stream (design record §8/§10: a pre-tokenizer bug that gave 625
tokens where llama.cpp gives 500 silently destroyed acceptance). So the reference here is llama.cpp's
`src/llama-vocab.cpp` (0c1e570, the version llama-cpp-python 0.3.36 bundles), not Hugging Face's tokenizer.json, and
the tests compare ids with llama.cpp on a corpus.

Three vocabulary kinds:

* `gpt2` - byte-level BPE (`bpe`). Pre-tokenizers `qwen2` (Qwen3), `smollm` (SmolLM2), `llama-bpe`, `gpt-2`,
  `default` and their llama.cpp aliases, split by regex (`pretokenize`).
* `llama` - SentencePiece (Gemma 3, `spm`): highest-score-bigram merging over the vocabulary with `<0xXX>` byte
  fallback.
* `gemma4` - SPM-style BPE (`bpe`): spaces become U+2581, the text is split only into newline runs and the rest,
  merges run over raw UTF-8 characters with `<0xXX>` byte fallback, BOS always added.

The modules: `pretokenize` (text -> pieces), `bpe` and `spm` (pieces -> ids), `vocab` (the metadata's token table,
special ids and flags); this one holds the `Tokenizer` over them, `StreamDecoder` and `tokenize_to_lines`.

Special tokens are split out first, the way llama.cpp does it (longest special text first, over the whole text; with
`parse_special=False` only user-defined tokens), then each remaining fragment is tokenized on its own.

Invalid UTF-8 input (`encode_bytes`): `errors="strict"` (default) raises `TokenizerError` naming the byte offset;
`errors="replace"` reproduces llama.cpp: BPE vocabularies see each undecodable byte as U+FFFD (llama.cpp's lenient
decoder), SentencePiece ones emit the raw bytes as `<0xXX>` tokens. Empty input gives just the BOS/EOS that
`add_special` asks for.

Decoding concatenates llama.cpp's token pieces (`llama_token_to_piece`) without llama.cpp's `clean_spaces`
detokenizer pass, so decode(encode(x)) == x except where the vocabulary itself is lossy: a literal U+2581 comes back
as a space from SentencePiece-style vocabularies, and a byte-level vocabulary drops bytes missing from its alphabet
(SmolLM2 has no token for 21 bytes, e.g. 0x00), as llama.cpp does.
"""

from __future__ import annotations

import codecs
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fucina_jax.errors import TokenizerError
from fucina_jax.gguf_io import read_metadata
from fucina_jax.tokenizer.bpe import _BPEEncoder, _ByteLevelBPE, _Gemma4BPE, _merges
# _BYTE_CHARS, _WHITESPACE, _category_ranges and _llama_cpts only for the tests, which import them from here
from fucina_jax.tokenizer.pretokenize import (
    _BYTE_CHARS,
    _CHAR_TO_BYTE,
    _ESCAPED_BYTE,
    _WHITESPACE,
    SUPPORTED_PRE_TOKENIZERS,
    _category_ranges,
    _llama_cpts,
    _SpecialSplitter,
)
from fucina_jax.tokenizer.spm import _SpmEncoder
from fucina_jax.tokenizer.vocab import (
    _HIDDEN_ATTRS,
    _SPECIAL_ATTRS,
    SUPPORTED_MODELS,
    TokenAttr,
    TokenType,
    _control_tokens,
    _get,
    _model_and_tokens,
    _special_ids,
    _token_table,
    _vocab_kind,
)

__all__ = [
    "StreamDecoder",
    "Tokenizer",
    "TokenAttr",
    "TokenType",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE_TOKENIZERS",
    "tokenize_to_lines",
]


def _special_splitters(texts: Sequence[str], attrs: Sequence[int]) -> dict[bool, _SpecialSplitter]:
    """parse_special -> the splitter of the special tokens it parses (user-defined ones only when False)."""
    specials_all = {texts[i]: i for i in np.flatnonzero(np.asarray(attrs, np.int64) & int(_SPECIAL_ATTRS)).tolist()}
    specials_text = {t: i for t, i in specials_all.items() if not attrs[i] & _HIDDEN_ATTRS}
    return {True: _SpecialSplitter(specials_all), False: _SpecialSplitter(specials_text)}


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's encode/decode semantics. Build with `from_gguf(path)` (reads only the
    metadata) or `from_metadata(md)`."""

    def __init__(self, metadata: Mapping[str, Any]):
        md = metadata
        self.model, tokens, index = _model_and_tokens(md)
        # kept for chat templates (fucina_jax.chat_template), which need the file's template and its family
        self.chat_template = _get(md, "tokenizer.chat_template", str)
        self.architecture = _get(md, "general.architecture", str)

        vocab = _vocab_kind(self.model, _get(md, "tokenizer.ggml.pre", str))
        self.pre, self._kind, self.ignore_merges = vocab.pre, vocab.kind, vocab.ignore_merges
        self.add_space_prefix = bool(_get(md, "tokenizer.ggml.add_space_prefix", bool, vocab.add_space_prefix))
        self._texts, self._token_to_id, self._scores, self._types, attrs = _token_table(md, tokens, index)
        special = _special_ids(md, vocab.ids, len(tokens))
        v = _get(md, "tokenizer.ggml.add_bos_token", bool)
        self.add_bos = vocab.add_bos if v is None else v
        v = _get(md, "tokenizer.ggml.add_eos_token", bool)
        self.add_eos = False if v is None else v
        if self._kind == "gemma4":
            self.add_bos = True  # llama.cpp forces it for Gemma 4 (PR #21500)
        self._eog = _control_tokens(special, attrs, self._texts, self._token_to_id)
        self._attrs = attrs
        self._special = special
        self._splitters = _special_splitters(self._texts, attrs)

        self._encoder = self._build_encoder(md)
        # "hf" or "python" for BPE vocabularies
        self.bpe_engine = self._encoder.engine_name if isinstance(self._encoder, _BPEEncoder) else None
        self._pieces: list[bytes] | None = None
        self._pieces_plain: list[bytes] | None = None

    # ----------------------------------------------------------------------------------------------- construction

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        return cls(metadata)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read only the metadata of a GGUF file (no tensor is touched)."""
        return cls(read_metadata(path))

    def _build_encoder(self, md: Mapping[str, Any]) -> _SpmEncoder | _BPEEncoder:
        """The fragment encoder of the vocabulary's kind."""
        if self._kind == "spm":
            return _SpmEncoder(self._texts, self._token_to_id, self._scores, self.add_space_prefix)
        merges = _merges(md, self.model)
        if self._kind == "gemma4":
            return _Gemma4BPE(self._token_to_id, merges, self.ignore_merges)
        return _ByteLevelBPE(self._token_to_id, merges, self.ignore_merges, self._kind)

    # ------------------------------------------------------------------------------------------------- properties

    @property
    def n_vocab(self) -> int:
        return len(self._texts)

    @property
    def bos_id(self) -> int | None:
        return self._special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._special["eos"]

    @property
    def eot_id(self) -> int | None:
        """The metadata's end-of-turn id, else a turn-end token found by its text (when a vocabulary has several,
        llama.cpp's pick depends on hash order; every one of them is in `eog_ids` either way)."""
        return self._special["eot"]

    @property
    def pad_id(self) -> int | None:
        return self._special["pad"]

    @property
    def unk_id(self) -> int | None:
        return self._special["unk"]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation: llama.cpp's set (eos, eot/eom, FIM pad/repo/sep and turn-end texts)."""
        return self._eog

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    @property
    def token_types(self) -> tuple[int, ...]:
        """`tokenizer.ggml.token_type` per id (all NORMAL when the file has none)."""
        return self._types

    def token_attr(self, token_id: int) -> int:
        """llama.cpp's attribute bits (`TokenAttr`) of a token, after its text-based adjustments."""
        return self._attrs[self._check_id(token_id)]

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[self._check_id(token_id)] & TokenAttr.CONTROL)

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of a token as stored in the GGUF (byte-level / U+2581 escaped)."""
        return self._texts[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary string is exactly `text`, or None."""
        return self._token_to_id.get(text)

    def _check_id(self, token_id: int) -> int:
        if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, bool):
            raise TypeError(f"a token id is an int, got {type(token_id).__name__} {token_id!r}")
        if not 0 <= token_id < len(self._texts):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._texts) - 1})")
        return token_id

    # ----------------------------------------------------------------------------------------------------- encode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special: prepend BOS / append EOS as the metadata asks (Gemma: BOS; Qwen3, SmolLM2: nothing).
        parse_special: also turn control-token texts such as "<start_of_turn>" into their ids (user-defined tokens
        are always matched, as in llama.cpp).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}; use encode_bytes() for bytes")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text contains a lone surrogate at index {e.start}, which is not Unicode text; "
                                 "decode your input with errors='strict' or 'replace'") from None
        return self._encode(text, add_special, parse_special, lenient=False)

    def encode_bytes(self, data: bytes, add_special: bool = True, parse_special: bool = False,
                     errors: str = "strict") -> list[int]:
        """Token ids of UTF-8 bytes. errors="strict" raises TokenizerError on invalid UTF-8; errors="replace"
        tokenizes the bytes exactly as llama.cpp does (see the module docstring)."""
        if errors not in ("strict", "replace"):
            raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
        data = bytes(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if errors == "strict":
                raise TokenizerError(
                    f"input is not valid UTF-8: byte 0x{data[e.start]:02X} at offset {e.start} ({e.reason}). Fix "
                    "the file's encoding, or tokenize it the way llama.cpp does with errors='replace'."
                ) from None
            # surrogateescape keeps each undecodable byte as its own character, so special texts (valid UTF-8)
            # are found where llama.cpp's byte search finds them; fragments are re-decoded llama.cpp's way below.
            return self._encode(data.decode("utf-8", "surrogateescape"), add_special, parse_special, lenient=True)
        return self._encode(text, add_special, parse_special, lenient=False)

    def _encode(self, text: str, add_special: bool, parse_special: bool, lenient: bool) -> list[int]:
        frags = self._splitters[bool(parse_special)].split(text)
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise TokenizerError("the vocabulary asks for a BOS token but defines none (no bos_token_id)")
            out.append(self.bos_id)
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                prev_special = True
                continue
            if lenient and _ESCAPED_BYTE.search(f):
                raw = f.encode("utf-8", "surrogateescape")
            else:
                raw = None
            out.extend(self._encoder.encode(f, raw, prev_special))
            prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise TokenizerError("the vocabulary asks for an EOS token but defines none (no eos_token_id)")
            out.append(self.eos_id)
        return out

    # ----------------------------------------------------------------------------------------------------- decode

    def _piece(self, token_id: int) -> bytes:
        """llama.cpp `token_to_piece(token, special=True)`."""
        a = self._attrs[token_id]
        text = self._texts[token_id]
        if a & (_HIDDEN_ATTRS | TokenAttr.USER_DEFINED):
            return text.encode("utf-8")
        if a & TokenAttr.NORMAL:
            if self._kind in ("spm", "gemma4"):
                return text.replace("\u2581", " ").encode("utf-8")
            out = bytearray()
            for c in text:
                b = _CHAR_TO_BYTE.get(c)
                if b is not None:
                    out.append(b)
                else:  # llama.cpp's llama_decode_text marker for a character outside the byte alphabet
                    out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
            return bytes(out)
        if a & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined types render as nothing, like llama.cpp

    def _build_pieces(self) -> None:
        self._pieces = [self._piece(i) for i in range(len(self._texts))]
        self._pieces_plain = [b"" if self._attrs[i] & _HIDDEN_ATTRS else p for i, p in enumerate(self._pieces)]

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for (llama.cpp `llama_token_to_piece`); special=False renders control and
        unknown tokens as nothing. A byte token, or a byte-level BPE piece, may be part of a UTF-8 character."""
        if self._pieces is None:
            self._build_pieces()
        self._check_id(token_id)
        return (self._pieces if special else self._pieces_plain)[token_id]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        if self._pieces is None:
            self._build_pieces()
        table = self._pieces_plain if skip_special else self._pieces
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
            raise TypeError(f"decode takes a sequence of token ids, got {type(ids).__name__}")
        ids = ids if isinstance(ids, list) else list(ids)
        try:
            if ids and min(ids) < 0:  # a negative id would index from the end of the table
                raise IndexError
            return b"".join(table[i] for i in ids)
        except (IndexError, TypeError):
            bad = next(i for i in ids if not isinstance(i, (int, np.integer)) or not 0 <= i < len(table))
            if not isinstance(bad, (int, np.integer)):
                raise TypeError(f"token ids are ints, got {type(bad).__name__} {bad!r}") from None
            raise TokenizerError(f"cannot decode token id {bad!r}: outside the vocabulary (0..{len(table) - 1})") \
                from None

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of a token sequence; bytes that do not form valid UTF-8 (a cut-off character) become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, "
                f"eos={self.eos_id}, add_bos={self.add_bos}, bpe_engine={self.bpe_engine!r})")


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the text that became complete, holding back the bytes of a UTF-8
    character split across tokens until the rest arrives; `flush()` returns what is left (an incomplete tail as
    U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self.tokenizer.token_to_bytes(token_id, special=not self.skip_special))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


def tokenize_to_lines(model: str | os.PathLike | Tokenizer, file: str | os.PathLike, out=None, *,
                      add_bos: bool | None = None, parse_special: bool = True, errors: str = "replace") -> int:
    """`generate.py MODEL --tokenize FILE`: print the token ids of FILE ("-" = stdin), one per line, reading only
    the vocabulary of MODEL (a GGUF path, or a Tokenizer already built). Same ids as
    `llama-tokenize -m MODEL -f FILE --ids --no-escape`: the file's bytes verbatim, BOS if the model adds one
    (add_bos=False is llama-tokenize's --no-bos), special-token texts parsed (llama-tokenize's default;
    parse_special=False is its --no-parse-special), invalid UTF-8 tokenized the way llama.cpp does with a warning on
    stderr (errors="strict" raises TokenizerError instead). Returns the number of tokens."""
    out = sys.stdout if out is None else out
    name = os.fspath(file)
    tok = model if isinstance(model, Tokenizer) else Tokenizer.from_gguf(model)
    if name == "-":
        data = sys.stdin.buffer.read()
        name = "<stdin>"
    else:
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError as e:
            raise TokenizerError(f"cannot read {name!r}: {e.strerror}") from None
    if not data:
        print(f"warning: {name} is empty", file=sys.stderr)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise TokenizerError(f"{name} is not valid UTF-8 (byte 0x{data[e.start]:02X} at offset {e.start}); "
                                 "fix its encoding") from None
        print(f"warning: {name} is not valid UTF-8 (first bad byte at offset {e.start}); tokenizing it the way "
              "llama.cpp does", file=sys.stderr)
    add_special = tok.add_bos if add_bos is None else (add_bos and tok.add_bos)
    ids = tok.encode_bytes(data, add_special=add_special, parse_special=parse_special, errors=errors)
    out.write("".join(f"{i}\n" for i in ids))
    return len(ids)
