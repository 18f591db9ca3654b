"""Knowing when a ZMQ SUB's subscription has reached its publisher, instead of sleeping.

PUB/SUB drops what is published before the subscription arrives (ZeroMQ's "slow joiner"). A
SUB sends its subscriptions the moment its ZMTP handshake with the PUB completes, so the
handshake is the readiness signal: `Handshakes(sock)` (opened *before* the socket connects or
binds) reports each completed or failed handshake from a socket monitor. What is left after
`wait()` returns is the loopback hop of a few bytes the PUB reads before its next send,
against the milliseconds the request that makes the next batch takes.

Where the test holds the publisher, it can also publish probe batches until the SUB sees one
(`wait_for(..., before=publish_probe)`); a handshake is the signal where a probe would change
what the test checks (seqs counted from 0).
"""
from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class Handshakes:
    """A monitor on `sock` counting its completed (`ok`) and refused (`failed`) handshakes."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
        self.ok = self.failed = 0

    def _take(self, timeout: float) -> None:
        if self.mon.poll(int(timeout * 1000)):
            ev = recv_monitor_message(self.mon)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.ok += 1
            elif ev & FAILED:
                self.failed += 1

    def wait(self, ok: int = 1, failed: int = 0, timeout: float = 10.0) -> "Handshakes":
        """Until `ok` handshakes have succeeded and `failed` been refused; AssertionError after `timeout` s."""
        end = time.monotonic() + timeout
        while self.ok < ok or self.failed < failed:
            left = end - time.monotonic()
            assert left > 0, (f"timed out after {timeout:g} s waiting for {ok} handshake(s) and {failed} refusal(s) "
                              f"on {self.sock.getsockopt_string(zmq.LAST_ENDPOINT) or 'a socket'}: "
                              f"{self.ok} and {self.failed} so far")
            self._take(left)
        return self

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)


def subscribed(sock: zmq.Socket, endpoint: str, timeout: float = 10.0) -> zmq.Socket:
    """`sock` (a SUB with its subscriptions set) connected to `endpoint`, once its handshake with
    the publisher there has completed (its subscriptions are on their way)."""
    hs = Handshakes(sock)
    try:
        sock.connect(endpoint)
        hs.wait(timeout=timeout)
    finally:
        hs.close()
    return sock
