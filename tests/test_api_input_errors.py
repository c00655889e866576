"""Bad input to the public API: wrong types are TypeErrors naming the parameter, wrong values the documented
ValueError (or the package's specific error), never a silent reinterpretation, an OverflowError or an
AttributeError. Plus: a penalty window longer than the context costs no more than the context."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_jax import chat
from fucina_jax.errors import TokenizerError
from fucina_jax.generate import generate
from fucina_jax.sampling import SamplerConfig

GREEDY = SamplerConfig(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def model(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


def test_decode_rejects_negative_ids(model):
    tok = model.tokenizer
    for bad in ([-1], [5, -tok.n_vocab], [tok.n_vocab]):
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.decode(bad)
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.decode_bytes(iter(bad))
    assert tok.decode([5, 6]) == tok.decode(np.array([5, 6]))


@pytest.mark.parametrize("prompt, error, needle", [
    (b"hello", TypeError, "tokenizer.encode"),
    (bytearray(b"hi"), TypeError, "tokenizer.encode"),
    ([1.7, 2.2], TypeError, "integers"),
    ([1, None], TypeError, "integers"),
    ([2**40], ValueError, r"token ids must be in \[0, "),
    ([2**70], ValueError, r"token ids must be in \[0, "),
    ([-1, 5], ValueError, r"token ids must be in \[0, "),
])
def test_generate_prompt_must_be_token_ids(model, prompt, error, needle):
    with pytest.raises(error, match=needle):
        model.generate(prompt, 3, temperature=0)


def test_logits_and_prefill_range_checked_before_int32(model):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        model.logits([2**31])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        model.prefill([2**32 + 5], model.new_cache(16))
    with pytest.raises(TypeError, match="cache"):
        model.prefill([5, 6], None)


@pytest.mark.parametrize("max_tokens, error", [(2.5, TypeError), (True, TypeError), ("3", TypeError),
                                               (-1, ValueError)])
@pytest.mark.parametrize("spec", [False, True])
def test_max_tokens_is_an_int_at_least_0(model, max_tokens, error, spec):
    with pytest.raises(error, match="max_tokens"):
        model.generate([5, 6], max_tokens, spec=spec, temperature=0)


def test_stop_ids_are_token_ids(model):
    with pytest.raises(TypeError, match="stop_ids"):
        model.generate([5, 6], 3, stop_ids="abc", temperature=0)
    with pytest.raises(TypeError, match="stop_ids"):
        model.generate([5, 6], 3, stop_ids=7, temperature=0)
    with pytest.raises(ValueError, match=r"stop_ids \[-1, 1000000000\]"):
        model.generate([5, 6], 3, stop_ids=[-1, 10**9], temperature=0)
    free = model.generate([5, 6], 4, stop_ids=(), temperature=0).run().tokens
    assert model.generate([5, 6], 4, stop_ids=np.array([free[0]]), temperature=0).run().tokens == []


def test_references_must_be_a_list_of_documents(model):
    with pytest.raises(TypeError, match=r"references.*\[doc\]"):
        model.generate([5, 6], 3, spec=True, references="abc", temperature=0)


def test_huge_int_sampler_values_mean_the_whole_range(model):
    ids = [5, 6, 7]
    cfg = dict(temperature=1.0, top_p=1.0, min_p=0.0, seed=3)
    assert SamplerConfig(top_k=2**40).validate().top_k == 2**40
    SamplerConfig(top_k=2**40, min_keep=2**40, repeat_last_n=2**40, seed=0).params()  # no OverflowError
    off = generate(model, ids, max_tokens=6, sampler=SamplerConfig(top_k=0, **cfg), stop_ids=()).run().tokens
    huge = generate(model, ids, max_tokens=6, sampler=SamplerConfig(top_k=2**40, **cfg), stop_ids=()).run().tokens
    assert huge == off
    keep = SamplerConfig(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, min_keep=2**40, seed=3)  # top-p never cuts
    assert generate(model, ids, max_tokens=6, sampler=keep, stop_ids=()).run().tokens == off


def test_penalty_window_is_capped_at_the_context():
    for rln in (64, 100, 10**9, 2**40, -1):
        assert SamplerConfig(repeat_last_n=rln).history_capacity(100) <= 100
    assert SamplerConfig(repeat_last_n=40).history_capacity(100) == 64  # windows below the context: unchanged
    assert SamplerConfig(repeat_last_n=10**9).history_capacity(100) == 100


def test_penalty_window_cap_keeps_the_stream(model):
    """A window of the whole context, -1 and a window far past it penalise the same tokens: the same stream."""
    ctx = 48
    ids = [5, 6, 7, 5, 6, 7, 8, 9]
    runs = []
    for rln in (ctx, -1, 10**9):
        cfg = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                            frequency_penalty=0.5, repeat_last_n=rln, seed=11)
        runs.append(generate(model, ids, max_tokens=ctx, sampler=cfg, ctx=ctx, stop_ids=()).run().tokens)
    assert len(runs[0]) == ctx - len(ids)
    assert runs[0] == runs[1] == runs[2]
    plain = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    assert generate(model, ids, max_tokens=ctx, sampler=plain, ctx=ctx, stop_ids=()).run().tokens != runs[0]


def test_penalty_window_capacity_does_not_change_tokens():
    """A window of n <= ctx tokens samples the same with the old power-of-two capacity and the capped one."""
    from fucina_jax.sampling import history_from_tokens, sample_rows

    rng = np.random.default_rng(0)
    V, n = 300, 48
    stream = rng.integers(0, V, n).tolist()
    logits = rng.standard_normal((4, V)).astype(np.float32)
    cfg = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=3.0, presence_penalty=1.0,
                        repeat_last_n=n, seed=5)
    pos = np.arange(n, n + 4, dtype=np.int32)
    drafts = np.asarray(rng.integers(0, V, 4), np.int32)
    out = [np.asarray(sample_rows(logits, pos, history_from_tokens(stream, w), drafts, cfg.params(),
                                  cap=cfg.candidate_cap(V))) for w in (cfg.history_capacity(n), 64)]
    assert cfg.history_capacity(n) == n
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("kw, needle", [
    (dict(sampler="greedy"), "SamplerConfig"),
    (dict(sampler={"temperature": 0}), "SamplerConfig"),
    (dict(spec=True, spec_options={"max_draft": 3}), "SpecOptions"),
    (dict(source="x"), "source"),
])
def test_wrong_object_types_are_type_errors(model, kw, needle):
    with pytest.raises(TypeError, match=needle):
        model.generate([5, 6], 3, **kw)


def test_model_parameter_is_checked(model):
    with pytest.raises(TypeError, match="model"):
        generate(None, [1, 2])
    with pytest.raises(TypeError, match="model"):
        chat.Conversation(None)
    with pytest.raises(TypeError, match="SpecOptions"):
        chat.Conversation(model, speculation=True, spec_options={})
    with pytest.raises(TypeError, match="max_tokens"):
        chat.Conversation(model, max_tokens=2.5)


def test_ctx_and_capacity_are_validated(model):
    with pytest.raises(ValueError, match="ctx = -1"):
        chat.Conversation(model, ctx=-1)
    with pytest.raises(ValueError, match="ctx = -1"):
        model.new_cache(-1)
    with pytest.raises(TypeError, match="ctx"):
        model.new_cache(2.5)
    with pytest.raises(ValueError, match="ctx = -5"):
        model.generate([5, 6], 3, ctx=-5, temperature=0)
    with pytest.raises(ValueError, match="batch"):
        model.new_cache(16, 0)
    assert model.new_cache(None).capacity >= model.default_ctx


@pytest.mark.parametrize("prompt, error, needle", [
    ([[5, 6], [7, 8]], ValueError, r"one prompt .* shape \(2, 2\)"),  # a batch is not silently one long prompt
    (5, TypeError, "single int"),
    ({5, 6}, TypeError, "ordered"),
    ({5: 1}, TypeError, "ordered"),
    ([[5, 6], [7]], TypeError, "flat sequence"),
])
def test_prompt_ids_are_one_flat_sequence(model, prompt, error, needle):
    with pytest.raises(error, match=needle):
        model.generate(prompt, 3, temperature=0)


def test_one_prompt_as_a_1_by_t_batch_is_that_prompt(model):
    flat = [t for t in model.generate([5, 6, 7], 4, temperature=0)]
    assert [t for t in model.generate(np.array([[5, 6, 7]]), 4, temperature=0)] == flat
    assert [t for t in model.generate(iter([5, 6, 7]), 4, temperature=0)] == flat


def test_generate_batched_checks_its_arguments(model):
    from fucina_jax.generate import generate_batched

    with pytest.raises(TypeError, match="list of prompts"):
        generate_batched(model, [5, 6, 7], max_tokens=2)  # one prompt, not 3 one-token prompts
    with pytest.raises(TypeError, match="SpecOptions"):
        generate_batched(model, [[5, 6]], options="x")
    with pytest.raises(TypeError, match="draft source"):
        generate_batched(model, [[5, 6], [7]], sources=["x", "y"])
    with pytest.raises(TypeError, match="clock"):
        generate_batched(model, [[5, 6]], clock="x")


@pytest.mark.parametrize("doc, needle", [(b"abc", "bytes"), (None, "NoneType"), (5, "int 5")])
def test_reference_documents_are_text_or_ids(model, doc, needle):
    with pytest.raises(TypeError, match=needle):
        model.generate([5, 6], 2, spec=True, references=[doc])
    conv = chat.Conversation(model, speculation=True)
    with pytest.raises(TypeError, match=needle):
        conv.add_spec_reference(doc)


def test_wrong_types_in_tokenizer_and_chat_options(model):
    tok = model.tokenizer
    for bad in ("abc", None, 5):
        with pytest.raises(TypeError, match="sequence of token ids"):
            tok.decode(bad)
    with pytest.raises(TypeError, match="token ids are ints"):
        tok.decode([5, "a"])
    with pytest.raises(TypeError, match="token id is an int"):
        tok.stream_decoder().feed("a")
    with pytest.raises(TypeError, match="system"):
        chat.Conversation(model, system=5)


def test_a_cache_larger_than_memory_is_a_clear_error(model):
    from fucina_jax.errors import CacheMemoryError

    with pytest.raises(CacheMemoryError, match=r"KV cache of \d+ positions x 1 row\(s\) needs .* GiB"):
        model.new_cache(2**40)
