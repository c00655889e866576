"""Tensor parallelism: the placement rules (in process, on abstract meshes) and sharded == single-device numerics on
4 forced host devices (in a subprocess: JAX fixes the device count when it starts).

Sharded matmuls reduce in a different order (each device sums its slice of heads / FFN columns, then an all-reduce),
so sharded logits are not bitwise equal to single-device ones. Measured max |diff| on the fixtures: 1.1e-5 with
logits up to 22 in magnitude (qwen3 7.6e-6, gemma3 7.2e-6, gemma4 dense 1.1e-5); the tolerance is 1e-4, and every
argmax must agree.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import fucina_jax
from fucina_jax import sharding
from fucina_jax.gguf_io import open_gguf
from fucina_jax.models import architecture
from fucina_jax.testing import FIXTURES, GEMMA4_VARIANTS, write_gemma4_fixture

TOL = 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))
# (case, fixture, size of the data axis): data=1 splits 4 heads 4 ways with the 2 kv heads replicated; data=2 splits
# heads and kv heads 2 ways and the batch rows 2 ways (gemma4 dense: sliding layers have 2 kv heads, global ones 1,
# so its cache is split on some layers and replicated on others).
CASES = [("qwen3-tp4", "qwen3", 1), ("qwen3-dp2-tp2", "qwen3", 2), ("gemma3-tp4", "gemma3", 1),
         ("gemma4-dp2-tp2", "gemma4-dense", 2)]


@pytest.fixture(scope="module")
def gguf(fixture_path, fixture_dir):
    def get(kind):
        if kind.startswith("gemma4-"):
            path = fixture_dir / f"{kind}.gguf"
            if not path.exists():
                write_gemma4_fixture(path, kind.split("-", 1)[1])
            return str(path)
        return fixture_path(kind)

    return get


def mesh(data, model):
    return AbstractMesh((data, model), sharding.MESH_AXES)


def table(path):
    """(config, global TensorSpecs, per-layer TensorSpecs) of the architecture's table, optional tensors included."""
    gf = open_gguf(path)
    arch = architecture(gf.architecture)
    cfg = arch.config_from_metadata(gf.metadata, gf.tensor_shape("token_embd.weight")[0],
                                    has_output="output.weight" in gf.tensors)
    glob, layer = arch.tensor_table(cfg)
    return cfg, list(glob), [layer(l) for l in range(cfg.n_layers)]


@pytest.mark.parametrize("kind", sorted(FIXTURES) + [f"gemma4-{v}" for v in sorted(GEMMA4_VARIANTS)])
def test_every_parameter_has_logical_axes(kind, gguf):
    _, glob, layers = table(gguf(kind))
    for s in glob + [s for specs in layers for s in specs]:
        assert s.key in sharding.PARAM_AXES, f"{kind}: add {s.key!r} to sharding.PARAM_AXES"
        assert len(sharding.PARAM_AXES[s.key]) == len(s.shape), (kind, s.key, s.shape)


def specs_for(kind, gguf, m):
    cfg, glob, layers = table(gguf(kind))

    def shapes(specs):
        return {s.key: jax.ShapeDtypeStruct(s.shape, np.float32) for s in specs}

    return sharding.param_specs({**shapes(glob), "layers": tuple(shapes(specs) for specs in layers)}, cfg, m)


def test_tensor_parallel_layout(gguf):
    """4 heads / 2 kv heads: on 4 devices Q/O/FFN/vocab split and K/V replicated; on 2 devices K/V split too."""
    sp = specs_for("qwen3", gguf, mesh(1, 4))
    l0 = sp["layers"][0]
    assert l0["attn_q"] == P("model", None) and l0["attn_output"] == P(None, "model")
    assert l0["attn_k"] == P(None, None) and l0["attn_v"] == P(None, None)
    assert l0["ffn_gate"] == P("model", None) and l0["ffn_up"] == P("model", None)
    assert l0["ffn_down"] == P(None, "model")
    assert l0["attn_norm"] == P(None) and l0["attn_q_norm"] == P(None)
    assert sp["token_embd"] == P("model", None) and sp["output_norm"] == P(None)
    l0 = specs_for("qwen3", gguf, mesh(2, 2))["layers"][0]
    assert l0["attn_k"] == P("model", None) and l0["attn_v"] == P("model", None)


def test_kv_heads_split_per_layer(gguf):
    """Gemma 4 dense fixture: sliding layers have 2 kv heads (split on 2 devices), global layers 1 (replicated)."""
    layers = specs_for("gemma4-dense", gguf, mesh(2, 2))["layers"]
    assert layers[0]["attn_k"] == P("model", None)
    assert layers[2]["attn_k"] == P(None, None)
    assert layers[2]["attn_q"] == P("model", None)


def test_heads_are_never_cut():
    """6 heads of 32 dims: 192 columns divide by 4, but 6 heads do not, so Q/O stay whole (replicated)."""
    from fucina_jax.models.config import LayerSpec, ModelConfig

    spec = LayerSpec(sliding=False, head_dim=32, n_kv_heads=2, ffn_dim=128, rope_base=1e4, rope_scale=1.0,
                     n_rot=32, kv_slot=0)
    cfg = ModelConfig(arch="qwen3", n_vocab=320, d_model=64, n_heads=6, rms_eps=1e-6, context_length=64,
                      layers=(spec,))
    params = {"token_embd": np.zeros((320, 64)), "output_norm": np.zeros(64),
              "layers": ({"attn_q": np.zeros((192, 64)), "attn_k": np.zeros((64, 64)),
                          "attn_output": np.zeros((64, 192)), "ffn_gate": np.zeros((128, 64))},)}
    l0 = sharding.param_specs(params, cfg, mesh(1, 4))["layers"][0]
    assert l0["attn_q"] == P(None, None) and l0["attn_output"] == P(None, None)
    assert l0["ffn_gate"] == P("model", None)
    l0 = sharding.param_specs(params, cfg, mesh(1, 2))["layers"][0]
    assert l0["attn_q"] == P("model", None) and l0["attn_k"] == P("model", None)  # 6 and 2 heads split by 2


def test_experts_then_expert_width():
    """Experts take the model axis when they divide it, else the expert FFN width does; never both."""
    sp = specs_for_moe(8)
    assert sp["ffn_gate_exps"] == P("model", None, None) and sp["ffn_down_exps"] == P("model", None, None)
    sp = specs_for_moe(6)
    assert sp["ffn_gate_exps"] == P(None, "model", None) and sp["ffn_down_exps"] == P(None, None, "model")
    assert sp["ffn_gate_inp"] == P(None, None)


def specs_for_moe(n_expert):
    from fucina_jax.models.config import LayerSpec, ModelConfig

    spec = LayerSpec(sliding=False, head_dim=32, n_kv_heads=2, ffn_dim=0, rope_base=1e4, rope_scale=1.0, n_rot=32,
                     kv_slot=0, moe=True)
    cfg = ModelConfig(arch="qwen3moe", n_vocab=320, d_model=64, n_heads=4, rms_eps=1e-6, context_length=64,
                      layers=(spec,), n_expert=n_expert, n_expert_used=2, expert_ffn_dim=32)
    E = n_expert
    params = {"token_embd": np.zeros((320, 64)), "output_norm": np.zeros(64),
              "layers": ({"ffn_gate_inp": np.zeros((E, 64)), "ffn_gate_exps": np.zeros((E, 32, 64)),
                          "ffn_down_exps": np.zeros((E, 64, 32))},)}
    return sharding.param_specs(params, cfg, mesh(1, 4))["layers"][0]


def test_cache_layout_and_fallbacks():
    from fucina_jax.models.cache import KVCache

    def cache(B, K):
        kv = (jax.ShapeDtypeStruct((B, 64, K, 32), np.float32),)
        return KVCache(k=kv, v=kv, length=jax.ShapeDtypeStruct((B,), np.int32))

    sp = sharding.cache_specs(cache(2, 2), mesh(2, 2))
    assert sp.k[0] == P("data", None, "model", None) and sp.length == P("data")
    sp = sharding.cache_specs(cache(3, 1), mesh(2, 2))  # 3 rows on 2, 1 kv head on 2: replicated, no error
    assert sp.k[0] == P(None, None, None, None) and sp.length == P(None)


def test_unknown_parameter_is_replicated():
    assert sharding.param_axes("some_future_tensor", 2) == (None, None)


def test_mesh_errors():
    n = jax.device_count()
    with pytest.raises(sharding.MeshError, match="xla_force_host_platform_device_count"):
        sharding.make_mesh(n + 1)
    with pytest.raises(sharding.MeshError, match="divide"):
        sharding.make_mesh(1, data=2)


def test_one_device_mesh_is_the_plain_model(fixture_path, load_model):
    """A 1-device ShardedModel is the plain model: same logits bits, same cache layout."""
    model = fucina_jax.load(fixture_path("qwen3"), f32=True)  # the f32 path: kernel weights do not shard
    one = sharding.shard_model(model, sharding.make_mesh(1))
    ids = np.random.default_rng(0).integers(0, 260, 20).astype(np.int32)
    np.testing.assert_array_equal(one.logits(ids), model.logits(ids))
    cache = one.new_cache(32, batch=2)
    assert cache.k[0].shape == model.new_cache(32, batch=2).k[0].shape


def run_worker(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    return subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def four_device_reports(gguf):
    proc = run_worker("compare", *(f"{name}={gguf(kind)}:{data}" for name, kind, data in CASES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case,kind,data", CASES)
def test_sharded_equals_single_device(case, kind, data, four_device_reports):
    r = four_device_reports[case]
    assert r["devices"] == 4 and r["mesh"] == {"data": data, "model": 4 // data}
    for step in ("full_forward", "prefill_decode", "verify"):
        s = r[step]
        print(f"{case} {step}: max |sharded - single| = {s['max_abs_diff']:.2e} (|logit| <= {s['max_abs_logit']:.1f},"
              f" {s['rows']} rows)")
        assert s["argmax_equal"], f"{case} {step}: an argmax differs"
        assert s["max_abs_diff"] < TOL
    # the steps really ran sharded, and the cache stayed put
    assert r["placement"]["attn_q"] == "P('model', None)" and r["placement"]["ffn_down"] == "P(None, 'model')"
    assert "'model'" in r["logits_sharding"]
    if data == 2:
        assert r["placement"]["attn_k"] == "P('model', None)"
        assert r["cache_sharding"][0] == "P('data', None, 'model')"
    assert r["cache_sharding_kept"], "a step returned the KV cache in another layout than it was given"
    assert r["cache_donated"], "a step did not donate the sharded KV cache"
    assert not r["decode_recompiled"], "sharded decode steps recompiled inside a bucket"
    assert r["load_sharded_equal"]


def test_sharded_generate_equals_plain(gguf):
    proc = run_worker("generate", gguf("qwen3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    streams = json.loads(proc.stdout)
    for name, (plain, sharded) in streams.items():
        assert sharded == plain, name
        assert len(plain) == 16


def test_sharded_speculative_equals_plain(gguf):
    """Speculative decoding on 4 devices commits the plain single-device stream of every conversation, greedy and
    sampled: the single decoder on the tensor-parallel mesh, the batched decoder (4 rows) on it and on data 2 x
    model 2 (rows split over "data"). Drafts were accepted, so the verify path really ran sharded."""
    proc = run_worker("spec", gguf("qwen3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, r in json.loads(proc.stdout).items():
        plain = r["plain"]
        assert all(len(t) == 20 for t in plain)
        assert r["single"] == plain, name
        assert r["single_accepted"] > 0, name
        for data in (1, 2):
            assert r[f"batched_dp{data}"] == plain, (name, data)
            assert r[f"batched_dp{data}_accepted"] > 0, (name, data)
