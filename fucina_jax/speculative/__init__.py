"""Speculation's policy and parts: the cost gate and its options, the verify-cost tables and their probe, and the
draft sources the drivers build.

The decoder that verifies drafts is `fucina_jax.decoder` (one decoder for plain, speculative and batched decoding);
the drivers `generate_speculative` and `generate_batched` are in `fucina_jax.generate`. Drafts come from any
`fucina_jax.index.DraftSource` (the package's own is the `SpeculationIndex` cascade); design record sections 1-4.
"""

from fucina_jax.speculative.gate import DEFAULT_BATCH_COSTS, DEFAULT_COST_TABLE, MAX_DRAFT, CostGate, CostPoint, SpecOptions, table_cost
from fucina_jax.speculative.sources import DraftMemory, TurnBufferedSource, default_source, draft_memory, reference_ids

__all__ = [
    "SpecOptions",
    "CostGate",
    "CostPoint",
    "DEFAULT_BATCH_COSTS",
    "DEFAULT_COST_TABLE",
    "MAX_DRAFT",
    "table_cost",
    "DraftMemory",
    "TurnBufferedSource",
    "draft_memory",
    "default_source",
    "reference_ids",
]
