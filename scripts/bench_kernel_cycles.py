"""The quantized kernels alone, in cycles: how close a verify row's arithmetic runs to what this core can do.

    python scripts/bench_kernel_cycles.py            # ~1 minute: peak rates, activation quantization, matmuls
    python scripts/bench_kernel_cycles.py --quick    # a few seconds (fewer repetitions)

Builds a small C++ harness against fucina_jax/kernels/qmatmul.cc (with FUCINA_KERNEL_HARNESS: no Python module,
no XLA runtime), with setup.py's flags, and runs on one thread:

  peak      the core's clock (a chain of dependent adds), and the AVX-512 rates the matmul kernel is bound by:
            vpdpbusd (64 int8 MACs each) and FMA per cycle, 16 independent accumulators
  quantize  the activations' q8 quantization (quantize_rows), cycles per 32-value block, for M rows of K = 2048
  matmul    one weight of 640 x 2048 at M = 1, 2, 4, 8, 16 rows: int8 MACs per cycle and their share of vpdpbusd's
            peak, with the weight in the core's L2 ("resident") and with 64 copies cycled ("streamed", 26-52 MB:
            a decode step's weights come from L3 or memory)

Cycles are wall time times the clock the add chain measured (turbo included, so a share of peak is a share of what
the core ran at). The figures are one thread's: a step splits the column groups across cores. Needs a C++ compiler
(g++ or $CXX) and jaxlib's FFI headers; AVX-512 VNNI for the AVX-512 rows (else the best instruction set the CPU has).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "fucina_jax" / "kernels"
CXXFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-w"]  # setup.py's, warnings off

HARNESS = r"""
#include "qmatmul.cc"
#include <chrono>
#include <cstdio>
#include <random>

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double clock_ghz(long n) {
  uint64_t v = 1;
  const double t = now();
  // register-register adds: a core may fold an add of an immediate at rename and run such a chain faster than 1/cycle
  for (long k = 0; k < n; ++k) __asm__ volatile("add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0" : "+r"(v));
  return 4.0 * n / (now() - t) / 1e9 + (v == 42 ? 1e-9 : 0.0);
}

// 16 independent chains of one AVX-512 instruction (vpdpbusd, or with kFma the FMA): how many issue a cycle.
template <bool kFma>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) double issue_rate(long n, double ghz) {
  __m512i a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_epi32(0x3F800000 + i);  // ~1.0f: no subnormal assists
  __m512i w = _mm512_castps_si512(_mm512_set1_ps(1.0001f)), x = _mm512_castps_si512(_mm512_set1_ps(0.999f));
  const double t = now();
  for (long k = 0; k < n; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      a[i] = kFma ? _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a[i]), _mm512_castsi512_ps(w),
                                                        _mm512_castsi512_ps(x)))
                  : _mm512_dpbusd_epi32(a[i], w, x);
    __asm__ volatile("" : "+v"(w), "+v"(x));
  }
  const double s = now() - t;
  int sum = 0;
  for (int i = 0; i < 16; ++i) sum += _mm512_reduce_add_epi32(a[i]);
  return 16.0 * n / (s * ghz * 1e9) + (sum == 42 ? 1e-9 : 0.0);
}

template <typename F>
double best_of(int rounds, int reps, F f) {
  double best = 1e30;
  for (int t = 0; t < rounds; ++t) {
    const double t0 = now();
    for (int r = 0; r < reps; ++r) f(r);
    best = std::min(best, (now() - t0) / reps);
  }
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  const int isa = best_isa();
  const bool avx512 = isa == 0;
  const double ghz = clock_ghz(100000000L);
  const double vnni = avx512 ? issue_rate<false>(20000000L, ghz) : 0.0;
  const double fma = avx512 ? issue_rate<true>(20000000L, ghz) : 0.0;
  std::printf("{\"part\": \"peak\", \"isa\": \"%s\", \"ghz\": %.3f, \"vpdpbusd\": %.3f, \"fma\": %.3f}\n",
              kIsas[isa].name, ghz, vnni, fma);
  std::mt19937 rng(1);
  const int64_t K = 2048, N = 640, G = N / kLanes, nb = K / kQB;
  for (int M : {1, 8, 64}) {
    std::vector<float> x(M * K);
    for (auto& v : x) v = (rng() % 20001) / 1000.0f - 10.0f;
    Act a;
    quantize_for(x.data(), M, K, nullptr, Weights{nullptr, nullptr, nullptr, nb, 1, kScaleF32, false, 8, 128}, isa, a);
    const double s = best_of(7, std::max(1, reps * 4 / M), [&](int) { quantize_rows(x.data(), a, isa); });
    std::printf("{\"part\": \"quantize\", \"M\": %d, \"K\": %ld, \"cycles_per_block\": %.1f}\n", M, (long)K,
                s * ghz * 1e9 / (M * nb));
  }
  struct Type { const char* name; int bits; bool affine; };
  for (const Type& t : {Type{"Q8_0", 8, false}, Type{"Q5_0", 5, false}, Type{"Q4_1", 4, true}}) {
    const int64_t bytes = G * nb * 64 * t.bits;
    const int copies = 64;
    std::vector<uint8_t> q(bytes * copies);
    for (auto& b : q) b = static_cast<uint8_t>(rng());
    std::vector<float> sc(G * nb * kLanes), off(G * nb * kLanes);
    for (auto& v : sc) v = 1e-3f * static_cast<float>(rng() % 100 + 1);
    for (auto& v : off) v = -1e-3f;
    Weights w{q.data(), sc.data(), t.affine ? off.data() : nullptr, nb, 1, kScaleF32, t.affine, t.bits,
              1 << (t.bits - 1)};
    for (int M : {1, 2, 4, 8, 16}) {
      std::vector<float> x(M * K), out(M * N);
      for (auto& v : x) v = (rng() % 2001) / 1000.0f - 1.0f;
      Act a;
      quantize_for(x.data(), M, K, nullptr, w, isa, a);
      for (int streamed = 0; streamed < 2; ++streamed) {
        const double s = best_of(5, reps, [&](int r) {
          Weights wr = w;
          wr.q = q.data() + (streamed ? r % copies : 0) * bytes;
          kIsas[isa].fn(wr, 0, G, a, out.data(), N);
        });
        const double per_cycle = double(M) * N * K / (s * ghz * 1e9);
        std::printf("{\"part\": \"matmul\", \"type\": \"%s\", \"M\": %d, \"weights\": \"%s\", \"us\": %.2f, "
                    "\"macs_per_cycle\": %.2f}\n", t.name, M, streamed ? "streamed" : "resident", s * 1e6, per_cycle);
      }
    }
  }
  return 0;
}
"""


def build(workdir: str) -> str:
    """Compile the harness; returns the executable's path."""
    import jax.ffi

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SystemExit("bench_kernel_cycles: no C++ compiler (set CXX or install g++)")
    src = Path(workdir) / "harness.cc"
    src.write_text(HARNESS)
    exe = str(Path(workdir) / "harness")
    cmd = [cxx, *CXXFLAGS, "-DFUCINA_KERNEL_HARNESS", "-isystem", jax.ffi.include_dir(), "-I", str(KERNELS), str(src),
           str(KERNELS / "select.cc"), "-o", exe, "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_kernel_cycles: the harness did not build:\n{done.stderr[-4000:]}")
    return exe


def run(reps: int) -> list[dict]:
    """Build and run the harness; its JSON lines as dicts."""
    with tempfile.TemporaryDirectory(prefix="fucina_kernel_cycles_") as d:
        out = subprocess.run([build(d), str(reps)], capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def report(rows: list[dict]) -> str:
    peak = next(r for r in rows if r["part"] == "peak")
    lines = [f"kernels: {peak['isa']}, one thread, clock ~{peak['ghz']:.2f} GHz"]
    if peak["vpdpbusd"]:
        lines.append(f"peak: vpdpbusd {peak['vpdpbusd']:.2f} / cycle ({64 * peak['vpdpbusd']:.0f} int8 MACs), "
                     f"FMA {peak['fma']:.2f} / cycle")
    for r in rows:
        if r["part"] == "quantize":
            lines.append(f"quantize  M {r['M']:3d} x K {r['K']}: {r['cycles_per_block']:6.1f} cycles per 32-block")
    lines.append("matmul 640 x 2048, MACs per cycle (share of vpdpbusd peak): resident | streamed")
    mats = [r for r in rows if r["part"] == "matmul"]
    vnni = 64 * peak["vpdpbusd"]  # int8 MACs a cycle at the peak (0: not measured)

    def cell(rate: float) -> str:
        return f"{rate:5.1f}" + (f" ({100 * rate / vnni:3.0f}%)" if vnni else "")

    for t in dict.fromkeys(r["type"] for r in mats):
        for m in dict.fromkeys(r["M"] for r in mats):
            rate = {r["weights"]: r["macs_per_cycle"] for r in mats if r["type"] == t and r["M"] == m}
            lines.append(f"  {t} M {m:2d}: {cell(rate['resident'])} | {cell(rate['streamed'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="calls per timing round (best of 5-7 rounds)")
    ap.add_argument("--quick", action="store_true", help="20 calls per round")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    rows = run(20 if args.quick else args.reps)
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
