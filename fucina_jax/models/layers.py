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

__all__ = [
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


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (w None: no weight, e.g. Gemma 4's value norm)."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
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


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_pos: jax.Array,
    scale: float,
    window: int = 0,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with GQA, against the whole cache.

    q: [B, T, H, Dh]; k_cache/v_cache: [B, S, K, Dh(v)] already holding this step's rows; q_pos: [B, T].
    Mask: slot j visible to a query at position p iff j <= p (causal; stale slots past the committed length are
    always > p or were overwritten by this step), and on sliding layers additionally p - j < window (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD: a query sees exactly the last `window` positions including itself).
    """
    B, T, H, Dh = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache) * scale  # [B, K, G, T, S]
    slot = jnp.arange(S, dtype=jnp.int32)
    p = q_pos[:, :, None]  # [B, T, 1]
    visible = slot[None, None, :] <= p
    if window:
        visible = visible & (p - slot[None, None, :] < window)
    scores = jnp.where(visible[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache)
    return out.reshape(B, T, H, v_cache.shape[-1])


def gelu_tanh(x: jax.Array) -> jax.Array:
    """tanh-approximated GELU (ggml_gelu / HF gelu_pytorch_tanh). Exact function; llama.cpp's CPU backend uses an
    fp16 lookup table, a difference the parity tests account for."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": gelu_tanh}


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., In] @ w^T with w stored (Out, In) as in GGUF/PyTorch."""
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
    return params["token_embd"][tokens] * jnp.float32(cfg.embed_scale)


def unembed(params: dict, h: jax.Array, cfg) -> jax.Array:
    """Final-normed hidden [..., D] -> logits [..., V]; tied models reuse token_embd; optional final softcap."""
    w = params["output"] if "output" in params else params["token_embd"]
    return softcap(linear(h, w), cfg.final_softcap)
