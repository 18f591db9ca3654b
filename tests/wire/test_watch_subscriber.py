"""The KV-event subscriber against a real ZMQ publisher (vLLM's semantics, wire/publisher.py) on
loopback: late join, gaps filled by replay in seq order, restarts, bind mode, lost batches."""
from __future__ import annotations

import contextlib
import time

import pytest
import zmq

from support.watch import restart
from support.wait import wait_for

from kvplay.wire.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WireError
from kvplay.wire.mirror import Fleet
from kvplay.wire.translate import SOMEONE_ELSE
from kvplay.wire.publisher import ZmqEventPublisher
from kvplay.wire.subscriber import PodSource, Subscriber

BS = 4


def stored(hashes, parent=None, session="alice"):
    return BlockStored(list(hashes), parent, list(range(BS * len(hashes))), BS, None, "GPU", None,
                       session_id=session)


def pump(sub, until, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sub.poll(20)
        if until():
            return
    raise AssertionError(f"timed out; states={sub.states()}")


def publish(pub, *events):
    pub.publish(EventBatch(time.time(), list(events)))


def sent(pub, n, timeout=10.0):
    """Wait until the publisher's thread has sent seq n - 1: `publish` only queues, so a target
    taken from `pub.next_seq` before that may be met by an early seq (a busy box lags)."""
    wait_for(lambda: pub.next_seq >= n, timeout, f"the publisher to send seq {n - 1}", poll=0.005)
    return n


@pytest.fixture
def publisher():
    pubs = []

    def make(endpoint="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*", topic="kv-events"):
        p = ZmqEventPublisher(endpoint, replay, topic=topic)
        pubs.append(p)
        return p

    yield make
    for p in pubs:
        p.shutdown()


def connect(pub, replay=True, **kw):
    src = PodSource("p", pub.endpoint, replay=pub.replay_endpoint if replay else None, topic="kv-events")
    return Subscriber([src], Fleet(), **kw).open()


def test_late_join_replays_from_zero(publisher):
    pub = publisher()
    for i in range(5):  # published before anyone listens: only a replay can bring them
        publish(pub, stored([100 + i], parent=None if i == 0 else 99 + i))
    sent(pub, 5)  # sent (to nobody) before we connect
    with connect(pub) as sub:
        m = sub.fleet.pod("p")
        # keep publishing until the subscription is up; the first live seq > 0 triggers a replay
        n = 5
        while m.last_seq < 0:
            publish(pub, stored([100 + n], parent=99 + n))
            n += 1
            pump_for(sub, 0.05)
        pump(sub, lambda: m.last_seq == n - 1 and sub.states()["p"] == "live")
        assert set(m.blocks) == {100 + i for i in range(n)}
        assert m.replayed >= 5 and m.gaps == 0 and m.stored == n


def pump_for(sub, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sub.poll(10)


def _sync(pub, sub, m):
    """Publish markers until the subscriber applies one (slow-joiner safe)."""
    k = 0
    while m.last_seq < 0:
        publish(pub, stored([10_000 + k]))
        k += 1
        pump_for(sub, 0.05)
    target = pub.next_seq - 1
    pump(sub, lambda: m.last_seq >= target and sub.states()["p"] == "live")


def test_gap_replay_never_resurrects_a_removed_block(publisher):
    pub = publisher()
    applied = []
    with connect(pub, on_batch=lambda pod, seq, b, r: applied.append((seq, r))) as sub:
        m = sub.fleet.pod("p")
        _sync(pub, sub, m)
        s0 = pub.next_seq
        # Stored(A) is lost in transit; the live Removed(A) after it reveals the gap. A consumer
        # that applied the live Removed(A) first and the replayed Stored(A) after would keep A.
        sub.drop_live("p", [s0])
        publish(pub, stored([7]))
        publish(pub, BlockRemoved([7], "GPU"))
        publish(pub, stored([8]))
        pump(sub, lambda: m.last_seq == s0 + 2 and sub.states()["p"] == "live")
        assert 7 not in m.blocks and 8 in m.blocks
        assert m.gaps == 1 and m.replayed >= 2
        seqs = [s for s, _ in applied]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))  # in order, no duplicates
        assert m.by_session["alice"] == len(m.blocks)


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_restart_clears_the_pod(publisher, mode, tmp_path, free_port):
    restarts = []
    fleet = Fleet()
    rep = f"tcp://127.0.0.1:{free_port()}"
    if mode == "bind":  # vLLM with a non-wildcard endpoint connects to us
        sub = Subscriber([PodSource("p", "tcp://127.0.0.1:*", bind=True, replay=rep, topic="kv-events")], fleet,
                         on_restart=lambda pod, batch: restarts.append(pod)).open()
        ep = sub.endpoint("p")
        pub = publisher(ep, rep)
    else:  # the publisher binds (ipc: a fixed address the restarted publisher binds again)
        ep = f"ipc://{tmp_path}/kv.sock"
        pub = publisher(ep, rep)
        sub = Subscriber([PodSource("p", ep, replay=rep, topic="kv-events")], fleet,
                         on_restart=lambda pod, batch: restarts.append(pod)).open()
    try:
        m = fleet.pod("p")
        _sync(pub, sub, m)
        n = pub.next_seq + 5
        for i in range(5):
            publish(pub, stored([200 + i]))
        sent(pub, n)
        pump(sub, lambda: m.last_seq == pub.next_seq - 1)
        assert 204 in m.blocks
        pub.shutdown()
        pump(sub, lambda: sub.states()["p"] == "stale")  # the monitor saw the peer leave
        pub2 = restart(publisher, ep, rep)
        end = time.monotonic() + 10
        while m.restarts == 0 and time.monotonic() < end:
            publish(pub2, stored([300]))
            pump_for(sub, 0.05)
        assert m.restarts == 1, sub.pod_info("p")
        pump(sub, lambda: sub.states()["p"] == "live" and 300 in m.blocks and m.last_seq == pub2.next_seq - 1)
        assert restarts == ["p"]
        assert set(m.blocks) == {300}  # the old publisher's cache is gone, the new one's is whole
    finally:
        sub.close()


def test_bind_mode_publisher_connects(publisher):
    fleet = Fleet()
    with Subscriber([PodSource("b", "tcp://127.0.0.1:*", bind=True, topic="kv-events")], fleet) as sub:
        ep = sub.endpoint("b")
        assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith("*")
        pub = publisher(ep, None)  # not a wildcard: vLLM's PUB connects
        assert not pub.binds
        m = fleet.pod("b")
        while m.last_seq < 0:
            publish(pub, stored([1]))
            pump_for(sub, 0.05)
        publish(pub, AllBlocksCleared())
        pump(sub, lambda: m.cleared >= 1)
        assert m.blocks == {}


def test_gap_without_replay_counts_lost_and_goes_stale_until_cleared(publisher):
    pub = publisher(replay=None)
    with connect(pub, replay=False) as sub:
        m = sub.fleet.pod("p")
        k = 0
        while m.last_seq < 0:
            publish(pub, stored([10_000 + k]))
            k += 1
            pump_for(sub, 0.05)
        pump(sub, lambda: m.last_seq == pub.next_seq - 1)
        was_incomplete = sub.states()["p"]  # may be stale already if the first batches were missed
        s0 = pub.next_seq
        sub.drop_live("p", [s0, s0 + 1])
        for i in range(3):
            publish(pub, stored([500 + i]))
        pump(sub, lambda: m.last_seq == s0 + 2)
        assert m.gaps == 1 and m.lost >= 2 and sub.states()["p"] == "stale"
        publish(pub, AllBlocksCleared())
        pump(sub, lambda: m.last_seq == s0 + 3)
        assert sub.states()["p"] == "live" and m.blocks == {}
        assert was_incomplete in ("live", "stale")


def test_topic_filter(publisher):
    pub = publisher(topic="other")
    src = PodSource("p", pub.endpoint, topic="kv-events")
    with Subscriber([src], Fleet()) as sub:
        for _ in range(20):
            publish(pub, stored([1]))
            pump_for(sub, 0.02)
        assert sub.fleet.pod("p").batches == 0 and sub.states()["p"] == "waiting"


@pytest.mark.parametrize("ep", ["localhost:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "http://x:1"])
def test_bad_endpoints_are_one_line(ep):
    with pytest.raises(WireError) as exc:
        Subscriber([PodSource("p", ep)]).open()
    assert "\n" not in str(exc.value) and "--events" in str(exc.value)


def test_bind_conflict_is_one_line():
    with Subscriber([PodSource("a", "tcp://127.0.0.1:*", bind=True)]) as a:
        ep = a.endpoint("a")
        with pytest.raises(WireError, match="--events-bind"):
            Subscriber([PodSource("b", ep, bind=True)]).open()


def test_two_pods_keep_their_own_seq(publisher):
    p1, p2 = publisher(), publisher()
    srcs = [PodSource("one", p1.endpoint, replay=p1.replay_endpoint, topic="kv-events"),
            PodSource("two", p2.endpoint, replay=p2.replay_endpoint, topic="kv-events")]
    with Subscriber(srcs, Fleet()) as sub:
        m1, m2 = sub.fleet.pod("one"), sub.fleet.pod("two")
        while m1.last_seq < 0 or m2.last_seq < 0:
            publish(p1, stored([1], session="a"))
            publish(p2, stored([2], session=None))
            pump_for(sub, 0.05)
        pump(sub, lambda: m1.last_seq == p1.next_seq - 1 and m2.last_seq == p2.next_seq - 1)
        assert set(m1.blocks) == {1} and set(m2.blocks) == {2}
        assert m2.blocks[2].creator == SOMEONE_ELSE
        assert sub.fleet.summary()["pods"]["one"]["by_session"] == {"a": 1}


@contextlib.contextmanager
def _publisher_gone(publisher, free_port):
    """A binding subscriber with replay that applied three batches of a publisher which then went
    away (the pod is stale): yields (sub, its mirror, endpoint, replay endpoint, last seq)."""
    rep = f"tcp://127.0.0.1:{free_port()}"
    fleet = Fleet()
    sub = Subscriber([PodSource("p", "tcp://127.0.0.1:*", bind=True, replay=rep, topic="kv-events")], fleet).open()
    try:
        ep = sub.endpoint("p")
        pub = publisher(ep, rep)
        m = fleet.pod("p")
        _sync(pub, sub, m)
        n = pub.next_seq + 3
        for i in range(3):
            publish(pub, stored([200 + i]))
        sent(pub, n)
        pump(sub, lambda: m.last_seq == n - 1)
        pub.shutdown()
        pump(sub, lambda: sub.states()["p"] == "stale")
        yield sub, m, ep, rep, m.last_seq
    finally:
        sub.close()


def test_restarted_publisher_already_past_our_seq_is_still_a_restart(publisher, free_port):
    """A new publisher whose seq has already passed ours looks like a gap to a seq-only consumer
    (it would keep the dead server's blocks). On reconnect the subscriber asks for its last seq
    and compares the payload: a different batch means a restart."""
    with _publisher_gone(publisher, free_port) as (sub, m, ep, rep, old_last):
        pub2 = restart(publisher, ep, rep)
        for i in range(old_last + 4):  # the new server is already past our seq when we see it
            publish(pub2, stored([900 + i]))
        # pub2.next_seq is only final once its thread sent them all: a target read earlier was met
        # by seq 2 on a busy box and the assert below then missed 903.. (a test race)
        sent(pub2, old_last + 4)
        pump(sub, lambda: m.restarts == 1 and m.last_seq == pub2.next_seq - 1 and sub.states()["p"] == "live")
        assert set(m.blocks) == {900 + i for i in range(old_last + 4)}  # nothing of the old server


def test_restarted_publishers_batch_before_its_connect_event_is_verified_first(publisher, free_port):
    """The interleaving a busy box can produce: a restarted publisher's live batch (beyond our
    last seq) is read before the monitor's CONNECTED event is handled. Taken as a gap, it used to
    start a replay from last applied + 1 that applied the new server's batches as the old one's
    continuation (and the connect-verify was skipped while that replay ran): old blocks kept, no
    restart seen. It must verify our last batch first. Driven deterministically by holding the
    monitor's events back until the live batch was handled."""
    with _publisher_gone(publisher, free_port) as (sub, m, ep, rep, old_last):
        pod = sub._pods["p"]
        monitor, pod.monitor = pod.monitor, None  # hold the new peer's CONNECTED back
        sub._poller.unregister(monitor)
        pub2 = restart(publisher, ep, rep)
        for i in range(old_last + 4):
            publish(pub2, stored([900 + i]))
        k = sent(pub2, old_last + 4)
        # the first live seq we hear is past ours (the slow-joiner drops the first ones)
        info = sub.pod_info("p")
        while sub.pod_info("p")["last_live"] == info["last_live"]:
            publish(pub2, stored([900 + k]))
            k += 1
            pump_for(sub, 0.05)
        k = sent(pub2, k)
        pump(sub, lambda: m.restarts == 1 and m.last_seq == k - 1 and sub.pod_info("p")["buffered"] == 0)
        assert set(m.blocks) == {900 + i for i in range(k)}  # nothing of the old server, nothing lost
        pod.monitor = monitor  # the CONNECTED now: a verify that finds the same publisher
        sub._poller.register(monitor, zmq.POLLIN)
        pump(sub, lambda: sub.states()["p"] == "live" and m.last_seq == k - 1)
        assert m.restarts == 1 and set(m.blocks) == {900 + i for i in range(k)}
