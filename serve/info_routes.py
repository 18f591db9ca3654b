"""The routes that make `kvplay serve` discoverable and readable by the ecosystem's tools:

- ``GET /kv_event_sources``: vLLM 0.32's answer, a map from DP rank to that rank's KV-events
  config (``{}`` when the server publishes no events). A socket the publisher binds is
  advertised as a wildcard (``tcp://*:PORT``: "connect to this server's host"); one it connects
  to is advertised as is (the consumer binds it).
- ``GET /server_info``: SGLang's shape, with its ``kv_events`` descriptor
  (``{"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": PORT, "topic",
  "block_size", "dp_size": 1}``; None unless the publisher binds a TCP port), ``page_size`` and
  ``dp_size``. RadixView and `kvplay watch/attach URL` read it.
- ``POST /detokenize``: ``{"tokens": [...]}`` (``skip_special_tokens``) → ``{"prompt": text}``
  (vLLM) and ``"text"`` (SGLang). An id outside the vocabulary is a 400.

(``POST /tokenize``, vLLM's, is serve/app.py's: it tokenises as generation does.) With API keys
every route needs a key, like the rest of the API. Inputs are bounded (`MAX_TOKENS`) before any
work.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from .protocol import ApiError, bad

MAX_TOKENS = 1 << 17


def advertised(endpoint: str | None, binds: bool = True) -> str | None:
    """A socket the server binds, as a consumer should read it: a TCP one as ``tcp://*:PORT``."""
    if endpoint is None or not binds or not endpoint.startswith("tcp://"):
        return endpoint
    _host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://*:{port}"


def kv_event_sources(state) -> dict:
    """vLLM 0.32's /kv_event_sources: {rank: KVEventsConfig as a dict}, {} without events."""
    pub = state.side.events_info
    if pub is None:
        return {}
    s = pub["settings"]
    return {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": advertised(pub["endpoint"], pub["binds"]),
                  "replay_endpoint": advertised(pub["replay_endpoint"]),
                  "buffer_steps": s["buffer_steps"], "hwm": s["hwm"], "max_queue_size": s["max_queue_size"],
                  "topic": s["topic"]}}


def sglang_kv_events(state) -> dict | None:
    """SGLang's kv_events descriptor (None, as SGLang says it, unless a bound TCP port serves it)."""
    pub = state.side.events_info
    if pub is None or not pub["binds"] or not pub["endpoint"].startswith("tcp://"):
        return None
    port = int(pub["endpoint"].rpartition(":")[2])
    return {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port,
            "topic": pub["settings"]["topic"], "block_size": state.side.config.block_size, "dp_size": 1}


def server_info(state) -> dict:
    side = state.side
    return {"model_path": side.config.model, "served_model_name": state.model_name,
            "page_size": side.config.block_size, "dp_size": 1, "tp_size": 1,
            "max_total_num_tokens": side.num_blocks * side.config.block_size,
            "context_length": side.max_positions, "kv_events": sglang_kv_events(state),
            "version": "kvplay"}


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false", name)
    return v


def detokenize(state, body, check_model) -> dict:
    if not isinstance(body, dict):
        raise bad("send a JSON object with 'tokens'")
    model = body.get("model")
    check_model(state, model if isinstance(model, str) or model is None else str(model)[:100])
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("'tokens' must be a list of token ids", "tokens")
    if len(tokens) > MAX_TOKENS:
        raise ApiError(413, f"more than {MAX_TOKENS} tokens", "tokens")
    vocab = len(state.side.tokenizer)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(f"token id {str(t)[:40]!r} is not an integer", "tokens")
        if not 0 <= t < vocab:
            raise bad(f"token id {t} is outside the vocabulary (0..{vocab - 1})", "tokens")
    skip = _flag(body, "skip_special_tokens", False)
    text = state.tokenizers.run(lambda tok: tok.decode(tokens, skip_special_tokens=skip))
    return {"prompt": text, "text": text}


def add_info_routes(app: FastAPI, state, identify, read_json, check_model) -> None:
    """Register the routes with serve/app.py's helpers: `identify(state, request)` refuses a
    missing or bad key when the server has keys; `read_json(request)` reads a bounded JSON body;
    `check_model(state, model)` refuses a model this server does not serve (404)."""

    @app.get("/kv_event_sources")
    async def _kv_event_sources(request: Request):
        identify(state, request)
        return kv_event_sources(state)

    @app.get("/server_info")
    async def _server_info(request: Request):
        identify(state, request)
        return server_info(state)

    @app.post("/detokenize")
    async def _detokenize(request: Request):
        identify(state, request)
        body = await read_json(request)
        return await run_in_threadpool(detokenize, state, body, check_model)
