"""wire/zmq_guard.py: per-connection budgets on a real ZMQ PUB over loopback TCP."""
from __future__ import annotations

import os
import socket
import sys

import pytest
import zmq

from support.wait import wait_for

from kvplay.wire.zmq_guard import PeerGuard, bytes_received

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO byte counts are Linux's")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def pub_with_guard(ctx, **budgets):
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    guard = PeerGuard(pub, interval=0, **budgets)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    return pub, guard, f"tcp://127.0.0.1:{port}"


def peer(ctx, endpoint, subs=0):
    """An XSUB that sends `subs` distinct subscriptions; returns it and a monitor for its
    disconnection (reconnection off: a cut peer stays cut)."""
    s = ctx.socket(zmq.XSUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 600_000)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(endpoint)
    for i in range(subs):
        s.send(b"\x01" + b"topic-%08d" % i)
    return s, mon


def settle(guard, until, timeout=10.0):
    """until() once it holds, the guard taking its news and measuring before each look."""
    return wait_for(until, timeout, before=guard.check)


def test_counts_what_the_kernel_received():
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    try:
        cli.sendall(b"x" * 5000)
        wait_for(lambda: bytes_received(conn) == 5000, 5)
        assert bytes_received(conn) == 5000
    finally:
        for s in (cli, conn, srv):
            s.close()


def test_a_peer_over_its_byte_budget_is_cut_and_the_others_stay(ctx):
    pub, guard, ep = pub_with_guard(ctx, peer_bytes=16 * 1024)
    quiet, quiet_gone = peer(ctx, ep, subs=1)
    assert settle(guard, lambda: guard.peers == 1)
    loud, loud_gone = peer(ctx, ep, subs=5000)  # ~80 kB of subscriptions
    assert settle(guard, lambda: guard.cut == 1)
    assert loud_gone.poll(5000)
    assert not quiet_gone.poll(200)
    assert guard.peers == 1 and guard.cut_bytes > 16 * 1024


def test_over_the_total_budget_the_largest_is_cut_first(ctx):
    pub, guard, ep = pub_with_guard(ctx, peer_bytes=1 << 20, total_bytes=40 * 1024)
    small, small_gone = peer(ctx, ep, subs=1000)  # ~16 kB each
    big, big_gone = peer(ctx, ep, subs=2000)  # ~32 kB
    assert settle(guard, lambda: guard.cut == 1)
    assert big_gone.poll(5000)
    assert not small_gone.poll(200)


def test_connections_past_the_cap_are_cut_newest_first(ctx):
    pub, guard, ep = pub_with_guard(ctx, max_peers=2)
    peers = []
    for _ in range(4):
        peers.append(peer(ctx, ep))
        assert settle(guard, lambda: guard.peers + guard.cut == len(peers))
    assert settle(guard, lambda: guard.cut == 2)
    gone = [mon.poll(2000 if i >= 2 else 200) for i, (_, mon) in enumerate(peers)]
    assert gone == [False, False, True, True]


def test_a_descriptor_that_is_no_longer_the_connection_is_left_alone(ctx):
    """libzmq may close a connection and the number be reused before the monitor says so: the
    guard touches a descriptor only while its addresses are those it saw at accept."""
    pub, guard, ep = pub_with_guard(ctx, peer_bytes=1024)
    p, gone = peer(ctx, ep)
    assert settle(guard, lambda: guard.peers == 1)
    (rec,) = guard._peers.values()
    rec.names = (("127.0.0.1", 1), ("127.0.0.1", 2))  # as if the number now held another socket
    for i in range(1000):
        p.send(b"\x01" + b"topic-%08d" % i)
    with socket.socket(fileno=os.dup(rec.fd)) as conn:  # they reached the kernel: a guard that measured would cut
        wait_for(lambda: (bytes_received(conn) or 0) > 1024, 10)
    guard.check()
    assert guard.cut == 0 and guard.peers == 0
    assert not gone.poll(300)
