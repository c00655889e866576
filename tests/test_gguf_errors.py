"""Bad input to load(): each case raises a specific exception whose message says what is wrong; none crashes or hangs."""

import dataclasses
import os
import shutil

import numpy as np
import pytest

import fucina_jax
from fucina_jax.errors import (
    GGUFError,
    MetadataError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from fucina_jax.testing import FIXTURES, write_fixture


def rewrite(src: str, dst: str, *, arch=None, drop=(), reshape=None, retype=None, meta=None, add=None) -> str:
    """Copy a GGUF with one thing changed, through gguf's reader and writer. meta: key -> (value, GGUFValueType),
    replacing (or adding) metadata keys; add: tensor name -> array, tensors to add."""
    import gguf

    r = gguf.GGUFReader(src)
    arch_in = r.fields["general.architecture"].contents()
    arch = arch or arch_in
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        val = f.contents()
        key = name.replace(arch_in + ".", arch + ".", 1)
        if meta and key in meta:
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, val, vtype)
    for key, (val, vtype, *sub) in (meta or {}).items():  # (value, type[, array element type: default STRING])
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=sub[0] if sub else gguf.GGUFValueType.STRING)
        else:
            w.add_key_value(key, val, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data).reshape(tuple(reversed([int(d) for d in t.shape])))
        if reshape and t.name == reshape:
            data = data[:-1]
        if retype and t.name == retype:
            w.add_tensor(t.name, data.astype(np.int32))
            continue
        w.add_tensor(t.name, data)
    for name, data in (add or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def good(fixture_path):
    return fixture_path("qwen3")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        fucina_jax.load(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        fucina_jax.load(p)


def test_a_pipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # no writer: opening it to read would block forever
    with pytest.raises(GGUFError, match="not a regular file"):
        fucina_jax.load(str(fifo))


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        fucina_jax.load(p)


@pytest.mark.parametrize("keep", [0.5, 0.999, 40 / 1e9])
def test_truncated(good, tmp_path, keep):
    data = open(good, "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(GGUFError, match="truncated|corrupt"):
        fucina_jax.load(p)


def test_unknown_architecture(good, tmp_path):
    p = rewrite(good, str(tmp_path / "arch.gguf"), arch="mamba9")
    with pytest.raises(UnsupportedArchitectureError) as e:
        fucina_jax.load(p)
    assert "mamba9" in str(e.value) and "qwen3" in str(e.value) and "gemma3" in str(e.value)


def test_missing_tensor(good, tmp_path):
    p = rewrite(good, str(tmp_path / "miss.gguf"), drop={"blk.1.ffn_up.weight"})
    with pytest.raises(MissingTensorError, match="blk.1.ffn_up.weight"):
        fucina_jax.load(p)


def test_wrong_shape(good, tmp_path):
    p = rewrite(good, str(tmp_path / "shape.gguf"), reshape="blk.0.attn_k.weight")
    with pytest.raises(TensorShapeError, match="blk.0.attn_k.weight"):
        fucina_jax.load(p)


def test_unsupported_tensor_type(good, tmp_path):
    p = rewrite(good, str(tmp_path / "type.gguf"), retype="blk.0.attn_q.weight")
    with pytest.raises((UnsupportedTensorTypeError, TensorShapeError), match="blk.0.attn_q.weight"):
        fucina_jax.load(p)


def test_errors_share_a_base_class():
    for cls in (GGUFError, MissingTensorError, TensorShapeError, UnsupportedArchitectureError,
                UnsupportedTensorTypeError):
        assert issubclass(cls, fucina_jax.FucinaError)


def _v(name):
    import gguf

    return getattr(gguf.GGUFValueType, name)


@pytest.mark.parametrize("key, value, vtype, match", [
    ("qwen3.block_count", 0, "UINT32", r"'qwen3.block_count' = 0 is out of range"),
    ("qwen3.block_count", 2**32 - 1, "UINT32", r"'qwen3.block_count' = 4294967295 is out of range \[1, 512\]"),
    ("qwen3.attention.head_count", 0, "UINT32", r"'qwen3.attention.head_count' = 0"),
    ("qwen3.embedding_length", "sixty-four", "STRING", r"'qwen3.embedding_length' must be an integer, got 'sixty-four'"),
    ("qwen3.context_length", float("inf"), "FLOAT64", r"'qwen3.context_length' must be an integer, got inf"),
    ("qwen3.attention.layer_norm_rms_epsilon", "tiny", "STRING", r"layer_norm_rms_epsilon' must be a finite"),
    ("qwen3.rope.dimension_count", 64, "UINT32", r"'qwen3.rope.dimension_count' = 64 is out of range \[1, 32\]"),
    ("qwen3.rope.freq_base", float("nan"), "FLOAT32", r"'qwen3.rope.freq_base' must be a positive number"),
])
def test_bad_metadata_values_name_the_key(good, tmp_path, key, value, vtype, match):
    p = rewrite(good, str(tmp_path / "meta.gguf"), meta={key: (value, _v(vtype))})
    with pytest.raises(MetadataError, match=match):
        fucina_jax.load(p)


@pytest.mark.parametrize("count", [2**63, 2**64 - 1, 10**9])
def test_a_string_array_count_past_the_end(good, tmp_path, count):
    import struct

    raw = bytearray(open(good, "rb").read())
    at = raw.index(b"tokenizer.ggml.tokens" + struct.pack("<II", 9, 8)) + len("tokenizer.ggml.tokens") + 8
    raw[at:at + 8] = struct.pack("<Q", count)
    p = tmp_path / "count.gguf"
    p.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        fucina_jax.load(str(p))


@pytest.mark.parametrize("sub, value, match", [
    ("UINT64", 2**63, "must be int32"),
    ("STRING", "x", "must be int32"),
    ("INT64", 2**40, None),  # an unknown type: loads (UNDEFINED, as llama.cpp), with no table sized by the value
    ("INT32", -7, None),
])
def test_token_types_out_of_range_or_not_integers(good, tmp_path, sub, value, match):
    from fucina_jax.errors import TokenizerError

    n = fucina_jax.load(good).config.n_vocab
    p = rewrite(good, str(tmp_path / "types.gguf"),
                meta={"tokenizer.ggml.token_type": ([value] * n, _v("ARRAY"), _v(sub))})
    if match is None:
        tok = fucina_jax.load(p).tokenizer
        assert set(tok.token_types) == {value} and len(tok.encode("ab")) > 0
    else:
        with pytest.raises(TokenizerError, match=match):
            fucina_jax.load(p).tokenizer


def test_llama_rope_must_rotate_the_whole_head(fixture_path, tmp_path):
    """As llama.cpp: a llama file with partial rotary (n_rot < head size) is refused, not run with the wrong RoPE."""
    p = rewrite(fixture_path("llama"), str(tmp_path / "rot.gguf"), meta={"llama.rope.dimension_count": (8, _v("UINT32"))})
    with pytest.raises(MetadataError, match="invalid rope.dimension_count 8, expected the head size 16"):
        fucina_jax.load(p)


def test_duplicate_metadata_key(tmp_path):
    spec = dataclasses.replace(FIXTURES["qwen3"], extra_kv=(("qwen3.block_counX", 3),))
    p = write_fixture(tmp_path / "dup.gguf", spec=spec)
    data = open(p, "rb").read()  # (gguf's writer refuses duplicates, so the second key is renamed in place)
    open(p, "wb").write(data.replace(b"qwen3.block_counX", b"qwen3.block_count"))
    with pytest.raises(GGUFError, match="'qwen3.block_count' appears twice"):
        fucina_jax.load(p)


def test_alignment_must_be_a_power_of_two(good, tmp_path):
    p = rewrite(good, str(tmp_path / "align.gguf"), meta={"general.alignment": (48, _v("UINT32"))})
    with pytest.raises(GGUFError, match="general.alignment = 48 is not a power-of-2"):
        fucina_jax.load(p)


def _patch_offset(path: str, tensor: str, delta: int) -> None:
    """Move one tensor's data offset in the header's tensor directory by delta bytes (the data stays put)."""
    import struct

    data = bytearray(open(path, "rb").read())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims + 4  # dims, then the type
    (offset,) = struct.unpack_from("<Q", data, at)
    struct.pack_into("<Q", data, at, offset + delta)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("delta", [4, -32])
def test_tensor_data_offsets_are_checked(good, tmp_path, delta):
    """A tensor whose offset is not where the previous one's data ends (moved, or overlapping its neighbour) would
    read another tensor's bytes; llama.cpp refuses it, so does load()."""
    p = str(tmp_path / "moved.gguf")
    shutil.copy(good, p)
    _patch_offset(p, "blk.0.attn_q.weight", delta)
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q.weight' has data offset"):
        fucina_jax.load(p)


def test_layers_past_block_count(good, tmp_path):
    p = rewrite(good, str(tmp_path / "fewer.gguf"), meta={"qwen3.block_count": (2, _v("UINT32"))})
    with pytest.raises(TensorShapeError, match="tensors of layer 2 but its metadata says block_count = 2"):
        fucina_jax.load(p)


def test_tensors_the_architecture_does_not_use(good, tmp_path):
    """A tensor the model would not read is refused, as llama.cpp refuses it: a Llama 3 file's rope_freqs, biases,
    or a qwen3 file relabelled llama (whose q/k norms llama does not have) would otherwise run and be wrong."""
    extra = {"rope_freqs.weight": np.ones(16, np.float32), "blk.0.attn_q.bias": np.zeros(128, np.float32)}
    p = rewrite(good, str(tmp_path / "extra.gguf"), add=extra)
    with pytest.raises(UnsupportedArchitectureError, match=r"'blk.0.attn_q.bias' \(and 1 more\) .* not part of a qwen3"):
        fucina_jax.load(p)
    p = rewrite(good, str(tmp_path / "relabelled.gguf"), arch="llama")
    with pytest.raises(UnsupportedArchitectureError, match=r"'blk.0.attn_k_norm.weight' \(and \d+ more\) .* llama"):
        fucina_jax.load(p)


def test_vocabulary_must_match_the_embedding(good, tmp_path):
    import gguf

    tokens = list(gguf.GGUFReader(good).fields["tokenizer.ggml.tokens"].contents())
    p = rewrite(good, str(tmp_path / "vocab.gguf"), meta={"tokenizer.ggml.tokens": (tokens[:300], _v("ARRAY"))})
    with pytest.raises(TensorShapeError, match=f"has {len(tokens)} rows but the tokenizer has 300 tokens"):
        fucina_jax.load(p)


def test_a_window_wider_than_any_cache_is_no_window(tmp_path):
    """sliding_window = 2^31 (wider than int32 positions can express) runs, and equals a window wider than the
    context: every position is visible either way."""
    wide, huge = (write_fixture(tmp_path / f"w{w}.gguf", spec=dataclasses.replace(FIXTURES["gemma3"], window=w))
                  for w in (4096, 2**31))
    ids = list(range(5, 40))
    np.testing.assert_array_equal(fucina_jax.load(wide).logits(ids), fucina_jax.load(huge).logits(ids))
