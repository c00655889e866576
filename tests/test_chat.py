"""Chat: multi-turn conversations over one KV cache, with and without speculation (fucina_jax.chat).

The reference for every reply is the plain generation loop run on a fresh prefill of the whole conversation as the
chat template renders it: carrying the cache over between turns, speculating, trimming turns at stops and
interrupting must all give the replies (token for token) that reference gives.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from fucina_jax.chat import ChatOptions, Conversation
from fucina_jax.speculative import TurnBufferedSource
from fucina_jax.chat_template import encode_chat
from fucina_jax.errors import ChatOptionsError
from fucina_jax.generate import generate
from fucina_jax.sampling import SamplerConfig
from fucina_jax.speculative import SpecOptions

GREEDY = SamplerConfig(temperature=0, seed=1)
MAX_TOKENS = 48
ALWAYS = SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False)  # the gate never trips: every draft is verified
CTX = 512  # a small cache keeps every step cheap
# Turn 2 makes SmolLM2 repeat its first reply: the conversation index has something to draft from.
TURNS = ["Repeat after me: I like green apples. I like red pears.", "Now say it again, word for word.",
         "What is the capital of France?"]
DOT = 30  # SmolLM2's "." token


def fresh_reply(model, messages, stop_ids, max_tokens=MAX_TOKENS) -> list[int]:
    """Plain decoding after a fresh prefill of the rendered conversation (ending with a user turn)."""
    ids = encode_chat(model.tokenizer, messages)
    return generate(model, ids, max_tokens=max_tokens, sampler=GREEDY, ctx=CTX, stop_ids=stop_ids).run().tokens


def chat(model, **kw) -> Conversation:
    """Greedy, short replies; clock=False: the cost gate prices verifies from its static table, so whether a step
    speculates does not depend on this machine's timings (what is committed never does)."""
    return Conversation(model, ChatOptions(sampler=GREEDY, max_tokens=MAX_TOKENS, ctx=CTX, clock=False, **kw))


def check_index_in_sync(conv: Conversation) -> None:
    """The TurnBufferedSource invariant: the conversation index has observed exactly the committed conversation."""
    np.testing.assert_array_equal(conv.source.index.stream(), conv.tokens)


@pytest.fixture(scope="module")
def three_turns(smollm2):
    out = {}
    for spec in (False, True):
        # ALWAYS: every draft is verified (the gate would switch a losing turn off: then nothing is proven)
        conv = chat(smollm2, speculation=spec, spec_options=ALWAYS if spec else None)
        out[spec] = (conv, [conv.send(t) for t in TURNS])
    return out


def test_spec_replies_byte_identical(three_turns):
    (_, plain), (conv, spec) = three_turns[False], three_turns[True]
    assert [r.text for r in spec] == [r.text for r in plain]
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert all(r.stop_reason == "stop" and r.tokens for r in plain)
    # not vacuous: the conversation index drafted tokens that verification accepted
    conversation = next(s for s in conv.source.index.stats() if s.name == "conversation")
    assert conversation.accepted > 0 and conv.decoder.rows[0].stats.accepted > 0
    check_index_in_sync(conv)
    assert conv.source.rebuilds == 0


def test_cache_carry_over_equals_reprefill(smollm2, three_turns):
    conv, replies = three_turns[False]
    messages = []
    for user, reply in zip(TURNS, replies):
        messages.append({"role": "user", "content": user})
        assert fresh_reply(smollm2, messages, conv.stop_ids) == reply.tokens
        messages.append({"role": "assistant", "content": reply.text})
    assert conv.messages == messages
    # only the new turn was prefilled: the whole previous conversation came from the cache, but for the reply's
    # newest token (the decoder's invariant: the cache holds the committed stream minus the carried token)
    assert replies[0].n_reused == 0
    for prev, reply in zip(replies, replies[1:]):
        assert reply.n_reused >= prev.n_reused + prev.n_prefilled + len(prev.tokens) - 1
    np.testing.assert_array_equal(conv.tokens[: -len(replies[-1].tokens)],
                                  encode_chat(smollm2.tokenizer, messages[:-1]))


def test_turn_gate_stop_id_mid_verify(smollm2):
    """A turn cut at an extra stop id (the stop often drafted mid-verify, with an overshoot behind it): the reply
    ends before the stop, the index stream equals the committed conversation after every turn."""
    conv = chat(smollm2, speculation=True, extra_stop_ids=[DOT])
    plain = chat(smollm2, extra_stop_ids=[DOT])
    for user in TURNS[:2]:
        r, p = conv.send(user), plain.send(user)
        assert r.stop_reason == "stop" and DOT not in r.tokens and not r.text.endswith(".")
        assert r.tokens == p.tokens
        check_index_in_sync(conv)
    assert conv.source.rebuilds == 0
    np.testing.assert_array_equal(conv.tokens, plain.tokens)


def test_turn_gate_drops_overshoot_and_its_accounting():
    """TurnBufferedSource unit test (no model): the decoder committed a slice past the turn's end; the gate forwards only the
    kept part and cuts the index's pending draft to it, so the dropped tokens count as neither accepted nor
    rejected; a cut before what the index has seen rebuilds it (references kept)."""
    gate = TurnBufferedSource(vocab_size=100)
    gate.add_reference(np.array([5, 6, 7, 8, 9, 10], np.int32))
    gate.sync(np.array([1, 5, 6], np.int32))
    buf = np.zeros(8, np.int32)
    n = gate.suggest(np.array([1, 5, 6], np.int32), buf)
    assert n >= 4 and list(buf[:4]) == [7, 8, 9, 10]
    gate.observe(np.array([7, 8, 9, 10], np.int32))  # held, not yet shown to the index
    assert gate.index.n_committed == 3
    gate.end_turn(keep=5)  # the turn keeps [1, 5, 6, 7, 8]: 9 and 10 were overshoot
    assert list(gate.index.stream()) == [1, 5, 6, 7, 8]
    ref = next(s for s in gate.index.stats() if s.name == "ref0")
    assert (ref.accepted, ref.drafted) == (2, 2)
    gate.sync(np.array([1, 5, 6, 7, 8, 42], np.int32))  # the next turn extends the stream: no rebuild
    assert gate.rebuilds == 0 and list(gate.index.stream()) == [1, 5, 6, 7, 8, 42]
    gate.sync(np.array([1, 5, 6, 3], np.int32))  # diverges inside what the index saw
    assert gate.rebuilds == 1 and list(gate.index.stream()) == [1, 5, 6, 3] and gate.index.n_references == 1


def test_reference_added_mid_conversation_drafts_next_turn(smollm2):
    turns = ["What is 2 + 2?", "Write a haiku about the sea."]
    plain = chat(smollm2)
    expected = [plain.send(t) for t in turns]
    # precondition: the second reply is new text (a reply repeating the first would be drafted by the conversation
    # source, which outranks references, and the reference would never get a turn)
    assert expected[1].text[:20] not in expected[0].text
    # the gate never trips: whether a verify pays is not what this test is about (a short first turn whose drafts
    # all fail would otherwise switch speculation off for the turn that can use the reference)
    conv = chat(smollm2, speculation=True, spec_options=ALWAYS)
    conv.send(turns[0])
    assert conv.add_spec_reference(expected[1].text) == 0
    reply = conv.send(turns[1])
    assert reply.tokens == expected[1].tokens
    ref = next(s for s in conv.source.index.stats() if s.name == "ref0")
    assert ref.drafted > 0 and ref.accepted > 0
    check_index_in_sync(conv)
    conv.clear_spec_references()
    assert conv.source.index.n_references == 0
    with pytest.raises(ChatOptionsError, match="speculation"):
        plain.add_spec_reference("no index without speculation")


def test_divergence_and_interrupt_reprefill(smollm2):
    """An edited history (the rendering no longer extends the committed stream) is re-prefilled from the divergence
    point; a turn closed early keeps what it committed; both give the fresh-prefill replies."""
    conv = chat(smollm2, speculation=True)
    conv.send(TURNS[2])
    conv.messages[-1]["content"] = "Paris is the capital of France, of course."
    n_before = len(conv.tokens)
    reply = conv.send("And of Italy?")
    assert 0 < reply.n_reused < n_before  # cut at the edit, not re-prefilled from scratch
    assert reply.tokens == fresh_reply(smollm2, conv.messages[:-1], conv.stop_ids)
    check_index_in_sync(conv)
    assert conv.source.rebuilds == 1

    turn = conv.stream("Write a long story about a dragon who learns to cook.")
    for _ in range(3):
        next(turn)
    turn.close()
    cut = conv.last_reply
    assert cut.stop_reason == "interrupted" and cut.tokens and conv.messages[-1]["content"] == cut.text
    check_index_in_sync(conv)
    reply = conv.send("What is the capital of France?")
    assert reply.tokens == fresh_reply(smollm2, conv.messages[:-1], conv.stop_ids)
    check_index_in_sync(conv)


def test_stop_sequences(smollm2):
    with pytest.raises(ChatOptionsError, match="one-draw-per-committed-token"):
        Conversation(smollm2, speculation=True, stop_sequences=["\n"])
    with pytest.raises(ChatOptionsError, match="extra_stop_ids"):
        ChatOptions(extra_stop_ids=[10**9]).validate(smollm2.config.n_vocab)
    # a stop string that starts inside a token of the plain reply: the text is cut inside that token, and the
    # token itself (which straddles the cut) is not committed
    full = chat(smollm2).send(TURNS[2])
    tok = smollm2.tokenizer
    texts = [tok.decode(full.tokens[:i]) for i in range(len(full.tokens) + 1)]
    k = next(i for i in range(1, len(full.tokens)) if len(texts[i + 1]) - len(texts[i]) >= 3
             and full.text.find(full.text[len(texts[i]) + 1 : len(texts[i]) + 3]) == len(texts[i]) + 1)
    stop = full.text[len(texts[k]) + 1 : len(texts[k]) + 3]
    conv = chat(smollm2, stop_sequences=[stop])
    stale = conv.stream("a turn that never starts")
    assert conv.messages == []
    pieces = list(conv.stream(TURNS[2]))
    reply = conv.last_reply
    with pytest.raises(RuntimeError, match="finish"):
        next(stale)  # rendered before the turn above ran: its prompt is out of date
    assert reply.stop_reason == "stop_sequence" and "".join(pieces) == reply.text
    assert reply.text == full.text[: len(texts[k]) + 1]
    assert reply.tokens == full.tokens[:k]  # the token the stop string starts in straddles the cut: dropped
    nxt = conv.send("And of Italy?")
    assert nxt.tokens == fresh_reply(smollm2, conv.messages[:-1], conv.stop_ids)


@pytest.mark.filterwarnings("ignore:os.fork")  # pexpect forks and at once execs a fresh interpreter
def test_repl_pty(smollm2_path):
    """The REPL on a pseudo-terminal: two turns, /stats, Ctrl-C during a reply, a further turn, EOF exits 0."""
    pexpect = pytest.importorskip("pexpect")
    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "generate.py")
    child = pexpect.spawn(sys.executable, [script, smollm2_path, "--repl", "--temp", "0", "-n", "400", "--ctx",
                                           str(CTX), "--spec", "-q"], encoding="utf-8", timeout=180,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        child.expect_exact("> ")
        child.sendline("What is the capital of France?")
        child.expect_exact("France?\r\n")  # the terminal's echo of the line
        child.expect(r"\w+")  # a reply (its words are the model's business; the REPL's mechanics are tested here)
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"turns=1 ")
        child.expect("spec: steps=")
        child.expect_exact("> ")
        child.sendline("Write a long story about a dragon who learns to cook.")
        child.expect_exact("learns to cook.\r\n")  # the terminal's echo of the line
        child.expect(r"(\w+[ ,.]+){8}")  # the reply is streaming
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect_exact("> ")
        child.sendline("What is the capital of Italy?")
        child.expect_exact("Italy?\r\n")
        child.expect(r"\w+")
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"turns=3 ")
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_gemma3_fallback_template_turns(gemma3):
    """The Gemma 3 270M file has no chat template: the family fallback renders it (trimming each message, so a
    reply ending in whitespace makes the next rendering diverge from the committed stream); speculative replies
    over the carried cache equal fresh-prefill plain replies."""
    conv = Conversation(gemma3, ChatOptions(sampler=GREEDY, max_tokens=16, ctx=256, speculation=True, clock=False))
    assert conv.template.is_fallback and "<start_of_turn>" in conv.template.source
    for user in ["What is the capital of France?", "And of Italy?", "Thanks."]:
        reply = conv.send(user)
        ids = encode_chat(gemma3.tokenizer, conv.messages[:-1])
        plain = generate(gemma3, ids, max_tokens=16, sampler=GREEDY, ctx=256, stop_ids=conv.stop_ids).run()
        assert reply.tokens == plain.tokens
        check_index_in_sync(conv)


def run_cli(argv, capsys):
    from fucina_jax import cli

    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_chat_one_turn(fixture_path, load_model, capsys):
    """--chat sends --prompt as one user turn: the reply a Conversation gives, with and without --spec."""
    import json

    path = fixture_path("qwen3")
    flags = [path, "--chat", "--prompt", "hello world", "--gen", "24", "--temperature", "0", "--ctx", "128",
             "--seed", "1", "--json"]
    expected = Conversation(load_model(path), ChatOptions(sampler=GREEDY, max_tokens=24, ctx=128)).send("hello world")
    for extra in ([], ["--spec"]):
        rc, out, err = run_cli(flags + extra, capsys)
        assert rc == 0, err
        res = json.loads(out)
        assert res["tokens"] == expected.tokens and res["text"] == expected.text
        assert res["chat"]["turns"] == 1 and ("spec" in res["chat"]) == bool(extra)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--repl", "--json"], "cannot be combined with --repl"),
        (["--chat"], "--chat needs the user message"),
        (["--prompt", "hi", "--system", "be brief"], "--system applies to --chat and --repl only"),
        (["--chat", "--prompt", "hi", "--gen", "0"], "--gen >= 1"),
    ],
)
def test_cli_chat_errors(fixture_path, capsys, argv, needle):
    rc, out, err = run_cli([fixture_path("qwen3"), *argv], capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1


def test_repl_refuses_a_line_that_is_not_utf8_and_goes_on(fixture_path, load_model):
    """stdin keeps undecodable bytes as lone surrogates: the line is refused with its byte, the session goes on."""
    import io

    from fucina_jax.chat import repl

    conv = Conversation(load_model(fixture_path("qwen3")), ChatOptions(sampler=GREEDY, max_tokens=3, ctx=128))
    lines = iter(["ok \udcff\udcfe", "hello", "/quit"])
    out, err = io.StringIO(), io.StringIO()
    assert repl(conv, out=out, err=err, read=lambda _: next(lines)) == 0
    assert "error: the line is not valid UTF-8 (byte 0xff at character 3)" in err.getvalue()
    assert conv.turns == 1 and conv.last_reply.text in out.getvalue()
