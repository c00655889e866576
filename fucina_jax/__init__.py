"""fucina_jax: Qwen3 and Gemma GGUF models on the CPU in JAX, with lossless draft-model-free speculative decoding."""

from fucina_jax.errors import (
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
from fucina_jax.model import Model, load

__all__ = [
    "load",
    "Model",
    "FucinaError",
    "GGUFError",
    "MetadataError",
    "MissingTensorError",
    "TensorShapeError",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "ContextFullError",
]
