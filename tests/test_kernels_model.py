"""The quantized-kernel forward against the f32 reference path, against llama.cpp, and against itself across
verify widths (decode rows == verify rows, bit for bit)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import fucina_jax
from fucina_jax import engine, kernels
from fucina_jax.errors import MeshError
from fucina_jax.models import truncate
from fucina_jax.testing import write_fixture

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

IDS = list(range(5, 70))


def is_packed(model) -> bool:
    return model.config.kernels and n_packed(model) > 0


def n_packed(model) -> int:
    import jax

    leaves = jax.tree_util.tree_leaves(model.params, is_leaf=lambda x: isinstance(x, kernels.QWeight))
    return sum(isinstance(x, kernels.QWeight) for x in leaves)


def assert_same_clear_argmax(a, ref):
    """a's argmax is ref's wherever ref's top-2 margin is clear (> 0.5), at >= 10 such positions."""
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= 10
    np.testing.assert_array_equal(a.argmax(-1)[clear], ref.argmax(-1)[clear])


def assert_tracks_the_f32_path(a, b):
    """q8 activations against f32 ones: the clear argmaxes agree and no logit moves by more than 4% of the range."""
    assert_same_clear_argmax(a, b)
    assert np.abs(a - b).max() <= 0.04 * (b.max() - b.min())


@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma3", "gemma4-dense", "gemma4-e2b"])
def test_fast_path_tracks_the_f32_path(quantized, kind):
    """Same weights, f32 vs q8 activations: the argmax agrees wherever the f32 top-2 margin is not a near-tie, and
    no logit moves by more than 4% of the logit range (measured 1.2-1.7%)."""
    fast, ref, _ = quantized(kind, "Q8_0")
    assert is_packed(fast) and n_packed(ref) == 0
    assert_tracks_the_f32_path(fast.logits(IDS), ref.logits(IDS))


@pytest.mark.parametrize("kind", ["qwen3moe", "gemma4-moe"])
def test_fast_path_tracks_the_f32_path_moe(quantized, kind):
    """MoE: q8 activations can flip a near-tie in the router's top-k, which swaps an expert; so the bound is on
    agreement, not on every logit (measured: qwen3moe fixture 39 of 44 clear positions, gemma4-moe all)."""
    fast, ref, _ = quantized(kind, "Q8_0")
    assert n_packed(fast) > 0 and n_packed(ref) == 0
    a, b = fast.logits(IDS), ref.logits(IDS)
    top2 = np.sort(b, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= 10
    assert (a.argmax(-1)[clear] == b.argmax(-1)[clear]).mean() >= 0.8


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0"])
def test_quantized_qwen3_equals_llamacpp(quantized, llama_ref, qtype):
    """llama.cpp also rounds activations to q8_0 blocks with an fp16 scale for these weight types, so the two
    engines compute the same integer products: logits agree to float-summation noise (Q8_0/Q4_0 measured < 5e-5
    everywhere; Q5_0 the same until a last-bit difference flips one activation's rounding, which the cache carries),
    where the f32 reference path is ~0.2 away. (Q4_1/Q5_1 pair with llama.cpp's q8_1, whose block sum is rounded to fp16;
    fucina_jax keeps the exact integer sum, so those agree less tightly; K-quants pair with q8_K blocks of 256.)"""
    fast, ref, path = quantized("qwen3", qtype)
    want = llama_ref(path).logits(IDS)
    def exact_positions(model):  # positions whose whole logits row agrees to 1e-4
        return (np.abs(model.logits(IDS) - want).max(axis=1) < 1e-4).mean()

    assert exact_positions(fast) >= 0.8  # measured: Q8_0/Q4_0 all 65, Q5_0 58 of 65 (a flip at 57 propagates)
    assert exact_positions(ref) <= 0.1  # the comparison tells the two paths apart


def decode_vs_verify(model, prompt, follow):
    """Max |verify row - decode row| over every verify bucket, after `prompt` is cached."""
    cache = model.new_cache(256)
    _, cache = model.prefill(prompt, cache)
    base = int(cache.length[0])
    rows = []
    c = cache
    for t in follow:
        out, c = engine.decode_step(model.params, jnp.asarray([t], jnp.int32), c, model.config)
        rows.append(np.asarray(out[0]))
    rows = np.stack(rows)
    worst = 0.0
    for k in engine.VERIFY_BUCKETS:
        c = truncate(c, base)
        out, c = engine.verify_step(model.params, jnp.asarray([follow[:k]], jnp.int32), c, model.config)
        worst = max(worst, float(np.abs(np.asarray(out[0]) - rows[:k]).max()))
    return worst


@pytest.mark.parametrize("kind, qtype", [("qwen3", "Q4_1"), ("gemma4-e2b", "Q4_1"), ("qwen3", "F16"),
                                         ("gemma4-e2b", "BF16"), ("gemma3", "F32"), ("qwen3moe", "Q8_0"),
                                         ("gemma4-moe", "Q8_0")])
def test_verify_rows_are_decode_rows_bitwise_on_fixtures(quantized, kind, qtype):
    fast, _, _ = quantized(kind, qtype)
    assert is_kernel_model(fast)
    assert decode_vs_verify(fast, IDS[:20], IDS[20:36]) == 0.0


def kernel_weights(model) -> list:
    import jax

    leaves = jax.tree_util.tree_leaves(model.params, is_leaf=lambda x: isinstance(x, kernels.KERNEL_WEIGHTS))
    return [x for x in leaves if isinstance(x, kernels.KERNEL_WEIGHTS)]


def is_kernel_model(model) -> bool:
    return model.config.kernels and len(kernel_weights(model)) > 0


@pytest.mark.parametrize("qtype", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma3", "gemma4-e2b"])
def test_float_files_run_on_the_float_kernel(quantized, kind, qtype):
    """Every matmul weight of a float file stays in the file's type (2 bytes a value for F16/BF16, not 4) and runs
    on the float kernel; with f32 activations on both paths, only the summation order differs from the f32 path:
    measured <= 7.6e-7 of the logit range."""
    from fucina_jax.gguf_io import open_gguf
    from fucina_jax.models.loading import PACKED_KEYS

    fast, ref, path = quantized(kind, qtype)
    ws = kernel_weights(fast)
    assert fast.config.kernels and not kernel_weights(ref)
    assert all(isinstance(w, kernels.FWeight) and w.w.dtype == kernels.FLOAT_TYPES[GGMLQuantizationType[qtype]] for w in ws)
    gf = open_gguf(path)
    matmuls = [t for name, t in gf.tensors.items() if len(t.shape) == 2 and name.split(".")[-2] in PACKED_KEYS]
    assert sum(w.nbytes for w in ws) == sum(t.n_bytes for t in matmuls)  # all of them, at the file's size
    a, b = fast.logits(IDS), ref.logits(IDS)
    assert_same_clear_argmax(a, b)
    assert np.abs(a - b).max() <= 1e-5 * (b.max() - b.min())


def test_real_model_in_bf16_runs_on_the_float_kernel(tmp_path_factory, smollm2_path):
    """SmolLM2-135M-Instruct with its matmul weights written as BF16 (testing.write_float_copy; 271 MB): real weights
    on the float kernel, at the file's size, verify rows bitwise the decode rows, the f32 path's logits to 1e-5 of
    the range."""
    from fucina_jax.testing import write_float_copy

    path = write_float_copy(smollm2_path, tmp_path_factory.mktemp("bf16") / "smollm2-bf16.gguf", "BF16")
    model = fucina_jax.load(path)
    ws = kernel_weights(model)
    assert model.config.kernels and all(isinstance(w, kernels.FWeight) and w.w.dtype == jnp.bfloat16 for w in ws)
    prompt = model.tokenizer.encode("The history of the printing press begins in")
    follow = model.tokenizer.encode(" Mainz, where Johannes Gutenberg built a press that used movable type")
    assert decode_vs_verify(model, prompt, (follow * 2)[:16]) == 0.0
    a, b = model.logits(prompt + follow), fucina_jax.load(path, f32=True).logits(prompt + follow)
    top2 = np.sort(b, axis=-1)[:, -2:]
    apart = top2[:, 1] - top2[:, 0] > 1e-3  # all but exact near-ties (the paths differ by ~1e-5)
    assert apart.mean() > 0.9
    np.testing.assert_array_equal(a.argmax(-1)[apart], b.argmax(-1)[apart])
    assert np.abs(a - b).max() <= 1e-5 * (b.max() - b.min())


@pytest.mark.parametrize("kind, qtype, kind_of_weight", [("gemma4-e4b", "Q8_0", kernels.QWeight),
                                                          ("gemma4-e2b", "BF16", kernels.FWeight)])
def test_gemma4_per_layer_table_stays_in_the_files_type(quantized, kind, qtype, kind_of_weight):
    """Gemma 4's per-layer embedding table ([V, layers x 256]: 9.4 GB in f32 for E2B) is read in place, as the
    file stores it, and gives the logits the f32 table gives, bit for bit."""
    import dataclasses

    fast, ref, _ = quantized(kind, qtype)
    table = fast.params["per_layer_token_embd"]
    assert isinstance(table, kind_of_weight) and table.nbytes < ref.params["per_layer_token_embd"].nbytes
    f32_table = dataclasses.replace(fast, params={**fast.params, "per_layer_token_embd":
                                                  ref.params["per_layer_token_embd"]})
    np.testing.assert_array_equal(fast.logits(IDS), f32_table.logits(IDS))


@pytest.mark.parametrize("kind", ["qwen3moe", "gemma4-moe"])
def test_quantized_expert_stacks_stay_quantized(quantized, llama_ref, kind):
    """Expert stacks of a quantized file stay at the file's size (kernels.pack_experts) and only the routed experts
    are computed. For Q8_0 llama.cpp pairs the same q8_0 activations, so on qwen3moe the two engines give the same
    logits (every row within 1e-4, where the f32 path is at no row); gemma4-moe differs elsewhere (llama.cpp's fp16
    GELU table), so there the clear argmaxes agree."""
    from fucina_jax.gguf_io import open_gguf
    from fucina_jax.models.loading import EXPERT_KEYS

    fast, ref, path = quantized(kind, "Q8_0")
    stacks = [w for w in kernel_weights(fast) if isinstance(w, kernels.QWeight) and w.experts]
    gf = open_gguf(path)
    # (the gemma4-moe fixture's fused gate_up stack has rows of 80 values, not whole Q8_0 blocks: it stays F32 in
    # the file, and the routed path gathers its f32 experts beside the packed down stack)
    files = [t for name, t in gf.tensors.items()
             if len(t.shape) == 3 and name.split(".")[-2] in EXPERT_KEYS and t.qtype in kernels.PACKED_TYPES]
    assert len(stacks) == len(files) > 0 and sum(w.nbytes for w in stacks) == sum(t.n_bytes for t in files)
    # the routers (F32 in the file, as llama.cpp's quantizer leaves them) run on the float kernel: row-exact logits
    routers = [layer["ffn_gate_inp"] for layer in fast.params["layers"] if "ffn_gate_inp" in layer]
    assert len(routers) == sum(name.endswith("ffn_gate_inp.weight") for name in gf.tensors) > 0
    assert all(isinstance(r, kernels.FWeight) and r.w.dtype == np.float32 for r in routers)
    want = llama_ref(path).logits(IDS)
    got = fast.logits(IDS)
    assert_same_clear_argmax(got, want)
    if kind == "qwen3moe":
        def close_rows(logits):
            return (np.abs(logits - want).max(axis=1) < 1e-4).mean()

        assert close_rows(got) >= 0.9 and close_rows(ref.logits(IDS)) <= 0.1  # measured 1.0 and 0.0


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_float_files_agree_with_llamacpp(quantized, llama_ref, kind, qtype):
    """llama.cpp rounds activations to the weight's type before its dot (fp16: 11 bits, bf16: 8); fucina_jax keeps
    them f32 as the reference path does. So the engines agree on the clear argmaxes and to within that rounding
    (measured: F16 0.03-0.06%, BF16 0.24-0.33% of the logit range), and fucina_jax's two paths agree with llama.cpp
    equally well (the difference is llama.cpp's rounding, not the kernel)."""
    fast, ref, path = quantized(kind, qtype)
    want = llama_ref(path).logits(IDS)
    got = fast.logits(IDS)
    assert_same_clear_argmax(got, want)
    span = want.max() - want.min()
    assert np.abs(got - want).max() <= 0.01 * span
    assert abs(np.abs(got - want).max() - np.abs(ref.logits(IDS) - want).max()) <= 1e-4 * span


def test_verify_rows_are_decode_rows_bitwise_on_real_models(gemma3, smollm2):
    for model in (gemma3, smollm2):
        assert is_packed(model)
        prompt = model.tokenizer.encode("The history of the printing press begins in")
        follow = model.tokenizer.encode(" Mainz, where Johannes Gutenberg built a press that used movable type")
        assert decode_vs_verify(model, prompt, (follow * 2)[:16]) == 0.0


def test_real_gemma3_fast_path_tracks_the_f32_path(gemma3, gemma3_path):
    ref = fucina_jax.load(gemma3_path, f32=True)
    ids = gemma3.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of")
    a, b = gemma3.logits(ids), ref.logits(ids)
    top2 = np.sort(b, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1.0
    np.testing.assert_array_equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
    assert np.abs(a - b).max() <= 0.05 * (b.max() - b.min())


def test_packed_weights_refuse_to_be_sharded(quantized):
    from fucina_jax.sharding import make_mesh, shard_model

    fast, _, _ = quantized("qwen3", "Q8_0")
    with pytest.raises(MeshError, match="f32=True"):
        shard_model(fast, make_mesh(1))


def test_memory_of_packed_weights(gemma3, gemma3_path):
    """The packed weights of the embedded model take no more bytes than its GGUF file (Q8_0 and Q5_0 codes and
    scales exactly the file's size; measured 252.9 MB packed against a 253.1 MB file; 280 MB before 5- and 6-bit
    codes had bit planes), not f32's 4 bytes per value."""
    import os

    import jax

    n_values = sum(w.n * w.k for w in jax.tree_util.tree_leaves(
        gemma3.params, is_leaf=lambda x: isinstance(x, kernels.QWeight)) if isinstance(w, kernels.QWeight))
    n_bytes = sum(w.nbytes for w in jax.tree_util.tree_leaves(
        gemma3.params, is_leaf=lambda x: isinstance(x, kernels.QWeight)) if isinstance(w, kernels.QWeight))
    assert n_values > 250e6
    assert n_bytes <= os.path.getsize(gemma3_path)


@pytest.mark.parametrize("path_kind", ["kernels", "f32"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_fitted_cache_gives_the_full_context_stream(quantized, monkeypatch, path_kind, temperature):
    """One-shot generation sizes its KV cache to prompt + max_tokens (models.fitted_capacity), not to ctx: the
    plain and the speculative streams, and every logit row the decoder sampled from, equal those of a run on a
    full-context cache, bit for bit (sliding-window fixture, rows past the window included)."""
    import fucina_jax.generate as drivers
    from fucina_jax.generate import generate
    from fucina_jax.models import fitted_capacity
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.generate import generate_speculative
    from fucina_jax.speculative import SpecOptions

    fast, ref, _ = quantized("gemma3", "Q8_0")
    model = fast if path_kind == "kernels" else ref
    ctx, prompt, n = 2048, IDS[:20] * 2, 40
    assert fitted_capacity(len(prompt) + n, ctx) == 256
    sampler = SamplerConfig(temperature=temperature, seed=7)
    options = SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False)

    def runs():
        plain = generate(model, prompt, max_tokens=n, sampler=sampler, ctx=ctx, stop_ids=()).run()
        rows = []
        spec = generate_speculative(model, prompt, max_tokens=n, sampler=sampler, ctx=ctx, stop_ids=(),
                                    options=options, clock=False)
        spec.decoder.on_verify_row = lambda *a: rows.append(np.asarray(a[-1]))
        out = spec.run()
        return plain.tokens, out.tokens, spec.decoder.cache.capacity, rows, out.spec["verify_steps"]

    fitted = runs()
    monkeypatch.setattr(drivers, "fitted_capacity", lambda need, ctx: ctx)
    full = runs()
    assert (fitted[2], full[2]) == (256, 2048)
    assert fitted[0] == full[0] == fitted[1] == full[1]
    assert len(fitted[0]) == n and fitted[4] > 0
    assert len(fitted[3]) == len(full[3]) > 0
    for a, b in zip(fitted[3], full[3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_random_code_fixtures_are_valid_models(tmp_path, llama_ref, qtype):
    """write_fixture(random_codes=True) (the writer of scripts/bench_memory.py's 1B-shaped model) makes a file that
    llama.cpp runs to the same logits as fucina_jax (the exact-integer agreement of the test above), with weights at
    the requested spread."""
    import dataclasses

    from fucina_jax.testing import FIXTURES

    spec = dataclasses.replace(FIXTURES["qwen3"], n_vocab=384)  # no GELU: llama.cpp's fp16 GELU table would blur it
    path = write_fixture(tmp_path / f"random-{qtype}.gguf", spec=spec, qtype=qtype, random_codes=True)
    fast, ref = fucina_jax.load(path), fucina_jax.load(path, f32=True)
    assert is_packed(fast) and fast.config.n_vocab == 384
    w = np.asarray(ref.params["layers"][0]["ffn_down"])
    assert abs(w.std() * np.sqrt(spec.n_ff) - 1.0) < 0.1  # std 1/sqrt(n_in), as the f32 fixtures draw it
    want = llama_ref(path).logits(IDS)
    got = fast.logits(IDS)
    # exact until a last-bit difference flips one activation's rounding, which the cache then carries (measured:
    # Q8_0 all 65 positions, Q4_0 the first 19)
    assert (np.abs(got - want).max(axis=1) < 1e-4)[:12].all()
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.2
    assert clear.sum() >= 20 and (got.argmax(-1) == want.argmax(-1))[clear].mean() >= 0.9


@pytest.mark.parametrize("qtype, bits, bs, scale_dtype, bytes_per_weight", [
    ("Q3_K", 4, 16, jnp.int8, (256 * 16 / 2 + 288) / (256 * 16)),  # 0.570: the file has 0.430
    ("Q2_K", 4, 16, jnp.float32, 1.0),  # the file has 0.328
    ("IQ4_NL", 8, 32, jnp.float16, 34 / 32),  # the file has 0.5625
    ("IQ4_XS", 8, 32, jnp.float32, 36 / 32),  # the file has 0.531
])
def test_low_bit_types_run_on_the_kernels(tmp_path, llama_ref, qtype, bits, bs, scale_dtype, bytes_per_weight):
    """Q3_K (the bulk of Q3_K_S/M/L files) packs losslessly as 4-bit codes q + 8 with the file's int8 sub-block
    scales, Q2_K as 4-bit codes with f32 scale and offset per 16 values, IQ4_NL/IQ4_XS as byte codes (their 16 levels
    are int8 values) with fp16 / f32 scales: the kernels run them at 0.57-1.13 bytes per weight where the f32 path
    holds 4. Against the f32 path the usual q8-activation bound holds; llama.cpp pairs Q2_K, Q3_K and IQ4_XS with q8_K
    activations (blocks of 256, not 32), so agreement with it is on the argmax where its top-2 margin is clear; with
    IQ4_NL it uses q8_0, and the logits agree. Verify rows stay the decode rows bit for bit."""
    import dataclasses

    import jax

    from fucina_jax.testing import FIXTURES

    spec = dataclasses.replace(FIXTURES["qwen3"], n_embd=256, head_dim=64, n_ff=512, n_vocab=384)
    path = write_fixture(tmp_path / f"{qtype}.gguf", spec=spec, qtype=qtype, random_codes=True)
    fast, ref = fucina_jax.load(path), fucina_jax.load(path, f32=True)
    packed = [x for x in jax.tree_util.tree_leaves(fast.params, is_leaf=lambda x: isinstance(x, kernels.QWeight))
              if isinstance(x, kernels.QWeight)]
    # every matmul and the embedding, in the type's form
    assert len(packed) >= 1 + 3 * spec.n_layer and n_packed(ref) == 0
    assert all(w.bits == bits and w.bs == bs and w.a.dtype == scale_dtype for w in packed)
    assert sum(w.nbytes for w in packed) / sum(w.shape[0] * w.shape[1] for w in packed) == bytes_per_weight
    a = fast.logits(IDS)
    assert_tracks_the_f32_path(a, ref.logits(IDS))
    want = llama_ref(path).logits(IDS)
    assert_same_clear_argmax(a, want)
    if qtype == "IQ4_NL":  # llama.cpp pairs it with q8_0 activations: the same integers (measured: all 65 rows equal)
        assert (np.abs(a - want).max(axis=1) < 1e-4).mean() >= 0.8
    assert decode_vs_verify(fast, IDS[:20], IDS[20:36]) == 0.0


def test_f16_cache_keeps_rows_exact_and_tracks_f32(quantized, llama_ref):
    """cache_type="f16" (half the KV memory; llama.cpp's default cache type): verify rows stay bitwise the decode
    rows; logits stay within the q8 noise of the f32-cache ones (measured max 0.05 on this fixture, whose logits
    span ~16) and pick the same token wherever llama.cpp's default f16-cache run has a clear top-2 margin (llama.cpp
    also rounds Q and the softmax weights to fp16 there, so it is not bitwise comparable); the f32 reference path
    runs on an f16 cache too."""
    fast32, _, path = quantized("qwen3", "Q8_0")
    fast16 = fucina_jax.load(path, cache_type="f16")
    ref16 = fucina_jax.load(path, f32=True, cache_type="f16")
    assert fast16.new_cache(16).k[0].dtype == jnp.float16 and fast32.new_cache(16).k[0].dtype == jnp.float32
    assert decode_vs_verify(fast16, IDS[:20], IDS[20:36]) == 0.0
    a16, a32 = fast16.logits(IDS), fast32.logits(IDS)
    assert 0.0 < np.abs(a16 - a32).max() <= 0.04 * (a32.max() - a32.min())
    want = llama_ref(path, f32_cache=False).logits(IDS)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= 10
    for got in (a16, ref16.logits(IDS)):
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    with pytest.raises(ValueError, match="cache_type"):
        fucina_jax.load(path, cache_type="q8_0")
    # and the speculative stream is the plain stream, verifying drafts against the f16 cache
    from fucina_jax.generate import generate
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.generate import generate_speculative
    from fucina_jax.speculative import SpecOptions

    prompt = IDS[:12] * 3
    for sampler in (SamplerConfig(temperature=0.0, seed=0), SamplerConfig(temperature=0.9, seed=3)):
        plain = generate(fast16, prompt, max_tokens=40, sampler=sampler, stop_ids=()).run()
        spec = generate_speculative(fast16, prompt, max_tokens=40, sampler=sampler, stop_ids=(), clock=False,
                                    options=SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False)).run()
        assert spec.tokens == plain.tokens and spec.spec["verify_steps"] > 0


def test_step_profile_names_each_op_by_its_kernel(quantized, load_script):
    """scripts/profile_step.py: the profiled events of the decoder's fused step are matched to its compiled program's
    ops. Every FFI kernel of the step shows up by its target, with the same calls a step at every width (a layer's
    kernels do not depend on the rows), and the step's matmuls run once per weight call of each layer."""
    mod = load_script("scripts/profile_step.py")
    fast, _, _ = quantized("qwen3", "Q8_0")
    got = mod.profile(fast, (1, 4), prompt_len=20, ctx=64, steps=3)
    n_layers = len(fast.params["layers"])
    for w, kinds in got.items():
        for kernel in ("fucina_qmatmul", "fucina_attention_write", "fucina_norm_rope", "fucina_residual_norm"):
            assert kernel in kinds and kinds[kernel][0] > 0, (w, kernel, sorted(kinds))
        assert kinds["fucina_attention_write"][1] == n_layers, (w, kinds["fucina_attention_write"])
    ffi = lambda w: {k: n for k, (_, n) in got[w].items() if k.startswith("fucina_")}
    assert ffi(1) == ffi(4)
    assert "width 4: ops" in mod.report(got) and "fucina_qmatmul" in mod.report(got)
    # a program's op names are its own: another step's events match nothing
    other = mod.op_kinds("%x.1 = f32[] add(...)")
    assert mod.by_kind([{"ph": "X", "name": "fusion.123456", "dur": 5.0}], other, 1) == {}
