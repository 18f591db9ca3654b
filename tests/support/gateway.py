"""A small API gateway on loopback, for the audit tests: it authenticates its own API keys and
forwards to one OpenAI-compatible upstream (vLLM, kvplay serve) as a single upstream identity —
what CacheProbe audited (a gateway pooling its customers on shared upstream keys).

- `salt="per-key"`: every request gets ``cache_salt`` = an HMAC of the caller's key (vLLM's
  request field, hashed into the first block), so customers never share cached blocks;
- `salt=None`: no salt, every customer shares the upstream's cache;
- `min_max_tokens=2`: refuses ``max_tokens`` below 2 with a 400, as some APIs do.

Streams are relayed chunk by chunk (the client's time to first token stays the upstream's, plus
one loopback hop). Run it with `GatewayThread(app).start()`; `.url`, `.stop()`."""
from __future__ import annotations

import hashlib
import hmac
import json
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvplay.serve.server import ServerThread, bind_socket

SECRET = b"kvplay-test-gateway"


def gateway_app(upstream: str, keys: list[str], salt: str | None = None, min_max_tokens: int = 0,
                upstream_key: str | None = None) -> Starlette:
    """The gateway's app: `keys` are its customers' keys; `upstream_key` the one key it uses upstream."""
    headers = {"Authorization": f"Bearer {upstream_key}"} if upstream_key else {}
    client = httpx.AsyncClient(base_url=upstream, timeout=600.0, headers=headers)

    def who(request: Request) -> str | None:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and token in keys else None

    def refused():
        return JSONResponse({"error": {"message": "invalid API key", "type": "invalid_request_error",
                                       "code": "invalid_api_key"}}, status_code=401)

    async def relay_get(request: Request):
        if who(request) is None:
            return refused()
        r = await client.get(request.url.path, params=dict(request.query_params))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def relay_post(request: Request):
        key = who(request)
        if key is None:
            return refused()
        body = json.loads(await request.body())
        path = request.url.path
        if path.startswith("/v1/"):
            if min_max_tokens and body.get("max_tokens", min_max_tokens) < min_max_tokens:
                return JSONResponse({"error": {"message": f"max_tokens must be at least {min_max_tokens}",
                                               "type": "invalid_request_error", "param": "max_tokens"}},
                                    status_code=400)
            body.pop("cache_salt", None)  # a customer never picks the salt
            if salt == "per-key":
                body["cache_salt"] = hmac.new(SECRET, key.encode(), hashlib.sha256).hexdigest()
        if not body.get("stream"):
            r = await client.post(path, json=body)
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        req = client.build_request("POST", path, json=body)
        r = await client.send(req, stream=True)
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))

        async def chunks():
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", relay_get, methods=["GET"]),
        Route("/server_info", relay_get, methods=["GET"]),
        Route("/v1/completions", relay_post, methods=["POST"]),
        Route("/v1/chat/completions", relay_post, methods=["POST"]),
        Route("/tokenize", relay_post, methods=["POST"]),
    ])


class GatewayThread(ServerThread):
    """uvicorn serving the gateway in a background thread on a free loopback port (start, stop
    and the port handling are kvplay serve's test thread's)."""

    def __init__(self, app: Starlette):
        import uvicorn

        self.sock = bind_socket("127.0.0.1", 0)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
