"""Text -> pieces, the way llama.cpp's `src/llama-vocab.cpp` and `src/unicode.cpp` cut it before any merge: the
Unicode categories and pre-tokenizer regexes of byte-level BPE vocabularies, GPT-2's byte-level alphabet, llama.cpp's
decoding of invalid UTF-8 and the split around special tokens.

The regex split is done here with Python `re` over character classes built from the same Unicode 15.1 categories
llama.cpp uses (HF's regex engine has its own Unicode tables, and this way the surrogates llama.cpp decodes from
invalid input are handled too).
"""

from __future__ import annotations

import base64
import codecs
import re
import zlib
from functools import lru_cache
from typing import Callable, Iterable, Mapping, Sequence

from fucina_jax.errors import TokenizerError

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

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TYPES))


@lru_cache(maxsize=None)
def _compiled_pre(kind: str) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(p) for p in _pre_regexes(kind))


# gemma4 vocabularies split their text only into newline runs and the rest
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


def _lenient_decode(data: bytes, invalid: Callable[[bytes, int], tuple[str, int]]) -> str:
    """Decode UTF-8 `data`, handing every offset where strict decoding stops to `invalid(data, offset)`, which returns
    the characters llama.cpp makes of the bytes there and how many bytes they take."""
    mv = memoryview(data)
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        text, i = _valid_prefix(mv, i)
        out.append(text)
        if i >= n:
            break
        text, size = invalid(data, i)
        out.append(text)
        i += size
    return "".join(out)


def _llama_cpt_at(data: bytes, i: int) -> tuple[str, int]:
    """The code point llama.cpp decodes at data[i], where strict decoding stopped, and its length in bytes."""
    b = data[i]
    # sequence length from the lead byte; every byte after it must be a continuation byte (nothing else is
    # checked: overlong forms and surrogates pass)
    size = 1 if not b & 0x40 else 2 if not b & 0x20 else 3 if not b & 0x10 else 4 if not b & 0x08 else 0
    if not (size > 1 and i + size <= len(data) and all(data[i + k] & 0xC0 == 0x80 for k in range(1, size))):
        return "\ufffd", 1
    cpt = b & (0x7F >> size)
    for k in range(1, size):
        cpt = (cpt << 6) | (data[i + k] & 0x3F)
    if cpt > 0x10FFFF:
        raise TokenizerError(
            f"input bytes at offset {i} decode to code point U+{cpt:X}, beyond Unicode; llama.cpp cannot "
            "tokenize this either. Fix the file's encoding."
        )
    return chr(cpt), size


def _llama_cpts(data: bytes) -> str:
    """llama.cpp `unicode_cpts_from_utf8`: a byte that does not start a well-formed-enough sequence becomes U+FFFD
    and decoding resumes at the next byte; overlong forms and surrogates are accepted as code points (kept here as
    lone surrogates / their value, re-encoded with `surrogatepass` later)."""
    return _lenient_decode(data, _llama_cpt_at)


_OPAQUE_BASE = 0xDC00  # an undecodable byte b travels through the SentencePiece path as chr(0xDC00 + b)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of an undecodable byte
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_SPLIT = re.compile("([\ud800-\udfff])")
_MEMO_MAX_LEN = 64  # longer words/chunks rarely repeat: not worth memoizing


def _opaque_symbol_at(data: bytes, i: int) -> tuple[str, int]:
    """The invalid symbol at data[i] as opaque characters, and its length in bytes."""
    size = min(_utf8_len(data[i]), len(data) - i)
    return "".join(chr(_OPAQUE_BASE + b) for b in data[i:i + size]), size


def _llama_spm_chars(data: bytes) -> str:
    """The symbols llama.cpp's SentencePiece tokenizer starts from: one per UTF-8 lead byte (length from the lead
    byte, no validation). A symbol that is not valid UTF-8 can never be a vocabulary piece, so its bytes become
    opaque characters that only byte fallback can emit."""
    return _lenient_decode(data, _opaque_symbol_at)


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

