"""OpenAI's wire format: request JSON -> a validated GenRequest, and the response objects back.

Every check of a request lives here, so the HTTP layer only routes and streams. Shapes follow the official `openai`
package's types (`types/completion.py`, `types/chat/chat_completion*.py`, `types/completion_usage.py`,
`types/model.py`, `types/shared/error_object.py`). Bad input raises `APIError`, which app.py sends as OpenAI's error
object `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Defaults where a field is absent (docs: the README's server section):
  - temperature 1 and top_p 1 (OpenAI's); the extension fields OpenAI has no counterpart for take llama.cpp's
    server defaults: top_k 40, min_p 0.05, repeat_penalty 1 (off), repeat_last_n 64. Send top_k 0 and min_p 0 for
    the untruncated distribution; temperature 0 is greedy.
  - no seed: a random one, returned in the response's `fucina.seed` so the output can be reproduced.
  - max_tokens: 16 for /v1/completions (OpenAI's default), the rest of the context for chat.
  - speculation: the server's --spec; `references` imply it unless the request says `speculation: false`.
Ranges: OpenAI's for its fields (temperature [0, 2], top_p [0, 1], penalties [-2, 2], up to 4 stop strings); a
prompt that does not fit the context, or prompt + max_tokens beyond it, is a 400 `context_length_exceeded` naming
the limit (llama.cpp clamps max_tokens instead; OpenAI refuses, and so do we). Unknown fields are ignored, as
OpenAI-compatible servers do; known fields are type-checked even when their value is ignored, and features we do not
implement (n > 1, logprobs, echo, suffix, best_of > 1, logit_bias, tools, non-text response formats) are a 400
rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from fucina_jax.sampling import SamplerConfig
from fucina_jax.serve.backend import GenRequest

__all__ = [
    "APIError",
    "ModelInfo",
    "Parsed",
    "parse_body",
    "parse_completion",
    "parse_chat",
    "ResponseBuilder",
    "error_body",
    "model_object",
    "MAX_STOP",
    "MAX_REFERENCES",
]

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_LEN = 1024  # characters per stop string (the stream holds back the longest one minus one)
MAX_STOP_IDS = 64
MAX_REFERENCES = 8  # reference documents per request (fucina_jax.index.CascadePolicy.max_references)
MAX_SEED = 2**32 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLER_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=40, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
                        frequency_penalty=0.0, presence_penalty=0.0)
FINGERPRINT = "fp_fucina_jax"


class APIError(Exception):
    """A request the server refuses (or could not serve): HTTP status + OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- the served model ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model and the server's settings."""

    id: str  # the GGUF file's base name
    aliases: frozenset  # names a request's `model` may use: the id, the name without .gguf, the path given
    created: int
    tokenizer: Any
    n_vocab: int
    ctx: int  # every request's prompt + max_tokens must fit
    eog_ids: frozenset
    chat_template: Any  # fucina_jax.chat_template.ChatTemplate
    turn_end_id: int | None  # the chat template's turn-end token, a stop id for chat requests
    speculation: bool  # the default of a request's `speculation` (--spec)

    @classmethod
    def from_model(cls, model, *, ctx: int, speculation: bool = False, path: str | None = None) -> ModelInfo:
        from fucina_jax.chat_template import chat_template_for

        path = path or model.path
        name = os.path.basename(path)
        stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
        tok = model.tokenizer
        template = chat_template_for(tok)
        end_id = tok.token_id(template.turn_end) if template.turn_end else None
        try:
            created = int(os.path.getmtime(path))
        except OSError:
            created = 0
        return cls(id=name, aliases=frozenset({name, stem, path, model.path}), created=created, tokenizer=tok,
                   n_vocab=int(model.config.n_vocab), ctx=int(ctx), eog_ids=frozenset(tok.eog_ids),
                   chat_template=template, turn_end_id=end_id, speculation=bool(speculation))


def model_object(info: ModelInfo) -> dict:
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": "fucina_jax"}


# ---- parsing ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parsed:
    """A validated request: what the backend runs, and how to answer."""

    kind: str  # "completion" | "chat"
    gen: GenRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage
    return_token_ids: bool  # extension: the response carries fucina.token_ids
    model: str  # the model id the response names


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, NaN/Infinity, huge integers
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                       "object.", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"The request body must be a JSON object, got a JSON {_json_type(obj)}.",
                       code="invalid_json")
    return obj


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_error(name: str, expected: str, value) -> APIError:
    return APIError(400, f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.",
                    param=name, code="invalid_type")


def _number(obj: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(f"Invalid '{name}': expected a number in [{lo:g}, {hi:g}], but got {v!r}.", name)
    return float(v)


def _integer(obj: dict, name: str, lo: int, hi: int | None, default):
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _type_error(name, "an integer", v)
    if v < lo or (hi is not None and v > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(f"Invalid '{name}': expected an integer {where}, but got {v}.", name)
    return v


def _boolean(obj: dict, name: str, default: bool) -> bool:
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _text(value, name: str) -> str:
    """A JSON string that is valid Unicode (JSON allows lone surrogates such as \\ud800, which no tokenizer can
    encode)."""
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"Invalid '{name}': the text holds a lone surrogate (\\u{ord(value[e.start]):04x} at "
                   f"character {e.start}), which is not Unicode text.", name) from None
    return value


# Known OpenAI fields whose value we ignore (type-checked all the same): name -> JSON types allowed (None = null).
_IGNORED = {
    "user": (str,), "metadata": (dict, type(None)), "store": (bool, type(None)),
    "service_tier": (str, type(None)), "parallel_tool_calls": (bool, type(None)),
    "prompt_cache_retention": (str, type(None)), "safety_identifier": (str, type(None)),
    "verbosity": (str, type(None)), "reasoning_effort": (str, type(None)), "prompt_cache_options": (dict,),
}


def _check_ignored(obj: dict) -> None:
    for name, types in _IGNORED.items():
        if name in obj and not isinstance(obj[name], types):
            names = " or ".join("null" if t is type(None) else _json_type(t()) for t in types)
            raise _type_error(name, f"a {names}" if len(types) == 1 else names, obj[name])


def _unsupported(name: str, why: str) -> APIError:
    return APIError(400, f"'{name}' is not supported by this server: {why}.", param=name, code="unsupported_parameter")


def _check_unsupported(obj: dict, kind: str) -> None:
    """Features we do not implement: a 400 when asked for, not a silent no."""
    n = _integer(obj, "n", 1, None, 1)
    if n != 1:
        raise APIError(400, f"Invalid 'n': this server generates one choice per request (n = 1), got n = {n}; send "
                       "n requests instead.", param="n", code="unsupported_value")
    lb = obj.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _type_error("logit_bias", "an object", lb)
        if lb:
            raise _unsupported("logit_bias", "token biases are not implemented")
    if kind == "completion":
        if obj.get("logprobs") is not None:
            _integer(obj, "logprobs", 0, 5, None)
            raise _unsupported("logprobs", "log probabilities are not returned")
        if _boolean(obj, "echo", False):
            raise _unsupported("echo", "the prompt is not echoed")
        if obj.get("suffix") is not None and _text(obj["suffix"], "suffix"):
            raise _unsupported("suffix", "insertion (a suffix) is not implemented")
        if _integer(obj, "best_of", 1, None, 1) != 1:
            raise _unsupported("best_of", "one completion is generated per request")
        return
    if _boolean(obj, "logprobs", False):
        raise _unsupported("logprobs", "log probabilities are not returned")
    if _integer(obj, "top_logprobs", 0, 20, 0):
        raise _unsupported("top_logprobs", "log probabilities are not returned")
    for name in ("tools", "functions"):
        v = obj.get(name)
        if v is not None:
            if not isinstance(v, list):
                raise _type_error(name, "an array", v)
            if v:
                raise _unsupported(name, "tool calling is not implemented")
    for name in ("tool_choice", "function_call"):
        v = obj.get(name)
        if v is not None and v not in ("none", "auto"):
            if not isinstance(v, (str, dict)):
                raise _type_error(name, "a string or an object", v)
            raise _unsupported(name, "tool calling is not implemented")
    rf = obj.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _type_error("response_format", "an object", rf)
        if rf.get("type", "text") != "text":
            raise _unsupported("response_format", f"only {{\"type\": \"text\"}} is served, got {rf.get('type')!r}")
    mods = obj.get("modalities")
    if mods is not None:
        if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
            raise _type_error("modalities", "an array of strings", mods)
        if any(m != "text" for m in mods):
            raise _unsupported("modalities", "only text is generated")
    for name in ("audio", "prediction", "web_search_options", "moderation"):
        if obj.get(name) is not None:
            raise _unsupported(name, "not implemented")


def _check_model(obj: dict, info: ModelInfo) -> str:
    m = obj.get("model")
    if m is None:
        return info.id
    if not isinstance(m, str):
        raise _type_error("model", "a string", m)
    if m not in info.aliases:
        raise APIError(404, f"The model `{m}` does not exist; this server serves `{info.id}` (GET /v1/models).",
                       param="model", code="model_not_found")
    return info.id


def _strings(obj: dict, name: str, max_n: int, what: str, *, max_len: int | None = None,
             single: bool = False) -> list[str]:
    """A list of at most max_n non-empty strings (or one string, when `single`); absent/null: []."""
    v = obj.get(name)
    if v is None:
        return []
    if single and isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _type_error(name, "a string or an array of strings" if single else "an array of strings", v)
    if len(v) > max_n:
        raise _bad(f"Invalid '{name}': at most {max_n} {what}s, got {len(v)}.", name)
    for x in v:
        _text(x, name)
        if not x:
            raise _bad(f"Invalid '{name}': a {what} must not be empty.", name)
        if max_len is not None and len(x) > max_len:
            raise _bad(f"Invalid '{name}': a {what} is at most {max_len} characters, got {len(x)}.", name)
    return v


def _stops(obj: dict, info: ModelInfo) -> tuple[tuple[str, ...], frozenset]:
    strings = _strings(obj, "stop", MAX_STOP, "stop sequence", max_len=MAX_STOP_LEN, single=True)
    ids = obj.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise _type_error("stop_token_ids", "an array of integers (token ids)", ids)
    if len(ids) > MAX_STOP_IDS:
        raise _bad(f"Invalid 'stop_token_ids': at most {MAX_STOP_IDS} ids, got {len(ids)}.", "stop_token_ids")
    bad = [t for t in ids if not 0 <= t < info.n_vocab]
    if bad:
        raise _bad(f"Invalid 'stop_token_ids': {bad[:4]} are not token ids of this model (0..{info.n_vocab - 1}).",
                   "stop_token_ids")
    return tuple(dict.fromkeys(strings)), frozenset(ids)


def _sampler(obj: dict) -> SamplerConfig:
    d = SAMPLER_DEFAULTS
    top_k = _integer(obj, "top_k", -1, None, d["top_k"])
    cfg = SamplerConfig(
        temperature=_number(obj, "temperature", 0.0, 2.0, d["temperature"]),
        top_p=_number(obj, "top_p", 0.0, 1.0, d["top_p"]),
        top_k=max(0, top_k),  # -1 (vLLM's spelling) and 0 both turn top-k off
        min_p=_number(obj, "min_p", 0.0, 1.0, d["min_p"]),
        repeat_penalty=_number(obj, "repeat_penalty", 1e-3, 1e3, d["repeat_penalty"]),
        repeat_last_n=_integer(obj, "repeat_last_n", -1, None, d["repeat_last_n"]),
        frequency_penalty=_number(obj, "frequency_penalty", -2.0, 2.0, d["frequency_penalty"]),
        presence_penalty=_number(obj, "presence_penalty", -2.0, 2.0, d["presence_penalty"]),
        seed=_integer(obj, "seed", 0, MAX_SEED, None),
    )
    from fucina_jax.errors import SamplerConfigError

    try:
        return cfg.validate()  # a concrete seed: a random one when the request has none
    except SamplerConfigError as e:
        raise _bad(f"Invalid sampling parameters: {e}.") from None


def _speculation(obj: dict, info: ModelInfo) -> tuple[bool, tuple[str, ...]]:
    refs = _strings(obj, "references", MAX_REFERENCES, "reference document")
    spec = obj.get("speculation")
    if spec is not None and not isinstance(spec, bool):
        raise _type_error("speculation", "a boolean", spec)
    if refs and spec is False:
        raise _bad("'references' feed speculative decoding's draft index: they cannot be combined with "
                   "'speculation': false.", "references")
    if spec is None:
        spec = info.speculation or bool(refs)
    return spec, tuple(refs)


def _stream_options(obj: dict) -> tuple[bool, bool]:
    stream = _boolean(obj, "stream", False)
    so = obj.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict):
        raise _type_error("stream_options", "an object", so)
    return stream, _boolean(so, "include_usage", False) and stream


def _max_tokens(obj: dict, n_prompt: int, info: ModelInfo, default: int | None) -> int:
    a = _integer(obj, "max_tokens", 1, None, None)
    b = _integer(obj, "max_completion_tokens", 1, None, None) if "max_completion_tokens" in obj else None
    if a is not None and b is not None and a != b:
        raise _bad(f"'max_tokens' ({a}) and 'max_completion_tokens' ({b}) disagree: send one of them.",
                   "max_completion_tokens")
    m = b if b is not None else a
    room = info.ctx - n_prompt
    if n_prompt >= info.ctx:
        raise APIError(400, f"This model's maximum context length is {info.ctx} tokens. However, your prompt has "
                       f"{n_prompt} tokens, which leaves no room for a completion. Please shorten the prompt (or "
                       f"start the server with a larger --ctx).", param="messages" if default is None else "prompt",
                       code="context_length_exceeded")
    if m is None:
        return min(default, room) if default is not None else room
    if m > room:
        param = "max_completion_tokens" if b is not None else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {info.ctx} tokens. However, you requested "
                       f"{n_prompt + m} tokens ({n_prompt} in the prompt, {m} for the completion). Please reduce "
                       f"the prompt or the completion length: {param} <= {room} here.", param=param,
                       code="context_length_exceeded")
    return m


def _common(obj: dict, info: ModelInfo, kind: str, prompt_ids: list[int], extra_stop_ids: frozenset,
            default_max: int | None, model: str) -> Parsed:
    stream, include_usage = _stream_options(obj)
    stop_strings, stop_ids = _stops(obj, info)
    sampler = _sampler(obj)
    speculation, refs = _speculation(obj, info)
    return_ids = _boolean(obj, "return_token_ids", False)
    key = obj.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise _type_error("prompt_cache_key", "a string", key)
    max_tokens = _max_tokens(obj, len(prompt_ids), info, default_max)
    gen = GenRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, sampler=sampler,
                     stop_ids=frozenset(info.eog_ids) | extra_stop_ids | stop_ids, stop_strings=stop_strings,
                     speculation=speculation, references=refs, chat_key=key)
    return Parsed(kind=kind, gen=gen, stream=stream, include_usage=include_usage, return_token_ids=return_ids,
                  model=model)


def _token_ids(v: list, info: ModelInfo, name: str) -> list[int]:
    if any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise _type_error(name, "a string or an array of integers (token ids)", v)
    bad = [t for t in v if not 0 <= t < info.n_vocab]
    if bad:
        raise _bad(f"Invalid '{name}': {bad[:4]} are not token ids of this model (0..{info.n_vocab - 1}).", name)
    return list(v)


def _encode(text: str, info: ModelInfo) -> list[int]:
    # as llama.cpp's server and this project's CLI: BOS per the file's metadata, special-token texts parsed
    return list(info.tokenizer.encode(text, add_special=True, parse_special=True))


def parse_completion(obj: dict, info: ModelInfo) -> Parsed:
    """POST /v1/completions."""
    model = _check_model(obj, info)
    _check_ignored(obj)
    _check_unsupported(obj, "completion")
    if "prompt" not in obj:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt",
                       code="missing_required_parameter")
    p = obj["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        ids = _encode(_text(p, "prompt"), info)
    elif isinstance(p, list):
        if p and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, f"'prompt' holds {len(p)} prompts: this server completes one prompt per request; "
                           "send one request per prompt.", param="prompt", code="unsupported_value")
        ids = _token_ids(p, info, "prompt")
    else:
        raise _type_error("prompt", "a string or an array of integers (token ids)", p)
    if not ids:
        raise _bad("'prompt' is empty and this model adds no BOS token: at least one token is needed.", "prompt")
    return _common(obj, info, "completion", ids, frozenset(), COMPLETION_DEFAULT_MAX_TOKENS, model)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _content(v, i: int, role: str) -> str:
    name = f"messages[{i}].content"
    if v is None:
        if role == "assistant":
            return ""
        raise _type_error(name, "a string or an array of content parts", v)
    if isinstance(v, str):
        return _text(v, name)
    if not isinstance(v, list):
        raise _type_error(name, "a string or an array of content parts", v)
    parts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise _type_error(f"{name}[{j}]", "an object", part)
        kind = part.get("type")
        if kind not in ("text", "refusal"):
            raise APIError(400, f"Invalid '{name}[{j}].type': this server reads text only, got {kind!r}.",
                           param=f"{name}[{j}].type", code="unsupported_value")
        parts.append(_text(part.get(kind), f"{name}[{j}].{kind}"))
    return "".join(parts)


def _messages(obj: dict) -> list[dict]:
    if "messages" not in obj:
        raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                       code="missing_required_parameter")
    msgs = obj["messages"]
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise _bad("'messages' is empty: at least one message is needed.", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"messages[{i}].role", "a string", role)
        if role not in _ROLES:
            raise _bad(f"Invalid 'messages[{i}].role': {role!r}; expected one of {', '.join(sorted(_ROLES))}.",
                       f"messages[{i}].role")
        if "content" not in m and role != "assistant":
            raise APIError(400, f"Missing required parameter: 'messages[{i}].content'.",
                           param=f"messages[{i}].content", code="missing_required_parameter")
        msg = {"role": _ROLES[role], "content": _content(m.get("content"), i, role)}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def parse_chat(obj: dict, info: ModelInfo) -> Parsed:
    """POST /v1/chat/completions: the messages rendered with the model's chat template."""
    from fucina_jax.chat_template import encode_chat
    from fucina_jax.errors import ChatTemplateError

    model = _check_model(obj, info)
    _check_ignored(obj)
    _check_unsupported(obj, "chat")
    messages = _messages(obj)
    kw = obj.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise _type_error("chat_template_kwargs", "an object", kw)
    reserved = sorted(_RESERVED_TEMPLATE_VARS & set(kw))
    if reserved:
        raise _bad(f"Invalid 'chat_template_kwargs': {', '.join(reserved)} are set by the server.",
                   "chat_template_kwargs")
    try:
        ids = encode_chat(info.tokenizer, messages, template=info.chat_template, **kw)
    except ChatTemplateError as e:
        raise _bad(str(e), "messages") from None
    if not ids:
        raise _bad("the rendered conversation is empty.", "messages")
    extra = frozenset() if info.turn_end_id is None else frozenset({info.turn_end_id})
    return _common(obj, info, "chat", list(ids), extra, None, model)


# ---- responses ---------------------------------------------------------------------------------------------------

class ResponseBuilder:
    """The response objects of one request: the whole response, or its stream's chunks."""

    def __init__(self, parsed: Parsed, request_id: str, created: int):
        self.p = parsed
        self.id = request_id
        self.created = created
        self.chat = parsed.kind == "chat"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.p.model,
                "system_fingerprint": FINGERPRINT}

    def _fucina(self, spec: dict | None, token_ids: list[int] | None) -> dict:
        out = {"seed": self.p.gen.sampler.seed, "speculation": spec}
        if self.p.return_token_ids and token_ids is not None:
            out["token_ids"] = list(token_ids)
        return out

    def response(self, text: str, finish_reason: str, usage: dict, spec: dict | None, token_ids: list[int]) -> dict:
        if self.chat:
            d = self._base("chat.completion")
            d["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": None, "finish_reason": finish_reason}]
        else:
            d = self._base("text_completion")
            d["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        d["usage"] = dict(usage)
        d["fucina"] = self._fucina(spec, token_ids)
        return d

    def chunk(self, text: str | None = None, *, role: bool = False, finish_reason: str | None = None,
              token_ids: list[int] | None = None, spec: dict | None = None, final: bool = False) -> dict:
        """One stream chunk: the chat stream's first carries delta.role; the one with finish_reason ends the
        choice (and carries the fucina statistics)."""
        if self.chat:
            d = self._base("chat.completion.chunk")
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text is not None:
                delta["content"] = text
            d["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            d = self._base("text_completion")
            d["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        if self.p.include_usage:
            d["usage"] = None
        if final:
            d["fucina"] = self._fucina(spec, None)
        elif self.p.return_token_ids and token_ids:
            d["fucina"] = {"token_ids": list(token_ids)}
        return d

    def usage_chunk(self, usage: dict) -> dict:
        """stream_options.include_usage: the extra chunk before [DONE], choices empty."""
        d = self._base("chat.completion.chunk" if self.chat else "text_completion")
        d["choices"] = []
        d["usage"] = dict(usage)
        return d
