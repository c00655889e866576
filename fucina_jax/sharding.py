"""Tensor parallelism with JAX SPMD: logical axes for every parameter, a device mesh, NamedSharding placement.

The jitted steps in engine.py are not touched: jit propagates the shardings of its inputs (GSPMD/Shardy), so the
same prefill/decode/verify programs run on 1 or N devices. This module only decides where each array lives.

Two-level naming, as in MaxText/jax-llm-examples: each parameter dimension has a *logical* axis (PARAM_AXES, keyed by
the params-dict key every architecture uses), and MESH_RULES map logical axes to *mesh* axes:

  heads, kv_heads, ffn, expert_ffn, experts, vocab  -> "model"   (tensor parallelism)
  batch                                             -> "data"    (independent conversations)
  embed, head_dim, ple, None                        -> replicated

A dimension is split only when its unit count divides the mesh axis (heads count in heads, not in H*Dh columns, so a
split never cuts a head in two); otherwise it stays replicated, which is always correct, only less memory-efficient.
A mesh axis is used at most once per array: the first divisible logical axis takes it (expert tensors: experts,
falling back to the expert FFN width).

What that gives per layer with the model axis of size n (Megatron layout): Q/K/V projections split by heads (column
parallel), the attention output projection split on its input heads (row parallel, one all-reduce), gate/up split on
F and down on F (one all-reduce), the KV cache split on its kv-head axis, the vocabulary split for the embedding and
the logits. With fewer kv heads than devices (the tiny fixtures: 4 heads, 2 kv heads on 4 devices; Gemma 3 270M: 1
kv head) the K/V projections and the cache are replicated and every device attends its own query heads against the
full cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fucina_jax.errors import FucinaError, MeshError
from fucina_jax.model import Model
from fucina_jax.models.cache import KVCache, init_cache
from fucina_jax.models.config import LayerSpec, ModelConfig

__all__ = [
    "MESH_RULES",
    "PARAM_AXES",
    "MeshError",
    "ShardedModel",
    "cache_shardings",
    "cache_specs",
    "compare_sharded",
    "load_sharded",
    "main",
    "make_mesh",
    "new_sharded_cache",
    "param_axes",
    "param_shardings",
    "param_specs",
    "shard_cache",
    "shard_model",
    "shard_params",
]

# Logical axis of every dimension of every parameter, by params-dict key (global keys and per-layer keys share one
# namespace; shapes in NumPy order, matrices stored (Out, In) as in GGUF).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    # global
    "token_embd": ("vocab", "embed"),  # [V, D]
    "output": ("vocab", "embed"),  # [V, D]
    "output_norm": ("embed",),
    "rope_freqs": (None,),  # Gemma 4 proportional-RoPE factors [Dh/2]
    "per_layer_token_embd": ("vocab", None),  # Gemma 4 PLE [V, L*P]: the biggest tensor of E2B/E4B
    "per_layer_model_proj": (None, "embed"),  # [L*P, D]
    "per_layer_proj_norm": ("ple",),
    # attention
    "attn_norm": ("embed",),
    "attn_q": ("heads", "embed"),  # [H*Dh, D]
    "attn_k": ("kv_heads", "embed"),  # [K*Dh, D]
    "attn_v": ("kv_heads", "embed"),
    "attn_q_norm": ("head_dim",),
    "attn_k_norm": ("head_dim",),
    "attn_output": ("embed", "heads"),  # [D, H*Dh]
    "post_attention_norm": ("embed",),
    # dense FFN
    "ffn_norm": ("embed",),
    "ffn_gate": ("ffn", "embed"),  # [F, D]
    "ffn_up": ("ffn", "embed"),
    "ffn_down": ("embed", "ffn"),  # [D, F]
    "post_ffw_norm": ("embed",),
    # mixture of experts
    "ffn_gate_inp": ("experts", "embed"),  # router [E, D]
    "ffn_gate_inp_scale": ("embed",),
    "ffn_gate_exps": ("experts", "expert_ffn", "embed"),  # [E, Fe, D]
    "ffn_up_exps": ("experts", "expert_ffn", "embed"),
    # gate rows then up rows: a split of 2*Fe would cut across the halves the forward slices apart
    "ffn_gate_up_exps": ("experts", None, "embed"),  # [E, 2*Fe, D]
    "ffn_down_exps": ("experts", "embed", "expert_ffn"),  # [E, D, Fe]
    "ffn_down_exps_scale": ("experts",),
    "pre_ffw_norm_2": ("embed",),
    "post_ffw_norm_1": ("embed",),
    "post_ffw_norm_2": ("embed",),
    # Gemma 4 per-layer embeddings and output scale
    "inp_gate": ("ple", "embed"),  # [P, D]
    "proj": ("embed", "ple"),  # [D, P]
    "post_norm": ("embed",),
    "layer_output_scale": (None,),
}

# KV cache arrays [B, S, K, Dh] and lengths [B].
CACHE_AXES = ("batch", None, "kv_heads", "head_dim")
LENGTH_AXES = ("batch",)

MESH_RULES: dict[str, str] = {
    "heads": "model",
    "kv_heads": "model",
    "ffn": "model",
    "experts": "model",
    "expert_ffn": "model",
    "vocab": "model",
    "batch": "data",
}

MESH_AXES = ("data", "model")


def make_mesh(n_devices: int | None = None, *, data: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first n_devices devices (default: all): `data` rows of batch parallelism,
    n_devices // data devices of tensor parallelism each. data=1 is pure tensor parallelism.

    Axis types are Auto: shardings propagate through the unannotated model code (Explicit axes would require every
    einsum to state its output sharding)."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices) if n_devices is None else n_devices
    if not 1 <= n <= len(devices):
        raise MeshError(f"asked for {n} devices but {len(devices)} are visible ({devices[0].platform}); "
                         "on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts")
    if data < 1 or n % data:
        raise MeshError(f"data={data} must divide the device count {n}: pick a divisor of {n} for --data")
    return jax.make_mesh((data, n // data), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:n])


def _units(axis: str | None, size: int, cfg: ModelConfig | None, spec: LayerSpec | None) -> int:
    """How many indivisible units a dimension holds: heads for head axes (a head's Dh columns stay together)."""
    if axis == "heads" and cfg is not None:
        return cfg.n_heads
    if axis == "kv_heads" and spec is not None and size % spec.n_kv_heads == 0:
        return spec.n_kv_heads
    return size


def _partition(axes, shape, mesh: Mesh, cfg=None, spec=None) -> PartitionSpec:
    """Logical axes -> PartitionSpec: split where the unit count divides the mesh axis, else replicate."""
    used: set[str] = set()
    out = []
    for axis, size in zip(axes, shape):
        target = MESH_RULES.get(axis) if axis else None
        if (target is None or target in used or target not in mesh.shape or mesh.shape[target] == 1
                or _units(axis, size, cfg, spec) % mesh.shape[target]):
            out.append(None)
        else:
            used.add(target)
            out.append(target)
    return PartitionSpec(*out)


def param_axes(key: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of parameter `key`; an unknown key (a tensor this table does not list yet) is replicated."""
    axes = PARAM_AXES.get(key)
    if axes is None or len(axes) != ndim:
        return (None,) * ndim
    return axes


def param_specs(params, cfg: ModelConfig, mesh: Mesh):
    """A PartitionSpec for every array of the params pytree (arrays or anything with .shape; same structure)."""

    def one(key, x, spec=None):
        return _partition(param_axes(key, len(x.shape)), x.shape, mesh, cfg, spec)

    out = {k: one(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = tuple(
        {k: one(k, v, spec) for k, v in lp.items()} for lp, spec in zip(params["layers"], cfg.layers)
    )
    return out


def param_shardings(params, cfg: ModelConfig, mesh: Mesh):
    """A NamedSharding for every array of the params pytree (same structure)."""
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), param_specs(params, cfg, mesh),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """params (jax or NumPy arrays) placed with their NamedShardings; NumPy arrays go straight to their shards, so a
    model larger than one device never has to fit on one."""
    from fucina_jax.model import any_packed

    if any_packed(params):
        raise MeshError(
            "kernel weights (quantized or float) cannot be sharded (an FFI call runs on one device); load the model "
            "with fucina_jax.load(path, f32=True) or fucina_jax.sharding.load_sharded(path, mesh)"
        )
    return jax.device_put(params, param_shardings(params, cfg, mesh))


def cache_specs(cache: KVCache, mesh: Mesh) -> KVCache:
    """PartitionSpecs for a cache (or a cache of ShapeDtypeStructs): kv heads on "model", rows on "data"."""
    return KVCache(
        k=tuple(_partition(CACHE_AXES, x.shape, mesh) for x in cache.k),
        v=tuple(_partition(CACHE_AXES, x.shape, mesh) for x in cache.v),
        length=_partition(LENGTH_AXES, cache.length.shape, mesh),
    )


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), cache_specs(cache, mesh),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.device_put(cache, cache_shardings(cache, mesh))


def new_sharded_cache(cfg: ModelConfig, mesh: Mesh, capacity: int, batch: int = 1, dtype=None) -> KVCache:
    """An empty cache created directly in its shards (never materialised whole on one device)."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, capacity, batch, dtype))
    return jax.tree_util.tree_map(lambda x, sh: jnp.zeros(x.shape, x.dtype, device=sh),
                                  shapes, cache_shardings(shapes, mesh))


@dataclasses.dataclass
class ShardedModel(Model):
    """A Model whose params live in NamedShardings over `mesh` and whose new caches are sharded too.

    Everything else (logits, prefill, generate, the speculative decoder) is Model's own code running the same jitted
    steps: they read `params` and call `new_cache`, and jit follows the shardings it is given."""

    mesh: Mesh | None = None

    def new_cache(self, ctx: int | None = None, batch: int = 1) -> KVCache:
        return new_sharded_cache(self.config, self.mesh, ctx or self.default_ctx, batch)


def shard_model(model, mesh: Mesh):
    """A ShardedModel sharing `model`'s config, metadata and tokenizer, with its params placed over `mesh`.

    The source model's arrays stay where they were (donate them by dropping `model` if memory is tight)."""
    params = shard_params(model.params, model.config, mesh)
    out = ShardedModel(path=model.path, config=model.config, params=params, metadata=model.metadata,
                       _tokenizer=model._tokenizer, mesh=mesh)
    out.load_seconds = getattr(model, "load_seconds", None)
    return out


def load_sharded(path, mesh: Mesh):
    """Load a GGUF straight into shards: each dequantized host tensor is sent only to the devices holding a part of
    it, so no single device ever holds the whole model (fucina_jax.load places everything on device 0 first).
    The host still holds the whole f32 model once, between dequantization and placement."""
    from fucina_jax.gguf_io import open_gguf
    from fucina_jax.model import _n_vocab, default_model_path
    from fucina_jax.models import architecture
    from fucina_jax.models.loading import load_params

    t0 = time.perf_counter()
    gf = open_gguf(default_model_path() if path is None else path)
    arch = architecture(gf.architecture)
    cfg = arch.config_from_metadata(gf.metadata, _n_vocab(gf), has_output="output.weight" in gf.tensors)
    glob, layer = arch.tensor_table(cfg)
    np_params = load_params(gf, cfg.arch, glob, layer, cfg.n_layers)
    params = shard_params(np_params, cfg, mesh)
    del np_params
    model = ShardedModel(path=gf.path, config=cfg, params=params, metadata=gf.metadata, mesh=mesh)
    model.load_seconds = time.perf_counter() - t0
    return model


# ---------------------------------------------------------------------------------------------------------------
# Equivalence check: sharded steps vs the same steps on one device (used by tests/test_sharding.py, and by users to
# validate a new host: `python -m fucina_jax.sharding --check MODEL.gguf --devices 8`).


def compare_sharded(model, sharded, *, batch: int = 2, n_ids: int = 40, n_prefill: int = 11, n_decode: int = 6,
                    verify_width: int = 4, seed: int = 0) -> dict:
    """Run the same token ids through `model` (one device) and `sharded`; return, per step kind, the max |logit
    difference| and whether every argmax agrees; whether the KV cache kept its sharding and was donated at every
    sharded step; whether a sharded decode step after the first compiled again.

    Step kinds: the full forward (Model.logits: 16-wide verify chunks on a fresh cache); a bucketed prefill of
    `batch` rows of different lengths (row r: n_prefill + r tokens) followed by `n_decode` decode steps; then one
    verify of `verify_width` rows per batch row on that same cache."""
    from fucina_jax import engine

    cfg = model.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(cfg.n_vocab, 260), n_ids).astype(np.int32)
    report: dict[str, Any] = {"devices": int(sharded.mesh.size), "mesh": dict(sharded.mesh.shape), "batch": batch}
    cache_ok = {"cache_sharding_kept": True, "cache_donated": True}

    def record(name, ref, got):
        ref, got = np.asarray(ref), np.asarray(got)
        report[name] = {
            "max_abs_diff": float(np.abs(ref - got).max()),
            "max_abs_logit": float(np.abs(ref).max()),
            "argmax_equal": bool((ref.argmax(-1) == got.argmax(-1)).all()),
            "rows": int(np.prod(ref.shape[:-1])),
        }

    def watch(before: KVCache, after: KVCache):
        """The step's output cache is laid out like a fresh sharded cache, and the input's K/V buffers were donated."""
        want = jax.tree_util.tree_leaves(cache_shardings(after, sharded.mesh))
        for x, w in zip(jax.tree_util.tree_leaves(after), want):
            cache_ok["cache_sharding_kept"] &= x.sharding.is_equivalent_to(w, x.ndim)
        cache_ok["cache_donated"] &= all(x.is_deleted() for x in before.k + before.v)

    record("full_forward", model.logits(ids), sharded.logits(ids))

    lens = np.array([n_prefill + r for r in range(batch)], np.int32)
    T = engine.bucket_for(int(lens.max()), engine.PREFILL_BUCKETS)
    prompt = np.stack([np.roll(ids, r)[:T] for r in range(batch)])  # past lens[r]: padding the step ignores
    steps = np.stack([np.roll(ids, 7 + t)[:batch] for t in range(n_decode)])
    draft = np.stack([np.roll(ids, 3 + r)[:verify_width] for r in range(batch)])
    rows, verify = {}, {}
    for name, m in (("ref", model), ("sharded", sharded)):
        step = watch if m is sharded else (lambda before, after: None)
        cache = m.new_cache(64, batch)
        logits, new = engine.prefill_step(m.params, jnp.asarray(prompt), jnp.asarray(lens), cache, cfg)
        step(cache, new)
        out = [np.asarray(logits)]
        for t, toks in enumerate(steps):
            if t == 1:  # the first decode compiled; the ones after it must reuse it (the cache layout is stable)
                compiled = engine.decode_step._cache_size()
            cache = new
            logits, new = engine.decode_step(m.params, jnp.asarray(toks), cache, cfg)
            step(cache, new)
            out.append(np.asarray(logits))
        if m is sharded and n_decode > 1:
            report["decode_recompiled"] = engine.decode_step._cache_size() != compiled
        rows[name] = np.stack(out)
        cache = new
        logits, new = engine.verify_step(m.params, jnp.asarray(draft), cache, cfg)
        step(cache, new)
        verify[name] = logits
        if m is sharded:
            report["logits_sharding"] = str(logits.sharding.spec)
            report["cache_sharding"] = [str(x.sharding.spec) for x in new.k]
    record("prefill_decode", rows["ref"], rows["sharded"])
    record("verify", verify["ref"], verify["sharded"])
    report.update(cache_ok)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fucina_jax.sharding",
        description="Check that sharded steps equal single-device steps on this host (prints one JSON object).")
    p.add_argument("--check", required=True, metavar="MODEL.gguf",
                   help="model to compare; 'fixture:KIND' writes a tiny random fixture (qwen3, gemma3, ..., "
                        "gemma4-dense, gemma4-moe, gemma4-e2b, gemma4-e4b) to a temporary directory")
    p.add_argument("--devices", type=int, default=None, help="devices in the mesh (default: all visible)")
    p.add_argument("--data", type=int, default=1, help="size of the data (batch) mesh axis (default: 1)")
    p.add_argument("--batch", type=int, default=2, help="rows in the prefill/decode/verify comparison (default: 2)")
    args = p.parse_args(argv)

    if args.devices and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # CPU hosts: ask for that many host devices (no effect once JAX has started, nor on GPU/TPU)
        jax.config.update("jax_num_cpu_devices", args.devices)

    import tempfile

    import fucina_jax

    with tempfile.TemporaryDirectory() as tmp:
        path = args.check
        try:
            if path.startswith("fixture:"):
                path = _write_fixture(path.split(":", 1)[1], tmp)
            t0 = time.perf_counter()
            model = fucina_jax.load(path, f32=True)
            mesh = make_mesh(args.devices, data=args.data)
        except (FucinaError, FileNotFoundError, KeyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        sharded = shard_model(model, mesh)
        report = compare_sharded(model, sharded, batch=args.batch)
        report["seconds"] = round(time.perf_counter() - t0, 2)
        report["model"] = args.check
        report["param_shardings"] = {
            k: str(v.sharding.spec) for k, v in sharded.params["layers"][0].items()
        } | {k: str(v.sharding.spec) for k, v in sharded.params.items() if k != "layers"}
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


def _write_fixture(kind: str, tmp: str) -> str:
    from fucina_jax.testing import (
        FIXTURES,
        GEMMA4_VARIANTS,
        write_fixture,
        write_gemma4_fixture,
    )

    path = os.path.join(tmp, f"{kind}.gguf")
    if kind.startswith("gemma4"):
        return write_gemma4_fixture(path, kind.partition("-")[2] or "dense")
    if kind not in FIXTURES:
        known = sorted(FIXTURES) + [f"gemma4-{v}" for v in GEMMA4_VARIANTS]
        raise ValueError(f"unknown fixture {kind!r}; choose from {', '.join(known)}")
    return write_fixture(path, kind)


if __name__ == "__main__":
    sys.exit(main())
