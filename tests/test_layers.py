"""Per-op parity of models/layers.py against straightforward NumPy references written from the math (float64)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax.models import layers as L

rng = np.random.default_rng(0)


def np_rms(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def np_rope(x, pos, n_rot, base, neox, freq_scale=1.0, ff=None):
    x = x.astype(np.float64).copy()
    B, T, H, D = x.shape
    out = x.copy()
    for b in range(B):
        for t in range(T):
            for i in range(n_rot // 2):
                theta = pos[b, t] * freq_scale * base ** (-2.0 * i / n_rot) / (1.0 if ff is None else ff[i])
                c, s = math.cos(theta), math.sin(theta)
                a_i, b_i = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
                x0, x1 = x[b, t, :, a_i], x[b, t, :, b_i]
                out[b, t, :, a_i] = x0 * c - x1 * s
                out[b, t, :, b_i] = x0 * s + x1 * c
    return out


def np_attention(q, k, v, qpos, scale, window):
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for t in range(T):
            p = qpos[b, t]
            for h in range(H):
                kh = h // (H // K)  # GQA: query head h reads kv head h // group
                js = [j for j in range(S) if j <= p and (window == 0 or p - j < window)]
                s = np.array([q[b, t, h] @ k[b, j, kh] * scale for j in js])
                w = np.exp(s - s.max())
                w /= w.sum()
                out[b, t, h] = sum(wi * v[b, j, kh] for wi, j in zip(w, js))
    return out


def test_rms_norm():
    x = rng.standard_normal((2, 5, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    np.testing.assert_allclose(L.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), np_rms(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(L.rms_norm(jnp.asarray(x), None, 1e-6), np_rms(x, None, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_rot", [16, 8])
def test_rope(neox, n_rot):
    x = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)
    pos = np.array([[0, 7, 300], [5, 6, 9000]], np.int32)
    inv = L.rope_inv_freq(n_rot, 10000.0, 0.5)
    got = L.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv, neox)
    np.testing.assert_allclose(got, np_rope(x, pos, n_rot, 10000.0, neox, 0.5), atol=2e-4)


def test_rope_freq_factors_identity_tail():
    """Gemma 4 proportional RoPE: factors of 1e30 leave their pairs unrotated."""
    ff = np.array([1.0] * 4 + [1e30] * 4)
    x = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    pos = np.array([[3, 11]], np.int32)
    got = np.asarray(L.apply_rope(jnp.asarray(x), jnp.asarray(pos), L.rope_inv_freq(16, 1e6, 1.0, ff)))
    np.testing.assert_allclose(got, np_rope(x, pos, 16, 1e6, True, 1.0, ff), atol=2e-4)
    np.testing.assert_allclose(got[..., 4:8], x[..., 4:8], atol=1e-6)


@pytest.mark.parametrize("window", [0, 3])
def test_gqa_attention_causal_and_window(window):
    B, T, H, K, D, S = 2, 4, 4, 2, 8, 10
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, K, D)).astype(np.float32)
    v = rng.standard_normal((B, S, K, D)).astype(np.float32)
    qpos = np.array([[2, 3, 4, 5], [6, 7, 8, 9]], np.int32)
    got = L.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(qpos), 0.3, window)
    np.testing.assert_allclose(got, np_attention(q, k, v, qpos, 0.3, window), atol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_ffn(act):
    x = rng.standard_normal((3, 16)).astype(np.float32)
    g, u = rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    d = rng.standard_normal((16, 32)).astype(np.float32)
    a = x.astype(np.float64) @ g.T
    if act == "silu":
        a = a / (1 + np.exp(-a))
    else:
        a = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))
    ref = (a * (x.astype(np.float64) @ u.T)) @ d.T
    np.testing.assert_allclose(L.glu_ffn(jnp.asarray(x), jnp.asarray(g), jnp.asarray(u), jnp.asarray(d), act), ref, rtol=1e-4, atol=1e-4)


def test_moe_topk_renormalised():
    E, F, D, k = 6, 8, 5, 2
    x = rng.standard_normal((4, D)).astype(np.float32)
    logits = rng.standard_normal((4, E)).astype(np.float32)
    G, U = rng.standard_normal((E, F, D)).astype(np.float32), rng.standard_normal((E, F, D)).astype(np.float32)
    Dn = rng.standard_normal((E, D, F)).astype(np.float32)
    ref = np.zeros((4, D))
    for t in range(4):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        sel = np.argsort(-p)[:k]
        w = p[sel] / p[sel].sum()
        for wj, e in zip(w, sel):
            a = G[e] @ x[t]
            ref[t] += wj * (Dn[e] @ ((a / (1 + np.exp(-a))) * (U[e] @ x[t])))
    got = L.moe_ffn(jnp.asarray(x), jnp.asarray(logits), jnp.asarray(G), jnp.asarray(U), jnp.asarray(Dn), k, "silu")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_route_is_softmax_top_k_renormalised_and_row_exact():
    """layers.route takes the top logits and a softmax over those only: the weights of softmax over all E, top n,
    renormalised (float64 reference), the same experts, and each row's bits whatever the number of rows."""
    import jax

    E, n, T = 128, 8, 16
    logits = (rng.standard_normal((T, E)) * np.linspace(0.1, 30.0, T)[:, None]).astype(np.float32)
    w, ids = (np.asarray(a) for a in jax.jit(L.route, static_argnums=1)(jnp.asarray(logits), n))
    for t in range(T):
        p = np.exp(logits[t].astype(np.float64) - logits[t].max())
        p /= p.sum()
        sel = np.argsort(-p, kind="stable")[:n]
        np.testing.assert_array_equal(ids[t], sel)
        np.testing.assert_allclose(w[t], p[sel] / p[sel].sum(), rtol=2e-6, atol=1e-7)
        for rows in (1, 3):  # the same row inside smaller steps: bitwise
            part = jax.jit(L.route, static_argnums=1)(jnp.asarray(logits[t:t + rows]), n)
            np.testing.assert_array_equal(np.asarray(part[0])[0], w[t])
            np.testing.assert_array_equal(np.asarray(part[1])[0], ids[t])


def test_write_kv_drops_out_of_range_rows():
    cache = jnp.zeros((1, 4, 1, 2))
    new = jnp.ones((1, 3, 1, 2))
    out = np.asarray(L.write_kv(cache, new, jnp.asarray([[2, 3, 4]])))
    assert out[0, 2:].sum() == 4 and out[0, :2].sum() == 0  # position 4 >= S dropped, not clamped onto slot 3
