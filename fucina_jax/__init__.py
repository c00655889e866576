"""fucina_jax: Qwen3 and Gemma GGUF models on the CPU in JAX, with lossless draft-model-free speculative decoding.

`load` and `Model` are imported lazily, so `import fucina_jax.index` (NumPy/C only) never imports JAX.
"""

from fucina_jax.errors import (
    CacheMemoryError,
    ContextFullError,
    FucinaError,
    GGUFError,
    MetadataError,
    MissingTensorError,
    TensorShapeError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)

__all__ = [
    "load",
    "Model",
    "clear_caches",
    "FucinaError",
    "GGUFError",
    "MetadataError",
    "MissingTensorError",
    "TensorShapeError",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "ContextFullError",
    "CacheMemoryError",
]


def __getattr__(name):
    if name in ("load", "Model"):
        from fucina_jax import model

        return getattr(model, name)
    if name == "clear_caches":  # drop every compiled program held in this process (fucina_jax.aot.clear)
        from fucina_jax import aot

        return aot.clear
    raise AttributeError(f"module 'fucina_jax' has no attribute {name!r}")
