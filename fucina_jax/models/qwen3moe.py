"""Qwen3-MoE (`qwen3moe`): Qwen3 attention with a softmax top-k routed FFN (renormalised weights, no shared expert)."""

from __future__ import annotations


from fucina_jax.models import qwen3
from fucina_jax.models.config import ModelConfig, meta_get, meta_int

ARCH = "qwen3moe"


def config_from_metadata(md: dict, n_vocab: int, has_output: bool) -> ModelConfig:
    def i(key, lo=1, hi=None):
        return meta_int(meta_get(md, f"{ARCH}.{key}", required=True), f"{ARCH}.{key}", lo, hi)

    n_expert = i("expert_count")
    return qwen3.config_from_metadata(
        md, n_vocab, has_output, arch=ARCH,
        n_expert=n_expert,
        n_expert_used=i("expert_used_count", hi=n_expert),
        expert_ffn_dim=i("expert_feed_forward_length"),
    )


tensor_table = qwen3.tensor_table
forward_hidden = qwen3.forward_hidden
