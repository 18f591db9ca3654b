"""ZMQ CURVE for the KV-event sockets: encryption plus an allow-list of subscribers.

KV events carry token ids (every user's prompts and replies, with the user as ``session_id``):
on a network, the publisher's PUB and replay sockets are CURVE servers that only talk to
subscribers whose public key is in a directory the operator keeps (a ZAP authenticator checks
each one); a subscriber is a CURVE client that knows the server's public key.

Keys are pyzmq's ``zmq.auth`` certificate files (``NAME.key`` public, ``NAME.key_secret``
secret+public). ``generate(DIR)`` makes the set `kvplay serve --gen-curve-keys DIR` writes:

    DIR/server.key  DIR/server.key_secret     the server's pair (--kv-events-curve DIR)
    DIR/clients/client.key                    allowed subscribers' public keys (add more)
    DIR/client.key_secret                     a subscriber's pair (watch/attach --events-curve-key)

A CURVE-less loopback publisher is unchanged (what vLLM's consumers expect).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvplay.engine.errors import EngineError

SERVER = "server"
CLIENTS = "clients"
ZAP_DOMAIN = "kvplay-kv-events"


def _load(path: str | os.PathLike, secret: bool, flag: str) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise EngineError(f"{flag} {path}: not a readable ZMQ certificate ({exc})") from None
    if secret and not sec:
        raise EngineError(f"{flag} {path}: holds no secret key (give the .key_secret file)")
    return public, sec


def generate(directory: str | os.PathLike, client: str = "client") -> Path:
    """A server pair and one client pair in `directory` (made 0700); returns it."""
    d = Path(directory).expanduser()
    clients = d / CLIENTS
    try:
        clients.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        if (d / f"{SERVER}.key_secret").exists():
            raise EngineError(f"--gen-curve-keys {d}: {SERVER}.key_secret exists already (left unchanged)")
        old = os.umask(0o077)
        try:
            zmq.auth.create_certificates(str(d), SERVER)
            pub, _ = zmq.auth.create_certificates(str(d), client)
        finally:
            os.umask(old)
        os.replace(pub, clients / f"{client}.key")
    except OSError as exc:
        raise EngineError(f"--gen-curve-keys {d}: {exc.strerror or exc}") from None
    return d


@dataclass
class ServerCurve:
    """The publisher side: the server's pair and the directory of allowed client keys."""
    public: bytes
    secret: bytes
    clients_dir: str

    @classmethod
    def load(cls, directory: str | os.PathLike, flag: str = "--kv-events-curve") -> "ServerCurve":
        d = Path(directory).expanduser()
        public, secret = _load(d / f"{SERVER}.key_secret", True, flag)
        clients = d / CLIENTS
        if not clients.is_dir() or not any(clients.glob("*.key")):
            raise EngineError(f"{flag} {d}: no allowed subscribers ({clients}/*.key); "
                              "`kvplay serve --gen-curve-keys DIR` makes one")
        return cls(public, secret, str(clients))

    def start_authenticator(self, ctx: zmq.Context):
        """A ZAP handler on `ctx` that admits only the keys in clients_dir (read now; restart
        the server to change them). Returns it (call .stop())."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=self.clients_dir)
        return auth

    def apply(self, sock: zmq.Socket) -> None:
        """Before bind/connect."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()


@dataclass
class ClientCurve:
    """The subscriber side: the server's public key and this subscriber's pair."""
    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key: str, client_key: str) -> "ClientCurve":
        """`server_key`: the server's ``server.key`` (or a 40-character Z85 key);
        `client_key`: this subscriber's ``.key_secret`` file."""
        if len(server_key) == 40 and not os.path.exists(server_key):
            server_public = server_key.encode()
        else:
            server_public, _ = _load(server_key, False, "--events-curve-server-key")
        public, secret = _load(client_key, True, "--events-curve-key")
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        """Before connect."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def client_from_args(server_key: str | None, client_key: str | None) -> ClientCurve | None:
    """The --events-curve-server-key / --events-curve-key pair of a subscribing command."""
    if not server_key and not client_key:
        return None
    if not (server_key and client_key):
        raise EngineError("--events-curve-server-key and --events-curve-key go together")
    return ClientCurve.load(server_key, client_key)
