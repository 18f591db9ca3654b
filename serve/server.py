"""Assemble and run a server: engine + keys + recorder + metrics + KV events -> uvicorn.

`build_state` puts the engine's side (serve/engine_side.py) in this process: the tests and
scripts/serve_ttft.py use it. `kvplay serve` (kvplay/commands/serve.py) runs that same side in an
engine-core process (serve/core_proc.py) and builds the state around its `RemoteSide`. Both go
through `create_app` and `ServerThread`/`serve_forever`.
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvplay.engine.errors import EngineError
from kvplay.wire.loopback import endpoint_is_loopback, is_loopback_host
from kvplay.wire.publisher import is_bind_endpoint, loopback_only

from .app import ServeState, create_app
from .engine_side import EngineSide, event_publisher

HEADER_TIMEOUT_S = 10.0  # from connecting (or the last response) to a request's complete headers
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this
MAX_HEADER_BYTES = 16 * 1024  # h11's limit on an incomplete request head
MAX_CONNECTIONS = 1024  # uvicorn's limit_concurrency: connections + tasks; over it, 503


def is_loopback(host: str) -> bool:
    """True only for a host that surely stays on this machine (wire/loopback.py)."""
    return is_loopback_host(host)


def guarded_h11():
    """uvicorn's h11 protocol with a header timeout: a connection that has not sent a whole
    request head within HEADER_TIMEOUT_S of connecting (or of its last response) is closed, so
    slow or idle connections cannot pile up (uvicorn itself only times out kept-alive idle
    connections, and any byte received cancels that)."""
    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timeout()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timeout()

        def _arm_header_timeout(self) -> None:
            self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout, self.cycle)

        def _header_timeout(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():  # no new request head since
                self.transport.close()

    return GuardedH11


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen before the model loads, so a busy port is one line, not a traceback minutes later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without
    # it every response whose headers and body go out in two writes waited ~40 ms (Nagle and
    # delayed ACK), measured as 44 ms per /v1/models call and added to every streamed TTFT.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def check_event_endpoints(kv_events, keys, loopback: bool, curve=None, insecure: bool = False) -> list[str]:
    """Refuse KV-event endpoints that would leave loopback unprotected; returns the endpoints
    that are open to the network without CURVE (allowed by `insecure`).

    Events carry every user's token ids (their prompts): without keys nothing may leave
    loopback (after the wildcard rewrite); with keys a non-loopback endpoint needs CURVE or
    the operator's explicit --kv-events-insecure."""
    if kv_events is None or not kv_events.enabled:
        return []
    pub = kv_events.endpoint
    if loopback and is_bind_endpoint(pub):
        pub = loopback_only(pub)
    replay = loopback_only(kv_events.replay_endpoint) if loopback else kv_events.replay_endpoint
    open_eps = [ep for ep in (pub, replay) if ep is not None and not endpoint_is_loopback(ep)]
    if open_eps and keys is None:
        raise EngineError(f"KV events on {open_eps[0]}: without --api-keys the event endpoints stay on loopback "
                          "(events carry every user's prompts as token ids); use 127.0.0.1, or give --api-keys "
                          "and --kv-events-curve DIR")
    if open_eps and curve is None and not insecure:
        raise EngineError(f"KV events on {open_eps[0]} are not loopback: they carry every user's prompts as token "
                          "ids; give --kv-events-curve DIR (keys from --gen-curve-keys DIR), or "
                          "--kv-events-insecure to publish them in clear to anyone who reaches the port")
    return [] if curve is not None else open_eps


def build_state(engine, keys=None, kv_events=None, loopback: bool = True, report_full: bool = False,
                recorder=None, served_name: str | None = None, curve=None, insecure_events: bool = False,
                max_concurrent: int | None = None, metrics_users: bool = False,
                explain_across_keys: bool = False) -> ServeState:
    """`kv_events`: a wire.publisher.KVEventsConfig (or None). On a loopback-only server a
    wildcard bind (vLLM's default ``tcp://*:5557``) binds 127.0.0.1 only; any other endpoint
    must pass check_event_endpoints. `curve`: a wire.curve.ServerCurve for both event sockets."""
    check_event_endpoints(kv_events, keys, loopback, curve, insecure_events)
    side = EngineSide(engine, identities_of(keys), event_publisher(kv_events, loopback, curve),
                      report_full=report_full, recorder=recorder, explain_across_keys=explain_across_keys)
    return state_for(side, keys, served_name, max_concurrent, metrics_users)


def identities_of(keys) -> list[tuple[str, str | None]]:
    """Every key's (user, group), once each: bound in the engine before serving."""
    return sorted({(i.user, i.group) for i in (keys or {}).values()}, key=lambda x: (x[0], x[1] or ""))


def state_for(side, keys=None, served_name: str | None = None, max_concurrent: int | None = None,
              metrics_users: bool = False) -> ServeState:
    extra = {} if max_concurrent is None else {"max_concurrent": max_concurrent}
    return ServeState(side, keys=keys, served_name=served_name, metrics_users=metrics_users, **extra)


def close_state(state: ServeState) -> None:
    """Close the side: in this process, its publisher, counters and queued recording; the
    engine-core process's, the whole core (it closes its session and engine)."""
    state.side.close()


def _uvicorn_server(state: ServeState, log_level: str = "warning", ssl_keyfile: str | None = None,
                    ssl_certfile: str | None = None, ssl_keyfile_password: str | None = None):
    config = uvicorn.Config(create_app(state), log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, ws="none", http=guarded_h11(),
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            limit_concurrency=MAX_CONNECTIONS,
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                            ssl_keyfile_password=ssl_keyfile_password)
    if ssl_certfile:
        try:
            config.load()  # reads the key and certificate now: a bad file is one line, before serving
        except (OSError, ValueError) as exc:
            raise EngineError(f"--ssl-certfile/--ssl-keyfile: cannot load them ({exc})") from None
    return uvicorn.Server(config)


def serve_forever(state: ServeState, sock: socket.socket, log_level: str = "warning",
                  ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
                  ssl_keyfile_password: str | None = None) -> None:
    _uvicorn_server(state, log_level, ssl_keyfile, ssl_certfile, ssl_keyfile_password).run(sockets=[sock])


class ServerThread:
    """uvicorn in a background thread on a free loopback port (tests, scripts)."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0,
                 ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
                 ssl_keyfile_password: str | None = None):
        self.state = state
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"{'https' if ssl_certfile else 'http'}://{host}:{self.port}"
        self.server = _uvicorn_server(state, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                                      ssl_keyfile_password=ssl_keyfile_password)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvplay-serve-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
