"""The interface between the HTTP layer and whatever runs the model, and the serial backend behind it.

The HTTP layer (serve/app.py) turns each request into a `GenRequest` (serve/protocol.py validates it), hands it to
`Backend.submit` and reads the `Ticket`'s events: `Delta`s, then exactly one `Done` or `Failed`. Everything the
HTTP layer needs from a backend is here, so a continuous-batching scheduler can replace `SerialBackend` without
touching the app:

  - `submit(req) -> Ticket` never blocks on the model: it queues the request or raises `QueueFull` (the bounded queue
    is full: 503 + Retry-After) or `ShuttingDown` (503);
  - the backend delivers events with `ticket.put(event)` (thread-safe; it wakes the asyncio reader);
  - `ticket.cancel()` (the client went away) is polled by the backend between tokens: it stops the request at its
    next step, frees the slot and ends the ticket with `Done("cancelled", ...)`;
  - `health()` and `shutdown(timeout)` as in the `Backend` protocol.

`TextAssembler` turns committed token ids into text deltas with OpenAI's `stop` strings applied (the output is cut at
the first occurrence of any of them, and text that might be the start of one is held back), so every backend streams
the same text for the same tokens.

`SerialBackend` runs one request at a time on one worker thread that owns the model, through the public decoding
API (`fucina_jax.generate.generate` / `fucina_jax.speculative.generate_speculative`), so a request's tokens are
exactly what the same call gives in-process. Stop strings are applied to the text and end the request: nothing
continues the stream after the cut, so this is lossless with speculation too.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol, Union

from fucina_jax.sampling import SamplerConfig

__all__ = [
    "GenRequest",
    "Delta",
    "Done",
    "Failed",
    "Event",
    "Ticket",
    "Backend",
    "QueueFull",
    "ShuttingDown",
    "TextAssembler",
    "SerialBackend",
    "FINISH_REASONS",
]

# Done.finish_reason values: OpenAI's "stop" (an end-of-generation / stop id, or a stop string) and "length"
# (max_tokens, or the context is full), plus "cancelled" (ticket.cancel(), or shutdown past its timeout).
FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class GenRequest:
    """One validated request, in token ids (serve/protocol.py builds it; every value is already checked).

    prompt_ids: the whole prompt (BOS included when the model adds one); 1 <= len < ctx.
    max_tokens: >= 1, and len(prompt_ids) + max_tokens <= the backend's ctx.
    sampler: validated, with a concrete seed (a request without `seed` got a random one).
    stop_ids: the model's end-of-generation ids, the chat template's turn-end id for chat, and the request's
      `stop_token_ids`; a sampled stop id ends the request and is not part of the output.
    stop_strings: OpenAI's `stop`: the output text is cut at the first occurrence of any (TextAssembler).
    speculation: decode speculatively (the same tokens, fewer forwards).
    references: documents for the draft index's reference automata (text, tokenized by the backend).
    chat_key: an opaque key of the conversation a chat request continues (OpenAI's `prompt_cache_key`), for
      prompt-cache reuse across turns; None: none given (a backend may still match cached prompts by prefix).
    """

    prompt_ids: list[int]
    max_tokens: int
    sampler: SamplerConfig
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    speculation: bool = False
    references: tuple[str, ...] = ()
    chat_key: Hashable | None = None


@dataclass(frozen=True)
class Delta:
    """Tokens committed since the last event and the text they make visible (may be "" while a UTF-8 character or a
    possible stop string is incomplete; the held-back text comes in a later Delta)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Done:
    """The request ended. usage: {"prompt_tokens", "completion_tokens", "total_tokens"} (completion_tokens counts
    every committed token, including any a stop string cut from the text). spec_stats: the decoder's speculation
    statistics (GenerationResult.spec) when the request speculated, else None."""

    finish_reason: str
    usage: dict
    spec_stats: dict | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed inside the backend; the backend keeps serving the others."""

    error: BaseException


Event = Union[Delta, Done, Failed]


class QueueFull(Exception):
    """submit() found the bounded queue full: answer 503 with Retry-After: retry_after (seconds)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class ShuttingDown(Exception):
    """submit() after shutdown() began."""


class Ticket:
    """What submit() returns; thread-safe. `events` (a queue.Queue) receives Delta items and then exactly one Done
    or Failed. Backends deliver with `put`, which also calls the `subscribe`d callbacks (the asyncio reader's
    wake-up); `cancel()` asks the backend to stop the request at its next step."""

    def __init__(self, request: GenRequest):
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self.submitted = time.monotonic()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._finished = False

    def cancel(self) -> None:
        """The client went away: the backend frees the slot at its next step (a no-op once the ticket ended)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        """Done or Failed was put."""
        return self._finished

    def put(self, event: Event) -> None:
        """Deliver one event (backend side). Nothing is delivered after the Done/Failed that ends the ticket."""
        with self._lock:
            if self._finished:
                return
            if isinstance(event, (Done, Failed)):
                self._finished = True
            self.events.put(event)
            listeners = list(self._listeners)
        for notify in listeners:
            try:
                notify()
            except Exception:  # a reader whose event loop is gone: nobody is waiting any more
                pass

    def subscribe(self, notify: Callable[[], None]) -> None:
        """Call notify() (from the backend's thread) after every event; called at once if events are waiting."""
        with self._lock:
            self._listeners.append(notify)
            pending = not self.events.empty()
        if pending:
            notify()


class Backend(Protocol):
    def submit(self, req: GenRequest) -> Ticket:
        """Queue one request; raises QueueFull when the bounded queue is full, ShuttingDown after shutdown()."""
        ...

    def health(self) -> dict:
        """{"status": "ok" | "shutting_down", "slots_total": N, "slots_free": N, "queued": N, ...}"""
        ...

    def shutdown(self, timeout: float) -> None:
        """Stop taking requests; let queued and running ones finish for up to `timeout` seconds, then cancel the
        rest; return when the worker(s) stopped."""
        ...


class TextAssembler:
    """Committed token ids -> text deltas, cut at the first occurrence of any stop string.

    While stop strings are set, the last max(len(stop)) - 1 characters are held back (they may be the start of a
    stop string still completing), so no delta ever shows text past a stop. `feed` returns the newly visible text;
    `stopped` turns True at a stop string (feed nothing after it); `finish` returns the rest at the end."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stops = tuple(stop_strings)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # the output text so far (cut at the stop string once `stopped`)
        self._shown = 0
        self.stopped = False

    def feed(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.text += self._decoder.feed(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.text += self._decoder.flush()
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._shown
        if self._stops:
            lo = max(0, shown - self._hold)  # a stop completing now starts in the text not searched before
            hits = [i for i in (self.text.find(s, lo) for s in self._stops) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                self.text = self.text[:cut]
                self._shown = max(shown, cut)
                return self.text[shown:cut]
        safe = len(self.text) if final else len(self.text) - self._hold
        if safe <= shown:
            return ""
        self._shown = safe
        return self.text[shown:safe]


def _usage(n_prompt: int, n_gen: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


# GenerationResult.stop_reason -> OpenAI's finish_reason ("eog" is the spelling of releases before "stop")
_FINISH = {"stop": "stop", "eog": "stop", "stop_sequence": "stop", "max_tokens": "length", "context": "length"}


@dataclass
class _Clock:
    """Exponential moving average of request service seconds (the Retry-After estimate)."""

    mean: float = 1.0
    n: int = 0

    def add(self, seconds: float) -> None:
        self.n += 1
        a = max(0.2, 1.0 / self.n)
        self.mean += a * (seconds - self.mean)


class SerialBackend:
    """One worker thread owns the model and runs requests one at a time, oldest first.

    ctx: the context every request must fit in (prompt + max_tokens <= ctx; protocol.py checks it). max_batch is
    accepted for the interface's sake (the batching scheduler's slot count) and reported by health(); this backend
    has one slot. queue_size: requests that may wait for the slot; one more is QueueFull. spec_options: the
    SpecOptions of speculative requests (None: the defaults).
    """

    def __init__(self, model, *, ctx: int | None = None, max_batch: int = 1, queue_size: int = 64,
                 spec_options=None):
        if queue_size < 0:
            raise ValueError(f"queue_size = {queue_size} is invalid: it must be >= 0")
        self.model = model
        self.ctx = model.check_ctx(ctx)
        self.max_batch = int(max_batch)
        self.queue_size = int(queue_size)
        self.spec_options = spec_options
        self._queue: collections.deque[Ticket] = collections.deque()
        self._cv = threading.Condition()
        self._running: Ticket | None = None
        self._closing = False
        self._clock = _Clock()
        self.served = 0  # requests that ended, however
        self.failed = 0  # ... with Failed
        self.cancelled = 0  # ... cancelled (the client went away, or shutdown's timeout)
        self._thread = threading.Thread(target=self._worker, name="fucina-serve-worker", daemon=True)
        self._thread.start()

    # ---- the Backend interface ------------------------------------------------------------------------------

    def submit(self, req: GenRequest) -> Ticket:
        if not isinstance(req, GenRequest):
            raise TypeError(f"submit() takes a GenRequest, got {type(req).__name__}")
        ticket = Ticket(req)
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.queue_size and (self._running is not None or self._queue):
                wait = self._clock.mean * (len(self._queue) + 1)
                raise QueueFull(f"the server is busy: {len(self._queue)} requests are waiting (--queue "
                                f"{self.queue_size}); retry later", retry_after=math.ceil(min(wait, 60.0)))
            self._queue.append(ticket)
            self._cv.notify()
        return ticket

    def health(self) -> dict:
        with self._cv:
            busy = self._running is not None
            return {
                "status": "shutting_down" if self._closing else "ok",
                "slots_total": 1,
                "slots_free": 0 if busy else 1,
                "queued": len(self._queue),
                "queue_size": self.queue_size,
                "max_batch": self.max_batch,
                "backend": "serial",
                "ctx": self.ctx,
                "served": self.served,
                "failed": self.failed,
                "cancelled": self.cancelled,
            }

    def shutdown(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # past the timeout: cancel what is left, the worker stops at its next token
            with self._cv:
                for t in [self._running, *self._queue]:
                    if t is not None:
                        t.cancel()
            self._thread.join(5.0)

    # ---- the worker ----------------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:  # closing and drained
                    return
                ticket = self._queue.popleft()
                self._running = ticket
            t0 = time.monotonic()
            try:
                self._serve(ticket)
            except BaseException as e:  # never lose the worker: the request fails alone
                ticket.put(Failed(e))
            finally:
                ticket.put(Failed(RuntimeError("the backend ended the request without a result")))  # no-op if ended
                with self._cv:
                    self._running = None
                    self.served += 1
                    self._clock.add(time.monotonic() - t0)

    def _generation(self, req: GenRequest):
        kw = dict(max_tokens=req.max_tokens, sampler=req.sampler, ctx=self.ctx, stop_ids=req.stop_ids)
        if req.speculation:
            try:
                from fucina_jax.generate import generate_speculative
            except ImportError:  # releases before the one decoder kept it in fucina_jax.speculative
                from fucina_jax.speculative import generate_speculative

            return generate_speculative(self.model, req.prompt_ids, references=list(req.references),
                                        options=self.spec_options, **kw)
        from fucina_jax.generate import generate

        return generate(self.model, req.prompt_ids, **kw)

    def _serve(self, ticket: Ticket) -> None:
        req = ticket.request
        n_prompt = len(req.prompt_ids)
        if ticket.cancelled:  # the client left while it waited
            self._count_cancel()
            ticket.put(Done("cancelled", _usage(n_prompt, 0)))
            return
        try:
            gen = self._generation(req)
            text = TextAssembler(self.model.tokenizer, req.stop_strings)
            n = 0
            finish = None
            for tok in gen:
                n += 1
                piece = text.feed(tok)
                ticket.put(Delta((tok,), piece))
                if text.stopped:
                    finish = "stop"
                    break
                if ticket.cancelled:
                    finish = "cancelled"
                    break
        except Exception as e:
            with self._cv:
                self.failed += 1
            ticket.put(Failed(e))
            return
        decoder = getattr(gen, "decoder", None)
        if finish is None:  # the generation ran to its end
            finish = _FINISH.get(gen.result.stop_reason, "stop")
            spec = gen.result.spec
            rest = text.finish()
            if rest:
                ticket.put(Delta((), rest))
            if text.stopped:  # the decoder's last bytes completed a stop string
                finish = "stop"
        else:
            spec = decoder.spec_stats() if decoder is not None and req.speculation else None
            if finish == "cancelled":
                self._count_cancel()
        ticket.put(Done(finish, _usage(n_prompt, n), spec))

    def _count_cancel(self) -> None:
        with self._cv:
            self.cancelled += 1
