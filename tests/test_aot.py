"""aot.jit: a program kept on disk runs what jax.jit runs, in a new process without tracing; a corrupt entry, a
changed argument or a tracer never reaches a wrong program.

The cross-process cases run in fresh interpreters (JAX's caches are per process) on a temporary cache directory;
each reports its result, what it traced (JAX's own log) and what it loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax import aot, sampling
from fucina_jax.model import enable_compilation_cache

CODE = r"""
import json, logging, sys
import numpy as np, jax
from fucina_jax import aot, sampling
from fucina_jax.model import enable_compilation_cache

traced = []


class Traces(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Finished tracing "):
            traced.append(record.getMessage().split()[2])


jax.config.update("jax_log_compiles", True)
log = logging.getLogger("jax")
log.addHandler(Traces())
log.setLevel(logging.WARNING)
log.propagate = False
enable_compilation_cache()
step = sampling.push_history.jitted if sys.argv[1] == "jit" else sampling.push_history
args = sampling.history_from_tokens([3, 1, 4, 1, 5], 8), np.asarray([9, 2, 6], np.int32), np.int32(2)
if sys.argv[1] == "prepare":  # the program brought in first: the call itself then only runs it
    step.prepare(*args)
before_call = aot.events()
out = step(*args)
call_events = aot.events() - before_call
if len(sys.argv) > 2:  # then a plain jax.jit compile: JAX's own cache must still be on after the bypass
    sampling.push_history.jitted(sampling.history_from_tokens([1], 16), np.asarray([7], np.int32), np.int32(1))
print("RESULT", json.dumps({"out": [np.asarray(x).tolist() for x in out], "traced": traced,
                            "loaded": sum(aot.LOADED.values()), "compiled": sum(aot.COMPILED.values()),
                            "counted": dict(aot.TRACED), "events": aot.events(), "call_events": call_events}))
"""

PUSH = "fucina_jax.sampling.push_history"  # push_history's Step.name, its key in aot.TRACED


def run(cache_dir, how: str, *extra: str, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "FUCINA_JAX_NO_CACHE"}
    env.update(FUCINA_JAX_CACHE_DIR=str(cache_dir), **env_extra)
    proc = subprocess.run([sys.executable, "-c", CODE, how, *extra], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1]), proc.stderr


def entries(cache_dir, suffix: str):
    d = cache_dir / aot.SUBDIR
    return sorted(p for p in d.glob(f"push_history-*{suffix}")) if d.exists() else []


def test_a_kept_program_runs_in_a_new_process_without_tracing(tmp_path):
    # The plain jax.jit run fills JAX's persistent cache first: the aot run must still compile for real (an
    # executable that cache hands back reloads without its kernels and fails to run), and not reuse it.
    plain, _ = run(tmp_path, "jit")
    assert plain["counted"] == {PUSH: 1}  # the jax.jit function counts its traces too
    first, _ = run(tmp_path, "aot")
    assert first["traced"] == ["push_history"] and first["loaded"] == 0 and first["compiled"] == 1
    assert first["counted"] == {PUSH: 1} and first["events"] == first["call_events"] == 1
    assert len(entries(tmp_path, ".key")) == len(entries(tmp_path, ".bin")) == 1
    second, _ = run(tmp_path, "aot")
    assert second["traced"] == [] and second["loaded"] == 1 and second["compiled"] == 0
    assert second["counted"] == {} and second["events"] == second["call_events"] == 1  # a load is an event
    assert first["out"] == second["out"] == plain["out"]
    assert plain["out"][0][:7] == [3, 1, 4, 1, 5, 9, 2]  # the program did its work: a real comparison
    assert len(entries(tmp_path, ".key")) == len(entries(tmp_path, ".bin")) == 1


def test_prepare_brings_the_program_in_and_the_call_only_runs_it(tmp_path):
    """prepare() compiles (a new store) or loads (a warm one) the program; the call after it moves events() by 0."""
    cold, _ = run(tmp_path, "prepare")
    assert cold["traced"] == ["push_history"] and cold["compiled"] == 1 and cold["counted"] == {PUSH: 1}
    assert cold["events"] == 1 and cold["call_events"] == 0
    warm, _ = run(tmp_path, "prepare")
    assert warm["traced"] == [] and warm["loaded"] == 1 and warm["counted"] == {}
    assert warm["events"] == 1 and warm["call_events"] == 0
    unprepared, _ = run(tmp_path, "aot")
    assert cold["out"] == warm["out"] == unprepared["out"]
    assert cold["out"][0][:7] == [3, 1, 4, 1, 5, 9, 2]


def test_a_new_environment_with_the_same_module_reuses_the_program(tmp_path):
    """Another environment (here a JAX option that changes no program; in use, an edit to fucina_jax) traces and
    lowers again, and finds the program by the lowered module: no compile."""
    first, _ = run(tmp_path, "aot")
    other, _ = run(tmp_path, "aot", JAX_TRACEBACK_FILTERING="off")
    assert other["traced"] == ["push_history"] and other["loaded"] == 0 and other["compiled"] == 0
    assert other["out"] == first["out"]
    assert len(entries(tmp_path, ".key")) == 2 and len(entries(tmp_path, ".bin")) == 1


def test_a_corrupt_entry_is_compiled_again_and_replaced(tmp_path):
    good, _ = run(tmp_path, "aot")
    (program,) = entries(tmp_path, ".bin")
    size = program.stat().st_size
    program.write_bytes(program.read_bytes()[: size // 2])
    again, err = run(tmp_path, "aot")
    assert "ignoring the unreadable compiled step" in err
    assert again["traced"] == ["push_history"] and again["compiled"] == 1 and again["out"] == good["out"]
    assert program.stat().st_size == size
    (key,) = entries(tmp_path, ".key")
    key.write_bytes(b"../../elsewhere.bin")  # a key naming no program of the store
    named, _ = run(tmp_path, "aot")
    assert named["traced"] == ["push_history"] and named["compiled"] == 0 and named["out"] == good["out"]
    last, _ = run(tmp_path, "aot")
    assert last["loaded"] == 1 and last["traced"] == [] and last["out"] == good["out"]


def test_the_bypass_leaves_jax_cache_on_for_everything_else(tmp_path):
    run(tmp_path, "aot", "then-jit")
    assert len(entries(tmp_path, ".bin")) == 1
    assert [p.name for p in tmp_path.glob("jit_push_history-*") if not p.name.endswith("-atime")], \
        "the plain jax.jit compile after the aot one wrote no entry to JAX's cache"


def test_without_the_cache_it_is_plain_jit(tmp_path):
    out, _ = run(tmp_path, "aot", FUCINA_JAX_NO_CACHE="1")
    assert out["traced"] == ["push_history"] and out["loaded"] == 0
    assert out["counted"] == {PUSH: 1} and out["call_events"] == 1
    assert not (tmp_path / aot.SUBDIR).exists()


@aot.jit(static_argnames=("scale",), donate_argnames=("acc",))
def _scaled(p, acc, scale):
    return acc + p["w"].astype(jnp.float32) * scale + p["b"].sum()


def _reference(p, acc, scale):
    return np.asarray(acc, np.float32) + np.asarray(p["w"], np.float32) * scale + np.asarray(p["b"]).sum()


@pytest.fixture()
def store_on():
    enable_compilation_cache()
    if aot._store() is None:
        pytest.fail("the step store is off (FUCINA_JAX_NO_CACHE set?): this test checks the aot path")


def test_in_process_calls_match_jit_whatever_changes_between_them(store_on):
    """The per-call key leaves dtypes and a dict argument's contents to the program's own check: a dict mutated in
    place (same id, other dtype or shape), a new but equal static value, other shapes: each result is the one
    jax.jit gives."""
    before = _scaled._cache_size()
    p = {"w": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)}
    p_ref = dict(p)
    out = _scaled(p, jax.device_put(np.zeros(4, np.float32)), 2.0)
    np.testing.assert_array_equal(out, _reference(p_ref, np.zeros(4), 2.0))
    p["w"] = np.arange(4, dtype=np.int32)  # same dict, same shapes, another dtype
    np.testing.assert_array_equal(_scaled(p, jnp.ones(4), 2.0), _reference(p, np.ones(4), 2.0))
    np.testing.assert_array_equal(_scaled(p, jnp.ones(4), float("2.0")), _reference(p, np.ones(4), 2.0))  # equal
    p["b"] = np.ones(5, np.float32)  # another shape inside the dict
    np.testing.assert_array_equal(_scaled(p, jnp.ones(4), 2.0), _reference(p, np.ones(4), 2.0))
    np.testing.assert_array_equal(_scaled(p, jnp.ones(4), 3.0), _reference(p, np.ones(4), 3.0))
    q = {"w": np.arange(6, dtype=np.float32), "b": np.zeros(1, np.float32)}
    np.testing.assert_array_equal(_scaled(q, jnp.ones(6), 3.0), _reference(q, np.ones(6), 3.0))
    assert _scaled._cache_size() == before + 5  # one program per distinct call above; the equal static reuses one
    # a function outside fucina_jax keeps its programs in this process only (the key does not cover its source)
    store = aot._store()
    assert not (os.path.isdir(store) and any(f.name.startswith("_scaled-") for f in os.scandir(store)))


def test_programs_that_drop_an_argument_are_kept_per_argument_shape(store_on):
    """A program that never reads an argument lowers to the same module text whatever that argument's shape (the raw
    greedy pick ignores the penalty history); each shape still runs a program built for its own avals."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 50)), jnp.float32)
    params = sampling.SamplerConfig(temperature=0).params()
    for w in (64, 40, 64):
        hist = sampling.history_from_tokens([1, 2, 3], w)
        got = sampling.sample_rows(logits, jnp.arange(2), hist, None, params, cap=sampling.GREEDY_UNPENALIZED)
        assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1)), w


def test_donation_is_kept(store_on):
    p = {"w": np.ones(4, np.float32), "b": np.zeros(1, np.float32)}
    acc = jax.device_put(np.zeros(4, np.float32))
    _scaled(p, acc, 1.0)
    assert acc.is_deleted()


def test_tracers_go_to_jit(store_on):
    """Inside the user's own jit (and under grad) a step is an ordinary nested jit."""
    hist = sampling.history_from_tokens([7, 8], 6)
    new = jnp.asarray([1, 2, 3], jnp.int32)
    inner = jax.jit(lambda h, n: sampling.push_history(h, n, jnp.int32(3)))(hist, new)
    outer = sampling.push_history.jitted(hist, new, jnp.int32(3))
    np.testing.assert_array_equal(inner.tokens, outer.tokens)
    assert inner.tokens[:5].tolist() == [7, 8, 1, 2, 3]
    p = {"w": jnp.ones(3), "b": jnp.zeros(1)}
    g = jax.grad(lambda w: _scaled({"w": w, "b": p["b"]}, jnp.zeros(3), 2.0).sum())(p["w"])
    np.testing.assert_array_equal(g, np.full(3, 2.0, np.float32))
    # a Python scalar inside a dict argument goes to jax.jit as well (it has no array signature)
    np.testing.assert_array_equal(_scaled({"w": np.ones(3, np.float32), "b": 2.0}, jnp.zeros(3), 1.0), np.full(3, 3.0))


def test_the_store_keeps_only_the_latest_environments(tmp_path):
    """Each change to fucina_jax is a new environment: a store keeps the keys of the current one and of the most
    recently used others (KEEP_ENVIRONMENTS in all) whatever their age, the programs those keys name, programs
    younger than an hour (written just before their key), and every other file."""
    now = time.time()
    current = aot._env_tag()
    others = ["a" * 12, "b" * 12, "c" * 12, "d" * 12]  # most recent first
    for age, tag in enumerate([current] + others):
        for k in "01":
            program = f"prefill_step-{age:016d}{k * 16}.bin"
            (tmp_path / program).write_bytes(b"x")
            key = tmp_path / f"prefill_step-{tag}-{k * 32}.key"
            key.write_text(program)
            t = now - 7200 - 1000 * (age if tag != current else 99)
            os.utime(key, (t, t))
            os.utime(tmp_path / program, (t, t))
    (tmp_path / "young.bin").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("kept")
    aot._pruned.cache_clear()
    aot._pruned(str(tmp_path))
    kept = [current] + others[: aot.KEEP_ENVIRONMENTS - 1]
    assert sorted({p.name.split("-")[1] for p in tmp_path.glob("*.key")}) == sorted(kept)
    assert sorted(p.name for p in tmp_path.glob("prefill_step-*.bin")) == sorted(
        f"prefill_step-{age:016d}{k * 16}.bin" for age in range(aot.KEEP_ENVIRONMENTS) for k in "01")
    assert (tmp_path / "young.bin").exists() and (tmp_path / "notes.txt").read_text() == "kept"


def test_programs_are_keyed_to_the_kernel_build(tmp_path, monkeypatch):
    """A program calls the kernels' FFI handlers: one compiled against another build of the extension (same module
    text) must not be found (a stale one crashed in a rebuilt library)."""
    monkeypatch.setattr(aot, "_store", lambda: str(tmp_path))
    lowered = jax.jit(lambda x: x + 1).lower(np.float32(1))
    this_build = aot._program_path("f", lowered)
    monkeypatch.setattr(aot, "_native", lambda: b"another build of the kernels")
    assert aot._program_path("f", lowered) != this_build


def test_clear_caches_drops_every_program_and_the_steps_still_work(store_on):
    """A long-lived process that loads many model shapes frees their programs with fucina_jax.clear_caches()."""
    import fucina_jax

    p = {"w": np.arange(4, dtype=np.float32), "b": np.ones(3, np.float32)}
    first = np.asarray(_scaled(p, jnp.ones(4), 2.0))
    assert _scaled._cache_size() > 0
    fucina_jax.clear_caches()
    assert _scaled._cache_size() == 0
    np.testing.assert_array_equal(_scaled(p, jnp.ones(4), 2.0), first)
    assert _scaled._cache_size() > 0


def _fresh_step():
    """A new aot.jit function (no program of it is held anywhere yet), outside fucina_jax: kept in this process."""

    def fresh(p, acc, scale):
        return acc + p["w"].astype(jnp.float32) * scale + p["b"].sum()

    return aot.jit(fresh, static_argnames=("scale",), donate_argnames=("acc",))


@pytest.fixture(params=["store", "plain jit"])
def path(request, monkeypatch):
    """Both ways a call goes: the step's own programs (the store on), or the jax.jit function (the store off)."""
    if request.param == "store":
        enable_compilation_cache()
        if aot._store() is None:
            pytest.fail("the step store is off (FUCINA_JAX_NO_CACHE set?): this test checks the aot path")
    else:
        monkeypatch.setattr(aot, "_store", lambda: None)
    return request.param


def _params(n):
    return {"w": np.arange(n, dtype=np.float32), "b": np.ones(3, np.float32)}


def test_traced_counts_one_trace_per_new_shape_or_static_value(path):
    step = _fresh_step()
    counts = []

    def call(n, scale):
        out = step(_params(n), jnp.zeros(n), scale)
        np.testing.assert_array_equal(out, _reference(_params(n), np.zeros(n), scale))
        counts.append((aot.TRACED[step.name], aot.events()))

    traced, events = aot.TRACED[step.name], aot.events()
    call(4, 2.0)
    call(4, 2.0)  # a repeat: no trace
    call(6, 2.0)  # a new shape
    call(6, 2.0)
    call(6, 3.0)  # a new static value
    assert counts == [(traced + t, events + t) for t in (1, 1, 2, 2, 3)]


@pytest.mark.parametrize("spec", [False, True], ids=["arrays", "shape structs"])
def test_prepare_then_call_moves_no_event_and_gives_the_unprepared_result(path, spec):
    step = _fresh_step()
    p, acc = _params(5), jax.device_put(np.full(5, 0.5, np.float32))
    args = (p, acc)
    if spec:
        args = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    before = aot.events()
    step.prepare(*args, scale=2.0)
    assert aot.events() == before + 1  # traced here (and compiled)
    assert not acc.is_deleted()  # nothing ran: nothing was donated
    if path == "store":
        assert len(step._programs) == 1  # where the call looks first (not only jax.jit's caches)
    prepared = aot.events()
    out = step(p, acc, scale=2.0)
    assert aot.events() == prepared  # the call only ran the program
    assert acc.is_deleted()  # the call itself still donates
    unprepared = _fresh_step()(p, jax.device_put(np.full(5, 0.5, np.float32)), 2.0)
    np.testing.assert_array_equal(out, unprepared)
    np.testing.assert_array_equal(out, _reference(p, np.full(5, 0.5), 2.0))
