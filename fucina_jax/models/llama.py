"""Llama (`llama`, e.g. SmolLM2): Qwen3's wiring without q/k norms, with NORM (adjacent-pair) RoPE.

llama.cpp's converter permutes the Q/K rows of Llama checkpoints so that ggml's NORM rope applies; the GGUF weights
are used as stored with adjacent-pair rotation.
"""

from __future__ import annotations

from functools import partial

from fucina_jax.models import qwen3
from fucina_jax.models.config import ModelConfig

ARCH = "llama"


def config_from_metadata(md: dict, n_vocab: int, has_output: bool) -> ModelConfig:
    return qwen3.config_from_metadata(md, n_vocab, has_output, arch=ARCH, rope_neox=False)


tensor_table = partial(qwen3.tensor_table, qk_norm=False, rope_freqs=True)
forward_hidden = partial(qwen3.forward_hidden, qk_norm=False)
