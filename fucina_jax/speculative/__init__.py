"""Lossless draft-model-free speculative decoding: the decoder, its cost gate and its fused verify step.

Drafts come from any `fucina_jax.index.DraftSource` (the package's own is the `SpeculationIndex` cascade); the
decoder verifies them with one batched forward and commits exactly the stream plain decoding commits (design record
sections 1-4). `generate_speculative` is `fucina_jax.generate.generate` with speculation;
`generate_batched` decodes many conversations in one batch (speculative/batched.py).
"""

from fucina_jax.speculative.batched import BatchedSpeculativeDecoder, generate_batched
from fucina_jax.speculative.decoder import SpecStats, SpeculativeDecoder, VerifyRowHook, generate_speculative
from fucina_jax.speculative.gate import DEFAULT_COST_TABLE, MAX_DRAFT, CostGate, CostPoint, SpecOptions, table_cost
from fucina_jax.speculative.steps import TOPK_FEEDBACK, verify_sample_step

__all__ = [
    "generate_speculative",
    "generate_batched",
    "BatchedSpeculativeDecoder",
    "SpeculativeDecoder",
    "SpecOptions",
    "SpecStats",
    "VerifyRowHook",
    "CostGate",
    "CostPoint",
    "DEFAULT_COST_TABLE",
    "MAX_DRAFT",
    "table_cost",
    "TOPK_FEEDBACK",
    "verify_sample_step",
]
