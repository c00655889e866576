"""The NumPy reference and the JAX pipeline against llama.cpp's own samplers (llama-cpp-python's C API, no model
needed): survivors of penalties -> top-k -> top-p -> min-p, the probabilities dist samples from, and greedy.

Rows are random float32 logits without exact ties, where llama.cpp's order is fully specified."""

from __future__ import annotations

import ctypes
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax.sampling import (SamplerConfig, filter_mask, history_from_tokens, penalize, row_windows, sample_rows,
                                 token_probs)

from test_sampling import R, V, W, cfg_with, ref_kept

llama_cpp = pytest.importorskip("llama_cpp")


def llama_chain(cfg: SamplerConfig, stream, with_dist: bool):
    """llama.cpp's default chain for our samplers (common/sampling.cpp order), history accepted token by token."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)
    add(llama_cpp.llama_sampler_init_penalties(V, cfg.repeat_last_n, cfg.repeat_penalty, cfg.frequency_penalty,
                                               cfg.presence_penalty))
    add(llama_cpp.llama_sampler_init_top_k(cfg.top_k))
    add(llama_cpp.llama_sampler_init_top_p(cfg.top_p, cfg.min_keep))
    add(llama_cpp.llama_sampler_init_min_p(cfg.min_p, cfg.min_keep))
    add(llama_cpp.llama_sampler_init_temp(cfg.temperature))
    if with_dist:
        add(llama_cpp.llama_sampler_init_dist(1234))
    for t in stream:
        llama_cpp.llama_sampler_accept(chain, int(t))
    return chain


def llama_apply(cfg: SamplerConfig, stream, row: np.ndarray, with_dist: bool = False):
    """Run the chain on one row; returns (ids, logits, p) of the survivors in llama.cpp's order, and the selected id."""
    chain = llama_chain(cfg, stream, with_dist)
    try:
        data = (llama_cpp.llama_token_data * V)()
        for i in range(V):
            data[i].id, data[i].logit, data[i].p = i, float(row[i]), 0.0
        arr = llama_cpp.llama_token_data_array(data=ctypes.cast(data, llama_cpp.llama_token_data_p), size=V,
                                               selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        out = [(arr.data[i].id, arr.data[i].logit, arr.data[i].p) for i in range(arr.size)]
        selected = arr.data[arr.selected].id if arr.selected >= 0 else None
        return out, selected
    finally:
        llama_cpp.llama_sampler_free(chain)


CASES = [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(top_k=1), dict(top_k=7), dict(top_p=0.5), dict(top_p=0.9, min_keep=25), dict(top_p=0.0),
    dict(min_p=0.2), dict(min_p=0.05, min_keep=40), dict(top_k=50, top_p=0.8, min_p=0.1),
    dict(top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.6,
         repeat_last_n=12),
    dict(top_k=0, top_p=0.95, min_p=0.0, repeat_penalty=0.8, repeat_last_n=64),
    dict(),  # everything off
]


def rows_and_history(seed: int):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((R, V)) * 2).astype(np.float32)
    stream = rng.integers(0, 40, 50).tolist()
    logits[:, :40] += 1.0  # history tokens are among the likely ones
    logits[:, 3] = 0.0  # penalties: 0 and negative logits are multiplied
    logits[:, 5] = -0.5
    return logits, stream


@pytest.mark.parametrize("rp,fp,pp,rln", [(1.3, 0.0, 0.0, 64), (0.7, 0.2, 0.0, 5), (1.1, 0.5, 1.5, 30),
                                          (2.0, -0.5, 0.0, 1)])
def test_penalised_logits_match_llama_cpp(rp, fp, pp, rln):
    cfg = cfg_with(repeat_penalty=rp, frequency_penalty=fp, presence_penalty=pp, repeat_last_n=rln)
    logits, stream = rows_and_history(5)
    logits[:, 6] = -0.0
    logits[:, 8] = -np.inf
    stream += [8, 8, 5, 6, 3]
    h = history_from_tokens(stream, W)
    toks, mask = row_windows(h, None, jnp.int32(rln), R)
    got = np.asarray(penalize(jnp.asarray(logits), toks, mask, cfg.params()))
    for r in range(R):
        kept, _ = llama_apply(cfg, stream, logits[r])  # filters off, temperature 1: every logit comes back
        want = np.full(V, np.nan, np.float32)
        for t, l, _ in kept:
            want[t] = l
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)  # ulps: FMA contraction may differ
        assert (got[r] != logits[r]).sum() >= 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "off")
def test_survivors_match_llama_cpp(case):
    cfg = cfg_with(**case)
    logits, stream = rows_and_history(1)
    mask = np.asarray(filter_mask(jnp.asarray(logits), history_from_tokens(stream, W), None, cfg.params(), cap=64))
    for r in range(R):
        kept, _ = llama_apply(cfg, stream, logits[r])
        ids = {t for t, _, _ in kept}
        assert ids == ref_kept(logits[r], stream, cfg), r
        assert ids == set(np.flatnonzero(mask[r]).tolist()), r


@pytest.mark.parametrize("case", [c for c in CASES if c], ids=str)
def test_probabilities_match_llama_cpp_dist(case):
    for temperature in (0.7, 1.3):
        cfg = cfg_with(**{**case, "temperature": temperature})
        logits, stream = rows_and_history(2)
        probs = np.asarray(token_probs(jnp.asarray(logits), history_from_tokens(stream, W), None, cfg.params(),
                                       cap=64))
        for r in range(R):
            kept, selected = llama_apply(cfg, stream, logits[r], with_dist=True)
            want = np.zeros(V)
            for t, _, p in kept:
                want[t] = p
            np.testing.assert_allclose(probs[r], want, atol=2e-6)
            assert want[selected] > 0


def test_greedy_matches_llama_cpp():
    logits, stream = rows_and_history(3)
    for kw in (dict(), dict(repeat_penalty=1.5, presence_penalty=0.5, repeat_last_n=20)):
        cfg = cfg_with(**{**CASES[0], "temperature": 0.0, **kw})
        got = np.asarray(sample_rows(jnp.asarray(logits), jnp.arange(R), history_from_tokens(stream, W), None,
                                     cfg.params(), cap=64))
        want = [llama_apply(cfg, stream, logits[r], with_dist=True)[1] for r in range(R)]
        assert got.tolist() == want


def test_penalty_window_slides_like_llama_cpp():
    """llama.cpp's ring buffer forgets tokens older than repeat_last_n; so does our window."""
    rng = np.random.default_rng(4)
    row = (rng.standard_normal(V) * 0.1).astype(np.float32)
    stream = [7] * 10 + rng.integers(100, 200, 20).tolist()  # token 7 only outside the last 20
    for rln, penalised in ((20, False), (30, True), (64, True)):
        cfg = cfg_with(repeat_penalty=1.0, presence_penalty=5.0, repeat_last_n=rln)
        kept, _ = llama_apply(cfg, stream, row)
        logit7 = dict((t, l) for t, l, _ in kept)[7]
        assert (logit7 < row[7] - 4) == penalised
        mask = np.asarray(filter_mask(jnp.asarray(np.tile(row, (R, 1))), history_from_tokens(stream, W), None,
                                      dataclasses.replace(cfg, min_p=0.5).params(), cap=64))
        assert bool(mask[0, 7]) == (not penalised)  # a 5-nat presence penalty drops it below min-p 0.5
