"""Quantized CPU kernels inside jax.jit: the fast path for GGUF weights.

A `QWeight` is a weight packed once at load (pack.py) and kept at 0.56-1.06 bytes per value (about the file's)
instead of f32's 4.
`qlinear(x, w)` multiplies through the XLA FFI target `fucina_qmatmul` (qmatmul.cc): activations quantized per
32-block to int8 like llama.cpp's q8_0, exact integer dot products, a fixed float sequence per output, so each row
of the result is bitwise independent of how many rows are computed with it. `take_rows(w, ids)` gathers embedding
rows from the packed codes, value for value the f32 path's dequantized rows.

Everything here is a pure function usable under jax.jit; a QWeight is a pytree (its arrays are leaves, its shape
facts static). The kernels pick AVX-512 VNNI, AVX2 or scalar code at run time (`isa()`, `set_isa()`, or the
FUCINA_KERNEL_ISA environment variable), all bitwise identical.

Layers a file stores as floats (F32, F16, BF16) become an `FWeight`: the file's values in the file's type, row-major,
multiplied by f32 activations in `fucina_fmatmul` (fmatmul.cc), one fixed float sequence per output like the
quantized kernels, so they too give verify rows bitwise equal to decode rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from fucina_jax.kernels.pack import LANES, PACKED_TYPES, QBLOCK, aligned_empty, pack_tensor

__all__ = ["FLOAT_TYPES", "FWeight", "KERNEL_WEIGHTS", "PACKED_TYPES", "QWeight", "argmax", "attention",
           "attention_write", "available", "concat_weights", "expert_linear", "isa", "pack_experts", "pack_weight",
           "packable", "norm_rope", "qlinear", "qlinear_candidates", "qlinear_pick", "residual_norm", "rms_norm",
           "set_isa", "supported_isas", "take_rows", "threads", "top_k"]

TARGET = "fucina_qmatmul"
EXPERTS_TARGET = "fucina_qmatmul_experts"
SELECT_TARGET = "fucina_qmatmul_select"
FLOAT_TARGET = "fucina_fmatmul"
ATTENTION_TARGET = "fucina_attention"
ATTENTION_WRITE_TARGET = "fucina_attention_write"
RMS_NORM_TARGET = "fucina_rms_norm"
NORM_ROPE_TARGET = "fucina_norm_rope"
RESIDUAL_NORM_TARGET = "fucina_residual_norm"
TOP_K_TARGET = "fucina_top_k"
ARGMAX_TARGET = "fucina_argmax"
_registered = False


def _module():
    from fucina_jax.kernels import _qmatmul

    return _qmatmul


def available() -> bool:
    """True when the compiled kernels import (they are built by `pip install` on x86-64)."""
    try:
        _module()
    except ImportError:
        return False
    return True


def _register() -> None:
    global _registered
    if not _registered:
        for name, capsule in _module().handlers().items():
            jax.ffi.register_ffi_target(f"fucina_{name}", capsule, platform="cpu")
        _registered = True


def isa() -> str:
    """The instruction set the kernels run with now: avx512, avx2 or scalar."""
    return _module().isa()


def supported_isas() -> list[str]:
    return _module().supported_isas()


def set_isa(name: str) -> None:
    """Force an instruction set (a lower one than the best is for testing the fallbacks; results are identical)."""
    _module().set_isa(name)


def threads() -> dict:
    """Who runs the kernels' parallel loops (parallel.h): {"pool": "own" (the kernels' spinning workers, the
    default) or "xla" (FUCINA_KERNEL_POOL=xla: XLA's intra-op pool), "workers": their count, and how many calls ran
    on the caller alone, with the workers, or on XLA's pool (the fallback while another call holds the workers)}."""
    return _module().threads()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    """A [n, k] weight (GGUF/PyTorch (out, in) order) in the kernels' packed layout (see pack.py)."""

    q: jax.Array  # uint8 [G, k/32 * 64 * bits] (pack.py: bytes, or nibbles + bit planes)
    a: jax.Array  # f16 or f32 [G, k/bs * 16], or K-quants' two-level uint8/int8 [G, k/256 * 320|288] (pack.py)
    c: jax.Array  # same as a (affine types) or [0] (symmetric types)
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    bs: int = dataclasses.field(metadata=dict(static=True))
    splits: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # see concat_weights
    experts: int = dataclasses.field(default=0, metadata=dict(static=True))  # > 0: a stack, see expert_linear

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def bits(self) -> int:
        """Bits per code (pack.CODE_BITS): 8, or 4-6 stored as nibbles + bit planes."""
        return self.q.shape[-1] // (self.k // QBLOCK * 64)

    @property
    def nbytes(self) -> int:
        return int(self.q.size + self.a.size * self.a.dtype.itemsize + self.c.size * self.c.dtype.itemsize)


_T = GGMLQuantizationType
# GGUF float types the float kernel reads as they are stored, and their NumPy types.
FLOAT_TYPES = {_T.F32: np.dtype("<f4"), _T.F16: np.dtype("<f2"), _T.BF16: np.dtype(jnp.bfloat16)}
FLOAT_K = 16  # the float kernel's k must be a multiple of this (its 16 partial sums, fmatmul.cc)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FWeight:
    """A [n, k] weight stored as floats (f32, f16 or bf16), row-major [out, in] as in the GGUF file."""

    w: jax.Array
    splits: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # see concat_weights

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def n(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.w.size * self.w.dtype.itemsize)


# The weights the kernels multiply by (isinstance checks take the tuple).
KERNEL_WEIGHTS = (QWeight, FWeight)


def pack_weight(raw: np.ndarray, qtype, shape: tuple[int, int], done=None) -> QWeight | FWeight:
    """Raw GGUF bytes of a [n, k] tensor of a type in PACKED_TYPES (-> QWeight) or FLOAT_TYPES (-> FWeight, the same
    values in the same type) with NumPy leaves, 64-byte aligned so jax.device_put adopts them without a copy. `done`
    as in pack.pack_tensor."""
    n, k = int(shape[0]), int(shape[1])
    if qtype in FLOAT_TYPES:
        src = np.frombuffer(raw, np.uint8).reshape(n, -1)
        out = aligned_empty(src.shape, np.uint8)
        step = max(1, (4 << 20) // max(1, src.shape[1]))  # ~4 MB a chunk: the file's pages go as they are copied
        for n0 in range(0, n, step):
            np.copyto(out[n0:n0 + step], src[n0:n0 + step])
            if done is not None:
                done(src[n0:n0 + step])
        return FWeight(w=out.view(FLOAT_TYPES[qtype]).reshape(n, k))
    q, a, c, bs = pack_tensor(raw, qtype, (n, k), done=done)
    return QWeight(q=q, a=a, c=c, n=n, k=k, bs=bs)


def pack_experts(raw: np.ndarray, qtype, shape: tuple[int, int, int], done=None) -> QWeight:
    """Raw GGUF bytes of an expert stack [E, n, k] (n a multiple of 16) -> one QWeight of E * n columns, expert e's
    columns e * n .. (e + 1) * n, its 16-column groups contiguous (what fucina_qmatmul_experts reads)."""
    E, n, k = (int(d) for d in shape)
    return dataclasses.replace(pack_weight(raw, qtype, (E * n, k), done=done), experts=E)


def concat_weights(ws: list[QWeight | FWeight]) -> QWeight | FWeight | None:
    """Weights that read the same input (Q, K, V; gate, up) as one weight whose outputs are the parts' outputs side
    by side (`splits` = the parts' n): one kernel call instead of several, each column computed exactly as before.
    None when the parts differ in kind or layout (k, bs, affine, float type) or a QWeight part's columns do not fill
    whole 16-column groups.
    NumPy parts (the loader fuses before placing) give 64-byte aligned NumPy leaves, like pack_weight."""
    first = ws[0]
    if isinstance(first, FWeight):
        if any(not isinstance(w, FWeight) or w.k != first.k or w.w.dtype != first.w.dtype for w in ws):
            return None
        parts = [w.w for w in ws]
        if isinstance(first.w, jax.Array):
            w = jnp.concatenate(parts)
        else:
            w = np.concatenate(parts, out=aligned_empty((sum(p.shape[0] for p in parts), first.k), first.w.dtype))
        return FWeight(w=w, splits=tuple(p.n for p in ws))
    if any(not isinstance(w, QWeight) for w in ws):
        return None
    affine = first.c.size > 0
    if any(w.k != first.k or w.bs != first.bs or (w.c.size > 0) != affine or w.a.dtype != first.a.dtype
           or w.bits != first.bits or w.n % LANES for w in ws):
        return None
    if isinstance(first.q, jax.Array):
        cat = jnp.concatenate
    else:
        def cat(parts):
            out = aligned_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype)
            return np.concatenate(parts, out=out)
    return QWeight(q=cat([w.q for w in ws]), a=cat([w.a for w in ws]), c=cat([w.c for w in ws]),
                   n=sum(w.n for w in ws), k=first.k, bs=first.bs, splits=tuple(w.n for w in ws))


def packable(qtype, shape) -> bool:
    """True when pack_weight takes a [n, k] tensor of this type, or pack_experts an [E, n, k] stack (quantized, no
    16-column group straddling two experts); the kernels must be built, and k fit their blocks."""
    if len(shape) not in (2, 3) or not available():
        return False
    if len(shape) == 3:
        return qtype in PACKED_TYPES and shape[1] % LANES == 0 and shape[2] % QBLOCK == 0
    return (qtype in PACKED_TYPES and shape[1] % QBLOCK == 0) or (qtype in FLOAT_TYPES and shape[1] % FLOAT_K == 0)


def qlinear(x: jax.Array, w: QWeight | FWeight) -> jax.Array:
    """x [..., k] @ w^T -> [..., n], through the quantized kernel (or the float kernel for an FWeight)."""
    _register()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).astype(jnp.float32)
    if isinstance(w, FWeight):
        y = jax.ffi.ffi_call(FLOAT_TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.n), jnp.float32))(x2, w.w)
        return y.reshape(*lead, w.n)
    n_pad = w.q.shape[0] * LANES
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n_pad), jnp.float32))(
        x2, w.q, w.a, w.c, bs=np.int64(w.bs)
    )
    if n_pad != w.n:
        y = y[:, : w.n]
    return y.reshape(*lead, w.n)


def qlinear_pick(x: jax.Array, w: QWeight, k: int) -> tuple[jax.Array, jax.Array]:
    """(argmax(qlinear(x, w)), top_k(qlinear(x, w), k)[1]) without the product ever being written out: the greedy
    pick of each row (int32 [...]) and the ids of its k largest values (int32 [..., k]; k = 0 gives [..., 0]), both
    bitwise what argmax and top_k answer on qlinear's values (qmatmul.cc, fucina_qmatmul_select)."""
    return qlinear_candidates(x, w, k, 0)[:2]


def qlinear_candidates(x: jax.Array, w: QWeight, k: int, c: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """qlinear_pick's (pick, top-k ids) and a sampler's candidates: top_k(qlinear(x, w), c, fold_zero=True), the c
    largest values (float32 [..., c], -0.0 returned as +0.0) and their ids (int32 [..., c]), bitwise what top_k
    answers on qlinear's values, again without the product being written out."""
    _register()
    if not (0 <= k <= w.n and 0 <= c <= w.n):
        raise ValueError(f"qlinear_candidates: k = {k} and c = {c} must be in [0, {w.n}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).astype(jnp.float32)
    M = x2.shape[0]
    ids, top, vals, cids = jax.ffi.ffi_call(SELECT_TARGET, (jax.ShapeDtypeStruct((M,), jnp.int32),
                                                            jax.ShapeDtypeStruct((M, k), jnp.int32),
                                                            jax.ShapeDtypeStruct((M, c), jnp.float32),
                                                            jax.ShapeDtypeStruct((M, c), jnp.int32)))(
        x2, w.q, w.a, w.c, bs=np.int64(w.bs), n_pad=np.int64(w.q.shape[0] * LANES), n=np.int64(w.n), k=np.int64(k),
        c=np.int64(c))
    return ids.reshape(lead), top.reshape(*lead, k), vals.reshape(*lead, c), cids.reshape(*lead, c)


def expert_linear(x: jax.Array, ids: jax.Array, w: QWeight) -> jax.Array:
    """A mixture-of-experts product: ids [T, U] expert ids, x [T, k] (each token's input, read by all its experts)
    or [T, U, k] (one input per (token, expert)) -> [T, U, n / experts], row (t, u) = x[t] (or x[t, u]) times
    expert ids[t, u] of the stack w (pack_experts). Each row is computed as qlinear computes it."""
    _register()
    T, U = ids.shape
    return jax.ffi.ffi_call(EXPERTS_TARGET, jax.ShapeDtypeStruct((T, U, w.n // w.experts), jnp.float32))(
        x.reshape(-1, w.k).astype(jnp.float32), ids.astype(jnp.int32), w.q, w.a, w.c, bs=np.int64(w.bs),
        experts=np.int64(w.experts))


def take_rows(w: QWeight | FWeight, ids: jax.Array) -> jax.Array:
    """Rows ids [...] of the weight as f32 [..., k] (an embedding lookup), dequantized from the packed codes."""
    if isinstance(w, FWeight):
        return w.w[ids].astype(jnp.float32)  # f16 and bf16 widen to f32 exactly
    G, nb, bits = w.q.shape[0], w.k // QBLOCK, w.bits
    g, lane = ids // LANES, ids % LANES
    blocks = w.q.reshape(G, nb, 64 * bits)
    if bits < 8:  # chunks c and c + 4 share double chunk c: low and high nibble; then one plane per higher bit
        v = blocks[:, :, :256].reshape(G, nb, 4, LANES, 4)[g, :, :, lane, :]
        u = jnp.concatenate([v & 0x0F, v >> 4], axis=-2)  # [..., nb, 8, 4]
        bit = (lane % 2)[..., None, None, None] * 4 + jnp.arange(4)  # code p = lane * 4 + e: bit p % 8 of byte p // 8
        for k in range(4, bits):
            plane = blocks[:, :, 256 + 64 * (k - 4):256 + 64 * (k - 3)].reshape(G, nb, 8, 8)[g, :, :, lane // 2]
            u = u | (((plane[..., None] >> bit) & 1) << k).astype(jnp.uint8)
        u = u.reshape(*ids.shape, w.k)
    else:
        u = blocks.reshape(G, nb, 8, LANES, 4)[g, :, :, lane, :].reshape(*ids.shape, w.k)
    a, c = _row_scales(w, g, lane)
    a = jnp.repeat(a, w.bs, axis=-1)
    if c is None:
        return (u.astype(jnp.float32) - jnp.float32(128 if bits == 8 else 1 << (bits - 1))) * a
    return u.astype(jnp.float32) * a + jnp.repeat(c, w.bs, axis=-1)


def _row_scales(w: QWeight, g: jax.Array, lane: jax.Array):
    """Scales and offsets (None: symmetric) of rows (g, lane) as f32 [..., k / bs] (pack.unpack_scales in JAX)."""
    G = w.q.shape[0]
    if w.a.dtype not in (jnp.uint8, jnp.int8):
        a = w.a.reshape(G, -1, LANES)[g, :, lane].astype(jnp.float32)
        return a, (w.c.reshape(G, -1, LANES)[g, :, lane].astype(jnp.float32) if w.c.size else None)
    S = w.k // 256  # K-quant two-level scales, per group and super-block: d, (dmin, scales, mins | int8 scales)
    blk = jax.lax.bitcast_convert_type(w.a, jnp.uint8).reshape(G, S, -1)

    def halves(lo):  # the 16 fp16 at byte lo of each super-block, for these lanes: [..., S, 1]
        pair = blk[:, :, lo:lo + 32].reshape(G, S, LANES, 2)[g, :, lane]
        return jax.lax.bitcast_convert_type(pair, jnp.float16).astype(jnp.float32)[..., None]

    def small(lo, n, signed=False):  # n x 16 small integers at byte lo: [..., S, n]
        v = blk[:, :, lo:lo + 16 * n].reshape(G, S, n, LANES)[g, :, :, lane]
        return (jax.lax.bitcast_convert_type(v, jnp.int8) if signed else v).astype(jnp.float32)

    lead = g.shape
    if w.a.dtype == jnp.int8:  # Q6_K, Q3_K
        return (halves(0) * small(32, 16, signed=True)).reshape(*lead, -1), None
    a = halves(0) * small(64, 8)
    c = -(halves(32) * small(192, 8))
    return a.reshape(*lead, -1), c.reshape(*lead, -1)


def _row_map(rows: jax.Array | None, q: jax.Array, k_cache: jax.Array) -> jax.Array:
    """The kernels' row-map operand: rows as int32 [B], or the empty map (the identity: q's batch is the caches')."""
    if rows is None:
        if q.shape[0] != k_cache.shape[0]:
            raise ValueError(f"q has {q.shape[0]} rows and the caches {k_cache.shape[0]}: pass a row map (rows)")
        return jnp.zeros((0,), jnp.int32)
    if rows.shape != (q.shape[0],):
        raise ValueError(f"rows {rows.shape} must map each of q's {q.shape[0]} rows to a cache row")
    return rows.astype(jnp.int32)


def _tree_masks(tree: jax.Array | None, q: jax.Array) -> jax.Array:
    """The kernels' tree operand: the ancestor masks as int32 [B, T], or the empty one (a chain)."""
    if tree is None:
        return jnp.zeros((0,), jnp.int32)
    if tree.shape != q.shape[:2]:
        raise ValueError(f"tree masks {tree.shape} must be one per step row {q.shape[:2]}")
    return tree.astype(jnp.int32)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_pos: jax.Array, scale: float,
              window: int = 0, rows: jax.Array | None = None, tree: jax.Array | None = None) -> jax.Array:
    """layers.attention's contract (q [B, T, H, Dh], caches [B, S, K, D], q_pos [B, T] -> [B, T, H, Dv]) in C:
    each row reads only its visible slots and is computed in a fixed order of its own (attention.cc).
    rows int32 [n] (optional): q has n rows, row i reads cache row rows[i] of caches [Bc, S, K, D] (distinct rows;
    a row's result is the one it gets at batch n with the identity map). tree int32 [B, T] (optional): a tree
    verify's ancestor masks (layers.attention)."""
    _register()
    B, T, H, _ = q.shape
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, H, v_cache.shape[-1]), jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, q_pos.astype(jnp.int32), _row_map(rows, q, k_cache),
        _tree_masks(tree, q), scale=np.float32(scale), window=np.int64(window),
    )


def attention_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    q_pos: jax.Array, scale: float, window: int = 0, rows: jax.Array | None = None,
                    tree: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """layers.write_kv of this step's K and V rows (k_new/v_new [B, T, K, D]) into both caches, then attention:
    (out [B, T, H, Dv], k_cache, v_cache) in one call. The caches are updated in place (XLA aliases the results to
    the cache arguments); rows at positions outside the cache are dropped, as write_kv drops them.
    rows int32 [n] (optional): the step has n rows over caches [Bc, S, K, D]; step row i is written into and
    attends over cache row rows[i] (distinct rows); the other cache rows are left as they are. tree int32 [B, T]
    (optional): a tree verify (layers.attention): step row t is written into slot q_pos[:, 0] + t."""
    _register()
    B, T, H, _ = q.shape
    out_types = (jax.ShapeDtypeStruct((B, T, H, v_cache.shape[-1]), jnp.float32),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    return jax.ffi.ffi_call(ATTENTION_WRITE_TARGET, out_types, input_output_aliases={3: 1, 4: 2})(
        q.astype(jnp.float32), k_new.astype(jnp.float32), v_new.astype(jnp.float32), k_cache, v_cache,
        q_pos.astype(jnp.int32), _row_map(rows, q, k_cache), _tree_masks(tree, q), scale=np.float32(scale),
        window=np.int64(window),
    )


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """layers.rms_norm's contract in C, one fixed summation order per row (attention.cc)."""
    _register()
    x = x.astype(jnp.float32)
    w = jnp.zeros((0,), jnp.float32) if w is None else w.astype(jnp.float32)
    return jax.ffi.ffi_call(RMS_NORM_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(x, w, eps=np.float32(eps))


def _weight(w: jax.Array | None) -> jax.Array:
    return jnp.zeros((0,), jnp.float32) if w is None else w.astype(jnp.float32)


def norm_rope(x: jax.Array, w: jax.Array | None, eps: float, cos_sin: jax.Array, neox: bool,
              norm: bool = True) -> jax.Array:
    """layers.apply_rope(layers.rms_norm(x, w, eps)) (or RoPE alone with norm=False) in one C call, per head.
    x [B, T, H, Dh]; cos_sin [B, T, n_rot / 2, 2]: cos and sin of each rotation angle (layers.rope_angles)."""
    _register()
    return jax.ffi.ffi_call(NORM_ROPE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x.astype(jnp.float32), _weight(w), cos_sin.astype(jnp.float32), eps=np.float32(eps), norm=np.int64(norm),
        neox=np.int64(neox),
    )


def residual_norm(h: jax.Array, a: jax.Array, w_post: jax.Array | None, w_next: jax.Array, eps: float,
                  post: bool = True) -> tuple[jax.Array, jax.Array]:
    """(h', rms_norm(h', w_next)) with h' = h + rms_norm(a, w_post) (post=False: h + a), in one C call."""
    _register()
    shape = jax.ShapeDtypeStruct(h.shape, jnp.float32)
    return jax.ffi.ffi_call(RESIDUAL_NORM_TARGET, (shape, shape))(
        h.astype(jnp.float32), a.astype(jnp.float32), _weight(w_post), _weight(w_next), eps=np.float32(eps),
        post=np.int64(post),
    )


def top_k(x: jax.Array, k: int, fold_zero: bool = False) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k(x, k) over the last axis, the same values and ids (XLA's total order on the float bits, ties by
    lower index), in one pass per row instead of XLA's sort (select.cc). fold_zero: as if -0.0 were +0.0 first
    (jax.lax.top_k(jnp.where(x == 0, 0.0, x), k)), without that pass over x."""
    _register()
    lead, V = x.shape[:-1], x.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"top_k: k = {k} must be in [1, {V}]")
    vals, ids = jax.ffi.ffi_call(TOP_K_TARGET, (jax.ShapeDtypeStruct((*lead, k), jnp.float32),
                                                jax.ShapeDtypeStruct((*lead, k), jnp.int32)),
                                 vmap_method="broadcast_all")(
        x.astype(jnp.float32), k=np.int64(k), fold_zero=np.int64(fold_zero))
    return vals, ids


def argmax(x: jax.Array) -> jax.Array:
    """The lowest index of each row's maximum over the last axis (int32); NaNs are skipped (V - 1 if all are NaN)."""
    _register()
    return jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
                            vmap_method="broadcast_all")(x.astype(jnp.float32))
