"""OpenAI-compatible request parsing and errors, without a schema library: every bad field
is one clear line in an OpenAI-style error body with the right HTTP status.

Accepted (as the OpenAI API and vLLM have them): model, messages | prompt (a string, or token
ids), stream, stream_options.include_usage, temperature, top_p, max_tokens (chat also
max_completion_tokens), seed, stop, n (1 only), user, logprobs (chat: logprobs + top_logprobs;
completions: logprobs = N; the model's raw log-probabilities, as vLLM's default); vLLM's top_k, ignore_eos and
vllm_xargs.kv_cache_report_mode; kvplay's return_miss_details (true: the response's `kvplay`
object gets `miss`, why the uncached prompt tokens were computed, as the key may see it: see
docs/miss.md). Other fields (cache_salt, session_id, logprobs, …) are ignored; in particular
nothing in the body chooses an identity or a salt. A `user` (the name a keyless playground goes
by) with a control, bidi or invisible character (kvplay/inert.py) is refused (400): it would be
shown to people and published as the KV events' session_id.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvplay.inert import hidden

MAX_N = 16  # choices per request
MAX_STOP = 8
MAX_LOGPROBS = 20
MAX_MESSAGES = 1024  # per chat request: refused before any of them is read
MAX_NESTING = 32  # JSON depth a request body may have (OpenAI bodies need 4 or 5)
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("authentication_error" if status == 401 else
                              "permission_error" if status == 403 else
                              "not_found_error" if status == 404 else
                              "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class GenRequest:
    """One parsed generation request (chat or completion)."""
    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    body_user: str | None = None
    report_mode: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1  # choices: n requests for the same prompt (the later ones reuse its blocks)
    miss_details: bool = False  # return_miss_details: the miss object in the kvplay extension


def _num(body: dict, key: str, default, lo=None, hi=None, integer=False, lo_open=False):
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if isinstance(v, float) and not math.isfinite(v):  # NaN, Infinity (Python's json accepts them)
        raise bad(f"'{key}' must be a finite number, got {v!r}", key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v!r}", key)
    if hi is not None and v > hi:
        raise bad(f"'{key}' must be <= {hi}, got {v!r}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, got {v!r}", key)
    return v


def _text_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "…"}, …]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of {role, content} objects", "messages")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    if len(msgs) > MAX_MESSAGES:
        raise bad(f"'messages' has {len(msgs)} entries; this server takes at most {MAX_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"messages[{i}].role must be system, user or assistant (got {role!r})", f"messages[{i}].role")
        out.append({"role": role, "content": _text_content(m.get("content"), i)})
    if out[-1]["role"] == "user" and not out[-1]["content"].strip():
        raise bad("the last message is empty", f"messages[{len(out) - 1}].content")
    return out


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        return p, None
    if isinstance(p, list):
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)
        raise bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    raise bad("'prompt' must be a string or a list of token ids", "prompt")


def check_body(body) -> None:
    """Refuse a parsed JSON body nested deeper than MAX_NESTING or holding a lone surrogate
    (``"\\ud800"``: valid JSON, but no UTF-8 text; the tokenizer and the reply would fail on it).
    Iterative: O(size of the body), no recursion."""
    stack = [(body, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise bad("the request holds a lone UTF-16 surrogate (e.g. \\ud800): not valid Unicode text",
                          code="invalid_json")
            continue
        if isinstance(v, (dict, list)):
            if depth >= MAX_NESTING:
                raise bad(f"the request body is nested deeper than {MAX_NESTING} levels", code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise bad("the request holds a lone UTF-16 surrogate (e.g. \\ud800): not valid Unicode text",
                              code="invalid_json")
                if isinstance(x, (str, dict, list)):
                    stack.append((x, depth + 1))


def parse(body, kind: str) -> GenRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    req = GenRequest(kind, model)
    if kind == "chat":
        req.messages = _messages(body)
    else:
        req.prompt, req.prompt_ids = _prompt(body)
    req.stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not req.stream:  # as vLLM: stream_options only make sense for a stream
            raise bad("'stream_options' needs 'stream': true", "stream_options")
        req.include_usage = _bool(so, "include_usage", False)
    req.temperature = float(_num(body, "temperature", 1.0, lo=0))
    req.top_p = float(_num(body, "top_p", 1.0, lo=0, hi=1, lo_open=True))
    top_k = _num(body, "top_k", 0, lo=-1, integer=True)
    req.top_k = 0 if top_k == -1 else top_k
    key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _num(body, key, None, lo=1, integer=True)
    req.seed = _num(body, "seed", None, integer=True)
    if req.seed is not None and not -(1 << 63) <= req.seed < (1 << 64):
        raise bad("'seed' must fit in 64 bits", "seed")
    req.n = _num(body, "n", 1, lo=1, hi=MAX_N, integer=True)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' takes at most {MAX_STOP} strings", "stop")
        req.stop = [s for s in stop if s]
    req.ignore_eos = _bool(body, "ignore_eos", False)
    req.miss_details = _bool(body, "return_miss_details", False)
    if kind == "chat":
        req.logprobs = _bool(body, "logprobs", False)
        req.top_logprobs = _num(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS, integer=True)
        if req.top_logprobs and not req.logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        n_lp = _num(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        req.logprobs, req.top_logprobs = n_lp is not None, n_lp or 0
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise bad("'user' must be a string", "user")
        if hidden(user) is not None:  # a name shown to people (and the KV events' session_id)
            raise bad(f"'user' has a control or invisible character ({hidden(user)}): give a name people can read",
                      "user")
        req.body_user = user.strip()[:64] or None
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise bad("'vllm_xargs' must be an object", "vllm_xargs")
        mode = xargs.get("kv_cache_report_mode")
        if mode is not None:
            if mode not in ("full", "incremental"):
                raise bad("vllm_xargs.kv_cache_report_mode must be 'full' or 'incremental'", "vllm_xargs")
            req.report_mode = mode
    return req


class StopMatcher:
    """Cuts streamed text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything received
        self.sent = 0  # chars of `text` already released
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add streamed text; return what can be released now."""
        if self.stopped:
            return ""
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            cut = max(cut, self.sent)  # released text never held a whole stop string
            self.stopped = True
            out, self.sent = self.text[self.sent:cut], cut
            return out
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> str:
        """The held-back tail when generation ended without a stop string."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    @property
    def released(self) -> str:
        return self.text[:self.sent]
