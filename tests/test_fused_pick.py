"""The fused output layer: a greedy sampler whose penalties are neutral (SamplerConfig.candidate_cap =
GREEDY_UNPENALIZED) takes each row's token and recycling candidates in the output layer's kernel
(kernels.qlinear_pick), and a sampled one with neutral penalties and top-k on (cap -c) its top c candidates
(kernels.qlinear_candidates), never writing the logits out. It must change no token and no candidate:

- the candidate cap: GREEDY_UNPENALIZED exactly for greedy configs whose penalties leave every logit as it is, -c
  for such sampled configs; widen_cap joins the caps of a batch's rows;
- engine: decode_sample_step and decode_sample_rows_step with the fused pick == the same steps through the logits
  and the sampler (greedy: cap 0, the penalised greedy path with neutral values; sampled: cap c), at every width,
  chains and trees: the samples, the top-K rows and the cache, bitwise, on quantized fixtures and on the real models;
- decoder: greedy and sampled plain and speculative runs on the real models commit the same stream, and the
  speculative run the same drafts and acceptances (the recycling matrix is fed the same candidates), fused or not;
- a model whose output layer the kernel does not take (a final softcap, or the f32 path) keeps the logits path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import fucina_jax
from fucina_jax import engine, kernels, sampling
from fucina_jax.generate import generate, generate_speculative
from fucina_jax.models import unembed_pick
from fucina_jax.sampling import GREEDY_UNPENALIZED, SamplerConfig
from fucina_jax.speculative import SpecOptions
from fucina_jax.testing import write_fixture, write_gemma4_fixture

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

CTX = 96
N = engine.STEP_WIDTHS[-1]


def test_candidate_cap_is_unpenalized_exactly_for_neutral_greedy_configs():
    V = 5000
    assert SamplerConfig(temperature=0).candidate_cap(V) == GREEDY_UNPENALIZED
    assert SamplerConfig(temperature=-1, repeat_penalty=1.3, repeat_last_n=0).candidate_cap(V) == GREEDY_UNPENALIZED
    for penalised in (dict(repeat_penalty=1.1), dict(frequency_penalty=0.2), dict(presence_penalty=-0.5),
                      dict(repeat_penalty=1.1, repeat_last_n=-1)):
        assert SamplerConfig(temperature=0, **penalised).candidate_cap(V) == 0, penalised
    assert SamplerConfig(temperature=0.7, top_k=0).candidate_cap(V) == sampling.TOP_K_OFF_CAP


def test_sampled_configs_with_neutral_penalties_and_top_k_get_a_fused_cap():
    V = 5000
    assert SamplerConfig(temperature=0.7, top_k=40).candidate_cap(V) == -64
    assert SamplerConfig(temperature=0.7, top_k=1).candidate_cap(V) == -2  # at least 2: -1 is greedy's
    assert SamplerConfig(temperature=0.7, top_k=40, repeat_penalty=1.1).candidate_cap(V) == 64
    assert SamplerConfig(temperature=0.7, top_k=40, presence_penalty=0.5).candidate_cap(V) == 64
    assert SamplerConfig(temperature=0.7, top_k=3000).candidate_cap(V) == -4096
    assert SamplerConfig(temperature=0.7, top_k=3000).candidate_cap(4000) == 4000  # the whole vocabulary: logits
    for cap, c in ((-64, 64), (-2, 2), (GREEDY_UNPENALIZED, 0), (0, None), (64, None)):
        assert sampling.fused_candidates(cap) == c, cap
        assert sampling.logits_cap(cap) == (cap if cap >= GREEDY_UNPENALIZED else -cap)
    code = ("from fucina_jax.sampling import SamplerConfig; "
            "print(SamplerConfig(temperature=1, top_k=9).candidate_cap(99))")
    for value, want in (("0", "16"), ("1", "-16")):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, FUCINA_FUSED_PICK=value),
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr[-500:])


def test_widened_caps_serve_every_row():
    """widen_cap: fused caps stay fused (the wider candidate count), any logits cap takes the logits path with
    the wider count; the join is commutative and the greedy cap is its identity among the fused ones."""
    w = sampling.widen_cap
    assert w(GREEDY_UNPENALIZED, GREEDY_UNPENALIZED) == GREEDY_UNPENALIZED
    assert w(GREEDY_UNPENALIZED, -64) == w(-64, GREEDY_UNPENALIZED) == -64
    assert w(-2, -64) == -64
    assert w(GREEDY_UNPENALIZED, 0) == w(0, GREEDY_UNPENALIZED) == 0
    assert w(-64, 0) == w(0, -64) == 64
    assert w(-64, 16) == 64 and w(-16, 1024) == 1024


def test_the_fused_pick_can_be_turned_off():
    """FUCINA_FUSED_PICK=0 (read at import): greedy configs step through the logits (cap 0)."""
    code = "from fucina_jax.sampling import SamplerConfig; print(SamplerConfig(temperature=0).candidate_cap(99))"
    for value, want in (("0", "0"), ("1", str(GREEDY_UNPENALIZED))):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, FUCINA_FUSED_PICK=value),
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr[-500:])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_pick")
    loaded = {}

    def get(kind: str, qtype: str = "Q8_0", f32: bool = False):
        key = (kind, qtype, f32)
        if key not in loaded:
            path = str(root / f"{kind}-{qtype}.gguf")
            if kind.startswith("gemma4"):
                write_gemma4_fixture(path, kind.partition("-")[2], qtype=qtype)
            else:
                write_fixture(path, kind, qtype=qtype)
            loaded[key] = fucina_jax.load(path, f32=f32)
        return loaded[key]

    return get


def _hidden(model) -> np.ndarray:
    """One zero hidden row of the model's width."""
    return np.zeros((1, np.shape(model.params["token_embd"])[-1]), np.float32)


def _stack(tree, B):
    return jax.device_put(jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * B), tree))


def _step_both_ways(model, B: int, width: int, tree: bool, rows=None, seed: int = 0, cfg=None):
    """One decode_sample(_rows)_step through the fused pick and through the logits from the same cache state: greedy
    (cfg None) with cap GREEDY_UNPENALIZED against cap 0 (neutral penalties), a sampled cfg with its fused cap -c
    against cap c. Returns (fused outputs, logits-path outputs)."""
    rng = np.random.default_rng(seed)
    V = model.config.n_vocab
    prompts = [rng.integers(0, V, 20 + 3 * b).astype(np.int32) for b in range(B)]
    cfg = (cfg or SamplerConfig(temperature=0, seed=0)).validate()
    # sampled: one cap for every config (any cap a config widens to gives its tokens), so they share programs
    fused = cfg.candidate_cap(V) if cfg.greedy else sampling.widen_cap(cfg.candidate_cap(V), -64)
    assert sampling.fused_candidates(fused) is not None, cfg
    caps = (fused, 0 if fused == GREEDY_UNPENALIZED else sampling.logits_cap(fused))
    window = cfg.history_capacity(CTX)
    history = jax.device_put(jax.tree_util.tree_map(
        lambda *x: np.stack([np.asarray(v) for v in x]),
        *[sampling.history_from_tokens(p.tolist(), window) for p in prompts]))
    sparams = _stack(cfg.params(), B)
    n = B if rows is None else len(rows)
    toks = rng.integers(0, V, (n, width)).astype(np.int32)
    if tree:
        parents = np.stack([[0] + [int(rng.integers(0, t)) for t in range(1, width)] for _ in range(n)]).astype(np.int32)
        drafts = engine.TreeDraft(parents)
    else:
        drafts = np.concatenate([toks[:, 1:], np.full((n, 1), -1, np.int32)], axis=1)
    start = np.array([len(prompts[b if rows is None else rows[i]]) - 1 for i, b in enumerate(range(n))], np.int32)
    pushed, n_pushed = np.full((B, N), -1, np.int32), np.zeros(B, np.int32)
    outs = []
    for cap in caps:
        cache = model.new_cache(CTX, batch=B)
        _, cache = engine.prefill(model.params, model.config, prompts, cache)
        if rows is None:
            out = engine.decode_sample_step(model.params, toks, drafts, start, cache, history, pushed, n_pushed,
                                            sparams, model.config, cap, wants_topk=True)
        else:
            out = engine.decode_sample_rows_step(model.params, toks, drafts, np.asarray(rows, np.int32), start, cache,
                                                 history, pushed, n_pushed, sparams, model.config, cap,
                                                 wants_topk=True)
        outs.append(jax.tree_util.tree_map(np.asarray, out))
    return outs


def _assert_same(fused, plain, where):
    sampled_f, hist_f, logits_f, topk_f, cache_f = fused
    sampled_p, hist_p, _, topk_p, cache_p = plain
    assert logits_f is None
    assert np.array_equal(sampled_f, sampled_p), where
    assert np.array_equal(topk_f, topk_p), where
    assert np.array_equal(hist_f.tokens, hist_p.tokens), where
    for a, b in zip(jax.tree_util.tree_leaves(cache_f), jax.tree_util.tree_leaves(cache_p)):
        assert np.array_equal(a, b), where


@pytest.mark.parametrize("kind, qtype", [("gemma3", "Q8_0"), ("qwen3", "Q4_0"), ("llama", "Q5_1")])
def test_fused_step_is_the_logits_step(fixtures, kind, qtype):
    model = fixtures(kind, qtype)
    assert unembed_pick(model.params, _hidden(model), model.config, 8) is not None
    for width in engine.STEP_WIDTHS:
        for tree in ([False, True] if width > 2 else [False]):
            _assert_same(*_step_both_ways(model, 2, width, tree, seed=width), (kind, width, tree))
    # the rows step over 2 of a 4-row cache
    _assert_same(*_step_both_ways(model, 4, 4, False, rows=[2, 0], seed=9), (kind, "rows"))


# Sampled configs with neutral penalties (fused caps): top-k at, below and above other filters' cuts, top-k 1
SAMPLED = [SamplerConfig(temperature=0.7, top_k=40, seed=1),
           SamplerConfig(temperature=1.5, top_k=5, top_p=0.5, min_p=0.0, seed=2),
           SamplerConfig(temperature=0.9, top_k=1, seed=3),
           SamplerConfig(temperature=2.0, top_k=64, top_p=1.0, min_p=0.2, min_keep=3, seed=4)]


@pytest.mark.parametrize("kind, qtype", [("gemma3", "Q8_0"), ("qwen3", "Q4_0"), ("llama", "Q5_1")])
def test_fused_sampled_step_is_the_logits_step(fixtures, kind, qtype):
    """A sampled config's fused step (the candidates taken in the output layer's kernel) == its logits step: the
    samples, top-K rows, history and cache, at every width (two on the other architectures: the sampler is the same
    code), chains and trees, and on mapped rows."""
    model = fixtures(kind, qtype)
    for i, cfg in enumerate(SAMPLED):
        for width in (engine.STEP_WIDTHS if kind == "gemma3" else (1, 8)):
            for tree in ([False, True] if width > 2 else [False]):
                _assert_same(*_step_both_ways(model, 2, width, tree, seed=width + 100 * i, cfg=cfg),
                             (kind, cfg, width, tree))
        _assert_same(*_step_both_ways(model, 4, 4, False, rows=[2, 0], seed=9 + i, cfg=cfg), (kind, cfg, "rows"))


def test_fused_step_is_the_logits_step_on_the_real_models(gemma3, smollm2):
    for model in (gemma3, smollm2):
        for width in (1, 4, 16):
            _assert_same(*_step_both_ways(model, 1, width, width == 4, seed=width), (model.config.arch, width))
            _assert_same(*_step_both_ways(model, 1, width, width == 4, seed=width, cfg=SAMPLED[0]),
                         (model.config.arch, width, "sampled"))


def test_models_the_kernel_does_not_take_keep_the_logits(fixtures):
    """A final softcap (Gemma 4) or the f32 reference path: no fused pick, the logits path (the same tokens)."""
    for model in (fixtures("gemma4-e2b", "Q8_0"), fixtures("gemma3", "Q8_0", f32=True)):
        assert unembed_pick(model.params, _hidden(model), model.config, 8) is None
        _assert_same(*_step_both_ways(model, 1, 4, False), model.config.arch)


def _runs(model, prompt, speculative: bool, sampler):
    if not speculative:
        return generate(model, prompt, max_tokens=48, sampler=sampler).run().tokens, None
    r = generate_speculative(model, prompt, max_tokens=48, sampler=sampler, options=SpecOptions(), clock=False,
                             persist=False).run()
    return r.tokens, {k: r.spec[k] for k in ("steps", "verify_steps", "drafted", "accepted")}


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("sampler", [SamplerConfig(temperature=0, seed=0), SAMPLED[0]], ids=["greedy", "sampled"])
def test_runs_are_the_same_fused_or_not(gemma3, smollm2, monkeypatch, speculative, sampler):
    runs = {}
    text = "Here is a list of the planets: Mercury, Venus, Earth, Mars. Again: Mercury,"
    for model in (gemma3, smollm2):
        runs[model.config.arch, "fused"] = _runs(model, model.tokenizer.encode(text), speculative, sampler)
    real = SamplerConfig.candidate_cap
    monkeypatch.setattr(SamplerConfig, "candidate_cap", lambda self, V: max(sampling.logits_cap(real(self, V)), 0))
    for model in (gemma3, smollm2):
        got = _runs(model, model.tokenizer.encode(text), speculative, sampler)
        assert got == runs[model.config.arch, "fused"], model.config.arch
