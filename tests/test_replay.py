"""The replay harness (speculative/replay.py): a recorded plain run replayed through the real decoder on the oracle
steps gives what the live speculative run gives, step for step (the same widths, drafts, acceptances and stream),
greedy and sampled, with a warm source, a stop id and a batch; recordings round-trip through their file."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_jax.generate import generate_batched, generate_speculative
from fucina_jax.index.cascade import SpeculationIndex
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import SpecOptions
from fucina_jax.speculative import replay as R

GREEDY = SamplerConfig(temperature=0.0)
SAMPLED = SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, seed=7)
COPY = ("The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. "
        "The days of the week are")
OTHER = "A list of colours: red, green, blue, yellow, orange, purple, red, green, blue, yellow, orange, purple,"
KEYS = ("steps", "verify_steps", "committed", "drafted", "accepted", "bonus", "rejected", "fallback_steps")


def _ids(model, text):
    return model.tokenizer.encode(text, add_special=True)


def _warm(model):
    """A source that has seen other text first (the cross-request state a persisted draft memory gives)."""
    src = SpeculationIndex(model.config.n_vocab)
    src.observe(np.asarray(_ids(model, OTHER + " " + COPY), np.int32))
    return src


def _same(live: dict, replayed: dict):
    assert {k: live[k] for k in KEYS} == {k: replayed[k] for k in KEYS}
    assert live["widths"] == replayed["widths"]


@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_replay_is_the_live_run(gemma3, sampler, warm):
    prompt = _ids(gemma3, COPY)
    rec = R.record(gemma3, prompt, max_tokens=48, sampler=sampler)
    make = (lambda: _warm(gemma3)) if warm else (lambda: SpeculationIndex(gemma3.config.n_vocab))
    live = generate_speculative(gemma3, prompt, max_tokens=48, sampler=sampler, source=make(), clock=False,
                                persist=False).run()
    assert live.tokens == rec.generated.tolist()  # speculative == plain, and the recording is the plain run
    rp = R.replay([rec], sources=[make()], clock=False)
    _same(live.spec, rp.stats[0])
    assert rp.stats[0]["verify_steps"] > 0  # the comparison exercised verifies


def test_replay_through_a_stop_id_and_a_batch(gemma3):
    """A stop id sampled mid-stream (recorded, not committed) and two rows of different lengths in one batch."""
    p1, p2 = _ids(gemma3, COPY), _ids(gemma3, OTHER)
    free = R.record(gemma3, p1, max_tokens=40, sampler=GREEDY, stop_ids=())
    stop = int(free.sampled[25])  # a token the run samples: stopping on it ends the stream there or earlier
    r1 = R.record(gemma3, p1, max_tokens=40, sampler=GREEDY, stop_ids=(stop,))
    r2 = R.record(gemma3, p2, max_tokens=30, sampler=GREEDY, stop_ids=())
    assert r1.finish == "stop" and r1.sampled[-1] == stop and stop not in r1.generated.tolist()
    live = generate_batched(gemma3, [p1, p2], max_tokens=[40, 30], sampler=GREEDY, stop_ids=[(stop,), ()],
                            sources=[SpeculationIndex(gemma3.config.n_vocab) for _ in range(2)], clock=False,
                            persist=False)
    assert [x.tokens for x in live] == [r1.generated.tolist(), r2.generated.tolist()]
    rp = R.replay([r1, r2], sources=[SpeculationIndex(gemma3.config.n_vocab) for _ in range(2)], clock=False)
    for b in range(2):
        _same(live[b].spec, rp.stats[b])


def test_virtual_time_prices_steps_by_the_cost_model(gemma3):
    """Under the virtual clock a plain replay costs one unit per step; a speculative one costs its widths' prices,
    and the policy sees those prices as measured."""
    rec = R.record(gemma3, _ids(gemma3, COPY), max_tokens=48, sampler=GREEDY)
    cost = lambda w, rows: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.5}[w] * (1.0 if rows == 1 else 1.5)
    plain = R.replay([rec], options=SpecOptions(enabled=False), cost=cost)
    assert plain.time == pytest.approx(len(rec.sampled) - 1) and plain.speedup == pytest.approx(1.0)
    rp = R.replay([rec], sources=[SpeculationIndex(gemma3.config.n_vocab)], cost=cost)
    priced = sum(n * cost(w, 1) for w, n in rp.widths.items())
    calibration = rp.steps - sum(rp.widths.values())  # plain steps before the gate had a timed plain step
    assert rp.time == pytest.approx(priced + calibration)
    assert rp.speedup == pytest.approx(plain.time / rp.time) and rp.speedup > 1.5  # the copy pays


def test_step_times_are_each_widths_whole_steps(gemma3):
    """spec_stats()["step_ms"]: per width, the timed steps and their whole time. Under the virtual clock a step's
    whole time is its price, so every timed step is counted once and each width's mean is its cost."""
    rec = R.record(gemma3, _ids(gemma3, COPY), max_tokens=48, sampler=GREEDY)
    cost = lambda w, rows: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.5}[w]
    rp = R.replay([rec], sources=[SpeculationIndex(gemma3.config.n_vocab)], cost=cost)
    times = {int(w): (n, ms) for w, (n, ms) in rp.stats[0]["step_ms"].items()}
    assert sum(n for n, _ in times.values()) == rp.steps and len(times) > 1
    for w, (n, ms) in times.items():
        assert ms / n == pytest.approx(cost(w, 1) * R.PLAIN_NS / 1e6)
        if w > 1:
            assert n == rp.widths[w]


def test_recording_round_trips_and_bad_files_raise(gemma3, tmp_path):
    rec = R.record(gemma3, _ids(gemma3, COPY), max_tokens=8, sampler=SAMPLED)
    rec.save(tmp_path / "r.npz")
    back = R.Recording.load(tmp_path / "r.npz")
    for f in ("prompt", "sampled", "topk"):
        assert np.array_equal(getattr(back, f), getattr(rec, f))
    assert (back.finish, back.max_tokens, back.stops, back.n_vocab, back.ctx) == \
        (rec.finish, rec.max_tokens, rec.stops, rec.n_vocab, rec.ctx)
    (tmp_path / "bad.npz").write_bytes(b"not a recording")
    with pytest.raises(ValueError, match="not a fucina_jax recording"):
        R.Recording.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="nothing to replay"):
        R.replay([])


class _Fixed:
    """A draft source that always proposes the same ids."""

    wants_topk = False

    def __init__(self, ids):
        self.ids = list(ids)

    def suggest(self, context, buf):
        n = min(len(self.ids), len(buf))
        buf[:n] = self.ids[:n]
        return n

    def observe(self, committed):
        pass


def test_hindsight_evidence_is_the_accepted_length():
    full = np.asarray([1, 2, 3, 4, 5, 6, 7], np.int32)
    buf = np.zeros(4, np.int32)
    for draft, context_len, accepted in (([4, 5, 9], 3, 2), ([4, 5, 6], 3, 3), ([9, 5, 6], 3, 0), ([7, 8], 6, 1)):
        src = R.Hindsight(_Fixed(draft), full)
        assert src.suggest(full[:context_len], buf) == len(draft)
        assert src.evidence() == ("hindsight", accepted)
    class WithSiblings(_Fixed):
        def siblings(self, k):
            return [(9, "sibling0"), (4, "sibling1"), (8, "sibling2")][:k]

    src = R.Hindsight(WithSiblings([5, 6]), full)
    src.suggest(full[:3], buf)  # the next token is 4
    assert src.siblings(3) == [(9, ("hindsight-sibling", 0)), (4, ("hindsight-sibling", 1)),
                               (8, ("hindsight-sibling", 0))]
    assert R.Hindsight(_Fixed([5]), full).siblings(2) == []  # a source without siblings offers none
    model = R.HindsightModel()
    assert model.cumulative(("hindsight", 2))[:4] == [1.0, 1.0, 0.0, 0.0]
    assert model.cumulative(("hindsight-sibling", 1))[:2] == [1.0, 0.0]
    assert model.cumulative(("hindsight-sibling", 0))[0] == 0.0
    assert model.cumulative("conversation:32") == R.AcceptanceModel().cumulative("conversation:32")


@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_hindsight_is_the_ceiling_of_the_same_drafts(gemma3, sampler):
    """Knowing each draft's accepted length, the economics never verify a draft whose first token is wrong and do
    at least as well as the learned policy over the same drafts and costs."""
    rec = R.record(gemma3, _ids(gemma3, OTHER + " " + COPY), max_tokens=48, sampler=sampler)
    make = lambda: SpeculationIndex(gemma3.config.n_vocab)
    learned = R.replay([rec], sources=[make()])
    ceiling = R.replay([rec], sources=[make()], hindsight=True)
    st = ceiling.stats[0]
    assert st["committed"] == learned.stats[0]["committed"] and st["verify_steps"] > 0
    assert st["accepted"] >= st["verify_steps"]  # every verify accepted a token: none was a known loss
    assert ceiling.speedup >= learned.speedup
    # with the recycling matrix's alternatives to each first token as tree siblings, known right or wrong
    tree = R.replay([rec], sources=[make()], options=SpecOptions(tree_siblings=2), hindsight=True)
    assert tree.stats[0]["committed"] == st["committed"] and tree.speedup >= ceiling.speedup
    with pytest.raises(ValueError, match="hindsight"):
        R.replay([rec], sources=[make()], options=SpecOptions(policy="gate"), hindsight=True)
