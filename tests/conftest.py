"""Shared fixtures: tiny GGUF models written once per session, the real models loaded once, llama.cpp references.

llama.cpp (through llama-cpp-python) is the independent implementation every parity test compares against.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests draft from private indexes unless they opt in (tests/test_draft_memory.py): the user's persisted draft memory
# would otherwise carry state from one test (and one run) into the next.
os.environ.setdefault("FUCINA_JAX_NO_PERSIST", "1")


@pytest.fixture(scope="session")
def load_script():
    """load_script("scripts/x.py") -> the repository's script as a module (registered in sys.modules under its own
    name: dataclasses resolve string annotations through it), its main() not run."""
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def load(relpath: str):
        name = "fucina_script_" + relpath.replace("/", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, relpath))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_fixtures")


@pytest.fixture(scope="session")
def fixture_path(fixture_dir):
    """fixture_path(kind) -> path of the tiny random GGUF `kind` (written on first use)."""
    from fucina_jax.testing import write_fixture

    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = write_fixture(fixture_dir / f"{kind}.gguf", kind)
        return cache[kind]

    return get


_MODELS: dict[str, object] = {}


def load_cached(path: str):
    import fucina_jax

    if path not in _MODELS:
        _MODELS[path] = fucina_jax.load(path)
    return _MODELS[path]


@pytest.fixture(scope="session")
def load_model():
    return load_cached


@pytest.fixture(scope="session")
def gemma3_path():
    from fucina_jax.model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    return load_cached(gemma3_path)


@pytest.fixture(scope="session")
def smollm2_path():
    from fucina_jax.testing import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return load_cached(smollm2_path)


class LlamaRef:
    """llama.cpp as the reference: logits of every position, and greedy continuations."""

    def __init__(self, path: str, n_ctx: int = 1024, f32_cache: bool = True):
        from fucina_jax.testing import open_llama_cpp

        kw = dict(type_k=0, type_v=0) if f32_cache else {}  # GGML_TYPE_F32 K/V cache: no f16 rounding of K/V
        self.llm = open_llama_cpp(path, n_ctx=n_ctx, n_batch=512, logits_all=True, verbose=False, n_threads=2, seed=0, **kw)

    def logits(self, ids) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(map(int, ids)))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids, n: int) -> tuple[list[int], np.ndarray]:
        """n greedy tokens after ids, and the logits row that picked each."""
        self.llm.reset()
        ids = list(map(int, ids))
        self.llm.eval(ids)
        out, rows = [], []
        for _ in range(n):
            row = np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)
            tok = int(row.argmax())
            out.append(tok)
            rows.append(row)
            self.llm.eval([tok])
        return out, np.stack(rows)


_REFS: dict[tuple, LlamaRef] = {}


@pytest.fixture(scope="session")
def llama_ref():
    """llama_ref(path, **kw) -> a cached LlamaRef (closed at session end, before the interpreter tears down
    the llama_cpp module its destructor needs)."""
    yield _get_ref
    for ref in _REFS.values():
        ref.llm.close()
    _REFS.clear()


def _get_ref(path: str, **kw) -> LlamaRef:
    key = (path, tuple(sorted(kw.items())))
    if key not in _REFS:
        _REFS[key] = LlamaRef(path, **kw)
    return _REFS[key]



@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test module, drop the compiled programs this process holds (fucina_jax.clear_caches; the next
    module loads the ones it needs from the persistent store). Each program keeps its machine code mapped, and one
    process running the whole suite (every fixture model, every bucket shape) once died in XLA's executable
    serialization near the kernel's default vm.max_map_count of 65530."""
    yield
    import fucina_jax

    fucina_jax.clear_caches()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(kind, qtype) -> (model on the kernels, the same file on the f32 reference path, its path): a tiny
    fixture with weights of that type, written and loaded once per test module."""
    import fucina_jax
    from fucina_jax.testing import write_fixture, write_gemma4_fixture

    cache = {}
    root = tmp_path_factory.mktemp("qfixtures")

    def get(kind: str, qtype: str):
        if (kind, qtype) not in cache:
            path = str(root / f"{kind}-{qtype}.gguf")
            if kind.startswith("gemma4"):
                write_gemma4_fixture(path, kind.partition("-")[2], qtype=qtype)
            else:
                write_fixture(path, kind, qtype=qtype)
            cache[kind, qtype] = (fucina_jax.load(path), fucina_jax.load(path, f32=True), path)
        return cache[kind, qtype]

    return get
