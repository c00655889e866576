"""Pure model math, one module per architecture keyed by GGUF `general.architecture`.

Each architecture module provides:
  config_from_metadata(md, n_vocab, has_output) -> ModelConfig
  tensor_table(cfg) -> (global TensorSpecs, layer index -> TensorSpecs)
  forward_hidden(params, tokens, positions, cache, cfg) -> (final-normed hidden [B, T, D], cache)

A cache with a row map (models.cache.on_rows(cache, rows), rows int32 [n]) makes the forward's n rows (tokens and positions
[n, T]) cache rows rows[i]: only those are written and read, and the cache comes back whole, without the map.
"""

from __future__ import annotations

from fucina_jax.errors import UnsupportedArchitectureError
from fucina_jax.models import gemma3, gemma4, llama, qwen3, qwen3moe
from fucina_jax.models.cache import KVCache, fitted_capacity, init_cache, truncate
from fucina_jax.models.config import LayerSpec, ModelConfig
from fucina_jax.models.layers import unembed, unembed_pick

__all__ = [
    "ARCHITECTURES",
    "KVCache",
    "LayerSpec",
    "ModelConfig",
    "architecture",
    "forward",
    "forward_hidden",
    "fitted_capacity",
    "init_cache",
    "truncate",
    "unembed",
    "unembed_pick",
]

ARCHITECTURES = {m.ARCH: m for m in (qwen3, qwen3moe, gemma3, gemma4, llama)}


def architecture(name: str):
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unknown architecture {name!r}; fucina_jax supports: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def forward_hidden(params, tokens, positions, cache: KVCache, cfg: ModelConfig):
    return architecture(cfg.arch).forward_hidden(params, tokens, positions, cache, cfg)


def forward(params, tokens, positions, cache: KVCache, cfg: ModelConfig):
    """Logits for every row: tokens/positions [B, T] -> (logits [B, T, V], cache).

    Positions must continue the cache (row b starts at cache.length[b]); the returned cache has every row written and
    its length advanced by T: the caller truncates it to what it commits.
    """
    h, cache = forward_hidden(params, tokens, positions, cache, cfg)
    return unembed(params, h, cfg), cache
