"""An OpenAI-compatible HTTP server: `python -m fucina_jax.serve [MODEL.gguf]` (or scripts/serve.py).

    python scripts/serve.py [MODEL.gguf] [--host 127.0.0.1] [--port 8080] [--ctx N] [--max-batch 8] [--spec]
        [--queue 64] [--shutdown-timeout 30] [--backend batching|serial] [--no-persist]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
    r = client.chat.completions.create(model="gemma-3-270m-q4_k_m.gguf", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=64, temperature=0, extra_body={"speculation": True})
    print(r.choices[0].message.content, r.usage, r.fucina["speculation"])

Endpoints: GET /health ({"status", "slots_total", "slots_free", "queued", ...}), GET /v1/models (one model, its id
the file's base name), POST /v1/completions, POST /v1/chat/completions (the model's chat template), both with
`stream: true` (server-sent events ending with `data: [DONE]`, `stream_options.include_usage`). Extension fields
beside OpenAI's: `top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `stop_token_ids`, `speculation` (true/false per
request; --spec sets the default), `references` (documents for the draft index; they imply speculation),
`return_token_ids`, `chat_template_kwargs`; every response carries `fucina: {"seed", "speculation": stats or null}`
(and `token_ids` when asked). Defaults, ranges and errors: serve/protocol.py's docstring.

Layout:
  backend.py   the interface the HTTP layer talks to (GenRequest, Ticket and its events, Backend), the shared
               TextAssembler (token ids -> text deltas with stop strings), and SerialBackend (one request at a time
               on one worker thread, through fucina_jax.generate; --backend serial);
  batching.py  BatchingBackend, the default: continuous batching on one fucina_jax.decoder.Decoder of --max-batch
               rows (requests join and leave between steps, a free row's stream is a prompt cache);
  protocol.py  OpenAI's wire format: request JSON -> a validated GenRequest, the response and chunk objects, errors;
  app.py       the Starlette app: routes, server-sent events, disconnects, the thread -> event-loop bridge;
  cli.py       flags, model loading, warm-up, uvicorn, graceful SIGTERM.

Why these components:
  - Starlette, not FastAPI: FastAPI is Starlette plus pydantic request models; its value is declarative validation
    and generated docs, but its validation errors are 422s in its own shape, and OpenAI's error objects (400 with
    `param` and `code`) would need every one of them remapped. Validation is one hand-written module
    (protocol.py) that returns exactly OpenAI's errors, so the framework only has to route and stream; Starlette
    does that on anyio alone, with no model layer.
  - uvicorn: the reference ASGI server; graceful shutdown on SIGTERM (stop accepting, wait for in-flight responses
    up to `timeout_graceful_shutdown`, then the app's lifespan end, which drains the backend).
  - Starlette's StreamingResponse, not sse-starlette: OpenAI's stream is only `data: {json}` lines and a final
    `data: [DONE]`, no event names, ids or retry fields; StreamingResponse already watches for the client's
    disconnect and cancels the body iterator (which cancels the ticket), and the keep-alive comment line is three
    lines of code. sse-starlette would add a dependency for features the format does not use.
"""

__all__ = ["GenRequest", "Ticket", "Backend", "SerialBackend", "BatchingBackend", "QueueFull", "Delta", "Done",
           "Failed"]


def __getattr__(name):
    if name == "BatchingBackend":
        from fucina_jax.serve import batching

        return batching.BatchingBackend
    if name in __all__:
        from fucina_jax.serve import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'fucina_jax.serve' has no attribute {name!r}")
