"""Command line: `python scripts/generate.py [MODEL.gguf] --prompt ...` (scripts/generate.py only calls main()).

Text streams to stdout as tokens are committed; statistics go to stderr; `--json` prints one JSON object on stdout at
the end instead of the streamed text. Bad input exits non-zero with one `error: ...` line and no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from fucina_jax.checks import undecodable_byte
from fucina_jax.errors import FucinaError

__all__ = ["main", "build_parser"]

DEFAULT_GEN = 128
DEFAULT_SPEC_BENCH_OUT = "spec_bench"
MAX_SPEC_REFS = 8  # reference documents per conversation (fucina_jax.index.CascadePolicy.max_references)
DEFAULT_SAMPLER = dict(
    temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
    frequency_penalty=0.0, presence_penalty=0.0,
)


class CLIError(Exception):
    """A bad command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse takes only -5 and -.5 for negative numbers; anything else starting with '-' is an option and
    # `--temp -inf` would say "expected one argument". Every float() spelling is a value here.
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):  # one clear line instead of usage + message
        raise CLIError(message)


def _nonneg_int(name):
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v

    return conv


def _prob(name):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {v}")
        return v

    return conv


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="generate.py",
        description="Generate text with a GGUF model (default: the embedded Gemma 3 270M) in JAX on the CPU.",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="path of a .gguf model file (default: the embedded Gemma 3 270M Q4_K_M)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default=None, help="prompt text; '-' reads it from stdin")
    src.add_argument("--prompt-file", "-f", default=None, help="read the prompt from this file ('-' = stdin)")
    src.add_argument("--tokenize", default=None, metavar="FILE",
                     help="print the token ids of FILE ('-' = stdin), one per line, and exit; loads no weights")
    p.add_argument("--gen", "-n", type=_nonneg_int("--gen"), default=DEFAULT_GEN,
                   help=f"number of tokens to generate (default {DEFAULT_GEN})")
    p.add_argument("--ctx", "-c", type=_nonneg_int("--ctx"), default=0,
                   help="context size in tokens (default: min(4096, the model's trained context))")
    p.add_argument("--f32", action="store_true",
                   help="dequantize every weight to f32 and run the pure-JAX reference path (default: quantized "
                        "weights run through fucina_jax's int8 kernels, F16/BF16/F32 ones through its float kernel)")
    p.add_argument("--cache-type", "-ct", choices=("f32", "f16"), default="f32",
                   help="KV cache element type: f16 halves its memory (llama.cpp's default) (default f32)")
    s = p.add_argument_group("sampling (llama.cpp semantics and defaults)")
    s.add_argument("--temperature", "--temp", type=float, default=DEFAULT_SAMPLER["temperature"],
                   help="temperature; <= 0 is greedy argmax (default 0.8)")
    s.add_argument("--top-k", type=_nonneg_int("--top-k"), default=DEFAULT_SAMPLER["top_k"],
                   help="keep the k most likely tokens; 0 = off (default 40)")
    s.add_argument("--top-p", type=_prob("--top-p"), default=DEFAULT_SAMPLER["top_p"],
                   help="nucleus sampling threshold in [0, 1]; 1 = off (default 0.95)")
    s.add_argument("--min-p", type=_prob("--min-p"), default=DEFAULT_SAMPLER["min_p"],
                   help="drop tokens below min_p * p(max) in [0, 1]; 0 = off (default 0.05)")
    s.add_argument("--repeat-penalty", type=float, default=DEFAULT_SAMPLER["repeat_penalty"],
                   help="penalise repeats of the last --repeat-last-n tokens; 1 = off (default 1.0)")
    s.add_argument("--repeat-last-n", type=int, default=DEFAULT_SAMPLER["repeat_last_n"],
                   help="penalty window; 0 = off, -1 = the whole context (default 64)")
    s.add_argument("--frequency-penalty", type=float, default=DEFAULT_SAMPLER["frequency_penalty"],
                   help="subtract count * value from repeated tokens' logits; 0 = off (default 0)")
    s.add_argument("--presence-penalty", type=float, default=DEFAULT_SAMPLER["presence_penalty"],
                   help="subtract value from logits of tokens present in the window; 0 = off (default 0)")
    s.add_argument("--seed", type=int, default=None, help="random seed (default: a random one, printed in --json)")
    sp = p.add_argument_group("speculative decoding (lossless: the same tokens as without it)")
    sp.add_argument("--spec", action="store_true",
                    help="draft from the conversation itself (suffix automaton) and recycled logits, verify in one "
                         "batched forward")
    sp.add_argument("--spec-ref", action="append", default=[], metavar="FILE",
                    help=f"a reference document the model may quote (implies --spec; repeatable, up to "
                         f"{MAX_SPEC_REFS}), tokenized with the model's tokenizer")
    sp.add_argument("--max-draft", type=int, default=None,
                    help="longest draft per verify, 1..15 (implies --spec; default 15)")
    sp.add_argument("--tree-siblings", type=int, default=None, metavar="N",
                    help="also verify up to N alternatives to a draft's first token, as a tree (implies --spec; "
                         "0..14, default 0: chains only)")
    sp.add_argument("--cost-table", default=None, metavar="FILE",
                    help="verify-cost table JSON written by --spec-bench, for the cost gate (implies --spec; "
                         "default: the table shipped for the embedded model)")
    sp.add_argument("--no-persist", action="store_true",
                    help="draft from this run's text only: do not read or write the model's persisted draft memory "
                         "(the recycling matrix and past outputs in ~/.cache/fucina_jax/index; also "
                         "FUCINA_JAX_NO_PERSIST=1)")
    sp.add_argument("--spec-bench", action="store_true",
                    help="measure this model's verify cost at every verify width in plain decode steps (the cost "
                         "gate's table; uses the sampling flags and --ctx), print it, write it as JSON and a PNG "
                         "plot, and exit")
    sp.add_argument("--spec-bench-out", default=DEFAULT_SPEC_BENCH_OUT, metavar="BASE",
                    help=f"--spec-bench writes BASE.json and BASE.png, replacing files of those names (default "
                         f"{DEFAULT_SPEC_BENCH_OUT})")
    ch = p.add_argument_group("chat (the model's chat template; the KV cache carries over between turns)")
    ch.add_argument("--chat", action="store_true", help="send --prompt as one user turn of a chat and print the reply")
    ch.add_argument("--repl", action="store_true",
                    help="interactive chat: one user turn per line, the reply streams; /ref FILE, /stats, /reset, "
                         "/quit; Ctrl-C stops a reply, Ctrl-D exits (--prompt, if given, is the first turn)")
    ch.add_argument("--system", default=None, help="system message that opens the conversation (--chat/--repl)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object with ids, text and statistics on stdout at the end (no streaming)")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress or statistics on stderr")
    return p


def _read_text(path: str) -> str:
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CLIError(f"file not found: {path}") from None
        except IsADirectoryError:
            raise CLIError(f"{path} is a directory, not a file") from None
        except PermissionError:
            raise CLIError(f"cannot read {path}: permission denied") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"{path} is not valid UTF-8 text (byte {e.start}): convert it to UTF-8") from None


def _model_path(args) -> str:
    if args.model is None:
        from fucina_jax.model import default_model_path

        return default_model_path()
    if not os.path.exists(args.model):
        raise CLIError(f"model file not found: {args.model}")
    return args.model


def _sampler(args):
    from fucina_jax.sampling import SamplerConfig

    return SamplerConfig(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
    ).validate()


def _spec_args(args):
    """(SpecOptions or None when speculation is off, reference texts); checked before the model loads."""
    if not (args.spec or args.spec_ref or args.max_draft is not None or args.cost_table is not None or
            args.tree_siblings is not None):
        return None, []
    from fucina_jax.speculative import MAX_DRAFT, SpecOptions

    if len(args.spec_ref) > MAX_SPEC_REFS:
        raise CLIError(f"--spec-ref given {len(args.spec_ref)} times: at most {MAX_SPEC_REFS} reference documents")
    if args.max_draft is not None and not 1 <= args.max_draft <= MAX_DRAFT:
        raise CLIError(f"--max-draft must be in [1, {MAX_DRAFT}], got {args.max_draft}")
    if args.tree_siblings is not None and not 0 <= args.tree_siblings <= MAX_DRAFT - 1:
        raise CLIError(f"--tree-siblings must be in [0, {MAX_DRAFT - 1}], got {args.tree_siblings}")
    refs = []
    for path in args.spec_ref:
        text = _read_text(path)
        if not text:
            raise CLIError(f"--spec-ref {path} is empty")
        refs.append(text)
    import dataclasses

    options = SpecOptions() if args.max_draft is None else SpecOptions.up_to(args.max_draft)
    if args.tree_siblings:
        options = dataclasses.replace(options, tree_siblings=args.tree_siblings)
    if args.cost_table is not None:
        from fucina_jax.speculative.bench import load_batch_costs, load_cost_table

        options = dataclasses.replace(options, cost_table=load_cost_table(args.cost_table),
                                      batch_costs=load_batch_costs(args.cost_table))
    return options, refs


def _log(args, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def _options_given(args, ignore: set[str]) -> list[str]:
    """The option strings of the flags set to other than their defaults, but for the dests in `ignore`."""
    return [a.option_strings[0] for a in build_parser()._actions
            if a.option_strings and a.dest not in ignore and a.default is not argparse.SUPPRESS
            and getattr(args, a.dest) != a.default]


def run(args) -> int:
    if args.tokenize is not None:
        from fucina_jax.tokenizer import tokenize_to_lines

        ignored = _options_given(args, {"tokenize", "quiet"})
        if ignored:
            raise CLIError(f"--tokenize prints token ids and exits: it cannot be combined with {', '.join(ignored)}")
        path = _model_path(args)
        if args.tokenize != "-" and not os.path.exists(args.tokenize):
            raise CLIError(f"file not found: {args.tokenize}")
        tokenize_to_lines(path, args.tokenize)
        return 0

    if args.prompt_file is not None:
        prompt = _read_text(args.prompt_file)
    elif args.prompt == "-":
        prompt = _read_text("-")
    elif args.prompt is not None:
        prompt = args.prompt
        bad = undecodable_byte(prompt)
        if bad is not None:
            raise CLIError(f"--prompt is not valid UTF-8 (byte 0x{bad[1]:02x} at character {bad[0]}): "
                           "pass UTF-8 text, or read the prompt from a file with --prompt-file")
    else:
        prompt = ""
    sampler = _sampler(args)  # validate flags before the slow load
    if args.no_persist:
        from fucina_jax.index.persist import NO_PERSIST_ENV

        os.environ[NO_PERSIST_ENV] = "1"
    spec_options, refs = _spec_args(args)
    chatting = args.chat or args.repl
    if chatting and args.gen < 1:
        raise CLIError("--chat/--repl need --gen >= 1 (tokens per reply)")
    if args.repl and args.json:
        raise CLIError("--json prints one result at the end: it cannot be combined with --repl")
    if args.chat and not prompt:
        raise CLIError("--chat needs the user message: give --prompt (or --prompt-file)")
    if args.system is not None and not chatting:
        raise CLIError("--system applies to --chat and --repl only")
    if args.spec_bench_out != DEFAULT_SPEC_BENCH_OUT and not args.spec_bench:
        raise CLIError("--spec-bench-out applies to --spec-bench only")
    if args.spec_bench:
        if chatting:
            raise CLIError("--spec-bench measures the model and exits: it cannot be combined with --chat/--repl")
        _check_output_base(args.spec_bench_out)
    path = _model_path(args)

    import fucina_jax
    from fucina_jax.generate import generate

    t0 = time.perf_counter()
    model = fucina_jax.load(path, progress=not args.quiet, f32=args.f32, cache_type=args.cache_type)
    _log(args, f"loaded {os.path.basename(path)} ({model.config.arch}, {model.config.n_layers} layers) "
               f"in {time.perf_counter() - t0:.1f} s; the first steps compile (a few seconds)")
    ctx = args.ctx or model.default_ctx
    if ctx > model.config.context_length:
        raise CLIError(f"--ctx {ctx} exceeds the model's trained context of {model.config.context_length}")
    if args.spec_bench:
        from fucina_jax.speculative.bench import run_spec_bench

        base = args.spec_bench_out
        run_spec_bench(model, json_path=base + ".json", png_path=base + ".png", ctx=ctx, sampler=sampler,
                       progress=not args.quiet, command=" ".join(["python scripts/generate.py", *sys.argv[1:]]))
        return 0
    if chatting:
        return _run_chat(args, model, path, ctx, sampler, spec_options, refs, prompt)
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    if not ids:
        raise CLIError("the prompt is empty and the model adds no BOS token: give --prompt")
    if spec_options is not None:
        from fucina_jax.generate import generate_speculative

        gen = generate_speculative(model, ids, max_tokens=args.gen, sampler=sampler, ctx=ctx, references=refs,
                                   options=spec_options)
    else:
        gen = generate(model, ids, max_tokens=args.gen, sampler=sampler, ctx=ctx)
    stream = model.tokenizer.stream_decoder()
    out = sys.stdout
    for tok in gen:
        if not args.json:
            piece = stream.feed(tok)
            if piece:
                out.write(piece)
                out.flush()
    result = gen.result
    if not args.json:
        out.write(stream.flush() + "\n")
        out.flush()
    if result.stop_reason == "context":
        _log(args, f"stopped: the context of {ctx} tokens is full (use a larger --ctx)")
    def rate(tps: float) -> str:  # 0: every call of the phase compiled, so there is no clean rate to show
        return f"{tps:.1f} tok/s" if tps > 0 else "rate n/a (compiled)"

    # the rates leave out the time spent bringing programs in (compiled, or loaded from the persistent cache)
    _log(args, f"prompt: {result.n_prompt} tokens, {rate(result.prompt_tps)} | "
               f"decode: {result.n_gen} tokens, {rate(result.decode_tps)} | "
               f"compile/load: {result.compile_seconds:.2f} s (not in the rates) | stop: {result.stop_reason}")
    if result.spec is not None:
        _log(args, result.spec["summary"])
        if "sources_summary" in result.spec:
            _log(args, result.spec["sources_summary"])
    if args.json:
        d = result.to_json()
        d.update(model=path, load_seconds=getattr(model, "load_seconds", None))
        json.dump(d, out)
        out.write("\n")
    return 0


def _run_chat(args, model, path, ctx, sampler, spec_options, refs, prompt) -> int:
    """--chat: one user turn through fucina_jax.chat.Conversation; --repl: the interactive loop."""
    from fucina_jax.chat import ChatOptions, Conversation, repl

    conv = Conversation(model, ChatOptions(sampler=sampler, max_tokens=args.gen, ctx=ctx, system=args.system,
                                           speculation=spec_options is not None, spec_options=spec_options))
    for doc in refs:
        conv.add_spec_reference(doc)
    out = sys.stdout
    if prompt:
        for piece in conv.stream(prompt):
            if not args.json:
                out.write(piece)
                out.flush()
        reply = conv.last_reply
        if args.json:
            json.dump(dict(model=path, text=reply.text, tokens=reply.tokens, stop_reason=reply.stop_reason,
                           seed=sampler.seed, chat=conv.stats()), out)
        out.write("\n")
        out.flush()
        if reply.stop_reason == "context":
            _log(args, f"stopped: the context of {ctx} tokens is full (use a larger --ctx)")
        if not args.repl:
            _log(args, conv.stats_summary())
    if args.repl:
        return repl(conv, err=open(os.devnull, "w") if args.quiet else sys.stderr)
    return 0


def _save_draft_memory() -> None:
    """The run's drafts feed the model's persisted draft memory: write it now (the script exits with os._exit)."""
    speculative = sys.modules.get("fucina_jax.speculative.sources")
    if speculative is not None:
        speculative.save_all()


def _check_output_base(base: str) -> None:
    """--spec-bench-out is checked before the benchmark runs (~30 s), not after: a writable directory, a file name."""
    folder, name = os.path.split(base)
    if not name:
        raise CLIError(f"--spec-bench-out {base!r} names a directory; give a file name base, e.g. {base}spec_bench")
    if not os.path.isdir(folder or "."):
        raise CLIError(f"--spec-bench-out: directory {folder!r} does not exist")
    if not os.access(folder or ".", os.W_OK):
        raise CLIError(f"--spec-bench-out: directory {folder!r} is not writable")
    for ext in (".json", ".png"):
        if os.path.isdir(base + ext):
            raise CLIError(f"--spec-bench-out: {base + ext!r} is a directory")


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            return run(args)
        finally:
            _save_draft_memory()
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FucinaError, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
