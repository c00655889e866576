"""Static model description built from GGUF metadata: frozen and hashable, so jit takes it as a static argument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fucina_jax.errors import MetadataError

__all__ = ["LayerSpec", "ModelConfig", "meta_get", "per_layer"]


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer looks like (layers differ within a model on Gemma 3/4)."""

    sliding: bool  # sliding-window attention layer (window = ModelConfig.window)
    head_dim: int  # Dh of q/k/v
    n_kv_heads: int  # K
    ffn_dim: int  # F of the dense FFN (0: none)
    rope_base: float
    rope_scale: float  # freq_scale = 1 / rope.scaling.factor
    n_rot: int  # rotated dims per head
    kv_slot: int  # index into KVCache.k / .v that this layer reads
    writes_kv: bool = True  # False on Gemma 4 shared-KV layers (they read a donor layer's slot)
    rope_freq_factors: tuple[float, ...] | None = None  # Gemma 4 proportional RoPE on global layers
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    moe: bool = False


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # general.architecture
    n_vocab: int  # V
    d_model: int  # D
    n_heads: int  # H
    rms_eps: float
    context_length: int  # trained context (n_ctx_train)
    layers: tuple[LayerSpec, ...]
    window: int = 0  # sliding window n_swa (0: none)
    act: str = "silu"  # FFN activation: "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    rope_neox: bool = True  # False: NORM (adjacent-pair) RoPE, Llama
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(D)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0 = off
    tied_output: bool = True  # no output.weight: the output layer is token_embd
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_dim: int = 0
    ple_dim: int = 0  # Gemma 4 per-layer embedding width (0 = none)
    extra: tuple[tuple[str, Any], ...] = field(default=())  # arch-specific static facts, as sorted (key, value) pairs
    kernels: bool = False  # run on fucina_jax.kernels (packed weights, C attention); False: the pure-JAX reference
    cache_type: str = "f32"  # KV cache element type, "f32" or "f16" (llama.cpp's --cache-type-k / -v)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_kv_slots(self) -> int:
        return 1 + max(l.kv_slot for l in self.layers)

    def get(self, key: str, default=None):
        return dict(self.extra).get(key, default)


def meta_get(md: dict, key: str, default=None, *, required: bool = False):
    if key in md:
        return md[key]
    if required:
        raise MetadataError(
            f"required metadata key {key!r} is missing; the GGUF was written by an incompatible converter"
        )
    return default


MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_WINDOW = 1 << 30  # a sliding window at least this wide sees every position any cache can hold: no window


def meta_int(value, key: str, lo: int = 0, hi: int | None = None) -> int:
    """A metadata integer (GGUF stores them as integer types; a bool, float or string is a broken file) in [lo, hi]."""
    if type(value) is not int:
        raise MetadataError(f"metadata {key!r} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise MetadataError(f"metadata {key!r} = {value} is out of range [{lo}, {'...' if hi is None else hi}]")
    return value


def meta_float(value, key: str, positive: bool = False) -> float:
    """A finite metadata number (an integer type is accepted, as llama.cpp's float keys may be stored as ints)."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "a positive" if positive else "a finite non-negative"
        raise MetadataError(f"metadata {key!r} must be {want} number, got {value!r}")
    return float(value)


def per_layer(value, n_layers: int, key: str) -> list:
    """A scalar-or-array metadata value expanded to one entry per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise MetadataError(f"metadata {key!r} has {len(value)} entries but the model has {n_layers} layers")
        return list(value)
    return [value] * n_layers


@dataclass(frozen=True)
class Hparams:
    """The hyper-parameters every supported architecture reads the same way (llama_model::load_hparams)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_kv: tuple[int, ...]  # per layer
    n_ff: tuple[int, ...]  # per layer
    head_dim: int  # key_length (default n_embd / n_head)
    head_dim_swa: int
    n_rot: int
    n_rot_swa: int
    rope_base: float
    rope_base_swa: float
    rope_scale: float  # 1 / rope.scaling.factor (linear scaling)
    eps: float
    ctx: int
    window: int
    softcap: float


def read_hparams(md: dict, arch: str) -> Hparams:
    def g(key, default=None, required=False):
        return meta_get(md, f"{arch}.{key}", default, required=required)

    def i(key, default=None, lo=1, hi=None, required=False):
        return meta_int(g(key, default, required), f"{arch}.{key}", lo, hi)

    def f(key, default=None, positive=False, required=False):
        return meta_float(g(key, default, required), f"{arch}.{key}", positive)

    def layers(key, default, lo):
        return tuple(meta_int(x, f"{arch}.{key}", lo) for x in per_layer(g(key, default), n_layer, f"{arch}.{key}"))

    n_embd = i("embedding_length", required=True)
    n_layer = i("block_count", hi=MAX_LAYERS, required=True)
    heads = layers("attention.head_count", g("attention.head_count", required=True), 1)
    n_head = heads[0]
    if any(h != n_head for h in heads):
        raise MetadataError(f"{arch}.attention.head_count varies per layer; that is not supported")
    n_kv = layers("attention.head_count_kv", n_head, 0)
    n_ff = layers("feed_forward_length", 0, 0)
    head_dim = i("attention.key_length", n_embd // n_head)
    value_dim = i("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise MetadataError(f"{arch}: key_length {head_dim} != value_length {value_dim} is not supported")
    head_dim_swa = i("attention.key_length_swa", head_dim)
    n_rot = i("rope.dimension_count", head_dim, hi=head_dim)
    n_rot_swa = i("rope.dimension_count_swa", n_rot if head_dim_swa == head_dim else head_dim_swa, hi=head_dim_swa)
    if n_rot % 2 or n_rot_swa % 2:
        raise MetadataError(f"{arch}: rope.dimension_count {n_rot} (sliding {n_rot_swa}) must be even: RoPE turns "
                            "pairs")
    if arch == "llama" and n_rot != head_dim:  # as llama.cpp: partial rotary is another architecture's feature
        raise MetadataError(f"{arch}: invalid rope.dimension_count {n_rot}, expected the head size {head_dim}")
    rope_base = f("rope.freq_base", 10000.0, positive=True)
    scaling = g("rope.scaling.type", "none")
    factor = f("rope.scaling.factor", 0.0)
    if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
        raise MetadataError(
            f"{arch}: rope scaling type {scaling!r} is not supported (only linear); "
            "re-convert the model without rope scaling or use llama.cpp"
        )
    rope_scale = 1.0 / factor if factor else 1.0
    if any(n_head % k for k in n_kv if k):
        raise MetadataError(f"{arch}: head_count {n_head} is not a multiple of head_count_kv {n_kv}")
    return Hparams(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_kv=n_kv,
        n_ff=n_ff,
        head_dim=head_dim,
        head_dim_swa=head_dim_swa,
        n_rot=n_rot,
        n_rot_swa=n_rot_swa,
        rope_base=rope_base,
        rope_base_swa=f("rope.freq_base_swa", rope_base, positive=True),
        rope_scale=rope_scale,
        eps=f("attention.layer_norm_rms_epsilon", required=True),
        ctx=i("context_length", 4096),
        window=min(i("attention.sliding_window", 0, lo=0), MAX_WINDOW),
        softcap=f("final_logit_softcapping", 0.0),
    )
