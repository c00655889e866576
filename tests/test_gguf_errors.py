"""Bad input to load(): each case raises a specific exception whose message says what is wrong; none crashes or hangs."""

import os
import shutil

import numpy as np
import pytest

import fucina_jax
from fucina_jax.errors import (
    GGUFError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from fucina_jax.testing import FIXTURES, write_fixture


def rewrite(src: str, dst: str, *, arch=None, drop=(), reshape=None, retype=None) -> str:
    """Copy a GGUF with one thing changed, through gguf's reader and writer."""
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
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=f.types[-1])
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
