"""`python scripts/serve.py [MODEL.gguf] [--host 127.0.0.1] [--port 8080] ...` and `python -m fucina_jax.serve`.

The socket is bound before the model loads (a port in use fails at once), the backend compiles its common steps
(`--no-warmup` skips that), then uvicorn serves. SIGTERM and SIGINT stop accepting connections, let in-flight
requests finish for up to --shutdown-timeout seconds, shut the backend down and exit 0. Bad flags: one
`error: ...` line, exit 2; a model that cannot be loaded or a port that cannot be bound: exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time

from fucina_jax.cli import CLIError, _nonneg_int, _Parser
from fucina_jax.errors import FucinaError

__all__ = ["main", "build_parser", "serve"]

DEFAULT_PORT = 8080
DEFAULT_QUEUE = 64
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def _port(s: str) -> int:
    v = _nonneg_int("--port")(s)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"--port must be in [0, 65535] (0: any free port), got {v}")
    return v


def _positive_int(name):
    def conv(s):
        v = _nonneg_int(name)(s)
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return conv


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shutdown-timeout must be a number of seconds, got {s!r}") from None
    if not 0 <= v < 1e6:
        raise argparse.ArgumentTypeError(f"--shutdown-timeout must be in [0, 1e6) seconds, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="serve.py", description="An OpenAI-compatible HTTP server (/v1/completions, "
                "/v1/chat/completions, /v1/models, /health) for a GGUF model (default: the embedded Gemma 3 270M).")
    p.add_argument("model", nargs="?", default=None,
                   help="path of a .gguf model file (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free "
                   "port, printed at start)")
    p.add_argument("--ctx", "-c", type=_nonneg_int("--ctx"), default=0,
                   help="context size in tokens; every request's prompt + max_tokens must fit (default: min(4096, "
                        "the model's trained context))")
    p.add_argument("--max-batch", type=_positive_int("--max-batch"), default=8,
                   help="requests decoded together (slots: a KV cache of max-batch x ctx positions) (default 8)")
    p.add_argument("--backend", choices=("batching", "serial"), default="batching",
                   help="batching: continuous batching on one decoder (requests join and leave between steps); "
                        "serial: one request at a time (default batching)")
    p.add_argument("--no-persist", action="store_true",
                   help="do not read or write the model's persisted draft memory (also FUCINA_JAX_NO_PERSIST=1)")
    p.add_argument("--queue", type=_nonneg_int("--queue"), default=DEFAULT_QUEUE,
                   help=f"requests that may wait for a slot; past that a request gets 503 + Retry-After "
                        f"(default {DEFAULT_QUEUE})")
    p.add_argument("--spec", action="store_true",
                   help="speculative decoding by default (a request's \"speculation\": true/false overrides it)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help=f"on SIGTERM, how long in-flight requests may take to finish (default "
                        f"{DEFAULT_SHUTDOWN_TIMEOUT:g})")
    p.add_argument("--f32", action="store_true", help="run the pure-JAX f32 reference path instead of the kernels")
    p.add_argument("--cache-type", "-ct", choices=("f32", "f16"), default="f32",
                   help="KV cache element type (default f32)")
    p.add_argument("--no-warmup", action="store_true",
                   help="do not compile the common steps before listening (the first requests compile them)")
    p.add_argument("--warmup-all", action="store_true",
                   help="also bring in every decode step program before listening (each row bucket up to "
                        "--max-batch, every verify width), so that no width is first compiled under load: seconds "
                        "with a warm compile cache, minutes on a cold one (default: the first use of a verify width "
                        "compiles it in the background while rows step at the widths that are ready)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="uvicorn's and the server's log level (default info)")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    return p


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"--host {host!r} is not an address of this machine: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _warmup(backend, info, quiet: bool) -> None:
    """Compile the steps most requests use (prefill, greedy and sampled decode, a speculative verify), so the
    first clients do not wait for the compiler; a warm start loads them from the compile cache."""
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.serve.backend import Done, Failed, GenRequest

    tok = info.tokenizer
    ids = tok.encode("one two three one two three one two three one two three", add_special=True)
    if not ids:
        return
    t0 = time.perf_counter()
    for temperature, spec in ((0.0, False), (1.0, False), (0.0, True)):
        sampler = SamplerConfig(temperature=temperature, top_p=1.0, top_k=40, min_p=0.05, seed=0).validate()
        n = max(1, min(8, info.ctx - len(ids)))
        ticket = backend.submit(GenRequest(list(ids), n, sampler, frozenset(info.eog_ids), speculation=spec))
        while not isinstance(ev := ticket.events.get(), (Done, Failed)):
            pass
        if isinstance(ev, Failed):
            raise RuntimeError(f"the warm-up generation failed: {type(ev.error).__name__}: {ev.error}")
    if not quiet:
        print(f"warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def serve(args) -> int:
    model_path = args.model
    if model_path is not None and not os.path.exists(model_path):
        raise CLIError(f"model file not found: {model_path}")
    sock = _bind(args.host, args.port)  # before the slow load: a port in use fails at once

    import uvicorn

    import fucina_jax
    from fucina_jax.serve.app import create_app
    from fucina_jax.serve.backend import SerialBackend
    from fucina_jax.serve.batching import BatchingBackend
    from fucina_jax.serve.protocol import ModelInfo
    from fucina_jax.speculative.sources import save_all

    quiet = args.log_level in ("warning", "error")
    log = logging.getLogger("fucina_jax.serve")  # the app's own messages (a failed request), beside uvicorn's
    log.setLevel(args.log_level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    t0 = time.perf_counter()
    model = fucina_jax.load(model_path, progress=not quiet, f32=args.f32, cache_type=args.cache_type)
    ctx = args.ctx or model.default_ctx
    if ctx > model.config.context_length:
        raise CLIError(f"--ctx {ctx} exceeds the model's trained context of {model.config.context_length}")
    if ctx < 2:
        raise CLIError(f"--ctx {ctx} leaves no room for a prompt and a completion")
    info = ModelInfo.from_model(model, ctx=ctx, speculation=args.spec, path=model.path)
    if args.no_persist:
        from fucina_jax.index.persist import NO_PERSIST_ENV

        os.environ[NO_PERSIST_ENV] = "1"
    kind = BatchingBackend if args.backend == "batching" else SerialBackend
    backend = kind(model, ctx=ctx, max_batch=args.max_batch, queue_size=args.queue)
    if not quiet:
        print(f"loaded {info.id} ({model.config.arch}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    if not args.no_warmup:
        _warmup(backend, info, quiet)
        if args.warmup_all and hasattr(backend, "prepare_steps"):
            t1 = time.perf_counter()
            n = backend.prepare_steps()
            if not quiet:
                print(f"brought in {n} more step programs in {time.perf_counter() - t1:.1f} s", file=sys.stderr,
                      flush=True)
    app = create_app(backend, info, shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="on",
                            timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)))
    server = uvicorn.Server(config)
    sock.listen(2048)  # connections from now on wait in the backlog until uvicorn's loop accepts them
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"fucina_jax serve: listening on http://{shown}:{port}/v1 (model {info.id}, ctx {ctx}, "
          f"speculation {'on' if args.spec else 'off'} by default)", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down, through the handler that was installed
    # before it ran: a no-op handler makes a SIGTERM'd server exit 0 after its graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    backend.shutdown(args.shutdown_timeout)  # already done by the app's lifespan; a no-op then
    save_all()  # the requests' drafts feed the model's persisted draft memory
    return 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return serve(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FucinaError, FileNotFoundError, ValueError, OSError, RuntimeError) as e:  # load, bind, warm-up
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
