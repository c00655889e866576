"""Tree verification: a verify's rows form a tree, and every row is computed exactly as plain decoding computes
its own prefix.

The attention level (kernels and the pure-JAX reference), the model level (every verify bucket, random tree
shapes, against decode rows), the cache compaction to an accepted path (== a fresh prefill of it), the sampler's
per-row penalty windows, the accept rule over a tree, and the decoder with adversarial trees (== plain decoding,
greedy and sampled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax import kernels
from fucina_jax.models import layers

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


def random_parents(rng, T: int) -> np.ndarray:
    """A random tree over T rows in topological order: row 0 is the root (-1), row t's parent is below t."""
    return np.array([-1] + [int(rng.integers(0, t)) for t in range(1, T)], np.int32)


def layout(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ancestor masks, depths) of a parents vector, from the definition (an independent reference of
    engine.tree_layout)."""
    T = len(parents)
    masks, depth = np.zeros(T, np.int64), np.zeros(T, np.int32)
    for t in range(T):
        p = parents[t]
        masks[t] = (1 << t) | (masks[p] if p >= 0 else 0)
        depth[t] = depth[p] + 1 if p >= 0 else 0
    return masks.astype(np.int32), depth


def path_of(parents: np.ndarray, t: int) -> list[int]:
    """The rows from the root to t."""
    out = [t]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


def attention_cases(rng, T, L, S, K, Dh, H, dtype):
    q = rng.standard_normal((1, T, H, Dh)).astype(np.float32)
    k_new = rng.standard_normal((1, T, K, Dh)).astype(np.float32)
    v_new = rng.standard_normal((1, T, K, Dh)).astype(np.float32)
    kc = rng.standard_normal((1, S, K, Dh)).astype(dtype)  # slots >= L are stale junk a row must never see
    vc = rng.standard_normal((1, S, K, Dh)).astype(dtype)
    return q, k_new, v_new, kc, vc


@needs_kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 3, 8])
def test_tree_attention_rows_are_their_chains_rows_bitwise(dtype, window):
    """Every row of a random tree (attention_write over the tree) is bitwise the last row of a chain verify of its
    own path written contiguously after the same cache, over random trees of every width; the reference path
    agrees within float rounding; stale slots past the root never leak."""
    rng = np.random.default_rng(31)
    H, K, Dh, S, L = 4, 2, 48, 96, 37
    tree_att = jax.jit(lambda *a: kernels.attention_write(*a[:6], 0.3, window, tree=a[6]))
    chain_att = jax.jit(lambda *a: kernels.attention_write(*a, 0.3, window))
    ref_att = jax.jit(lambda q, kc, vc, pos, tree: layers.attention(q, kc, vc, pos, 0.3, window, tree=tree))
    for T in (2, 4, 8, 16):
        for _ in range(3):
            parents = random_parents(rng, T)
            masks, depth = layout(parents)
            q, k_new, v_new, kc, vc = attention_cases(rng, T, L, S, K, Dh, H, dtype)
            pos = (L + depth)[None].astype(np.int32)
            out, kt, vt = (np.asarray(x) for x in tree_att(q, k_new, v_new, kc, vc, pos, masks[None]))
            # the rows landed at slot L + t, whatever their depth
            np.testing.assert_array_equal(kt[0, L : L + T], k_new[0].astype(dtype))
            ref = np.asarray(ref_att(q, kt, vt, pos, masks[None]))
            np.testing.assert_allclose(ref, out, rtol=2e-5, atol=2e-5)
            for t in range(T):
                p = path_of(parents, t)
                sel = np.asarray(p)
                cpos = (L + np.arange(len(p)))[None].astype(np.int32)
                want = np.asarray(chain_att(q[:, sel], k_new[:, sel], v_new[:, sel], kc, vc, cpos)[0])
                np.testing.assert_array_equal(out[0, t], want[0, -1])
            # the tree changes what a row sees: a row with a sibling-only neighbour differs from the chain layout
            if any(parents[t] != t - 1 for t in range(1, T)):
                chain = np.asarray(chain_att(q, k_new, v_new, kc, vc, (L + np.arange(T))[None].astype(np.int32))[0])
                assert not np.array_equal(chain, out)


@needs_kernels
def test_tree_masks_are_checked():
    rng = np.random.default_rng(3)
    q, k_new, v_new, kc, vc = attention_cases(rng, 4, 10, 32, 1, 16, 2, np.float32)
    pos = np.array([[10, 11, 11, 12]], np.int32)
    att = jax.jit(lambda *a: kernels.attention_write(*a[:6], 0.3, 0, tree=a[6]))
    np.asarray(att(q, k_new, v_new, kc, vc, pos, np.asarray([[1, 3, 5, 9]], np.int32))[0])  # a valid tree
    # row 2 blind to itself; row 1 sees row 2; row 3 sees a row past the step
    for bad in ([1, 3, 1, 9], [1, 7, 5, 9], [1, 3, 5, 9 | 16]):
        with pytest.raises(Exception, match="tree row"):
            np.asarray(att(q, k_new, v_new, kc, vc, pos, np.asarray([bad], np.int32))[0])
