"""Per-connection budgets for a ZMQ socket that anyone who reaches its port may talk to.

libzmq has no limit on what a peer may send a PUB: every subscription a peer sends is kept in a
trie for as long as the connection lives (800k distinct subscriptions from one XSUB: +136 MB
on a PUB, +152 MB on an ``XPUB_MANUAL`` socket, which keeps them in a second trie "for
termination"; measured, docs/serve.md), and the memory goes back to the heap only when the peer
disconnects. Nothing in libzmq can refuse
or drop one peer. So the guard watches the socket's connections itself:

- a socket monitor (``EVENT_ACCEPTED`` / ``EVENT_CONNECTED`` .. ``EVENT_DISCONNECTED``) gives
  each connection's file descriptor;
- the kernel counts the bytes each TCP connection has received (``TCP_INFO``
  ``tcpi_bytes_received``, Linux): a connection past `peer_bytes`, or the largest ones while all
  together are past `total_bytes`, or the newest ones past `max_peers` connections, are cut with
  ``shutdown(2)`` on a duplicate of the descriptor (libzmq sees the peer hang up, ends the pipe
  and frees what it kept for it; a ZMQ peer reconnects by itself);
- after a cut the C heap is trimmed (glibc's ``malloc_trim``: the freed trie is many small
  blocks that the heap otherwise keeps).

A legitimate subscriber sends a greeting, a handshake and its few subscriptions (~100 bytes;
with CURVE ~600); a replay consumer ~12 bytes a request. Bytes count from the connection's
start (a consumer using ZMTP heartbeats is cut, and reconnects, after `peer_bytes` of them).
A descriptor is checked against the addresses seen at accept before it is touched (libzmq may
have closed it and the number been reused). ipc:// connections have no byte counter: only the
connection cap applies to them. The monitor's queue holds MONITOR_EVENTS_KEPT events between
two checks; a connection whose event a connect storm pushed past it is not watched.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import socket
import struct
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

PEER_BYTES = 64 * 1024  # what one connection may send in its life
TOTAL_BYTES = 1024 * 1024  # what all live connections of one socket may have sent together
MAX_PEERS = 256  # connections to one socket
CHECK_INTERVAL = 0.05  # seconds between two looks at the kernel's counters
MONITOR_EVENTS_KEPT = 100_000  # connection events between two checks (a connect storm)
TRIM_DELAY = 0.5  # after a cut: libzmq frees the peer's pipe on its next turn, then trim

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_RECEIVED = struct.Struct("=Q")
_BYTES_RECEIVED_AT = 128  # struct tcp_info: tcpi_bytes_received (Linux >= 4.1)
_OPEN = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
_GONE = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


MALLOC_TRIM = _malloc_trim()


@dataclass
class Peer:
    fd: int
    names: tuple  # (sockname, peername) when it was accepted: the same socket if they still match
    since: float
    received: int = 0


def _dup(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=socket.dup(fd))
    except OSError:
        return None


def _names(s: socket.socket) -> tuple | None:
    try:
        return s.getsockname(), s.getpeername()
    except OSError:
        return None


def bytes_received(s: socket.socket) -> int | None:
    """What the kernel has received on this TCP connection (None: not TCP, or not Linux)."""
    if _TCP_INFO is None or s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _BYTES_RECEIVED_AT + 8:
        return None
    return _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0]


class PeerGuard:
    """Watches one socket's connections; `check()` from the thread that owns the socket."""

    def __init__(self, sock: zmq.Socket, peer_bytes: int = PEER_BYTES, total_bytes: int = TOTAL_BYTES,
                 max_peers: int = MAX_PEERS, interval: float = CHECK_INTERVAL):
        self.sock = sock
        self.peer_bytes, self.total_bytes, self.max_peers = peer_bytes, total_bytes, max_peers
        self.interval = interval
        addr = f"inproc://kvplay-guard-{id(self):x}"
        sock.monitor(addr, _OPEN | _GONE)
        self._mon = sock.context.socket(zmq.PAIR)
        self._mon.setsockopt(zmq.RCVHWM, MONITOR_EVENTS_KEPT)  # libzmq drops events past it
        self._mon.connect(addr)
        self._peers: dict[int, Peer] = {}
        self._next = 0.0
        self._trim_at = None
        self.cut = 0  # connections cut, all reasons
        self.cut_bytes = 0  # bytes those had sent
        self.trims = 0  # heap trims done after cuts

    @property
    def peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)

    def check(self, now: float | None = None) -> int:
        """Take the monitor's news, measure, cut what is over budget; returns how many were cut.
        Does nothing more often than every `interval` seconds."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return 0
        self._next = now + self.interval
        self._events(now)
        cut = self._measure_and_cut()
        if cut:
            self._trim_at = now + TRIM_DELAY
        elif self._trim_at is not None and now >= self._trim_at:
            self._trim_at = None
            try:
                self.sock.getsockopt(zmq.EVENTS)  # lets libzmq finish the cut pipes first
            except zmq.ZMQError:
                pass
            if MALLOC_TRIM is not None:
                MALLOC_TRIM(0)
            self.trims += 1
        return cut

    def _events(self, now: float) -> None:
        while True:
            try:
                ev = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError, IndexError, struct.error):
                continue
            fd = ev.get("value")
            if not isinstance(fd, int) or fd < 0:
                continue
            if ev["event"] & _GONE:
                self._peers.pop(fd, None)
                continue
            s = _dup(fd)
            if s is None:
                continue
            with s:
                names = _names(s)
            if names is not None:
                self._peers[fd] = Peer(fd, names, now)

    def _measure_and_cut(self) -> int:
        live: list[tuple[Peer, socket.socket]] = []
        for peer in list(self._peers.values()):
            s = _dup(peer.fd)
            if s is None or _names(s) != peer.names:  # closed by libzmq, the number maybe reused
                if s is not None:
                    s.close()
                self._peers.pop(peer.fd, None)
                continue
            n = bytes_received(s)
            peer.received = peer.received if n is None else n
            live.append((peer, s))
        over = {id(p) for p, _ in live if p.received > self.peer_bytes}
        rest = sorted((p for p, _ in live if id(p) not in over), key=lambda p: p.received, reverse=True)
        total = sum(p.received for p in rest)
        for p in rest:
            if total <= self.total_bytes:
                break
            over.add(id(p))
            total -= p.received
        newest = sorted((p for p, _ in live if id(p) not in over), key=lambda p: p.since)
        for p in newest[self.max_peers:]:
            over.add(id(p))
        cut = 0
        for peer, s in live:
            if id(peer) in over:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._peers.pop(peer.fd, None)
                self.cut += 1
                self.cut_bytes += peer.received
                cut += 1
            s.close()
        return cut
