"""Test fixtures shared by fucina_jax's tests and by users: tiny random-weight GGUF models and vocabularies."""

from fucina_jax.testing.fixtures import (
    FIXTURES,
    GEMMA3_1B_SHAPE,
    FixtureSpec,
    byte_level_vocab,
    smollm2_path,
    write_fixture,
    write_float_copy,
)
from fucina_jax.testing.gemma4 import GEMMA4_VARIANTS, write_gemma4_fixture
from fucina_jax.testing.llama_cpp import open_llama_cpp

__all__ = ["FIXTURES", "GEMMA3_1B_SHAPE", "FixtureSpec", "GEMMA4_VARIANTS", "byte_level_vocab", "open_llama_cpp",
           "smollm2_path", "write_fixture", "write_float_copy", "write_gemma4_fixture"]
