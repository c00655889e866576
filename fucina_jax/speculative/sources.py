"""Draft sources built for the drivers: a request's default index, reference documents, the process's shared and
persisted draft memory, and the chat wrapper.

Any `fucina_jax.index.DraftSource` can feed the decoder; these are the package's own arrangements of the
`SpeculationIndex` cascade (conversation suffix automaton + reference automata + past outputs + Token-Recycling).

`DraftMemory`: one model's Token-Recycling matrix and past-output index, shared by every request and conversation
of the process (`draft_memory(model)`) and kept on disk per model (index/persist.py: the user cache directory,
written atomically, a corrupt or foreign file ignored with one warning line). Opt out with FUCINA_JAX_NO_PERSIST=1,
`--no-persist` or `persist=False`. It changes which drafts are offered, never what is committed.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Sequence

import numpy as np

from fucina_jax.errors import DraftSourceError
from fucina_jax.index import SpeculationIndex
from fucina_jax.index.persist import IndexStore, model_key

__all__ = ["DraftMemory", "TurnBufferedSource", "default_source", "draft_memory", "finish_request",
           "reference_ids", "save_all"]

SAVE_EVERY = 30.0  # seconds between two saves of a memory (and once more at exit)


def reference_ids(model, doc) -> np.ndarray:
    """A reference document as int32 token ids: text is encoded with the model's tokenizer (no BOS; the
    tokenize-with-the-model's-tokenizer contract of design record section 8), a sequence of ids is checked
    against the vocabulary."""
    if isinstance(doc, str):
        return np.asarray(model.tokenizer.encode(doc, add_special=False), np.int32)
    if isinstance(doc, (bytes, bytearray)):
        raise TypeError("a reference document is text (str) or token ids, got bytes: decode it first")
    if doc is None or isinstance(doc, (int, np.integer)):
        raise TypeError(f"a reference document is text (str) or token ids, got {type(doc).__name__} {doc!r}")
    return model.check_ids(doc)


class DraftMemory:
    """One model's shared draft state: a RecyclingMatrix and an OutputIndex, loaded from its IndexStore once and
    saved back at most every SAVE_EVERY seconds (after a request ends) and at exit."""

    def __init__(self, store: IndexStore, vocab_size: int):
        self.store = store
        self.matrix = store.load_recycling(vocab_size)
        self.outputs = store.load_outputs(vocab_size)
        self._lock = threading.Lock()
        self._saved = time.monotonic()
        self._dirty = False

    def index(self) -> SpeculationIndex:
        """A fresh conversation index that drafts from (and learns into) the shared state."""
        return SpeculationIndex(self.matrix.vocab_size, recycling_matrix=self.matrix, outputs=self.outputs)

    def finished(self, source) -> None:
        """A request that drafted from `source` ended: its output joins the past outputs; save when due."""
        if callable(getattr(source, "finish_output", None)):
            source.finish_output()
        self._dirty = True
        if time.monotonic() - self._saved >= SAVE_EVERY:
            self.save()

    def save(self) -> None:
        with self._lock:
            if self._dirty:
                self.store.save_recycling(self.matrix)
                self.store.save_outputs(self.outputs)
                self._dirty = False
            self._saved = time.monotonic()


_MEMORIES: dict[tuple, DraftMemory] = {}
_MEMORY_LOCK = threading.Lock()


def draft_memory(model) -> DraftMemory | None:
    """The process's DraftMemory of this model (None when persistence is off by FUCINA_JAX_NO_PERSIST)."""
    store_key = (model.path, model.config.n_vocab)
    with _MEMORY_LOCK:
        mem = _MEMORIES.get(store_key)
        if mem is None:
            store = IndexStore(model_key(model.path))
            if not store.enabled:
                return None
            mem = _MEMORIES[store_key] = DraftMemory(store, model.config.n_vocab)
            atexit.register(mem.save)  # the memory lives as long as the process
        return mem


def save_all() -> None:
    """Save every draft memory of the process that changed (also run at exit; a process that leaves with os._exit,
    as scripts/generate.py does, calls it first)."""
    for mem in list(_MEMORIES.values()):
        mem.save()


def finish_request(model, source) -> None:
    """A request (or a chat turn) that drafted from `source` ended: feed the model's draft memory."""
    mem = _MEMORIES.get((model.path, model.config.n_vocab))
    if mem is not None and source is not None:
        mem.finished(source)


def default_source(model, source=None, references: Sequence = (), persist: bool = True):
    """`source` (None: a fresh SpeculationIndex over the model's shared draft memory, or a private one with
    persist=False or FUCINA_JAX_NO_PERSIST set) with the reference documents (text or token ids) added."""
    if isinstance(references, (str, bytes)):
        raise TypeError(f"references must be a list of documents (text or token ids), got a "
                        f"{type(references).__name__}: pass one document as [doc]")
    if source is None:
        mem = draft_memory(model) if persist else None
        source = mem.index() if mem is not None else SpeculationIndex(model.config.n_vocab)
    if references:
        if not hasattr(source, "add_reference"):
            raise DraftSourceError(
                f"references need a draft source with add_reference() (e.g. SpeculationIndex); got "
                f"{type(source).__name__}"
            )
        for doc in references:
            source.add_reference(reference_ids(model, doc))
    return source


class TurnBufferedSource:
    """A conversation's draft source across turns: the conversation index behind a buffer of the latest committed
    slice, which is forwarded to the index only once the turn keeps it.

    The decoder shows every committed slice to its source at once, but only the chat loop knows whether the turn
    keeps it (a stop sequence, the turn limit or an interrupt may cut it). So it forwards each slice (and its
    top-K rows) to the index only when the next one arrives or the next draft is asked for, and `end_turn(keep)`
    settles the last one: the part past the conversation's kept length is dropped and the index's pending draft is
    cut to what was kept, so those tokens count as neither accepted nor rejected. `sync(stream)` then brings the
    index to exactly the committed conversation: it observes the new turn's tokens, or rebuilds the index (same
    references) when the committed stream no longer extends what the index has seen.
    """

    def __init__(self, vocab_size: int, index_factory=None):
        self._factory = index_factory or (lambda: SpeculationIndex(vocab_size))
        self.index = self._factory()
        self._refs: list[np.ndarray] = []
        self._held: np.ndarray | None = None
        self._held_topk: np.ndarray | None = None
        self.rebuilds = 0

    # ---- DraftSource ------------------------------------------------------------------------------------

    @property
    def wants_topk(self) -> bool:
        return bool(getattr(self.index, "wants_topk", False))

    def suggest(self, context: np.ndarray, buf: np.ndarray) -> int:
        self._flush()
        return self.index.suggest(context, buf)

    def evidence(self):
        return self.index.evidence() if callable(getattr(self.index, "evidence", None)) else "draft"

    def siblings(self, k: int):
        return self.index.siblings(k) if callable(getattr(self.index, "siblings", None)) else []

    def observe(self, committed: np.ndarray) -> None:
        self._flush()
        self._held = np.array(committed, np.int32)

    def observe_topk(self, rows: np.ndarray) -> None:
        self._held_topk = np.array(rows)

    # ---- turns ------------------------------------------------------------------------------------------

    def end_turn(self, keep: int) -> None:
        """The conversation keeps `keep` stream tokens: forward the held slice up to there, drop the rest."""
        held, rows = self._held, self._held_topk
        self._held = self._held_topk = None
        base = self.index.n_committed
        if held is None:
            self.index.truncate_pending(0)  # a draft whose verify never committed (an interrupt)
            return
        k = max(0, min(len(held), keep - base))
        # The turn ended after this slice (a stop, the limit, an interrupt, a trim): draft tokens past the kept
        # part were never committed, so their outcome is unknown - not a rejection.
        self.index.truncate_pending(k)
        self.index.observe(held[:k])
        if rows is not None and k:
            # rows[j] belongs to held[len(held) - len(rows) + j]; keep the ones of the kept tokens
            first = len(held) - len(rows)
            rows = rows[: max(0, k - first)]
            if len(rows):
                self.index.observe_topk(rows)

    def sync(self, stream: np.ndarray) -> None:
        """Make the index's observed stream equal `stream` (the committed conversation)."""
        self._flush()
        seen = self.index.stream()
        if len(seen) <= len(stream) and np.array_equal(seen, stream[: len(seen)]):
            if len(stream) > len(seen):
                self.index.observe(np.asarray(stream[len(seen):], np.int32))
            return
        # The conversation was cut before tokens the index already learned (a re-rendered previous reply, a
        # stop sequence reaching back over earlier slices): an online suffix automaton cannot forget, so rebuild.
        self.rebuilds += 1
        self.index = self._factory()
        for ref in self._refs:
            self.index.add_reference(ref)
        if len(stream):
            self.index.observe(np.asarray(stream, np.int32))

    def add_reference(self, tokens: np.ndarray) -> int:
        self._flush()
        n = self.index.add_reference(tokens)
        self._refs.append(np.asarray(tokens, np.int32))
        return n

    def clear_references(self) -> None:
        self._flush()
        self.index.clear_references()
        self._refs.clear()

    def _flush(self) -> None:
        if self._held is not None:
            held, rows = self._held, self._held_topk
            self._held = self._held_topk = None
            self.index.observe(held)
            if rows is not None:
                self.index.observe_topk(rows)
