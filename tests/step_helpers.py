"""Helpers shared by the cache/step equivalence tests (test_forward.py, test_gemma4.py)."""

import jax.numpy as jnp
import numpy as np

from fucina_jax import engine


def decode_rows(model, ids, n_prefill, ctx=64):
    """Logits after each position: prefill ids[:n_prefill], then one decode step per remaining id."""
    cache = model.new_cache(ctx)
    last, cache = model.prefill(ids[:n_prefill], cache)
    rows = [np.asarray(last)]
    for t in ids[n_prefill:]:
        logits, cache = engine.decode_step(model.params, jnp.asarray([t], jnp.int32), cache, model.config)
        rows.append(np.asarray(logits[0]))
    return np.stack(rows), cache
