"""Shared transformer math: norms, RoPE, attention over the KV cache, feed-forward blocks.

Axis legend (einsums, comments, shapes everywhere in fucina_jax):
  B batch rows   T query tokens   S cache slots   D model dim   H query heads   K kv heads   Dh head dim
  F ffn dim      V vocab          L layers        E experts     R rows of a verify/sample batch

Everything here is a pure function of arrays, f32 activations. No RNG, no argmax: logits only.
Numerics follow llama.cpp's CPU graph (ggml): RMSNorm in f32 with the weight multiplied after normalising,
NEOX or NORM RoPE, softmax attention in f32 with a -inf mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax.kernels import QWeight, qlinear, take_rows

__all__ = [
    "fixed_sum",
    "rms_norm",
    "rope_inv_freq",
    "apply_rope",
    "attention",
    "write_kv",
    "glu_ffn",
    "gelu_tanh",
    "moe_ffn",
    "softcap",
]

NEG_INF = -jnp.inf


def fixed_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over one axis in a fixed pairwise order (zero-pad to a power of two, add halves until one is left).

    XLA's reduce picks its vectorisation, and so its summation order, by the shape of the other axes: the same row
    sums differently inside 1 row than inside 8 (measured: rms_norm over [8, 640]). Elementwise adds do not, so a
    row summed this way is bitwise the same in any batch: the property verification rows rely on.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, p - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, h, axis=axis) + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (w None: no weight, e.g. Gemma 4's value norm)."""
    x = x.astype(jnp.float32)
    mean_sq = fixed_sum(x * x, keepdims=True) * jnp.float32(1.0 / x.shape[-1])
    y = x * jax.lax.rsqrt(mean_sq + eps)
    return y if w is None else y * w


def rope_inv_freq(n_rot: int, base: float, freq_scale: float = 1.0, freq_factors=None) -> np.ndarray:
    """Per-pair angular speeds [n_rot/2]: freq_scale * base^(-2i/n_rot) / ff[i] (ggml's rope with freq factors).

    Computed in float64 on the host and rounded once, so every step sees the same constants.
    """
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv = freq_scale * base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)[: n_rot // 2]
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, neox: bool = True) -> jax.Array:
    """Rotate the first n_rot = 2*len(inv_freq) dims of each head; the rest pass through.

    x: [B, T, H, Dh]; positions: [B, T] int32.
    NEOX pairs dim i with i + n_rot/2 (Qwen3, Gemma); NORM pairs 2i with 2i+1 (Llama in GGUF, whose converter
    permuted Q/K rows for exactly this layout).
    """
    n_rot = 2 * inv_freq.shape[0]
    theta = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, n_rot/2]
    cos = jnp.cos(theta)[:, :, None, :]
    sin = jnp.sin(theta)[:, :, None, :]
    xr, xpass = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x0, x1 = xr[..., : n_rot // 2], xr[..., n_rot // 2 :]
        y = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    else:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([y, xpass], axis=-1) if xpass.shape[-1] else y


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Store new [B, T, K, Dh] into cache [B, S, K, Dh] at slot = position.

    Slot s holds absolute position s (a full-length cache, see cache.py). Rows whose position is >= S (padding of a
    bucket near the end of the context) are dropped, never clamped onto a live slot.
    """
    b = jnp.arange(cache.shape[0])[:, None]
    return cache.at[b, positions].set(new.astype(cache.dtype), mode="drop")


# Attention reads the cache in chunks of this many slots, and only the chunks that hold visible slots: a decode step
# at position p costs O(p) (O(window) on sliding layers), not O(capacity). Chunk boundaries are fixed multiples of
# ATTN_CHUNK, and a chunk a row cannot see adds exact zeros, so a row's result does not depend on the other rows.
ATTN_CHUNK = 256
# Steps of at most this many rows per batch row (decode, verify) get row-exact attention (see attention()).
ROW_EXACT_MAX = 16


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_pos: jax.Array,
    scale: float,
    window: int = 0,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with GQA, over the visible part of the cache.

    q: [B, T, H, Dh]; k_cache/v_cache: [B, S, K, Dh(v)] already holding this step's rows; q_pos: [B, T].
    Mask: slot j visible to a query at position p iff j <= p (causal; stale slots past the committed length are
    always > p or were overwritten by this step), and on sliding layers additionally p - j < window (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD: a query sees exactly the last `window` positions including itself).

    Online softmax over cache chunks in a loop with data-dependent bounds (no recompile as the context grows); a
    capacity that is not a multiple of 16 (init_cache never makes one) takes a one-shot path over all S slots, which
    is not row-exact.
    """
    B, T, H, Dh = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, Dh)
    p = q_pos[:, None, None, :, None]  # [B, 1, 1, T, 1] against scores [B, K, G, T, slots]

    # Up to a verify bucket of rows, the two products are spelled as multiply + reduce instead of dots: XLA's dot
    # picks its algorithm (and so its summation order) by the number of rows, a reduce sums every output alike.
    # That keeps each row bitwise independent of how many rows come with it, which the quantized path needs: its
    # activation rounding would amplify a last-bit difference into a visible logit change.
    exact = T <= ROW_EXACT_MAX

    def qk(ks):
        if exact:
            return fixed_sum(qg.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :] * ks.transpose(0, 2, 1, 3)[:, :, None, None])
        return jnp.einsum("btkgd,bskd->bkgts", qg, ks)

    def pv(pr, vs):
        if exact:
            return fixed_sum(pr[..., None] * vs.transpose(0, 2, 1, 3)[:, :, None, None], axis=-2)
        return jnp.einsum("bkgts,bskd->bkgtd", pr, vs)

    def scores_of(ks, first_slot, n):
        s = qk(ks) * scale
        slot = first_slot + jnp.arange(n, dtype=jnp.int32)
        visible = slot <= p
        if window:
            visible = visible & (p - slot < window)
        return jnp.where(visible, s, NEG_INF)

    chunk = next((c for c in (ATTN_CHUNK, 128, 64, 32, 16) if S % c == 0), None)
    if chunk is None:
        s = scores_of(k_cache, 0, S)
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))  # max is order-free; the sum is not
        probs = e / fixed_sum(e, keepdims=True)
        return pv(probs, v_cache).transpose(0, 3, 1, 2, 4).reshape(B, T, H, v_cache.shape[-1])

    # padding rows of a bucket near the end of the context carry positions >= S: never read past the last chunk
    hi = jnp.minimum(jnp.max(q_pos) // chunk + 1, S // chunk)
    lo = jnp.maximum(jnp.min(q_pos) - window + 1, 0) // chunk if window else 0
    Dv = v_cache.shape[-1]

    def body(i, carry):
        m, l, acc = carry
        start = i * chunk
        ks = jax.lax.dynamic_slice_in_dim(k_cache, start, chunk, axis=1)
        vs = jax.lax.dynamic_slice_in_dim(v_cache, start, chunk, axis=1)
        s = scores_of(ks, start, chunk)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing visible yet: keep exp() finite (it gives 0)
        pr = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + fixed_sum(pr)
        acc = acc * alpha[..., None] + pv(pr, vs)
        return m_new, l, acc

    init = (
        jnp.full((B, K, G, T), NEG_INF, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        jnp.zeros((B, K, G, T, Dv), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    out = acc / l[..., None]  # [B, K, G, T, Dv]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dv)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """tanh-approximated GELU (ggml_gelu / HF gelu_pytorch_tanh). Exact function; llama.cpp's CPU backend uses an
    fp16 lookup table, a difference the parity tests account for."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": gelu_tanh}


def linear(x: jax.Array, w: jax.Array | QWeight) -> jax.Array:
    """x [..., In] @ w^T with w stored (Out, In) as in GGUF/PyTorch: an f32 array (the reference path) or a packed
    quantized QWeight (the kernels' path, fucina_jax.kernels)."""
    if isinstance(w, QWeight):
        return qlinear(x, w)
    return jnp.einsum("...i,oi->...o", x, w)


def glu_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: str) -> jax.Array:
    """down(act(gate x) * up x): SwiGLU (silu) or GeGLU (gelu)."""
    return linear(ACTIVATIONS[act](linear(x, gate)) * linear(x, up), down)


def moe_ffn(
    x: jax.Array,
    router_logits: jax.Array,
    gate_exps: jax.Array,
    up_exps: jax.Array,
    down_exps: jax.Array,
    n_used: int,
    act: str,
    expert_scale: jax.Array | None = None,
) -> jax.Array:
    """Softmax top-k routing with renormalised weights (llama.cpp build_moe_ffn, SOFTMAX gating, norm_w=true).

    x: [..., D]; router_logits: [..., E]; gate/up_exps: [E, F, D]; down_exps: [E, D, F].
    Dense formulation: every expert is computed for every token and weighted by a [.., E] matrix that is zero off the
    selected experts. Exact (zero weights contribute 0), simple, and fine for the tiny fixtures; a gather-based
    path is the speed route for real MoE checkpoints.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, n_used)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    if expert_scale is not None:
        top_w = top_w * expert_scale[top_i]
    E = probs.shape[-1]
    weights = jnp.sum(jax.nn.one_hot(top_i, E, dtype=jnp.float32) * top_w[..., None], axis=-2)  # [..., E]
    g = jnp.einsum("...d,efd->...ef", x, gate_exps)
    u = jnp.einsum("...d,efd->...ef", x, up_exps)
    y = jnp.einsum("...ef,edf->...ed", ACTIVATIONS[act](g) * u, down_exps)
    return jnp.einsum("...ed,...e->...d", y, weights)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    return cap * jnp.tanh(x / cap) if cap else x


def layer_inv_freq(spec) -> np.ndarray:
    return rope_inv_freq(spec.n_rot, spec.rope_base, spec.rope_scale, spec.rope_freq_factors)


def attention_block(p: dict, x, positions, ks: list, vs: list, spec, cfg, *, qk_norm: bool, v_norm: bool = False,
                    inv_freq=None):
    """Self-attention of one layer: projections, (q/k norm), RoPE, cache write, attention, output projection.

    x: [B, T, D] (already input-normed); ks/vs: the cache's per-slot arrays, updated in place in the Python list
    (the pytree stays immutable: new arrays replace old ones). Gemma 4 quirks: K=V layers (no attn_v: V is the raw K
    projection, before k-norm and RoPE), the weightless value norm, and shared-KV layers that only read.
    inv_freq [n_rot/2] overrides the spec's RoPE speeds (Gemma 4 divides them by the rope_freqs tensor, which is a
    weight of the file, not metadata, so it cannot live in the static LayerSpec).
    """
    B, T, _ = x.shape
    H, K, Dh = cfg.n_heads, spec.n_kv_heads, spec.head_dim
    if inv_freq is None:
        inv_freq = layer_inv_freq(spec)
    q = linear(x, p["attn_q"]).reshape(B, T, H, Dh)
    if qk_norm:
        q = rms_norm(q, p["attn_q_norm"], cfg.rms_eps)
    q = apply_rope(q, positions, inv_freq, cfg.rope_neox)
    if spec.writes_kv:
        k = linear(x, p["attn_k"]).reshape(B, T, K, Dh)
        v = linear(x, p["attn_v"]).reshape(B, T, K, Dh) if "attn_v" in p else k
        if qk_norm:
            k = rms_norm(k, p["attn_k_norm"], cfg.rms_eps)
        if v_norm:
            v = rms_norm(v, None, cfg.rms_eps)
        k = apply_rope(k, positions, inv_freq, cfg.rope_neox)
        ks[spec.kv_slot] = write_kv(ks[spec.kv_slot], k, positions)
        vs[spec.kv_slot] = write_kv(vs[spec.kv_slot], v, positions)
    scale = spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(Dh)
    window = cfg.window if spec.sliding else 0
    a = attention(q, ks[spec.kv_slot], vs[spec.kv_slot], positions, scale, window)
    return linear(a.reshape(B, T, H * Dh), p["attn_output"])


def embed(params: dict, tokens: jax.Array, cfg) -> jax.Array:
    w = params["token_embd"]
    rows = take_rows(w, tokens) if isinstance(w, QWeight) else w[tokens]
    return rows * jnp.float32(cfg.embed_scale)


def unembed(params: dict, h: jax.Array, cfg) -> jax.Array:
    """Final-normed hidden [..., D] -> logits [..., V]; tied models reuse token_embd; optional final softcap."""
    w = params["output"] if "output" in params else params["token_embd"]
    return softcap(linear(h, w), cfg.final_softcap)
