"""Static model description built from GGUF metadata: frozen and hashable, so jit takes it as a static argument."""

from __future__ import annotations

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

    n_embd = int(g("embedding_length", required=True))
    n_layer = int(g("block_count", required=True))
    heads = per_layer(g("attention.head_count", required=True), n_layer, f"{arch}.attention.head_count")
    n_head = int(heads[0])
    if any(int(h) != n_head for h in heads):
        raise MetadataError(f"{arch}.attention.head_count varies per layer; that is not supported")
    n_kv = tuple(int(x) for x in per_layer(g("attention.head_count_kv", n_head), n_layer, "head_count_kv"))
    n_ff = tuple(int(x) for x in per_layer(g("feed_forward_length", 0), n_layer, "feed_forward_length"))
    head_dim = int(g("attention.key_length", n_embd // n_head))
    value_dim = int(g("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise MetadataError(f"{arch}: key_length {head_dim} != value_length {value_dim} is not supported")
    head_dim_swa = int(g("attention.key_length_swa", head_dim))
    n_rot = int(g("rope.dimension_count", head_dim))
    n_rot_swa = int(g("rope.dimension_count_swa", n_rot if head_dim_swa == head_dim else head_dim_swa))
    rope_base = float(g("rope.freq_base", 10000.0))
    scaling = g("rope.scaling.type", "none")
    factor = float(g("rope.scaling.factor", 0.0) or 0.0)
    if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
        raise MetadataError(
            f"{arch}: rope scaling type {scaling!r} is not supported (only linear); "
            "re-convert the model without rope scaling or use llama.cpp"
        )
    rope_scale = 1.0 / factor if factor else 1.0
    for name, v in (("n_head", n_head), ("n_embd", n_embd), ("n_layer", n_layer), ("head_dim", head_dim)):
        if v <= 0:
            raise MetadataError(f"{arch}: {name} = {v} is impossible")
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
        rope_base_swa=float(g("rope.freq_base_swa", rope_base)),
        rope_scale=rope_scale,
        eps=float(g("attention.layer_norm_rms_epsilon", required=True)),
        ctx=int(g("context_length", 4096)),
        window=int(g("attention.sliding_window", 0) or 0),
        softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
    )
