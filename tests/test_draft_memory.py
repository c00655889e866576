"""The process's shared, persisted draft memory (speculative/sources.py over index/persist.py): requests feed one
recycling matrix and one past-output index per model, saved to the cache directory and loaded by the next
process; warm or cold, a speculative stream is the plain one."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_jax.generate import generate, generate_speculative
from fucina_jax.index import persist
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import SpecOptions, sources

CTX = 160
GREEDY = SamplerConfig(temperature=0.0, seed=0)
SAMPLED = SamplerConfig(temperature=0.8, top_k=20, seed=11)


@pytest.fixture
def memory_on(monkeypatch, tmp_path):
    monkeypatch.delenv(persist.NO_PERSIST_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_MEMORIES", {})
    return tmp_path / "cache" / "fucina_jax" / "index"


@pytest.fixture(scope="module")
def model(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


def ids(model, text):
    return model.tokenizer.encode(text, add_special=True)


@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_warm_memory_changes_drafts_not_streams(model, memory_on, sampler):
    warmers = ["one two three four one two three four", "the cat sat on the mat, the cat sat", "a b c d a b c d e"]
    probe = ids(model, "one two three four one two three")
    plain = generate(model, probe, max_tokens=50, sampler=sampler, ctx=CTX, stop_ids=()).run()
    for text in warmers:  # other requests warm the shared matrix and output index
        generate_speculative(model, ids(model, text), max_tokens=40, sampler=sampler, ctx=CTX, stop_ids=()).run()
    mem = sources.draft_memory(model)
    assert mem.outputs.n_outputs == len(warmers) and (mem.matrix.table[:, 0] >= 0).sum() > 0
    warm = generate_speculative(model, probe, max_tokens=50, sampler=sampler, ctx=CTX, stop_ids=()).run()
    assert warm.tokens == plain.tokens
    mem.save()
    files = sorted(p.name for p in memory_on.iterdir())
    assert len(files) == 2 and files[0].startswith("outputs-") and files[1].startswith("recycling-")
    # a new process: the memory is loaded from the files, and still changes nothing that is committed
    sources._MEMORIES.clear()
    again = sources.draft_memory(model)
    np.testing.assert_array_equal(again.matrix.table, mem.matrix.table)
    assert again.outputs.n_outputs == mem.outputs.n_outputs
    res = generate_speculative(model, probe, max_tokens=50, sampler=sampler, ctx=CTX, stop_ids=(),
                               options=SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False)).run()
    assert res.tokens == plain.tokens


def test_opt_outs_touch_no_file(model, memory_on, monkeypatch):
    generate_speculative(model, ids(model, "x y z x y z"), max_tokens=10, ctx=CTX, stop_ids=(), persist=False).run()
    assert sources._MEMORIES == {}
    monkeypatch.setenv(persist.NO_PERSIST_ENV, "1")
    generate_speculative(model, ids(model, "x y z x y z"), max_tokens=10, ctx=CTX, stop_ids=()).run()
    assert sources.draft_memory(model) is None and not memory_on.exists()


def test_a_corrupt_memory_file_is_ignored_with_one_warning(model, memory_on, caplog):
    generate_speculative(model, ids(model, "p q r p q r"), max_tokens=10, ctx=CTX, stop_ids=()).run()
    sources.draft_memory(model).save()
    path = next(p for p in memory_on.iterdir() if p.name.startswith("recycling-"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    sources._MEMORIES.clear()
    with caplog.at_level("WARNING"):
        mem = sources.draft_memory(model)
    assert (mem.matrix.table[:, 0] >= 0).sum() == 0  # a fresh matrix
    assert len([r for r in caplog.records if path.name in r.getMessage()]) == 1
    plain = generate(model, ids(model, "p q r p"), max_tokens=12, ctx=CTX, stop_ids=(), sampler=GREEDY).run()
    spec = generate_speculative(model, ids(model, "p q r p"), max_tokens=12, ctx=CTX, stop_ids=(),
                                sampler=GREEDY).run()
    assert spec.tokens == plain.tokens
