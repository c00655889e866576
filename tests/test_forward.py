"""Cache and step equivalences on tiny fixtures: cached == uncached, verify rows == decode rows, truncate + re-append
== fresh (bitwise), and no recompilation inside a bucket.

XLA's f32 dot sums in an order that depends on the number of rows (m-dependent blocking), so a row computed inside a
k-row verify can differ from the same row computed alone in the last bits: those comparisons use a tolerance of 1e-4
(measured max ~1e-5 on these fixtures) and print the measured difference. Comparisons between identical op
sequences (truncate + re-append vs fresh) are bitwise.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax import aot, engine
from fucina_jax.models import truncate
from step_helpers import decode_rows

KINDS = ["qwen3", "gemma3", "llama", "qwen3moe"]
ROW_TOL = 1e-4


def ids_for(model, n, seed=0):
    return np.random.default_rng(seed).integers(0, 260, n).astype(np.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_equals_full_forward(kind, fixture_path, load_model):
    model = load_model(fixture_path(kind))
    ids = ids_for(model, 40)  # gemma3 fixture window is 8: decoding crosses the window many times
    full = model.logits(ids)
    for n_prefill in (1, 11, 17):
        rows, cache = decode_rows(model, ids, n_prefill)
        diff = np.abs(rows - full[n_prefill - 1 :]).max()
        print(f"{kind} prefill {n_prefill}: max |cached - full| = {diff:.2e}")
        assert diff < ROW_TOL
        assert (rows.argmax(-1) == full[n_prefill - 1 :].argmax(-1)).all()
        assert int(cache.length[0]) == len(ids)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
@pytest.mark.parametrize("k", engine.VERIFY_BUCKETS)
def test_verify_rows_equal_decode_rows(kind, k, fixture_path, load_model):
    model = load_model(fixture_path(kind))
    ids = ids_for(model, 30, seed=k)
    start = 13
    dec, _ = decode_rows(model, ids[: start + k], start)
    cache = model.new_cache(64)
    _, cache = model.prefill(ids[:start], cache)
    ver, cache = engine.verify_step(model.params, jnp.asarray(ids[None, start : start + k]), cache, model.config)
    ver = np.asarray(ver[0])
    diff = np.abs(ver - dec[1:]).max()
    print(f"{kind} k={k}: max |verify row - decode row| = {diff:.2e}")
    assert diff < ROW_TOL
    assert int(cache.length[0]) == start + k


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_padded_verify_rows_never_leak(kind, fixture_path, load_model):
    """A verify padded with junk rows, truncated to the valid rows, continues exactly like an unpadded run."""
    model = load_model(fixture_path(kind))
    ids = ids_for(model, 24, seed=3)
    ref, _ = decode_rows(model, ids, 12)
    cache = model.new_cache(64)
    _, cache = model.prefill(ids[:10], cache)
    padded = np.concatenate([ids[10:12], np.full(6, 7, np.int32)])  # 2 real rows + 6 padding rows
    _, cache = engine.verify_step(model.params, jnp.asarray(padded[None]), cache, model.config)
    cache = truncate(cache, 12)
    rows = []
    for t in ids[12:]:
        logits, cache = engine.decode_step(model.params, jnp.asarray([t]), cache, model.config)
        rows.append(np.asarray(logits[0]))
    assert np.abs(np.stack(rows) - ref[1:]).max() < ROW_TOL


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_truncate_then_reappend_is_bitwise_fresh(kind, fixture_path, load_model):
    """Rewind across the sliding window (gemma3 fixture: window 8) and re-append: same cache bits, same logits."""
    model = load_model(fixture_path(kind))
    ids = ids_for(model, 36, seed=5)

    def run(detour: bool):
        cache = model.new_cache(64)
        _, cache = model.prefill(ids[:20], cache)
        if detour:
            junk = jnp.asarray(np.arange(100, 116, dtype=np.int32)[None])
            for _ in range(2):  # two rejected 16-wide verifies, then a rewind deeper than the window
                _, cache = engine.verify_step(model.params, junk, cache, model.config)
            cache = truncate(cache, 20)
        rows = []
        for t in ids[20:]:
            logits, cache = engine.decode_step(model.params, jnp.asarray([t]), cache, model.config)
            rows.append(np.asarray(logits[0]))
        return np.stack(rows), cache

    fresh_rows, fresh = run(False)
    rows, cache = run(True)
    np.testing.assert_array_equal(rows, fresh_rows)
    n = len(ids)
    for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
        np.testing.assert_array_equal(np.asarray(a)[:, :n], np.asarray(b)[:, :n])
    assert int(cache.length[0]) == n


def test_truncate_is_a_length_update(fixture_path, load_model):
    model = load_model(fixture_path("qwen3"))
    cache = model.new_cache(32)
    _, cache = model.prefill(ids_for(model, 9), cache)
    cut = truncate(cache, 4)
    assert int(cut.length[0]) == 4
    assert all(a is b for a, b in zip(cut.k + cut.v, cache.k + cache.v))  # no K/V array touched


def test_no_recompilation_within_a_bucket(fixture_path, load_model):
    model = load_model(fixture_path("qwen3"))
    ids = ids_for(model, 60)

    def snapshot():
        return dict(aot.TRACED), dict(aot.LOADED)  # a program loaded from disk is not traced

    cache = model.new_cache(128)
    _, cache = model.prefill(ids[:3], cache)  # warm every shape used below
    logits, cache = engine.decode_step(model.params, jnp.asarray([1]), cache, model.config)
    _, cache = engine.verify_step(model.params, jnp.asarray(ids[None, :4]), cache, model.config)
    before = snapshot()
    for n in (5, 9, 16, 1):  # different prompt lengths in the 16 bucket, on fresh caches and a used one
        c = model.new_cache(128)
        _, c = model.prefill(ids[:n], c)
        for t in ids[:7]:
            _, c = engine.decode_step(model.params, jnp.asarray([t]), c, model.config)
        for s in (0, 4, 8):
            _, c = engine.verify_step(model.params, jnp.asarray(ids[None, s : s + 4]), c, model.config)
            c = truncate(c, int(c.length[0]) - 2)
    assert snapshot() == before
    # and a shape outside the buckets does compile (the counter is live); (2, 5) is used by no loop or other test
    c = model.new_cache(128, batch=2)
    _, c = engine.verify_step(model.params, jnp.asarray(np.stack([ids[:5], ids[5:10]])), c, model.config)
    assert snapshot() != before


def test_context_full_is_a_clear_error(fixture_path, load_model):
    from fucina_jax.errors import ContextFullError

    model = load_model(fixture_path("qwen3"))
    with pytest.raises(ContextFullError, match="context"):
        model.prefill(ids_for(model, 40), model.new_cache(32))
