"""Tokenizer pieces that need no reference implementation: the Unicode table, the special-token splitter against a
literal transcription of llama.cpp's algorithm, the lenient UTF-8 decoder against llama.cpp's rules, stream decoding
and every bad-input path. Parity with llama.cpp itself is in test_tokenizer_parity.py."""

from __future__ import annotations

import io
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fucina_jax.errors import TokenizerError
from fucina_jax.testing.vocab import gemma4_vocab, write_gemma4_vocab_gguf
from fucina_jax.tokenizer import (
    _WHITESPACE,
    StreamDecoder,
    Tokenizer,
    TokenType,
    _category_ranges,
    _llama_cpts,
    _SpecialSplitter,
    tokenize_to_lines,
)

TRAIN = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1\n", "naïve café 東京 😀"] * 5


@pytest.fixture(scope="module")
def g4_md():
    tokens, types, scores, merges = gemma4_vocab(TRAIN, vocab_size=600)
    return {"general.architecture": "gemma4", "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 106, "tokenizer.ggml.add_bos_token": True}


@pytest.fixture(scope="module")
def g4(g4_md):
    return Tokenizer.from_metadata(g4_md)


# ------------------------------------------------------------------------------------------------ Unicode table

def test_unicode_table_agrees_with_unicodedata():
    """The embedded Unicode 15.1 categories equal Python's wherever Python's version has the code point assigned."""
    letter = {"L": "L", "N": "N", "P": "P", "S": "S", "M": "M", "Z": "Z", "C": "C"}
    table = {}
    for cls, ranges in _category_ranges().items():
        for a, b in ranges:
            table[(a, b)] = cls
    assigned_later = 0
    for (a, b), cls in table.items():
        for c in range(a, b + 1):
            cat = unicodedata.category(chr(c))
            if cat == "Cn":
                assigned_later += cls != "U"
                continue
            assert letter[cat[0]] == cls, (hex(c), cat, cls)
    # Python 3.11 has Unicode 14.0: the table adds the characters of 15.0 and 15.1 (5,116 of them)
    if unicodedata.unidata_version == "14.0.0":
        assert assigned_later == 5116
    assert sum(b - a + 1 for rs in _category_ranges().values() for a, b in rs) == 0x110000


def test_whitespace_is_unicode_white_space():
    py = {c for c in range(0x110000) if chr(c).isspace()}
    assert _WHITESPACE == py - {0x1C, 0x1D, 0x1E, 0x1F}  # Python counts the C0 separators, Unicode does not


# --------------------------------------------------------------------------------------- special-token splitting

def llama_partition(text: str, specials: dict[str, int]) -> list:
    """llama.cpp tokenizer_st_partition transcribed literally: every special (longest first), every fragment,
    repeated find from the left."""
    frags: list = [text]
    for s in sorted(specials, key=lambda t: (-len(t), specials[t])):
        out = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                continue
            start = 0
            while True:
                k = f.find(s, start)
                if k < 0:
                    break
                if k > start:
                    out.append(f[start:k])
                out.append(specials[s])
                start = k + len(s)
            if start < len(f):
                out.append(f[start:])
        frags = out
    return frags


SPECIALS = {"ab": 0, "bc": 1, "abc": 2, "\n": 3, "\n\n": 4, "\n\n\n": 5, "<x>": 6, "x>": 7, "c": 8, "<x>y<": 9}


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "\n", "<", "x", ">", "y", " ", "é", "ab", "<x>"]), max_size=30))
def test_special_splitter_is_llama_cpp_partition(parts):
    text = "".join(parts)
    assert _SpecialSplitter(SPECIALS).split(text) == llama_partition(text, SPECIALS)


def test_special_splitter_examples():
    sp = _SpecialSplitter(SPECIALS)
    # "abc" (longest) wins over "ab"/"bc"; "x>" only where "<x>" did not take it
    assert sp.split("zabcz") == ["z", 2, "z"]
    assert sp.split("abab") == [0, 0]
    assert sp.split("\n" * 7) == [5, 5, 3]
    assert sp.split("x>") == [7]
    assert _SpecialSplitter({}).split("abc") == ["abc"]
    assert sp.split("") == []


# --------------------------------------------------------------------------------------------- lenient decoding

def llama_cpts_reference(data: bytes) -> list[int]:
    """llama.cpp unicode_cpts_from_utf8, byte by byte (0xFFFD for a byte that cannot start a sequence)."""
    out, i, n = [], 0, len(data)

    def cont(i, k):
        return i + k < n and data[i + k] & 0xC0 == 0x80

    while i < n:
        b = data[i]
        if b < 0x80:
            out.append(b)
            i += 1
        elif b & 0xE0 == 0xC0 and cont(i, 1):
            out.append(((b & 0x1F) << 6) | (data[i + 1] & 0x3F))
            i += 2
        elif b & 0xF0 == 0xE0 and cont(i, 1) and cont(i, 2):
            out.append(((b & 0x0F) << 12) | ((data[i + 1] & 0x3F) << 6) | (data[i + 2] & 0x3F))
            i += 3
        elif b & 0xF8 == 0xF0 and cont(i, 1) and cont(i, 2) and cont(i, 3):
            out.append(((b & 0x07) << 18) | ((data[i + 1] & 0x3F) << 12) | ((data[i + 2] & 0x3F) << 6)
                       | (data[i + 3] & 0x3F))
            i += 4
        else:
            out.append(0xFFFD)
            i += 1
    return out


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=4), st.text(max_size=4).map(str.encode)), max_size=12))
def test_lenient_decoder_is_llama_cpp_decoder(parts):
    data = b"".join(parts)
    ref = llama_cpts_reference(data)
    if any(c > 0x10FFFF for c in ref):
        with pytest.raises(TokenizerError, match="beyond Unicode"):
            _llama_cpts(data)
    else:
        assert [ord(c) for c in _llama_cpts(data)] == ref


# ------------------------------------------------------------------------------------------------- gemma4 basics

def test_gemma4_layout_and_flags(g4):
    assert g4.model == "gemma4" and g4.add_bos and g4.bos_id == 2
    assert g4.token_text(105) == "<|turn>" and g4.token_types[105] == TokenType.CONTROL
    assert g4.token_types[50] == TokenType.USER_DEFINED and g4.is_control(50)  # <|tool_response> is EOG
    assert {1, 50, 106} <= g4.eog_ids and g4.is_eog(106) and not g4.is_eog(105)
    assert g4.token_text(107) == "\n" and g4.token_text(238) == "<0x00>"


def test_gemma4_newline_runs_and_byte_fallback(g4):
    ids = g4.encode("a\n\n\nb", add_special=False)
    assert 109 in ids  # "\n\n\n" is one token although no merge builds it
    ids = g4.encode("ꙮ", add_special=False)  # not in the alphabet: its three UTF-8 bytes
    assert [g4.token_text(i) for i in ids] == ["<0xEA>", "<0x99>", "<0xAE>"]
    assert g4.decode(ids) == "ꙮ"


def test_gemma4_bos_forced_even_if_metadata_says_no(g4_md):
    tok = Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.add_bos_token": False})
    assert tok.add_bos and tok.encode("x")[0] == tok.bos_id


def test_parse_special(g4):
    assert g4.encode("<|turn>user", add_special=False, parse_special=True)[0] == 105
    assert 105 not in g4.encode("<|turn>user", add_special=False, parse_special=False)
    # user-defined tokens are split out even without parse_special (llama.cpp does the same)
    assert 100 in g4.encode("x<|channel>y", add_special=False, parse_special=False)


# ----------------------------------------------------------------------------------------------- stream decoding

def test_stream_decoder_with_split_utf8(g4):
    text = "héllo 東京 😀!"
    byte_ids = [g4.token_id(f"<0x{b:02X}>") for b in text.encode()]
    dec = StreamDecoder(g4)
    pieces = [dec.feed(i) for i in byte_ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[text.encode().index("😀".encode()):][:4] == ["", "", "", "😀"]
    # an incomplete character at the end comes out as U+FFFD on flush, and the decoder is reusable after
    dec.feed(g4.token_id("<0xF0>"))
    assert dec.flush() == "\ufffd"
    assert dec.feed_many(g4.encode("ok", add_special=False)) == "ok"


def test_skip_special(g4):
    ids = g4.encode("<|turn>user\nhi<turn|>", add_special=True, parse_special=True)
    assert g4.decode(ids) == "<bos><|turn>user\nhi<turn|>"
    assert g4.decode(ids, skip_special=True) == "user\nhi"
    dec = g4.stream_decoder(skip_special=True)
    assert dec.feed_many(ids) == "user\nhi"
    assert g4.token_to_bytes(105, special=False) == b"" and g4.token_to_bytes(105) == b"<|turn>"
    assert g4.token_to_bytes(238 + 0xE4) == b"\xe4"


# ----------------------------------------------------------------------------------------------------- bad input

def test_gguf_without_tokenizer(tmp_path):
    import gguf

    path = str(tmp_path / "no_vocab.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_uint32("qwen3.context_length", 64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf(path)
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "qwen3"})


def test_unknown_model_and_pre_list_the_supported_ones(g4_md):
    with pytest.raises(TokenizerError, match=r"unsupported tokenizer model 'bert'.*gpt2, llama, gemma4"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.model": "bert"})
    md = {**g4_md, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(TokenizerError, match=r"unsupported pre-tokenizer 'no-such-pre'.*qwen2.*smollm"):
        Tokenizer.from_metadata(md)
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.pre"})


def test_malformed_metadata(g4_md):
    tokens = g4_md["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="appears twice"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.tokens": tokens + [tokens[-1]],
                                 "tokenizer.ggml.token_type": None, "tokenizer.ggml.scores": None})
    with pytest.raises(TokenizerError, match="scores has fewer entries"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.merges"):
        Tokenizer.from_metadata({k: v for k, v in g4_md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="list of strings"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.tokens": [1, 2, 3]})
    with pytest.raises(TokenizerError, match="must be an integer"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.bos_token_id": "2"})
    with pytest.warns(UserWarning, match="outside the vocabulary"):
        tok = Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.eos_token_id": 10**6})
    assert tok.eos_id is None


def test_bad_encode_and_decode_input(g4):
    with pytest.raises(TypeError, match="encode_bytes"):
        g4.encode(b"bytes")
    with pytest.raises(TokenizerError, match="lone surrogate at index 1"):
        g4.encode("a\ud800b")
    with pytest.raises(TokenizerError, match=r"not valid UTF-8: byte 0xFF at offset 3"):
        g4.encode_bytes(b"abc\xffdef")
    assert g4.encode_bytes(b"abc\xffdef", errors="replace")  # llama.cpp's way: U+FFFD, here byte tokens
    with pytest.raises(ValueError, match="errors"):
        g4.encode_bytes(b"x", errors="ignore")
    assert g4.encode("", add_special=True) == [g4.bos_id]
    assert g4.decode([]) == ""
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        g4.decode([1, g4.n_vocab])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        g4.token_to_bytes(-1)


def test_tokenize_to_lines_errors(tmp_path, g4, monkeypatch, capsys):
    path = write_gemma4_vocab_gguf(tmp_path / "v.gguf", TRAIN, vocab_size=600)
    f = tmp_path / "in.txt"
    f.write_bytes("héllo\n".encode())
    out = io.StringIO()
    assert tokenize_to_lines(path, f, out=out) == len(out.getvalue().split())
    assert [int(x) for x in out.getvalue().split()] == Tokenizer.from_gguf(path).encode("héllo\n", parse_special=True)
    with pytest.raises(TokenizerError, match="cannot read"):
        tokenize_to_lines(g4, tmp_path / "missing.txt", out=io.StringIO())
    f.write_bytes(b"\xff")
    with pytest.raises(TokenizerError, match="not valid UTF-8"):
        tokenize_to_lines(g4, f, out=io.StringIO(), errors="strict")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    out = io.StringIO()
    assert tokenize_to_lines(g4, "-", out=out) == 1  # just BOS
    assert "<stdin> is empty" in capsys.readouterr().err


def test_c_text_index_equals_the_python_table(gemma3_path, monkeypatch):
    """The text -> id table built in one C pass (gguf_strings.c's index) is the one dict(zip(...)) builds, on the
    real 262k-token vocabulary, and the tokenizers built either way encode alike; anything odd is left to Python."""
    from fucina_jax import _gguf_strings
    from fucina_jax.gguf_io import read_metadata

    md = read_metadata(gemma3_path)
    tokens = md["tokenizer.ggml.tokens"]
    assert _gguf_strings.index(tokens) == dict(zip(tokens, range(len(tokens))))
    for odd in (["a", "b", "a"], ["a", ""], ["a", 1], ("a", "b")):
        assert _gguf_strings.index(odd) is None
    assert _gguf_strings.index([]) == {}
    fast = Tokenizer.from_metadata(md)
    monkeypatch.setitem(sys.modules, "fucina_jax._gguf_strings", None)  # import fails: the Python path
    slow = Tokenizer.from_metadata(md)
    assert fast._token_to_id == slow._token_to_id and list(fast._scores) == list(slow._scores)
    text = "Speculative decoding, 投機的デコード, <start_of_turn>user\nHi!<end_of_turn>"
    assert fast.encode(text, add_special=True, parse_special=True) == slow.encode(text, add_special=True,
                                                                                  parse_special=True)


def test_empty_token_texts_and_bad_scores(g4_md):
    tokens = list(g4_md["tokenizer.ggml.tokens"])
    tokens[7] = ""
    tok = Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.tokens": tokens})
    assert tok.token_text(7) == "[EMPTY_7]" and tok.token_text(8) == tokens[8]
    with pytest.raises(TokenizerError, match="scores must be numbers"):
        Tokenizer.from_metadata({**g4_md, "tokenizer.ggml.scores": ["x"] * len(tokens)})
