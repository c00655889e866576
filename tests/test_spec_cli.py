"""--spec, --spec-ref and --max-draft on the command line (Qwen3 fixture): the same tokens as without them, the
statistics on stderr and in --json, one-line errors. (A --spec-ref document the model quotes, with reference-source
acceptance > 0, runs on the real model: tests/test_spec_gemma3.py, where the text is real text.)"""

from __future__ import annotations

import json

import pytest

from fucina_jax import cli

PROMPT = "hello world hello world, the quick brown fox"
FLAGS = ["--prompt", PROMPT, "--gen", "48", "--temperature", "0", "--ctx", "128", "--json"]


def run_cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_spec_ref_same_tokens_and_stats(fixture_path, tmp_path, capsys):
    model = fixture_path("qwen3")
    rc, out, err = run_cli([model, *FLAGS, "--quiet"], capsys)
    assert rc == 0, err
    plain = json.loads(out)
    assert plain["spec"] is None

    doc = tmp_path / "doc.txt"
    doc.write_text("hello world, the quick brown fox jumps over the lazy dog", encoding="utf-8")
    rc, out, err = run_cli([model, *FLAGS, "--spec", "--spec-ref", str(doc), "--max-draft", "7"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens"] == plain["tokens"] and res["text"] == plain["text"]
    spec = res["spec"]
    assert spec["max_draft"] == 7 and spec["committed"] + 1 == len(res["tokens"]) and spec["verify_steps"] > 0
    assert [s["name"] for s in spec["sources"]] == ["conversation", "ref0", "recycling"]
    # stderr: `spec: steps=... committed=... (X tok/step) ... (P% acc)` and the per-source line
    assert f"committed={spec['committed']} ({spec['tok_per_step']:.2f} tok/step)" in err
    assert f"({100 * spec['acceptance']:.1f}% acc)" in err
    assert spec["sources_summary"] + "\n" in err and "spec sources: conversation " in err


def test_spec_flag_alone(fixture_path, capsys):
    rc, out, err = run_cli([fixture_path("qwen3"), *FLAGS, "--spec", "--quiet"], capsys)
    assert rc == 0, err
    spec = json.loads(out)["spec"]
    assert spec["max_draft"] == 15 and spec["summary"].startswith("spec: steps=")
    assert [s["name"] for s in spec["sources"]] == ["conversation", "recycling"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--max-draft", "16"], "--max-draft must be in [1, 15]"),
        (["--max-draft", "0"], "--max-draft must be in [1, 15]"),
        (["--spec-ref", "/nonexistent/doc.txt"], "file not found"),
        (["--spec-ref", "DOC"] * 9, "at most 8 reference documents"),
    ],
)
def test_spec_bad_flags_are_one_line(fixture_path, tmp_path, capsys, extra, needle):
    doc = tmp_path / "doc.txt"
    doc.write_text("some text", encoding="utf-8")
    extra = [str(doc) if a == "DOC" else a for a in extra]
    rc, out, err = run_cli([fixture_path("qwen3"), "--prompt", "x", *extra], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1
