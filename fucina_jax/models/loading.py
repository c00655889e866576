"""Declarative tensor tables: GGUF tensor name + expected shape -> a place in the params pytree.

Each architecture lists its tensors once (global and per layer); `load_params` reads and checks the shape of every
one, so a malformed file fails with the tensor's name instead of a shape error deep in jit. A tensor becomes an f32
array (the reference path), or, with `packed=True`, a matmul weight of a type the kernels take becomes a QWeight
(fucina_jax.kernels): the weights only `linear`/`embed` consume, listed in PACKED_KEYS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fucina_jax.errors import MissingTensorError, TensorShapeError, UnsupportedArchitectureError
from fucina_jax.gguf_io import GGUFFile

__all__ = ["EXPERT_KEYS", "PACKED_KEYS", "ROUTER_KEYS", "TensorSpec", "load_params", "output_specs"]

# Params consumed only through layers.linear / layers.lookup, so either representation works for them. Norms stay
# f32. (Gemma 4 E2B's per-layer embedding table is 262144 x 8960: 9.4 GB in f32, 2.5 GB as
# the Q8_0 its files store.)
PACKED_KEYS = frozenset({
    "token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    "per_layer_token_embd", "per_layer_model_proj", "inp_gate", "proj",
})

# Expert stacks [E, n, k], consumed only through layers.moe_ffn: quantized ones stay quantized (kernels.pack_experts).
EXPERT_KEYS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"})

# Routers [E, D], consumed only through layers.linear as well. Quantizers keep them F32 (llama.cpp's does, and so do
# the fixtures); on the kernels' path they run on the float kernel, so a token's router logits, and with them its
# experts, are the same bits whatever the number of rows in the step (XLA's f32 dot is not: see layers.route).
ROUTER_KEYS = frozenset({"ffn_gate_inp"})

KERNEL_KEYS = PACKED_KEYS | EXPERT_KEYS | ROUTER_KEYS  # what the kernels' path may hold as kernel weights


@dataclass(frozen=True)
class TensorSpec:
    key: str  # key in the params dict (global) or in the layer's dict
    name: str  # GGUF tensor name; "{l}" is replaced by the layer index
    shape: tuple[int, ...]  # NumPy order (GGUF ne reversed): a {n_in, n_out} matrix is (n_out, n_in)
    optional: bool = False


def output_specs(cfg) -> list[TensorSpec]:
    """The global tensors every supported architecture has: embeddings, final norm, untied output layer if any."""
    D, V = cfg.d_model, cfg.n_vocab
    specs = [
        TensorSpec("token_embd", "token_embd.weight", (V, D)),
        TensorSpec("output_norm", "output_norm.weight", (D,)),
    ]
    if not cfg.tied_output:
        specs.append(TensorSpec("output", "output.weight", (V, D)))
    return specs


def _read(gf: GGUFFile, spec: TensorSpec, name: str, arch: str, packed: bool):
    if name not in gf.tensors:
        if spec.optional:
            return None
        raise MissingTensorError(
            f"tensor {name!r} is missing from {gf.path!r}; a {arch} model needs it. "
            "The file is incomplete or was written for another architecture."
        )
    shape = gf.tensor_shape(name)
    if tuple(shape) != tuple(spec.shape):
        raise TensorShapeError(
            f"tensor {name!r} in {gf.path!r} has shape {shape} (NumPy order) but the metadata implies {spec.shape}; "
            "the metadata and the weights disagree: re-convert the model."
        )
    if packed and spec.key in KERNEL_KEYS:
        from fucina_jax import kernels

        qtype = gf.tensors[name].qtype
        stack = spec.key in EXPERT_KEYS
        if kernels.packable(qtype, shape):
            raw = gf.raw(name)
            base = raw.ctypes.data

            def done(rows):  # drop the file pages of each chunk once packed: the mapping is not held whole in RSS
                gf.release(name, rows.ctypes.data - base, rows.ctypes.data - base + rows.nbytes)

            pack = kernels.pack_experts if stack else kernels.pack_weight
            return pack(raw, qtype, shape, done=done)
    arr = gf.load(name)  # a converted copy: the file pages are no longer needed
    gf.release(name)
    return arr


def check_tensor_set(gf: GGUFFile, n_layers: int, arch: str, wanted: set[str]) -> None:
    """What llama.cpp refuses before reading weights: layer tensors past block_count (the rest of the file would be
    ignored), a tensor the architecture does not use (llama.cpp: "wrong number of tensors"; run without it, a model
    would give wrong numbers, e.g. a Llama 3 file's rope_freqs), and a vocabulary whose size is not the embedding's
    row count (ids past either end would fail mid-run). wanted: every tensor name the model's tables can read."""
    extra = sorted({int(i) for i in (n.split(".")[1] for n in gf.tensors if n.startswith("blk.")) if i.isdigit()}
                   - set(range(n_layers)))
    if extra:
        raise TensorShapeError(
            f"{gf.path!r} has tensors of layer {extra[0]} but its metadata says block_count = {n_layers}; the metadata "
            "and the weights disagree: re-convert the model."
        )
    unused = sorted(set(gf.tensors) - wanted)
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise UnsupportedArchitectureError(
            f"tensor {unused[0]!r}{more} in {gf.path!r} is not part of a {arch} model as fucina_jax runs it; running "
            "without it would give wrong results (llama.cpp refuses such a file too: 'wrong number of tensors'). "
            "The file was written for another architecture or variant."
        )
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    rows = gf.tensor_shape("token_embd.weight")[0] if "token_embd.weight" in gf.tensors else None
    if isinstance(tokens, list) and rows is not None and len(tokens) != rows:
        raise TensorShapeError(
            f"tensor 'token_embd.weight' in {gf.path!r} has {rows} rows but the tokenizer has {len(tokens)} tokens; "
            "they must match (llama.cpp refuses this file too): re-convert the model."
        )


def load_params(
    gf: GGUFFile,
    arch: str,
    global_specs: list[TensorSpec],
    layer_specs: Callable[[int], list[TensorSpec]],
    n_layers: int,
    progress: Callable[[int, int], None] | None = None,
    *,
    packed: bool = False,
    place: Callable = lambda x: x,
    fuse: Callable[[int, dict], dict] | None = None,
) -> dict:
    """Read every tensor of the tables into {key: array, "layers": (per-layer dict, ...)}.

    `fuse(l, layer)` may rewrite a layer's NumPy dict (e.g. layers.fuse_projections) before `place` maps every array
    of it, e.g. onto the device; globals are placed one by one as read. So the host copy of one layer at a time is all
    that is transient, and each tensor is placed once (with 64-byte aligned packed arrays jax.device_put adopts the
    host buffer: no copy at all)."""
    import jax

    wanted = {spec.name for spec in global_specs}
    wanted |= {spec.name.format(l=l) for l in range(n_layers) for spec in layer_specs(l)}
    check_tensor_set(gf, n_layers, arch, wanted)

    def put(x):
        return jax.tree_util.tree_map(place, x)

    def read_globals():
        out = {}
        for spec in global_specs:
            arr = _read(gf, spec, spec.name, arch, packed)
            if arr is not None:
                out[spec.key] = put(arr)
        return out

    def read_layer(l):
        lp = {}
        for spec in layer_specs(l):
            arr = _read(gf, spec, spec.name.format(l=l), arch, packed)
            if arr is not None:
                lp[spec.key] = arr
        return put(fuse(l, lp) if fuse else lp)

    # The globals (the embedding: the largest tensor) are read on a second thread while the layers are read here:
    # the packing loops (kernels/pack.cc, or NumPy where that is not built) release the GIL, and the transient host
    # memory stays one tensor more.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        glob = pool.submit(read_globals)
        layers = []
        for l in range(n_layers):
            layers.append(read_layer(l))
            if progress:
                progress(l + 1, n_layers)
        params: dict = glob.result()
    params["layers"] = tuple(layers)
    return params
