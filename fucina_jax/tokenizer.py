"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, token-for-token identical to llama.cpp.

The speculative decoder's reference documents must be encoded exactly as the model's own tokenizer would, or the
suffix automaton never aligns with the committed stream (design record §8/§10: a pre-tokenizer bug that gave 625
tokens where llama.cpp gives 500 silently destroyed acceptance). So the reference here is llama.cpp's
`src/llama-vocab.cpp` (0c1e570, the version llama-cpp-python 0.3.36 bundles), not Hugging Face's tokenizer.json, and
the tests compare ids with llama.cpp on a corpus.

Three vocabulary kinds:

* `gpt2` - byte-level BPE. Pre-tokenizers `qwen2` (Qwen3), `smollm` (SmolLM2), `llama-bpe`, `gpt-2`, `default` and
  their llama.cpp aliases. The regex split is done here with Python `re` over character classes built from the same
  Unicode 15.1 categories llama.cpp uses (HF's regex engine has its own Unicode tables, and this way the surrogates
  llama.cpp decodes from invalid input are handled too); the BPE merges run in HF `tokenizers`.
* `llama` - SentencePiece (Gemma 3): highest-score-bigram merging over the vocabulary with `<0xXX>` byte fallback.
  Written by hand: HF `tokenizers` has no score-ordered bigram merge (its BPE needs a merge table, which would differ
  from llama.cpp on ties and on merges into control/user-defined pieces).
* `gemma4` - SPM-style BPE: spaces become U+2581, the text is split only into newline runs and the rest, merges run
  over raw UTF-8 characters with `<0xXX>` byte fallback, BOS always added. Merges run in HF `tokenizers`; the
  newline-run rule of llama.cpp PR #21343 is applied here before.

A pure-Python BPE (llama.cpp's merge loop) stands in for HF whenever the merge table cannot be given to HF exactly
(a merge whose parts or result are not tokens, a gemma4 vocabulary without all 256 `<0xXX>` tokens); the tests
check that both engines agree.

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

import array
import base64
import codecs
import heapq
import os
import re
import sys
import warnings
import zlib
from enum import IntEnum
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fucina_jax.errors import TokenizerError

__all__ = [
    "StreamDecoder",
    "Tokenizer",
    "TokenAttr",
    "TokenType",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE_TOKENIZERS",
    "tokenize_to_lines",
]


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

# SentencePiece fragments shorter than this are merged whole; longer ones are cut where no merge can cross first.
_SPM_CHUNK_MIN = 256

_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN  # split out before tokenizing
_HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # not parsed / not rendered unless `special`

# ---------------------------------------------------------------------------------------------------------------------
# Unicode categories
#
# llama.cpp classifies code points with a table generated from UnicodeData.txt 15.1 (unicode-data.cpp); Python's
# `unicodedata` follows the interpreter's Unicode version (14.0 on 3.11, 16.0 on 3.14), so the table is stored here:
# general categories collapsed to llama.cpp's flags (L letter, N number, P punctuation, S symbol, M mark,
# Z separator, C control/format/private/surrogate, U unassigned), run-length coded (varint length + class letter),
# zlib-compressed, base85. `tests/test_tokenizer_unit.py` checks it against `unicodedata` where both are assigned.
# ---------------------------------------------------------------------------------------------------------------------

_UNICODE_15_1_RUNS = (
    "c-oDZNr+}w700=6{@yoLRaaN_kgEEsQ$5c^x;q+Uo6od_+<U!nxe4712aJjX7*G&&6M~pUj3@yYSp*!&LJ;CcZC8ybf&)a*;"
    "6fw_4xj{AO%_4@o%3FGR|gF)?)SZSr!)P}|C~3Qo9lTnv0@aV^;yVc7WP@0GmL%K^iP}YG@;}<i>8~M7cukv+f3fP%;w&NRc"
    "qn~;}^Lt;>b>7X=^#cSd34)lBdjOsgO%-k-F=0YZCuynGxCXtQ@G_OEPze-NshoD1x$-N0UxE&N8xo7}uoz+*Pn+n5wxLffQ"
    "67%IZ81$L(&{`XXf3xR0ph+L<|qJ9Kdv&wuN4E80u~y3CR6*6n_mrE8X3>?E~*(+=2YBJL5LTozYs!P<b4GfH+(IlY%R)_EG"
    "*GVS3+g&o<vN{u^a_aJ%GUDOjxPBdxJA;bM9EXZtXxLtg-!l_z4lZ$Ogl-;Z`<aEOf9%M%@H=rS>V&(e~b-Pj}UfywAc6;cJ"
    "sgyf(Z_axykwIcDw>jd12V1>opmNMz_msU>4ePlMiPco@R(%90wM4I9f2(CX@3>=G&A8hxK~Lpd-6t01s!73r)*~m=XPM8_2"
    "#ZUs5s8IrRB>{W#=eOqD@|_+P)!TBrJH_#jTS07nNC~P04qYRdax_(yrI3zhMl)m+kWnBkT*ACZQGMa1$#Tr2<Qu0akcL(-{"
    "m{($odkNfhCQDXja=?<1fCII5x;5W}<x<r8C@;ad(l3fW$}B``~SVk%xMl=`3Kcpg7ZcnG>z#w!+Q?e{rfrKxVlrE{h-B_8_"
    "a&qg!}=Su?Vfj7eLf6YCWjo5eCf7sx+u*+Z^X0bII5vmjSZ;R`pmBk_XdD%o{Nbt%=_;~@IinFc-UlcIY*+W&9<m$fPX_xI0"
    "pE6^H*WuFuDHdg5|W-19>_(vi96c(+yz7Gz`)1y#e?i;dT39SZcm*^M<yk$gi+{aIzFW8wAK2XXOKjO7Y$1vo=F;1SZaT6GE"
    "2PB`c=&EfKB$-CUXQVL#y+mkTBQQ)S@Z~;GJ4D$7aaEZm3-{R;pRNg_-L{lE2sdVF!<_}$r|lxK$OW&VjRQ9jCdBM@J647}V"
    "JC295w?gzo=PN2#<YG5s|V<KT%2T^&<NtfZsJ4y6dlTM>87z)+&8k`afkZ<rg!=F*kJCyF2f~XVy@45EObBm#4&GK>gHjqG`"
    "wEU_k@gJbA1_4jv1q1<UO@>DK4D!%Im_@Y87{+%{Wb)ZmLzJkWv)eUS?^lzUp*CB0OZhuqA7S&Yg!ZOW3kVZ}1b=xb{sG_oi"
    "XoogVN$uK2$daT3=3Synb;8=lYON_aP0XH4A6Fky!BpNM}Z2C+~amw4BZX*;od*$M}mFd=TMcAyY_yD@X8v2#ZK8ifOCA0n>"
    "BQF@hnoEBnNvB?DA>IM@B9tsG+E9Mxa6<V<kfr#tFbp~cj3Z)MSY-8cuII~-E2=Er{MwC=vj}2)(^|RRe!~EaO;?48+N__5n"
    "QhqMQK{^FUo&yO~DXBEe>9kb8044(wcUNWBRbXc|4p8Rfj4Oz}!#I0LJfk&5a3!cF4&boz1?hOf7M#u8IjUl#*-)h=&?nhtv"
    "~sup9+)hn#TYwO4{K5v!TiLHrDh|as(~Ze$#ba;J0W{TVzXT#iO(wd5Y{=T*_dk&P%0P8`yS!`FqE7N!osa$yc>67hcn|u@R"
    "UBQ?3(qN|DDI}h_X<mvy7)6n!hf|@=1G$LnB-ufDrY7cu&G+M@jxPEz&~zJ4eC-zRS`@K~9`WMT-lr4OLoj_hRd$XJaE>23R"
    "cgs%Nw<A!Yu*o~{npaNr%|GA*7oYYa;MT<|^OT24TKorY6(P3(d6MJ&k?dlCW}#QXgsy`ZQwhR94jolX+ir{O9tJWD@d+<sy"
    "+vxOf>j|a0FU&0@yE7Q6-AxQOLHkAHYdQt2UXUe3EBeXgftb}~1I^1a<?tY)AA5zEYE?Vx|qg-=LE9S!;(er$w?-fMEs!DGB"
    "Dsim+20{k@Om8ZEf?uKMU?<KaY~c!d48B1A0w_A=wG#lZWW3;6*=$XV41DeebPR(~%Zyi~`kB}l?*UOn3w|CDUECd3ghBl-W"
    "Hf$>co$Uf+K2Rry_C+|F{36!a06M<`j?=3-<hTDFRDI@$Ta{j4dDu<xA0|H(ZW@PLut3I{c;l8$=!W+>T064?oHSDGF!NloP"
    "kj15Eo!K^Na?zR{!U2iv$vOD5T}pmh)aI2f^rlXIL#r+d>nd)o%bTg=yIj(Lh?^5tJa(jC*iLZSJB*9sudn>?u`V@jqKcwRT"
    "5~xZTv1T2`t0QqJ77hPtzaN~Ho{vje_aryE)p6@nOm4-GQqu7O*H87a$bSky8;R6WLF7YRNVLI_f3FY<XoHzCE^OCHtsh9GH"
    "**-xY^c9$Qi+NQ6Cnf6wdq9g12I_a$tFyOMQy7#auP`l1$<cIK=J0jhnL|VUTP{*CJ3#wQd#vp>Qgj-z;cu<?}M#?e``kI#p"
    "LfVHFW+(2E+rB%5BDpq*($=a#1yZHyAv<QIVYgbkuJQi?ohMpkL3?2i2w5Glos-A-_A%}9cl)(C#>X$z_G9TYpt9ui>!-&4Y"
    "B_xv3LB@F8@n)<4r1!QyODlg*c<b7qd<i8J{?=XU!SU^osWKNoI#Fsi~5BK5lQDv=M9icw0gP3;j7^BqcmxSHr<!xqXiYOq^"
    "x)55Va@ijnhQ?)qy>RzyA8Lf^OR>-_C@T>{{REPgrcyS91HMrSvJpNNXYOP%EoZ@~oKuVJn>?Vyo1X&&3DQEm7?-4EaFhQ-c"
    "r5W=?71n{}O!$#>B}JQSga_ysayq~mca=wAPfNeTJy+y4IQ!7jRuwmWaed-|re>EG|^lcwyy24(KIa&Rw{vbX=@e!G8x+&TY"
    "L5ie15&pGMKCsDp&%P<wc1MXKE!Xl{nUDy3DcKGapQKkp&ChmSRofP@5R*Eh}<9IU@5_gNzw!#9CWqc(^XL<Qcsmd0&>xW4{"
    "6RY7zcQn1X!+Vc~uUF}v^dLE-@Rr&l{m4(c!~6RSOwZ$Oe`(iqLIt+Cs|U^Bvj44Pdu<yP#g6;r?nNnZy~h{r1)8R>X6Xdw{"
    "s~&KDRG}t?PMGT2V?(D6E7#p2H7&;n>UM-RK*ue`hCsJB4trZ<L7z)Aid5gO3y#l|I3kdWbO$6>s*{gPi&Dg;YAL~b*Ho{H_"
    "Ua{%XpqLPGfcu?|r#Rukm#>OFy3Bi$98CPoD(V-+u=<f4#8Z+Lc}`?4O3|m(<+!+RXmuN5^6M_4J|nQzre>xUapLr+@vMn&1"
    "Ea2Vhxf3;"
)

# White_Space (PropList.txt): what llama.cpp's `\s` means. Not Python's `\s`, which adds U+001C..U+001F.
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                         0x202F, 0x205F, 0x3000])


@lru_cache(maxsize=1)
def _category_ranges() -> dict[str, list[tuple[int, int]]]:
    """Class letter -> sorted inclusive code point ranges (Unicode 15.1)."""
    raw = zlib.decompress(base64.b85decode("".join(_UNICODE_15_1_RUNS)))
    ranges: dict[str, list[tuple[int, int]]] = {c: [] for c in "LNPSMZCU"}
    start = i = 0
    while i < len(raw):
        n = shift = 0
        while True:
            b = raw[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        cls = chr(raw[i])
        i += 1
        ranges[cls].append((start, start + n - 1))
        start += n
    if start != 0x110000:
        raise AssertionError("corrupt Unicode table")
    return ranges


def _class_body(ranges: Iterable[tuple[int, int]]) -> str:
    """The inside of a `re` character class matching exactly these code point ranges."""
    def esc(c: int) -> str:
        return f"\\U{c:08x}"
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


@lru_cache(maxsize=1)
def _classes() -> dict[str, str]:
    r = _category_ranges()
    ws = sorted(_WHITESPACE)
    return {"L": _class_body(r["L"]), "N": _class_body(r["N"]), "P": _class_body(r["P"]),
            "WS": _class_body((c, c) for c in ws)}


# ---------------------------------------------------------------------------------------------------------------------
# Pre-tokenizers (llama.cpp `llm_tokenizer_bpe` regex lists). Each list is applied in order, every regex splitting the
# pieces of the previous one into matches and the gaps between them. The single-regex ones are the patterns llama.cpp
# runs through its hand-written splitters; those splitters implement the regex (with the alternation `|\s+` the gpt2
# splitter adds implicitly), which is what is compiled here.
# ---------------------------------------------------------------------------------------------------------------------

_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def _pre_regexes(kind: str) -> list[str]:
    c = _classes()
    L, N, P, WS = c["L"], c["N"], c["P"], c["WS"]
    tail = rf"| ?[^{WS}{L}{N}]+[\r\n]*|[{WS}]*[\r\n]+|[{WS}]+(?![^{WS}])|[{WS}]+"
    gpt2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|[{WS}]+(?![^{WS}])|[{WS}]+"
    if kind == "qwen2":
        return [rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}]+|[{N}]{tail}"]
    if kind == "llama3":
        return [rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}{tail}"]
    if kind == "smollm":
        return [rf"[{N}]", gpt2]
    if kind == "gpt2":
        return [gpt2]
    if kind == "default":
        return [rf"[{P}$+<=>^~|]+", gpt2, rf"[{N}]+", r"[0-9][0-9][0-9]"]
    raise AssertionError(kind)


# tokenizer.ggml.pre -> (regex kind, ignore_merges, add_bos default). Names from llama.cpp's llama_vocab::impl::load.
_PRE_TYPES: dict[str, tuple[str, bool, bool]] = {
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"], ("qwen2", False, False)),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    ("smollm", False, False)),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"], ("llama3", True, True)),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False, False)),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"],
                    ("gpt2", False, False)),
    "default": ("default", False, False),
}

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TYPES))


@lru_cache(maxsize=None)
def _compiled_pre(kind: str) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(p) for p in _pre_regexes(kind))


_NEWLINE_RUNS = re.compile(r"\n+|[^\n]+")


def _split_pieces(text: str, regexes: Sequence[re.Pattern]) -> list[str]:
    """llama.cpp `unicode_regex_split`: every regex splits each piece into its matches and the gaps between them."""
    if len(regexes) == 1:
        return regexes[0].findall(text)  # the single-regex patterns match every character: no gaps
    pieces = [text]
    for rx in regexes:
        out: list[str] = []
        for p in pieces:
            last = 0
            for m in rx.finditer(p):
                s, e = m.span()
                if s > last:
                    out.append(p[last:s])
                if e > s:
                    out.append(p[s:e])
                last = e
            if last < len(p):
                out.append(p[last:])
        pieces = out
    return pieces


# GPT-2's byte <-> printable-character table (the byte-level alphabet of `gpt2` vocabularies).
def _byte_to_char() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_to_char()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}
_LATIN1_TO_BYTE_CHARS = {b: c for b, c in enumerate(_BYTE_CHARS)}  # str.translate table over latin-1 decoded bytes


def _byte_level(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp's treatment of invalid UTF-8 (only used by `encode_bytes(errors="replace")`)
# ---------------------------------------------------------------------------------------------------------------------

def _utf8_len(lead: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


def _valid_prefix(data: bytes | memoryview, i: int) -> tuple[str, int]:
    """Decode data[i:] up to its first invalid byte: (text, index of that byte or len(data))."""
    try:
        return codecs.utf_8_decode(data[i:], "strict", True)[0], len(data)
    except UnicodeDecodeError as e:
        return codecs.utf_8_decode(data[i:i + e.start], "strict", True)[0], i + e.start


def _llama_cpts(data: bytes) -> str:
    """llama.cpp `unicode_cpts_from_utf8`: a byte that does not start a well-formed-enough sequence becomes U+FFFD
    and decoding resumes at the next byte; overlong forms and surrogates are accepted as code points (kept here as
    lone surrogates / their value, re-encoded with `surrogatepass` later)."""
    mv = memoryview(data)
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        text, i = _valid_prefix(mv, i)
        out.append(text)
        if i >= n:
            break
        b = data[i]
        # sequence length from the lead byte; every byte after it must be a continuation byte (nothing else is
        # checked: overlong forms and surrogates pass)
        size = 1 if not b & 0x40 else 2 if not b & 0x20 else 3 if not b & 0x10 else 4 if not b & 0x08 else 0
        cpt = None
        if size > 1 and i + size <= n and all(data[i + k] & 0xC0 == 0x80 for k in range(1, size)):
            cpt = b & (0x7F >> size)
            for k in range(1, size):
                cpt = (cpt << 6) | (data[i + k] & 0x3F)
        else:
            size = 1
        if cpt is None:
            out.append("\ufffd")
        elif cpt > 0x10FFFF:
            raise TokenizerError(
                f"input bytes at offset {i} decode to code point U+{cpt:X}, beyond Unicode; llama.cpp cannot "
                "tokenize this either. Fix the file's encoding."
            )
        else:
            out.append(chr(cpt))
        i += size
    return "".join(out)


_OPAQUE_BASE = 0xDC00  # an undecodable byte b travels through the SentencePiece path as chr(0xDC00 + b)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of an undecodable byte
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_SPLIT = re.compile("([\ud800-\udfff])")
_MEMO_MAX_LEN = 64  # longer words/chunks rarely repeat: not worth memoizing


def _llama_spm_chars(data: bytes) -> str:
    """The symbols llama.cpp's SentencePiece tokenizer starts from: one per UTF-8 lead byte (length from the lead
    byte, no validation). A symbol that is not valid UTF-8 can never be a vocabulary piece, so its bytes become
    opaque characters that only byte fallback can emit."""
    mv = memoryview(data)
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        text, i = _valid_prefix(mv, i)
        out.append(text)
        if i >= n:
            break
        size = min(_utf8_len(data[i]), n - i)
        out.append("".join(chr(_OPAQUE_BASE + b) for b in data[i:i + size]))
        i += size
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------------
# Special-token partition (llama.cpp `tokenizer_st_partition`)
# ---------------------------------------------------------------------------------------------------------------------

# Texts up to this many (start, length) pairs find their special tokens by direct lookups instead of the regex.
_DIRECT_SCAN_MAX = 100_000


class _SpecialSplitter:
    """Splits text around special tokens exactly as llama.cpp does: special texts in order of decreasing length
    (ties by id: llama.cpp's unstable sort leaves them unspecified), each cutting every remaining raw fragment at its
    non-overlapping left-to-right occurrences. Only the specials that occur in the text are tried; they are found
    with one trie-shaped regex, searched at every start position so that overlapping occurrences count too."""

    def __init__(self, specials: Mapping[str, int]):
        self.ids = dict(specials)
        self.lengths = sorted({len(t) for t in self.ids})
        self._rx: re.Pattern | None = None
        self._prefix_memo: dict[str, tuple[str, ...]] = {}

    def _regex(self) -> re.Pattern:
        if self._rx is None:
            trie: dict = {}
            for t in self.ids:
                node = trie
                for ch in t:
                    node = node.setdefault(ch, {})
                node[""] = {}

            def emit(node: dict) -> str:
                alts = [re.escape(ch) + emit(sub) for ch, sub in sorted(node.items()) if ch]
                if not alts:
                    return ""
                body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
                # a piece that ends here may also continue: try the longer one first (greedy `?`)
                return f"(?:{body})?" if "" in node else body

            self._rx = re.compile(emit(trie), re.DOTALL)
        return self._rx

    def _prefixes(self, s: str) -> tuple[str, ...]:
        got = self._prefix_memo.get(s)
        if got is None:
            got = tuple(s[:n] for n in self.lengths if n <= len(s) and s[:n] in self.ids)
            if len(self._prefix_memo) < 65536:
                self._prefix_memo[s] = got
        return got

    def split(self, text: str) -> list[str | int]:
        if not self.ids or not text:
            return [text] if text else []
        found: set[str] = set()
        if len(text) * len(self.lengths) <= _DIRECT_SCAN_MAX:
            # Short text: look every (start, length) up directly, the same set without building the regex (~0.2 s
            # for Gemma's thousands of specials).
            ids = self.ids
            for i in range(len(text)):
                for n in self.lengths:
                    if i + n > len(text):
                        break
                    if text[i:i + n] in ids:
                        found.add(text[i:i + n])
        else:
            rx = self._regex()
            pos = 0
            while True:
                m = rx.search(text, pos)
                if m is None:
                    break
                found.update(self._prefixes(m.group()))
                pos = m.start() + 1
        if not found:
            return [text]
        frags: list[str | int] = [text]
        for s in sorted(found, key=lambda t: (-len(t), self.ids[t])):
            tid = self.ids[s]
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(s)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags


# ---------------------------------------------------------------------------------------------------------------------
# BPE merges: HF `tokenizers` when it can hold the merge table exactly, else llama.cpp's loop in Python
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
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import models

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
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------------

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


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's encode/decode semantics. Build with `from_gguf(path)` (reads only the
    metadata) or `from_metadata(md)`."""

    def __init__(self, metadata: Mapping[str, Any]):
        md = metadata
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
        self.model = model
        n = len(tokens)
        # kept for chat templates (fucina_jax.chat_template), which need the file's template and its family
        self.chat_template = _get(md, "tokenizer.chat_template", str)
        self.architecture = _get(md, "general.architecture", str)

        # --- vocabulary kind and flags (llama_vocab::impl::load) ---
        pre_name = _get(md, "tokenizer.ggml.pre", str)
        self.add_eos = False
        self.ignore_merges = False
        if model == "llama":
            self.pre = "default"
            self._kind = "spm"
            self.add_bos, self.add_space_prefix = True, True
            ids = {"bos": 1, "eos": 2, "unk": 0}
        elif model == "gemma4":
            self.pre = "gemma4"
            self._kind = "gemma4"
            self.add_bos, self.add_space_prefix = False, False
            ids = {}
        else:
            if pre_name is None:
                warnings.warn("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                              "(generation quality may degrade: convert the model again)", stacklevel=2)
                pre_name = "default"
            if pre_name not in _PRE_TYPES:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {pre_name!r} for a gpt2 (BPE) vocabulary; supported: "
                    f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}"
                )
            self.pre = pre_name
            self._kind, self.ignore_merges, self.add_bos = _PRE_TYPES[pre_name]
            self.add_space_prefix = False
            ids = {"bos": 11, "eos": 11}  # llama.cpp's BPE defaults (GPT-2 style files always override them)
        self.add_space_prefix = bool(_get(md, "tokenizer.ggml.add_space_prefix", bool, self.add_space_prefix))

        # --- tokens, scores, types ---
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
        self._texts = texts
        try:
            self._scores = array.array("d", scores[:n] if scores is not None else bytes(8 * n))
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
        self._token_to_id = token_to_id
        if types is not None:
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
            self._types = tuple(type_ids.tolist())
        else:
            attrs = [int(TokenAttr.NORMAL)] * n
            self._types = (int(TokenType.NORMAL),) * n

        # --- special ids: family defaults, then metadata ---
        special = {k: None for k in _ID_KEYS}
        for k, v in ids.items():
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
                warnings.warn(f"{key} = {v} is outside the vocabulary of {n} tokens; ignored", stacklevel=2)

        v = _get(md, "tokenizer.ggml.add_bos_token", bool)
        if v is not None:
            self.add_bos = v
        v = _get(md, "tokenizer.ggml.add_eos_token", bool)
        if v is not None:
            self.add_eos = v
        if self._kind == "gemma4":
            self.add_bos = True  # llama.cpp forces it for Gemma 4 (PR #21500)

        # --- control-looking tokens, found by text (llama.cpp does the same, "obviously not ideal") ---
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

        self._attrs = attrs
        self._special = special
        self._eog = frozenset(eog)
        specials_all = {texts[i]: i for i in np.flatnonzero(np.asarray(attrs, np.int64) & int(_SPECIAL_ATTRS)).tolist()}
        specials_text = {t: i for t, i in specials_all.items() if not attrs[i] & _HIDDEN_ATTRS}
        self._splitters = {True: _SpecialSplitter(specials_all), False: _SpecialSplitter(specials_text)}

        # --- the merge engine ---
        self._bpe = None
        self.bpe_engine: str | None = None  # "hf" or "python" for BPE vocabularies
        self._spm_bigrams: np.ndarray | None = None
        self._spm_memo: dict[str, tuple[int, ...]] = {}
        if self._kind != "spm":
            merges_raw = md.get("tokenizer.ggml.merges")
            if merges_raw is None:
                raise TokenizerError(f"a {model} vocabulary needs tokenizer.ggml.merges, which this GGUF lacks; "
                                     "convert the model again")
            if not isinstance(merges_raw, list) or not all(isinstance(m, str) for m in merges_raw):
                raise TokenizerError("tokenizer.ggml.merges must be a list of strings; the GGUF is malformed")
            self._bpe = self._build_bpe(merges_raw)
        self._pieces: list[bytes] | None = None
        self._pieces_plain: list[bytes] | None = None

    # ----------------------------------------------------------------------------------------------- construction

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        return cls(metadata)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read only the metadata of a GGUF file (no tensor is touched)."""
        from fucina_jax.gguf_io import read_metadata

        return cls(read_metadata(path))

    def _build_bpe(self, merges_raw: list[str]):
        ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(merges_raw):
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if pos < 0:
                continue
            pair = (m[:pos], m[pos + 1:])
            ranks.setdefault(pair, rank)  # llama.cpp's emplace keeps the first rank of a repeated pair
        vocab = self._token_to_id
        byte_encode = self._kind != "gemma4"
        if byte_encode:
            def fallback(piece: str) -> list[int]:
                # llama.cpp looks each byte of the piece's text up as a one-byte token
                out = []
                for b in piece.encode("utf-8"):
                    tid = vocab.get(chr(b)) if b < 0x80 else None
                    if tid is not None:
                        out.append(tid)
                return out
        else:
            def fallback(piece: str) -> list[int]:
                out = []
                for b in piece.encode("utf-8", "surrogatepass"):
                    tid = vocab.get(f"<0x{b:02X}>")
                    if tid is not None:
                        out.append(tid)
                return out
        self._bpe_py = _PyBPE(ranks, vocab, fallback, self.ignore_merges)
        self.bpe_engine = "python"
        # HF's BPE holds the same table only if every merge's parts and result are tokens (llama.cpp tolerates
        # others) and, for gemma4, all 256 <0xXX> tokens exist (HF would emit its unk token where llama.cpp skips
        # a missing byte).
        ordered = sorted(ranks.items(), key=lambda kv: kv[1])
        if any(a not in vocab or b not in vocab or a + b not in vocab for (a, b), _ in ordered):
            return self._bpe_py
        if not byte_encode and any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return self._bpe_py
        try:
            hf = _HfBPE(vocab, [pair for pair, _ in ordered], byte_fallback=not byte_encode,
                        ignore_merges=self.ignore_merges)
        except Exception:  # noqa: BLE001 - HF rejects the table for a reason of its own: stay exact in Python
            return self._bpe_py
        self.bpe_engine = "hf"
        return hf

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
            if self._kind == "spm":
                prefix = " " if self.add_space_prefix and prev_special else ""
                if raw is None:
                    chars = (prefix + f).replace(" ", "\u2581")
                else:
                    chars = _llama_spm_chars((prefix.encode() + raw).replace(b" ", "\u2581".encode()))
                out.extend(self._spm_fragment(chars))
            else:
                out.extend(self._bpe_fragment(f if raw is None else _llama_cpts(raw)))
            prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise TokenizerError("the vocabulary asks for an EOS token but defines none (no eos_token_id)")
            out.append(self.eos_id)
        return out

    # --- BPE fragments ---

    def _bpe_fragment(self, text: str) -> list[int]:
        if self._kind == "gemma4":
            return self._gemma4_fragment(text)
        words = [_byte_level(w) for w in _split_pieces(text, _compiled_pre(self._kind))]
        return self._bpe.encode_words(words)

    def _gemma4_fragment(self, text: str) -> list[int]:
        out: list[int] = []
        batch: list[str] = []
        vocab = self._token_to_id
        for w in _NEWLINE_RUNS.findall(text.replace(" ", "\u2581")):
            if w[0] == "\n" and w in vocab:
                # llama.cpp PR #21343: a newline run that is itself a token is emitted whole, merges or not
                out.extend(self._bpe.encode_words(batch))
                batch = []
                out.append(vocab[w])
            elif _SURROGATE.search(w):
                # a surrogate from invalid input (errors="replace") can merge with nothing: cut the word there
                for part in _SURROGATE_SPLIT.split(w):
                    if len(part) == 1 and 0xD800 <= ord(part) <= 0xDFFF:
                        out.extend(self._bpe.encode_words(batch))
                        batch = []
                        out.extend(self._bpe_py.fallback(part))
                    elif part:
                        batch.append(part)
            else:
                batch.append(w)
        out.extend(self._bpe.encode_words(batch))
        return out

    # --- SentencePiece fragments ---

    def _spm_fragment(self, text: str) -> list[int]:
        out: list[int] = []
        memo = self._spm_memo
        for chunk in self._spm_chunks(text):
            got = memo.get(chunk)
            if got is None:
                got = tuple(self._spm_chunk(chunk))
                if len(chunk) <= _MEMO_MAX_LEN:
                    if len(memo) > 200_000:
                        memo.clear()
                    memo[chunk] = got
            out.extend(got)
        return out

    def _spm_chunks(self, text: str) -> list[str]:
        """Cut `text` wherever two adjacent characters occur together in no vocabulary piece: no merge can cross
        such a point, so the merge loop runs on each chunk independently and the result is the same as on the
        whole fragment (which is what llama.cpp does), but chunks repeat and are memoized."""
        n = len(text)
        if n < _SPM_CHUNK_MIN:  # short text: one chunk, and no need to build the bigram table (~0.15 s)
            return [text] if text else []
        if self._spm_bigrams is None:
            self._spm_bigrams = self._vocab_bigrams()
        big = self._spm_bigrams
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
        keys = (cps[:-1] << 21) | cps[1:]
        idx = np.searchsorted(big, keys)
        idx[idx == len(big)] = 0
        cuts = (np.flatnonzero(big[idx] != keys) + 1).tolist()
        bounds = [0, *cuts, n]
        return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _vocab_bigrams(self) -> np.ndarray:
        """Sorted keys (c1 << 21 | c2) of every adjacent character pair inside any vocabulary string."""
        texts = self._texts
        lens = np.array(list(map(len, texts)), dtype=np.int64)
        cps = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
        if len(cps) < 2:
            return np.zeros(0, dtype=np.int64)
        keys = (cps[:-1] << 21) | cps[1:]
        inside = np.ones(len(keys), dtype=bool)
        ends = np.cumsum(lens)[:-1] - 1  # pair positions that straddle two vocabulary strings
        inside[ends[(ends >= 0) & (ends < len(keys))]] = False
        return np.unique(keys[inside])

    def _spm_chunk(self, chunk: str) -> list[int]:
        """llama.cpp `llm_tokenizer_spm_session::tokenize` on one chunk: repeatedly merge the adjacent pair whose
        concatenation is the highest-scoring vocabulary piece (ties to the leftmost); pieces left that are not
        tokens are emitted as bytes."""
        vocab, scores = self._token_to_id, self._scores
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
                out.extend(self._spm_byte_tokens(s))
        return out

    def _spm_byte_tokens(self, piece: str) -> list[int]:
        out = []
        for c in piece:
            o = ord(c)
            bs = bytes([o - _OPAQUE_BASE]) if _OPAQUE_BASE <= o <= _OPAQUE_BASE + 0xFF else c.encode("utf-8")
            for b in bs:
                tid = self._token_to_id.get(f"<0x{b:02X}>")
                if tid is None and b < 0x80:
                    tid = self._token_to_id.get(chr(b))
                if tid is None:
                    raise TokenizerError(
                        f"byte 0x{b:02X} has no token in this SentencePiece vocabulary (no <0x{b:02X}> piece), so "
                        "the text cannot be encoded; llama.cpp fails on it too"
                    )
                out.append(tid)
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
