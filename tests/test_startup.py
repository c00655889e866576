"""Start-up: on the way to the first token, only the declared jitted steps compile, and on a warm start none.

An eager JAX op outside jit (jnp.asarray of a host value, jnp.zeros, x[0] on a device array) is a compile of its own
when cold and a compile-cache read when warm: 8-60 ms each, measured; ten of them once sat between load() and the
first token. Each case runs in a fresh interpreter (in-process caches would hide an op another test compiled
first) with JAX logging what it traces, on a quantized tiny model (the kernels' path) and the f32 path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = r"""
import logging, sys
import jax
import fucina_jax

traced = []


class Traces(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished tracing "):  # logged for top-level traces only: one per compiled program
            traced.append(msg.split()[2])


jax.config.update("jax_log_compiles", True)
log = logging.getLogger("jax")
log.addHandler(Traces())
log.setLevel(logging.WARNING)
log.propagate = False
path, f32, spec = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
m = fucina_jax.load(path, f32=f32)
traced.append("|loaded")
gen = m.generate("one two three one two", max_tokens=3, temperature=0, spec=spec)
first = next(iter(gen))
print("TRACED", " ".join(traced))
print("FIRST", first)
"""

# the jitted functions a generation may compile before its first token
STEPS = {"_zeros", "prefill_step", "sample_step", "decode_sample_step"}


@pytest.fixture(scope="module")
def q8_fixture(fixture_dir):
    from fucina_jax.testing import write_fixture

    return write_fixture(fixture_dir / "startup_gemma3_q8.gguf", "gemma3", qtype="Q8_0")


@pytest.mark.parametrize("f32, spec", [(False, False), (False, True), (True, False)],
                         ids=["kernels-plain", "kernels-spec", "f32-plain"])
def test_first_token_compiles_only_the_declared_steps(q8_fixture, tmp_path, f32, spec):
    """Cold (an empty cache directory): only the declared steps are traced. Warm (the directory the cold run
    filled): nothing at all is traced (aot.jit loads each step's program), and the first token is the same."""
    env = {**os.environ, "FUCINA_JAX_CACHE_DIR": str(tmp_path / "xla")}
    env.pop("FUCINA_JAX_NO_CACHE", None)

    def start():
        proc = subprocess.run([sys.executable, "-c", CODE, q8_fixture, "1" if f32 else "0", "1" if spec else "0"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = {ln.split()[0]: ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith(("TRACED", "FIRST"))}
        names = out["TRACED"]
        at = names.index("|loaded")
        assert names[:at] == []  # loading compiles nothing
        return names[at + 1 :], out["FIRST"]

    cold, first = start()
    assert "prefill_step" in cold  # the log is seen: the checks below can fail
    assert set(cold) <= STEPS, f"eager ops or undeclared programs before the first token: {sorted(set(cold) - STEPS)}"
    warm, again = start()
    assert warm == [], f"traced on a warm start: {warm}"
    assert again == first


DISPATCH = r"""
import sys
import jax
if sys.argv[2] == "1":
    jax.numpy.zeros(1).block_until_ready()  # the user's own JAX work made the CPU client first
import fucina_jax

m = fucina_jax.load(sys.argv[1])
print("ASYNC", jax.config.values["jax_cpu_enable_async_dispatch"])
for spec in (False, True):
    print("TOKENS", list(m.generate("one two three one two three one", max_tokens=16, temperature=0, spec=spec)))
"""


def test_load_prefers_inline_dispatch_and_it_changes_no_token(q8_fixture):
    """load() turns JAX's CPU async dispatch off (fucina_jax.model.prefer_inline_dispatch) unless the user set
    FUCINA_JAX_ASYNC_DISPATCH or the CPU client already exists; the stream is the same either way."""
    def run(env_extra, pre_init="0"):
        env = {k: v for k, v in os.environ.items() if k != "FUCINA_JAX_ASYNC_DISPATCH"} | env_extra
        out = subprocess.run([sys.executable, "-c", DISPATCH, str(q8_fixture), pre_init], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        return [l for l in lines if l.startswith("ASYNC")][0], [l for l in lines if l.startswith("TOKENS")]

    inline, toks = run({})
    assert inline == "ASYNC False"
    asked, toks_async = run({"FUCINA_JAX_ASYNC_DISPATCH": "1"})
    assert asked == "ASYNC True"
    early, toks_early = run({}, pre_init="1")
    assert early == "ASYNC True"
    assert len(toks) == 2 and toks[0] == toks[1]  # speculative == plain
    assert toks == toks_async == toks_early
