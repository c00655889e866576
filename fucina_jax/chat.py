"""Multi-turn chat: a `Conversation` over one KV cache, with optional lossless speculation and a REPL.

Each turn renders the whole conversation with the model's chat template (the file's own, else the family fallback),
keeps the longest prefix of the new rendering that is already committed (in the KV cache and the draft index) and
prefills only the rest. When the rendering diverges from the committed stream (the template trims the previous
reply, or re-encoding the reply text merges tokens differently) the cache is truncated at the divergence point and
re-prefilled from there, so the model always sees exactly the tokens a fresh prefill of the rendering would give.

Speculation (design record sections 7-9): the conversation owns one `SpeculationIndex` and one decoder for its whole
life, so the conversation suffix automaton, the reference cursors, the recycling matrix and the cost gate carry over
between turns. The decoder sees the index through a `TurnBufferedSource`, which keeps the index's stream byte-exact
with the committed conversation: tokens a turn's trim discards (a stop marker, anything past a stop, what an interrupt left
uncommitted) are never observed, and the index's pending-draft accounting is cut to match
(`SpeculationIndex.truncate_pending`).

Stops: the tokenizer's end-of-generation ids, the template's turn-end marker when it is one token, `extra_stop_ids`
(token ids: the decoder cuts at them inside a verify, so they are safe with speculation) and `stop_sequences`
(text-level, without speculation only: see `ChatOptions.validate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from fucina_jax.chat_template import ChatTemplate, chat_template_for, encode_chat
from fucina_jax.checks import is_int, undecodable_byte
from fucina_jax.decoder import INTERRUPTED, MAX_TOKENS, STOP_SEQUENCE, Decoder, Request
from fucina_jax.errors import ChatOptionsError, ContextFullError, FucinaError
from fucina_jax.model import Model
from fucina_jax.sampling import SamplerConfig, validated_config
from fucina_jax.speculative import SpecOptions, TurnBufferedSource, default_source, reference_ids
from fucina_jax.speculative.sources import finish_request

__all__ = ["ChatOptions", "Conversation", "Reply", "repl"]

DEFAULT_MAX_TOKENS = 512  # generated tokens per turn


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a Conversation generates. `sampler` None = SamplerConfig() (llama.cpp's defaults, a random seed fixed
    once for the conversation); `ctx` None = the model's default context; `system` opens the conversation."""

    sampler: SamplerConfig | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    ctx: int | None = None
    system: str | None = None
    speculation: bool = False
    spec_options: SpecOptions | None = None  # None = its defaults
    extra_stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[str, ...] = ()
    template: ChatTemplate | None = None  # None = chat_template_for(model.tokenizer)
    clock: bool = True  # feed wall-clock step costs to the cost gate (False: the static cost table only)
    persist: bool = True  # draft from the model's shared, persisted draft memory (speculative/sources.py)

    def validate(self, n_vocab: int) -> ChatOptions:
        if self.system is not None and not isinstance(self.system, str):
            raise TypeError(f"system must be a str (or None), got {type(self.system).__name__} {self.system!r}")
        if not is_int(self.max_tokens):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__} {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ChatOptionsError(f"max_tokens = {self.max_tokens}: a turn generates at least one token")
        bad = [t for t in self.extra_stop_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab]
        if bad:
            raise ChatOptionsError(f"extra_stop_ids {bad} are not token ids of this model (0..{n_vocab - 1})")
        if self.spec_options is not None:
            if not isinstance(self.spec_options, SpecOptions):
                raise TypeError(f"spec_options must be a fucina_jax.speculative.SpecOptions (or None), got "
                                f"{type(self.spec_options).__name__}")
        if any(not isinstance(s, str) or not s for s in self.stop_sequences):
            raise ChatOptionsError(f"stop_sequences must be non-empty strings; got {self.stop_sequences!r}")
        if self.stop_sequences and self.speculation:
            # Design record addendum: a text stop can complete on a token accepted in the middle of a verify batch,
            # after the decoder has already committed (and pushed into the penalty history, the index and the
            # cache) the tokens behind it in the same batch - rows the plain loop never draws, because it stops
            # one token after the sequence completes. That breaks the one-RNG-draw-per-committed-token contract.
            # Token-id stops do not: the decoder checks them row by row before committing.
            raise ChatOptionsError(
                "stop_sequences cannot be combined with speculation: a stop sequence completed by a token accepted "
                "mid-verify would commit draws past it that plain decoding never makes (the one-draw-per-committed-"
                "token contract). Use extra_stop_ids (token ids, checked per verified row) or turn speculation off"
            )
        return dataclasses.replace(self, sampler=validated_config(self.sampler),
                                   extra_stop_ids=tuple(int(t) for t in self.extra_stop_ids),
                                   stop_sequences=tuple(self.stop_sequences))


@dataclasses.dataclass
class Reply:
    """One assistant turn. `tokens` are the kept generated ids (what the conversation committed), `text` the reply
    stored in the conversation; `n_prefilled` prompt tokens were computed this turn, `n_reused` came from the
    cache."""

    text: str
    tokens: list[int]
    stop_reason: str  # a fucina_jax.decoder stop reason: STOP (an end-of-generation or extra stop id) |
    #                   STOP_SEQUENCE | MAX_TOKENS | CONTEXT | INTERRUPTED (KeyboardInterrupt, an error, or the
    #                   stream closed early)
    n_prefilled: int
    n_reused: int
    seconds: float


class Conversation:
    """A multi-turn chat with one model over one KV cache; see the module docstring.

    `send(text)` runs a turn and returns its Reply; `stream(text)` yields the reply's text as it is generated (its
    Reply is `last_reply` afterwards). An exception or KeyboardInterrupt during a turn, or closing the stream
    early, ends the turn with what was committed so far: the conversation stays usable.
    """

    def __init__(self, model, options: ChatOptions | None = None, **kw):
        if options is not None and kw:
            raise TypeError("pass either options= or keyword options, not both")
        if not isinstance(model, Model):
            raise TypeError(f"model must be a fucina_jax Model (fucina_jax.load(path)), got {type(model).__name__}")
        if options is not None and not isinstance(options, ChatOptions):
            raise TypeError(f"options must be a ChatOptions, got {type(options).__name__}")
        self.model = model
        self.options = (options or ChatOptions(**kw)).validate(model.config.n_vocab)
        o = self.options
        tok = model.tokenizer
        self.template = o.template or chat_template_for(tok)
        self.ctx = model.check_ctx(o.ctx)
        stops = set(tok.eog_ids) | set(o.extra_stop_ids)
        end_id = tok.token_id(self.template.turn_end) if self.template.turn_end else None
        if end_id is not None:
            stops.add(end_id)
        self.stop_ids = frozenset(stops)
        self._refs: list[np.ndarray] = []
        self.last_reply: Reply | None = None
        self._active = False  # a turn is running (its stream was started and has not ended)
        self.reset()

    # ---- public API -------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start over (no messages, an empty cache and index, fresh statistics); reference documents stay."""
        o = self.options
        self.messages: list[dict] = [{"role": "system", "content": o.system}] if o.system is not None else []
        if o.speculation:
            self.source: TurnBufferedSource | None = TurnBufferedSource(
                self.model.config.n_vocab, index_factory=lambda: default_source(self.model, persist=o.persist))
            for ref in self._refs:
                self.source.add_reference(ref)
            spec_options = o.spec_options or SpecOptions()
        else:
            self.source = None
            spec_options = SpecOptions(enabled=False)
        clock = time.perf_counter_ns if o.clock else None
        self.decoder = Decoder(self.model, ctx=self.ctx, options=spec_options, clock=clock)
        self.turns = 0
        self.n_prefilled = 0
        self.n_reused = 0
        self.n_generated = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0

    @property
    def tokens(self) -> np.ndarray:
        """The committed conversation stream (prompt turns and kept replies), int32."""
        row = self.decoder.rows[0]
        return row.stream[: row.n].copy() if row is not None else np.zeros(0, np.int32)

    def send(self, text: str) -> Reply:
        for _ in self.stream(text):
            pass
        return self.last_reply

    def stream(self, text: str) -> Iterator[str]:
        """Run one turn for the user message `text`, yielding the reply text as it is committed."""
        if not isinstance(text, str):
            raise TypeError(f"a user message is a str, got {type(text).__name__}")
        # Rendered (and checked) now; the message joins the conversation when the turn starts running, so a
        # stream that is never iterated leaves the conversation as it was.
        message = {"role": "user", "content": text}
        ids = np.asarray(encode_chat(self.model.tokenizer, [*self.messages, message], template=self.template),
                         np.int32)
        if ids.size >= self.ctx:
            raise ContextFullError(
                f"the conversation has {ids.size} tokens but the context holds {self.ctx}: use a larger --ctx, "
                "or start a new conversation (/reset in the REPL)"
            )
        return self._turn(ids, message, len(self.messages))

    def add_spec_reference(self, doc: str | Sequence[int]) -> int:
        """Index a reference document (text is encoded with the model's tokenizer, no BOS); returns its number.
        It matches the conversation so far at once and drafts from the next step on."""
        if self.source is None:
            raise ChatOptionsError("reference documents feed speculation: create the Conversation with "
                                   "speculation=True (--spec)")
        arr = reference_ids(self.model, doc)
        n = self.source.add_reference(arr)
        self._refs.append(arr)
        return n

    def clear_spec_references(self) -> None:
        self._refs.clear()
        if self.source is not None:
            self.source.clear_references()

    def stats(self) -> dict:
        """Counts over the conversation since the last reset, plus the decoder's and the index's statistics."""
        out = dict(turns=self.turns, tokens=len(self.tokens), prefilled=self.n_prefilled, reused=self.n_reused,
                   generated=self.n_generated, prefill_seconds=round(self.prefill_seconds, 3),
                   decode_seconds=round(self.decode_seconds, 3), ctx=self.ctx)
        if self.source is not None:
            out["spec"] = self.decoder.spec_stats() if self.decoder.rows[0] is not None else {
                "summary": "spec: no turn yet"}
            out["spec"]["sources_summary"] = self.source.index.summary()
            out["index_rebuilds"] = self.source.rebuilds
        return out

    def stats_summary(self) -> str:
        s = self.stats()
        lines = [f"chat: turns={s['turns']} tokens={s['tokens']}/{s['ctx']} prefilled={s['prefilled']} "
                 f"reused={s['reused']} generated={s['generated']} "
                 f"decode={s['generated'] / s['decode_seconds'] if s['decode_seconds'] else 0.0:.1f} tok/s"]
        if "spec" in s:
            lines += [s["spec"]["summary"], s["spec"]["sources_summary"]]
        return "\n".join(lines)

    # ---- one turn ---------------------------------------------------------------------------------------

    def _turn(self, ids: np.ndarray, message: dict, n_messages: int) -> Iterator[str]:
        if self._active or len(self.messages) != n_messages:
            raise RuntimeError("this turn was rendered before another turn ran: finish (or close) one turn's "
                               "stream before starting the next")
        self._active = True
        self.messages.append(message)
        dec = self.decoder
        o = self.options
        tok = self.model.tokenizer
        t_start = time.perf_counter()
        # The longest committed prefix of the new rendering: the cache (and index) keep it, the rest is prefilled.
        old = self.tokens
        m = min(old.size, ids.size)
        diff = np.flatnonzero(old[:m] != ids[:m])
        keep = int(diff[0]) if diff.size else m
        request = Request(tuple(ids.tolist()), o.max_tokens, o.sampler, self.stop_ids, self.source)
        try:
            logits = dec.begin([request], keep=[keep])
            logits.block_until_ready()  # the prefill's time belongs to the prefill, not to the first decode step
        except BaseException:
            self.messages.pop()
            self._active = False
            raise
        row = dec.rows[0]
        self.n_reused += row.reused
        self.n_prefilled += int(ids.size) - row.reused
        t_prefill = time.perf_counter()
        self.prefill_seconds += t_prefill - t_start
        if self.source is not None:
            self.source.sync(ids)
            self.source.index.begin_output()  # the reply is this turn's output (the past-output index learns it)

        base = int(ids.size)
        reused = row.reused
        gen: list[int] = []
        stop = MAX_TOKENS
        text = ""  # the reply text so far
        shown = 0  # characters of text already yielded
        hold = max((len(s) for s in o.stop_sequences), default=1) - 1  # a stop may still be completing there
        cut: int | None = None  # where a stop sequence starts in text
        sdec = tok.stream_decoder()
        finished = False  # the turn's end is decided: closing the stream now only skips the rest of the text
        try:
            outcome = dec.first(logits)[0]
            while True:
                for t in outcome.committed:
                    gen.append(t)
                    text += sdec.feed(t)
                if o.stop_sequences:
                    # a completed stop can only start in the text not searched before
                    lo = max(0, shown - hold)
                    hits = [i for i in (text.find(s, lo) for s in o.stop_sequences) if i >= 0]
                    if hits:
                        cut = min(hits)
                        stop = STOP_SEQUENCE
                        finished = True
                        if cut > shown:
                            yield text[shown:cut]
                            shown = cut
                        break
                safe = len(text) - hold if o.stop_sequences else len(text)
                if safe > shown:
                    yield text[shown:safe]
                    shown = safe
                if not row.active:
                    stop = row.finish  # STOP, MAX_TOKENS or CONTEXT: the decoder's stop rules
                    break
                outcome = dec.step()[0]
            finished = True
            if cut is None:
                text += sdec.flush()
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
        except BaseException:  # KeyboardInterrupt, the consumer closing the stream (GeneratorExit), an error
            if not finished:
                stop = INTERRUPTED
            raise
        finally:
            self._end_turn(base, gen, text if cut is None else text[:cut], stop, reused, t_start, t_prefill)

    def _end_turn(self, base: int, gen: list[int], text: str, stop: str, reused: int, t_start: float,
                  t_prefill: float) -> None:
        """Commit the turn: keep the generated tokens the reply text covers, trim the decoder and the index to
        them, store the reply."""
        self._active = False
        tok = self.model.tokenizer
        dec = self.decoder
        if stop == STOP_SEQUENCE:
            # keep the tokens whose bytes lie wholly inside the trimmed text; a token straddling the cut is
            # dropped and the next turn re-prefills the reply text as the template renders it
            budget = len(text.encode("utf-8"))
            kept, used = 0, 0
            for t in gen:
                used += len(tok.token_to_bytes(t))
                if used > budget:
                    break
                kept += 1
            gen = gen[:kept]
        elif stop == INTERRUPTED:
            text = tok.decode(gen)  # an interrupt may land between commit and display: store what was committed
        row = dec.rows[0]
        dec.rewind(0, min(row.n, base + len(gen)))
        if self.source is not None:
            self.source.end_turn(row.n)
            finish_request(self.model, self.source.index)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        self.n_generated += len(gen)
        self.decode_seconds += time.perf_counter() - t_prefill
        self.last_reply = Reply(text=text, tokens=list(gen), stop_reason=stop, n_prefilled=base - reused,
                                n_reused=reused, seconds=time.perf_counter() - t_start)


# ---- the REPL -------------------------------------------------------------------------------------------------

REPL_HELP = """commands: /ref FILE (add a reference document, needs --spec), /stats, /reset, /quit, /help
Ctrl-C stops the reply being generated; Ctrl-D (EOF) exits."""


def repl(conv: Conversation, *, out=None, err=None, prompt: str = "> ", read=input) -> int:
    """Interactive chat on a terminal: each line is a user turn, its reply streams to `out` (so do the commands'
    answers); the help banner and errors go to `err`. Returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    print(REPL_HELP, file=err, flush=True)
    while True:
        try:
            line = read(prompt)
        except EOFError:
            out.write("\n")
            out.flush()
            return 0
        except KeyboardInterrupt:
            out.write("\n")  # Ctrl-C at the prompt drops the line
            out.flush()
            continue
        line = line.strip()
        if not line:
            continue
        bad = undecodable_byte(line)
        if bad is not None:
            print(f"error: the line is not valid UTF-8 (byte 0x{bad[1]:02x} at character {bad[0]}); type it again",
                  file=err, flush=True)
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd == "/quit":
                return 0
            if cmd == "/help":
                print(REPL_HELP, file=out)
            elif cmd == "/stats":
                print(conv.stats_summary(), file=out)
            elif cmd == "/reset":
                conv.reset()
                print("conversation reset", file=out)
            elif cmd == "/ref":
                _repl_ref(conv, arg, out)
            else:
                print(f"unknown command {cmd}; {REPL_HELP}", file=out)
            out.flush()
            continue
        turn = None
        try:
            with _deferred_sigint() as pressed:
                turn = conv.stream(line)
                for piece in turn:
                    out.write(piece)
                    out.flush()
                    if pressed():
                        raise KeyboardInterrupt
            out.write("\n")
        except KeyboardInterrupt:
            if turn is not None:
                turn.close()  # ends the turn with what was committed (a no-op if it already ended)
            out.write("\n[interrupted]\n")
        except FucinaError as e:  # a full context, a template that rejects the conversation: keep the session
            print(f"error: {e}", file=err, flush=True)
        out.flush()


@contextlib.contextmanager
def _deferred_sigint():
    """During a reply, Ctrl-C only sets a flag that the reply loop reads after each piece. A KeyboardInterrupt
    raised by Python's own handler lands wherever the main thread is, and when that is a finalizer (JAX frees
    buffers in __del__ and weakref callbacks) Python prints it as "Exception ignored" and the reply goes on. A
    second Ctrl-C raises at once, e.g. during a long prefill. Off the main thread, the handler cannot be set: no-op."""
    hits = []

    def handler(signum, frame):
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield lambda: False
        return
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, old)


def _repl_ref(conv: Conversation, path: str, out) -> None:
    if not path:
        print("usage: /ref FILE", file=out, flush=True)
        return
    try:
        with open(os.path.expanduser(path), "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {path}: {e}", file=out, flush=True)
        return
    try:
        n = conv.add_spec_reference(text)
    except (ChatOptionsError, ValueError) as e:
        print(f"error: {e}", file=out, flush=True)
        return
    print(f"reference {n} added: {path}", file=out, flush=True)
