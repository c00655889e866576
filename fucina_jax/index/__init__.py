"""Draft indexes for speculative decoding: suffix automaton (C core), Token-Recycling matrix, past outputs, cascade,
and their persistence per model (persist.py).

Works on NumPy arrays of token ids and never imports JAX.
"""

from fucina_jax.index.cascade import CascadePolicy, SourceStats, SpeculationIndex
from fucina_jax.index.outputs import OutputIndex, OutputMatcher
from fucina_jax.index.persist import IndexStore, model_key
from fucina_jax.index.protocol import DraftSource
from fucina_jax.index.recycling import RecyclingMatrix
from fucina_jax.index.sam import Cursor, SuffixAutomaton
from fucina_jax.index.sam_ref import CursorRef, SuffixAutomatonRef

__all__ = [
    "DraftSource",
    "SpeculationIndex",
    "CascadePolicy",
    "SourceStats",
    "SuffixAutomaton",
    "Cursor",
    "SuffixAutomatonRef",
    "CursorRef",
    "RecyclingMatrix",
    "OutputIndex",
    "OutputMatcher",
    "IndexStore",
    "model_key",
]
