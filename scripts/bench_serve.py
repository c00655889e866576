#!/usr/bin/env python
"""The OpenAI-compatible server under load: fucina_jax with speculation off and on, against llama-cpp-python's own
server, on the same GGUF and thread count, in one run.

    python scripts/bench_serve.py                        # the embedded Gemma 3 270M, concurrency 1,2,4,8, 128 tokens
    python scripts/bench_serve.py --quick                # fewer requests, 48 tokens: a few minutes
    python scripts/bench_serve.py MODEL.gguf --concurrency 1,4 --gen 64 --json out.json
    python scripts/bench_serve.py --quick --serve-args "--backend serial"   # the server's flags

Systems: `spec off` and `spec on` are one fucina_jax server (`python -m fucina_jax.serve`), the request's
`speculation` field choosing; `llama.cpp` is `python -m llama_cpp.server --model F --n_threads T --n_threads_batch T`
(needs `pip install "llama-cpp-python[server]"`, the [bench] extra), started through a wrapper that opens its model with
fucina_jax.testing.open_llama_cpp (llama.cpp's extra buffer types off on a build with the AMX backend, whose matmul
segfaults on some machines). XLA uses every core; T (--threads) defaults to the core count.

Mixes (bench/tasks/tasks.json, continuation prompts for a base model, POST /v1/completions, streamed):
  grounded   the prompt holds a document the answer copies (grounded_copy, code_edit), greedy;
  free-form  open continuations (free_form), sampled as the tasks say (top-k 40, top-p 0.95, min-p 0.05, a seed).
At each concurrency c, c client threads send the mix's requests back to back (N requests in all, cycling over the
prompts); the systems take turns per (mix, concurrency), so machine drift hits them alike, and the server not
serving is stopped (SIGSTOP) for the turn: an idle llama_cpp.server spins. The fucina_jax server starts with
--warmup-all: every step program is in before the first request, so the levels measure serving, not compiling (a
server without it compiles a verify width in the background at its first use, which on 2 cores costs the
requests of that moment about half their speed). Each system first
serves every prompt of the mix once, unmeasured (fucina compiles its prefill buckets and verify widths there).

Reported per (mix, c, system): aggregate tok/s (completion tokens of all N requests / the level's wall time), time to
first token (request sent -> first text chunk) and time per output token ((last chunk - first chunk) / (tokens - 1)),
p50 and p95 over the requests; then the ratios spec on / spec off and each / llama.cpp. Only 127.0.0.1 is addressed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, ROOT)

from fucina_jax.serve.testing import HOST, LiveServer  # noqa: E402

TASKS = os.path.join(ROOT, "bench", "tasks", "tasks.json")
MIXES = {"grounded": ("grounded_copy", "code_edit"), "free-form": ("free_form",)}
SYSTEMS = ("spec off", "spec on", "llama.cpp")
SAMPLED = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
SEED = 1234

# llama_cpp.server, with its model opened by fucina_jax.testing.open_llama_cpp (extra buffer types off where the build
# has the AMX backend): llama_cpp.server.model calls `llama_cpp.Llama(model_path=..., ...)` through its module
# global, which a module delegating everything else to llama_cpp replaces.
LLAMA_WRAPPER = """
import runpy, sys, types
import llama_cpp
import llama_cpp.server.model as model
from fucina_jax.testing import open_llama_cpp

class LlamaCpp(types.ModuleType):
    def __getattr__(self, name):
        return getattr(llama_cpp, name)

shim = LlamaCpp("llama_cpp")
shim.Llama = lambda model_path, **kw: open_llama_cpp(model_path, **kw)
model.llama_cpp = shim
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def load_mix(name: str) -> list[dict]:
    with open(TASKS) as f:
        t = json.load(f)
    docs = t["documents"]
    out = []
    for task in t["tasks"]:
        if task["class"] in MIXES[name] and "reference" not in task:
            prompt = task["continuation"].format(**docs)
            out.append({"id": task["id"], "prompt": prompt, "temperature": float(task["temperature"])})
    return out


class LlamaServer:
    def __init__(self, model: str, port: int, ctx: int, threads: int):
        # --interrupt_requests False: its default cuts a running stream short when the next request arrives, and
        # every request here must run to its end.
        cmd = [sys.executable, "-c", LLAMA_WRAPPER, "--model", model, "--host", HOST, "--port", str(port),
               "--n_ctx", str(ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--verbose", "False", "--interrupt_requests", "False"]
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode} (is the [server] extra "
                                   "installed? pip install 'llama-cpp-python[server]')")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("llama_cpp.server did not start within 180 s")
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def one_request(port: int, body: dict, timeout: float) -> dict:
    """POST /v1/completions with stream=true; the time of the first and last text chunk and the token count."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    chunks = 0
    usage = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            break
        ev = json.loads(payload)
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices") or []:
            if c.get("finish_reason") is None and c.get("text") is not None:
                chunks += 1
                now = time.perf_counter()
                if c["text"]:
                    first = now if first is None else first
                    last = now
    conn.close()
    n = usage["completion_tokens"] if usage else chunks
    return {"start": t0, "first": first, "last": last, "tokens": n}


def run_level(port: int, jobs: list[dict], concurrency: int, timeout: float) -> dict:
    q: queue.Queue = queue.Queue()
    for j in jobs:
        q.put(j)
    results, errors = [], []

    def worker():
        while True:
            try:
                body = q.get_nowait()
            except queue.Empty:
                return
            try:
                results.append(one_request(port, body, timeout))
            except Exception as e:  # noqa: BLE001 - reported, the level goes on
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["first"] - r["start"] for r in results if r["first"] is not None]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results
            if r["first"] is not None and r["tokens"] > 1 and r["last"] > r["first"]]
    return {"requests": len(results), "errors": errors, "tokens": tokens, "wall_s": wall,
            "tokens_per_request": tokens / len(results) if results else 0.0,
            "tok_s": tokens / wall if wall > 0 else 0.0, "ttft_ms": pct_ms(ttft), "tpot_ms": pct_ms(tpot)}


def pct_ms(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p95": None}
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, max(0, round(0.95 * len(xs) + 0.5) - 1))]
    return {"p50": round(1e3 * statistics.median(xs), 1), "p95": round(1e3 * p95, 1)}


def bodies(mix: list[dict], system: str, n: int, gen: int) -> list[dict]:
    out = []
    for i in range(n):
        task = mix[i % len(mix)]
        body = {"prompt": task["prompt"], "max_tokens": gen, "temperature": task["temperature"], "stream": True,
                "stream_options": {"include_usage": True}}
        if task["temperature"] > 0:
            body.update(SAMPLED, seed=SEED + i)
        if system != "llama.cpp":
            body["speculation"] = system == "spec on"
        out.append(body)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default 1,2,4,8)")
    ap.add_argument("--gen", type=int, default=None, help="max_tokens per request (default 128, --quick 48)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per level: max(this, 2 x concurrency) (default 8, --quick 4)")
    ap.add_argument("--mixes", default="grounded,free-form", help="comma-separated: grounded, free-form")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    ap.add_argument("--benchmarks", default=None, metavar="FILE",
                    help="also write the tables into FILE's server section (e.g. BENCHMARKS.md; bench/run.py keeps "
                         "it when it rewrites the file)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads (default: cores)")
    ap.add_argument("--ctx", type=int, default=1024, help="context of both servers (default 1024)")
    ap.add_argument("--quick", action="store_true", help="48 tokens, 4 requests per level at least")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--serve-args", default="", metavar="ARGS",
                    help="extra flags for the fucina_jax server, e.g. \"--backend serial\" or \"--max-batch 4\"")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    gen = args.gen or (48 if args.quick else 128)
    per_level = args.requests or (4 if args.quick else 8)
    levels = [int(c) for c in args.concurrency.split(",")]
    mixes = [m.strip() for m in args.mixes.split(",")]
    systems = [s.strip() for s in args.systems.split(",")]
    bad = [m for m in mixes if m not in MIXES] + [s for s in systems if s not in SYSTEMS]
    if bad or not levels or min(levels) < 1:
        print(f"error: unknown mix/system {bad} or bad --concurrency", file=sys.stderr)
        return 2
    if args.model is None:
        from fucina_jax.model import default_model_path

        model = default_model_path()
    else:
        model = args.model
    servers, ports = {}, {}
    print(f"model {os.path.basename(model)}, ctx {args.ctx}, {gen} tokens per request, llama.cpp threads "
          f"{args.threads}, XLA on {os.cpu_count()} cores", flush=True)
    try:
        if {"spec off", "spec on"} & set(systems):
            t0 = time.perf_counter()
            fj = LiveServer(model, "--ctx", str(args.ctx), "--queue", "256", "--warmup-all", *args.serve_args.split(),
                            timeout=900)
            servers["fucina"] = fj
            ports["spec off"] = ports["spec on"] = fj.port
            with urllib.request.urlopen(fj.url + "/health", timeout=10) as r:
                health = json.load(r)
            backend = f"{health.get('backend', '?')} backend, {health['slots_total']} slots"
            print(f"fucina_jax server up in {time.perf_counter() - t0:.1f} s ({backend})", flush=True)
        if "llama.cpp" in systems:
            t0 = time.perf_counter()
            ll = LlamaServer(model, free_port(), args.ctx, args.threads)
            servers["llama"] = ll
            ports["llama.cpp"] = int(ll.url.rsplit(":", 1)[1])
            print(f"llama_cpp.server up in {time.perf_counter() - t0:.1f} s", flush=True)
        results = []
        owner = {"spec off": "fucina", "spec on": "fucina", "llama.cpp": "llama"}
        for mix_name in mixes:
            mix = load_mix(mix_name)
            for system in systems:  # warm-up: every prompt once, unmeasured
                with alone(servers, owner[system]):
                    run_level(ports[system], bodies(mix, system, len(mix), gen), 1, args.timeout)
            for c in levels:
                n = max(per_level, 2 * c)
                for system in systems:
                    with alone(servers, owner[system]):
                        r = run_level(ports[system], bodies(mix, system, n, gen), c, args.timeout)
                    r.update(mix=mix_name, concurrency=c, system=system)
                    results.append(r)
                    print(f"  {mix_name:9s} c={c} {system:9s} {r['tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{r['ttft_ms']['p50']} ms  TPOT p50 {r['tpot_ms']['p50']} ms  "
                          f"{r['tokens_per_request']:.1f} tok/request"
                          + (f"  ERRORS {r['errors'][:2]}" if r["errors"] else ""), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print_table(results, levels, mixes, systems)
    if args.benchmarks:
        from fucina_jax.speculative.bench import machine_description

        header = (f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  \nMachine: {machine_description()}  \n"
                  f"Command: `python scripts/bench_serve.py {' '.join(sys.argv[1:] if argv is None else argv)}`  \n"
                  f"Model {os.path.basename(model)}, ctx {args.ctx}, {gen} tokens per request, llama.cpp threads "
                  f"{args.threads}; aggregate tok/s over each level's requests, TTFT and TPOT p50 / p95.")
        write_benchmarks(args.benchmarks, results, levels, mixes, systems, header)
        print(f"wrote the server section of {args.benchmarks}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "ctx": args.ctx, "gen": gen, "threads": args.threads,
                       "serve_args": args.serve_args, "results": results}, f, indent=1)
    return 0


@contextlib.contextmanager
def alone(servers: dict, running: str):
    """The other servers' processes stopped (SIGSTOP) while `running` serves, continued after: an idle
    llama_cpp.server's threads keep spinning (66% of a core measured), which would tax whichever system runs next."""
    paused = [s.proc for name, s in servers.items() if name != running and s.proc.poll() is None]
    for proc in paused:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in paused:
            os.kill(proc.pid, signal.SIGCONT)


def table_lines(results, levels, mixes, systems) -> list[str]:
    """The results as two markdown tables: per (mix, c, system), then the ratios."""
    by = {(r["mix"], r["concurrency"], r["system"]): r for r in results}
    lines = ["| mix | c | system | agg tok/s | TTFT p50 / p95 ms | TPOT p50 / p95 ms | tok/request |",
             "|---|---|---|---|---|---|---|"]
    for m in mixes:
        for c in levels:
            for s in systems:
                r = by[(m, c, s)]
                lines.append(f"| {m} | {c} | {s} | {r['tok_s']:.1f} | {r['ttft_ms']['p50']} / {r['ttft_ms']['p95']}"
                             f" | {r['tpot_ms']['p50']} / {r['tpot_ms']['p95']} | {r['tokens_per_request']:.1f} |")
    pairs = [(a, b) for a, b in (("spec on", "spec off"), ("spec off", "llama.cpp"), ("spec on", "llama.cpp"))
             if a in systems and b in systems]
    if pairs:
        lines += ["", "| mix | c | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
                  "|---|---|" + "---|" * len(pairs)]
        for m in mixes:
            for c in levels:
                cells = []
                for a, b in pairs:
                    x, y = by[(m, c, a)]["tok_s"], by[(m, c, b)]["tok_s"]
                    cells.append(f"{x / y:.2f}x" if y > 0 else "n/a")
                lines.append(f"| {m} | {c} | " + " | ".join(cells) + " |")
    return lines


def print_table(results, levels, mixes, systems) -> None:
    print()
    print("\n".join(table_lines(results, levels, mixes, systems)))


def write_benchmarks(path: str, results, levels, mixes, systems, header: str) -> None:
    """The tables as BENCHMARKS.md's server section (bench/run.py keeps it when it rewrites the file)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import write_section

    write_section(path, "bench_serve", "\n".join(["## Server (scripts/bench_serve.py)", "", header, "",
                                                  *table_lines(results, levels, mixes, systems)]))


if __name__ == "__main__":
    sys.exit(main())
