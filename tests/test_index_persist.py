"""Persisted draft state (fucina_jax/index/persist.py): round trips, corrupt and foreign files, opt-outs, bounds."""

from __future__ import annotations

import logging
import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from fucina_jax.errors import DraftIndexError
from fucina_jax.index import IndexStore, OutputIndex, RecyclingMatrix, model_key
from fucina_jax.index import persist
from fucina_jax.index.recycling import SENTINEL

V, K = 300, 8
LOGGER = "fucina_jax.index.persist"


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv(persist.NO_PERSIST_ENV, raising=False)
    return IndexStore("model-A", directory=tmp_path / "cache")


def warm_matrix(seed: int = 0, rows: int = 120, vocab: int = V, k: int = K) -> RecyclingMatrix:
    rng = np.random.default_rng(seed)
    m = RecyclingMatrix(vocab, k)
    ids = rng.choice(vocab, rows, replace=False)
    m.table[ids] = rng.integers(0, vocab, (rows, k))
    m.table[ids[:10], 3:] = SENTINEL  # partly filled rows, as move-to-front leaves them
    return m


def warm_outputs(seed: int = 0, n: int = 30, **kw) -> OutputIndex:
    rng = np.random.default_rng(seed)
    ix = OutputIndex(V, **kw)
    for _ in range(n):
        if ix.n_outputs and rng.random() < 0.5:
            base = ix.outputs()[-1]
            ix.add_output(np.concatenate([base[: int(rng.integers(1, len(base) + 1))], rng.integers(0, 4, 3)]))
        else:
            ix.add_output(rng.integers(0, 4, int(rng.integers(1, 40))))
    return ix


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def drafts(ix: OutputIndex, seed: int = 1) -> list[list[int]]:
    """What a matcher drafts at every position of a random stream."""
    rng = np.random.default_rng(seed)
    m, buf, out = ix.matcher(), np.zeros(12, np.int32), []
    for _ in range(300):
        m.observe(rng.integers(0, 4, int(rng.integers(1, 3))).astype(np.int32))
        out.append(buf[: m.draft(buf, 12)].tolist() + m.last.counts.tolist())
    return out


# ---- round trips ------------------------------------------------------------------------------------


def test_recycling_round_trip(store, caplog):
    m = warm_matrix()
    assert store.save_recycling(m)
    back = store.load_recycling(V, K)
    assert back.table.dtype == np.int32 and np.array_equal(back.table, m.table)
    assert store.save_recycling(RecyclingMatrix(V, K))  # a cold matrix round-trips too (no rows)
    assert (store.load_recycling(V, K).table == SENTINEL).all()
    assert warnings_of(caplog) == []


def test_outputs_round_trip_suggests_exactly_what_the_original_does(store, caplog):
    ix = warm_outputs()
    assert store.save_outputs(ix)
    back = store.load_outputs(V)
    assert [o.tolist() for o in back.outputs()] == [o.tolist() for o in ix.outputs()]
    assert drafts(back) == drafts(ix) and any(drafts(ix))
    assert warnings_of(caplog) == []


def test_a_file_saved_under_a_larger_cap_loads_its_newest_outputs(store):
    ix = warm_outputs(n=40, max_tokens=2000)
    store.save_outputs(ix)
    small = store.load_outputs(V, max_tokens=100)
    kept, total = [], 0
    for o in reversed(ix.outputs()):
        if total + len(o) > 100:
            break
        kept.insert(0, o.tolist())
        total += len(o)
    assert [o.tolist() for o in small.outputs()] == kept and small.n_tokens <= 100


def test_files_are_named_by_model_and_bounded(store, tmp_path):
    other = IndexStore("model-B", directory=store.directory)
    assert store.path("recycling") != other.path("recycling") and store.path("outputs") != other.path("outputs")
    full = RecyclingMatrix(V, K)
    full.table[:] = 1
    store.save_recycling(full)
    assert os.path.getsize(store.path("recycling")) == persist.HEADER_BYTES + V * (K + 1) * 4  # the bound, reached
    ix = OutputIndex(V, max_tokens=500)
    for _ in range(600):
        ix.add_output([1])  # the worst case: one-token outputs, a length per token
    store.save_outputs(ix)
    assert os.path.getsize(store.path("outputs")) == persist.HEADER_BYTES + 8 * 500
    assert sorted(os.listdir(store.directory)) == sorted(
        os.path.basename(store.path(k)) for k in ("recycling", "outputs"))  # no temporary files left
    with pytest.raises(DraftIndexError):
        store.path("matrix")
    with pytest.raises(DraftIndexError):
        IndexStore("")


# ---- corrupt and foreign files ------------------------------------------------------------------------


def _rewrite(path, fn):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(fn(data))


def _header_field(offset: int, fmt: str, value):
    def fn(data):
        struct.pack_into(fmt, data, offset, value)
        return data
    return fn


CORRUPTIONS = {
    "truncated header": (lambda d: d[:40], "truncated"),
    "truncated payload": (lambda d: d[:-5], "truncated"),
    "padded": (lambda d: d + b"\0\0\0\0", "padded"),
    "flipped payload byte": (lambda d: d[:100] + bytes([d[100] ^ 0x10]) + d[101:], "checksum"),
    "wrong magic": (_header_field(0, "<8s", b"GGUF\0\0\0\0"), "magic"),
    "other version": (_header_field(8, "<I", persist.FORMAT_VERSION + 1), "version"),
    "other vocab": (_header_field(16, "<I", V + 1), "vocabulary"),
    "empty": (lambda d: b"", "truncated"),
}


@pytest.mark.parametrize("kind", ["recycling", "outputs"])
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupt_file_is_ignored_with_one_warning_then_replaced(store, caplog, kind, case):
    state = warm_matrix() if kind == "recycling" else warm_outputs()
    save = store.save_recycling if kind == "recycling" else store.save_outputs
    load = (lambda: store.load_recycling(V, K)) if kind == "recycling" else (lambda: store.load_outputs(V))
    fresh = (lambda s: (s.table == SENTINEL).all()) if kind == "recycling" else (lambda s: s.n_outputs == 0)
    same = ((lambda s: np.array_equal(s.table, state.table)) if kind == "recycling"
            else (lambda s: [o.tolist() for o in s.outputs()] == [o.tolist() for o in state.outputs()]))
    path = store.path(kind)
    assert save(state)
    corrupt, why = CORRUPTIONS[case]
    _rewrite(path, corrupt)
    caplog.clear()
    assert fresh(load())
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and path in msgs[0] and why in msgs[0] and "\n" not in msgs[0], msgs
    assert save(state) and same(load())  # the next save replaces it
    assert len(warnings_of(caplog)) == 1


def test_foreign_files_other_key_k_kind_and_oversize(store, caplog):
    m = warm_matrix()
    store.save_recycling(m)
    other = IndexStore("model-B", directory=store.directory)
    shutil.copyfile(store.path("recycling"), other.path("recycling"))  # same bytes, under another model's name
    assert (other.load_recycling(V, K).table == SENTINEL).all()
    assert (store.load_recycling(V, 4).table == SENTINEL).all()  # K = 8 stored, 4 asked
    store.save_outputs(warm_outputs())
    shutil.copyfile(store.path("outputs"), store.path("recycling"))  # outputs where the matrix should be
    assert (store.load_recycling(V, K).table == SENTINEL).all()
    with open(store.path("outputs"), "wb") as f:  # larger than any outputs file this cap allows
        f.write(b"\0" * (persist.HEADER_BYTES + 8 * persist.DEFAULT_MAX_TOKENS + 1))
    assert store.load_outputs(V).n_outputs == 0
    msgs = warnings_of(caplog)
    assert len(msgs) == 4
    for msg, why in zip(msgs, ["another model", "K = 8", "b'OUTS'", "more than"]):
        assert why in msg, msg


def _repayload(path, edit):
    """Edit the payload of a stored file and make its header agree again (length, checksum)."""
    with open(path, "rb") as f:
        data = f.read()
    fields = list(persist._HEADER.unpack_from(data))
    payload = edit(bytearray(data[persist.HEADER_BYTES :]))
    fields[5], fields[7] = len(payload), zlib.crc32(payload)
    with open(path, "wb") as f:
        f.write(persist._HEADER.pack(*fields) + bytes(payload))


def test_a_checksummed_file_with_impossible_contents_is_ignored(store, caplog):
    m = warm_matrix()
    m.table[5, 0] = V + 3  # not a token of this vocabulary
    store.save_recycling(m)
    assert (store.load_recycling(V, K).table == SENTINEL).all()
    store.save_recycling(warm_matrix())
    _repayload(store.path("recycling"), lambda p: p[:4] + p[:4] + p[8:])  # a row id twice
    assert (store.load_recycling(V, K).table == SENTINEL).all()
    _repayload(store.path("recycling"), lambda p: p[:-4])  # not whole rows
    assert (store.load_recycling(V, K).table == SENTINEL).all()
    ix = warm_outputs()
    store.save_outputs(ix)
    m_out = ix.n_outputs

    def bad_token(p):
        struct.pack_into("<i", p, 4 * m_out, V)
        return p

    _repayload(store.path("outputs"), bad_token)
    assert store.load_outputs(V).n_outputs == 0
    store.save_outputs(ix)
    _repayload(store.path("outputs"), lambda p: p[:-4])  # lengths no longer add up
    assert store.load_outputs(V).n_outputs == 0
    msgs = warnings_of(caplog)
    assert len(msgs) == 5
    for msg, why in zip(msgs, ["candidate ids", "strictly increasing", "whole rows", "token ids", "disagree"]):
        assert why in msg, msg


def test_a_missing_file_is_a_silent_first_run(store, caplog):
    assert (store.load_recycling(V).table == SENTINEL).all() and store.load_outputs(V).n_outputs == 0
    assert warnings_of(caplog) == [] and not os.path.exists(store.directory)


def test_an_unwritable_directory_warns_once_and_never_raises(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(persist.NO_PERSIST_ENV, raising=False)
    (tmp_path / "file").write_text("not a directory")
    store = IndexStore("model-A", directory=tmp_path / "file" / "cache")
    assert not store.save_recycling(warm_matrix())
    assert not store.save_recycling(warm_matrix())
    assert not store.save_outputs(warm_outputs())
    msgs = warnings_of(caplog)
    assert len(msgs) == 2 and "cannot save" in msgs[0] and store.path("recycling") in msgs[0]  # once per file
    assert (store.load_recycling(V).table == SENTINEL).all()


def test_a_failed_replace_keeps_the_old_file_and_leaves_no_temporary(store, caplog, monkeypatch):
    old = warm_matrix(seed=1)
    store.save_recycling(old)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist.os, "replace", boom)
    assert not store.save_recycling(warm_matrix(seed=2))
    monkeypatch.undo()
    assert np.array_equal(store.load_recycling(V, K).table, old.table)
    assert os.listdir(store.directory) == [os.path.basename(store.path("recycling"))]
    assert "No space left" in warnings_of(caplog)[0]


# ---- opt-outs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["env", "parameter"])
def test_opting_out_reads_and_writes_nothing(tmp_path, monkeypatch, caplog, how):
    monkeypatch.delenv(persist.NO_PERSIST_ENV, raising=False)
    directory = tmp_path / "cache"
    on = IndexStore("model-A", directory=directory)
    on.save_recycling(warm_matrix())
    on.save_outputs(warm_outputs())
    before = {p: os.stat(on.path(p)).st_mtime_ns for p in ("recycling", "outputs")}
    if how == "env":
        monkeypatch.setenv(persist.NO_PERSIST_ENV, "1")
        off = IndexStore("model-A", directory=directory)
    else:
        off = IndexStore("model-A", directory=directory, enabled=False)
    assert not off.enabled
    assert (off.load_recycling(V, K).table == SENTINEL).all() and off.load_outputs(V).n_outputs == 0  # not read
    assert not off.save_recycling(warm_matrix(seed=9)) and not off.save_outputs(OutputIndex(V))
    assert {p: os.stat(on.path(p)).st_mtime_ns for p in ("recycling", "outputs")} == before  # not written
    fresh = IndexStore("model-A", directory=tmp_path / "elsewhere", enabled=how == "env")
    fresh.save_recycling(warm_matrix())
    assert not os.path.exists(tmp_path / "elsewhere")  # not even created
    assert warnings_of(caplog) == []


def test_the_environment_values_and_the_cache_directory(monkeypatch, tmp_path):
    for value, disabled in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(persist.NO_PERSIST_ENV, value)
        assert persist.persistence_disabled() is disabled
        assert IndexStore("k", directory=tmp_path).enabled is not disabled
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert persist.cache_dir() == str(tmp_path / "xdg" / "fucina_jax" / "index")
    assert IndexStore("k").directory == persist.cache_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert persist.cache_dir() == str(tmp_path / "home" / ".cache" / "fucina_jax" / "index")


# ---- the model key ----------------------------------------------------------------------------------


def test_model_key_follows_the_contents_not_the_path(tmp_path, fixture_path):
    a, b = fixture_path("qwen3"), fixture_path("gemma3")
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(a, copy)
    assert model_key(a) == model_key(copy) != model_key(b)
    size = os.path.getsize(copy)
    for offset in (0, 5000, size - 1):  # the header's first bytes, inside the first block, the last byte
        data = bytearray(copy.read_bytes())
        data[offset] ^= 1
        edited = tmp_path / f"edited{offset}.gguf"
        edited.write_bytes(bytes(data))
        assert model_key(edited) != model_key(a)
    with open(copy, "ab") as f:
        f.write(b"\0" * 32)
    assert model_key(copy) != model_key(a)  # another size
    assert len(model_key(a)) == 32 and model_key(a) == model_key(a)
