"""The `--peer-url` peer: any OpenAI-compatible server with prefix caching (vLLM, SGLang,
`kvplay serve`), driven over HTTP with the workload's own token ids.

Every request is a streamed ``POST /v1/completions`` whose ``prompt`` is the token-id list (the
completions API accepts token-id prompts, so the server tokenizes nothing), with the workload's
number of new tokens (``max_tokens`` = N with ``ignore_eos``), greedy
(``temperature`` 0). TTFT is measured by this client, from the round's start to the first
streamed chunk that carries a choice; decode is measured from the first to the last chunk. The
server's own count of reused prompt tokens is read from the last chunk's
``usage.prompt_tokens_details.cached_tokens`` when it reports one (vLLM with
``--enable-prompt-tokens-details``), else it stays unknown.

Cold means cold: before the timed workload the peer gets one throwaway request (first-call
costs, as every other peer), then its prefix cache is emptied with ``POST /reset_prefix_cache``
(vLLM with ``VLLM_SERVER_DEV_MODE=1``, SGLang's ``/flush_cache``). When the server offers neither,
every prompt of this run gets one fresh random first token instead, so no block of an earlier run
can match; the report says which was done.
"""
from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from kvplay.engine.errors import EngineError

from .metrics import PeerResult, RequestRecord
from .workloads import Workload

Progress = Callable[[str], None]
KEY = "peer-url"
RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")


def _quiet(msg: str) -> None:
    pass


def base_url(url: str) -> str:
    """http://host:port[/v1][/] -> http://host:port (the server root)."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise EngineError(f"--peer-url {url!r}: expected http://HOST:PORT")
    if u.endswith("/v1"):
        u = u[:-3]
    return u


class HttpPeer:
    """A client of one OpenAI-compatible server."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0, api_key: str | None = None):
        import httpx

        self.base = base_url(url)
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
        import httpx

        try:
            r = self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise EngineError(f"--peer-url {self.base}: cannot connect ({_why(exc)})") from None
        if r.status_code != 200:
            raise EngineError(f"--peer-url {self.base}: GET /v1/models answered HTTP {r.status_code}: "
                              f"{_error_text(r)}")
        try:
            listed = {m["id"]: m.get("owned_by") for m in r.json().get("data", [])}
            ids = list(listed)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EngineError(f"--peer-url {self.base}: GET /v1/models is not an OpenAI model list") from None
        if self.model is None:
            if not ids:
                raise EngineError(f"--peer-url {self.base}: the server lists no model; pass --peer-model NAME")
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
        import httpx

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

    # --- one request ----------------------------------------------------------------------------

    def complete(self, prompt_ids: list[int] | str, new_tokens: int, extra: dict | None = None) -> dict:
        """Stream one greedy completion of exactly `new_tokens`; return its client-side times and
        what the server reported (perf_counter clock). `prompt_ids` may also be text; `extra` adds
        or overrides body fields (user, cache_salt, logprobs, ignore_eos…; the labs' target client)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": new_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update(extra or {})
        logprobs = []
        first = None
        chunks = 0
        usage = None
        text = []
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise EngineError(f"{self.base} answered HTTP {r.status_code}: {_error_text(r)}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise EngineError(f"{self.base} sent a stream chunk that is not JSON: {data[:80]!r}") from None
                if obj.get("error"):
                    raise EngineError(f"{self.base} failed mid-stream: {_message(obj['error'])}")
                if obj.get("choices"):
                    if first is None:
                        first = time.perf_counter()
                    chunks += 1
                    text.append(obj["choices"][0].get("text") or "")
                    if obj["choices"][0].get("logprobs"):
                        logprobs.append(obj["choices"][0]["logprobs"])
                if obj.get("usage"):
                    usage = obj["usage"]
        end = time.perf_counter()
        details = (usage or {}).get("prompt_tokens_details") or {}
        return {"first": first or end, "end": end, "text": "".join(text),
                "output_tokens": (usage or {}).get("completion_tokens", chunks),
                "prompt_tokens": (usage or {}).get("prompt_tokens", len(prompt_ids)),
                "cached_tokens": details.get("cached_tokens"), "logprobs": logprobs}


def run_http_peer(peer: HttpPeer, workload: Workload, progress: Progress = _quiet, seed: int = 0) -> PeerResult:
    """Play `workload` through the server, round by round (a round's requests concurrently)."""
    res = PeerResult(KEY, peer.label)
    rng = random.Random(seed)
    try:
        # warm-up: a short throwaway request whose prompt shares no block with the workload
        peer.complete(list(reversed(workload.turns[0].prompt_ids[:24])), 2)
        if peer.reset_prefix_cache():
            prefix: list[int] = []
            res.extra["cold_by"] = f"POST {peer.reset_path}"
        else:
            vocab = sorted({t for turn in workload.turns for t in turn.prompt_ids})
            prefix = [rng.choice(vocab)]
            res.extra["cold_by"] = "a fresh random first token on every prompt (no reset endpoint)"
        n, done = len(workload.turns), 0
        mismatched = []
        t_start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(len(r) for r in workload.rounds)) as pool:
            for rnd in workload.rounds:
                arrival = time.perf_counter()
                futures = [pool.submit(peer.complete, prefix + t.prompt_ids, workload.new_tokens) for t in rnd]
                for turn, fut in zip(rnd, futures):
                    got = fut.result()
                    done += 1
                    progress(f"{KEY}: request {done}/{n}")
                    if got["prompt_tokens"] != len(prefix) + len(turn.prompt_ids):
                        mismatched.append(got["prompt_tokens"])
                    res.records.append(RequestRecord(turn.user, turn.round, turn.cold, len(turn.prompt_ids),
                                                     got["cached_tokens"], got["output_tokens"], arrival,
                                                     got["first"], got["end"]))
        res.wall_s = time.perf_counter() - t_start
        if mismatched:
            res.extra["note"] = (f"the server counted {mismatched[0]} prompt tokens where {KEY} sent a different "
                                 "number: is it serving another tokenizer?")
    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
        res.unavailable = f"unavailable: {_why(exc)}"
        res.records = []
    return res


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


def _why(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:200] if msg else type(exc).__name__
