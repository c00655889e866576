"""The speculative decoder's one compiled step: verify a draft and sample every row, fused.

  verify_sample_step  tokens [1, k in VERIFY_BUCKETS] = [carried token, draft..., padding]
                      -> sampled [k], (logits [k, V]), (top-K ids [k, TOPK_FEEDBACK]), cache advanced by k

Row i holds the logits after the carried token and the first i draft tokens, so it predicts the token at stream
position base + i (base = the committed stream length = cache length + 1). It is sampled through the full pipeline
at exactly that position (the RNG is keyed on the position) and penalised with the committed history plus
drafts[:i]: the hypothetical prefix its logits are conditioned on (design record section 2, obligations 1 and 3).
Every row is sampled, the host keeps the longest prefix that matches the draft; a row past the first mismatch was
drawn from a counter-based RNG, so discarding it consumes nothing a plain run would see.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from fucina_jax import aot, sampling
from fucina_jax.models import forward_hidden, unembed
from fucina_jax.models.cache import KVCache
from fucina_jax.models.config import ModelConfig

__all__ = ["TOPK_FEEDBACK", "TRACE_COUNTS", "feedback_topk", "verify_sample_step"]

# Candidates per verified row handed to DraftSource.observe_topk (the recycling matrix keeps 8 per token).
TOPK_FEEDBACK = 8

# Incremented at trace time only: tests assert nothing recompiles inside a bucket.
TRACE_COUNTS: collections.Counter = collections.Counter()


@aot.jit(
    static_argnames=("cfg", "cap", "wants_topk", "with_logits"), donate_argnames=("cache",)
)
def verify_sample_step(
    params,
    tokens: jax.Array,
    drafts: jax.Array,
    cache: KVCache,
    history: sampling.History,
    sparams: sampling.SamplerParams,
    cfg: ModelConfig,
    cap: int,
    wants_topk: bool = False,
    with_logits: bool = False,
):
    """One verify forward over tokens [1, k] plus the sampler on every row.

    drafts int32 [k]: drafts[i] is the token row i is checked against (tokens[0, i + 1]), -1 past the draft (a
    -1 never enters a penalty window). Returns (sampled int32 [k], logits [k, V] or None, top-K ids int32
    [k, TOPK_FEEDBACK] or None, cache). The cache comes back advanced by k: the caller truncates it to what it
    commits. `wants_topk` and `with_logits` are static so neither the top-K nor the logits output is traced
    unless asked for (the logits are for the verify-row hook, a test/debug instrument).
    """
    k = tokens.shape[1]
    TRACE_COUNTS["verify_sample", tokens.shape, cap, wants_topk, with_logits] += 1
    in_pos = cache.length[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    h, cache = forward_hidden(params, tokens, in_pos, cache, cfg)
    logits = unembed(params, h[0], cfg)  # [k, V]
    # Row i's token lands at stream position (input position + 1): the plain loop's position for the same prefix.
    sampled = sampling.sample_rows(logits, in_pos[0] + 1, history, drafts, sparams, cap=cap)
    topk = feedback_topk(logits) if wants_topk else None
    return sampled, (logits if with_logits else None), topk, cache


def feedback_topk(logits: jax.Array) -> jax.Array:
    """The recycling candidates of each verified row, int32 [..., TOPK_FEEDBACK]: taken from the raw rows (before
    penalties), as the design record specifies."""
    return sampling.top_k(logits, min(TOPK_FEEDBACK, logits.shape[-1]))[1].astype(jnp.int32)
