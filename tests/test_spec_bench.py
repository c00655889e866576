"""The --spec-bench probe: it measures every verify bucket, its JSON round-trips into the cost gate, bad files raise,
and the shipped default table is the probe's own output."""

from __future__ import annotations

import io
import json
import math
import time

import pytest

from fucina_jax import engine
from fucina_jax.errors import CostTableError, SpecOptionsError
from fucina_jax.speculative import DEFAULT_BATCH_COSTS, DEFAULT_COST_TABLE, CostGate, CostPoint, SpecOptions
from fucina_jax.speculative.bench import (
    DEFAULT_TABLE_PATH,
    load_batch_costs,
    load_cost_table,
    run_spec_bench,
)


@pytest.fixture(scope="module")
def probe(fixture_path, load_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_bench")
    model = load_model(fixture_path("qwen3"))
    out = io.StringIO()
    result = run_spec_bench(model, json_path=str(d / "t.json"), png_path=str(d / "t.png"), reps=2, rounds=1,
                            prompt_len=24, batch_rows=(2,), progress=False, command="test", out=out)
    return result, d, out.getvalue()


def test_probe_measures_every_bucket(probe):
    result, d, printed = probe
    assert [r[0] for r in result.rows] == list(engine.VERIFY_BUCKETS)
    assert [r[1] for r in result.rows] == [w - 1 for w in engine.VERIFY_BUCKETS]
    for _, _, cost, measured, verify_ms in result.rows:
        assert cost == max(measured, 1.0) and math.isfinite(cost)
        assert verify_ms > 0
    assert result.plain_ms > 0
    assert [(r, w) for r, w, _ in result.batch] == [(2, w) for w in (1, *engine.VERIFY_BUCKETS)]
    assert all(math.isfinite(c) and c >= 1.0 for _, _, c in result.batch)
    assert "draft slots" in printed and "--cost-table" in printed and "C_B(16)" in printed
    with open(d / "t.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_json_round_trips_into_the_gate(probe):
    result, d, _ = probe
    doc = json.loads((d / "t.json").read_text())
    for key in ("model", "date", "machine", "plain_ms", "table", "command"):
        assert key in doc
    assert [e["width"] for e in doc["table"]] == list(engine.VERIFY_BUCKETS)
    table = load_cost_table(d / "t.json")
    assert table == tuple(CostPoint(d_, round(c, 4)) for _, d_, c, _, _ in result.rows)
    batch = load_batch_costs(d / "t.json")
    assert batch == tuple((r, w, round(c, 4)) for r, w, c in result.batch)
    gate = CostGate(SpecOptions(cost_table=table, batch_costs=batch))
    # Without a clock the gate prices a verify straight from the table (never below one plain step), and a batch
    # step from the batch surface.
    for p in table:
        assert gate.verify_cost(p.draft_len) == pytest.approx(max(p.cost, 1.0))
    for r, w, c in batch:
        if w > 1:
            assert gate.step_cost(w, rows=r) == pytest.approx(c)


def _write(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, what",
    [
        ("not json {", "not a JSON cost table"),
        ("[1, 2]", "no 'table'"),
        ('{"table": []}', "non-empty list"),
        ('{"table": [{"draft_len": 1}]}', "'draft_len' and 'cost'"),
        ('{"table": [{"draft_len": 0, "cost": 1.0}]}', "draft_len = 0"),
        ('{"table": [{"draft_len": 1.5, "cost": 1.0}]}', "draft_len = 1.5"),
        ('{"table": [{"draft_len": 1, "cost": -1}]}', "cost = -1"),
        ('{"table": [{"draft_len": 1, "cost": "1.2"}]}', "cost = '1.2'"),
        ('{"table": [{"draft_len": 1, "cost": NaN}]}', "cost = nan"),
        ('{"table": [{"draft_len": 3, "cost": 1.1}, {"draft_len": 3, "cost": 1.2}]}', "strictly increase"),
        ('{"format": "other", "table": [{"draft_len": 1, "cost": 1.0}]}', "format 'other'"),
        ('{"table": [{"draft_len": 1, "cost": 1%s}]}' % ("0" * 400), "cost = 1000000000"),  # past float's range
        ("[" * 100000 + "]" * 100000, "not a JSON cost table"),  # nesting past Python's recursion limit
        ('{"table": [{"draft_len": 1, "cost": 1.0}], "batch": {}}', "'batch' must be a list"),
        ('{"table": [{"draft_len": 1, "cost": 1.0}], "batch": [{"rows": 2, "width": 2}]}', "'rows', 'width'"),
        ('{"table": [{"draft_len": 1, "cost": 1.0}], "batch": [{"rows": 1, "width": 2, "cost": 1}]}', "rows = 1"),
        ('{"table": [{"draft_len": 1, "cost": 1.0}], "batch": [{"rows": 2, "width": 2, "cost": 0}]}', "cost = 0"),
        ('{"table": [{"draft_len": 1, "cost": 1.0}], "batch": [{"rows": 2, "width": 2, "cost": 1.2}, '
         '{"rows": 2, "width": 2, "cost": 1.3}]}', "repeats rows = 2, width = 2"),
    ],
)
def test_bad_files_raise(tmp_path, text, what):
    with pytest.raises(CostTableError, match=None) as e:
        path = _write(tmp_path, text)
        load_cost_table(path)
        load_batch_costs(path)
    assert what in str(e.value)
    assert isinstance(e.value, SpecOptionsError)  # callers catching option errors see it too


def test_missing_file_raises(tmp_path):
    with pytest.raises(CostTableError, match="not found"):
        load_cost_table(tmp_path / "nope.json")


def test_shipped_default_table_is_probe_output():
    """The package ships the probe's JSON for the embedded model, and it loads into a valid gate."""
    with open(DEFAULT_TABLE_PATH) as f:
        doc = json.load(f)
    assert doc["model"].startswith("gemma-3-270m")
    assert any(s in doc["command"] for s in ("spec.bench", "speculative.bench", "--spec-bench"))
    table = load_cost_table(DEFAULT_TABLE_PATH)
    assert [p.draft_len for p in table] == [w - 1 for w in engine.VERIFY_BUCKETS]
    assert table == DEFAULT_COST_TABLE  # the gate's default is this file, not a typed-in copy
    assert load_batch_costs(DEFAULT_TABLE_PATH) == DEFAULT_BATCH_COSTS
    assert {(r, w) for r, w, _ in DEFAULT_BATCH_COSTS} == {(r, w) for r in (2, 4, 8) for w in (1, *engine.VERIFY_BUCKETS)}
    CostGate(SpecOptions(cost_table=table))


def test_a_shipped_table_per_kernel_instruction_set():
    """Both shipped tables are probe output for every verify bucket, and the one the gate starts from is the one of
    the instruction set the kernels run on this CPU (detected from /proc/cpuinfo, without the kernels)."""
    import os

    from fucina_jax import kernels

    here = os.path.dirname(DEFAULT_TABLE_PATH)
    tables = {isa: os.path.join(here, name) for isa, name in
              (("avx512", "default_cost_table.json"), ("avx2", "default_cost_table_avx2.json"))}
    for path in tables.values():
        with open(path) as f:
            command = json.load(f)["command"]
        assert any(s in command for s in ("spec.bench", "speculative.bench"))
        assert [p.draft_len for p in load_cost_table(path)] == [w - 1 for w in engine.VERIFY_BUCKETS]
    if kernels.available():
        fast = kernels.supported_isas()[0] == "avx512" and os.environ.get("FUCINA_KERNEL_ISA") in (None, "avx512")
        assert DEFAULT_TABLE_PATH == tables["avx512" if fast else "avx2"]


# ---- the CLI: --spec-bench and --cost-table -----------------------------------------------------------------------


def test_cli_spec_bench_writes_a_table_the_cli_loads(fixture_path, tmp_path, capsys):
    from fucina_jax import cli

    path = fixture_path("qwen3")
    base = str(tmp_path / "probe")
    assert cli.main([path, "--spec-bench", "--spec-bench-out", base, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "draft slots" in out and f"--cost-table {base}.json" in out
    with open(base + ".json") as f:
        doc = json.load(f)
    assert doc["command"].startswith("python scripts/generate.py") or "--spec-bench" in doc["command"]
    assert [e["width"] for e in doc["table"]] == list(engine.VERIFY_BUCKETS)
    assert (tmp_path / "probe.png").exists()
    # the table drives a speculative run
    rc = cli.main([path, "--prompt", "abcabcabcabc", "--gen", "8", "--temperature", "0", "--cost-table",
                   base + ".json", "--json", "--quiet"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["spec"] is not None and res["n_gen"] > 0


def test_cli_spec_bench_without_matplotlib_writes_the_table_and_skips_the_plot(probe, fixture_path, tmp_path,
                                                                               capsys, monkeypatch):
    """matplotlib is in the [bench] extra only: without it the table is still written, one line says the plot was
    skipped and how to get it, and the run succeeds (it used to end in a ModuleNotFoundError traceback)."""
    import sys

    from fucina_jax import cli
    from fucina_jax.speculative import bench

    result, _, _ = probe
    monkeypatch.setattr(bench, "measure_cost_table", lambda model, **kw: result)  # the probe's: no second timing
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    base = str(tmp_path / "probe")
    assert cli.main([fixture_path("qwen3"), "--spec-bench", "--spec-bench-out", base, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    with open(base + ".json") as f:
        assert [e["width"] for e in json.load(f)["table"]] == list(engine.VERIFY_BUCKETS)
    assert not (tmp_path / "probe.png").exists()
    (line,) = [ln for ln in captured.out.splitlines() if "matplotlib" in ln]
    assert line.startswith(f"skipped the plot {base}.png") and "pip install matplotlib" in line and "[bench]" in line


def test_cli_bad_cost_table_is_one_error_line(fixture_path, tmp_path, capsys):
    from fucina_jax import cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"table": [{"draft_len": 3, "cost": 0}]}')
    rc = cli.main([fixture_path("qwen3"), "--prompt", "x", "--cost-table", str(bad), "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error: ") and "cost = 0" in err and "Traceback" not in err
    rc = cli.main([fixture_path("qwen3"), "--prompt", "x", "--cost-table", str(tmp_path / "missing.json")])
    assert rc != 0 and "not found" in capsys.readouterr().err


@pytest.mark.parametrize("base, what", [
    ("{tmp}/missing-dir/bench", "does not exist"),
    ("", "names a directory"),
    ("{tmp}/", "names a directory"),
    ("{tmp}/taken", "is a directory"),
])
def test_cli_spec_bench_out_is_checked_before_the_benchmark(fixture_path, tmp_path, capsys, base, what):
    """A bad --spec-bench-out fails at once (no model loaded, no ~30 s benchmark lost), with one error line."""
    from fucina_jax import cli

    (tmp_path / "taken.png").mkdir()
    t0 = time.perf_counter()
    rc = cli.main([fixture_path("qwen3"), "--spec-bench", "--spec-bench-out", base.format(tmp=tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --spec-bench-out") and what in err
    assert time.perf_counter() - t0 < 5
    assert not list(tmp_path.glob("*.json"))


def test_module_cli_passes_its_options_to_the_probe(fixture_path, monkeypatch, probe):
    """`python -m fucina_jax.speculative.bench`: --prompt-len, --greedy, --reps/--rounds and --batch-rows reach the
    probe; a bad --prompt-len or --batch-rows is a usage error before any model loads."""
    from fucina_jax.speculative import bench

    result, _, _ = probe
    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        return result

    monkeypatch.setattr(bench, "measure_cost_table", fake)
    args = [fixture_path("qwen3"), "--json", "", "--png", "", "--prompt-len", "37", "--greedy", "--reps", "3",
            "--rounds", "2", "--batch-rows", "2,4"]
    assert bench.main(args) == 0
    assert seen["prompt_len"] == 37 and seen["reps"] == 3 and seen["rounds"] == 2 and seen["batch_rows"] == (2, 4)
    assert seen["sampler"].temperature == 0.0
    for bad in (["--prompt-len", "0"], ["--batch-rows", "1"]):
        with pytest.raises(SystemExit) as e:
            bench.main([fixture_path("qwen3"), *bad])
        assert e.value.code == 2
