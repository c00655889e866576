"""Gemma 4 on tiny random fixtures of every text variant (dense K=V, MoE, E2B/E4B-style PLE + shared KV).

Reference: llama.cpp (llama-cpp-python 0.3.36), run in a child process because a malformed Gemma 4 file can abort
(C assert) instead of raising. F32 weights and an F32 K/V cache on both sides.

Tolerances, measured (64 positions, window 8, logits up to ~27 after the softcap of 30):
- Engine as shipped (exact tanh GELU): max |logit diff| 4e-3 .. 1.1e-2 per variant. llama.cpp's CPU GELU reads an
  fp16 lookup table (input rounded to fp16, output stored as fp16): that alone explains the difference, see below.
  Bound 5e-2; the argmax must agree at every position (the fixtures' seeds have llama.cpp top-2 margins >= 0.08).
- The same forward with a test-only emulation of that table (gelu_fp16_table): per-position max diff of 1e-5 on
  shallow stacks; deeper stacks accumulate rare fp16 rounding-boundary flips (a 1e-7 difference before the table
  becomes a 5e-4 jump after it), so the median per position is 5e-5 .. 5e-4 and the max 1e-3 .. 4e-3. Bounds: median
  2e-3, max 2e-2. For scale: rounding the embedding scale sqrt(n_embd) to bf16 (as HF / DeepMind do) moves the median
  to ~2e-2 on the n_embd = 80 and 96 fixtures: llama.cpp 0.3.36 uses the exact sqrtf, and so does fucina_jax.
"""

import dataclasses
import json
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax import engine
from fucina_jax.errors import MetadataError
from fucina_jax.models import layers as L
from fucina_jax.models import truncate
from fucina_jax.testing.gemma4 import GEMMA4_VARIANTS, write_gemma4_fixture
from step_helpers import decode_rows

VARIANTS = list(GEMMA4_VARIANTS)
# Weight seeds: deterministic fixtures whose llama.cpp logits have no near-tie at the argmax (min top-2 margin 0.08).
SEEDS = {"dense": 1, "moe": 1, "e2b": 0, "e4b": 0}
N_POS = 64  # > 8 windows of 8
EXACT_TOL = 5e-2
TABLE_MEDIAN_TOL = 2e-3
TABLE_MAX_TOL = 2e-2
ROW_TOL = 1e-4  # same model, different row blocking in XLA's dot (see test_forward.py)
TABLE_ACT = "gelu_fp16_table"

# Extra files for the reference batch: (name, variant, write_gemma4_fixture kwargs)
EXTRA = {
    # llama.cpp defaults rope.freq_base_swa to 10000 (not to rope.freq_base): same logits as the full file
    "dense-no-swa-base": ("dense", {"drop_keys": ("rope.freq_base_swa",)}),
    # experts as separate gate/up tensors (the loader's fallback when ffn_gate_up_exps is absent)
    "moe-split": ("moe", {"spec": dataclasses.replace(GEMMA4_VARIANTS["moe"], fused_gate_up=False)}),
}

_REF_SCRIPT = r"""
import json, sys
import numpy as np
from fucina_jax.testing import open_llama_cpp
jobs, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for path, out in jobs:
    llm = open_llama_cpp(path, n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2, seed=0, type_k=0, type_v=0)
    llm.eval(ids)
    np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
    llm.close()
"""


def ids_for(n_vocab: int, n: int = N_POS, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


@pytest.fixture(scope="module")
def g4_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4")
    paths = {v: write_gemma4_fixture(d / f"{v}.gguf", v, seed=SEEDS[v]) for v in VARIANTS}
    for name, (variant, kw) in EXTRA.items():
        paths[name] = write_gemma4_fixture(d / f"{name}.gguf", variant, seed=SEEDS[variant], **kw)
    return paths


@pytest.fixture(scope="module")
def g4_refs(g4_paths):
    """llama.cpp logits [N_POS, V] of every fixture, computed in one child process."""
    pytest.importorskip("llama_cpp")
    ids = ids_for(GEMMA4_VARIANTS["dense"].n_vocab)
    jobs = [(p, p + ".ref.npy") for p in g4_paths.values()]
    proc = subprocess.run(
        [sys.executable, "-c", _REF_SCRIPT, json.dumps(jobs), json.dumps(ids.tolist())],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"llama.cpp failed on a gemma4 fixture:\n{proc.stderr[-3000:]}"
    return {name: np.load(p + ".ref.npy") for name, p in g4_paths.items()}


def gelu_fp16_table(x):
    """ggml-cpu's GELU (GGML_GELU_FP16): x <= -10 -> 0, x >= 10 -> x, else table[fp16(x)] with the table holding
    fp16(gelu_f32(v)) for every fp16 value v."""
    x16 = x.astype(jnp.float16).astype(jnp.float32)
    y = L.gelu_tanh(x16).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10.0, 0.0, jnp.where(x >= 10.0, x, y))


def with_config(model, **changes):
    return dataclasses.replace(model, config=dataclasses.replace(model.config, **changes))


# --------------------------------------------------------------------------------------------- parity vs llama.cpp


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_llamacpp(variant, g4_paths, g4_refs, load_model):
    model = load_model(g4_paths[variant])
    ref = g4_refs[variant]
    ours = model.logits(ids_for(model.config.n_vocab))
    diff = np.abs(ours - ref).max()
    top2 = np.sort(ref, -1)[:, -2:]
    print(f"gemma4 {variant}: max |logit diff| vs llama.cpp = {diff:.2e} over {N_POS} positions "
          f"(|logit| <= {np.abs(ref).max():.1f}, min llama.cpp top-2 margin {(top2[:, 1] - top2[:, 0]).min():.3f})")
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert diff < EXACT_TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_llamacpp_with_its_fp16_gelu_table(variant, g4_paths, g4_refs, load_model, monkeypatch):
    """With llama.cpp's GELU table emulated, what is left is f32 summation order (plus rare table-boundary flips)."""
    monkeypatch.setitem(L.ACTIVATIONS, TABLE_ACT, gelu_fp16_table)
    model = with_config(load_model(g4_paths[variant]), act=TABLE_ACT)
    d = np.abs(model.logits(ids_for(model.config.n_vocab)) - g4_refs[variant]).max(-1)
    print(f"gemma4 {variant} with fp16 GELU table: per-position max |diff| median {np.median(d):.1e}, "
          f"max {d.max():.1e}")
    assert np.median(d) < TABLE_MEDIAN_TOL
    assert d.max() < TABLE_MAX_TOL


def test_embedding_scale_is_exact_sqrt_not_bf16(g4_paths, g4_refs, load_model, monkeypatch):
    """The check has teeth: a bf16-rounded sqrt(80) (8.9375 vs 8.9443) is 10x outside the table-emulated bound."""
    monkeypatch.setitem(L.ACTIVATIONS, TABLE_ACT, gelu_fp16_table)
    model = load_model(g4_paths["moe"])
    D = model.config.d_model
    assert model.config.embed_scale == math.sqrt(D)
    bf16 = float(jnp.asarray(math.sqrt(D), jnp.bfloat16))
    assert bf16 != np.float32(math.sqrt(D))
    d = np.abs(with_config(model, act=TABLE_ACT, embed_scale=bf16).logits(ids_for(model.config.n_vocab))
               - g4_refs["moe"]).max(-1)
    print(f"gemma4 moe with a bf16 embedding scale: median per-position diff {np.median(d):.1e}")
    assert np.median(d) > 5 * TABLE_MEDIAN_TOL


def test_missing_swa_rope_base_defaults_to_10000(g4_paths, g4_refs, load_model):
    full, dropped = load_model(g4_paths["dense"]), load_model(g4_paths["dense-no-swa-base"])
    assert {s.rope_base for s in dropped.config.layers if s.sliding} == {10000.0}
    assert dropped.config == full.config
    np.testing.assert_allclose(g4_refs["dense-no-swa-base"], g4_refs["dense"], atol=1e-6)


def test_separate_gate_up_experts_equal_fused(g4_paths, g4_refs, load_model):
    fused, split = load_model(g4_paths["moe"]), load_model(g4_paths["moe-split"])
    assert "ffn_gate_up_exps" in fused.params["layers"][0] and "ffn_gate_exps" in split.params["layers"][0]
    ids = ids_for(fused.config.n_vocab, 16)
    np.testing.assert_array_equal(split.logits(ids), fused.logits(ids))
    np.testing.assert_allclose(g4_refs["moe-split"], g4_refs["moe"], atol=1e-5)


# --------------------------------------------------------------------------------------------- config and layout


def test_layer_layout(g4_paths, load_model):
    dense = load_model(g4_paths["dense"]).config
    assert [s.sliding for s in dense.layers] == [True, True, False] * 2
    assert [(s.head_dim, s.n_kv_heads, s.n_rot) for s in dense.layers[:3]] == [(32, 2, 32)] * 2 + [(64, 1, 64)]
    assert all(s.attn_scale == 1.0 and s.writes_kv and s.kv_slot == i for i, s in enumerate(dense.layers))
    assert [s.rope_base for s in dense.layers[:3]] == [1e4, 1e4, 1e6]
    assert dense.final_softcap == 30.0 and dense.act == "gelu" and dense.ple_dim == 0
    params = load_model(g4_paths["dense"]).params
    # K=V on global layers (attn_v may sit in a fused attn_q+attn_k+attn_v on the kernels' path)
    assert [any("attn_v" in k.split("+") for k in p) for p in params["layers"]] == [True, True, False] * 2
    np.testing.assert_array_equal(params["rope_freqs"], np.float32([1.0] * 8 + [1e30] * 24))  # 8 of 32 pairs rotate

    e2b = load_model(g4_paths["e2b"]).config
    # first shared layer 5: sliding sharers read layer 3, global sharers layer 4
    assert [(s.writes_kv, s.kv_slot) for s in e2b.layers] == [(True, i) for i in range(5)] + [(False, 3), (False, 4)]
    assert [s.ffn_dim for s in e2b.layers] == [96] * 5 + [192] * 2
    assert e2b.n_kv_slots == 5 and e2b.ple_dim == 16
    e4b = load_model(g4_paths["e4b"]).config
    assert [s.kv_slot for s in e4b.layers[6:]] == [4, 5]
    cache = load_model(g4_paths["e2b"]).new_cache(32)
    assert [k.shape[2:] for k in cache.k] == [(1, 32)] * 4 + [(1, 64)]

    moe = load_model(g4_paths["moe"]).config
    assert (moe.n_expert, moe.n_expert_used, moe.expert_ffn_dim) == (16, 4, 32)
    assert all(s.moe and s.ffn_dim == 64 for s in moe.layers)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"drop_keys": ("attention.sliding_window_pattern",)}, "sliding_window_pattern"),
        ({"drop_keys": ("attention.value_length",)}, "value_length"),
        ({"drop_keys": ("embedding_length_per_layer_input",)}, "embedding_length_per_layer_input"),
        # 3 shared layers of (S,S,S,S,F,S,F): the first sharer (layer 4, global) would read layer 2 (sliding)
        ({"spec": dataclasses.replace(GEMMA4_VARIANTS["e2b"], shared_kv_layers=3)}, "other type"),
    ],
)
def test_bad_metadata_is_a_clear_error(kw, match, tmp_path):
    import fucina_jax

    path = write_gemma4_fixture(tmp_path / "bad.gguf", "e2b", **kw)
    with pytest.raises(MetadataError, match=match):
        fucina_jax.load(path)


# --------------------------------------------------------------------------------------------- cache and steps


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decode_equals_full_forward(variant, g4_paths, load_model):
    """Prefill + decode across the window (8) and through shared-KV layers == one uncached forward."""
    model = load_model(g4_paths[variant])
    ids = ids_for(model.config.n_vocab, 40, seed=3)
    full = model.logits(ids)
    for n_prefill in (1, 13):
        rows, cache = decode_rows(model, ids, n_prefill)
        diff = np.abs(rows - full[n_prefill - 1 :]).max()
        print(f"gemma4 {variant} prefill {n_prefill}: max |cached - full| = {diff:.2e}")
        assert diff < ROW_TOL
        np.testing.assert_array_equal(rows.argmax(-1), full[n_prefill - 1 :].argmax(-1))
        assert int(cache.length[0]) == len(ids)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [4, 16])
def test_verify_rows_equal_decode_rows(variant, k, g4_paths, load_model):
    model = load_model(g4_paths[variant])
    ids = ids_for(model.config.n_vocab, 13 + k, seed=k)
    start = 13
    dec, _ = decode_rows(model, ids, start)
    cache = model.new_cache(64)
    _, cache = model.prefill(ids[:start], cache)
    ver, cache = engine.verify_step(model.params, jnp.asarray(ids[None, start:]), cache, model.config)
    diff = np.abs(np.asarray(ver[0]) - dec[1:]).max()
    print(f"gemma4 {variant} k={k}: max |verify row - decode row| = {diff:.2e}")
    assert diff < ROW_TOL
    assert int(cache.length[0]) == start + k


@pytest.mark.parametrize("variant", VARIANTS)
def test_rewind_across_window_and_shared_kv_is_bitwise_fresh(variant, g4_paths, load_model):
    """Two rejected 16-wide verifies (junk written to every cache slot 20..51, donor slots of the shared-KV layers
    included), a rewind of 32 > 4 windows back to 20, then the real continuation: logits and the committed cache are
    bit-identical to a run that never took the detour."""
    model = load_model(g4_paths[variant])
    ids = ids_for(model.config.n_vocab, 44, seed=5)
    junk = jnp.asarray(np.arange(500, 516, dtype=np.int32)[None])

    def run(detour: bool):
        cache = model.new_cache(64)
        _, cache = model.prefill(ids[:20], cache)
        if detour:
            for _ in range(2):
                _, cache = engine.verify_step(model.params, junk, cache, model.config)
            assert int(cache.length[0]) == 52
            cache = truncate(cache, 20)
        ver, cache = engine.verify_step(model.params, jnp.asarray(ids[None, 20:36]), cache, model.config)
        rows = [np.asarray(ver[0])]
        for t in ids[36:]:
            logits, cache = engine.decode_step(model.params, jnp.asarray([t]), cache, model.config)
            rows.append(np.asarray(logits))
        return np.concatenate(rows), cache

    fresh_rows, fresh = run(False)
    rows, cache = run(True)
    np.testing.assert_array_equal(rows, fresh_rows)
    n = len(ids)
    for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
        np.testing.assert_array_equal(np.asarray(a)[:, :n], np.asarray(b)[:, :n])
    assert int(cache.length[0]) == n
