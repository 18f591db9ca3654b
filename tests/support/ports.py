"""Loopback ports handed out without a race.

Where the code under test can bind port 0 and say what it got (a ZMQ ``tcp://127.0.0.1:*``
endpoint read back from the publisher, uvicorn on a pre-bound socket), tests do that. Where a
port must be known before anything binds it — `kvplay watch --events-bind EP` and kvplay
serve's publisher connecting to the same EP, a publisher restarted on the endpoints its
consumer was given, a vLLM or RadixView process told its port — the port is *reserved*:

- a socket bound to 127.0.0.1:PORT (``SO_REUSEADDR``) that never listens holds it, so no
  other ``bind(0)`` and no outgoing connection of any process is given that port meanwhile
  (Linux hands out only ports with no bound socket);
- the code under test binds it anyway (libzmq, uvicorn, vLLM and http.server all set
  ``SO_REUSEADDR``, and a bound socket that does not listen is no conflict for them);
- until then a connection to it is refused: the same port serves as one "nothing listens here".

The old way (bind port 0, close, hand the number out) left the port free for anyone between
the close and the bind.

Which tests still need a port known in advance, and why:
- a consumer that binds (`attach`/`watch --events-bind`, a bound Subscriber) while kvplay serve's
  or vLLM's publisher connects to it: the consumer needs the server first, the server's
  publisher needs the endpoint at start (tui/test_attach, tui/test_tree_views,
  wire/test_watch_remote, wire/test_watch_serve, cli/test_watch_cmd, interop/*);
- a publisher restarted on the endpoints its consumer was given (wire/test_watch_subscriber,
  cli/test_watch_cmd);
- a separate process told its port: vLLM (HTTP, events, replay: support/vllm.py), RadixView's page;
- a port where nothing listens, for "cannot reach" (tui/test_attach, wire/test_discovery,
  wire/test_watch_remote, cli/test_watch_cmd, serve/test_serve_info).
"""
from __future__ import annotations

import socket


class PortReservations:
    """Ports reserved until `close()` (the `free_port` fixture closes them after the test)."""

    def __init__(self):
        self._held: list[socket.socket] = []

    def __call__(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        self._held.append(s)
        return s.getsockname()[1]

    def close(self) -> None:
        while self._held:
            self._held.pop().close()
