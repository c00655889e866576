"""The quantized kernels (fucina_jax.kernels) against independent references.

- packing is lossless: the packed codes stand for exactly the values quants.dequantize gives, for every type;
- kernel == a NumPy integer reference that reproduces the activation rounding and the float sequence bit for bit
  (fma emulated in float64), for every type and every instruction set the CPU has (AVX-512 VNNI, AVX2, scalar);
- each output row is bitwise independent of the other rows in the call;
- the dispatch falls back when told to (env var in a fresh process, set_isa in this one);
- the kernels' own workers and XLA's pool give the same bits, also with programs running at once;
- embedding rows gathered from the packed codes == dequantized rows;
- the output layer's fused pick (qlinear_pick) == the argmax and top-k of the product, bitwise;
- the float kernel (F32, F16, BF16 weights): the file's values, kept in the file's type; kernel == a NumPy statement
  of its fixed float sequence, bit for bit, on every instruction set and for every row count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from fucina_jax import kernels
from fucina_jax.kernels.pack import PACKED_TYPES, decode_codes, pack_codes, unpack_values
from fucina_jax.quants import dequantize
from test_layers import np_attention  # float64 attention straight from the definition

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

# byte offsets of the f16 scale fields per block (everything else in a block is free-form bits)
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2],
              T.Q5_K: [0, 2], T.Q6_K: [208], T.Q3_K: [108], T.Q2_K: [80, 82],
              T.IQ4_NL: [0], T.IQ4_XS: [0]}


def random_tensor(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes of a random [n, k] tensor: random code bits, finite random f16 scales of both signs."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.uniform(1e-3, 5e-2, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])).astype("<f2")
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def fma(a, b, c):
    """float32 fma(a, b, c): the product of two f32 is exact in f64; one f64 add, one rounding to f32 (a double
    rounding could differ in the last bit about once in 2^28 operations; the inputs here are fixed)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def reference(x: np.ndarray, u: np.ndarray, a: np.ndarray, c, bs: int) -> np.ndarray:
    """The kernel's arithmetic in NumPy: q8 activations per 32-block, exact integer dots, the documented float
    sequence per (row, column)."""
    M, K = x.shape
    N = u.shape[0]
    nb, nsub = K // 32, 32 // bs
    xb = x.reshape(M, nb, 32)
    finite = np.isfinite(xb).all(-1)
    amax = np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1).astype(np.float32)
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    q[~finite] = 0
    d = np.where(finite, d.astype(np.float16).astype(np.float32), np.float32(np.nan))  # the block keeps fp16(d)
    qs = q.reshape(M, nb, nsub, bs)
    S = qs.sum(-1)  # [M, nb, nsub]
    I = np.einsum("mbjk,nbjk->mnbj", qs, u.reshape(N, nb, nsub, bs).astype(np.int64))
    acc = np.zeros((M, N), np.float32)
    for b in range(nb):
        for j in range(nsub):
            s = d[:, b, None] * a[None, :, b * nsub + j]
            if c is None:
                acc = fma(s, (I[:, :, b, j] - 128 * S[:, b, j, None]).astype(np.float32), acc)
            else:
                acc = fma(s, I[:, :, b, j].astype(np.float32), acc)
                acc = fma(d[:, b, None] * c[None, :, b * nsub + j], np.broadcast_to(S[:, b, j, None], acc.shape)
                          .astype(np.float32), acc)
    return acc


def qweight(raw, qtype, shape) -> kernels.QWeight:
    return jax.tree_util.tree_map(jnp.asarray, kernels.pack_weight(raw, qtype, shape))


_qlinear = jax.jit(kernels.qlinear)


@pytest.fixture
def each_isa():
    """Run the body once per instruction set this CPU supports; restores the best one afterwards."""
    isas = kernels.supported_isas()
    yield isas
    kernels.set_isa(isas[0])


def shape_for(qtype) -> tuple[int, int]:
    block = GGML_QUANT_SIZES[qtype][0]
    return 40, (512 if block == 256 else 96)  # 40 columns: not a multiple of 16 (padding path)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_packing_is_lossless(qtype):
    n, k = shape_for(qtype)
    raw = random_tensor(qtype, n, k)
    u, a, c, bs = decode_codes(raw, qtype, (n, k))
    want = dequantize(raw, qtype, (n, k))
    got = unpack_values(u, a, c, bs)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_kernel_equals_integer_reference_on_every_isa(qtype, each_isa):
    n, k = shape_for(qtype)
    raw = random_tensor(qtype, n, k, seed=1)
    u, a, c, bs = decode_codes(raw, qtype, (n, k))
    w = qweight(raw, qtype, (n, k))
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((17, k)) * rng.uniform(0.1, 10, (17, 1))).astype(np.float32)
    x[5, :32] = 0.0  # an all-zero block: dx = 0
    want = reference(x, u, a, c, bs)
    for isa in each_isa:
        kernels.set_isa(isa)
        for m in (1, 3, 8, 17):
            got = np.asarray(_qlinear(jnp.asarray(x[:m]), w))
            assert got.shape == (m, n)
            assert np.array_equal(got.view(np.uint32), want[:m].view(np.uint32)), (isa, m)


def test_kernel_is_close_to_the_f32_product():
    """Sanity of the whole construction: q8 activations cost ~1% relative error, no more."""
    n, k = 64, 512
    raw = random_tensor(T.Q4_K, n, k, seed=3)
    x = np.random.default_rng(4).standard_normal((4, k)).astype(np.float32)
    exact = x @ dequantize(raw, T.Q4_K, (n, k)).T
    got = np.asarray(_qlinear(jnp.asarray(x), qweight(raw, T.Q4_K, (n, k))))
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q3_K], ids=lambda t: t.name)
def test_rows_are_bitwise_independent_of_the_batch(qtype, each_isa):
    n, k = 48, 512
    w = qweight(random_tensor(qtype, n, k, seed=5), qtype, (n, k))
    x = np.random.default_rng(6).standard_normal((16, k)).astype(np.float32)
    for isa in each_isa:
        kernels.set_isa(isa)
        alone = np.concatenate([np.asarray(_qlinear(jnp.asarray(x[i : i + 1]), w)) for i in range(16)])
        for m in (2, 4, 7, 8, 9, 16):
            for start in (0, 16 - m):
                got = np.asarray(_qlinear(jnp.asarray(x[start : start + m]), w))
                assert np.array_equal(got, alone[start : start + m]), (isa, m, start)


@pytest.mark.parametrize("qtype, bad", [(T.Q8_0, np.inf), (T.F16, np.nan), (T.BF16, -np.inf)],
                         ids=["Q8_0-inf", "F16-nan", "BF16-neginf"])
def test_non_finite_input_poisons_only_its_row(qtype, bad):
    """A non-finite activation gives NaN in its whole row on the quantized kernels (its q8 block is poisoned), and
    what f32 arithmetic gives on the float kernel (an inf stays +-inf, or NaN where it meets a zero weight)."""
    n, k = 32, 64
    x = np.random.default_rng(8).standard_normal((3, k)).astype(np.float32)
    x[1, 40] = bad
    if qtype in kernels.FLOAT_TYPES:
        raw = float_tensor(qtype, n, k, seed=7)
        got = np.asarray(_qlinear(jnp.asarray(x), fweight(raw, qtype, (n, k))))
        want = float_reference(x, dequantize(raw, qtype, (n, k)))
        assert not np.isfinite(want[1]).any()
        np.testing.assert_array_equal(got, want)  # NaN where want has NaN, the same infinities
    else:
        got = np.asarray(_qlinear(jnp.asarray(x), qweight(random_tensor(qtype, n, k, seed=7), qtype, (n, k))))
        assert np.isnan(got[1]).all()
    assert np.isfinite(got[[0, 2]]).all()


def test_activation_blocks_quantized_sixteen_at_a_time_keep_their_bits(each_isa):
    """Rows of 37 blocks (AVX-512 quantizes 16 blocks of a row per pass, the rest one by one): all-zero blocks, exact
    .5 ties, blocks whose scale rounds to an fp16 subnormal, to zero or overflows to inf, and a non-finite value in a
    16-block pass (that row is NaN; the others keep the reference's bits), on every instruction set."""
    qtype, n, k = T.Q8_0, 32, 32 * 37
    raw = random_tensor(qtype, n, k, seed=11)
    u, a, c, bs = decode_codes(raw, qtype, (n, k))
    w = qweight(raw, qtype, (n, k))
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((6, k)) * rng.uniform(0.1, 10, (6, 1))).astype(np.float32)
    x[0, 32 * 3: 32 * 4] = 0.0  # inside the first pass
    x[0, 32 * 20: 32 * 21] = 0.0  # inside the second
    x[1, :32 * 16] = np.tile(np.float32([127.0, 0.5, 1.5, -2.5, 63.5, -0.5, 3.5, 2.5]), 64)  # d = 1: .5 ties
    x[2, 32 * 5: 32 * 6] *= np.float32(1e-7)  # d ~ 1e-8: an fp16 subnormal or zero
    x[2, 32 * 17: 32 * 18] *= np.float32(1e-12)
    x[3, 32 * 30: 32 * 31] *= np.float32(1e6)  # d > 65504: fp16(d) = inf
    x[4, 32 * 9 + 7] = np.inf  # a non-finite value inside a pass
    with np.errstate(over="ignore"):  # fp16(d) = inf is the case
        want = reference(np.where(np.isfinite(x), x, 0).astype(np.float32), u, a, c, bs)
    for isa in each_isa:
        kernels.set_isa(isa)
        got = np.asarray(_qlinear(jnp.asarray(x), w))
        rows = [0, 1, 2, 3, 5]
        np.testing.assert_array_equal(got[rows], want[rows], err_msg=isa)
        assert np.isnan(got[4]).all(), isa


def test_leading_axes_and_jit_in_user_code():
    n, k = 20, 64
    raw = random_tensor(T.Q5_0, n, k, seed=9)
    w = qweight(raw, T.Q5_0, (n, k))
    x = np.random.default_rng(10).standard_normal((2, 3, k)).astype(np.float32)

    @jax.jit
    def f(x, w):  # a user's own jitted function taking the QWeight pytree
        return kernels.qlinear(jnp.tanh(x), w) * 2.0

    got = np.asarray(f(jnp.asarray(x), w))
    flat = np.asarray(_qlinear(jnp.tanh(jnp.asarray(x)).reshape(6, k), w)) * 2.0
    assert got.shape == (2, 3, n)
    np.testing.assert_array_equal(got.reshape(6, n), flat)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q4_1, T.Q5_0, T.Q5_K, T.Q3_K, T.Q2_K,
                                   T.IQ4_NL, T.IQ4_XS],
                         ids=lambda t: t.name)
def test_take_rows_equals_dequantized_rows(qtype):
    n, k = shape_for(qtype)
    raw = random_tensor(qtype, n, k, seed=11)
    w = qweight(raw, qtype, (n, k))
    ids = np.array([[0, 17, n - 1], [5, 5, 33]], np.int32)
    got = np.asarray(jax.jit(kernels.take_rows)(w, jnp.asarray(ids)))
    want = dequantize(raw, qtype, (n, k))[ids]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_1], ids=lambda t: t.name)
def test_expert_rows_are_the_experts_own_products(qtype, each_isa):
    """expert_linear over a packed stack [E, n, k]: row (t, u) is bitwise qlinear(x[t] or x[t, u], expert ids[t, u]),
    whatever the other rows' experts; ids repeat an expert within a token and across tokens, and skip some."""
    E, n, k = 5, 32, 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    raw = random_tensor(qtype, E * n, k, seed=40)
    stack = jax.tree_util.tree_map(jnp.asarray, kernels.pack_experts(raw, qtype, (E, n, k)))
    assert stack.experts == E and stack.n == E * n
    rng = np.random.default_rng(41)
    ids = np.array([[0, 3, 3], [4, 0, 1], [1, 1, 4], [3, 0, 4]], np.int32)  # expert 2 unused
    T_, U = ids.shape
    x_tok = rng.standard_normal((T_, k)).astype(np.float32)
    x_own = rng.standard_normal((T_, U, k)).astype(np.float32)
    parts = [qweight(raw.reshape(E, -1)[e], qtype, (n, k)) for e in range(E)]
    for isa in each_isa:
        kernels.set_isa(isa)
        shared = np.asarray(jax.jit(kernels.expert_linear)(jnp.asarray(x_tok), jnp.asarray(ids), stack))
        own = np.asarray(jax.jit(kernels.expert_linear)(jnp.asarray(x_own), jnp.asarray(ids), stack))
        assert shared.shape == own.shape == (T_, U, n)
        for t in range(T_):
            for u in range(U):
                w = parts[ids[t, u]]
                np.testing.assert_array_equal(shared[t, u], np.asarray(_qlinear(jnp.asarray(x_tok[t:t + 1]), w))[0])
                np.testing.assert_array_equal(own[t, u], np.asarray(_qlinear(jnp.asarray(x_own[t, u:u + 1]), w))[0])


def test_expert_ids_out_of_range_are_an_error():
    stack = jax.tree_util.tree_map(jnp.asarray, kernels.pack_experts(random_tensor(T.Q8_0, 64, 32), T.Q8_0,
                                                                      (2, 32, 32)))
    with pytest.raises(Exception, match="expert id out of range"):
        np.asarray(kernels.expert_linear(jnp.ones((1, 32)), jnp.asarray([[0, 2]], jnp.int32), stack))


# ---------------------------------------------------------------------------------------------------------------------
# The float kernel (F32, F16, BF16 weights as the file stores them)
# ---------------------------------------------------------------------------------------------------------------------

FLOATS = [T.F32, T.F16, T.BF16]


def float_tensor(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes of a random [n, k] float tensor (values of both signs, some exact zeros)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0, :5] = 0.0
    return w.astype(kernels.FLOAT_TYPES[qtype]).view(np.uint8).reshape(-1)


def float_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """fmatmul.cc's sequence: 16 partial sums P[p] = fma(w[k], x[k], P[p]) over k = p, p + 16, ... (fma emulated in
    f64), then P[p] += P[p + h] for h = 8, 4, 2, 1."""
    M, K = x.shape
    P = np.zeros((M, w.shape[0], 16), np.float32)
    wf = w.astype(np.float32)
    for k in range(0, K, 16):
        P = fma(wf[None, :, k:k + 16], x[:, None, k:k + 16], P)
    for h in (8, 4, 2, 1):
        P[..., :h] = P[..., :h] + P[..., h:2 * h]
    return P[..., 0]


def fweight(raw, qtype, shape) -> kernels.FWeight:
    return jax.tree_util.tree_map(jnp.asarray, kernels.pack_weight(raw, qtype, shape))


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_are_the_file_values(qtype):
    n, k = 37, 80
    raw = float_tensor(qtype, n, k, seed=20)
    w = kernels.pack_weight(raw, qtype, (n, k))
    assert isinstance(w, kernels.FWeight) and w.w.dtype == kernels.FLOAT_TYPES[qtype] and w.shape == (n, k)
    assert w.nbytes == raw.nbytes and w.w.ctypes.data % 64 == 0  # the file's bytes, aligned for a zero-copy put
    want = dequantize(raw, qtype, (n, k))
    assert np.array_equal(np.asarray(w.w, np.float32).view(np.uint32), want.view(np.uint32))
    ids = np.array([[0, 17, n - 1], [5, 5, 33]], np.int32)
    got = np.asarray(jax.jit(kernels.take_rows)(fweight(raw, qtype, (n, k)), jnp.asarray(ids)))
    np.testing.assert_array_equal(got, want[ids])


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_kernel_equals_the_reference_on_every_isa(qtype, each_isa):
    """n = 37: column tiles of 4 and 2 with a tail; k = 80: a multiple of 16, not of 32; m up to 17: row tiles of 3
    with both tails. Each row is computed alone (the reference has no batch), so this is row independence too."""
    n, k = 37, 80
    raw = float_tensor(qtype, n, k, seed=21)
    w = fweight(raw, qtype, (n, k))
    rng = np.random.default_rng(22)
    x = (rng.standard_normal((17, k)) * rng.uniform(0.1, 10, (17, 1))).astype(np.float32)
    x[3, :16] = -0.0
    want = float_reference(x, dequantize(raw, qtype, (n, k)))
    for isa in each_isa:
        kernels.set_isa(isa)
        for m in (1, 2, 3, 4, 5, 8, 17):
            for start in (0, 17 - m):
                got = np.asarray(_qlinear(jnp.asarray(x[start:start + m]), w))
                assert got.shape == (m, n)
                assert np.array_equal(got.view(np.uint32), want[start:start + m].view(np.uint32)), (isa, m, start)


def test_float_kernel_is_the_f32_product():
    n, k = 70, 1024
    raw = float_tensor(T.BF16, n, k, seed=23)
    x = np.random.default_rng(24).standard_normal((5, k)).astype(np.float32)
    w64 = dequantize(raw, T.BF16, (n, k)).astype(np.float64)
    got = np.asarray(_qlinear(jnp.asarray(x), fweight(raw, T.BF16, (n, k))))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w64.T, rtol=1e-5, atol=1e-4)


def test_float_weights_fuse_and_keep_their_bits():
    """concat_weights of F16 parts: one call whose columns are the parts' columns, bit for bit; parts of another
    type or kind are not fused."""
    k = 48
    parts = [kernels.pack_weight(float_tensor(T.F16, n, k, seed=30 + n), T.F16, (n, k)) for n in (8, 3, 5)]
    fused = kernels.concat_weights(parts)
    assert fused.splits == (8, 3, 5) and fused.shape == (16, k) and fused.w.ctypes.data % 64 == 0
    x = jnp.asarray(np.random.default_rng(27).standard_normal((4, k)).astype(np.float32))
    whole = np.asarray(_qlinear(x, jax.tree_util.tree_map(jnp.asarray, fused)))
    alone = np.concatenate([np.asarray(_qlinear(x, jax.tree_util.tree_map(jnp.asarray, p))) for p in parts], axis=1)
    np.testing.assert_array_equal(whole, alone)
    bf = kernels.pack_weight(float_tensor(T.BF16, 8, k, seed=31), T.BF16, (8, k))
    q8 = kernels.pack_weight(random_tensor(T.Q8_0, 16, 64), T.Q8_0, (16, 64))
    assert kernels.concat_weights([parts[0], bf]) is None
    assert kernels.concat_weights([q8, kernels.pack_weight(float_tensor(T.F16, 16, 64, 32), T.F16, (16, 64))]) is None


def test_float_packable_needs_whole_16_blocks():
    assert kernels.packable(T.F16, (8, 48)) and kernels.packable(T.BF16, (8, 16)) and kernels.packable(T.F32, (3, 32))
    assert not kernels.packable(T.F16, (8, 40)) and not kernels.packable(T.F16, (48,))


def test_pack_layout_groups_columns_in_lanes():
    """Column n lives in lane n % 16 of group n // 16; 4 consecutive K values per lane chunk."""
    u = np.arange(20 * 32, dtype=np.int64).reshape(20, 32) % 251
    a = np.arange(20, dtype=np.float32)[:, None] + 1
    q, pa, pc = pack_codes(u.astype(np.uint8), a, None, 32)
    assert q.shape == (2, 512) and pa.shape == (2, 16) and pc.size == 0
    blk = q.reshape(2, 8, 16, 4)
    assert blk[1, 2, 3, 1] == u[16 + 3, 2 * 4 + 1]
    assert pa[1, 3] == a[19, 0] and pa[1, 4] == 0  # padded columns have scale 0
    assert (blk[1, :, 4:] == 128).all()


def test_dispatch_falls_back_when_forced():
    code = ("from fucina_jax import kernels; import sys; "
            "sys.stdout.write(kernels.isa() + ' ' + ','.join(kernels.supported_isas()))")
    for want in ("scalar", "avx2"):
        if want not in kernels.supported_isas():
            continue
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FUCINA_KERNEL_ISA": want},
                             capture_output=True, text=True, check=True).stdout
        assert out.split()[0] == want
    with pytest.raises(ValueError, match="unknown kernel instruction set"):
        kernels.set_isa("neon")


def test_real_tensors_pack_losslessly(gemma3_path, smollm2_path):
    from fucina_jax.gguf_io import open_gguf

    seen = set()
    for path in (gemma3_path, smollm2_path):
        gf = open_gguf(path)
        for name, t in gf.tensors.items():
            if t.qtype in PACKED_TYPES and t.qtype not in seen and name.startswith("blk."):
                seen.add(t.qtype)
                u, a, c, bs = decode_codes(gf.raw(name), t.qtype, t.shape)
                assert np.array_equal(unpack_values(u, a, c, bs), gf.load(name)), name
    assert {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_1} <= seen


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("H, K, Dh", [(4, 2, 48), (3, 1, 40), (8, 8, 64), (8, 1, 80)],
                         ids=["gqa2", "gqa3-tail", "mha", "gqa8-vtail"])
def test_attention_kernel_matches_the_definition(window, H, K, Dh):
    """Query rows are computed in blocks of 4 sharing a kv head; blocks straddle positions (T * G rows per kv head),
    head dims that are not a multiple of 16 (dot tail) or of 64 (V tail) take the scalar tails."""
    rng = np.random.default_rng(12)
    B, T, S = 2, 5, 40
    q = rng.standard_normal((B, T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((B, S, K, Dh)).astype(np.float32)
    v = rng.standard_normal((B, S, K, Dh)).astype(np.float32)
    pos = np.array([[3, 4, 5, 6, 7], [30, 31, 32, 33, 39]], np.int32)
    got = np.asarray(jax.jit(kernels.attention, static_argnums=(4, 5))(q, k, v, pos, 0.2, window))
    np.testing.assert_allclose(got, np_attention(q, k, v, pos, 0.2, window), atol=2e-6)
    # each row alone gives the same bits as inside the batch
    for t in (0, 4):
        one = np.asarray(jax.jit(kernels.attention, static_argnums=(4, 5))(q[:, t:t + 1], k, v, pos[:, t:t + 1], 0.2,
                                                                         window))
        np.testing.assert_array_equal(one[:, 0], got[:, t])
    # an fp16 cache is read as its values widened exactly: bitwise the f32 cache holding those values
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    half = np.asarray(jax.jit(kernels.attention, static_argnums=(4, 5))(q, k16, v16, pos, 0.2, window))
    wide = np.asarray(jax.jit(kernels.attention, static_argnums=(4, 5))(q, k16.astype(np.float32),
                                                                        v16.astype(np.float32), pos, 0.2, window))
    np.testing.assert_array_equal(half, wide)
    assert not np.array_equal(half, got)  # the rounding to fp16 did change the inputs


@pytest.mark.parametrize("H, K, Dh, S", [(4, 1, 256, 600), (3, 1, 80, 2100)], ids=["gemma3-270m", "gqa3-vtail"])
def test_attention_split_block_gives_the_one_thread_bits(H, K, Dh, S):
    """A single block with a long span (a decode step over a long context) is split across the thread pool (scores
    by slot ranges, softmax by rows, V sums by output dims); it must give the definition's values and, bit for bit,
    the rows of a call with many blocks (one thread per block, nothing split)."""
    rng = np.random.default_rng(21)
    T = 16
    q = rng.standard_normal((1, T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((1, S, K, Dh)).astype(np.float32)
    v = rng.standard_normal((1, S, K, Dh)).astype(np.float32)
    pos = (S - T + np.arange(T, dtype=np.int32))[None]
    att = jax.jit(kernels.attention, static_argnums=(4, 5))
    many = np.asarray(att(q, k, v, pos, 0.1, 0))
    np.testing.assert_allclose(many, np_attention(q, k, v, pos, 0.1, 0), rtol=1e-5, atol=1e-5)
    for t in (0, T - 1):
        one = np.asarray(att(q[:, t:t + 1], k, v, pos[:, t:t + 1], 0.1, 0))
        np.testing.assert_array_equal(one[:, 0], many[:, t])
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    half = np.asarray(att(q[:, :1], k16, v16, pos[:, :1], 0.1, 0))
    wide = np.asarray(att(q, k16.astype(np.float32), v16.astype(np.float32), pos, 0.1, 0))
    np.testing.assert_array_equal(half[:, 0], wide[:, 0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_attention_scratch_kept_between_calls_is_never_read_stale(dtype):
    """Each thread keeps its score and widened-slot buffers from call to call, uninitialised. A call over a long
    span of NaN values leaves them full of NaN; later calls over shorter spans, other shapes and a wider head must
    still give the definition's values (a value read before this call wrote it would be NaN)."""
    rng = np.random.default_rng(33)
    att = jax.jit(kernels.attention, static_argnums=(4, 5))
    poison = np.full((1, 900, 3, 64), np.nan, np.float32).astype(dtype)
    q = rng.standard_normal((1, 8, 9, 64)).astype(np.float32)
    assert np.isnan(np.asarray(att(q, poison, poison, (880 + np.arange(8, dtype=np.int32))[None], 0.1, 0))).all()
    for (H, K, Dh, S, T) in [(9, 3, 64, 300, 1), (4, 1, 80, 120, 5), (9, 3, 64, 600, 16)]:
        q = rng.standard_normal((1, T, H, Dh)).astype(np.float32)
        k = rng.standard_normal((1, S, K, Dh)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((1, S, K, Dh)).astype(np.float32).astype(dtype)
        pos = (S - 1 - T - np.arange(T, dtype=np.int32)[::-1])[None]
        got = np.asarray(att(q, k, v, pos, 0.1, 0))
        np.testing.assert_allclose(got, np_attention(q, k.astype(np.float32), v.astype(np.float32), pos, 0.1, 0),
                                   rtol=1e-5, atol=1e-5)


def _random_tree_masks(rng, B: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor masks [B, T] of random trees over T step rows (row 0 the root, each row's parent before it), and
    each row's depth."""
    masks = np.zeros((B, T), np.int32)
    depth = np.zeros((B, T), np.int32)
    for b in range(B):
        for t in range(1, T):
            parent = int(rng.integers(0, t))
            masks[b, t] = masks[b, parent] | (1 << t)
            depth[b, t] = depth[b, parent] + 1
        masks[b, 0] = 1
    return masks, depth


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("H, K, Dh, S, T, window", [(9, 3, 64, 700, 1, 0), (9, 3, 64, 700, 2, 0),
                                                    (9, 3, 64, 700, 8, 0), (4, 1, 256, 600, 16, 0),
                                                    (8, 2, 128, 333, 4, 100), (4, 2, 48, 90, 5, 0),
                                                    (8, 1, 80, 200, 3, 7)],
                         ids=["smollm2-plain", "smollm2-width2", "smollm2-verify", "gemma3-split", "window", "dot-tail",
                              "vtail"])
def test_attention_gives_the_same_bits_on_every_isa(dtype, H, K, Dh, S, T, window, each_isa):
    """The AVX-512 code folds 16 slots' scores at once, runs the softmax 16 slots at a time, sums a chain's common
    slots without tests and takes up to 8 query rows a block (the others 4); the AVX2 and generic code go slot by
    slot. Every instruction set gives the same bits, chains and trees, blocks of 1-8 rows, spans that are not a
    multiple of 16, sliding windows, a block split across the pool; an fp16 cache gives the bits of an f32 cache
    holding its values."""
    rng = np.random.default_rng(31)
    B = 2
    q = rng.standard_normal((B, T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((B, S, K, Dh)).astype(dtype)
    v = rng.standard_normal((B, S, K, Dh)).astype(dtype)
    pos = np.stack([np.arange(S - T - 3, S - 3), np.arange(17, 17 + T)]).astype(np.int32)
    masks, depth = _random_tree_masks(rng, B, T)
    tree_pos = (pos[:, :1] + depth).astype(np.int32)
    chain = jax.jit(kernels.attention, static_argnums=(4, 5))
    tree = jax.jit(lambda q, k, v, p, m: kernels.attention(q, k, v, p, 0.125, window, tree=m))
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    got = {}
    for isa in each_isa:
        kernels.set_isa(isa)
        got[isa] = (np.asarray(chain(q, k, v, pos, 0.125, window)), np.asarray(tree(q, k, v, tree_pos, masks)))
        if dtype == np.float16:  # an fp16 cache (each kv head's slots widened once for its blocks) == those values in f32
            np.testing.assert_array_equal(got[isa][0], np.asarray(chain(q, k32, v32, pos, 0.125, window)))
            np.testing.assert_array_equal(got[isa][1], np.asarray(tree(q, k32, v32, tree_pos, masks)))
    want = got[each_isa[-1]]  # the generic code
    np.testing.assert_allclose(want[0], np_attention(q, k32, v32, pos, 0.125, window), rtol=1e-5, atol=1e-5)
    for isa, (c, t) in got.items():
        np.testing.assert_array_equal(c, want[0], err_msg=f"{isa}: chain")
        np.testing.assert_array_equal(t, want[1], err_msg=f"{isa}: tree")


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
def test_attention_write_is_write_kv_then_attention(cache_dtype):
    """The fused cache write + attention gives the bits of layers.write_kv into both caches followed by
    kernels.attention: every row, the caches (fp16: rounded as XLA's convert rounds), rows at positions past the
    cache dropped; and without donation the caller's cache arrays are left as they were."""
    from fucina_jax.models.layers import write_kv

    rng = np.random.default_rng(22)
    B, T, H, K, Dh, S = 2, 4, 4, 2, 48, 40
    q = jnp.asarray(rng.standard_normal((B, T, H, Dh)).astype(np.float32))
    k_new = jnp.asarray(rng.standard_normal((B, T, K, Dh)).astype(np.float32))
    v_new = jnp.asarray(rng.standard_normal((B, T, K, Dh)).astype(np.float32))
    kc = jnp.asarray(rng.standard_normal((B, S, K, Dh)).astype(cache_dtype))
    vc = jnp.asarray(rng.standard_normal((B, S, K, Dh)).astype(cache_dtype))
    pos = jnp.asarray([[5, 6, 7, 8], [37, 38, 39, 40]], jnp.int32)  # row 1's last position is past the cache

    def apart(q, k_new, v_new, kc, vc, pos):
        kc, vc = write_kv(kc, k_new, pos), write_kv(vc, v_new, pos)
        return kernels.attention(q, kc, vc, pos, 0.3, 3), kc, vc

    fused = jax.jit(lambda *a: kernels.attention_write(*a, 0.3, 3))
    kc_before, vc_before = np.asarray(kc).copy(), np.asarray(vc).copy()
    want = [np.asarray(x) for x in jax.jit(apart)(q, k_new, v_new, kc, vc, pos)]
    got = [np.asarray(x) for x in fused(q, k_new, v_new, kc, vc, pos)]
    for w, g in zip(want, got):
        assert w.dtype == g.dtype
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(np.asarray(kc), kc_before)
    np.testing.assert_array_equal(np.asarray(vc), vc_before)
    assert not np.array_equal(got[1], kc_before)  # the rows did land


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16])
def test_a_row_map_steps_its_cache_rows_alone(cache_dtype):
    """rows [n] maps step row i onto cache row rows[i] of a larger cache: attention_write and attention give each row
    the bits of the identity map over the same cache rows cut out (a batch of n), write those cache rows only (every
    other row keeps every value), and a map that repeats a row or points outside the cache is an error."""
    rng = np.random.default_rng(23)
    Bc, n, T, H, K, Dh, S = 5, 3, 4, 4, 2, 48, 40
    rows = np.array([3, 0, 4], np.int32)
    q = jnp.asarray(rng.standard_normal((n, T, H, Dh)).astype(np.float32))
    k_new = jnp.asarray(rng.standard_normal((n, T, K, Dh)).astype(np.float32))
    v_new = jnp.asarray(rng.standard_normal((n, T, K, Dh)).astype(np.float32))
    kc = rng.standard_normal((Bc, S, K, Dh)).astype(cache_dtype)
    vc = rng.standard_normal((Bc, S, K, Dh)).astype(cache_dtype)
    pos = jnp.asarray([[5, 6, 7, 8], [20, 21, 22, 23], [37, 38, 39, 40]], jnp.int32)  # row 2 ends past the cache

    mapped = jax.jit(lambda *a: kernels.attention_write(*a[:6], 0.3, 3, rows=a[6]))
    ident = jax.jit(lambda *a: kernels.attention_write(*a, 0.3, 3))
    got = [np.asarray(x) for x in mapped(q, k_new, v_new, kc, vc, pos, rows)]
    want = [np.asarray(x) for x in ident(q, k_new, v_new, kc[rows], vc[rows], pos)]
    np.testing.assert_array_equal(got[0], want[0])
    others = np.setdiff1d(np.arange(Bc), rows)
    for g, w, before in zip(got[1:], want[1:], (kc, vc)):
        assert g.shape == before.shape and g.dtype == before.dtype
        np.testing.assert_array_equal(g[rows], w)
        np.testing.assert_array_equal(g[others], before[others])
        assert not np.array_equal(g[rows], before[rows])  # the rows did land
    att = jax.jit(lambda *a: kernels.attention(*a[:4], 0.3, 3, rows=a[4]))
    np.testing.assert_array_equal(np.asarray(att(q, got[1], got[2], pos, rows)), want[0])
    # a row alone, mapped onto each cache row in turn: its own row's bits (the identity map at batch 1)
    for i, b in enumerate(rows):
        one = att(q[i : i + 1], got[1], got[2], pos[i : i + 1], rows[i : i + 1])
        np.testing.assert_array_equal(np.asarray(one)[0], want[0][i])
    for bad in ([3, 3, 0], [0, 5, 1], [-1, 0, 1]):
        with pytest.raises(ValueError, match="distinct rows"):
            np.asarray(mapped(q, k_new, v_new, kc, vc, pos, np.asarray(bad, np.int32))[0])
    with pytest.raises(ValueError, match="row map"):
        kernels.attention(q, kc, vc, pos, 0.3)
    with pytest.raises(ValueError, match="rows"):
        kernels.attention(q, kc, vc, pos, 0.3, rows=jnp.asarray([0, 1], jnp.int32))


def test_a_row_map_keeps_the_long_context_split():
    """One decode row over a long context (a lone block, split across the thread pool) mapped onto cache row 2 of 4:
    the bits of the same row over that cache row alone, and the definition's values."""
    rng = np.random.default_rng(24)
    Bc, H, K, Dh, S = 4, 4, 1, 256, 600
    q = rng.standard_normal((1, 1, H, Dh)).astype(np.float32)
    k = rng.standard_normal((Bc, S, K, Dh)).astype(np.float32)
    v = rng.standard_normal((Bc, S, K, Dh)).astype(np.float32)
    pos = np.array([[S - 3]], np.int32)
    rows = np.array([2], np.int32)
    att = jax.jit(kernels.attention, static_argnums=(4, 5))
    mapped = np.asarray(att(q, k, v, pos, 0.1, 0, rows))
    np.testing.assert_array_equal(mapped, np.asarray(att(q, k[2:3], v[2:3], pos, 0.1, 0)))
    np.testing.assert_allclose(mapped, np_attention(q, k[2:3], v[2:3], pos, 0.1, 0), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(mapped, np.asarray(att(q, k[1:2], v[1:2], pos, 0.1, 0)))


def test_attention_and_norm_rows_are_independent_of_the_batch():
    rng = np.random.default_rng(13)
    T, H, K, Dh, S = 16, 4, 1, 256, 64
    q = jnp.asarray(rng.standard_normal((1, T, H, Dh)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((1, S, K, Dh)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((1, S, K, Dh)).astype(np.float32))
    pos = jnp.arange(T, dtype=jnp.int32)[None] + 20
    w = jnp.asarray(rng.standard_normal(Dh).astype(np.float32))
    att = jax.jit(kernels.attention, static_argnums=(4, 5))
    norm = jax.jit(kernels.rms_norm, static_argnums=(2,))
    a_one = np.concatenate([np.asarray(att(q[:, i : i + 1], k, v, pos[:, i : i + 1], 0.0625, 8)) for i in range(T)], 1)
    n_one = np.concatenate([np.asarray(norm(q[:, i : i + 1], w, 1e-6)) for i in range(T)], 1)
    for m in (2, 4, 8, 16):
        np.testing.assert_array_equal(np.asarray(att(q[:, :m], k, v, pos[:, :m], 0.0625, 8)), a_one[:, :m])
        np.testing.assert_array_equal(np.asarray(norm(q[:, :m], w, 1e-6)), n_one[:, :m])


def test_rms_norm_kernel_matches_the_definition():
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((3, 7, 40)) * 5).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(kernels.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), want * w,
                               rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(kernels.rms_norm(jnp.asarray(x), None, 1e-6)), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_rot", [64, 16])
def test_norm_rope_kernel_matches_the_definition(neox, n_rot):
    from fucina_jax.models import layers as L

    rng = np.random.default_rng(15)
    x = jnp.asarray((rng.standard_normal((2, 3, 4, 64)) * 3).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(64).astype(np.float32))
    pos = jnp.asarray([[0, 7, 8], [100, 2000, 30000]], jnp.int32)
    inv = L.rope_inv_freq(n_rot, 10000.0)
    want = L.apply_rope(L.rms_norm(x, w, 1e-6), pos, inv, neox)
    cs = np.asarray(L.rope_angles(pos, inv))
    np.testing.assert_allclose(kernels.norm_rope(x, w, 1e-6, jnp.asarray(cs), neox), want, atol=2e-5)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
@pytest.mark.parametrize("Dh, n_rot", [(64, 64), (64, 48), (64, 16), (64, 6), (256, 256), (128, 80)])
def test_rope_rotation_is_the_fused_definition_bitwise_on_every_isa(neox, Dh, n_rot, each_isa):
    """y0 = fma(x0, c, -(x1 s)), y1 = fma(x0, s, x1 c) per pair, as ggml's rope rounds. The AVX-512 and AVX2 code
    rotate 16 / 8 NEOX pairs or 8 / 4 adjacent pairs a vector and leave the rest to the pair-by-pair code: rotations
    of whole vectors, vectors and a tail, a tail alone, and a partial rotation (n_rot < Dh) give the same bits on
    every instruction set, with zeros of both signs, infinities and NaNs among the values (not subnormals: XLA
    runs its kernels with denormals flushed to zero)."""
    from fucina_jax.models import layers as L

    rng = np.random.default_rng(16)
    xs = (rng.standard_normal((2, 3, 5, Dh)) * 3).astype(np.float32)
    xs.reshape(-1)[rng.choice(xs.size, 12, replace=False)] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30] * 2
    pos = jnp.asarray([[0, 7, 8], [100, 2000, 30000]], jnp.int32)
    cs = np.asarray(L.rope_angles(pos, L.rope_inv_freq(n_rot, 10000.0)))
    half = n_rot // 2
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    c, s = cs[:, :, None, :, 0], cs[:, :, None, :, 1]
    x0, x1 = xs[..., i0], xs[..., i1]
    want = xs.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        want[..., i0] = fma(x0, c, -(x1 * s))
        want[..., i1] = fma(x0, s, x1 * c)
    for isa in each_isa:
        kernels.set_isa(isa)
        got = np.asarray(kernels.norm_rope(jnp.asarray(xs), None, 1e-6, jnp.asarray(cs), neox, norm=False))
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)],
                                      err_msg=isa)
        assert np.array_equal(np.isnan(got), np.isnan(want)), isa


def test_residual_norm_kernel_matches_the_xla_layers():
    from fucina_jax.models import layers as L

    rng = np.random.default_rng(16)
    h, a = (jnp.asarray(rng.standard_normal((2, 3, 48)).astype(np.float32)) for _ in range(2))
    w1, w2 = (jnp.asarray(rng.standard_normal(48).astype(np.float32)) for _ in range(2))
    for w_post in (w1, None):
        got = kernels.residual_norm(h, a, w_post, w2, 1e-6, post=w_post is not None)
        want = L.residual_norm(h, a, w_post, w2, 1e-6)
        for g, x in zip(got, want):
            np.testing.assert_allclose(g, x, atol=2e-6)


def _selection_rows(rng, kind: int, R: int, V: int) -> np.ndarray:
    """Rows that stress an order: Gaussian, many ties, and the special values (+-0.0, +-inf, +-NaN) mixed in."""
    if kind == 0:
        return rng.standard_normal((R, V)).astype(np.float32)
    if kind == 1:
        return rng.integers(-3, 4, (R, V)).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 2.5], np.float32)
    x = rng.choice(special, (R, V))
    return np.where(rng.random((R, V)) < 0.7, rng.standard_normal((R, V)).astype(np.float32), x).astype(np.float32)


def test_top_k_kernel_equals_lax_top_k():
    """Same values (bitwise) and ids as XLA's TopK, whose order is a total order on the float bits with ties by
    lower index: including ties, signed zeros, infinities and NaNs of either sign. With fold_zero, the same as XLA's
    TopK of the row with -0.0 made +0.0 (the sampler's fold)."""
    rng = np.random.default_rng(0)
    top_k = jax.jit(kernels.top_k, static_argnums=(1, 2))
    shapes = [(3, 2999, 1), (3, 2999, 7), (2, 4099, 64), (1, 16, 16), (2, 17, 5), (4, 33, 32)]
    for trial in range(180):
        R, V, k = shapes[trial % len(shapes)]
        x = jnp.asarray(_selection_rows(rng, trial % 3, R, V))
        for fold in (False, True):
            want_v, want_i = jax.lax.top_k(jnp.where(x == 0, 0.0, x) if fold else x, k)
            got_v, got_i = top_k(x, k, fold)
            where = (trial, R, V, k, fold)
            assert np.array_equal(np.asarray(got_i), np.asarray(want_i)), where
            assert np.array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32)), where
    # the scan's buffer (cut back to the k best at 2k): ascending rows (every value enters), descending rows (none
    # after the first k), and runs of equal values across the cuts
    up = np.arange(4099, dtype=np.float32)
    for row in (up, up[::-1].copy(), np.repeat(np.arange(41, dtype=np.float32), 100)[:4099]):
        x = jnp.asarray(np.stack([row, -row]))
        for k in (1, 8, 64, 200):
            want_v, want_i = jax.lax.top_k(x, k)
            got_v, got_i = top_k(x, k, False)
            assert np.array_equal(np.asarray(got_i), np.asarray(want_i)), k
            assert np.array_equal(np.asarray(got_v), np.asarray(want_v)), k
    with pytest.raises(ValueError, match="k = 0"):
        kernels.top_k(jnp.zeros((2, 8)), 0)


def test_argmax_kernel_is_the_first_maximum():
    """The lowest index of the maximum (+0.0 == -0.0), against XLA's max + min-index on NaN-free rows; NaNs are
    skipped (a row of NaNs gives V - 1)."""
    rng = np.random.default_rng(1)
    argmax = jax.jit(kernels.argmax)
    shapes = [(3, 2999), (1, 16), (2, 17), (4, 4099)]
    for trial in range(120):
        R, V = shapes[trial % len(shapes)]
        x = _selection_rows(rng, trial % 3, R, V)
        got = np.asarray(argmax(jnp.asarray(x)))
        finite = np.where(np.isnan(x), -np.inf, x)
        want = np.array([np.flatnonzero(row == row.max())[0] if not np.isnan(r).all() else V - 1
                         for row, r in zip(finite, x)])
        assert np.array_equal(got, want), trial
        clean = jnp.asarray(np.where(np.isnan(x), 0.0, x))
        is_max = clean == jnp.max(clean, axis=-1, keepdims=True)
        xla = jnp.min(jnp.where(is_max, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
        assert np.array_equal(np.asarray(argmax(clean)), np.asarray(xla)), trial
    assert int(argmax(jnp.full((1, 7), jnp.nan))[0]) == 6
    for V in (7, 40):  # rows with nothing above -inf: the first -inf
        row = np.full((1, V), np.nan, np.float32)
        row[0, 3::5] = -np.inf
        assert int(argmax(jnp.asarray(row))[0]) == 3
        assert int(argmax(jnp.full((1, V), -jnp.inf))[0]) == 0


def test_selections_under_vmap():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, 100)), jnp.float32)
    assert np.array_equal(np.asarray(jax.vmap(kernels.argmax)(x)), np.asarray(kernels.argmax(x)))
    got = jax.vmap(lambda r: kernels.top_k(r, 4)[1])(x)
    assert np.array_equal(np.asarray(got), np.asarray(jax.lax.top_k(x, 4)[1]))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q5_1], ids=lambda t: t.name)
def test_fused_pick_is_the_argmax_and_top_k_of_the_product(qtype, each_isa):
    """qlinear_pick == (argmax, top_k ids) of qlinear's values, and qlinear_candidates' sampler candidates == top_k
    with the -0.0 fold (values and ids), bitwise, on every instruction set: row counts that
    slice the columns differently, n not a multiple of 16, k from 0 to past a slice's width, equal logits in
    different slices (duplicated weight rows: the lower id wins), an all-zero row (every logit equal) and rows
    poisoned to NaN by a non-finite input."""
    rng = np.random.default_rng(7)
    n, k_in = 3001, (512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96)
    raw = random_tensor(qtype, n, k_in, seed=3).reshape(n, -1)
    pairs = [(5, 2900), (100, 101), (2000, 7), (3000, 1)]
    for src, dst in pairs:  # equal rows -> equal logits
        raw[dst] = raw[src]
    w = qweight(raw.reshape(-1), qtype, (n, k_in))
    assert w.n == n
    # rows along a duplicated weight row: its two equal logits are (almost surely) the row's largest
    along = dequantize(raw.reshape(-1), qtype, (n, k_in))[[src for src, _ in pairs]]
    pick = jax.jit(kernels.qlinear_pick, static_argnums=2)
    cands = jax.jit(kernels.qlinear_candidates, static_argnums=(2, 3))
    for isa in each_isa:
        kernels.set_isa(isa)
        for M in (1, 3, 16, 40):
            x = rng.standard_normal((M, k_in)).astype(np.float32)
            x[-len(along):] = along[-M:]
            if M > 7:
                x[1] = 0.0
                x[2, 7] = np.inf if M > 16 else np.nan
            y = _qlinear(jnp.asarray(x), w)
            for k in (0, 1, 8, 40):
                ids, top = pick(jnp.asarray(x), w, k)
                where = (isa, M, k)
                assert np.array_equal(np.asarray(ids), np.asarray(kernels.argmax(y))), where
                assert top.shape == (M, k), where
                if k:
                    assert np.array_equal(np.asarray(top), np.asarray(jax.lax.top_k(y, k)[1])), where
            # a sampler's candidates beside them: top_k with the -0.0 fold, values and ids
            folded = jnp.where(y == 0.0, jnp.float32(0.0), y)
            for k, c in ((8, 2), (0, 64), (8, n)):  # n: every value, negatives and NaNs too
                ids, top, vals, cids = cands(jnp.asarray(x), w, k, c)
                where = (isa, M, k, c)
                assert np.array_equal(np.asarray(ids), np.asarray(kernels.argmax(y))), where
                assert np.array_equal(np.asarray(top), np.asarray(jax.lax.top_k(y, k)[1])), where
                want_v, want_i = jax.lax.top_k(folded, c)
                assert np.array_equal(np.asarray(cids), np.asarray(want_i)), where
                assert np.asarray(vals).tobytes() == np.asarray(want_v).tobytes(), where  # NaN payloads, +0.0
        zero = np.asarray(pick(jnp.zeros((1, k_in)), w, 8)[1])
        assert zero.tolist() == [list(range(8))]  # all equal: the lowest ids, in order
    with pytest.raises(ValueError, match="k = 3002"):
        kernels.qlinear_pick(jnp.zeros((1, k_in)), w, n + 1)
    with pytest.raises(ValueError, match="c = 3002"):
        kernels.qlinear_candidates(jnp.zeros((1, k_in)), w, 0, n + 1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_inconsistent_packed_buffers_are_refused(qtype):
    """The kernel checks every buffer against the shapes (codes of a known width, scales of the kind their dtype
    says) and refuses a mismatch with a clear error instead of reading out of bounds."""
    import dataclasses

    n, k = shape_for(qtype)
    w = qweight(random_tensor(qtype, n, k, seed=12), qtype, (n, k))
    x = jnp.ones((2, k), jnp.float32)
    bad = [dataclasses.replace(w, q=w.q[:, :-64]),  # a block's worth of codes short
           dataclasses.replace(w, a=w.a[:, :-1])]  # one scale (byte) short
    if w.a.dtype in (jnp.uint8, jnp.int8):  # K-quant scales must come with their own block size and no offsets
        bad.append(dataclasses.replace(w, bs=32 if w.bs == 16 else 16))
        bad.append(dataclasses.replace(w, c=jnp.zeros(w.a.shape, jnp.float32)))
    for b in bad:
        with pytest.raises(Exception, match="fucina_qmatmul"):
            np.asarray(kernels.qlinear(x, b))
    np.asarray(kernels.qlinear(x, w))  # the consistent weight runs


POOL_CHILD = r"""
import json
import sys
import numpy as np
import jax
from fucina_jax import kernels
sys.path.insert(0, sys.argv[3])
from test_kernels import pool_outputs

np.savez(sys.argv[1], **pool_outputs(np.load(sys.argv[2])))
print(json.dumps(kernels.threads()))
"""


def pool_outputs(raw: np.ndarray) -> dict:
    """Kernel outputs big enough to split across threads: a Q8_0 product at several row counts, a many-block
    attention and a single long-span block (split by phases)."""
    w = qweight(raw, T.Q8_0, (512, 1024))
    rng = np.random.default_rng(9)
    out = {f"qlinear{m}": np.asarray(_qlinear(jnp.asarray(rng.standard_normal((m, 1024)).astype(np.float32)), w))
           for m in (1, 3, 8)}
    att = jax.jit(kernels.attention, static_argnums=(4, 5))
    for name, (T_, H, K, Dh, S) in {"many": (16, 8, 2, 64, 700), "split": (1, 4, 1, 256, 2100)}.items():
        q = rng.standard_normal((1, T_, H, Dh)).astype(np.float32)
        k = rng.standard_normal((1, S, K, Dh)).astype(np.float32)
        v = rng.standard_normal((1, S, K, Dh)).astype(np.float32)
        pos = (S - T_ + np.arange(T_, dtype=np.int32))[None]
        out[f"attention_{name}"] = np.asarray(att(q, k, v, pos, 0.1, 0))
    return out


def test_own_workers_give_the_xla_pool_bits(tmp_path):
    """The kernels split their loops on their own spinning workers (parallel.h, the default); FUCINA_KERNEL_POOL=xla
    puts them on XLA's intra-op pool. Both must give the same bits, and each must be the one that ran."""
    raw = random_tensor(T.Q8_0, 512, 1024, seed=8)
    np.save(tmp_path / "raw.npy", raw)
    before = kernels.threads()
    here = pool_outputs(raw)
    after = kernels.threads()
    assert after["pool"] == "own" and after["workers"] == len(os.sched_getaffinity(0)) - 1
    if after["workers"] > 0:
        assert after["calls_workers"] > before["calls_workers"]
    env = {**os.environ, "FUCINA_KERNEL_POOL": "xla"}
    done = subprocess.run([sys.executable, "-c", POOL_CHILD, str(tmp_path / "xla.npz"), str(tmp_path / "raw.npy"),
                           os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pool"] == "xla" and report["calls_workers"] == 0 and report["calls_pool"] > 0
    there = np.load(tmp_path / "xla.npz")
    assert sorted(there.files) == sorted(here)
    for name, got in here.items():
        np.testing.assert_array_equal(got, there[name], err_msg=name)


def test_concurrent_callers_share_the_workers():
    """Programs running at once (Python threads, or the devices of a sharded mesh) contend for the workers: one
    holds them, the others split on XLA's pool. Every call must give the bits it gives alone."""
    import concurrent.futures

    w = qweight(random_tensor(T.Q4_K, 768, 1024, seed=10), T.Q4_K, (768, 1024))
    xs = [jnp.asarray(np.random.default_rng(20 + i).standard_normal((4, 1024)).astype(np.float32)) for i in range(4)]
    alone = [np.asarray(_qlinear(x, w)) for x in xs]
    before = kernels.threads()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for _ in range(3):
            got = list(ex.map(lambda x: np.asarray(_qlinear(x, w)), xs * 8))
            for i, g in enumerate(got):
                np.testing.assert_array_equal(g, alone[i % 4])
    after = kernels.threads()
    assert after["calls_workers"] + after["calls_pool"] - before["calls_workers"] - before["calls_pool"] >= 96


def test_kernel_cycles_harness_builds_and_reports(load_script):
    """scripts/bench_kernel_cycles.py: the kernels build alone (FUCINA_KERNEL_HARNESS, no Python module) and its
    harness reports every part: the peak rates, quantization per M and every (type, rows, weights) matmul cell."""
    import shutil

    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.fail("no C++ compiler: the kernels themselves need one")
    mod = load_script("scripts/bench_kernel_cycles.py")
    rows = mod.run(reps=2)
    peak = [r for r in rows if r["part"] == "peak"]
    assert len(peak) == 1 and peak[0]["ghz"] > 0.3 and peak[0]["isa"] == kernels.supported_isas()[0]
    assert sorted(r["M"] for r in rows if r["part"] == "quantize") == [1, 8, 64]
    assert all(r["cycles_per_block"] > 0 for r in rows if r["part"] == "quantize")
    cells = {(r["type"], r["M"], r["weights"]) for r in rows if r["part"] == "matmul"}
    assert cells == {(t, m, w) for t in ("Q8_0", "Q5_0", "Q4_1") for m in (1, 2, 4, 8, 16)
                     for w in ("resident", "streamed")}
    assert all(r["macs_per_cycle"] > 0 for r in rows if r["part"] == "matmul")
    assert "quantize  M   8" in mod.report(rows)
