"""Qwen3-MoE (`qwen3moe`): Qwen3 attention with a softmax top-k routed FFN (renormalised weights, no shared expert)."""

from __future__ import annotations


from fucina_jax.models import qwen3
from fucina_jax.models.config import ModelConfig, meta_get

ARCH = "qwen3moe"


def config_from_metadata(md: dict, n_vocab: int, has_output: bool) -> ModelConfig:
    return qwen3.config_from_metadata(
        md, n_vocab, has_output, arch=ARCH,
        n_expert=int(meta_get(md, f"{ARCH}.expert_count", required=True)),
        n_expert_used=int(meta_get(md, f"{ARCH}.expert_used_count", required=True)),
        expert_ffn_dim=int(meta_get(md, f"{ARCH}.expert_feed_forward_length", required=True)),
    )


tensor_table = qwen3.tensor_table
forward_hidden = qwen3.forward_hidden
