"""GGUF quantized blocks -> the kernels' packed layout, losslessly.

Every supported type is decoded (decode_codes) to byte codes u (0..255) with one scale `a` per sub-block of `bs`
values and, for types with a per-block minimum, one offset `c`:

  type   bs  form       u            a              c            value (bitwise the same as quants.dequantize)
  Q8_0   32  symmetric  q + 128      d              -            a * (u - 128)
  Q4_0   32  symmetric  q - 8 + 128  d              -
  Q5_0   32  symmetric  q - 16 + 128 d              -
  Q6_K   16  symmetric  q - 32 + 128 d * scale      -
  Q3_K   16  symmetric  q + 128      d * scale      -            (q in -4..3: 4-bit codes q + 8, zero 8)
  Q4_1   32  affine     q            d              m            a * u + c
  Q5_1   32  affine     q            d              m
  Q4_K   32  affine     q            d * sc         -(dmin * m)
  Q5_K   32  affine     q            d * sc         -(dmin * m)
  Q2_K   16  affine     q            d * sc         -(dmin * m)  (f32 scales: 4-bit codes + 8 bytes per 16 values)
  IQ4_NL 32  symmetric  kv[q] + 128  d              -            (kv: the 16 non-linear int8 levels; byte codes)
  IQ4_XS 32  symmetric  kv[q] + 128  d * (ls - 32)  -            (f32 scales)

(`d * sc` is the float product ggml computes, so nothing is rounded that was not rounded before.) The packed form
stores no more than the file: codes in as many bits as the type has (CODE_BITS; a 32-block of a 16-column group takes
64 * bits bytes); scales the file keeps in fp16 (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1) as those fp16 numbers; K-quant scales
in the file's two levels (KSCALE_TYPES), multiplied out by the kernel. Bytes per weight (codes + scales): Q8_0 1.0625,
Q4_0 0.5625, Q5_0 0.6875, Q4_1 0.625, Q5_1 0.75, Q6_K 0.820 (each exactly the file's), Q4_K 0.578 and Q5_K 0.703
(the file's 0.5625 and 0.6875: 6-bit sub-scales held in bytes), Q3_K 0.570 (the file's 0.430: 3-bit codes held in
4, 6-bit scales in bytes), Q2_K 1.0 (the file's 0.328: 2-bit codes in 4, f32 scale and offset per 16 values), IQ4_NL
1.0625 and IQ4_XS 1.125 (the file's 0.5625 and 0.531: their levels are int8 values, so they take byte codes); see
docs/performance.md. Other types (the codebook i-quants, floats) stay on the f32 path.

Packed arrays of a weight [N, K] (N padded to a multiple of 16 columns, G = N/16 groups, nb = K/32 blocks):
  q uint8 [G, nb * 64 * bits]  per group and block, 8 chunks x 16 columns x 4 consecutive K values = 512 codes:
        8 bits: one byte per code, chunk by chunk (512 bytes);
        4-6 bits: 256 bytes of low nibbles (chunk c in the low (c < 4) or high nibble of double chunk c % 4), then
        one 64-byte plane per bit above the fourth: 8 bytes per chunk, bit p (little-endian) = that bit of code p of
        the chunk (p = column * 4 + value). Symmetric codes are stored as q with zero 2^(bits-1) (8, 16, 32).
  a f16/f32 [G, nb * 32/bs * 16]  per group: [sub-block][column]; K-quants: uint8/int8 (KSCALE_TYPES)
  c f16/f32 same as a (affine) or [0] (symmetric, and K-quants: the kernel forms the offset from a)
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fucina_jax.quants import (KVALUES_IQ4NL, _as_bytes, _bit_planes, _crumbs, _f16, _nibbles, _q5_quants,
                               _scale_min_k4, iq4_xs_scales, q2_k_scales, q3_k_quants, q3_k_scales)

__all__ = ["CODE_BITS", "F16_SCALE_TYPES", "KSCALE_TYPES", "LANES", "PACKED_TYPES", "QBLOCK", "aligned_empty",
           "decode_codes", "pack_codes", "pack_tensor", "scale_dtype", "unpack_scales", "unpack_values"]

T = GGMLQuantizationType
LANES = 16  # output columns per group: one AVX-512 lane each
QBLOCK = 32  # activation quantization block along K
ALIGN = 64  # bytes: the host-buffer alignment XLA's CPU client adopts without a copy
_U8 = np.uint8


def _sym(u: np.ndarray, a: np.ndarray):
    return u, a.astype(np.float32), None


def _q8_0(c):
    return _sym(c[:, 2:] ^ _U8(0x80), _f16(c, 0))  # int8 q + 128 == its byte with the sign bit flipped


def _q4_0(c):
    return _sym(_nibbles(c, 2, 18, 16) + _U8(120), _f16(c, 0))


def _q5_0(c):
    return _sym(_q5_quants(c, 2, 6) + _U8(112), _f16(c, 0))


def _q4_1(c):
    return _nibbles(c, 4, 20, 16), _f16(c, 0), _f16(c, 2)


def _q5_1(c):
    return _q5_quants(c, 4, 8), _f16(c, 0), _f16(c, 2)


def _k45(c, q):
    sc, mn = _scale_min_k4(c[:, 4:16])
    return q, _f16(c, 0) * sc, -(_f16(c, 2) * mn)


def _q4_k(c):
    return _k45(c, _nibbles(c, 16, 144, 32))


def _q5_k(c):
    q = _nibbles(c, 48, 176, 32)
    high = _bit_planes(c[:, 16:48])
    high *= _U8(16)
    q |= high
    return _k45(c, q)


_IQ4_CODES = KVALUES_IQ4NL.view(_U8) ^ _U8(0x80)  # level + 128


def _iq4_nl(c):
    return _sym(np.take(_IQ4_CODES, _nibbles(c, 2, 18, 16)), _f16(c, 0))


def _iq4_xs_scales(c):
    return (_f16(c, 0) * iq4_xs_scales(c),)


def _iq4_xs(c):
    return _sym(np.take(_IQ4_CODES, _nibbles(c, 8, 136, 16)), *_iq4_xs_scales(c))


def _q2_k_scales(c):
    dl, ml = q2_k_scales(c)
    return dl, -ml


def _q2_k(c):
    return (_crumbs(c[:, 16:80].reshape(c.shape[0], 2, 32)), *_q2_k_scales(c))


def _q3_k(c):
    # int8 q + 128: the byte with its sign bit flipped
    return _sym(q3_k_quants(c).view(_U8) ^ _U8(0x80), _f16(c, 108) * q3_k_scales(c))


def _q6_k(c):
    n = c.shape[0]
    q = _nibbles(c, 0, 128, 64)
    high = _crumbs(c[:, 128:192].reshape(n, 2, 32))
    high *= _U8(16)
    q |= high
    q += _U8(96)
    return _sym(q, _f16(c, 208) * c[:, 192:208].view(np.int8))


# type -> (decoder, bs)
_DECODERS = {
    T.Q8_0: (_q8_0, 32),
    T.Q4_0: (_q4_0, 32),
    T.Q5_0: (_q5_0, 32),
    T.Q4_1: (_q4_1, 32),
    T.Q5_1: (_q5_1, 32),
    T.Q4_K: (_q4_k, 32),
    T.Q5_K: (_q5_k, 32),
    T.Q6_K: (_q6_k, 16),
    T.Q3_K: (_q3_k, 16),
    T.Q2_K: (_q2_k, 16),
    T.IQ4_NL: (_iq4_nl, 32),
    T.IQ4_XS: (_iq4_xs, 32),
}
PACKED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_DECODERS)
# Types whose scales (and offsets) are the file's own fp16 numbers: packed as f16, exactly, 2 bytes instead of 4 per
# 32 values (the Q8_0 output layer of a 262k vocab moves 10.5 MB less per token). K-quants multiply two numbers into
# a scale that fp16 may not hold: f32.
F16_SCALE_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.IQ4_NL})
# Types whose f32 scales (and offsets) are products of the file's numbers, by the decoder's own function.
_SCALE_PRODUCTS = {T.Q2_K: _q2_k_scales, T.IQ4_XS: _iq4_xs_scales}


# Bits per code of each type. Fewer bits than a byte are stored as a 4-bit nibble plus one bit plane per bit above
# (layout in the module docstring): Q4_K 0.75 bytes per weight instead of 1.25, Q5_0 0.6875 instead of 1.0625.
CODE_BITS = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q3_K: 4,
             T.Q2_K: 4, T.IQ4_NL: 8, T.IQ4_XS: 8}


# K-quants keep the file's two-level scales: per 16-column group and super-block of 256 values along K, the 16
# columns' fp16 d, then (Q4_K, Q5_K: uint8) the 16 fp16 dmin, 8 x 16 6-bit scales and 8 x 16 6-bit mins (320 bytes),
# or (Q6_K, Q3_K: int8) 16 x 16 signed scales (288 bytes). The kernel forms a = d * scale and c = -(dmin * min), the
# same exact f32 products the dequantizer computes: 0.078 / 0.070 bytes per weight instead of f32's 0.25.
KSCALE_TYPES = {T.Q4_K: 320, T.Q5_K: 320, T.Q6_K: 288, T.Q3_K: 288}
_SIGNED_KSCALES = (T.Q6_K, T.Q3_K)  # int8 scales per 16 values, no offsets


def scale_dtype(qtype) -> np.dtype:
    if qtype in KSCALE_TYPES:
        return np.dtype(np.int8 if qtype in _SIGNED_KSCALES else np.uint8)
    return np.dtype(np.float16 if qtype in F16_SCALE_TYPES else np.float32)


def _kscales_into(dst: np.ndarray, blocks: np.ndarray, qtype, groups: int) -> None:
    """Two-level K-quant scales of `groups` * 16 rows (raw super-blocks `blocks` [rows * S, type_size], rows in
    order, padded rows all zero) into dst [groups, S * KSCALE_TYPES[qtype]] (uint8 view)."""
    S = blocks.shape[0] // (groups * LANES)

    def lanes_last(x, per):  # [rows * S, per] bytes -> [groups, S, per / width * 16 * width] with lanes innermost
        width = 2 if per == 2 else 1
        v = x.reshape(groups, LANES, S, per // width, width)
        return v.transpose(0, 2, 3, 1, 4).reshape(groups, S, -1)

    if qtype == T.Q6_K:
        parts = [lanes_last(blocks[:, 208:210], 2), lanes_last(blocks[:, 192:208], 16)]
    elif qtype == T.Q3_K:
        parts = [lanes_last(blocks[:, 108:110], 2), lanes_last(q3_k_scales(blocks).view(_U8), 16)]
    else:
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        parts = [lanes_last(blocks[:, 0:2], 2), lanes_last(blocks[:, 2:4], 2), lanes_last(sc, 8), lanes_last(mn, 8)]
    np.concatenate(parts, axis=-1, out=dst.view(np.uint8).reshape(groups, S, -1))


def unpack_scales(a: np.ndarray, c: np.ndarray, qtype, n: int, k: int):
    """Packed scales (and offsets) of a [n, k] weight -> f32 a [n, k/bs] and c [n, k/bs] (None when symmetric):
    the numbers the kernel multiplies by, read back from the layout (tests hold them to decode_codes)."""
    G = a.shape[0]

    def rows(x):  # [G, blocks, 16] -> [G * 16, blocks]
        return x.reshape(G, -1, LANES).transpose(0, 2, 1).reshape(G * LANES, -1)[:n].astype(np.float32)

    if qtype not in KSCALE_TYPES:
        return rows(a), (rows(c) if c.size else None)
    S = k // 256
    blk = np.ascontiguousarray(a).view(np.uint8).reshape(G, S, KSCALE_TYPES[qtype])
    d = blk[:, :, :32].copy().view("<f2").astype(np.float32)[:, :, None, :]  # [G, S, 1, 16]
    if qtype in _SIGNED_KSCALES:
        sc = blk[:, :, 32:].view(np.int8).reshape(G, S, 16, LANES)
        return rows(d * sc.astype(np.float32)), None
    dmin = blk[:, :, 32:64].copy().view("<f2").astype(np.float32)[:, :, None, :]
    sc = blk[:, :, 64:192].reshape(G, S, 8, LANES).astype(np.float32)
    mn = blk[:, :, 192:].reshape(G, S, 8, LANES).astype(np.float32)
    return rows(d * sc), rows(-(dmin * mn))


def _narrow_codes(q: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """Byte-code layout [G, nb * 512] -> the `bits`-bit layout [G, nb * 64 * bits]: nibbles, then bit planes.
    Symmetric codes q - zero + 128 become q (zero 2^(bits-1)); the padding code 128 becomes the zero code."""
    G = q.shape[0]
    codes = q - np.uint8(128 - (1 << (bits - 1)) if symmetric else 0)
    v = codes.reshape(G, -1, 2, 256)  # chunks 0-3 | chunks 4-7 of each block
    parts = [((v[:, :, 0] & np.uint8(0x0F)) | (v[:, :, 1] << np.uint8(4)))]
    chunks = codes.reshape(G, -1, 8, 64)
    for k in range(4, bits):  # plane k: bit k of each code, 64 codes of a chunk into 8 bytes
        parts.append(np.packbits((chunks >> np.uint8(k)) & np.uint8(1), axis=-1, bitorder="little").reshape(
            G, -1, 64))
    return np.concatenate(parts, axis=-1).reshape(G, -1)


def decode_codes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    """Raw bytes of a [N, K] tensor -> (u uint8 [N, K], a f32 [N, K/bs], c f32 [N, K/bs] or None, bs)."""
    decoder, bs = _DECODERS[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    N, K = shape
    u, a, c = decoder(_as_bytes(raw).reshape(-1, type_size))
    per_row = K // bs
    return (
        u.reshape(N, K),
        np.ascontiguousarray(a, np.float32).reshape(N, per_row),
        None if c is None else np.ascontiguousarray(c, np.float32).reshape(N, per_row),
        bs,
    )


def unpack_values(u: np.ndarray, a: np.ndarray, c: np.ndarray | None, bs: int) -> np.ndarray:
    """The f32 weight values the codes stand for (used by tests to prove the packing lossless)."""
    a = np.repeat(a, bs, axis=-1)
    if c is None:
        return (u.astype(np.float32) - np.float32(128)) * a
    return u.astype(np.float32) * a + np.repeat(c, bs, axis=-1)


def pack_codes(u: np.ndarray, a: np.ndarray, c: np.ndarray | None, bs: int, dtype=np.float32, bits: int = 8):
    """Codes [N, K] + scales [N, K/bs] -> the kernel layout (q, a, c), columns padded to a multiple of 16. The plain
    statement of the layout: pack_tensor computes the same bytes faster, and the tests hold it to this."""
    N, K = u.shape
    G = -(-N // LANES)
    pad = G * LANES - N
    if pad:  # padded columns compute 0: code 128 with scale 0 (symmetric) or scale and offset 0 (affine)
        u = np.concatenate([u, np.full((pad, K), 128, np.uint8)])
        a = np.concatenate([a, np.zeros((pad, a.shape[1]), np.float32)])
        if c is not None:
            c = np.concatenate([c, np.zeros((pad, c.shape[1]), np.float32)])
    nb = K // QBLOCK
    q = u.reshape(G, LANES, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb * 8 * LANES * 4)

    def lanes_last(s):
        return s.reshape(G, LANES, -1).transpose(0, 2, 1).reshape(G, -1)

    return (
        np.ascontiguousarray(_narrow_codes(q, bits, c is None) if bits < 8 else q),
        np.ascontiguousarray(lanes_last(a)).astype(dtype),
        np.zeros((0,), dtype) if c is None else np.ascontiguousarray(lanes_last(c)).astype(dtype),
    )


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty whose data starts on a 64-byte boundary. jax.device_put on the CPU adopts such a buffer instead of
    copying it (XLA's CPU client zero-copies aligned host memory), so a packed weight is allocated once, not twice."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize  # (np.prod costs ~50 us a call: 360 calls in a load)
    raw = np.empty(n + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


def _lanes_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst [g, X * 16] <- src [g * 16, X] with the 16 rows of a group innermost: dst[g, x * 16 + l] = src[g * 16 + l, x].
    On the codes this runs over uint32 views (4 consecutive K values move as one element: 4x fewer elements than
    pack_codes' byte-wise transpose, same bytes)."""
    g = dst.shape[0]
    np.copyto(dst.reshape(g, -1, LANES), src.reshape(g, LANES, -1).transpose(0, 2, 1))


def _pad_rows(x: np.ndarray, rows: int, fill) -> np.ndarray:
    return np.concatenate([x, np.full((rows - x.shape[0], x.shape[1]), fill, x.dtype)])


def _chunk_rows(K: int, rows_per_chunk: int | None) -> int:
    if rows_per_chunk is None:  # about 4 MB of codes per chunk: the decoders' temporaries stay in cache
        rows_per_chunk = (4 << 20) // K
    return max(LANES, rows_per_chunk // LANES * LANES)


def pack_tensor(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], rows_per_chunk: int | None = None,
                done=None):
    """Raw GGUF bytes of a [N, K] tensor -> (q, a, c, bs) packed (byte for byte pack_codes(*decode_codes(...)), but
    for the K-quants' two-level scales, which unpack_scales reads back to decode_codes' numbers), into
    64-byte aligned arrays (see aligned_empty), a chunk of rows at a time so the transient NumPy copies stay small
    next to the result (Gemma 3's tied embedding is 262144 rows). `done(rows)`, if given, is called with each chunk
    of raw rows once it is consumed (the loader drops those file pages from memory)."""
    N, K = shape
    bs = _DECODERS[qtype][1]
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = _as_bytes(raw).reshape(N, K // block * type_size)
    G = -(-N // LANES)
    nb, per_row = K // QBLOCK, K // bs
    affine = qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q2_K)
    bits = CODE_BITS[qtype]
    q = aligned_empty((G, nb * 64 * bits), np.uint8)
    q32 = q.view(np.uint32)  # [G, nb * 8 * 16]: one element = the 4 consecutive K values of one column
    sd = scale_dtype(qtype)
    kscale = qtype in KSCALE_TYPES
    if kscale:
        a = aligned_empty((G, K // 256 * KSCALE_TYPES[qtype]), sd)
        c = np.zeros((0,), sd)
    else:
        a = aligned_empty((G, per_row * LANES), sd)
        c = aligned_empty((G, per_row * LANES), sd) if affine else np.zeros((0,), sd)
    step = _chunk_rows(K, rows_per_chunk)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        g0, g1 = n0 // LANES, -(-n1 // LANES)
        chunk = rows[n0:n1]
        if qtype == T.Q8_0 and n1 - n0 == (g1 - g0) * LANES:
            _q8_0_into(q32[g0:g1], a[g0:g1], chunk, nb)
        else:
            blocks = chunk.reshape(-1, type_size)
            u_ = _codes(blocks, qtype).reshape(n1 - n0, K)
            padded = n1 - n0 < (g1 - g0) * LANES  # padded columns compute 0: code 128, scale 0 (and offset 0)
            if padded:
                u_ = _pad_rows(u_, (g1 - g0) * LANES, 128)
            if bits < 8:
                full = np.empty((g1 - g0, nb * 8 * LANES * 4), np.uint8)
                _lanes_into(full.view(np.uint32), np.ascontiguousarray(u_).view(np.uint32))
                _narrow_into(q[g0:g1], full, bits, not affine)
            else:
                _lanes_into(q32[g0:g1], np.ascontiguousarray(u_).view(np.uint32))
            if kscale:
                if padded:
                    blocks = _pad_rows(chunk, (g1 - g0) * LANES, 0).reshape(-1, type_size)
                _kscales_into(a[g0:g1], blocks, qtype, g1 - g0)
            else:  # the other types' decoders give d (byte 0) as the scale and m (byte 2) as the offset
                scales = _SCALE_PRODUCTS[qtype](blocks) if qtype in _SCALE_PRODUCTS else [_f16(blocks, 0),
                                                                                          _f16(blocks, 2)]
                for dst, s_ in zip((a, c) if affine else (a,), scales):
                    s_ = s_.reshape(n1 - n0, per_row)
                    _lanes_into(dst[g0:g1], _pad_rows(s_, (g1 - g0) * LANES, 0) if padded else s_)
        if done is not None:
            done(chunk)
    return q, a, c, bs


def _native():
    """The kernels' extension module (pack.cc's loops), or None where it is not built (NumPy then does the same)."""
    try:
        from fucina_jax.kernels import _qmatmul
    except ImportError:
        return None
    return _qmatmul


def _q8_0_into(dst: np.ndarray, scales: np.ndarray, chunk: np.ndarray, nb: int) -> None:
    """Q8_0 rows (whole 16-column groups) straight into the packed codes and fp16 scales, no decode copy. NumPy
    form: the 32 int8 of a block (after its 2-byte scale) are moved as 8 unaligned uint32 words, and XOR 0x80808080
    flips the sign bit of each byte (q + 128) on the way (the bytes stay in file order, so the host's byte order
    does not matter); the scales are the file's fp16 bytes, lanes last."""
    n, row = chunk.shape
    native = _native()
    if native is not None:
        native.pack_q8_0(np.ascontiguousarray(chunk), n, nb, dst, scales)
        return
    words = np.ndarray((n // LANES, LANES, nb, 8), np.uint32, buffer=np.ascontiguousarray(chunk), offset=2,
                       strides=(LANES * row, row, 2 + QBLOCK, 4))
    np.bitwise_xor(words.transpose(0, 2, 3, 1), np.uint32(0x80808080), out=dst.reshape(n // LANES, nb, 8, LANES))
    _lanes_into(scales, _f16(chunk.reshape(-1, 2 + QBLOCK), 0).reshape(n, nb))


def _codes(blocks: np.ndarray, qtype) -> np.ndarray:
    """The byte codes u of raw blocks [n, type_size], in C where built (pack.cc), else through the type's decoder."""
    native = _native()
    if native is None:
        return _DECODERS[qtype][0](blocks)[0]
    u = np.empty((blocks.shape[0], GGML_QUANT_SIZES[qtype][0]), np.uint8)
    native.decode_codes(int(qtype), np.ascontiguousarray(blocks), u)
    return u


def _narrow_into(dst: np.ndarray, full: np.ndarray, bits: int, symmetric: bool) -> None:
    """dst[...] = _narrow_codes(full, bits, symmetric), in C where built."""
    native = _native()
    if native is None:
        dst[...] = _narrow_codes(full, bits, symmetric)
    else:
        native.narrow_codes(full, dst, bits, 128 - (1 << (bits - 1)) if symmetric else 0)
