"""Driving a server from tests and benchmarks: a live server process on 127.0.0.1, an in-process one, raw HTTP and
SSE helpers, and the in-process reference a served request must equal (tests/test_serve.py, scripts/bench_serve.py).

Only 127.0.0.1 is ever addressed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

__all__ = ["LiveServer", "InProcessServer", "request", "get_json", "sse_events", "stream_and_hang_up", "wait_health",
           "wait_idle",
           "reference", "chat_ids_and_stops", "HOST"]

HOST = "127.0.0.1"


class LiveServer:
    """`python -m fucina_jax.serve MODEL --port 0 ...` in a subprocess; the port comes from its 'listening on' line."""

    def __init__(self, model_path: str, *args: str, timeout: float = 120.0):
        cmd = [sys.executable, "-m", "fucina_jax.serve", model_path, "--port", "0", "--host", HOST,
               "--log-level", "warning", *args]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.port = None
        deadline = time.monotonic() + timeout
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
            if time.monotonic() > deadline:
                break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self.url = f"http://{HOST}:{self.port}"
        while True:  # it listens from the line on; /health answers once uvicorn's loop runs
            try:
                if get_json(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server never answered /health:\n" + self.log)
            time.sleep(0.05)

    def _read_rest(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class InProcessServer:
    """uvicorn serving create_app(backend, info) in a thread of the test process."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def request(url: str, body=None, *, method: str | None = None, timeout: float = 60.0, headers: dict | None = None):
    """(status, headers, body bytes) of one HTTP request; body: a dict (sent as JSON) or raw bytes."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(url: str, body=None, **kw):
    status, headers, raw = request(url, body, **kw)
    return status, json.loads(raw)


def sse_events(raw: bytes) -> list:
    """The `data:` payloads of a server-sent-event stream: parsed JSON objects, and "[DONE]"."""
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_and_hang_up(port: int, path: str, body: dict, n_events: int, timeout: float = 30.0) -> bytes:
    """POST a streaming request over a raw socket, read until n_events `data:` events arrived, then close the
    connection mid-stream. Returns what was read."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    got = b""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(head + data)
        while got.count(b"data: ") < n_events:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


def wait_health(url: str, cond, timeout: float = 20.0) -> dict:
    """Poll /health until cond(health) holds; returns that health (or the last one, at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        _, h = get_json(url + "/health")
        if cond(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.005)


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """/health once every slot is free and nothing is queued (or the last answer at the timeout)."""
    return wait_health(url, lambda h: h["slots_free"] == h["slots_total"] and h["queued"] == 0, timeout)


def reference(model, prompt_ids, max_tokens: int, *, stop_ids=None, speculation=False, references=(), **sampling):
    """What the server must return for a request: fucina_jax.generate in this process, with the server's sampler
    defaults under the request's values. Returns the GenerationResult."""
    from fucina_jax.generate import generate
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.serve.protocol import SAMPLER_DEFAULTS

    cfg = SamplerConfig(**{**SAMPLER_DEFAULTS, **sampling})
    if speculation or references:
        try:
            from fucina_jax.generate import generate_speculative
        except ImportError:
            from fucina_jax.speculative import generate_speculative
        gen = generate_speculative(model, prompt_ids, max_tokens=max_tokens, sampler=cfg, stop_ids=stop_ids,
                                   references=list(references))
    else:
        gen = generate(model, prompt_ids, max_tokens=max_tokens, sampler=cfg, stop_ids=stop_ids)
    return gen.run()


def chat_ids_and_stops(model, messages):
    """The prompt ids and stop ids the server uses for a chat request."""
    from fucina_jax.chat_template import chat_template_for, encode_chat

    tok = model.tokenizer
    template = chat_template_for(tok)
    ids = encode_chat(tok, messages, template=template)
    stops = set(tok.eog_ids)
    end = tok.token_id(template.turn_end) if template.turn_end else None
    if end is not None:
        stops.add(end)
    return ids, frozenset(stops)
