#!/usr/bin/env python
"""The benchmark suite: fucina_jax plain and speculative against llama.cpp plain and prompt-lookup, per task class.

    python bench/run.py                       # full: every model, 3 prompts per class, 128 tokens, writes BENCHMARKS.md
    python bench/run.py --quick               # one prompt per class, 24 tokens (what the CI test runs)
    python bench/run.py --models gemma3 --gen 64 --reps 2 --out-dir /tmp/b
    python bench/run.py --classes spec_bench --warm  # the six Spec-Bench-style categories, warm draft memory

Systems, run side by side in this one process and interleaved per task (the order rotates every repetition, so
machine drift hits every system alike): fucina_jax plain (generate), fucina_jax speculative (generate_speculative,
default SpecOptions, the shipped cost table plus the gate's live rescale), llama.cpp plain, and llama.cpp
prompt-lookup decoding (llama_cpp.llama_speculative.LlamaPromptLookupDecoding, 2 and 10 draft tokens; it needs
logits_all=True). Same model file, prompt ids, token budget, stop ids and sampler settings for all of them.

tok/s is decode only: fucina's GenerationResult.decode_tps (compiling calls excluded), llama.cpp's tokens after the
first one over the time from the first token to the last. The speculative stream must equal the plain stream token
for token (greedy and sampled: the RNG is keyed on the stream position); llama.cpp's samplers draw from their own
RNG, so only greedy llama.cpp streams are comparable (reported as `llama==`, informative: numerics differ).

Tasks live in bench/tasks/tasks.json: a continuation prompt for the base model (Gemma 3 270M) and a chat
conversation for the instruct model (SmolLM2-135M-Instruct, rendered with its own chat template). --classes takes
class names or a group: `spec_bench` is the six Spec-Bench-style categories written for this suite (mt_chat,
translation, summarization, qa, math_reasoning, rag; greedy), and the report adds their geometric mean per model
(spec/plain and spec/llama.cpp-best, over the six class means).

Draft memory. fucina_jax's default source (speculative/sources.py default_source) drafts from the process's shared
draft memory of the model (Token-Recycling matrix + past-output index, draft_memory()), fed by every request and
persisted in ~/.cache/fucina_jax/index: warmth carries across tasks in one process, and across processes. For the
suite that state is uncontrolled (it depends on the task order, on the repetitions - a task's second run would
draft its own first output - and on what earlier processes left on disk), so the bench never uses it:
  cold (default): every speculative run drafts from a private index (its conversation, its references, a fresh
      recycling matrix), as the committed BENCHMARKS.md figures did (they predate the draft memory).
  --warm: per model, two in-process memories (never read from or written to disk): before the timed runs, an
      untimed speculative run of task i feeds memory i % 2 (with 3 prompts a class, every class is in both). Each
      timed run of task i drafts from a copy of the other memory: other tasks' conversations, never its own
      output, the same state for every repetition and in any order. The rows and the report say which it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, ROOT)

import numpy as np

TASKS_PATH = os.path.join(HERE, "tasks", "tasks.json")
SYSTEMS = ("fucina_plain", "fucina_spec", "llama_plain", "llama_pld2", "llama_pld10")
LLAMA_SYSTEMS = ("llama_plain", "llama_pld2", "llama_pld10")
SPEC_BENCH = ("mt_chat", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench-style, greedy
CLASSES = ("grounded_copy", "verbatim_repetition", "code_edit", "rag_reference", "multi_turn_restatement",
           "free_form", "sampled_grounded_copy") + SPEC_BENCH
GROUPS = {"spec_bench": SPEC_BENCH}  # the report's geometric mean over each group's class means; --classes names
# The goals for speculative vs own plain (the suite reports them; they are not assertions). 0.98: never a loss.
GOALS = {"grounded_copy": 2.5, "verbatim_repetition": 4.0, "code_edit": 1.8, "rag_reference": 1.6,
         "multi_turn_restatement": 1.5, "free_form": 0.98, "sampled_grounded_copy": 1.8,
         **dict.fromkeys(SPEC_BENCH, 0.98), "rag": 1.8}
MODELS = ("gemma3", "smollm2")
DEFAULT_GEN = 128
QUICK_GEN = 24
DEFAULT_CTX = 1024
DEFAULT_SEED = 1234
LLAMA_THREADS = 2
SAMPLED = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}  # sampled tasks; temperature comes from the task


@dataclasses.dataclass
class Task:
    cls: str
    id: str
    prompt_ids: list[int]
    reference_ids: list[int] | None
    temperature: float


def model_path(name: str) -> str:
    if name == "gemma3":
        from fucina_jax.model import default_model_path

        return default_model_path()
    if name == "smollm2":
        from fucina_jax.testing import smollm2_path

        return smollm2_path()
    raise ValueError(f"unknown model {name!r}: use one of {MODELS}")


def load_tasks(model, style: str, *, quick: bool = False, path: str = TASKS_PATH,
               classes: tuple[str, ...] = CLASSES) -> list[Task]:
    """The tasks as prompt ids for `model`; style "continuation" (base models) or "chat" (instruct models)."""
    from fucina_jax.chat_template import encode_chat

    with open(path) as f:
        spec = json.load(f)
    docs = spec["documents"]

    def fill(text: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: docs[m.group(1)] if m.group(1) in docs else m.group(0), text)

    tasks, seen = [], set()
    for t in spec["tasks"]:
        if t["class"] not in classes or (quick and t["class"] in seen):
            continue
        seen.add(t["class"])
        tok = model.tokenizer
        if style == "chat":
            ids = encode_chat(tok, [dict(m, content=fill(m["content"])) for m in t["chat"]])
        else:
            ids = tok.encode(fill(t["continuation"]), add_special=True, parse_special=True)
        ref = tok.encode(docs[t["reference"]], add_special=False) if t.get("reference") else None
        tasks.append(Task(t["class"], t["id"], list(ids), ref, float(t["temperature"])))
    return tasks


def _sampler(task: Task, seed: int):
    from fucina_jax.sampling import SamplerConfig

    if task.temperature <= 0:
        return SamplerConfig(temperature=0.0, seed=seed)
    return SamplerConfig(temperature=task.temperature, seed=seed, **SAMPLED)


class Runner:
    """One model: its fucina_jax Model and llama.cpp instances, and one timed run per (system, task)."""

    def __init__(self, name: str, model, path: str, *, ctx: int, gen: int, seed: int, llama: bool,
                 warm: bool = False):
        self.name, self.model, self.path, self.ctx, self.gen, self.seed = name, model, path, ctx, gen, seed
        self.stops = frozenset(model.tokenizer.eog_ids)
        self.warm = warm
        self.memories = None  # --warm: two (RecyclingMatrix, OutputIndex) after prime(); task id -> the one it reads
        self.reads: dict[str, int] = {}
        self.llms = {}
        if llama:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            from fucina_jax.testing import open_llama_cpp

            kw = {"n_ctx": ctx, "n_threads": LLAMA_THREADS, "n_threads_batch": LLAMA_THREADS, "seed": seed, "verbose": False}
            self.llms["llama_plain"] = open_llama_cpp(path, **kw)
            for n in (2, 10):
                # prompt lookup verifies drafts through logits of every position: logits_all=True
                self.llms[f"llama_pld{n}"] = open_llama_cpp(path, logits_all=True,
                                                            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=n), **kw)

    @property
    def systems(self) -> tuple[str, ...]:
        return ("fucina_plain", "fucina_spec") + tuple(self.llms)

    def run(self, system: str, task: Task, gen: int | None = None) -> dict:
        gen = gen or self.gen
        if system.startswith("fucina"):
            return self._fucina(system == "fucina_spec", task, gen)
        return self._llama(self.llms[system], task, gen)

    def prepare_shapes(self, tasks: list[Task]) -> None:
        """One untimed speculative run per distinct step shape the tasks use (cache capacity x sampler), then wait
        for the background preparer: a live decoder compiles a verify width it has not run in the background
        (decoder._ready), and that must not happen inside a timed run (compiling calls are excluded from the
        rates; a background compile taking a core is not)."""
        from fucina_jax import aot
        from fucina_jax.models import fitted_capacity

        seen = set()
        for task in tasks:
            shape = (fitted_capacity(len(task.prompt_ids) + self.gen, self.ctx), task.temperature > 0)
            if shape not in seen:
                seen.add(shape)
                self._fucina(True, task, self.gen)
        aot.PREPARER.wait_idle()

    def prime(self, tasks: list[Task]) -> None:
        """--warm: task i feeds memory i % 2 with one untimed speculative run; its timed runs read the other one."""
        from fucina_jax.index import SpeculationIndex

        self.memories = [_memory(self.model.config.n_vocab) for _ in range(2)]
        for i, task in enumerate(tasks):
            source = SpeculationIndex(self.model.config.n_vocab, recycling_matrix=self.memories[i % 2][0],
                                      outputs=self.memories[i % 2][1])
            self._fucina(True, task, self.gen, source=source)
            source.finish_output()  # the output joins the memory (a no-op if the driver already did it)
            self.reads[task.id] = 1 - i % 2

    def _source(self, task: Task):
        """The timed speculative run's draft source: None (a private index, cold) or a copy of its warm memory."""
        if self.memories is None:
            return None
        from fucina_jax.index import SpeculationIndex

        matrix, outputs = _memory(self.model.config.n_vocab, self.memories[self.reads[task.id]])
        return SpeculationIndex(self.model.config.n_vocab, recycling_matrix=matrix, outputs=outputs)

    def _fucina(self, spec: bool, task: Task, gen: int, source=None) -> dict:
        from fucina_jax.generate import generate
        from fucina_jax.generate import generate_speculative

        kw = {"max_tokens": gen, "sampler": _sampler(task, self.seed), "ctx": self.ctx, "stop_ids": self.stops}
        if spec:
            refs = [task.reference_ids] if task.reference_ids else ()
            r = generate_speculative(self.model, task.prompt_ids, references=refs, persist=False,
                                     source=source if source is not None else self._source(task), **kw).run()
        else:
            r = generate(self.model, task.prompt_ids, **kw).run()
        return {"tokens": list(r.tokens), "tps": r.decode_tps, "spec": r.spec, "compile_s": r.compile_seconds}

    def _llama(self, llm, task: Task, gen: int) -> dict:
        llm.reset()
        llm.set_seed(self.seed)
        temp = max(task.temperature, 0.0)
        extra = SAMPLED if temp > 0 else {}
        out: list[int] = []
        t_first = t_last = None
        for tok in llm.generate(task.prompt_ids, temp=temp, repeat_penalty=1.0, reset=True, **extra):
            now = time.perf_counter()
            if t_first is None:
                t_first = now  # the prompt's eval ends here: decode time starts
            t_last = now
            if tok in self.stops:
                break
            out.append(int(tok))
            if len(out) >= gen:
                break
        n = len(out) - 1
        tps = n / (t_last - t_first) if n > 0 and t_last > t_first else 0.0
        return {"tokens": out, "tps": tps, "spec": None, "compile_s": 0.0}

    def close(self):
        for llm in self.llms.values():
            llm.close()
        self.llms.clear()


def _memory(vocab: int, like=None):
    """A draft memory (Token-Recycling matrix, past-output index) that lives in this process only: empty, or a copy
    of `like` (its automaton built now, not in the timed run's first step)."""
    from fucina_jax.index.outputs import OutputIndex
    from fucina_jax.index.recycling import RecyclingMatrix

    matrix, outputs = RecyclingMatrix(vocab), OutputIndex(vocab)
    if like is not None:
        matrix.table[:] = like[0].table
        outputs.load_outputs(like[1].outputs())
        outputs.refresh()
    return matrix, outputs


def _geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def bench_model(runner: Runner, tasks: list[Task], *, reps: int, bar=None, warmup: bool = True,
                on_row=None) -> list[dict]:
    """Every task on every system, `reps` times, the system order rotating per repetition and task."""
    if warmup:  # compile the steps (and warm llama.cpp) outside the timings; compile calls are excluded anyway
        w = next((t for t in tasks if t.cls == "verbatim_repetition"), tasks[0])
        for s in runner.systems:
            runner.run(s, w, gen=min(runner.gen, 32))
        runner.prepare_shapes(tasks)
    if runner.warm:
        if bar is not None:
            bar.set_postfix_str(f"{runner.name} warming the draft memory", refresh=True)
        runner.prime(tasks)
    rows = []
    systems = runner.systems
    for ti, task in enumerate(tasks):
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for rep in range(reps):
            k = (rep + ti) % len(systems)
            for s in systems[k:] + systems[:k]:
                runs[s].append(runner.run(s, task))
                if bar is not None:
                    bar.set_postfix_str(f"{runner.name} {task.id} {s}", refresh=False)
                    bar.update(1)
        tps = {s: statistics.median(r["tps"] for r in runs[s]) for s in systems}
        plain = runs["fucina_plain"][0]["tokens"]
        spec_runs = runs["fucina_spec"]
        st = spec_runs[-1]["spec"]
        llama_best = max((tps[s] for s in systems if s in LLAMA_SYSTEMS), default=float("nan"))
        gate = st["gate"]
        row = {
            "model": runner.name, "cls": task.cls, "id": task.id, "n_prompt": len(task.prompt_ids), "n_gen": len(plain),
            "temperature": task.temperature, "memory": "warm" if runner.warm else "cold", "tps": tps,
            "spec_speedup": tps["fucina_spec"] / tps["fucina_plain"] if tps["fucina_plain"] else float("nan"),
            "vs_llama_best": tps["fucina_spec"] / llama_best if math.isfinite(llama_best) and llama_best else float("nan"),
            "acceptance": st["acceptance"], "tok_per_step": st["tok_per_step"],
            "spec_equal": all(r["tokens"] == plain for r in spec_runs)
            and all(r["tokens"] == plain for r in runs["fucina_plain"]),
            "llama_equal": (runs["llama_plain"][0]["tokens"] == plain) if "llama_plain" in runs and
            task.temperature <= 0 else None,
            "gate": f"{gate['state']} trips={gate['trips']} probes={gate['probes']} (+{gate['probes_passed']}) "
                 f"scale={gate['cost_scale']}",
            "verify_steps": st["verify_steps"], "steps": st["steps"], "spec_summary": st["summary"],
        }
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (model, class): geometric means over the prompts, against the goals."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for cls in CLASSES:
            rs = [r for r in rows if r["model"] == model and r["cls"] == cls]
            if not rs:
                continue
            sp = _geomean([r["spec_speedup"] for r in rs])
            vs = _geomean([r["vs_llama_best"] for r in rs])
            out.append({"model": model, "cls": cls, "n": len(rs), "spec_speedup": sp, "goal": GOALS[cls],
                            "met": sp >= GOALS[cls], "vs_llama_best": vs, "acceptance": statistics.mean(
                                r["acceptance"] for r in rs), "spec_equal": all(r["spec_equal"] for r in rs)})
    return out


def group_means(summary: list[dict]) -> list[dict]:
    """Per (model, group of GROUPS): geometric means over the group's class means (classes that ran)."""
    out = []
    for model in dict.fromkeys(s["model"] for s in summary):
        for group, members in GROUPS.items():
            ss = [s for s in summary if s["model"] == model and s["cls"] in members]
            if ss:
                out.append({"model": model, "group": group, "classes": len(ss),
                            "spec_speedup": _geomean([s["spec_speedup"] for s in ss]),
                            "vs_llama_best": _geomean([s["vs_llama_best"] for s in ss]),
                            "spec_equal": all(s["spec_equal"] for s in ss)})
    return out


def _f(x, fmt="{:.2f}"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


CAVEATS = (
    "**Caveats.** The machine is a shared 2-core VM: other jobs ran during the measurement, so absolute tok/s "
    "drift; the systems are interleaved per task to cancel drift in the ratios, but single-prompt ratios remain "
    "noisy (llama.cpp's 2-thread barriers suffer most when another process takes a core). Acceptance, and therefore "
    "speedup, is a property of (model x exact token stream): a small model that paraphrases instead of copying gives "
    "the drafts nothing to match, and a prompt whose greedy output loops makes speculation look better than it is. "
    "Speedups are decode tok/s ratios with compile time excluded; both engines run quantized int8-activation "
    "kernels (fucina_jax's through the XLA FFI, docs/performance.md), so greedy streams of the two can still part at "
    "near-ties where their float summation orders differ."
)


def markdown(rows, summary, meta) -> str:
    systems = [s for s in SYSTEMS if any(s in r["tps"] for r in rows)]
    lines = [
        "# Benchmarks",
        "",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']}  ",
        (f"Mode: {meta['mode']} ({meta['gen']} generated tokens per run, {meta['reps']} interleaved repetition(s), "
         f"ctx {meta['ctx']}, seed {meta['seed']}, llama.cpp {LLAMA_THREADS} threads, draft memory "
         f"{meta['memory']}: bench/run.py's docstring)  "),
        f"Command: `{meta['command']}`  ",
        f"Wall time: {meta['seconds'] / 60:.1f} min",
        "",
        ("Regenerate with `python bench/run.py` (full) or `python bench/run.py --quick`. The verify-cost table the "
         "gate starts from: `python scripts/generate.py --spec-bench` (see fucina_jax/speculative/default_cost_table.json)."),
        "",
        CAVEATS,
        "",
        "## Per class (geometric mean over prompts)",
        "",
        "| model | class | prompts | spec/plain | goal | met | spec/llama.cpp-best | mean acc | spec == plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(f"| {s['model']} | {s['cls']} | {s['n']} | {_f(s['spec_speedup'])}x | {s['goal']}x | "
                     f"{'yes' if s['met'] else 'no'} | {_f(s['vs_llama_best'])}x | {_f(100 * s['acceptance'], '{:.0f}')}% "
                     f"| {'yes' if s['spec_equal'] else 'NO'} |")
    groups = group_means(summary)
    if groups:
        lines += ["", "## Groups (geometric mean over the class means; spec_bench: the Spec-Bench-style classes, "
                      "greedy)", "", "| model | group | classes | spec/plain | spec/llama.cpp-best | spec == plain |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {g['model']} | {g['group']} | {g['classes']} | {_f(g['spec_speedup'])}x | "
                  f"{_f(g['vs_llama_best'])}x | {'yes' if g['spec_equal'] else 'NO'} |" for g in groups]
    lines += ["", "## Per task (decode tok/s)", "",
              "| model | task | gen | " + " | ".join(systems) + " | spec/plain | spec/llama-best | acc | tok/step | "
              "spec==plain | llama== | gate |",
              "|---|---|---|" + "---|" * len(systems) + "---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['id']} | {r['n_gen']} | " + " | ".join(_f(r['tps'].get(s), '{:.1f}') for s in systems)
            + f" | {_f(r['spec_speedup'])}x | {_f(r['vs_llama_best'])}x | {_f(100 * r['acceptance'], '{:.0f}')}% | "
              f"{_f(r['tok_per_step'])} | {'yes' if r['spec_equal'] else 'NO'} | "
              f"{'-' if r['llama_equal'] is None else ('yes' if r['llama_equal'] else 'no')} | {r['gate']} |")
    lines += ["", "![speedups](bench/benchmarks.png)", ""]
    return "\n".join(lines)


def plot(rows, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}:{r['id']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows) + 2), 5))
    ax.bar(x - 0.2, [r["spec_speedup"] for r in rows], 0.4, label="fucina spec / fucina plain")
    ax.bar(x + 0.2, [r["vs_llama_best"] if math.isfinite(r["vs_llama_best"]) else 0 for r in rows], 0.4,
           label="fucina spec / llama.cpp best (plain, lookup 2, lookup 10)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("decode speed ratio")
    ax.legend(fontsize=8)
    ax.set_title("fucina_jax speculative decoding: speedups per task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_suite(models: dict, *, quick: bool, gen: int, reps: int, ctx: int = DEFAULT_CTX, seed: int = DEFAULT_SEED,
              llama: bool = True, progress: bool = True, classes: tuple[str, ...] = CLASSES,
              warmup: bool = True, tasks_path: str = TASKS_PATH, on_row=None, warm: bool = False) -> list[dict]:
    """models: name -> (fucina_jax Model, GGUF path, prompt style). Returns the per-task rows; `on_row(row)` sees
    each one as it is measured (a long run on a slow machine keeps what it measured). warm: the speculative runs
    draft from a warm memory (the module docstring), else each from a private one."""
    from tqdm import tqdm

    prepared = []
    for name, (model, path, style) in models.items():
        prepared.append((name, model, path, load_tasks(model, style, quick=quick, classes=classes, path=tasks_path)))
    n_sys = 5 if llama else 2
    total = sum(len(t) for *_, t in prepared) * reps * n_sys
    rows = []
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress) as bar:
        for name, model, path, tasks in prepared:
            runner = Runner(name, model, path, ctx=ctx, gen=gen, seed=seed, llama=llama, warm=warm)
            try:
                rows += bench_model(runner, tasks, reps=reps, bar=bar, warmup=warmup, on_row=on_row)
            finally:
                runner.close()
    return rows


def write_report(rows: list[dict], meta: dict, out_dir: str) -> tuple[list[dict], str, str]:
    """BENCHMARKS.md in out_dir, the chart and the raw results in out_dir/bench/; returns (summary, md, png)."""
    summary = summarize(rows)
    os.makedirs(os.path.join(out_dir, "bench"), exist_ok=True)
    png = plot(rows, os.path.join(out_dir, "bench", "benchmarks.png"))
    with open(os.path.join(out_dir, "bench", "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary, "groups": group_means(summary)}, f, indent=1,
                  default=str)
    md = os.path.join(out_dir, "BENCHMARKS.md")
    kept = ""
    if os.path.exists(md):
        with open(md) as f:
            kept = "".join(f"\n{m.group(0)}\n" for m in SECTION.finditer(f.read()))
    with open(md, "w") as f:
        f.write(markdown(rows, summary, meta) + kept)
    return summary, md, png


# Sections other benchmarks write into BENCHMARKS.md (scripts/bench_serve.py --benchmarks): kept when this suite
# rewrites the file.
SECTION = re.compile(r"<!-- section (\S+) -->.*?<!-- end \1 -->", re.S)


def write_section(path: str, name: str, body: str) -> None:
    """Put `body` into the file's section `name` (replacing the old one, else appended): the suite keeps it."""
    text = open(path).read() if os.path.exists(path) else ""
    block = f"<!-- section {name} -->\n{body.rstrip()}\n<!-- end {name} -->"
    pattern = re.compile(rf"<!-- section {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"one prompt per class, {QUICK_GEN} tokens")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    ap.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated task classes or groups "
                                                                 f"({', '.join(GROUPS)}); default all")
    ap.add_argument("--warm", action="store_true", help="speculative runs draft from a warm draft memory (the other "
                                                        "tasks' conversations), not a private one")
    ap.add_argument("--gen", type=int, default=0, help=f"tokens per run (default {DEFAULT_GEN}, quick {QUICK_GEN})")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions per task (median tok/s)")
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="context size for every system")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampler seed of the sampled tasks")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp systems")
    ap.add_argument("--out-dir", default=ROOT, help="where BENCHMARKS.md goes (the PNG and JSON go to "
                                                    "OUT_DIR/bench/)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    import fucina_jax
    from fucina_jax.speculative.bench import machine_description

    t0 = time.perf_counter()
    machine = machine_description()
    names = [m for m in args.models.split(",") if m]
    classes = tuple(dict.fromkeys(m for c in args.classes.split(",") if c for m in GROUPS.get(c, (c,))))
    for c in classes:
        if c not in CLASSES:
            ap.error(f"unknown class {c!r}: use {CLASSES} or a group {tuple(GROUPS)}")
    models = {}
    for name in names:
        path = model_path(name)
        models[name] = (fucina_jax.load(path), path, "continuation" if name == "gemma3" else "chat")
    gen = args.gen or (QUICK_GEN if args.quick else DEFAULT_GEN)
    os.makedirs(os.path.join(args.out_dir, "bench"), exist_ok=True)
    partial = os.path.join(args.out_dir, "bench", "results.partial.jsonl")
    with open(partial, "w"):
        pass

    def checkpoint(row):
        with open(partial, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    rows = run_suite(models, quick=args.quick, gen=gen, reps=args.reps, ctx=args.ctx, seed=args.seed,
                     llama=not args.no_llama, progress=not args.no_progress, classes=classes, on_row=checkpoint,
                     warm=args.warm)
    cmd = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
                "mode": "quick" if args.quick else "full", "gen": gen, "reps": args.reps, "ctx": args.ctx, "seed": args.seed,
                "command": cmd.strip(), "seconds": time.perf_counter() - t0, "memory": "warm" if args.warm else "cold"}
    summary, md, png = write_report(rows, meta, args.out_dir)
    for s in summary:
        print(f"{s['model']:8s} {s['cls']:24s} spec/plain {_f(s['spec_speedup'])}x (goal {s['goal']}x) "
              f"vs llama.cpp best {_f(s['vs_llama_best'])}x  acc {_f(100 * s['acceptance'], '{:.0f}')}%  "
              f"spec==plain {s['spec_equal']}")
    for g in group_means(summary):
        label = f"{g['group']} ({g['classes']} classes)"
        print(f"{g['model']:8s} {label:24s} spec/plain {_f(g['spec_speedup'])}x vs llama.cpp best "
              f"{_f(g['vs_llama_best'])}x  spec==plain {g['spec_equal']}  ({meta['memory']} draft memory)")
    print(f"wrote {md}, {png}")
    bad = [r["id"] for r in rows if not r["spec_equal"]]
    if bad:
        print(f"error: speculative stream differs from plain on {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
