"""The verify-cost table file format (written by the --spec-bench probe, fucina_jax.speculative.bench), read without JAX.

    {"format": "fucina_jax.cost_table", "version": 1, "model": ..., "date": ..., "machine": ..., "plain_ms": ...,
     "command": ..., "table": [{"width": 2, "draft_len": 1, "cost": 1.0, ...}, ...],
     "batch": [{"rows": 4, "width": 1, "cost": 1.5}, {"rows": 4, "width": 2, "cost": 1.1}, ...]}

Only `table[*].draft_len` (draft slots = verify width - 1) and `table[*].cost` (plain decode steps per verify) are
read, and the optional `batch` surface: a step of `width` rows per batch row over `rows` batch rows costs `cost`
plain steps of the same batch, and its `width` 1 entry is that batch's plain step in one-row plain steps. The rest
documents where the numbers come from. The gate's DEFAULT_COST_TABLE and DEFAULT_BATCH_COSTS are this module's
reading of the shipped file DEFAULT_TABLE_PATH.
"""

from __future__ import annotations

import json
import math
import os

from fucina_jax.errors import CostTableError

__all__ = ["DEFAULT_TABLE_PATH", "FORMAT", "FORMAT_VERSION", "read_batch_costs", "read_cost_points"]

FORMAT = "fucina_jax.cost_table"
FORMAT_VERSION = 1

def _kernel_isa() -> str:
    """'avx512' where the quantized kernels run their AVX-512 VNNI code, else 'avx2' (read from /proc/cpuinfo and
    FUCINA_KERNEL_ISA, so without importing JAX or the kernels; the two instruction sets price a verify very
    differently)."""
    if os.environ.get("FUCINA_KERNEL_ISA") in ("avx2", "scalar"):
        return "avx2"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "avx512" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx2"
    except OSError:
        pass
    return "avx512"


# Package data: produced by the probe on the embedded Gemma 3 270M (see each file's "command" and "machine" fields),
# one table per kernel instruction set: an AVX-512 VNNI Zen 4 (default_cost_table.json) and an AVX2-only Zen 3
# (default_cost_table_avx2.json), where the multi-row matmuls cost ~4x more instructions per MAC.
_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TABLE_PATH = os.path.join(
    _HERE, "default_cost_table_avx2.json" if _kernel_isa() == "avx2" else "default_cost_table.json")


def _read_doc(path: str) -> dict:
    """The checked JSON document of a cost-table file."""
    redo = _REDO
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CostTableError(f"cost table file not found: {path} ({redo}, or omit it to use the default)") from None
    except OSError as e:
        raise CostTableError(f"cannot read the cost table {path}: {e.strerror}") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:  # (nesting, huge numbers)
        raise CostTableError(f"{path} is not a JSON cost table ({e}); {redo}") from None
    if not isinstance(doc, dict) or "table" not in doc:
        raise CostTableError(f"{path} has no 'table' list: it is not a --spec-bench cost table; {redo}")
    if doc.get("format", FORMAT) != FORMAT or doc.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CostTableError(
            f"{path} is format {doc.get('format')!r} version {doc.get('version')!r}; this fucina_jax reads "
            f"{FORMAT!r} version {FORMAT_VERSION}; {redo}"
        )
    return doc


_REDO = "re-run --spec-bench to write a fresh one"


def _positive_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


def _cost(c) -> float:
    """A JSON cost as a float (nan when it is not a number, inf past float range)."""
    try:
        return math.nan if isinstance(c, bool) or not isinstance(c, (int, float)) else float(c)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf


def read_cost_points(path: str | os.PathLike) -> list[tuple[int, float]]:
    """(draft_len, cost) pairs of a cost-table file, checked; CostTableError names the file and the problem."""
    path = os.fspath(path)
    entries = _read_doc(path)["table"]
    if not isinstance(entries, list) or not entries:
        raise CostTableError(f"{path}: 'table' must be a non-empty list of {{draft_len, cost}} entries; {_REDO}")
    points: list[tuple[int, float]] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "draft_len" not in e or "cost" not in e:
            raise CostTableError(f"{path}: table entry {i} = {e!r} needs the keys 'draft_len' and 'cost'")
        d, cost = e["draft_len"], _cost(e["cost"])
        if not _positive_int(d):
            raise CostTableError(f"{path}: table entry {i} has draft_len = {d!r}; it must be an integer >= 1")
        if not math.isfinite(cost) or cost <= 0:
            raise CostTableError(f"{path}: table entry {i} has cost = {repr(e['cost'])[:40]}; it must be a finite "
                                 "number > 0 (plain decode steps per verify)")
        if points and d <= points[-1][0]:
            raise CostTableError(f"{path}: draft_len must strictly increase, but entry {i} has {d} after "
                                 f"{points[-1][0]}")
        points.append((d, cost))
    return points


def read_batch_costs(path: str | os.PathLike) -> list[tuple[int, int, float]]:
    """(rows, width, cost) entries of a cost-table file's optional `batch` surface, checked (none: [])."""
    path = os.fspath(path)
    entries = _read_doc(path).get("batch", [])
    if not isinstance(entries, list):
        raise CostTableError(f"{path}: 'batch' must be a list of {{rows, width, cost}} entries; {_REDO}")
    out: list[tuple[int, int, float]] = []
    seen = set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not {"rows", "width", "cost"} <= e.keys():
            raise CostTableError(f"{path}: batch entry {i} = {repr(e)[:80]} needs the keys 'rows', 'width' and "
                                 "'cost'")
        rows, width, cost = e["rows"], e["width"], _cost(e["cost"])
        if not (_positive_int(rows) and rows >= 2 and _positive_int(width)):
            raise CostTableError(f"{path}: batch entry {i} has rows = {rows!r}, width = {width!r}; rows must be an "
                                 "integer >= 2 and width an integer >= 1")
        if not math.isfinite(cost) or cost <= 0:
            raise CostTableError(f"{path}: batch entry {i} has cost = {repr(e['cost'])[:40]}; it must be a finite "
                                 "number > 0")
        if (rows, width) in seen:
            raise CostTableError(f"{path}: batch entry {i} repeats rows = {rows}, width = {width}")
        seen.add((rows, width))
        out.append((rows, width, cost))
    return out
