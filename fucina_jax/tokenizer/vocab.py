"""A GGUF vocabulary's tables, read from `tokenizer.ggml.*` the way llama.cpp's `llama_vocab::impl::load` reads
them: the vocabulary kind and its defaults, token texts, ids, scores, types and attribute bits, the special ids
(metadata first, then tokens found by their text) and the end-of-generation set.
"""

from __future__ import annotations

import array
import warnings
from enum import IntEnum
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from fucina_jax.errors import TokenizerError
from fucina_jax.tokenizer.pretokenize import _PRE_TYPES, SUPPORTED_PRE_TOKENIZERS

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.h `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(IntEnum):
    """llama.cpp's per-token attribute bits (llama.h `llama_token_attr`), derived from the type and token text."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_TYPE_TO_ATTR = {
    TokenType.UNDEFINED: TokenAttr.UNDEFINED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}

_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN  # split out before tokenizing
_HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # not parsed / not rendered unless `special`

_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
])
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id", "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id", "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id", "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}
_DEPRECATED_ID_KEYS = {"fim_pre": "tokenizer.ggml.prefix_token_id", "fim_suf": "tokenizer.ggml.suffix_token_id",
                       "fim_mid": "tokenizer.ggml.middle_token_id"}


def _get(md: Mapping[str, Any], key: str, kind: type | tuple, default=None):
    v = md.get(key, default)
    if v is not default and not isinstance(v, kind):
        raise TokenizerError(f"metadata key {key!r} has type {type(v).__name__}, expected {kind}; "
                             "the GGUF file is malformed: convert the model again")
    return v


def _index_texts(tokens) -> dict[str, int] | None:
    """{text: id} when tokens is a list of distinct non-empty str (in C: gguf_strings.c's index), else None."""
    try:
        from fucina_jax._gguf_strings import index
    except ImportError:  # a source tree without the extension built: the Python path
        return None
    return index(tokens)



def _model_and_tokens(md: Mapping[str, Any]) -> tuple[str, list, dict[str, int] | None]:
    """`tokenizer.ggml.model` and `.tokens`, checked, and the tokens' text -> id table when C could build it."""
    model = _get(md, "tokenizer.ggml.model", str)
    tokens = md.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerError(
            "this GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing). Use a GGUF "
            "converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py writes it)."
        )
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(
            f"unsupported tokenizer model {model!r}; supported: {', '.join(SUPPORTED_MODELS)} "
            "(gpt2 = byte-level BPE, llama = SentencePiece, gemma4 = Gemma 4 BPE)"
        )
    index = _index_texts(tokens)  # distinct non-empty strings (every real vocabulary): the table in one C pass
    if not tokens or (index is None and (not isinstance(tokens, list) or set(map(type, tokens)) != {str})):
        raise TokenizerError("tokenizer.ggml.tokens must be a non-empty list of strings; the GGUF is malformed")
    return model, tokens, index


class _VocabKind(NamedTuple):
    """A vocabulary kind and its defaults, before the metadata's flags and ids override them."""

    pre: str  # the pre-tokenizer name (`Tokenizer.pre`)
    kind: str  # "spm", "gemma4", or the regex kind of a gpt2 vocabulary's pre-tokenizer
    ignore_merges: bool
    add_bos: bool
    add_space_prefix: bool
    ids: dict[str, int]  # special token ids


def _vocab_kind(model: str, pre_name: str | None) -> _VocabKind:
    """What llama.cpp's `llama_vocab::impl::load` makes of `tokenizer.ggml.model` and `tokenizer.ggml.pre`."""
    if model == "llama":
        return _VocabKind("default", "spm", False, True, True, {"bos": 1, "eos": 2, "unk": 0})
    if model == "gemma4":
        return _VocabKind("gemma4", "gemma4", False, False, False, {})
    if pre_name is None:
        warnings.warn("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                      "(generation quality may degrade: convert the model again)", stacklevel=3)  # Tokenizer()'s caller
        pre_name = "default"
    if pre_name not in _PRE_TYPES:
        raise TokenizerError(
            f"unsupported pre-tokenizer {pre_name!r} for a gpt2 (BPE) vocabulary; supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    kind, ignore_merges, add_bos = _PRE_TYPES[pre_name]
    # llama.cpp's BPE default ids (GPT-2 style files always override them)
    return _VocabKind(pre_name, kind, ignore_merges, add_bos, False, {"bos": 11, "eos": 11})


def _token_table(md: Mapping[str, Any], tokens: Sequence[str], index: dict[str, int] | None
                 ) -> tuple[list[str], dict[str, int], array.array, tuple[int, ...], list[int]]:
    """The tokens' texts, text -> id, scores, `tokenizer.ggml.token_type` values and attribute bits (before their
    text-based adjustments)."""
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None and (not isinstance(scores, list) or len(scores) < n):
        raise TokenizerError(f"tokenizer.ggml.scores has fewer entries than the {n} tokens; the GGUF is malformed")
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) < n):
        raise TokenizerError(
            f"tokenizer.ggml.token_type has fewer entries than the {n} tokens; the GGUF is malformed")
    if index is not None:
        texts, token_to_id = list(tokens), index
    else:
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        token_to_id = dict(zip(texts, range(n)))
    try:
        score_table = array.array("d", scores[:n] if scores is not None else bytes(8 * n))
    except TypeError:
        raise TokenizerError("tokenizer.ggml.scores must be numbers; the GGUF is malformed") from None
    if len(token_to_id) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(texts):
            if t in seen:
                raise TokenizerError(
                    f"token text {t!r} appears twice (ids {seen[t]} and {i}); llama.cpp refuses such a "
                    "vocabulary too. Convert the model again."
                )
            seen[t] = i
    if types is None:
        return texts, token_to_id, score_table, (int(TokenType.NORMAL),) * n, [int(TokenAttr.NORMAL)] * n
    try:
        type_ids = np.asarray(types[:n], np.int64)
    except (TypeError, ValueError, OverflowError):
        raise TokenizerError("tokenizer.ggml.token_type must be int32 llama_token_type values; the GGUF "
                             "is malformed") from None
    if type_ids.ndim != 1:
        raise TokenizerError("tokenizer.ggml.token_type must be a flat array of integers; the GGUF is malformed")
    attr_of = np.full(max(_TYPE_TO_ATTR) + 1, int(TokenAttr.UNDEFINED), np.int64)  # unknown types: UNDEFINED
    for t, a in _TYPE_TO_ATTR.items():
        attr_of[int(t)] = int(a)
    known = (type_ids >= 0) & (type_ids < len(attr_of))
    attrs = np.where(known, attr_of[np.clip(type_ids, 0, len(attr_of) - 1)], int(TokenAttr.UNDEFINED)).tolist()
    return texts, token_to_id, score_table, tuple(type_ids.tolist()), attrs


def _special_ids(md: Mapping[str, Any], defaults: Mapping[str, int], n: int) -> dict[str, int | None]:
    """Special token ids (the keys of `_ID_KEYS`): the vocabulary kind's defaults, then the metadata's."""
    special: dict[str, int | None] = {k: None for k in _ID_KEYS}
    for k, v in defaults.items():
        special[k] = v if v < n else None
    # llama.cpp reads the deprecated FIM keys after the current ones, so they win when both are present
    for k, key in [*_ID_KEYS.items(), *_DEPRECATED_ID_KEYS.items()]:
        v = md.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise TokenizerError(f"metadata key {key!r} must be an integer token id, got {v!r}")
        if 0 <= v < n:
            special[k] = v
        else:
            warnings.warn(f"{key} = {v} is outside the vocabulary of {n} tokens; ignored",
                          stacklevel=3)  # Tokenizer()'s caller
    return special


def _control_tokens(special: dict[str, int | None], attrs: list[int], texts: Sequence[str],
                    token_to_id: Mapping[str, int]) -> frozenset[int]:
    """Control-looking tokens, found by text (llama.cpp does the same, "obviously not ideal"): fills the eot, eom
    and FIM ids the metadata left out into `special`, adjusts `attrs`, and returns the end-of-generation ids."""
    def make_control(i: int) -> None:
        attrs[i] |= TokenAttr.CONTROL

    if special["eot"] is None:
        hits = [token_to_id[t] for t in _EOT_TEXTS if t in token_to_id]
        if hits:
            special["eot"] = min(hits)  # llama.cpp takes whichever its hash map yields first
    if special["eom"] is None and "<|eom_id|>" in token_to_id:
        special["eom"] = token_to_id["<|eom_id|>"]
    for k, options in _FIM_TEXTS.items():
        if special[k] is None:
            hits = [token_to_id[t] for t in options if t in token_to_id]
            if hits:
                special[k] = min(hits)
                make_control(special[k])
    for i in np.flatnonzero(np.asarray(attrs, np.int64) & int(TokenAttr.CONTROL)).tolist():
        if "unused" in texts[i]:
            attrs[i] |= TokenAttr.UNUSED

    eog: set[int] = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}
    for t in _EOG_TEXTS:
        i = token_to_id.get(t)
        if i is not None:
            eog.add(i)
            make_control(i)
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
        if t in token_to_id:
            attrs[token_to_id[t]] = int(TokenAttr.USER_DEFINED)
    for k in ("eos", "eot", "eom"):
        if special[k] is not None:
            eog.add(special[k])
    eog_texts = {texts[i] for i in eog}
    if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in
                                    eog_texts)) or ("<|calls|>" in eog_texts and "<|flush|>" in eog_texts)):
        end = token_to_id["<|end|>"]
        eog.discard(end)
        attrs[end] = int(TokenAttr.USER_DEFINED)
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        s = token_to_id["</s>"]
        eog.discard(s)
        attrs[s] = int(TokenAttr.NORMAL)
    return frozenset(eog)
