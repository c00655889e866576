"""Declarative tensor tables: GGUF tensor name + expected shape -> a place in the params pytree.

Each architecture lists its tensors once (global and per layer); `load_params` reads, dequantizes to f32 and checks
the shape of every one, so a malformed file fails with the tensor's name instead of a shape error deep in jit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fucina_jax.errors import MissingTensorError, TensorShapeError
from fucina_jax.gguf_io import GGUFFile

__all__ = ["TensorSpec", "load_params", "output_specs"]


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


def _read(gf: GGUFFile, spec: TensorSpec, name: str, arch: str) -> np.ndarray | None:
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
    return gf.load(name)


def load_params(
    gf: GGUFFile,
    arch: str,
    global_specs: list[TensorSpec],
    layer_specs: Callable[[int], list[TensorSpec]],
    n_layers: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Read every tensor of the tables into {key: f32 array, "layers": (per-layer dict, ...)}."""
    params: dict = {}
    for spec in global_specs:
        arr = _read(gf, spec, spec.name, arch)
        if arr is not None:
            params[spec.key] = arr
    layers = []
    for l in range(n_layers):
        lp = {}
        for spec in layer_specs(l):
            arr = _read(gf, spec, spec.name.format(l=l), arch)
            if arr is not None:
                lp[spec.key] = arr
        layers.append(lp)
        if progress:
            progress(l + 1, n_layers)
    params["layers"] = tuple(layers)
    return params
