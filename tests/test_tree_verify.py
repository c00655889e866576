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


# ---- the model level ----------------------------------------------------------------------------------------------

import fucina_jax  # noqa: E402
from fucina_jax import engine  # noqa: E402
from fucina_jax.models import truncate  # noqa: E402
from fucina_jax.testing import write_fixture, write_gemma4_fixture  # noqa: E402

PROMPT = list(range(5, 27))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(kind, qtype) -> (model on the kernels, the same file on the f32 reference path)."""
    cache, root = {}, tmp_path_factory.mktemp("tree_fixtures")

    def get(kind: str, qtype: str):
        if (kind, qtype) not in cache:
            path = str(root / f"{kind}-{qtype}.gguf")
            if kind.startswith("gemma4"):
                write_gemma4_fixture(path, kind.partition("-")[2], qtype=qtype)
            else:
                write_fixture(path, kind, qtype=qtype)
            cache[kind, qtype] = (fucina_jax.load(path), fucina_jax.load(path, f32=True))
        return cache[kind, qtype]

    return get


def chain_last_rows(model, base_cache_fn, paths_tokens):
    """The logits plain decoding computes after each token list (after the cached prompt): a chain verify padded
    to its bucket, its row len - 1 (verify rows are decode rows, tests/test_forward.py)."""
    out = []
    for toks in paths_tokens:
        k = engine.bucket_for(max(len(toks), 2), engine.VERIFY_BUCKETS)
        padded = np.zeros((1, k), np.int32)
        padded[0, : len(toks)] = toks
        logits, _ = engine.verify_step(model.params, jnp.asarray(padded), base_cache_fn(), model.config)
        out.append(np.asarray(logits[0, len(toks) - 1]))
    return np.stack(out)


def tree_case(model, rng, k):
    parents = random_parents(rng, k)
    tokens = rng.integers(3, model.config.n_vocab, size=k).astype(np.int32)
    if k >= 4:  # a duplicated token among siblings and a token repeated down a path
        kids = [t for t in range(1, k) if parents[t] == 0]
        if len(kids) >= 2:
            tokens[kids[1]] = tokens[kids[0]]
        tokens[k - 1] = tokens[parents[k - 1]]
    return parents, tokens


def prompt_cache(model, capacity=256):
    _, cache = model.prefill(np.asarray(PROMPT, np.int32), model.new_cache(capacity))
    return cache


@needs_kernels
@pytest.mark.parametrize("kind, qtype", [("qwen3", "Q4_1"), ("gemma3", "F32"), ("gemma4-e2b", "Q8_0"),
                                         ("qwen3moe", "Q8_0")])
def test_tree_rows_are_plain_rows_bitwise(models, kind, qtype):
    """Every row of random trees at every verify width: bitwise the logits plain decoding computes after that row's
    path (kernels); the f32 reference path within rounding, with the same argmax."""
    fast, ref = models(kind, qtype)
    rng = np.random.default_rng(hash(kind) % 1000)
    for model, exact in ((fast, True), (ref, False)):
        for k in engine.VERIFY_BUCKETS:
            parents, tokens = tree_case(model, rng, k)
            logits, cache = engine.tree_verify_step(model.params, jnp.asarray(tokens[None]),
                                                    jnp.asarray(parents[None]), prompt_cache(model), model.config)
            assert int(cache.length[0]) == len(PROMPT) + k
            got = np.asarray(logits[0])
            want = chain_last_rows(model, lambda: prompt_cache(model),
                                   [tokens[path_of(parents, t)] for t in range(k)])
            if exact:
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
                assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_kernels
@pytest.mark.parametrize("kind, qtype", [("qwen3", "Q4_1"), ("gemma4-e2b", "Q8_0")])
def test_compaction_equals_a_fresh_prefill_of_the_path(models, kind, qtype):
    """After a tree verify, compact_step on an accepted path (a deep leaf's, off the first chain) gives the cache a
    fresh prefill of prompt + path has, slot for slot, and the next decode step's logits are bitwise the same."""
    fast, _ = models(kind, qtype)
    rng = np.random.default_rng(5)
    for k in (4, 8, 16):
        parents, tokens = tree_case(fast, rng, k)
        parents[1:] = np.minimum(parents[1:], np.arange(k - 1))  # keep it a tree; make a deep path likely
        leaf = max(range(k), key=lambda t: (len(path_of(parents, t)), t))
        path = path_of(parents, leaf)  # rows, root first
        n0 = len(PROMPT)
        _, cache = engine.tree_verify_step(fast.params, jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
                                           prompt_cache(fast), fast.config)
        moves = np.full((1, engine.COMPACT_SLOTS), -1, np.int32)
        moves[0, : len(path) - 1] = path[1:]
        cache = truncate(engine.compact_step(cache, np.asarray([n0], np.int32), moves), n0 + len(path))
        fresh = fast.new_cache(256)
        _, fresh = fast.prefill(np.asarray(PROMPT + tokens[path].tolist(), np.int32), fresh)
        n = n0 + len(path)
        for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
            np.testing.assert_array_equal(np.asarray(a)[0, :n], np.asarray(b)[0, :n])
        nxt = jnp.asarray([7], jnp.int32)
        la, _ = engine.decode_step(fast.params, nxt, cache, fast.config)
        lb, _ = engine.decode_step(fast.params, nxt, fresh, fast.config)
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
        if path != list(range(len(path))):  # a path off the first chain: without the move it would differ
            _, raw = engine.tree_verify_step(fast.params, jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
                                             prompt_cache(fast), fast.config)
            lc, _ = engine.decode_step(fast.params, nxt, truncate(raw, n), fast.config)
            assert not np.array_equal(np.asarray(lc), np.asarray(lb))


def test_tree_layout_and_paths_match_the_definition():
    rng = np.random.default_rng(9)
    for k in (2, 4, 8, 16):
        parents = np.stack([random_parents(rng, k) for _ in range(3)])
        tokens = rng.integers(0, 1000, size=(3, k)).astype(np.int32)
        masks, depth = (np.asarray(x) for x in engine.tree_layout(jnp.asarray(parents)))
        paths = np.asarray(engine.tree_paths(jnp.asarray(tokens), jnp.asarray(masks), jnp.asarray(depth)))
        for b in range(3):
            m, d = layout(parents[b])
            np.testing.assert_array_equal(masks[b], m)
            np.testing.assert_array_equal(depth[b], d)
            for t in range(k):
                want = tokens[b, path_of(parents[b], t)[1:]].tolist()
                assert paths[b, t].tolist() == want + [-1] * (k - 1 - len(want))
    chain = np.arange(-1, 7, dtype=np.int32)[None]
    masks, depth = engine.tree_layout(jnp.asarray(chain))
    assert np.asarray(masks)[0].tolist() == [2 ** (t + 1) - 1 for t in range(8)]
    assert np.asarray(depth)[0].tolist() == list(range(8))
