"""Draft state that outlives the process: the recycling matrix and the output index of one model, on disk.

Token Recycling keeps its matrix across queries (reset per prompt, one reimplementation fell from 1.87x to 1.30x
on translation) and SuffixDecoding's tree spans every past request; both pay only if they survive the process.
`IndexStore(model_key(path))` reads and writes them as two files in the user cache directory:

    $XDG_CACHE_HOME/fucina_jax/index/   (or ~/.cache/fucina_jax/index/, the base fucina_jax.model uses)
        recycling-<key digest>.bin      the RecyclingMatrix (vocab x K int32, only its seen rows)
        outputs-<key digest>.bin        the OutputIndex's outputs, oldest first

Every file is a 72-byte header, then the payload (little-endian):

    magic    8s   b"FJAXIDX\\0"
    version  u32  FORMAT_VERSION
    kind     4s   b"RCYL" (recycling) | b"OUTS" (outputs)
    vocab    u32  vocabulary size of the state
    param    u64  recycling: K, candidates per row; outputs: the number of outputs m
    length   u64  payload bytes
    key      32s  blake2b-256 of the model key
    crc      u32  zlib.crc32 of the payload

    recycling payload: int32 row ids [R] (strictly increasing: the seen rows, first slot set), int32 rows [R, K]
    outputs payload:   uint32 lengths [m], int32 tokens [sum(lengths)]

Sizes are bounded by construction: a recycling file holds at most vocab * (K + 1) * 4 bytes of payload (the
matrix is fixed size: 9 MiB at Gemma 3's 262,144 tokens, 1.7 MiB at SmolLM2's 49,152, far less while few rows are
seen), an outputs file at most 8 * max_tokens (each output has a token and a length). A file is written to a
temporary file in the same directory and moved over the old one with os.replace, so a reader sees the old file or
the new one, never a part. A missing file is a first run (silent). A truncated, corrupt (checksum), foreign (other
magic, version, kind, model key, vocabulary or K) or oversized file is ignored with one warning line that names it
and says why; a fresh state is used, and the next save replaces the file. A save that cannot write (a read-only
directory, a full disk) warns once per store and never raises. Two processes of one model do not merge: the last
save wins.

Opt out with FUCINA_JAX_NO_PERSIST=1 (any value but "" and "0") or IndexStore(..., enabled=False): nothing is then
read, written or created. Persistence changes which drafts are offered, never what is committed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import zlib

import numpy as np

from fucina_jax.errors import DraftIndexError
from fucina_jax.index.outputs import DEFAULT_MAX_TOKENS, OutputIndex
from fucina_jax.index.recycling import SENTINEL, TOPK, RecyclingMatrix

__all__ = ["IndexStore", "model_key", "cache_dir", "persistence_disabled", "NO_PERSIST_ENV", "FORMAT_VERSION"]

log = logging.getLogger(__name__)

NO_PERSIST_ENV = "FUCINA_JAX_NO_PERSIST"
FORMAT_VERSION = 1
MAGIC = b"FJAXIDX\0"
KIND_RECYCLING = b"RCYL"
KIND_OUTPUTS = b"OUTS"
_HEADER = struct.Struct("<8sI4sIQQ32sI")  # magic, version, kind, vocab, param, length, key digest, crc32
HEADER_BYTES = _HEADER.size  # 72

_KEY_SAMPLES = 64  # blocks model_key reads, evenly spaced over the file
_KEY_BLOCK = 16 << 10  # bytes per block: 1 MiB read in all


def cache_dir() -> str:
    """$XDG_CACHE_HOME/fucina_jax/index, or ~/.cache/fucina_jax/index (the base of fucina_jax.model's caches)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fucina_jax", "index")


def persistence_disabled() -> bool:
    """True when $FUCINA_JAX_NO_PERSIST is set to anything but "" or "0"."""
    return os.environ.get(NO_PERSIST_ENV, "") not in ("", "0")


def model_key(path: str | os.PathLike) -> str:
    """A cheap identity of a model file's contents: blake2b over its size and 64 blocks of 16 KiB spread evenly from
    its first byte to its last (1 MiB read, ~1 ms from the page cache; no GGUF parsing).

    The first block holds the GGUF header's counts and leading metadata (architecture, name); requantizing or
    converting again changes the size, and fine-tuned weights change the sampled tensor bytes (weights are ~97% of
    a file). Copies of one file at other paths share the key. It is a sample, not a full hash: a file edited only
    between the sampled blocks keeps its key, which costs draft quality only (the stored state is never trusted for
    what is committed); the vocabulary size is checked on its own when a file is read. Callers with a better
    identity can pass any string to IndexStore instead.
    """
    path = os.fspath(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        last = max(0, size - _KEY_BLOCK)
        for j in range(_KEY_SAMPLES):
            h.update(os.pread(f.fileno(), _KEY_BLOCK, last * j // (_KEY_SAMPLES - 1)))
    return h.hexdigest()


class _Ignored(Exception):
    """A stored file that cannot be used; the message says why."""


class IndexStore:
    """The persisted draft state of one model (see the module docstring for files and format).

    IndexStore(model_key, *, directory=None, enabled=True): `model_key` is any string naming the model's contents
    (`model_key(path)` computes one from the file); `directory` defaults to `cache_dir()`; `enabled=False` (or
    $FUCINA_JAX_NO_PERSIST) makes every load return a fresh state and every save a no-op, touching no file.
    Not thread-safe: one thread saves at a time.
    """

    def __init__(self, model_key: str, *, directory: str | os.PathLike | None = None, enabled: bool = True):
        if not isinstance(model_key, str) or not model_key:
            raise DraftIndexError(f"model_key must be a non-empty string; got {model_key!r}")
        self.model_key = model_key
        self.key_digest = hashlib.blake2b(model_key.encode(), digest_size=32).digest()
        self.directory = os.fspath(directory) if directory is not None else cache_dir()
        self.enabled = bool(enabled) and not persistence_disabled()
        self._save_warned: set[str] = set()

    def path(self, kind: str) -> str:
        """The file of `kind` ("recycling" or "outputs") for this model."""
        if kind not in ("recycling", "outputs"):
            raise DraftIndexError(f"kind must be 'recycling' or 'outputs'; got {kind!r}")
        return os.path.join(self.directory, f"{kind}-{self.key_digest[:8].hex()}.bin")

    # ---- the recycling matrix -----------------------------------------------------------------------

    def load_recycling(self, vocab_size: int, k: int = TOPK) -> RecyclingMatrix:
        """The stored matrix of this model, or a fresh one (no file, persistence off, or an unusable file)."""
        matrix = RecyclingMatrix(vocab_size, k)
        path = self.path("recycling")
        bound = HEADER_BYTES + vocab_size * (k + 1) * 4
        got = self._read(path, KIND_RECYCLING, vocab_size, bound, k)
        if got is None:
            return matrix
        _, payload = got
        try:
            if len(payload) % (4 * (k + 1)):
                raise _Ignored(f"a payload of {len(payload)} bytes is not whole rows of K = {k}")
            r = len(payload) // (4 * (k + 1))
            ids = np.frombuffer(payload, "<i4", r)
            rows = np.frombuffer(payload, "<i4", r * k, offset=4 * r).reshape(r, k)
            if r and (ids[0] < 0 or ids[-1] >= vocab_size or (r > 1 and (np.diff(ids) <= 0).any())):
                raise _Ignored("row ids are not strictly increasing ids of the vocabulary")
            if rows.size and (rows.min() < SENTINEL or rows.max() >= vocab_size):
                raise _Ignored(f"candidate ids outside [{SENTINEL}, {vocab_size})")
        except _Ignored as e:
            _warn_ignored(path, str(e))
            return matrix
        matrix.table[ids] = rows
        return matrix

    def save_recycling(self, matrix: RecyclingMatrix) -> bool:
        """Write the matrix (its seen rows); True when written. Never raises on I/O errors (one warning)."""
        if not self.enabled:
            return False
        table = matrix.table
        ids = np.flatnonzero(table[:, 0] != SENTINEL).astype("<i4")  # seen rows: an unseen row's first slot is empty
        payload = ids.tobytes() + np.ascontiguousarray(table[ids], "<i4").tobytes()
        return self._write(self.path("recycling"), KIND_RECYCLING, matrix.vocab_size, matrix.k, payload)

    # ---- the output index ---------------------------------------------------------------------------

    def load_outputs(self, vocab_size: int, *, max_tokens: int = DEFAULT_MAX_TOKENS, **kw) -> OutputIndex:
        """The stored outputs of this model in a new OutputIndex(vocab_size, max_tokens=..., **kw), or an empty one.

        A file holding more tokens than `max_tokens` (saved under a larger cap) loads its newest outputs that fit.
        """
        index = OutputIndex(vocab_size, max_tokens=max_tokens, **kw)
        path = self.path("outputs")
        # 8 bytes a token at most (its id, and a length if it is an output of its own)
        bound = HEADER_BYTES + 8 * max(max_tokens, DEFAULT_MAX_TOKENS)
        got = self._read(path, KIND_OUTPUTS, vocab_size, bound)
        if got is None:
            return index
        m, payload = got
        try:
            if 4 * m > len(payload):
                raise _Ignored(f"{m} outputs do not fit a payload of {len(payload)} bytes")
            lengths = np.frombuffer(payload, "<u4", m).astype(np.int64)
            total = int(lengths.sum())
            if (lengths == 0).any() or 4 * (m + total) != len(payload):
                raise _Ignored(f"output lengths (sum {total}) disagree with a payload of {len(payload)} bytes")
            tokens = np.frombuffer(payload, "<i4", total, offset=4 * m)
            if total and (tokens.min() < 0 or tokens.max() >= vocab_size):
                raise _Ignored(f"token ids outside [0, {vocab_size})")
        except _Ignored as e:
            _warn_ignored(path, str(e))
            return index
        index.load_outputs(np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1]) if m else [])
        return index

    def save_outputs(self, index: OutputIndex) -> bool:
        """Write the index's outputs, oldest first; True when written. Never raises on I/O errors (one warning)."""
        if not self.enabled:
            return False
        outs = index.outputs()
        lengths = np.array([len(o) for o in outs], "<u4")
        tokens = np.concatenate(outs).astype("<i4") if outs else np.zeros(0, "<i4")
        return self._write(self.path("outputs"), KIND_OUTPUTS, index.vocab_size, len(outs),
                           lengths.tobytes() + tokens.tobytes())

    # ---- the file format ----------------------------------------------------------------------------

    def _read(self, path: str, kind: bytes, vocab_size: int, bound: int,
              param: int | None = None) -> tuple[int, bytes] | None:
        """(header param, checked payload) of `path`, or None (persistence off, no file, or an unusable file: one
        warning). `param`, when given, must equal the header's."""
        if not self.enabled:
            return None
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > bound:
                    raise _Ignored(f"{size} bytes is more than this state can take ({bound})")
                data = f.read()
        except FileNotFoundError:
            return None
        except _Ignored as e:
            _warn_ignored(path, str(e))
            return None
        except OSError as e:
            _warn_ignored(path, f"unreadable ({e.strerror or e})")
            return None
        try:
            if len(data) < HEADER_BYTES:
                raise _Ignored(f"truncated ({len(data)} bytes, shorter than the {HEADER_BYTES}-byte header)")
            magic, version, got_kind, vocab, got_param, length, key, crc = _HEADER.unpack_from(data)
            if magic != MAGIC:
                raise _Ignored(f"not a fucina_jax index file (magic {magic!r})")
            if version != FORMAT_VERSION:
                raise _Ignored(f"format version {version}, this fucina_jax reads version {FORMAT_VERSION}")
            if got_kind != kind:
                raise _Ignored(f"it holds {got_kind!r} data, not {kind!r}")
            if key != self.key_digest:
                raise _Ignored("it belongs to another model (a different model key)")
            if vocab != vocab_size:
                raise _Ignored(f"vocabulary of {vocab} tokens, the model has {vocab_size}")
            if param is not None and got_param != param:
                raise _Ignored(f"K = {got_param} candidates per row, expected {param}")
            payload = memoryview(data)[HEADER_BYTES:]
            if len(payload) != length:
                raise _Ignored(f"truncated or padded: the header says {length} payload bytes, the file has "
                               f"{len(payload)}")
            if zlib.crc32(payload) != crc:
                raise _Ignored("checksum mismatch (a corrupt payload)")
        except _Ignored as e:
            _warn_ignored(path, str(e))
            return None
        return int(got_param), bytes(payload)

    def _write(self, path: str, kind: bytes, vocab_size: int, param: int, payload: bytes) -> bool:
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, vocab_size, param, len(payload), self.key_digest,
                              zlib.crc32(payload))
        tmp = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix="." + os.path.basename(path) + ".",
                                       suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())  # the data reaches the disk before the rename makes it the file
            os.replace(tmp, path)
            return True
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if path not in self._save_warned:
                self._save_warned.add(path)
                log.warning("fucina_jax: cannot save %s (%s); draft state is not persisted", path,
                            e.strerror or e)
            return False


def _warn_ignored(path: str, why: str) -> None:
    log.warning("fucina_jax: ignoring %s: %s; starting fresh (the next save replaces it)", path, why)
