"""engine.decode_sample_rows_step: a decoder step over n of the cache's B rows (rows [n], a random map).

For every mapped row, on the kernels' path (quantized fixtures: Gemma 3 with sliding layers, Gemma 4 E2B with PLE
and shared-KV layers) and on the f32 reference path, against the same row stepped alone (decode_sample_step at
B = 1 over a copy of that row's cache):
- the samples, the logits and the top-K rows are bitwise the lone run's (on the f32 path, whose XLA products are
  not row-exact across batch sizes, bitwise those of the identity-map step over the same n rows, and close to the
  lone run's);
- the row's K/V slots and length after the step are the lone run's;
- the cache rows not in the map keep every slot and their length;
- the history comes back with every row's pending samples pushed (the ones outside the map too).
n is a bucket of the active rows (1, 2, 3 -> 4: padding rows are distinct rows too), B is 4 or 8, the widths 1 and 4
(a verify with drafts); rows carry different prompts, lengths, samplers and pending pushes, so a row mixed up with
another cannot pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fucina_jax
from fucina_jax import engine, kernels, sampling
from fucina_jax.sampling import SamplerConfig
from fucina_jax.testing import write_fixture, write_gemma4_fixture

CTX = 64
N = engine.STEP_WIDTHS[-1]
WINDOW = 64  # the history window (a static shape)
CAP = 32  # the widest candidate cap of the samplers (top_k 20 -> 32); any cap gives the same tokens


def sampler(b: int) -> SamplerConfig:
    """Row b's sampler: every row its own (greedy with its own penalty, or sampled with its own seed and values)."""
    if b % 4 == 0:
        return SamplerConfig(temperature=0.0, repeat_penalty=1.0 + 0.5 * b, repeat_last_n=64, seed=0)
    return SamplerConfig(temperature=0.6 + 0.1 * b, top_k=20, repeat_penalty=1.2, presence_penalty=0.1 * b,
                         repeat_last_n=64, seed=100 + b)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(path_kind, kind) -> a loaded fixture: "kernels" (Q8_0 weights on the kernels) or "f32"."""
    root = tmp_path_factory.mktemp("rows_fixtures")
    paths, loaded = {}, {}

    def get(path_kind: str, kind: str):
        if kind not in paths:
            path = str(root / f"{kind}.gguf")
            if kind.startswith("gemma4"):
                write_gemma4_fixture(path, kind.partition("-")[2], qtype="Q8_0")
            else:
                write_fixture(path, kind, qtype="Q8_0")
            paths[kind] = path
        if (path_kind, kind) not in loaded:
            loaded[path_kind, kind] = fucina_jax.load(paths[kind], f32=path_kind == "f32")
        return loaded[path_kind, kind]

    return get


def stack(trees):
    return jax.device_put(jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees))


def host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x).copy(), tree)


def take(tree, sel):
    """Rows sel of a host pytree with a leading batch axis, as a device pytree."""
    sel = np.asarray(sel)
    return jax.device_put(jax.tree_util.tree_map(lambda x: np.asarray(x)[sel], tree))


def batch_state(model, B: int, rng):
    """A B-row cache holding different prompts (lengths 5..29), each row's history (its prompt) and sampler
    values, and pending samples for every row (0..3 of each row's committed, as a previous step leaves them)."""
    V = model.config.n_vocab
    prompts = [rng.integers(0, V, int(rng.integers(5, 30))).astype(np.int32) for _ in range(B)]
    cache = model.new_cache(CTX, batch=B)
    _, cache = engine.prefill(model.params, model.config, prompts, cache)
    history = stack([sampling.history_from_tokens(p.tolist(), WINDOW) for p in prompts])
    sparams = stack([sampler(b).params() for b in range(B)])
    pushed = rng.integers(0, V, (B, N)).astype(np.int32)
    n_pushed = rng.integers(0, 4, B).astype(np.int32)
    return host(cache), host(history), pushed, n_pushed, host(sparams), np.array([len(p) for p in prompts], np.int32)


def rows_call(model, toks, drafts, rows, start, cache, history, pushed, n_pushed, sparams, k):
    return engine.decode_sample_rows_step(
        model.params, toks, drafts, rows, start, jax.device_put(cache), jax.device_put(history), pushed, n_pushed,
        jax.device_put(sparams), model.config, CAP, wants_topk=k > 1, with_logits=True)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("n_active", [1, 2, 3])
@pytest.mark.parametrize("B", [4, 8])
@pytest.mark.parametrize("path_kind, kind", [("kernels", "gemma3"), ("kernels", "gemma4-e2b"), ("f32", "gemma3"),
                                             ("f32", "gemma4-e2b")])
def test_each_mapped_row_is_its_row_stepped_alone(models, path_kind, kind, B, n_active, k):
    model = models(path_kind, kind)
    assert model.config.kernels == (path_kind == "kernels")
    if path_kind == "kernels":
        assert kernels.available()
    rng = np.random.default_rng(1000 * B + 10 * n_active + k)
    cache, history, pushed, n_pushed, sparams, lengths = batch_state(model, B, rng)
    n = engine.row_bucket(n_active, B)
    assert n == (4 if n_active == 3 else n_active)
    rows = rng.permutation(B)[:n].astype(np.int32)
    if n > 1 and (np.diff(rows) > 0).all():
        rows = rows[::-1].copy()  # never in order: a step row that read cache row rows[sorted i] would pass
    V = model.config.n_vocab
    toks = rng.integers(0, V, (n, k)).astype(np.int32)
    drafts = np.full((n, k), -1, np.int32)
    drafts[:, : k - 1] = toks[:, 1:]  # a verify: row (i, j) is checked against token j + 1
    start = lengths[rows] - 1 - rng.integers(0, 3, n).astype(np.int32)  # some rows rewind (rejected drafts)

    sampled, hist_out, logits, topk, out = rows_call(model, toks, drafts, rows, start, cache, history, pushed,
                                                     n_pushed, sparams, k)
    sampled, logits, out, hist_out = np.asarray(sampled), np.asarray(logits), host(out), host(hist_out)
    assert sampled.shape == (n, N) and logits.shape == (n, k, V)
    assert out.length.shape == (B,) and out.rows is None

    # every row's pending samples were pushed, mapped or not
    want_hist = host(engine.push_rows(jax.device_put(history), pushed, n_pushed))
    for a, b in zip(hist_out, want_hist):
        np.testing.assert_array_equal(a, b)

    def plain(sel, i):  # decode_sample_step over the cache rows `sel` alone (the step rows i), identity map
        return host(engine.decode_sample_step(
            model.params, toks[i], drafts[i], start[i], take(cache, sel), take(history, sel), pushed[sel],
            n_pushed[sel], take(sparams, sel), model.config, CAP, wants_topk=k > 1, with_logits=True))

    # The kernels are row-exact: each mapped row is its row stepped alone (B = 1), bit for bit. The f32 reference
    # path is not (XLA's f32 products at batch 1 and 2 round apart, row map or not): there each row is bitwise the
    # identity-map step over the same n rows, and close to the row alone.
    exact_alone = model.config.kernels or n == 1
    ref_n = None if exact_alone else plain(rows, np.arange(n))
    for i, b in enumerate(rows):
        a_sampled, _, a_logits, a_topk, a_cache = plain(rows[i : i + 1], slice(i, i + 1))
        assert out.length[b] == a_cache.length[0] == start[i] + k
        if ref_n is not None:
            np.testing.assert_allclose(logits[i], a_logits[0], rtol=1e-4, atol=1e-4)
            a_sampled, a_logits, a_topk = (None if x is None else x[i : i + 1] for x in ref_n[0:1] + ref_n[2:4])
            a_cache = take(ref_n[4], [i])
        np.testing.assert_array_equal(sampled[i], a_sampled[0])
        np.testing.assert_array_equal(logits[i], a_logits[0])
        if k > 1:
            np.testing.assert_array_equal(np.asarray(topk)[i], a_topk[0])
        for got, want in zip(out.k + out.v, a_cache.k + a_cache.v):
            np.testing.assert_array_equal(got[b], np.asarray(want)[0])
    untouched = np.setdiff1d(np.arange(B), rows)
    np.testing.assert_array_equal(out.length[untouched], cache.length[untouched])
    for got, before in zip(out.k + out.v, cache.k + cache.v):
        np.testing.assert_array_equal(got[untouched], before[untouched])
    # the step did write the mapped rows, and the sampled tokens vary across rows (no row reads another's state)
    assert any(not np.array_equal(got[rows], before[rows]) for got, before in zip(out.k, cache.k))


@pytest.mark.parametrize("path_kind", ["kernels", "f32"])
def test_identity_map_is_decode_sample_step(models, path_kind):
    """rows = arange(B), the map of a full batch: the rows step is the plain step, bit for bit (the history too)."""
    model = models(path_kind, "gemma3")
    B, k = 4, 4
    rng = np.random.default_rng(5)
    cache, history, pushed, n_pushed, sparams, lengths = batch_state(model, B, rng)
    toks = rng.integers(0, model.config.n_vocab, (B, k)).astype(np.int32)
    drafts = np.concatenate([toks[:, 1:], np.full((B, 1), -1, np.int32)], axis=1)
    start = lengths - 1
    got = rows_call(model, toks, drafts, np.arange(B, dtype=np.int32), start, cache, history, pushed, n_pushed,
                    sparams, k)
    want = engine.decode_sample_step(model.params, toks, drafts, start, jax.device_put(cache),
                                     jax.device_put(history), pushed, n_pushed, jax.device_put(sparams),
                                     model.config, CAP, wants_topk=True, with_logits=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("path_kind", ["kernels", "f32"])
def test_the_cache_is_updated_in_place(models, path_kind):
    """The donated cache's K/V buffers come back as the step's result (XLA aliases them through the kernels, and
    through the scatter on the f32 path): no copy of the [B, S, K, Dh] caches per step."""
    model = models(path_kind, "gemma3")
    B = 8
    rng = np.random.default_rng(7)
    cache, history, pushed, n_pushed, sparams, lengths = batch_state(model, B, rng)
    # buffers XLA owns, as the decoder's are (a device_put NumPy array may stay the NumPy memory: not donatable)
    dev = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t))(jax.device_put(cache))
    before = [x.unsafe_buffer_pointer() for x in dev.k + dev.v]
    rows = np.array([5], np.int32)
    out = engine.decode_sample_rows_step(model.params, np.zeros((1, 1), np.int32), np.full((1, 1), -1, np.int32),
                                         rows, lengths[rows] - 1, dev, jax.device_put(history), pushed, n_pushed,
                                         jax.device_put(sparams), model.config, CAP)[-1]
    assert [x.unsafe_buffer_pointer() for x in out.k + out.v] == before


def test_row_bucket():
    assert [engine.row_bucket(a, 8) for a in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [engine.row_bucket(a, 3) for a in range(1, 4)] == [1, 2, 3]
    assert [engine.row_bucket(a, 6) for a in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert engine.row_bucket(1, 1) == 1
