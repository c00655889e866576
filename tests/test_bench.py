"""The benchmark suite (bench/run.py) in its quick mode: every task class runs on every system, the speculative
stream equals the plain stream token for token, and the report files are written.

The CI run uses the tiny random Qwen3 fixture and a short task file in the shipped format (its context is 512
tokens); the shipped task file itself is checked for shape and prompt construction. The full run is
`python bench/run.py` (results in BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench/run.py")


SHORT_TASKS = {
    "documents": {"a": "the cat sat on the mat and the dog sat on the log", "b": "abc abc abc abc abc abc"},
    "tasks": [
        {"class": "grounded_copy", "id": "grounded_copy/a", "temperature": 0.0,
         "continuation": "text: {a}\ncopy: {a}\ncopy:", "chat": []},
        {"class": "grounded_copy", "id": "grounded_copy/not-in-quick", "temperature": 0.0,
         "continuation": "x", "chat": []},
        {"class": "verbatim_repetition", "id": "verbatim_repetition/b", "temperature": 0.0,
         "continuation": "{b}\n{b}\n{b}\n", "chat": []},
        {"class": "code_edit", "id": "code_edit/f", "temperature": 0.0,
         "continuation": "def f(x):\n    return x\n# renamed:\ndef g(x):\n", "chat": []},
        {"class": "rag_reference", "id": "rag_reference/a", "temperature": 0.0, "reference": "a",
         "continuation": "quote:", "chat": []},
        {"class": "multi_turn_restatement", "id": "multi_turn_restatement/a", "temperature": 0.0,
         "continuation": "User: hi\nAssistant: {a}\nUser: again\nAssistant:", "chat": []},
        {"class": "free_form", "id": "free_form/0", "temperature": 0.8, "continuation": "Once", "chat": []},
        {"class": "sampled_grounded_copy", "id": "sampled_grounded_copy/a", "temperature": 0.7,
         "continuation": "text: {a}\ncopy: {a}\ncopy:", "chat": []},
        {"class": "mt_chat", "id": "mt_chat/a", "temperature": 0.0,
         "continuation": "User: hi\nAssistant: {a}\nUser: say it shorter\nAssistant:", "chat": []},
        {"class": "translation", "id": "translation/a", "temperature": 0.0, "continuation": "English: {a}\nFrench:",
         "chat": []},
        {"class": "summarization", "id": "summarization/a", "temperature": 0.0,
         "continuation": "{a} {b}\nSummary:", "chat": []},
        {"class": "qa", "id": "qa/a", "temperature": 0.0, "continuation": "Q: where did the cat sit?\nA:", "chat": []},
        {"class": "math_reasoning", "id": "math_reasoning/a", "temperature": 0.0,
         "continuation": "2 + 3 * 4 =? Step by step:", "chat": []},
        {"class": "rag", "id": "rag/a", "temperature": 0.0, "continuation": "Passage: {a}\nWhere did the dog sit?",
         "chat": []},
    ],
}


def test_quick_mode_runs_and_spec_equals_plain(bench, fixture_path, load_model, tmp_path):
    tasks_path = tmp_path / "tasks.json"
    tasks_path.write_text(json.dumps(SHORT_TASKS))
    path = fixture_path("qwen3")
    llama = importlib.util.find_spec("llama_cpp") is not None
    rows = bench.run_suite({"fixture": (load_model(path), path, "continuation")}, quick=True, gen=20, reps=1,
                           ctx=512, llama=llama, progress=False, tasks_path=str(tasks_path))
    assert [r["cls"] for r in rows] == list(bench.CLASSES)  # one prompt per class in quick mode
    systems = set(bench.SYSTEMS if llama else ("fucina_plain", "fucina_spec"))
    for r in rows:
        assert set(r["tps"]) == systems and all(v > 0 for v in r["tps"].values()), r
        assert r["spec_equal"], f"{r['id']}: the speculative stream differs from the plain one"
        assert r["n_gen"] > 0 and r["steps"] > 0
    # the copy tasks hand the cascade something to draft: at least one verify ran somewhere
    assert sum(r["verify_steps"] for r in rows) > 0
    meta = {"date": "today", "machine": "test", "mode": "quick", "gen": 20, "reps": 1, "ctx": 512, "seed": 1, "command": "test",
                "seconds": 1.0, "memory": "cold"}
    summary, md, png = bench.write_report(rows, meta, str(tmp_path))
    assert len(summary) == len(bench.CLASSES)
    with open(md) as f:
        text = f.read()
    assert "| fixture | grounded_copy/a |" in text and "spec/plain" in text
    assert [g["group"] for g in bench.group_means(summary)] == ["spec_bench"] and "| fixture | spec_bench | 6 |" in text
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # another benchmark's section (scripts/bench_serve.py --benchmarks) survives the suite rewriting the file
    bench.write_section(md, "bench_serve", "## Server\n\n| a | b |")
    bench.write_section(md, "bench_serve", "## Server\n\n| c | d |")  # replaced, not appended twice
    bench.write_report(rows, meta, str(tmp_path))
    with open(md) as f:
        text = f.read()
    assert text.count("<!-- section bench_serve -->") == 1 and "| c | d |" in text and "| a | b |" not in text
    assert "| fixture | grounded_copy/a |" in text


def test_warm_draft_memory(bench, fixture_path, load_model, tmp_path):
    """--warm: task i feeds memory i % 2 untimed, its timed runs read the other one, and they still equal plain."""
    tasks_path = tmp_path / "tasks.json"
    tasks_path.write_text(json.dumps(SHORT_TASKS))
    path = fixture_path("qwen3")
    model = load_model(path)
    tasks = bench.load_tasks(model, "continuation", quick=True, path=str(tasks_path),
                             classes=("grounded_copy", "verbatim_repetition", "qa"))
    runner = bench.Runner("fixture", model, path, ctx=512, gen=12, seed=1, llama=False, warm=True)
    rows = bench.bench_model(runner, tasks, reps=2)
    assert runner.reads == {t.id: 1 - i % 2 for i, t in enumerate(tasks)}
    assert all(outputs.n_outputs for _, outputs in runner.memories)  # both halves hold their tasks' outputs
    assert [r["memory"] for r in rows] == ["warm"] * 3
    assert all(r["spec_equal"] for r in rows), [r["id"] for r in rows if not r["spec_equal"]]


def test_shipped_task_file(bench, fixture_path, load_model):
    """Every class has >= 3 prompts, placeholders resolve, RAG references are not in the prompt."""
    with open(bench.TASKS_PATH) as f:
        spec = json.load(f)
    classes = [t["class"] for t in spec["tasks"]]
    for c in bench.CLASSES:
        assert classes.count(c) >= 3, c
    assert len({t["id"] for t in spec["tasks"]}) == len(spec["tasks"])
    for t in spec["tasks"]:
        assert t["chat"] and t["continuation"], t["id"]
        if t.get("reference"):
            assert t["reference"] in spec["documents"]
    model = load_model(fixture_path("qwen3"))
    tasks = bench.load_tasks(model, "continuation")
    assert len(tasks) == len(spec["tasks"])
    tok = model.tokenizer
    for t, raw in zip(tasks, spec["tasks"]):
        text = tok.decode(t.prompt_ids)
        assert "{" + "lighthouse}" not in text and "{code_" not in text  # placeholders were filled
        if raw.get("reference"):
            assert tok.decode(t.reference_ids) == spec["documents"][raw["reference"]]
    quick = bench.load_tasks(model, "continuation", quick=True)
    assert [t.cls for t in quick] == list(bench.CLASSES)


def test_replay_prices_a_model_with_its_own_measured_table(fixture_path, load_model, load_script, capsys,
                                                           monkeypatch):
    """bench/replay.py --cost-table MODEL=measure: the replay's prices come from the model's own probe (printed), one
    cost per verify bucket, not from the shipped table (Gemma 3's)."""
    from fucina_jax import engine
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.speculative import DEFAULT_COST_TABLE

    monkeypatch.setattr(sys, "path", list(sys.path))  # bench/replay.py puts bench/ on it: undone after the test
    replay = load_script("bench/replay.py")
    path = fixture_path("qwen3")
    options = replay.measured_prices(load_model(path), SamplerConfig(temperature=0.0, seed=0), 96)
    table = options.cost_table
    assert [p.draft_len for p in table] == [w - 1 for w in engine.VERIFY_BUCKETS]
    assert all(p.cost >= 1.0 for p in table) and table != DEFAULT_COST_TABLE
    printed = capsys.readouterr().out
    assert os.path.basename(path) in printed and "greedy" in printed


def test_replay_at_a_live_cost_curve(gemma3, load_script, monkeypatch):
    """bench/replay.py --live's "@live" column: live step times as costs in plain steps (live_costs), and the replay
    priced at them (replay_at): at the priced table's own costs it is the replay; plain steps of the speculative run
    dearer than the plain run's (costs[1] > 1) add their excess to the speculative time."""
    import dataclasses

    from fucina_jax import engine
    from fucina_jax.index.cascade import SpeculationIndex
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.speculative import SpecOptions
    from fucina_jax.speculative import replay as R
    from fucina_jax.speculative.gate import CostPoint, table_cost

    monkeypatch.setattr(sys, "path", list(sys.path))  # bench/replay.py puts bench/ on it: undone after the test
    replay = load_script("bench/replay.py")
    assert replay.live_costs({1: [10, 50.0], 4: [5, 30.0], 8: [0, 0.0]}, 5.0) == {1: 1.0, 4: 1.2}
    model = gemma3
    prompt = model.tokenizer.encode("Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday, Tuesday,",
                                    add_special=True)
    rec = R.record(model, prompt, max_tokens=24, sampler=SamplerConfig(temperature=0.0))
    options = SpecOptions()
    costs = {w: table_cost(options.cost_table, w - 1) for w in engine.VERIFY_BUCKETS}
    src = lambda: SpeculationIndex(model.config.n_vocab)
    rp = R.replay([rec], sources=[src()], options=options)
    assert any(w > 1 for w in rp.widths)  # verifies ran: their prices are what the curve changes
    assert replay.replay_at(rec, src(), options, {1: 1.0, **costs}) == pytest.approx(rp.speedup)
    dear = {1: 1.25, **costs}
    plain_steps = rp.steps - sum(n for w, n in rp.widths.items() if w > 1)
    assert plain_steps > 0
    assert replay.replay_at(rec, src(), options, dear) == pytest.approx(
        rp.plain_time / (rp.time + 0.25 * plain_steps))
    # a width the live runs never used keeps the table's price; a measured one is priced as measured
    steep = {w: c * 2 for w, c in costs.items()}
    slow = R.replay([rec], sources=[src()], options=dataclasses.replace(
        options, cost_table=tuple(CostPoint(w - 1, c) for w, c in steep.items())))
    assert replay.replay_at(rec, src(), options, {1: 1.0, **steep}) == pytest.approx(slow.speedup)
    # the ceiling at a curve: the hindsight replay at the same costs, never below the learned policy there
    top = R.replay([rec], sources=[src()], options=SpecOptions(min_gain=0.0), hindsight=True)
    assert replay.replay_at(rec, src(), SpecOptions(min_gain=0.0), {1: 1.0, **costs}, hindsight=True) == \
        pytest.approx(top.speedup)
    assert replay.replay_at(rec, src(), options, dear, hindsight=True) >= replay.replay_at(rec, src(), options, dear)
