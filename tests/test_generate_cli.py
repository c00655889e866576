"""Plain generation and the command line: greedy parity with llama.cpp on the embedded model, reproducible sampling,
the --json output, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fucina_jax import cli
from fucina_jax.generate import generate
from fucina_jax.sampling import SamplerConfig
from parity_helpers import assert_same_or_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplerConfig(temperature=0.0, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [
    b"The three primary colors are",
    b"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    b"Counting: 1, 2, 3, 4, 5,",
])
def test_greedy_64_matches_llamacpp_on_embedded_gemma3(prompt, gemma3, gemma3_path, llama_ref):
    ref = llama_ref(gemma3_path, n_ctx=2048, f32_cache=False)
    ids = ref.llm.tokenize(prompt, add_bos=True)
    theirs, rows = ref.greedy(ids, 64)
    result = generate(gemma3, ids, max_tokens=64, sampler=GREEDY, stop_ids=()).run()
    assert_same_or_near_tie(result.tokens, theirs, rows)
    assert result.n_gen == 64 and result.stop_reason == "max_tokens"


def test_sampling_reproducible_and_seed_dependent(fixture_path, load_model):
    model = load_model(fixture_path("qwen3"))
    ids = [5, 6, 7, 8]
    cfg = SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=123)
    a = generate(model, ids, max_tokens=24, sampler=cfg, stop_ids=()).run().tokens
    b = generate(model, ids, max_tokens=24, sampler=cfg, stop_ids=()).run().tokens
    c = generate(model, ids, max_tokens=24, sampler=SamplerConfig(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                                                   seed=124), stop_ids=()).run().tokens
    assert a == b
    assert a != c


def test_greedy_generate_equals_argmax_of_full_forward(fixture_path, load_model):
    """The loop (prefill + fused decode/sample steps) commits argmax(full-forward logits) at every step."""
    model = load_model(fixture_path("gemma3"))
    ids = [2, 40, 41, 42]
    toks = generate(model, ids, max_tokens=20, sampler=GREEDY, stop_ids=()).run().tokens
    stream = ids + toks
    full = model.logits(stream[:-1])
    assert toks == [int(t) for t in full[len(ids) - 1 :].argmax(-1)]


def test_stops_on_eog_and_on_full_context(fixture_path, load_model):
    model = load_model(fixture_path("qwen3"))
    ids = [5, 6, 7]
    free = generate(model, ids, max_tokens=10, sampler=GREEDY, stop_ids=()).run().tokens
    stopped = generate(model, ids, max_tokens=10, sampler=GREEDY, stop_ids={free[3]}).run()
    assert stopped.tokens == free[: free.index(free[3])] and stopped.stop_reason == "stop"
    full = generate(model, ids, max_tokens=50, sampler=GREEDY, ctx=8, stop_ids=()).run()
    assert full.stop_reason == "context" and len(ids) + full.n_gen == 8
    from fucina_jax.errors import ContextFullError

    with pytest.raises(ContextFullError, match="--ctx"):
        generate(model, list(range(10)), max_tokens=5, sampler=GREEDY, ctx=8).run()


def test_model_generate_api(fixture_path, load_model):
    model = load_model(fixture_path("qwen3"))
    gen = model.generate([5, 6, 7], max_tokens=6, temperature=0, seed=0)
    toks = list(gen)
    assert toks == gen.result.tokens and len(toks) == gen.result.n_gen


def run_cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_on_fixture(fixture_path, capsys):
    rc, out, err = run_cli([fixture_path("qwen3"), "--prompt", "the cat", "--gen", "5", "--temperature", "0",
                            "--json", "--quiet"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    for key in ("prompt_ids", "tokens", "text", "n_prompt", "n_gen", "prompt_tps", "decode_tps",
                "compile_seconds", "stop_reason", "seed"):
        assert key in d
    assert d["n_gen"] == len(d["tokens"]) <= 5 and d["n_prompt"] == len(d["prompt_ids"]) > 0
    rc, out16, err = run_cli([fixture_path("qwen3"), "--prompt", "the cat", "--gen", "5", "--temperature", "0",
                              "--json", "--quiet", "--cache-type", "f16"], capsys)
    assert rc == 0, err
    assert json.loads(out16)["n_prompt"] == d["n_prompt"]


@pytest.mark.parametrize("argv,needle", [
    (["--gen", "-1"], "--gen"),
    (["--top-p", "1.5"], "--top-p"),
    (["--min-p", "x"], "--min-p"),
    (["--repeat-last-n", "-5"], "repeat_last_n"),
    (["--repeat-penalty", "0"], "repeat_penalty"),
    (["missing-model.gguf", "-p", "hi"], "not found"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "not found"),
    (["--bogus-flag"], "unrecognized"),
    (["--cache-type", "q4_0"], "--cache-type"),
    (["-p", "hello \udcff world"], "--prompt is not valid UTF-8 (byte 0xff at character 6)"),  # argv's own escape
    (["--tokenize", "-", "--spec", "--gen", "5"], "cannot be combined with --gen, --spec"),  # would be ignored
    (["--tokenize", "-", "--temp", "0"], "cannot be combined with --temperature"),
    (["--max-draft", "-1"], "--max-draft must be in [1, 15], got -1"),
    (["--repeat-penalty", "1e-45"], "reciprocal overflows float32"),
    (["--temp", "-inf"], "temperature = -inf is invalid"),  # a value, not an option: argparse's own view of '-'
    (["--presence-penalty", "-1e-3", "--top-p", "2"], "--top-p"),  # -1e-3 parsed as a value
    (["-p", "hi", "--spec-bench-out", "x"], "--spec-bench-out applies to --spec-bench only"),
])
def test_cli_bad_input_is_one_line(argv, needle, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_cli_unreadable_prompt_file(tmp_path, capsys, fixture_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"\xff\xfe\xfa not utf-8")
    rc, out, err = run_cli([fixture_path("qwen3"), "--prompt-file", str(p)], capsys)
    assert rc != 0 and "UTF-8" in err and len(err.strip().splitlines()) == 1


def test_cli_not_gguf_model(tmp_path, capsys):
    p = tmp_path / "model.gguf"
    p.write_text("hello")
    rc, out, err = run_cli([str(p), "--prompt", "x"], capsys)
    assert rc == 1 and "not a GGUF file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_embedded_model_subprocess_json():
    """The real entry point on the embedded model, as a user runs it."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--prompt", "The capital of France is",
         "--gen", "8", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tokens"] == [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert d["text"].startswith(" the capital of")
    assert "decode:" in r.stderr


@pytest.mark.parametrize("which", ["gemma3", "smollm2"])
def test_cli_tokenize_matches_llamacpp(which, gemma3_path, smollm2_path, llama_ref, tmp_path, capsys):
    """--tokenize prints llama-tokenize's ids (BOS per metadata, special tokens parsed), one per line."""
    path = gemma3_path if which == "gemma3" else smollm2_path
    text = "Hello, world!\n\tdef f(x):\n    return x ** 2  # 3.14159 — ünïcödé 日本語 <start_of_turn> <|im_start|>"
    f = tmp_path / "text.txt"
    f.write_text(text, encoding="utf-8")
    rc, out, err = run_cli([path, "--tokenize", str(f)], capsys)
    assert rc == 0, err
    ours = [int(x) for x in out.split()]
    ref = llama_ref(path, n_ctx=512, f32_cache=False)
    add_bos = ref.llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
    assert ours == ref.llm.tokenize(text.encode(), add_bos=add_bos, special=True)
