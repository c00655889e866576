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

from fucina_jax.kernels import KERNEL_WEIGHTS, FWeight, QWeight, expert_linear, qlinear, qlinear_candidates, take_rows
from fucina_jax.kernels import attention as kernels_attention
from fucina_jax.kernels import attention_write as kernels_attention_write
from fucina_jax.kernels import norm_rope as kernels_norm_rope
from fucina_jax.kernels import residual_norm as kernels_residual_norm
from fucina_jax.kernels import rms_norm as kernels_rms_norm

__all__ = [
    "rms_norm",
    "rope_angles",
    "rope_inv_freq",
    "apply_rope",
    "attention",
    "write_kv",
    "ffn_block",
    "fuse_projections",
    "glu_ffn",
    "project",
    "residual_norm",
    "gelu_tanh",
    "moe_ffn",
    "route",
    "softcap",
]

NEG_INF = -jnp.inf


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, fast: bool = False) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (w None: no weight, e.g. Gemma 4's value norm).

    fast: the C kernel (kernels.rms_norm: one call instead of several XLA ops, rows in a fixed order), used by
    models on the kernels' path (cfg.kernels)."""
    if fast:
        return kernels_rms_norm(x, w, eps)
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def residual_norm(h: jax.Array, a: jax.Array, w_post: jax.Array | None, w_next: jax.Array, eps: float,
                  fast: bool = False) -> tuple[jax.Array, jax.Array]:
    """The step between sublayers: h' = h + rms_norm(a, w_post) (Gemma's post-norms) or h + a (w_post None), and
    the next sublayer's input rms_norm(h', w_next). fast: one C call (kernels.residual_norm)."""
    if fast:
        return kernels_residual_norm(h, a, w_post, w_next, eps, post=w_post is not None)
    h = h + (a if w_post is None else rms_norm(a, w_post, eps))
    return h, rms_norm(h, w_next, eps)


def rope_inv_freq(n_rot: int, base: float, freq_scale: float = 1.0, freq_factors=None) -> np.ndarray:
    """Per-pair angular speeds [n_rot/2]: freq_scale * base^(-2i/n_rot) / ff[i] (ggml's rope with freq factors).

    Computed in float64 on the host and rounded once, so every step sees the same constants.
    """
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv = freq_scale * base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)[: n_rot // 2]
    return inv.astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq) -> jax.Array:
    """cos and sin of every rotation angle: positions [B, T] -> [B, T, n_rot/2, 2]."""
    theta = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, n_rot/2]
    return jnp.stack([jnp.cos(theta), jnp.sin(theta)], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, neox: bool = True) -> jax.Array:
    """Rotate the first n_rot = 2*len(inv_freq) dims of each head; the rest pass through.

    x: [B, T, H, Dh]; positions: [B, T] int32.
    NEOX pairs dim i with i + n_rot/2 (Qwen3, Gemma); NORM pairs 2i with 2i+1 (Llama in GGUF, whose converter
    permuted Q/K rows for exactly this layout).
    """
    n_rot = 2 * inv_freq.shape[0]
    cs = rope_angles(positions, inv_freq)
    cos = cs[:, :, None, :, 0]
    sin = cs[:, :, None, :, 1]
    xr, xpass = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x0, x1 = xr[..., : n_rot // 2], xr[..., n_rot // 2 :]
        y = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    else:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([y, xpass], axis=-1) if xpass.shape[-1] else y


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Store new [B, T, K, Dh] into cache [B, S, K, Dh] at slot = position.

    Slot s holds absolute position s (a full-length cache, see cache.py). Rows whose position is >= S (padding of a
    bucket near the end of the context) are dropped, never clamped onto a live slot. rows int32 [n] (optional): new
    and positions have n rows, row i goes into cache row rows[i] of a cache of any batch (the others are untouched).
    """
    B, T = positions.shape
    if rows is None:
        rows = jax.lax.broadcasted_iota(jnp.int32, (B, T), 0)
    else:
        rows = jnp.broadcast_to(rows.astype(jnp.int32)[:, None], (B, T))
    idx = jnp.stack([rows, positions.astype(jnp.int32)], axis=-1)  # [B, T, 2]: (row, slot) of each new entry
    # cache.at[rows, positions].set(new, mode="drop") as the one scatter it lowers to: tracing jnp's indexing took
    # a third of a forward's trace time (start-up)
    dnums = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 1),
                                            scatter_dims_to_operand_dims=(0, 1))
    return jax.lax.scatter(cache, idx, new.astype(cache.dtype), dnums, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


# Attention reads the cache in chunks of this many slots, and only the chunks that hold visible slots: a decode step
# at position p costs O(p) (O(window) on sliding layers), not O(capacity).
ATTN_CHUNK = 256


def tree_slots(positions: jax.Array, tree: jax.Array | None) -> jax.Array:
    """The cache slot of each step row [B, T]: its position, or in a tree verify the root's slot + its index."""
    if tree is None:
        return positions
    return positions[:, :1] + jnp.arange(positions.shape[1], dtype=positions.dtype)[None, :]


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    q_pos: jax.Array,
    scale: float,
    window: int = 0,
    rows: jax.Array | None = None,
    tree: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with GQA, over the visible part of the cache.

    q: [B, T, H, Dh]; k_cache/v_cache: [B, S, K, Dh(v)] already holding this step's rows; q_pos: [B, T].
    rows int32 [n] (optional): q has n rows, row i attends over cache row rows[i] (those rows are gathered first: a
    copy, on this reference path).
    Mask: slot j visible to a query at position p iff j <= p (causal; stale slots past the committed length are
    always > p or were overwritten by this step), and on sliding layers additionally p - j < window (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD: a query sees exactly the last `window` positions including itself).
    tree int32 [B, T] (optional): a tree verify. q_pos is then each row's stream position (root + depth), step
    row t is in slot q_pos[:, 0] + t (tree_slots), and it sees the slots before the root's plus step slot m iff
    bit m of tree[b, t] is set (its ancestors and itself; each judged by its own position on sliding layers).

    Online softmax over cache chunks in a loop with data-dependent bounds (no recompile as the context grows); a
    capacity that is not a multiple of 16 (init_cache never makes one) takes a one-shot path over all S slots.
    This is the pure-JAX reference; models on the kernels use kernels.attention (same contract, in C,
    row-exact).
    """
    if rows is not None:
        k_cache, v_cache = k_cache[rows], v_cache[rows]
    B, T, H, Dh = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, Dh)
    p = q_pos[:, None, None, :, None]  # [B, 1, 1, T, 1] against scores [B, K, G, T, slots]

    if tree is not None:
        root = q_pos[:, :1][:, None, None, :, None]  # [B, 1, 1, 1, 1]
        masks = tree.astype(jnp.int32)[:, None, None, :, None]  # [B, 1, 1, T, 1]

    def scores_of(ks, first_slot, n):
        s = jnp.einsum("btkgd,bskd->bkgts", qg, ks) * scale
        slot = first_slot + jnp.arange(n, dtype=jnp.int32)
        if tree is None:
            visible, slot_pos = slot <= p, slot
        else:
            m = slot - root  # the step row a slot holds (0 <= m < T)
            step = (m >= 0) & (m < T)
            mc = jnp.clip(m, 0, T - 1)
            seen = ((masks >> jnp.clip(m, 0, 31)) & 1) == 1
            visible = jnp.where(step, seen, slot < root)
            slot_pos = jnp.where(step, jnp.take_along_axis(
                jnp.broadcast_to(q_pos[:, None, None, None, :], (*mc.shape[:-1], T)), mc, axis=-1), slot)
        if window:
            visible = visible & (p - slot_pos < window)
        return jnp.where(visible, s, NEG_INF)

    chunk = next((c for c in (ATTN_CHUNK, 128, 64, 32, 16) if S % c == 0), None)
    if chunk is None:
        probs = jax.nn.softmax(scores_of(k_cache, 0, S), axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache)
        return out.reshape(B, T, H, v_cache.shape[-1])

    # padding rows of a bucket near the end of the context carry positions >= S: never read past the last chunk
    last = q_pos if tree is None else tree_slots(q_pos, tree)
    hi = jnp.minimum(jnp.max(last) // chunk + 1, S // chunk)
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
        l = l * alpha + jnp.sum(pr, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskd->bkgtd", pr, vs)
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


def linear(x: jax.Array, w: jax.Array | QWeight | FWeight) -> jax.Array:
    """x [..., In] @ w^T with w stored (Out, In) as in GGUF/PyTorch: an f32 array (the reference path) or a packed
    quantized QWeight or float FWeight (the kernels' path, fucina_jax.kernels)."""
    if isinstance(w, KERNEL_WEIGHTS):
        return qlinear(x, w)
    return jnp.einsum("...i,oi->...o", x, w)


def glu_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: str) -> jax.Array:
    """down(act(gate x) * up x): SwiGLU (silu) or GeGLU (gelu)."""
    return linear(ACTIVATIONS[act](linear(x, gate)) * linear(x, up), down)


# Projections that read the same input; on the kernels' path a layer may hold them as one fused weight under the
# joined key (see fuse_projections), so one kernel call computes all of them.
FUSIBLE = (("attn_q", "attn_k", "attn_v"), ("attn_q", "attn_k"), ("ffn_gate", "ffn_up"))


def project(x: jax.Array, p: dict, keys: tuple[str, ...]) -> list[jax.Array]:
    """[linear(x, p[key]) for key in keys], through the fused weight of the longest leading run of keys the layer has
    one for (Q+K+V, or Q+K with V apart when V's layout differs, e.g. Q5_0 Q and K with a Q8_0 V)."""
    for n in range(len(keys), 1, -1):
        fused = p.get("+".join(keys[:n]))
        if fused is not None:
            y = linear(x, fused)
            bounds = np.cumsum(fused.splits)[:-1].tolist()
            return jnp.split(y, bounds, axis=-1) + [linear(x, p[k]) for k in keys[n:]]
    return [linear(x, p[k]) for k in keys]


def fuse_projections(layer: dict, writes_kv: bool = True) -> dict:
    """A layer's params with each FUSIBLE group of kernel weights replaced by one fused weight where the kernels
    allow it (same layout); Q/K/V only on layers that write the KV cache (the others use Q alone)."""
    from fucina_jax.kernels import concat_weights

    out = dict(layer)
    for keys in FUSIBLE:
        if (keys[0] == "attn_q" and not writes_kv) or not all(isinstance(out.get(k), KERNEL_WEIGHTS) for k in keys):
            continue
        fused = concat_weights([out[k] for k in keys])
        if fused is not None:
            for k in keys:
                del out[k]
            out["+".join(keys)] = fused
    return out


def ffn_block(x: jax.Array, p: dict, act: str) -> jax.Array:
    """glu_ffn over a layer's ffn_gate / ffn_up (possibly fused) / ffn_down."""
    g, u = project(x, p, ("ffn_gate", "ffn_up"))
    return linear(ACTIVATIONS[act](g) * u, p["ffn_down"])


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
    The reference (f32 stacks): every expert is computed for every token and weighted by a [.., E] matrix that is
    zero off the selected experts. Exact (zero weights contribute 0) and simple. Where a stack is packed
    (kernels.pack_experts, the kernels' path), only the routed experts are computed (_routed_experts); up_exps may
    then be None, with gate_exps the fused gate_up stack.
    """
    top_w, top_i = route(router_logits, n_used)
    if expert_scale is not None:
        top_w = top_w * expert_scale[top_i]
    if any(isinstance(w, QWeight) for w in (gate_exps, up_exps, down_exps)):
        return _routed_experts(x, top_w, top_i, gate_exps, up_exps, down_exps, act)
    E = router_logits.shape[-1]
    weights = jnp.sum(jax.nn.one_hot(top_i, E, dtype=jnp.float32) * top_w[..., None], axis=-2)  # [..., E]
    g = jnp.einsum("...d,efd->...ef", x, gate_exps)
    u = jnp.einsum("...d,efd->...ef", x, up_exps)
    y = jnp.einsum("...ef,edf->...ed", ACTIVATIONS[act](g) * u, down_exps)
    return jnp.einsum("...ed,...e->...d", y, weights)


def route(router_logits: jax.Array, n_used: int) -> tuple[jax.Array, jax.Array]:
    """Router logits [..., E] -> (weights, expert ids) [..., n_used]: softmax over all E, top n_used, renormalised.

    Spelled as the top n_used logits, then a softmax over those alone: the same numbers (softmax's common factor
    cancels in the renormalisation), but no reduction over E, and the n_used-term sum in a fixed order. So a row's
    experts and weights depend on its logits only, never on the number of rows (XLA may sum a [T, E] softmax
    differently at T = 1 and T = 8). Ties between equal logits go to the lower expert id, as in lax.top_k.
    """
    top_l, top_i = jax.lax.top_k(router_logits.astype(jnp.float32), n_used)
    e = jnp.exp(top_l - top_l[..., :1])  # top_k sorts descending: e[..., 0] == 1
    total = e[..., 0]
    for j in range(1, n_used):
        total = total + e[..., j]
    return e / total[..., None], top_i


def _expert_rows(x: jax.Array, ids: jax.Array, w) -> jax.Array:
    """Rows [T, U, n] of expert ids [T, U] applied to x [T, k] or [T, U, k]: the experts kernel for a packed stack,
    a gather of the U experts' f32 matrices for an f32 one."""
    if isinstance(w, QWeight):
        return expert_linear(x, ids, w)
    eq = "tk,tunk->tun" if x.ndim == 2 else "tuk,tunk->tun"
    return jnp.einsum(eq, x, w[ids])


def _routed_experts(x, top_w, top_i, gate_exps, up_exps, down_exps, act: str) -> jax.Array:
    """moe_ffn over the routed experts only (the kernels' path: stacks packed by kernels.pack_experts). up_exps None:
    gate_exps is the fused gate_up stack [E, 2F, D] (gate rows first). The weighted sum over the U experts is spelled
    out in a fixed order, so each row is the same whatever the batch."""
    lead, D = x.shape[:-1], x.shape[-1]
    U = top_i.shape[-1]
    xt, ids, wts = x.reshape(-1, D), top_i.reshape(-1, U), top_w.reshape(-1, U)
    if up_exps is None:
        g, u = jnp.split(_expert_rows(xt, ids, gate_exps), 2, axis=-1)
    else:
        g, u = _expert_rows(xt, ids, gate_exps), _expert_rows(xt, ids, up_exps)
    y = _expert_rows(ACTIVATIONS[act](g) * u, ids, down_exps)  # [T, U, D]
    out = y[:, 0] * wts[:, :1]
    for j in range(1, U):
        out = out + y[:, j] * wts[:, j:j + 1]
    return out.reshape(*lead, D)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    return cap * jnp.tanh(x / cap) if cap else x


def layer_inv_freq(spec) -> np.ndarray:
    return rope_inv_freq(spec.n_rot, spec.rope_base, spec.rope_scale, spec.rope_freq_factors)


def attention_block(p: dict, x, positions, ks: list, vs: list, spec, cfg, *, qk_norm: bool, v_norm: bool = False,
                    inv_freq=None, rows=None, tree=None):
    """Self-attention of one layer: projections, (q/k norm), RoPE, cache write, attention, output projection.

    x: [B, T, D] (already input-normed); ks/vs: the cache's per-slot arrays, updated in place in the Python list
    (the pytree stays immutable: new arrays replace old ones). Gemma 4 quirks: K=V layers (no attn_v: V is the raw K
    projection, before k-norm and RoPE), the weightless value norm, and shared-KV layers that only read.
    inv_freq [n_rot/2] overrides the spec's RoPE speeds (Gemma 4 divides them by the rope_freqs tensor, which is a
    weight of the file, not metadata, so it cannot live in the static LayerSpec).
    rows int32 [n] or None (KVCache.rows): x's n rows are cache rows rows[i] (written and read there alone).
    tree int32 [n, T] or None (KVCache.tree): the rows are a tree verify (attention).
    """
    B, T, _ = x.shape
    H, K, Dh = cfg.n_heads, spec.n_kv_heads, spec.head_dim
    if inv_freq is None:
        inv_freq = layer_inv_freq(spec)
    if spec.writes_kv:
        has_v = "attn_v" in p or "attn_q+attn_k+attn_v" in p
        q, k, *v = project(x, p, ("attn_q", "attn_k", "attn_v") if has_v else ("attn_q", "attn_k"))
        k = k.reshape(B, T, K, Dh)
        v = v[0].reshape(B, T, K, Dh) if has_v else k
    else:
        q = linear(x, p["attn_q"])
    angles = rope_angles(positions, inv_freq) if cfg.kernels else None  # once for q and k

    def norm_rope(x, w):  # (q/k-norm, then) RoPE: one C call on the kernels' path
        if cfg.kernels:
            return kernels_norm_rope(x, w, cfg.rms_eps, angles, cfg.rope_neox, norm=qk_norm)
        return apply_rope(rms_norm(x, w, cfg.rms_eps) if qk_norm else x, positions, inv_freq, cfg.rope_neox)

    q = norm_rope(q.reshape(B, T, H, Dh), p.get("attn_q_norm"))
    if spec.writes_kv:
        if v_norm:
            v = rms_norm(v, None, cfg.rms_eps, cfg.kernels)
        k = norm_rope(k, p.get("attn_k_norm"))
    scale = spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(Dh)
    window = cfg.window if spec.sliding else 0
    slot = spec.kv_slot
    if spec.writes_kv and cfg.kernels:  # the cache write and the attention in one C call
        a, ks[slot], vs[slot] = kernels_attention_write(q, k, v, ks[slot], vs[slot], positions, scale, window, rows,
                                                        tree)
    else:
        if spec.writes_kv:
            ks[slot] = write_kv(ks[slot], k, tree_slots(positions, tree), rows)
            vs[slot] = write_kv(vs[slot], v, tree_slots(positions, tree), rows)
        attend = kernels_attention if cfg.kernels else attention
        a = attend(q, ks[slot], vs[slot], positions, scale, window, rows, tree)
    return linear(a.reshape(B, T, H * Dh), p["attn_output"])


def lookup(w: jax.Array | QWeight | FWeight, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` of an embedding table as f32 [..., k]: an f32 array, or a kernel weight read in place (the
    same values: kernels.take_rows)."""
    return take_rows(w, tokens) if isinstance(w, KERNEL_WEIGHTS) else w[tokens]


def embed(params: dict, tokens: jax.Array, cfg) -> jax.Array:
    return lookup(params["token_embd"], tokens) * jnp.float32(cfg.embed_scale)


def unembed(params: dict, h: jax.Array, cfg) -> jax.Array:
    """Final-normed hidden [..., D] -> logits [..., V]; tied models reuse token_embd; optional final softcap."""
    return softcap(linear(h, output_weight(params)), cfg.final_softcap)


def output_weight(params: dict):
    """The output layer's weight: `output`, or `token_embd` for a tied model."""
    return params["output"] if "output" in params else params["token_embd"]


def unembed_pick(params: dict, h: jax.Array, cfg, k: int, c: int = 0) -> tuple | None:
    """(the greedy pick [...], the ids of the min(k, V) largest logits [..., min(k, V)], candidates) of the logits
    unembed(params, h, cfg) would give, bitwise (sampling.greedy_pick's and sampling.top_k's rules), computed in the
    output layer's kernel without writing the logits out (kernels.qlinear_candidates); candidates: a sampler's,
    sampling.top_k(logits, min(c, V), fold_zero=True) (values, ids), for c > 0, else None. None where that kernel
    does not apply (an f32 or float-type output weight, or a final softcap), and the caller unembeds."""
    w = output_weight(params)
    if not isinstance(w, QWeight) or cfg.final_softcap:
        return None
    ids, top, vals, cids = qlinear_candidates(h, w, min(k, w.n), min(c, w.n))
    return ids, top, ((vals, cids) if c else None)
