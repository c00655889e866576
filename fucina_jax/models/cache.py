"""The KV cache: an immutable, fixed-capacity pytree.

Layout: one K and one V array per cache-owning layer, [B, S, K, Dh], slot s holding absolute position s, plus the
committed length per batch row. Per-layer arrays (a tuple, not one stacked array) let layers differ in K and Dh
(Gemma 4: 256-dim sliding vs 512-dim global heads); Gemma 4's shared-KV layers own no slot and read their donor's.

Sliding-window layers use the same full-length layout with a window mask, not a ring buffer. Why: a rewind of ANY
depth stays an O(1) length update (a ring of W + max_verify slots would bound the rewind depth and make every
rewind across the ring boundary a re-prefill), masks stay one comparison on slot indices, and every layer shares one
position->slot map. The price is memory: sliding layers keep S slots instead of ~W, i.e. ~S/W more KV memory on 5/6
of Gemma's layers (Gemma 3 270M at S = 4096: 18 layers x 2 x 4096 x 256 x 4 B = 151 MB in f32). A ring buffer is the
right trade once contexts reach tens of thousands of tokens; truncate() is the only function that would change.

Truncation is a length update: stale slots at positions >= length are never visible, because a step writes its rows
before attending and the causal mask hides every slot past the query's own position.

A step may compute only some of the rows: `on_rows(cache, rows)` hands the forward the cache with a row map (int32
[n], distinct row indices), and the forward's n step rows (tokens and positions [n, T]) then write and read cache
row rows[i] only; the other rows are untouched, and the cache comes back whole ([B] lengths, no map).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax import aot
from fucina_jax.errors import CacheMemoryError
from fucina_jax.models.config import ModelConfig

__all__ = ["KVCache", "fitted_capacity", "init_cache", "on_rows", "on_tree", "stepped", "truncate"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per kv slot: [B, S, K, Dh] keys after k-norm and RoPE
    v: tuple[jax.Array, ...]  # per kv slot: [B, S, K, Dh] values (after Gemma 4's value norm)
    length: jax.Array  # [B] int32: committed positions per row
    # int32 [n] or None: a forward over n step rows reads and writes cache row rows[i] for step row i (on_rows);
    # None: step row b is cache row b. Only a forward's input carries one.
    rows: jax.Array | None = None
    # int32 [n, T] or None: the forward's T rows are a tree verify (on_tree): bit m of tree[i, t] says step row t
    # sees step row m (its ancestors and itself); row t is in slot positions[i, 0] + t. Only a forward's input.
    tree: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


# Slots are allocated in multiples of this (as llama.cpp pads its KV cache): attention reads the cache in chunks
# (layers.attention), and a chunked capacity keeps every step on the row-exact chunked path.
SLOT_ALIGN = 16


# ModelConfig.cache_type -> the K/V arrays' dtype. fp16 halves the cache (llama.cpp's default); rows are written
# rounded to nearest even and read back widened exactly, on both paths (layers.write_kv, kernels.attention).
CACHE_DTYPES = {"f32": jnp.float32, "f16": jnp.float16}


def init_cache(cfg: ModelConfig, capacity: int, batch: int = 1, dtype=None) -> KVCache:
    """An empty cache of at least `capacity` slots (rounded up to a multiple of SLOT_ALIGN) for `batch` rows, of
    dtype (default: cfg.cache_type's)."""
    dtype = dtype or CACHE_DTYPES[cfg.cache_type]
    capacity = -(-capacity // SLOT_ALIGN) * SLOT_ALIGN
    shapes: dict[int, tuple[int, int]] = {}
    for spec in cfg.layers:
        if spec.writes_kv:
            shapes[spec.kv_slot] = (spec.n_kv_heads, spec.head_dim)
    n = cfg.n_kv_slots
    dtype = jnp.dtype(dtype)
    need = 2 * batch * capacity * dtype.itemsize * sum(h * d for h, d in shapes.values())
    free = _available_bytes()
    if free is not None and need > free:
        raise CacheMemoryError(_cache_message(need, free, capacity, batch, dtype))
    try:
        kv = _zeros(tuple((batch, capacity, *shapes[slot]) for slot in range(n)) * 2, dtype)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise CacheMemoryError(_cache_message(need, free, capacity, batch, dtype)) from None
    return KVCache(k=kv[:n], v=kv[n:], length=jax.device_put(np.zeros((batch,), np.int32)))


def _available_bytes() -> int | None:
    """MemAvailable + free swap from /proc/meminfo (None where there is none: the allocation itself then tells)."""
    try:
        with open("/proc/meminfo") as f:  # "MemAvailable:   23891264 kB"
            info = {key: int(rest.split()[0]) * 1024 for key, _, rest in (ln.partition(":") for ln in f)}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + info.get("SwapFree", 0)


def _cache_message(need: int, free: int | None, capacity: int, batch: int, dtype) -> str:
    have = f"; the machine has {free / 2**30:.1f} GiB available" if free is not None else ""
    half = " (--cache-type f16 / cache_type='f16' halves it)" if dtype == jnp.float32 else ""
    return (f"a KV cache of {capacity} positions x {batch} row(s) needs {need / 2**30:.1f} GiB of {dtype.name}"
            f"{half}{have}: use a smaller context (--ctx / ctx=) or fewer tokens to generate (--gen / max_tokens=)")


@aot.jit(static_argnames=("shapes", "dtype"))
def _zeros(shapes: tuple, dtype) -> tuple[jax.Array, ...]:
    """Zero arrays of these shapes in one compiled call (eager jnp.zeros would be two ops per shape, each a
    compile, or a compile-cache read, at start-up)."""
    return tuple(jnp.zeros(s, dtype) for s in shapes)


# fitted_capacity's smallest size: one attention chunk (layers.ATTN_CHUNK), so a fitted cache reads its slots in the
# same chunks as a full-context one.
FIT_MIN_SLOTS = 256


def fitted_capacity(n_positions: int, ctx: int) -> int:
    """Cache slots for a request whose positions never reach n_positions (prompt + max_tokens): the smallest
    FIT_MIN_SLOTS * 2^i holding them, never more than ctx.

    A one-shot generation sizes its cache to what it can use instead of the whole context (as mlx-lm grows its
    cache): Gemma 3 270M's full 4096-slot f32 cache is 151 MB, a 64-token answer to a short prompt needs 256 slots
    (9 MB). Powers of two keep the number of compiled cache shapes to a handful (each shape compiles its steps
    once). Attention reads only the chunks that hold visible slots, so the capacity never changes a row's value on
    the kernels' path; verify rows past the capacity are dropped by write_kv, exactly as at the end of a context.
    """
    if n_positions < 1 or ctx < 1:
        raise ValueError(f"n_positions = {n_positions} and ctx = {ctx}: both must be >= 1")
    cap = FIT_MIN_SLOTS
    while cap < n_positions:
        cap *= 2
    return min(cap, ctx)


def on_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache as a forward over the step rows `rows` (int32 [n], distinct rows of the cache) sees it."""
    return dataclasses.replace(cache, rows=rows)


def on_tree(cache: KVCache, tree: jax.Array) -> KVCache:
    """The cache as a tree verify's forward sees it: tree int32 [n, T], each step row's ancestor mask (self
    included; ancestors come first: bit m of row t is set only for m <= t)."""
    return dataclasses.replace(cache, tree=tree)


def stepped(cache: KVCache, ks, vs, positions: jax.Array) -> KVCache:
    """What a forward returns: the cache with its new per-slot arrays ks / vs, each stepped row's length just past
    its last slot (positions [n, T]; with a row map only the mapped rows' lengths move), and no row map or tree."""
    end = positions[:, -1] + 1 if cache.tree is None else positions[:, 0] + positions.shape[1]
    length = end if cache.rows is None else cache.length.at[cache.rows].set(end)
    return KVCache(k=tuple(ks), v=tuple(vs), length=length)


def truncate(cache: KVCache, n) -> KVCache:
    """The cache with its committed length set to n (scalar or [B]); O(1), no K/V data is touched."""
    if isinstance(n, jax.Array):  # a device value or a tracer (inside jit)
        n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), cache.length.shape)
    else:  # a host value: placed, not computed (an eager op would compile at start-up)
        n = jax.device_put(np.broadcast_to(np.asarray(n, np.int32), cache.length.shape).copy())
    return dataclasses.replace(cache, length=n)
