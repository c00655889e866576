#!/usr/bin/env python
"""Peak memory (RSS) of fucina_jax against the GGUF file size and against llama.cpp, model by model.

Each measurement runs in a fresh process, so the peaks are not mixed. For every model it prints:
  - fucina_jax's RSS after `import jax` and one op (the runtime floor, independent of the model), after loading,
    after a plain greedy generation and after a speculative one (which compiles the verify steps), with the peak
    over the whole run as a multiple of the file size, and the same peak less the floor;
  - llama.cpp's (llama-cpp-python) peak RSS for the same file, context and generation.

Models: the embedded Gemma 3 270M, a Gemma 3 1B-shaped random-weight Q8_0 file written once into --dir (its size
makes the fixed cost of the JAX runtime small against the weights, as it is for any real model of 1B parameters
and up), and any GGUF paths given.

  python scripts/bench_memory.py [MODEL.gguf ...] [--ctx 4096] [--gen 64] [--no-synthetic] [--no-llama]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

FUCINA_CODE = r"""
import sys
def rss():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["VmRSS"].split()[0]) / 1024, int(d["VmHWM"].split()[0]) / 1024
path, ctx, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import jax, jax.numpy as jnp
jnp.ones(3).block_until_ready()
print("STAGE floor %.1f %.1f" % rss(), flush=True)
import fucina_jax
from fucina_jax.generate import generate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.generate import generate_speculative
m = fucina_jax.load(path or None)
print("STAGE load %.1f %.1f" % rss(), flush=True)
ids = m.tokenizer.encode("The history of the printing press begins with")
greedy = SamplerConfig(temperature=0.0, seed=0)
generate(m, ids, max_tokens=gen, sampler=greedy, ctx=ctx, stop_ids=()).run()
print("STAGE plain %.1f %.1f" % rss(), flush=True)
generate_speculative(m, ids, max_tokens=gen, sampler=greedy, ctx=ctx, stop_ids=()).run()
print("STAGE spec %.1f %.1f" % rss(), flush=True)
"""

LLAMA_CODE = r"""
import resource, sys
from fucina_jax.testing import open_llama_cpp
path, ctx, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = open_llama_cpp(path, n_ctx=ctx, n_threads=2, verbose=False)
ids = llm.tokenize(b"The history of the printing press begins with")
out = llm.generate(ids, temp=0.0)
for _ in range(gen):
    next(out)
print("PEAK %.1f" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), flush=True)
"""


def run(code: str, *args) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"measurement failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.splitlines()


def synthetic_model(directory: str) -> str:
    from fucina_jax.testing import GEMMA3_1B_SHAPE, write_fixture

    path = os.path.join(directory, "gemma3-1b-shape-random-q8_0.gguf")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        print(f"writing {path} (random Q8_0 weights, Gemma 3 1B shapes) ...", flush=True)
        write_fixture(path + ".part", spec=GEMMA3_1B_SHAPE, qtype="Q8_0", random_codes=True)
        os.replace(path + ".part", path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="more GGUF files to measure")
    ap.add_argument("--ctx", type=int, default=4096, help="context size of both systems (default 4096)")
    ap.add_argument("--gen", type=int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fucina_jax", "synthetic"),
                    help="where the synthetic 1B-shaped file is written once (default ~/.cache/fucina_jax/synthetic)")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the 1B-shaped random-weight model")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    args = ap.parse_args()
    if args.ctx < 2 or args.gen < 1:
        ap.error("--ctx must be >= 2 and --gen >= 1")
    for p in args.models:
        if not os.path.isfile(p):
            ap.error(f"no such GGUF file: {p}")

    from fucina_jax.model import default_model_path

    models = [default_model_path()]
    if not args.no_synthetic:
        models.append(synthetic_model(args.dir))
    models += args.models
    print(f"ctx {args.ctx}, {args.gen} generated tokens; sizes in MiB")
    print(f"{'model':44s} {'file':>6s} {'floor':>6s} {'load':>6s} {'plain':>6s} {'spec':>6s} {'peak':>6s} "
          f"{'x file':>6s} {'-floor':>7s} {'llama':>6s} {'x file':>6s}")
    for path in models:
        size = os.path.getsize(path) / 2**20
        stages = {}
        for line in run(FUCINA_CODE, path, args.ctx, args.gen):
            if line.startswith("STAGE"):
                _, name, cur, peak = line.split()
                stages[name] = (float(cur), float(peak))
        peak = stages["spec"][1]
        floor = stages["floor"][0]
        llama = ""
        if not args.no_llama:
            out = run(LLAMA_CODE, path, args.ctx, args.gen)
            lpeak = float(next(ln for ln in out if ln.startswith("PEAK")).split()[1])
            llama = f" {lpeak:6.0f} {lpeak / size:5.2f}x"
        print(f"{os.path.basename(path)[:44]:44s} {size:6.0f} {floor:6.0f} {stages['load'][0]:6.0f} "
              f"{stages['plain'][0]:6.0f} {stages['spec'][0]:6.0f} {peak:6.0f} {peak / size:5.2f}x "
              f"{(peak - floor) / size:6.2f}x{llama}")
    print("floor: import jax + one op; load/plain/spec: RSS after each stage; peak: over the whole run; "
          "-floor: (peak - floor) / file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
