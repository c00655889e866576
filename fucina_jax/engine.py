"""The jit boundary: the few compiled step functions every loop in fucina_jax calls.

Where does compilation happen? Here, and only here: one compiled program per (step, bucket shape, config), kept
across processes by `aot.jit` (a warm start loads it: no trace, no compile).
Every traced shape comes from the declared buckets below; per-call values (cache length, number of valid rows) are
arrays, never static arguments, so a new prompt length or a longer history never recompiles.

  prefill_step  [B, T in PREFILL_BUCKETS]   -> logits of each row's last valid token [B, V]
  decode_step   [B, 1]                       -> logits [B, V]
  verify_step   [B, k in VERIFY_BUCKETS]     -> logits of every row [B, k, V]

Each step writes its rows into the cache and returns it with `length` advanced by the rows the caller declared
valid (prefill) or by all rows (decode/verify); the speculative decoder truncates to what it commits. The cache
argument is donated: the caller must use the returned cache.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from fucina_jax import aot
from fucina_jax.models import forward_hidden, truncate, unembed
from fucina_jax.models.cache import KVCache
from fucina_jax.models.config import ModelConfig

__all__ = [
    "PREFILL_BUCKETS",
    "VERIFY_BUCKETS",
    "TRACE_COUNTS",
    "bucket_for",
    "prefill_step",
    "decode_step",
    "verify_step",
]

# Prompt chunks: a prompt is prefilled in chunks of the largest bucket; the last chunk is padded to the smallest
# bucket that holds it. Three shapes keep compile time bounded while a short chat turn pays for <= 16 padded rows.
PREFILL_BUCKETS = (16, 64, 256)
# Verify widths (carried token + draft), padded up to the next bucket.
VERIFY_BUCKETS = (2, 4, 8, 16)

# Incremented at trace time only: tests assert nothing recompiles inside a bucket.
TRACE_COUNTS: collections.Counter = collections.Counter()


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n (n must not exceed the largest)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


def _positions(cache: KVCache, T: int) -> jax.Array:
    return cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_step(params, tokens: jax.Array, n_valid: jax.Array, cache: KVCache, cfg: ModelConfig):
    """Prefill one padded chunk; tokens [B, T], n_valid [B] (>= 1). Only the last valid row is unembedded:
    computing [T, V] logits for a whole chunk would cost more than the chunk's transformer layers."""
    TRACE_COUNTS["prefill", tokens.shape] += 1
    B, T = tokens.shape
    start = cache.length
    h, cache = forward_hidden(params, tokens, _positions(cache, T), cache, cfg)
    last = h[jnp.arange(B), n_valid - 1]
    return unembed(params, last, cfg), truncate(cache, start + n_valid)


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, tokens: jax.Array, cache: KVCache, cfg: ModelConfig):
    """One token per row; tokens [B]."""
    TRACE_COUNTS["decode", tokens.shape] += 1
    h, cache = forward_hidden(params, tokens[:, None], _positions(cache, 1), cache, cfg)
    return unembed(params, h[:, 0], cfg), cache


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def verify_step(params, tokens: jax.Array, cache: KVCache, cfg: ModelConfig):
    """Logits of every row of tokens [B, k]; the cache comes back advanced by k (truncate to what you commit:
    rows past the committed length are stale and never visible after truncation)."""
    TRACE_COUNTS["verify", tokens.shape] += 1
    h, cache = forward_hidden(params, tokens, _positions(cache, tokens.shape[1]), cache, cfg)
    return unembed(params, h, cfg), cache


@aot.jit(static_argnames=("cfg", "cap"), donate_argnames=("cache",))
def decode_sample_step(params, tokens: jax.Array, cache: KVCache, history, sparams, cfg: ModelConfig, cap: int):
    """decode_step fused with the sampler: append tokens [1] and pick the next token.

    The picked token's absolute stream position is the cache length after the append: the counter its random
    draw is keyed on (sampling.position_uniform). Returns (token int32 [1], cache, history with the token pushed).
    """
    from fucina_jax import sampling

    TRACE_COUNTS["decode_sample", tokens.shape, cap] += 1
    h, cache = forward_hidden(params, tokens[:, None], _positions(cache, 1), cache, cfg)
    logits = unembed(params, h[:, 0], cfg)
    tok = sampling.sample_rows(logits, cache.length, history, None, sparams, cap=cap)
    return tok, cache, sampling.push_history(history, tok, jnp.int32(1))
