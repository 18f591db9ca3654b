"""Find a server's KV-event endpoints from its URL, the two ways servers advertise them.

- **vLLM** ``GET /kv_event_sources`` (vllm#55844). Three shapes are in the wild, all accepted:
  vLLM 0.32's map from DP rank to that rank's KV-events config
  (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
  "replay_endpoint": ..., "topic": ...}}``), a bare array of
  ``{"data_parallel_rank", "endpoint", "replay_endpoint", "topic"}``, and the same array as
  ``{"sources": [...]}``.
- **SGLang** ``GET /server_info`` → ``kv_events``: ``{"publisher": "zmq", "endpoint_host": "*",
  "endpoint_port_base": 5557, "topic": "", "block_size": 16, "dp_size": N}``; rank r publishes on
  base port + r.

A wildcard endpoint (``tcp://*:P``, ``0.0.0.0``, ``::``) is a socket the server binds: connect to
the server's host at P. A concrete one is where the server's PUB *connects* (vLLM connects
whenever its endpoint is not a wildcard), so kvplay binds it, as ``--events-bind`` does. Replay
endpoints are always bound by the server (a wildcard becomes the server's host). One pod per DP
rank.

HTTP is bounded (a timeout per request, `MAX_RESPONSE_BYTES` read at most, `MAX_SOURCES` ranks);
anything unexpected is one line (`WireError`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from .codec import WireError
from .subscriber import PodSource, check_endpoint

MAX_RESPONSE_BYTES = 1 << 20
MAX_SOURCES = 256
TIMEOUT_S = 5.0
WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


class Unreachable(WireError):
    """The server did not answer at all (a refused connection, a timeout)."""


@dataclass
class Discovered:
    """What a server said about its KV events."""
    sources: list[PodSource]
    via: str                      # "GET /kv_event_sources" | "GET /server_info"
    block_size: int | None = None  # SGLang's kv_events.block_size (hash at this size)


def _host_for_zmq(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _split_tcp(ep: str) -> tuple[str, str] | None:
    """(host, port) of a tcp:// endpoint, else None."""
    if not ep.startswith("tcp://"):
        return None
    host, _, port = ep[len("tcp://"):].rpartition(":")
    return host, port


def resolve(ep: str, server_host: str, what: str, always_bound: bool = False) -> tuple[str, bool]:
    """(endpoint to use, bind?) for an endpoint a server advertised."""
    if not isinstance(ep, str) or len(ep) > 512:
        raise WireError(f"the server advertised a {what} that is not an endpoint: {str(ep)[:80]!r}")
    hp = _split_tcp(ep)
    if hp is not None:
        host, port = hp
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise WireError(f"the server advertised {what} {ep!r}: no usable port")
        if host in WILDCARDS:
            return check_endpoint(f"tcp://{_host_for_zmq(server_host)}:{port}", what), False
        return check_endpoint(ep, what), not always_bound
    check_endpoint(ep, what)  # ipc:// and inproc:// are bound by the server: same machine, connect
    return ep, False


def _get_json(client: httpx.Client, path: str):
    """(status, parsed JSON or None), reading at most MAX_RESPONSE_BYTES."""
    try:
        with client.stream("GET", path) as r:
            if r.status_code != 200:
                return r.status_code, None
            raw = bytearray()
            for chunk in r.iter_bytes():
                raw += chunk
                if len(raw) > MAX_RESPONSE_BYTES:
                    raise WireError(f"GET {path}: the answer is larger than {MAX_RESPONSE_BYTES >> 20} MiB")
    except httpx.HTTPError as exc:
        raise Unreachable(f"cannot reach {client.base_url}: {exc}") from None
    try:
        return 200, json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise WireError(f"GET {path}: the answer is not JSON") from None


def _rank(v, default: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 16:
        return default
    return v


def vllm_sources(body, server_host: str, name: str) -> list[PodSource]:
    """PodSources from a /kv_event_sources answer (any of its three shapes)."""
    if isinstance(body, dict) and isinstance(body.get("sources"), list):
        entries = [(_rank(e.get("data_parallel_rank"), i) if isinstance(e, dict) else i, e)
                   for i, e in enumerate(body["sources"])]
    elif isinstance(body, list):
        entries = [(_rank(e.get("data_parallel_rank"), i) if isinstance(e, dict) else i, e)
                   for i, e in enumerate(body)]
    elif isinstance(body, dict):
        entries = []
        for k, e in body.items():
            if not (isinstance(k, str) and k.isdigit() and len(k) < 6):
                raise WireError(f"GET /kv_event_sources: {str(k)[:40]!r} is not a DP rank")
            entries.append((int(k), e))
    else:
        raise WireError("GET /kv_event_sources: expected a map of DP ranks or a list of sources")
    if len(entries) > MAX_SOURCES:
        raise WireError(f"GET /kv_event_sources lists {len(entries)} sources (at most {MAX_SOURCES})")
    found: list[tuple[int, PodSource]] = []
    for rank, e in sorted(entries, key=lambda re: re[0]):
        if not isinstance(e, dict):
            raise WireError(f"GET /kv_event_sources: rank {rank} is not an object")
        off = e.get("enable_kv_cache_events") is False or ("publisher" in e and e["publisher"] in ("null", None))
        if off or e.get("endpoint") is None:
            continue  # this rank publishes nothing
        endpoint, bind = resolve(e["endpoint"], server_host, "endpoint")
        replay = e.get("replay_endpoint")
        replay_ep = resolve(replay, server_host, "replay endpoint", always_bound=True)[0] if replay else None
        topic = e.get("topic") or ""
        if not isinstance(topic, str) or len(topic) > 256:
            raise WireError(f"GET /kv_event_sources: rank {rank} has a bad topic")
        found.append((rank, PodSource(name, endpoint, bind, replay_ep, topic)))
    return _name_ranks([s for _, s in found], [r for r, _ in found], name)


def _name_ranks(sources: list[PodSource], ranks: list[int], name: str) -> list[PodSource]:
    if len(sources) > 1:
        for src, r in zip(sources, ranks):
            src.name = f"{name}/dp{r}"
    return sources


def sglang_sources(info, server_host: str, name: str) -> tuple[list[PodSource], int | None]:
    """PodSources (and the hashing block size) from SGLang's /server_info."""
    kv = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(kv, dict) or kv.get("publisher", "zmq") != "zmq":
        return [], None
    host = kv.get("endpoint_host", "*")
    base = kv.get("endpoint_port_base")
    dp = kv.get("dp_size", 1)
    bs = kv.get("block_size")
    if not isinstance(host, str) or len(host) > 255:
        raise WireError("GET /server_info: kv_events.endpoint_host is not a host")
    if isinstance(base, bool) or not isinstance(base, int) or not 0 < base < 65536:
        raise WireError("GET /server_info: kv_events.endpoint_port_base is not a port")
    if isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= MAX_SOURCES or base + dp > 65536:
        raise WireError("GET /server_info: kv_events.dp_size is not a number of ranks")
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or not 0 < bs < 1 << 20):
        raise WireError("GET /server_info: kv_events.block_size is not a block size")
    topic = kv.get("topic") or ""
    if not isinstance(topic, str) or len(topic) > 256:
        raise WireError("GET /server_info: kv_events.topic is not a topic")
    h = server_host if host in WILDCARDS else host
    out = [PodSource(name, check_endpoint(f"tcp://{_host_for_zmq(h)}:{base + r}", "endpoint"), False, None, topic)
           for r in range(dp)]
    return _name_ranks(out, list(range(dp)), name), bs


def discover(url: str, api_key: str | None = None, timeout: float = TIMEOUT_S) -> Discovered:
    """Ask the server at `url` for its KV-event endpoints: vLLM's way, then SGLang's.
    Raises WireError (one line) when it lists none or answers nonsense."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WireError(f"URL {url!r}: give the server's base URL, like http://127.0.0.1:8000")
    host = parts.hostname
    name = parts.netloc.rpartition("@")[2]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    with httpx.Client(base_url=base, headers=headers, timeout=timeout, follow_redirects=False) as client:
        status, body = _get_json(client, "/kv_event_sources")
        if status == 401:
            raise WireError(f"{base} refused the API key (401): give --api-key")
        if status == 200 and body:
            sources = vllm_sources(body, host, name)
            if sources:
                return Discovered(sources, "GET /kv_event_sources")
        status2, info = _get_json(client, "/server_info")
        if status2 == 200:
            sources, bs = sglang_sources(info, host, name)
            if sources:
                return Discovered(sources, "GET /server_info", bs)
    raise WireError(f"{base} lists no KV-event publisher (GET /kv_event_sources: "
                    f"{'HTTP ' + str(status) if status != 200 else 'none'}; GET /server_info: "
                    f"{'HTTP ' + str(status2) if status2 != 200 else 'no kv_events'}): start it with KV events "
                    "on, or give --events")
