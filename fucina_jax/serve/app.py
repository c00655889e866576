"""The ASGI app: routes, server-sent events, errors, and the bridge from backend threads to the event loop.

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions. Request
parsing and every response object are in serve/protocol.py; the model runs behind a serve.backend.Backend.

Streams are a plain Starlette StreamingResponse of `data: {json}\\n\\n` lines ending with `data: [DONE]` (with
uvicorn's ASGI 2.3 it listens for `http.disconnect` and cancels the body iterator, whose `finally` cancels the
ticket: the backend frees the slot at its next step). A non-streaming request watches for the disconnect itself.
A ticket's events are read without a thread per request: `Ticket.put` wakes an asyncio.Event through
call_soon_threadsafe, and the reader drains the ticket's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import time
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fucina_jax.serve import protocol
from fucina_jax.serve.backend import Backend, Delta, Done, Failed, QueueFull, ShuttingDown, Ticket
from fucina_jax.serve.protocol import APIError, ModelInfo, ResponseBuilder

__all__ = ["create_app", "ticket_events", "MAX_BODY"]

log = logging.getLogger("fucina_jax.serve")

MAX_BODY = 32 << 20  # bytes of one request body (a prompt and its references)
KEEPALIVE_SECONDS = 15.0  # an SSE comment line while a stream waits (queued, or a long prefill)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_dumps(obj), status_code=status, headers=headers, media_type="application/json")


def _error(e: APIError) -> Response:
    return _json(e.body(), e.status, e.headers)


def _server_error(message: str, code: str = "internal_error") -> APIError:
    return APIError(500, message, type="server_error", code=code)


def _failure(event) -> APIError:
    """The error object of a request that failed (or was cut by shutdown) inside the backend."""
    if isinstance(event, Failed):
        e = event.error
        return _server_error(f"the request failed inside the model: {type(e).__name__}: {e}")
    return APIError(503, "the server shut down before the request finished", type="server_error",
                    code="shutting_down")


async def ticket_events(ticket: Ticket, keepalive: float | None = None):
    """The ticket's events as they arrive (None every `keepalive` seconds of silence); ends after Done/Failed."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify():
        loop.call_soon_threadsafe(wake.set)

    ticket.subscribe(notify)
    while True:
        try:
            ev = ticket.events.get_nowait()
        except queue.Empty:
            try:
                await asyncio.wait_for(wake.wait(), keepalive)
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
                yield None
            wake.clear()
            continue
        yield ev
        if isinstance(ev, (Done, Failed)):
            return


async def _read_body(request: Request) -> bytes:
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > MAX_BODY:
        raise APIError(413, f"the request body has {n} bytes; the limit is {MAX_BODY}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is larger than the limit of {MAX_BODY} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(backend: Backend, info: ModelInfo, *, shutdown_timeout: float = 30.0) -> Starlette:
    """The Starlette app serving `info`'s model through `backend`; its lifespan's end shuts the backend down."""

    def submit(parsed) -> Ticket:
        try:
            return backend.submit(parsed.gen)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None

    async def health(request: Request) -> Response:
        h = backend.health()
        return _json(h, 200 if h.get("status") == "ok" else 503)

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [protocol.model_object(info)]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in info.aliases:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{info.id}`.",
                           param="model", code="model_not_found")
        return _json(protocol.model_object(info))

    async def completions(request: Request) -> Response:
        return await serve(request, protocol.parse_completion, "cmpl")

    async def chat_completions(request: Request) -> Response:
        return await serve(request, protocol.parse_chat, "chatcmpl")

    async def serve(request: Request, parse, prefix: str) -> Response:
        try:
            raw = await _read_body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        obj = protocol.parse_body(raw)
        parsed = await run_in_threadpool(parse, obj, info)  # tokenizing a long prompt must not stall the loop
        ticket = submit(parsed)
        out = ResponseBuilder(parsed, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))
        if parsed.stream:
            return StreamingResponse(_sse(ticket, out), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, ticket, out)

    async def _whole(request: Request, ticket: Ticket, out: ResponseBuilder) -> Response:
        async def watch():  # the client hung up while it waited: free the slot
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    ticket.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        text, ids = [], []
        try:
            async for ev in ticket_events(ticket):
                if isinstance(ev, Delta):
                    text.append(ev.text)
                    ids.extend(ev.token_ids)
                elif isinstance(ev, Done) and ev.finish_reason != "cancelled":
                    return _json(out.response("".join(text), ev.finish_reason, ev.usage, ev.spec_stats, ids))
                elif ev is not None:
                    return _error(_failure(ev))
        finally:
            watcher.cancel()
            ticket.cancel()  # a no-op when it ended; else (this task was cancelled) the backend stops it
        return _error(_server_error("the request ended without a result"))

    async def _sse(ticket: Ticket, out: ResponseBuilder):
        def event(obj) -> str:
            return f"data: {_dumps(obj)}\n\n"

        try:
            if out.chat:
                yield event(out.chunk(role=True))
            async for ev in ticket_events(ticket, keepalive=KEEPALIVE_SECONDS):
                if ev is None:
                    yield ": keep-alive\n\n"
                elif isinstance(ev, Delta):
                    if ev.text or (out.p.return_token_ids and ev.token_ids):
                        yield event(out.chunk(ev.text, token_ids=list(ev.token_ids)))
                elif isinstance(ev, Done) and ev.finish_reason != "cancelled":
                    yield event(out.chunk(None if out.chat else "", finish_reason=ev.finish_reason,
                                          spec=ev.spec_stats, final=True))
                    if out.p.include_usage:
                        yield event(out.usage_chunk(ev.usage))
                    yield "data: [DONE]\n\n"
                else:  # Failed, or cut by shutdown: an error event the openai client raises as APIError
                    err = _failure(ev)
                    log.warning("request %s failed: %s", out.id, err.message)
                    yield event(err.body())
                    yield "data: [DONE]\n\n"
        finally:
            ticket.cancel()

    async def api_error(request: Request, exc: APIError) -> Response:
        return _error(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _json(protocol.error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind,
                                         code=code), exc.status_code, getattr(exc, "headers", None))

    async def crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(_server_error(f"{type(exc).__name__}: {exc}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(backend.shutdown, shutdown_timeout)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={APIError: api_error, HTTPException: http_error, Exception: crash})
