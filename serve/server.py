"""Assemble and run a server: engine + keys + recorder + metrics + KV events -> uvicorn.

`kvplay serve` (serve/cli.py), the tests and scripts/serve_ttft.py all go through `build_state`
and `ServerThread`/`serve_forever`, so what the tests exercise is what users run.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
import time

from kvplay.engine.errors import EngineError

from .app import ServeState, create_app
from .kv_events import EngineEventPublisher
from .metrics import ServerMetrics


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


def build_state(engine, keys=None, kv_events=None, loopback: bool = True, report_full: bool = False,
                recorder=None, served_name: str | None = None) -> ServeState:
    """`kv_events`: a wire.publisher.KVEventsConfig (or None). On a loopback-only server a
    wildcard bind (vLLM's default ``tcp://*:5557``) binds 127.0.0.1 only."""
    state = ServeState(engine, keys=keys, recorder=recorder, served_name=served_name)
    state.register_keys()
    state.metrics = ServerMetrics(engine)
    if kv_events is not None and kv_events.enabled:
        # start-up time: imported when this first runs
        from kvplay.wire.publisher import ZmqEventPublisher

        pub = ZmqEventPublisher.from_config(kv_events, loopback=loopback)
        state.events = EngineEventPublisher(engine, pub, report_full=report_full)
    if recorder is not None:
        recorder.attach(engine)
    return state


def close_state(state: ServeState) -> None:
    if state.events is not None:
        state.events.close()
        state.events.publisher.shutdown()
    if state.metrics is not None:
        state.metrics.close()


def _uvicorn_server(state: ServeState, log_level: str = "warning", ssl_keyfile: str | None = None,
                    ssl_certfile: str | None = None):
    # start-up time: imported when this first runs
    import uvicorn

    config = uvicorn.Config(create_app(state), log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, ws="none", http="h11",
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    if ssl_certfile:
        try:
            config.load()  # reads the key and certificate now: a bad file is one line, before serving
        except (OSError, ValueError) as exc:
            raise EngineError(f"--ssl-certfile/--ssl-keyfile: cannot load them ({exc})") from None
    return uvicorn.Server(config)


def serve_forever(state: ServeState, sock: socket.socket, log_level: str = "warning",
                  ssl_keyfile: str | None = None, ssl_certfile: str | None = None) -> None:
    _uvicorn_server(state, log_level, ssl_keyfile, ssl_certfile).run(sockets=[sock])


class ServerThread:
    """uvicorn in a background thread on a free loopback port (tests, scripts)."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0,
                 ssl_keyfile: str | None = None, ssl_certfile: str | None = None):
        self.state = state
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"{'https' if ssl_certfile else 'http'}://{host}:{self.port}"
        self.server = _uvicorn_server(state, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
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
