"""Dequantization of GGUF tensor types to float32, vectorised in NumPy.

Each kernel reads a chunk of raw blocks (`uint8[n, type_size]`) and writes `float32[n, block_size]` in place, following
the block layouts and the float operation order of llama.cpp (`ggml-common.h` structs, `dequantize_row_*` in
`ggml-quants.c`). Keeping the C operation order (e.g. `(d * scale) * q - d_min * min`, all in float32) makes the result
bitwise equal to llama.cpp's and to `gguf.quants.dequantize`; integer parts (nibbles, high bits, 6-bit scales) are
assembled in uint8/int8 arithmetic, which is exact.

Memory: the output is allocated once; the raw bytes (usually a read-only memmap) are walked in chunks of about
`CHUNK_ELEMENTS` output values, so temporaries stay a few MiB regardless of the tensor size.

Types with their own kernel are `NATIVE_TYPES`. The codebook i-quants (IQ1_S, IQ1_M, IQ2_*, IQ3_*) need large lattice
tables; they are delegated to `gguf.quants` (slower, same results). Everything else (integer and F64 tensors,
the activation-only Q8_1/Q8_K, types newer than the installed gguf) raises `UnsupportedTensorTypeError`.

`BLOCK_LAYOUTS` describes each type's block (elements per block, bytes per block, byte fields and the value formula)
for code that repacks quantized weights instead of dequantizing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fucina_jax.errors import TensorShapeError, UnsupportedTensorTypeError

__all__ = [
    "BLOCK_LAYOUTS",
    "BlockField",
    "BlockLayout",
    "CHUNK_ELEMENTS",
    "E8M0_HALF",
    "FALLBACK_TYPES",
    "KVALUES_IQ4NL",
    "KVALUES_MXFP4",
    "NATIVE_TYPES",
    "QK_K",
    "SUPPORTED_TYPES",
    "UE4M3_HALF",
    "block_layout",
    "dequantize",
    "dequantize_blocks",
]

T = GGMLQuantizationType
QK_K = 256  # elements in a K-quant / i-quant super-block

# About this many float32 outputs (2 MiB) per chunk: big enough to amortise NumPy call overhead, small enough that
# the uint8/int8 temporaries of a chunk stay in cache. Measured: 2^17..2^20 are within 10% of each other, 2^15 and
# 2^21 slower.
CHUNK_ELEMENTS = 1 << 19


# --------------------------------------------------------------------------------------------------------------------
# Block layouts
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockField:
    """One field of a block: `size` bytes at byte `offset`, holding `count` items of NumPy dtype `dtype`."""

    name: str
    offset: int
    size: int
    dtype: str  # little-endian NumPy dtype string of one item ('<f2', '|u1', '|i1', '<u2', '<u4', '<f4')
    doc: str

    @property
    def count(self) -> int:
        return self.size // np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BlockLayout:
    """A GGML type's storage: `block_size` values in `type_size` bytes, laid out as `fields` (which tile the block)."""

    qtype: GGMLQuantizationType
    block_size: int
    type_size: int
    fields: tuple[BlockField, ...]
    formula: str  # how value e of the block is computed from the fields

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def field(self, name: str) -> BlockField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.qtype.name} blocks have no field {name!r} (fields: {[f.name for f in self.fields]})")

    def nbytes(self, n_elements: int) -> int:
        """Bytes that `n_elements` values occupy (`n_elements` must be a whole number of blocks)."""
        if n_elements % self.block_size:
            raise ValueError(f"{n_elements} is not a multiple of the {self.qtype.name} block size {self.block_size}")
        return n_elements // self.block_size * self.type_size


def _layout(
    qtype: GGMLQuantizationType, block_size: int, formula: str, *fields: tuple[str, int, str, str]
) -> BlockLayout:
    out, offset = [], 0
    for name, size, dtype, doc in fields:
        out.append(BlockField(name, offset, size, dtype, doc))
        offset += size
    return BlockLayout(qtype, block_size, offset, tuple(out), formula)


_DT_F16 = "<f2"
_DT_U8 = "|u1"
_DT_I8 = "|i1"

# e = index of the value inside its block throughout. "nibble(b, h)" is the low (h=0) or high (h=1) 4 bits of byte b.
BLOCK_LAYOUTS: dict[GGMLQuantizationType, BlockLayout] = {
    layout.qtype: layout
    for layout in (
        _layout(T.F32, 1, "y = x", ("x", 4, "<f4", "value")),
        _layout(T.F16, 1, "y = float(x)", ("x", 2, _DT_F16, "value")),
        _layout(T.BF16, 1, "y = bits(x) << 16 as float32", ("x", 2, "<u2", "upper half of a float32")),
        _layout(
            T.Q4_0, 32, "y = (nibble(qs[e % 16], e // 16) - 8) * d",
            ("d", 2, _DT_F16, "scale"),
            ("qs", 16, _DT_U8, "4-bit quants: low nibbles are e 0..15, high nibbles e 16..31"),
        ),
        _layout(
            T.Q4_1, 32, "y = nibble(qs[e % 16], e // 16) * d + m",
            ("d", 2, _DT_F16, "scale"), ("m", 2, _DT_F16, "offset (block minimum)"),
            ("qs", 16, _DT_U8, "4-bit quants: low nibbles are e 0..15, high nibbles e 16..31"),
        ),
        _layout(
            T.Q5_0, 32, "y = ((nibble(qs[e % 16], e // 16) | bit(qh, e) << 4) - 16) * d",
            ("d", 2, _DT_F16, "scale"), ("qh", 4, "<u4", "5th bit of quant e is bit e"),
            ("qs", 16, _DT_U8, "low 4 bits: low nibbles are e 0..15, high nibbles e 16..31"),
        ),
        _layout(
            T.Q5_1, 32, "y = (nibble(qs[e % 16], e // 16) | bit(qh, e) << 4) * d + m",
            ("d", 2, _DT_F16, "scale"), ("m", 2, _DT_F16, "offset (block minimum)"),
            ("qh", 4, "<u4", "5th bit of quant e is bit e"),
            ("qs", 16, _DT_U8, "low 4 bits: low nibbles are e 0..15, high nibbles e 16..31"),
        ),
        _layout(T.Q8_0, 32, "y = qs[e] * d", ("d", 2, _DT_F16, "scale"), ("qs", 32, _DT_I8, "8-bit quants")),
        _layout(
            T.Q2_K, QK_K,
            "e = 128*h + 32*j + r: y = (d * (scales[e//16] & 15)) * ((qs[32*h + r] >> 2*j) & 3)"
            " - dmin * (scales[e//16] >> 4)",
            ("scales", 16, _DT_U8, "per 16 values: low nibble scale, high nibble min"),
            ("qs", 64, _DT_U8, "2-bit quants, four per byte"),
            ("d", 2, _DT_F16, "super-block scale of the scales"), ("dmin", 2, _DT_F16, "super-block scale of the mins"),
        ),
        _layout(
            T.Q3_K, QK_K,
            "e = 128*h + 32*j + r: y = (d * (s6[e//16] - 32)) * (((qs[32*h + r] >> 2*j) & 3)"
            " - (0 if hmask[e % 32] >> (e // 32) & 1 else 4))",
            ("hmask", 32, _DT_U8, "high (3rd) bit of quant e is bit e//32 of hmask[e%32]"),
            ("qs", 64, _DT_U8, "low 2 bits, four per byte"),
            ("scales", 12, _DT_U8, "16 6-bit scales s6[i]: low 4 bits from bytes 0..7 (low nibble i<8, high i>=8), "
                                "high 2 bits from bits 2*(i//4) of byte 8 + i%4"),
            ("d", 2, _DT_F16, "super-block scale"),
        ),
        _layout(
            T.Q4_K, QK_K,
            "e = 64*j + 32*h + r, b = e//32: y = (d * sc6[b]) * nibble(qs[32*j + r], h) - dmin * m6[b]",
            ("d", 2, _DT_F16, "super-block scale of the scales"), ("dmin", 2, _DT_F16, "super-block scale of the mins"),
            ("scales", 12, _DT_U8, "8 (scale, min) 6-bit pairs, packed as in get_scale_min_k4"),
            ("qs", 128, _DT_U8, "4-bit quants"),
        ),
        _layout(
            T.Q5_K, QK_K,
            "e = 64*j + 32*h + r, b = e//32: y = (d * sc6[b]) * (nibble(qs[32*j + r], h)"
            " + 16 * (qh[r] >> b & 1)) - dmin * m6[b]",
            ("d", 2, _DT_F16, "super-block scale of the scales"), ("dmin", 2, _DT_F16, "super-block scale of the mins"),
            ("scales", 12, _DT_U8, "8 (scale, min) 6-bit pairs, packed as in get_scale_min_k4"),
            ("qh", 32, _DT_U8, "5th bit of quant e is bit e//32 of qh[e%32]"),
            ("qs", 128, _DT_U8, "low 4 bits"),
        ),
        _layout(
            T.Q6_K, QK_K,
            "e = 128*h + 32*k + r: q = nibble(ql[64*h + 32*(k&1) + r], k>>1) | ((qh[32*h + r] >> 2*k) & 3) << 4;"
            " y = (d * scales[e//16]) * (q - 32)",
            ("ql", 128, _DT_U8, "low 4 bits"), ("qh", 64, _DT_U8, "high 2 bits, four per byte"),
            ("scales", 16, _DT_I8, "signed 8-bit scale per 16 values"), ("d", 2, _DT_F16, "super-block scale"),
        ),
        _layout(
            T.IQ4_NL, 32, "y = d * KVALUES_IQ4NL[nibble(qs[e % 16], e // 16)]",
            ("d", 2, _DT_F16, "scale"), ("qs", 16, _DT_U8, "4-bit indices into a non-linear 16-entry table"),
        ),
        _layout(
            T.IQ4_XS, QK_K,
            "b = e//32, ls = nibble(scales_l[b//2], b%2) | ((scales_h >> 2*b) & 3) << 4:"
            " y = (d * (ls - 32)) * KVALUES_IQ4NL[nibble(qs[16*b + e%16], (e%32)//16)]",
            ("d", 2, _DT_F16, "super-block scale"), ("scales_h", 2, "<u2", "high 2 bits of the 8 sub-block scales"),
            ("scales_l", 4, _DT_U8, "low 4 bits of the 8 sub-block scales"), ("qs", 128, _DT_U8, "4-bit table indices"),
        ),
        _layout(
            T.TQ1_0, QK_K,
            "ternary: trit n of byte b is ((b * 3^n mod 256) * 3) >> 8; y = (trit - 1) * d",
            ("qs", 48, _DT_U8, "5 trits per byte (values 0..159 from bytes 0..31, 160..239 from bytes 32..47)"),
            ("qh", 4, _DT_U8, "4 trits per byte (values 240..255)"), ("d", 2, _DT_F16, "scale"),
        ),
        _layout(
            T.TQ2_0, QK_K, "e = 128*h + 32*j + r: y = (((qs[32*h + r] >> 2*j) & 3) - 1) * d",
            ("qs", 64, _DT_U8, "2-bit ternary codes, four per byte"), ("d", 2, _DT_F16, "scale"),
        ),
        _layout(
            T.MXFP4, 32, "y = KVALUES_MXFP4[nibble(qs[e % 16], e // 16)] * 2^(e8 - 128)",
            ("e", 1, _DT_U8, "E8M0 shared exponent"), ("qs", 16, _DT_U8, "E2M1 codes"),
        ),
        _layout(
            T.NVFP4, 64, "s = e//16: y = KVALUES_MXFP4[nibble(qs[8*s + e%8], (e%16)//8)] * ue4m3(d[s]) / 2",
            ("d", 4, _DT_U8, "UE4M3 scale per 16 values"), ("qs", 32, _DT_U8, "E2M1 codes"),
        ),
    )
}


def block_layout(qtype: GGMLQuantizationType | int | str) -> BlockLayout:
    """The block layout of a type that has a native kernel (see `BLOCK_LAYOUTS`)."""
    qtype = _as_qtype(qtype)
    try:
        return BLOCK_LAYOUTS[qtype]
    except KeyError:
        raise UnsupportedTensorTypeError(
            f"no block layout is described for {qtype.name}; described: {_names(BLOCK_LAYOUTS)}"
        ) from None


# --------------------------------------------------------------------------------------------------------------------
# Tables and small helpers
# --------------------------------------------------------------------------------------------------------------------

# Non-linear 4-bit levels of IQ4_NL / IQ4_XS (ggml-common.h kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# E2M1 values times two (ggml-common.h kvalues_mxfp4); the scale decoders below halve to compensate.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _e8m0_half_table() -> np.ndarray:
    """float32[256]: 2^(x - 128), the E8M0 exponent halved; x = 0, 1 give the subnormals 2^-128, 2^-127."""
    x = np.arange(256, dtype=np.uint32)
    bits = np.where(x < 2, np.uint32(0x00200000) << x, (x - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def _ue4m3_half_table() -> np.ndarray:
    """float32[256]: half the value of an unsigned E4M3 byte (bias 7, bit 7 ignored); 0x00 and 0x7F decode to 0."""
    x = np.arange(256)
    exp, man = (x >> 3) & 15, (x & 7).astype(np.float32)
    # Every value is a small dyadic rational, so these float32 expressions are exact (no rounding to match).
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1 + man / 8, exp - 7)).astype(np.float32)
    raw[(x == 0) | (x == 0x7F)] = 0
    return (raw * np.float32(0.5)).astype(np.float32)


E8M0_HALF = _e8m0_half_table()
UE4M3_HALF = _ue4m3_half_table()
_U8 = np.uint8
_SHIFT2 = np.array([0, 2, 4, 6], np.uint8)  # the four 2-bit fields of a byte, lowest first
_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)

# NumPy performance notes that shape the kernels below (measured, NumPy 2.4 on x86-64):
# - An op over a whole chunk `c` (contiguous) runs at memory speed; an op over a column slice such as `c[:, 2:18]`
#   pays a per-row overhead (~5 ns a block). So nibbles are split over the whole chunk and then copied out once.
# - uint8 `<<` is not vectorised (15x slower than `>>`); `x * 2**k` gives the same bits (uint8 wraps) at full speed.
# - Integer offsets (q - 8, q - 16, ...) are applied in uint8/int8 before the single int -> float32 conversion.
# - `np.take(table, idx)` is several times faster than `table[idx]` for small lookup tables.


def _f16(c: np.ndarray, offset: int) -> np.ndarray:
    """The f16 at `offset` of every block, as float32 `[n, 1]` (exact widening)."""
    return c[:, offset : offset + 2].view("<f2").astype(np.float32)


def _nibbles(c: np.ndarray, start: int, stop: int, group: int) -> np.ndarray:
    """Bytes `c[:, start:stop]` in groups of `group` -> uint8 `[n, 2*(stop-start)]`: per group, lows then highs."""
    n = c.shape[0]
    out = np.empty((n, (stop - start) // group, 2, group), np.uint8)
    out[:, :, 0] = (c & _U8(15))[:, start:stop].reshape(n, -1, group)
    out[:, :, 1] = (c >> _U8(4))[:, start:stop].reshape(n, -1, group)
    return out.reshape(n, -1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """uint8 `[n, g, 32]` -> `[n, g*128]`: 2-bit field j of byte r of group g is value 128*g + 32*j + r."""
    n, g, w = q.shape
    out = np.empty((n, g, 4, w), np.uint8)
    for j in range(4):
        np.right_shift(q, _U8(2 * j), out=out[:, :, j])
    out &= _U8(3)
    return out.reshape(n, g * 4 * w)


def _bit_planes(h: np.ndarray) -> np.ndarray:
    """uint8 `[n, 32]` -> `[n, 256]` of 0/1: bit b of byte r is value 32*b + r (K-quant high-bit masks)."""
    out = np.empty((h.shape[0], 8, 32), np.uint8)
    for b in range(8):  # 4x faster than np.unpackbits along a middle axis
        np.right_shift(h, _U8(b), out=out[:, b])
    out &= _U8(1)
    return out.reshape(h.shape[0], 256)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into 8 6-bit scales and 8 6-bit mins (uint8 `[n, 8]` each)."""
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    # sub-blocks 0..3 keep their 6 bits whole; 4..7 take 4 bits from bytes 8..11 and the top 2 bits of bytes 0..7.
    np.bitwise_and(s[:, 0:4], _U8(63), out=sc[:, :4])
    np.bitwise_and(s[:, 4:8], _U8(63), out=mn[:, :4])
    sc[:, 4:] = (s[:, 8:12] & _U8(15)) | (s[:, 0:4] >> _U8(6)) * _U8(16)
    mn[:, 4:] = (s[:, 8:12] >> _U8(4)) | (s[:, 4:8] >> _U8(6)) * _U8(16)
    return sc, mn


# --------------------------------------------------------------------------------------------------------------------
# Kernels: c = uint8[n, type_size] raw blocks, o = float32[n, block_size] output (written in place)
# --------------------------------------------------------------------------------------------------------------------


def _q8_0(c: np.ndarray, o: np.ndarray) -> None:
    o[...] = c[:, 2:].view(np.int8)
    o *= _f16(c, 0)


def _q4_0(c: np.ndarray, o: np.ndarray) -> None:
    q = _nibbles(c, 2, 18, 16)
    q -= _U8(8)  # wraps to the right int8 value
    o[...] = q.view(np.int8)
    o *= _f16(c, 0)


def _q4_1(c: np.ndarray, o: np.ndarray) -> None:
    o[...] = _nibbles(c, 4, 20, 16)
    o *= _f16(c, 0)
    o += _f16(c, 2)


def _q5_quants(c: np.ndarray, qh: int, qs: int) -> np.ndarray:
    """5-bit quants uint8 `[n, 32]`: nibbles of the 16 bytes at `qs` plus, as bit 4, bit e of the LE word at `qh`."""
    q = _nibbles(c, qs, qs + 16, 16)
    high = np.unpackbits(c[:, qh : qh + 4], axis=1, bitorder="little")
    high *= _U8(16)
    q |= high
    return q


def _q5_0(c: np.ndarray, o: np.ndarray) -> None:
    q = _q5_quants(c, 2, 6)
    q -= _U8(16)
    o[...] = q.view(np.int8)
    o *= _f16(c, 0)


def _q5_1(c: np.ndarray, o: np.ndarray) -> None:
    o[...] = _q5_quants(c, 4, 8)
    o *= _f16(c, 0)
    o += _f16(c, 2)


def q2_k_scales(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K blocks [n, 84] -> (d * sc, dmin * m), float32 [n, 16] each: a value is d * sc * q - dmin * m per 16
    values (C computes each product first, in float)."""
    sc = c[:, 0:16]
    return _f16(c, 80) * (sc & _U8(15)), _f16(c, 82) * (sc >> _U8(4))


def _q2_k(c: np.ndarray, o: np.ndarray) -> None:
    n = c.shape[0]
    dl, ml = q2_k_scales(c)
    o3 = o.reshape(n, 16, 16)
    o3[...] = _crumbs(c[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16)
    o3 *= dl[:, :, None]
    o3 -= ml[:, :, None]


def q3_k_scales(c: np.ndarray) -> np.ndarray:
    """Q3_K blocks [n, 110] -> sub-block scales int8 [n, 16] in -32..31; a value is fp16 d (bytes 108-109) * scale *
    quant (q3_k_quants), per 16 values."""
    n = c.shape[0]
    s = c[:, 96:108]
    low = np.empty((n, 16), np.uint8)
    np.bitwise_and(s[:, 0:8], _U8(15), out=low[:, :8])
    np.right_shift(s[:, 0:8], _U8(4), out=low[:, 8:])
    high = _crumbs(s[:, None, 8:12]).reshape(n, 16)  # scale i: bits 2*(i//4) of byte 8 + i%4
    high *= _U8(16)
    return (low | high).view(np.int8) - np.int8(32)


def q3_k_quants(c: np.ndarray) -> np.ndarray:
    """Q3_K blocks [n, 110] -> quants int8 [n, 256] in -4..3."""
    n = c.shape[0]
    # quant = low 2 bits - 4 unless the high bit is set, i.e. low + 4*hbit - 4, in int8.
    q = _crumbs(c[:, 32:96].reshape(n, 2, 32))
    hbit = _bit_planes(c[:, 0:32])
    hbit *= _U8(4)
    q += hbit
    q -= _U8(4)
    return q.view(np.int8)


def _q3_k(c: np.ndarray, o: np.ndarray) -> None:
    dl = _f16(c, 108) * q3_k_scales(c)  # float32 [n, 16]
    o3 = o.reshape(c.shape[0], 16, 16)
    o3[...] = q3_k_quants(c).reshape(-1, 16, 16)
    o3 *= dl[:, :, None]


def _q45_k(c: np.ndarray, o: np.ndarray, q: np.ndarray) -> None:
    """Shared tail of Q4_K/Q5_K: y = (d * sc) * q - dmin * m per 32-value sub-block."""
    n = c.shape[0]
    sc, mn = _scale_min_k4(c[:, 4:16])
    o3 = o.reshape(n, 8, 32)
    o3[...] = q.reshape(n, 8, 32)
    o3 *= (_f16(c, 0) * sc)[:, :, None]
    o3 -= (_f16(c, 2) * mn)[:, :, None]


def _q4_k(c: np.ndarray, o: np.ndarray) -> None:
    _q45_k(c, o, _nibbles(c, 16, 144, 32))  # byte 32*j + r holds values 64*j + r (low) and 64*j + 32 + r (high)


def _q5_k(c: np.ndarray, o: np.ndarray) -> None:
    q = _nibbles(c, 48, 176, 32)
    high = _bit_planes(c[:, 16:48])
    high *= _U8(16)
    q |= high
    _q45_k(c, o, q)


def _q6_k(c: np.ndarray, o: np.ndarray) -> None:
    n = c.shape[0]
    # Per 128-value half: ql bytes 32*(k&1) + r, nibble k>>1, give value 32*k + r; qh byte r, bits 2k..2k+1, its top.
    q = _nibbles(c, 0, 128, 64)
    high = _crumbs(c[:, 128:192].reshape(n, 2, 32))
    high *= _U8(16)
    q |= high
    q -= _U8(32)
    ds = _f16(c, 208) * c[:, 192:208].view(np.int8)  # float32 [n, 16]: (d * scale) first, as in C
    o3 = o.reshape(n, 16, 16)
    o3[...] = q.view(np.int8).reshape(n, 16, 16)
    o3 *= ds[:, :, None]


def _iq4_nl(c: np.ndarray, o: np.ndarray) -> None:
    o[...] = np.take(KVALUES_IQ4NL, _nibbles(c, 2, 18, 16))
    o *= _f16(c, 0)


def iq4_xs_scales(c: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [n, 136] -> the 8 sub-block scales ls - 32 (int8 [n, 8], -32..31) of 32 values each."""
    n = c.shape[0]
    sl = c[:, 4:8]
    ls = np.empty((n, 4, 2), np.uint8)  # sub-block b = 2*i + h: nibble h of scales_l[i]
    np.bitwise_and(sl, _U8(15), out=ls[:, :, 0])
    np.right_shift(sl, _U8(4), out=ls[:, :, 1])
    sh = c[:, 2:4].view("<u2")  # [n, 1]
    high = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    ls = ls.reshape(n, 8) | high * _U8(16)
    return ls.view(np.int8) - np.int8(32)  # ls <= 63, so int8 is exact


def _iq4_xs(c: np.ndarray, o: np.ndarray) -> None:
    n = c.shape[0]
    dl = _f16(c, 0) * iq4_xs_scales(c)
    o3 = o.reshape(n, 8, 32)
    o3[...] = np.take(KVALUES_IQ4NL, _nibbles(c, 8, 136, 16)).reshape(n, 8, 32)
    o3 *= dl[:, :, None]


def _trits(b: np.ndarray, k: int) -> np.ndarray:
    """The first k base-3 digits of TQ1_0 bytes `[n, w]` as uint8 `[n, k, w]` (0..2): (b * 3^i mod 256) * 3 >> 8."""
    q = b[:, None, :] * _POW3[:k, None]  # uint8 multiply wraps mod 256, as the C code's uint8_t does
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def _tq1_0(c: np.ndarray, o: np.ndarray) -> None:
    n = c.shape[0]
    q = np.empty((n, 256), np.uint8)
    q[:, 0:160] = _trits(c[:, 0:32], 5).reshape(n, 160)
    q[:, 160:240] = _trits(c[:, 32:48], 5).reshape(n, 80)
    q[:, 240:256] = _trits(c[:, 48:52], 4).reshape(n, 16)
    q -= _U8(1)
    o[...] = q.view(np.int8)
    o *= _f16(c, 52)


def _tq2_0(c: np.ndarray, o: np.ndarray) -> None:
    q = _crumbs(c[:, 0:64].reshape(-1, 2, 32))
    q -= _U8(1)
    o[...] = q.view(np.int8)
    o *= _f16(c, 64)


def _mxfp4(c: np.ndarray, o: np.ndarray) -> None:
    o[...] = np.take(KVALUES_MXFP4, _nibbles(c, 1, 17, 16))
    o *= E8M0_HALF[c[:, 0:1]]


def _nvfp4(c: np.ndarray, o: np.ndarray) -> None:
    n = c.shape[0]
    o3 = o.reshape(n, 4, 16)
    o3[...] = np.take(KVALUES_MXFP4, _nibbles(c, 4, 36, 8)).reshape(n, 4, 16)
    o3 *= UE4M3_HALF[c[:, 0:4]][:, :, None]


_KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray], None]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
    T.MXFP4: _mxfp4,
    T.NVFP4: _nvfp4,
}
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)

NATIVE_TYPES: tuple[GGMLQuantizationType, ...] = _FLOAT_TYPES + tuple(_KERNELS)
# Codebook i-quants: dequantized by gguf.quants (their lattice tables are thousands of entries).
FALLBACK_TYPES: tuple[GGMLQuantizationType, ...] = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = NATIVE_TYPES + FALLBACK_TYPES


# --------------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------------


def _names(types) -> str:
    return ", ".join(t.name for t in types)


def _as_qtype(qtype: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    """A GGMLQuantizationType from the enum, its integer id (as stored in GGUF) or its name ("Q4_K")."""
    try:
        if isinstance(qtype, str):
            return GGMLQuantizationType[qtype.upper()]
        return GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise UnsupportedTensorTypeError(
            f"unknown GGML tensor type {qtype!r}; supported types: {_names(SUPPORTED_TYPES)}. "
            "The file may come from a newer llama.cpp: re-quantize it to one of the supported types."
        ) from None


def _unsupported(qtype: GGMLQuantizationType) -> UnsupportedTensorTypeError:
    return UnsupportedTensorTypeError(
        f"tensor type {qtype.name} cannot be dequantized; supported types: {_names(SUPPORTED_TYPES)}. "
        "Re-quantize the model with llama.cpp's llama-quantize to one of these (e.g. Q8_0, Q4_K_M or F16)."
    )


def dequantize_blocks(
    blocks: np.ndarray, qtype: GGMLQuantizationType | int | str, out: np.ndarray | None = None
) -> np.ndarray:
    """Raw blocks `uint8[n, type_size]` -> float32 `[n, block_size]` with a native kernel, chunked (into `out` if
    given)."""
    qtype = _as_qtype(qtype)
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        raise _unsupported(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != type_size:
        raise TensorShapeError(
            f"{qtype.name} blocks must be uint8[n, {type_size}], got {blocks.dtype}{list(blocks.shape)}"
        )
    n = blocks.shape[0]
    if out is None:
        out = np.empty((n, block_size), np.float32)
    step = max(1, CHUNK_ELEMENTS // block_size)
    # Huge scales (MXFP4 exponent 255, f16 inf/NaN in a corrupt block) give inf/NaN exactly as llama.cpp does; that
    # is the faithful result, not a reason to warn from the middle of a kernel.
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, step):
            kernel(blocks[start : start + step], out[start : start + step])
    return out


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType | int | str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored data -> float32 array of `shape` (NumPy order, last axis = GGUF row).

    `raw` is what `gguf.GGUFReader` gives: a typed array for F32/F16, otherwise the bytes (uint8, any shape).
    Raises `UnsupportedTensorTypeError` for types outside `SUPPORTED_TYPES` and `TensorShapeError` when the byte count
    does not match `shape`.
    """
    qtype = _as_qtype(qtype)
    shape = tuple(int(d) for d in shape)
    n_elements = int(np.prod(shape, dtype=np.int64))
    if qtype not in SUPPORTED_TYPES:
        raise _unsupported(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise TensorShapeError(
            f"a {qtype.name} tensor's rows must be a multiple of {block_size} values, but shape {list(shape)} has rows "
            f"of {shape[-1]}; the file is corrupt or its shape metadata is wrong"
        )
    raw = np.asarray(raw)
    expected = n_elements // block_size * type_size
    if raw.nbytes != expected:
        raise TensorShapeError(
            f"a {qtype.name} tensor of shape {list(shape)} needs {expected} bytes, but {raw.nbytes} were given; "
            "the file is corrupt or truncated"
        )

    if qtype in (T.F32, T.F16):
        if raw.dtype.kind == "f":  # typed (and possibly big-endian) from the reader: let NumPy convert
            return raw.astype(np.float32).reshape(shape)
        return _as_bytes(raw).view("<f4" if qtype == T.F32 else "<f2").astype(np.float32).reshape(shape)
    if qtype == T.BF16:
        bits = _as_bytes(raw).view("<u2").astype(np.uint32)
        bits <<= 16  # bf16 is the upper half of a float32: exact
        return bits.view(np.float32).reshape(shape)

    buf = _as_bytes(raw)
    if qtype in FALLBACK_TYPES:
        import gguf.quants

        rows = buf.reshape(-1, (shape[-1] // block_size) * type_size) if shape else buf.reshape(1, -1)
        return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)
    out = np.empty(shape, np.float32)
    dequantize_blocks(buf.reshape(-1, type_size), qtype, out=out.reshape(-1, block_size))
    return out


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    """The raw storage as a flat uint8 array (no copy for a contiguous memmap)."""
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
