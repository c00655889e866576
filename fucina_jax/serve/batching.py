"""Continuous batching on the one decoder: requests join and leave a running batch between steps.

`BatchingBackend` is a serve.backend.Backend: one worker thread owns the model and a `fucina_jax.decoder.Decoder`
of `max_batch` rows (the slots: a KV cache of max_batch x ctx positions, allocated once). Between two steps it

  1. ends what is done: rows the decoder finished (a stop id, max_tokens, a full context), rows whose text reached
     a stop string, and rows whose client went away (`ticket.cancel()`): each ticket gets its Done and the row is
     freed at once;
  2. admits waiting requests into free rows, oldest first: each is prefilled alone into its row's slots
     (engine.prefill_row_step) while the others keep their state, and its first token is sampled;
  3. runs one decoder step for every active row (one forward for all of them; speculative rows draft from their own
     index, the others ride along plainly) and streams each row's committed tokens to its ticket.

No request waits for a batch to drain. A request's tokens are exactly what the same request gives alone (greedy,
and sampled with a seed): the decoder samples row b at row b's own stream positions with its own seed, history and
sampler values, and every row of a step is computed as it is alone (tests/test_serve_batching.py checks this).

Prompt cache: a free row keeps its last stream and cache. A new request whose prompt starts with the stream a free
row holds (a chat turn that extends an earlier one: the prompt is the earlier prompt + reply + the new message) takes
that row, and only its new part is prefilled (Decoder.begin with keep), as llama.cpp's server reuses a slot's
prompt cache; its draft index is kept when the prompt extends what the index has seen.

Speculation: one cost gate for the batch, priced by the batch's measured step times (speculative/gate.py), so a
verify the batch cannot afford runs as a plain step. Failures: a draft source that raises fails its request alone
(Decoder.failed_row); an error in the forward itself fails the requests of that step, and the backend keeps serving.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import numpy as np

from fucina_jax.decoder import INTERRUPTED, STOP_SEQUENCE, Decoder, Request
from fucina_jax.serve.backend import (
    _FINISH,
    Delta,
    Done,
    Failed,
    GenRequest,
    QueueFull,
    ShuttingDown,
    TextAssembler,
    Ticket,
    _Clock,
    _usage,
)
from fucina_jax.speculative import SpecOptions, default_source
from fucina_jax.speculative.sources import finish_request

__all__ = ["BatchingBackend"]

# A free row's cached stream is reused when it holds at least this many leading ids of the new prompt.
MIN_REUSE = 16


class _Slot:
    """One decoder row's request while it runs."""

    def __init__(self, ticket: Ticket, text: TextAssembler, t0: float):
        self.ticket = ticket
        self.text = text
        self.n_gen = 0
        self.t0 = t0


class BatchingBackend:
    """Continuous batching over `max_batch` decoder rows; see the module docstring. queue_size: requests that may
    wait for a row (one more is QueueFull); spec_options: the decoder's SpecOptions (None: the defaults)."""

    def __init__(self, model, *, ctx: int | None = None, max_batch: int = 8, queue_size: int = 64,
                 spec_options: SpecOptions | None = None):
        if max_batch < 1 or queue_size < 0:
            raise ValueError(f"max_batch = {max_batch}, queue_size = {queue_size}: need max_batch >= 1, queue >= 0")
        self.model = model
        self.ctx = model.check_ctx(ctx)
        self.max_batch = int(max_batch)
        self.queue_size = int(queue_size)
        self.decoder = Decoder(model, self.max_batch, ctx=self.ctx, options=spec_options or SpecOptions(),
                               clock=time.perf_counter_ns, background_compile=True)
        self._slots: list[_Slot | None] = [None] * self.max_batch
        self._queue: collections.deque[Ticket] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._clock = _Clock()
        self.served = self.failed = self.cancelled = 0
        self.reused_tokens = 0  # prompt ids taken from a free row's cache instead of prefilled
        self._thread = threading.Thread(target=self._worker, name="fucina-serve-batch", daemon=True)
        self._thread.start()

    # ---- the Backend interface ------------------------------------------------------------------------------

    def submit(self, req: GenRequest) -> Ticket:
        if not isinstance(req, GenRequest):
            raise TypeError(f"submit() takes a GenRequest, got {type(req).__name__}")
        ticket = Ticket(req)
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            busy = sum(s is not None for s in self._slots)
            if len(self._queue) >= self.queue_size and busy + len(self._queue) >= self.max_batch:
                wait = self._clock.mean * (len(self._queue) // self.max_batch + 1)
                raise QueueFull(f"the server is busy: {busy} requests are running and {len(self._queue)} waiting "
                                f"(--max-batch {self.max_batch}, --queue {self.queue_size}); retry later",
                                retry_after=math.ceil(min(wait, 60.0)))
            self._queue.append(ticket)
            self._cv.notify()
        return ticket

    def health(self) -> dict:
        with self._cv:
            busy = sum(s is not None for s in self._slots)
            return {
                "status": "shutting_down" if self._closing else "ok",
                "slots_total": self.max_batch,
                "slots_free": self.max_batch - busy,
                "queued": len(self._queue),
                "queue_size": self.queue_size,
                "max_batch": self.max_batch,
                "backend": "batching",
                "ctx": self.ctx,
                "served": self.served,
                "failed": self.failed,
                "cancelled": self.cancelled,
                "reused_prompt_tokens": self.reused_tokens,
            }

    def shutdown(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # past the timeout: cancel what is left; the worker ends them at its next step
            with self._cv:
                for t in [*(s.ticket for s in self._slots if s is not None), *self._queue]:
                    t.cancel()
            self._thread.join(10.0)

    # ---- the worker ----------------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not any(self._slots) and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue and not any(self._slots):
                    return
            try:
                self._admit()
                if self.decoder.active:
                    self._step()
                self._end_finished()
            except BaseException as e:  # never lose the worker: fail what was running, keep serving
                self._fail_running(e)

    def prepare_steps(self) -> int:
        """Bring in every step program the decoder may run (Decoder.prepare_steps), before serving: the worker is
        idle then (call it between the warm-up and the first request)."""
        with self._cv:
            if any(s is not None for s in self._slots) or self._queue:
                raise RuntimeError("prepare_steps() runs before serving: requests are in flight")
        return self.decoder.prepare_steps()

    def _admit(self) -> None:
        """Waiting requests into free rows, oldest first, each prefilled alone; the first token of each."""
        while True:
            with self._cv:
                free = [b for b, s in enumerate(self._slots) if s is None]
                if not free or not self._queue:
                    return
                ticket = self._queue.popleft()
            req = ticket.request
            if ticket.cancelled:  # the client left while it waited
                self._finish(ticket, "cancelled", 0, None)
                continue
            b, keep = self._row_for(req.prompt_ids, free)
            slot = _Slot(ticket, TextAssembler(self.model.tokenizer, req.stop_strings), time.monotonic())
            with self._cv:
                self._slots[b] = slot
            try:
                source = self._source(b, req, keep)
                request = Request(tuple(req.prompt_ids), req.max_tokens, req.sampler, req.stop_ids, source)
                reqs: list[Request | None] = [None] * self.max_batch
                reqs[b] = request
                keeps = [0] * self.max_batch
                keeps[b] = keep
                logits = self.decoder.begin(reqs, keep=keeps)
                self.reused_tokens += self.decoder.rows[b].reused
                self._deliver(b, self.decoder.first(logits)[b])
            except Exception as e:  # this request alone fails (its prompt, its references, ...)
                self._fail(b, e)

    def _row_for(self, prompt: list[int], free: list[int]) -> tuple[int, int]:
        """(the free row to take, how many leading prompt ids its cached stream already holds): the row sharing the
        longest prefix with the prompt when that is >= MIN_REUSE, else the free row that ran least recently."""
        best, best_keep = None, 0
        p = np.asarray(prompt, np.int32)
        for b in free:
            row = self.decoder.rows[b]
            if row is None:
                continue
            m = min(row.n, p.size)
            diff = np.flatnonzero(row.stream[:m] != p[:m])
            keep = int(diff[0]) if diff.size else m
            if keep > best_keep:
                best, best_keep = b, keep
        if best is not None and best_keep >= MIN_REUSE:
            return best, best_keep
        empty = [b for b in free if self.decoder.rows[b] is None]
        return (empty or free)[0], 0

    def _source(self, b: int, req: GenRequest, keep: int):
        """The row's draft source: none for a plain request; a fresh index with the request's references, or the
        row's previous index when the prompt extends exactly what that index has seen."""
        if not req.speculation:
            return None
        row = self.decoder.rows[b]
        old = row.source if row is not None else None
        if old is not None and not req.references and keep and keep == row.n and hasattr(old, "observe"):
            old.observe(np.asarray(req.prompt_ids[keep:], np.int32))
            return old
        source = default_source(self.model, references=req.references)
        source.observe(np.asarray(req.prompt_ids, np.int32))
        return source

    def _step(self) -> None:
        try:
            outcomes = self.decoder.step()
        except Exception as e:
            b = self.decoder.failed_row
            if b is None or self._slots[b] is None:
                raise  # the forward itself: every running request fails (the worker's handler)
            self._fail(b, e)  # this request's draft source: it alone fails, the others go on next step
            return
        for b, o in enumerate(outcomes):
            if o is not None and self._slots[b] is not None:
                self._deliver(b, o)

    def _deliver(self, b: int, outcome) -> None:
        slot = self._slots[b]
        for tok in outcome.committed:
            if slot.text.stopped:
                break
            slot.n_gen += 1
            slot.ticket.put(Delta((tok,), slot.text.feed(tok)))

    def _end_finished(self) -> None:
        for b, slot in enumerate(self._slots):
            if slot is None:
                continue
            row = self.decoder.rows[b]
            if slot.ticket.cancelled:
                self._end(b, "cancelled")
            elif slot.text.stopped:
                self._end(b, "stop")
            elif not row.active:
                rest = slot.text.finish()
                if rest:
                    slot.ticket.put(Delta((), rest))
                self._end(b, "stop" if slot.text.stopped else _FINISH.get(row.finish, "stop"))

    def _end(self, b: int, finish: str) -> None:
        slot = self._slots[b]
        row = self.decoder.rows[b]
        self.decoder.stop(b, INTERRUPTED if finish == "cancelled" else STOP_SEQUENCE)  # if its text or client ended it
        spec = self.decoder.spec_stats(b) if slot.ticket.request.speculation else None
        if row.source is not None:
            finish_request(self.model, row.source)  # the output joins the model's draft memory
        self._finish(slot.ticket, finish, slot.n_gen, spec)
        with self._cv:
            self._slots[b] = None
            self._clock.add(time.monotonic() - slot.t0)

    def _finish(self, ticket: Ticket, finish: str, n_gen: int, spec) -> None:
        ticket.put(Done(finish, _usage(len(ticket.request.prompt_ids), n_gen), spec))
        with self._cv:
            self.served += 1
            self.cancelled += finish == "cancelled"

    def _fail(self, b: int, error: BaseException) -> None:
        slot = self._slots[b]
        if self.decoder.rows[b] is not None:
            self.decoder.release(b)  # its stream is not a cache to reuse
        with self._cv:
            self._slots[b] = None
            self.served += 1
            self.failed += 1
        slot.ticket.put(Failed(error))

    def _fail_running(self, error: BaseException) -> None:
        for b, slot in enumerate(self._slots):
            if slot is not None:
                self._fail(b, error)
