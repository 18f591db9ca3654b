"""A client of one OpenAI-compatible server (vLLM, SGLang, `kvplay serve`): `HttpPeer` checks the
server and its model (`connect`), empties its prefix cache where the server offers an endpoint
for it (`reset_prefix_cache`: vLLM's ``POST /reset_prefix_cache`` with
``VLLM_SERVER_DEV_MODE=1``, SGLang's ``/flush_cache``), and streams ``POST /v1/completions``
with token-id prompts (`complete`: client-side TTFT, the server's cached-token count when it
reports one). `kvplay bench --peer-url` (bench/http_peer.py) and the labs' `--target`
(labs/target.py) drive servers through it.
"""
from __future__ import annotations

import json
import os
import time

import httpx

from kvplay.engine.errors import EngineError

RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")


def base_url(url: str, flag: str = "--peer-url") -> str:
    """http://host:port[/v1][/] -> http://host:port (the server root)."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise EngineError(f"{flag} {url!r}: expected http://HOST:PORT")
    if u.endswith("/v1"):
        u = u[:-3]
    return u


class HttpPeer:
    """A client of one OpenAI-compatible server."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0, api_key: str | None = None,
                 flag: str = "--peer-url"):
        self.flag = flag  # what error lines name the server by (the command's flag)
        self.base = base_url(url, flag)
        api_key = api_key or os.environ.get("OPENAI_API_KEY")  # as OpenAI clients do
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base, timeout=httpx.Timeout(timeout, connect=10.0),
                                   headers=headers)
        self.model = model
        self.server = "OpenAI-compatible server"
        self.reset_path: str | None = None

    def close(self) -> None:
        self.client.close()

    # --- discovery ------------------------------------------------------------------------------

    def connect(self) -> "HttpPeer":
        """Check the server answers, pick the model (the only one served, or --peer-model) and say
        what it is. Raises EngineError with one line when it cannot."""
        try:
            r = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.flag} {self.base}: cannot connect ({why(exc)})") from None
        if r.status_code != 200:
            raise HttpError(r.status_code, f"{self.flag} {self.base}: GET /v1/models answered HTTP {r.status_code}: "
                            f"{_error_text(r)}")
        try:
            listed = {m["id"]: m.get("owned_by") for m in r.json().get("data", [])}
            ids = list(listed)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EngineError(f"{self.flag} {self.base}: GET /v1/models is not an OpenAI model list") from None
        if self.model is None:
            if not ids:
                raise EngineError(f"{self.flag} {self.base}: the server lists no model; pass --peer-model NAME")
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise EngineError(f"--peer-model {self.model!r}: {self.base} serves {', '.join(ids)}")
        owner = listed.get(self.model) if ids else None
        version = None
        try:
            v = self.client.get("/version")
            if v.status_code == 200 and isinstance(v.json(), dict):
                version = v.json().get("version")
        except (httpx.HTTPError, ValueError):
            pass
        if owner or version:
            self.server = " ".join(str(x) for x in (owner or "server", version) if x)
        return self

    @property
    def label(self) -> str:
        return f"{self.model} at {self.base} ({self.server}, OpenAI completions API)"

    def reset_prefix_cache(self) -> bool:
        """Empty the server's prefix cache if it offers a way; True when it did."""
        paths = (self.reset_path,) if self.reset_path else RESET_PATHS
        for path in paths:
            try:
                r = self.client.post(path)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                self.reset_path = path
                return True
        return False

    def request_json(self, method: str, path: str, max_bytes: int, **kw) -> tuple[int, object]:
        """(status, the body as JSON, or None when it is not JSON or longer than `max_bytes`) of
        one request (`kw`: httpx's json=, params=); a transport failure raises EngineError."""
        raw = bytearray()
        try:
            with self.client.stream(method, path, **kw) as r:
                for chunk in r.iter_bytes():
                    raw += chunk
                    if len(raw) > max_bytes:
                        return r.status_code, None
                status = r.status_code
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base}: {method} {path} failed ({why(exc)})") from None
        try:
            return status, json.loads(bytes(raw))
        except (ValueError, RecursionError):
            return status, None

    # --- one request ----------------------------------------------------------------------------

    def complete(self, prompt_ids: list[int] | str, new_tokens: int, extra: dict | None = None) -> dict:
        """Stream one greedy completion of exactly `new_tokens`; return its client-side times and
        what the server reported (perf_counter clock). `prompt_ids` may also be text; `extra` adds
        or overrides body fields (user, cache_salt, logprobs, ignore_eos…; the labs' target client)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": new_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update(extra or {})
        got = self.stream("/v1/completions", body)
        if got["prompt_tokens"] is None:
            got["prompt_tokens"] = len(prompt_ids)
        return got

    def stream(self, path: str, body: dict, max_bytes: int | None = None) -> dict:
        """POST `body` (a streamed completion or chat completion) to `path` and read the stream:
        {"sent", "first", "end"} (perf_counter: when the request went, its first chunk with a
        choice, the end), "text", "output_tokens", "prompt_tokens" and "cached_tokens" (None when
        the server reports no usage or no prompt_tokens_details), "logprobs", "kvplay" (the last
        `kvplay` object kvplay serve sends, else None), "request_id" and "processing_ms" (the
        response's X-Request-Id and openai-processing-ms headers, where sent). A refusal raises
        HttpError with its status; a broken stream, or one longer than `max_bytes`, EngineError."""
        logprobs = []
        first = None
        chunks = 0
        usage = None
        ext = None
        text = []
        size = 0
        sent = time.perf_counter()
        try:
            with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise HttpError(r.status_code, f"{self.base} answered HTTP {r.status_code}: {_error_text(r)}")
                headers = {k: r.headers.get(k) for k in ("x-request-id", "openai-processing-ms")}
                for line in r.iter_lines():
                    size += len(line) + 1
                    if max_bytes is not None and size > max_bytes:
                        raise EngineError(f"{self.base}: the stream of {path} ran past {max_bytes} bytes")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise EngineError(f"{self.base} sent a stream chunk that is not JSON: {data[:80]!r}") from None
                    if not isinstance(obj, dict):
                        raise EngineError(f"{self.base} sent a stream chunk that is not a JSON object: {data[:80]!r}")
                    if obj.get("error"):
                        raise EngineError(f"{self.base} failed mid-stream: {_message(obj['error'])}")
                    choices = obj.get("choices")
                    if choices and isinstance(choices, list) and isinstance(choices[0], dict):
                        c = choices[0]
                        delta = c.get("delta")
                        if isinstance(delta, dict) and not delta.get("content") and not c.get("finish_reason") \
                                and set(delta) <= {"role", "content"}:
                            continue  # a chat stream's opening chunk: the role (and ""), no token yet
                        if first is None:
                            first = time.perf_counter()
                        chunks += 1
                        piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        text.append(piece if isinstance(piece, str) else "")
                        if c.get("logprobs"):
                            logprobs.append(c["logprobs"])
                    if isinstance(obj.get("usage"), dict):
                        usage = obj["usage"]
                    if isinstance(obj.get("kvplay"), dict):
                        ext = obj["kvplay"]
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base}: {path} failed ({why(exc)})") from None
        end = time.perf_counter()
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return {"sent": sent, "first": first or end, "end": end, "text": "".join(text),
                "output_tokens": (usage or {}).get("completion_tokens", chunks),
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "cached_tokens": cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
                "logprobs": logprobs, "kvplay": ext, "request_id": headers["x-request-id"],
                "processing_ms": _number(headers["openai-processing-ms"])}


class HttpError(EngineError):
    """The server answered a request with an HTTP error status (`status`)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _number(text: str | None) -> float | None:
    try:
        v = float(text) if text is not None else None
    except ValueError:
        return None
    return v if v is not None and v == v and abs(v) != float("inf") else None


def _message(err) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _error_text(r) -> str:
    try:
        obj = r.json()
    except ValueError:
        return r.text.strip().splitlines()[0][:200] if r.text.strip() else "(empty body)"
    if isinstance(obj, dict) and "error" in obj:
        return _message(obj["error"])[:200]
    if isinstance(obj, dict) and "detail" in obj:
        return str(obj["detail"])[:200]
    return str(obj)[:200]


def why(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:200] if msg else type(exc).__name__
