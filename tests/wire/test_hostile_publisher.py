"""The subscriber and `kvplay watch` against a hostile publisher on loopback (issue #21): real ZMQ
PUB and replay ROUTER sockets driven frame by frame, so every malformed, lying or flooding
message can be sent. Each case failed before the fix: a traceback, a dead loop, a wedge, an
endless replay, a restart taken from a stray frame, or a summary that hid why."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from support.wait import wait_for

from kvplay.wire.codec import BlockStored, EventBatch, encode_batch, end_marker_frames, pack_seq
from kvplay.wire.mirror import Fleet
from kvplay.wire.subscriber import (MAX_BUFFERED, MAX_MESSAGE_BYTES, MAX_REPLAY_RETRIES, RCV_HWM, PodSource,
                                    Subscriber)

BS = 2
TOPIC = b"kv"


def good(h, parent=None, session="alice") -> bytes:
    return encode_batch(EventBatch(1.0, [BlockStored([h], parent, [1, 2], BS, None, "GPU", None,
                                                     session_id=session)]))


def raw_batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events)], use_bin_type=True)


def ev(**kw) -> dict:
    d = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    d.update(kw)
    return d


class Hostile:
    """A PUB and a replay ROUTER on 127.0.0.1 that send exactly the frames a test gives."""

    def __init__(self, replay: bool = True, answer=None, silent: bool = False):
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[int] = []
        self.answer = answer or (lambda start: [])  # start seq -> list of (seq, payload) before the marker
        self.replay_endpoint = None
        self.silent = silent  # take replay requests, never answer
        self._stop = threading.Event()
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, _, seq8 = self.router.recv_multipart()
            start = int.from_bytes(seq8, "big", signed=True)
            self.requests.append(start)
            if self.silent:
                continue
            for seq, payload in self.answer(start):
                self.router.send_multipart([ident, b"", TOPIC, pack_seq(seq), payload])
            self.router.send_multipart([ident, b""] + end_marker_frames(TOPIC))

    def send(self, seq: int, payload: bytes):
        self.pub.send_multipart([TOPIC, pack_seq(seq), payload])

    def frames(self, *frames):
        self.pub.send_multipart(list(frames))

    def close(self):
        self._stop.set()
        if self.replay_endpoint:
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def hostile():
    made = []

    def make(**kw):
        h = Hostile(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def subscribe(h: Hostile, topic="kv", replay_timeout=2.0, **kw) -> Subscriber:
    return Subscriber([PodSource("p", h.endpoint, replay=h.replay_endpoint, topic=topic)], Fleet(),
                      replay_timeout=replay_timeout, **kw).open()


def pump(sub, until, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sub.poll(20)
        if until():
            return
    raise AssertionError(f"timed out: {sub.pod_info('p')}")


def pump_for(sub, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sub.poll(10)


def joined(h: Hostile, sub: Subscriber):
    """Send seq 0 until the subscriber has applied it (slow joiner) and settled live."""
    m = sub.fleet.pod("p")
    end = time.monotonic() + 20
    while m.last_seq < 0:
        assert time.monotonic() < end, sub.pod_info("p")
        h.send(0, good(1000))
        pump_for(sub, 0.05)
    pump(sub, lambda: sub.states()["p"] == "live")
    return m


def live_after(h, sub, seq, h_block):
    """Send `seq` until it is applied; True once the mirror holds its block."""
    m = sub.fleet.pod("p")
    end = time.monotonic() + 20
    while h_block not in m.blocks:
        assert time.monotonic() < end, sub.pod_info("p")
        h.send(seq, good(h_block))
        pump_for(sub, 0.05)


# --- 1. wrongly typed fields are rejected at decode, counted, skipped -------------------------
@pytest.mark.parametrize("bad", [
    ev(block_hashes=[[1, 2]]), ev(block_hashes=[{"x": 1}]), ev(block_size="4"), ev(token_ids=7),
    ev(session_id=["alice"]), ev(session_id=5), ev(session_id="s" * (10 << 20)),
    ev(parent_block_hash={"a": 1}), {"type": "BlockRemoved", "block_hashes": [[7]], "medium": "GPU"},
])
def test_a_wrongly_typed_event_never_reaches_the_mirror(hostile, bad):
    h = hostile()
    with subscribe(h) as sub:
        m = joined(h, sub)
        h.send(1, raw_batch(ev(block_hashes=[5]), bad))
        pump(sub, lambda: sub.pod_info("p")["last_applied"] == 1)
        info = sub.pod_info("p")
        assert info["bad_events"] == 1 and info["state"] == "stale"  # counted, and said
        assert 5 in m.blocks and 7 not in m.blocks                    # the good event of the batch kept
        assert all(isinstance(k, int) for k in m.blocks)
        assert all(isinstance(s, str) and len(s) < 1000 for s in m.by_session)
        # the loop is alive: the next batch applies; a clear makes the mirror exact again
        h.send(2, raw_batch({"type": "AllBlocksCleared"}))
        pump(sub, lambda: sub.states()["p"] == "live")
        assert m.summary()["blocks"] == 0


def test_a_batch_that_is_not_msgpack_is_counted_and_not_silent(hostile):
    h = hostile(replay=False)
    with subscribe(h) as sub:
        joined(h, sub)
        h.send(1, b"\xc1\xc1garbage")
        h.send(2, good(2))
        pump(sub, lambda: sub.pod_info("p")["last_applied"] == 2)
        info = sub.pod_info("p")
        assert info["bad_payloads"] == 1 and info["lost"] == 1 and info["state"] == "stale"


# --- 2. a replay that brings nothing new is given up ------------------------------------------
@pytest.mark.parametrize("answer", ["nothing", "old"])
def test_a_replay_that_brings_nothing_new_gives_up(hostile, answer):
    """The publisher answers every replay with only the end marker (or only what we have): asked
    a bounded number of times, then the hole counts as lost and live batches apply again."""
    h = hostile(answer=(lambda start: []) if answer == "nothing" else (lambda start: [(0, good(1000))]))
    with subscribe(h) as sub:
        m = joined(h, sub)
        asked = len(h.requests)
        live_after(h, sub, 5, 5)   # seqs 1-4 never come: a gap, a replay that brings nothing
        pump_for(sub, 0.5)
        live_after(h, sub, 6, 6)   # and the stream goes on
        assert len(h.requests) - asked <= MAX_REPLAY_RETRIES + 1
        info = sub.pod_info("p")
        assert info["lost"] == 4 and info["state"] == "stale" and m.gaps >= 1


# --- 3. seqs are not trusted ------------------------------------------------------------------
@pytest.mark.parametrize("replay", [True, False])
def test_a_seq_far_ahead_never_wedges(hostile, replay):
    h = hostile(replay=replay)
    with subscribe(h) as sub:
        m = joined(h, sub)
        h.send(1, good(1))
        h.send(2**63 - 1, good(666))
        live_after(h, sub, 2, 2)   # later live batches still apply
        live_after(h, sub, 3, 3)
        assert 666 not in m.blocks and m.restarts == 0
        assert sub.pod_info("p")["lost"] == 1


def test_a_two_frame_message_is_not_a_restart(hostile):
    h = hostile()
    with subscribe(h) as sub:
        m = joined(h, sub)
        live_after(h, sub, 1, 1)
        h.frames(TOPIC.ljust(8, b"\0"), good(99))   # an 8-byte topic read as a seq would go backwards
        live_after(h, sub, 2, 2)
        assert m.restarts == 0 and {1000, 1, 2} <= set(m.blocks) and 99 not in m.blocks
        assert sub.pod_info("p")["bad_payloads"] == 1


@pytest.mark.parametrize("frames", [
    lambda: [b"", TOPIC, pack_seq(1), good(50)],      # a replay answer (4 frames)
    lambda: [pack_seq(1), good(50)],                   # a replay answer without delimiter or topic
    lambda: [TOPIC, b"\xff" * 8, b""],                 # the end marker
    lambda: [TOPIC, pack_seq(1), good(50), b"x"],      # one frame too many
])
def test_replay_shaped_messages_on_the_live_socket_are_rejected(hostile, frames):
    h = hostile(replay=False)
    with subscribe(h, topic="") as sub:  # every message reaches it, whatever its first frame
        m = joined(h, sub)
        h.frames(*frames())
        live_after(h, sub, 1, 1)
        assert 50 not in m.blocks and m.restarts == 0 and sub.pod_info("p")["bad_payloads"] >= 1


def test_live_batches_held_during_a_silent_replay_are_bounded(hostile):
    """A replay ROUTER that takes the request and never answers, while live batches keep coming:
    at most MAX_BUFFERED are held, then the replay is abandoned (the hole counts as lost) and the
    stream applies on."""
    h = hostile()
    with subscribe(h, replay_timeout=600) as sub:  # only the cap can end this replay
        m = joined(h, sub)
        h.silent = True
        h.send(2, good(2))  # seq 1 never comes: a gap, a replay nobody answers
        pump(sub, lambda: sub.pod_info("p")["state"] == "replaying")
        most = 0
        seq = 3
        end = time.monotonic() + 120
        while m.last_seq < MAX_BUFFERED:
            assert time.monotonic() < end, sub.pod_info("p")
            for _ in range(200):
                h.send(seq, good(seq))
                seq += 1
            sub.poll(5)
            most = max(most, sub.pod_info("p")["buffered"])
        assert most <= MAX_BUFFERED
        info = sub.pod_info("p")
        assert info["lost"] == 1 and info["state"] != "replaying" and 2 in m.blocks


# --- 4/5. bounded sizes and queues; the clock is honoured under a flood ------------------------
def test_message_size_and_queue_are_bounded(hostile):
    h = hostile(replay=False)
    with subscribe(h) as sub:
        pod = sub._pods["p"]
        for s in (pod.sub,):
            assert s.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
            assert s.getsockopt(zmq.RCVHWM) == RCV_HWM > 0
        m = joined(h, sub)
        big = raw_batch(ev(block_hashes=[77], ownership="x" * MAX_MESSAGE_BYTES))
        assert len(big) > MAX_MESSAGE_BYTES
        h.send(1, big)
        live_after(h, sub, 1, 1)  # ZeroMQ drops the oversized message's connection and reconnects
        assert 77 not in m.blocks


FLOOD = r"""
import sys, time, zmq
from kvplay.wire.codec import encode_frames, EventBatch, BlockStored
pub = zmq.Context.instance().socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind("tcp://127.0.0.1:*")  # a port the OS picks, told to the test on stdout
print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
ev = [BlockStored([i], None, [1, 2], 2, None, "GPU", None) for i in range(50)]
payload = encode_frames(b"", 0, EventBatch(1.0, ev))[2]
seq, end = 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(100):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
"""


def test_watch_duration_is_honoured_under_a_flood(tmp_path):
    """A publisher floods (50 events a batch, as fast as it can) for far longer than --duration:
    watch ends on its own, before the flood does, with its summary (and a bounded queue)."""
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, "120"], stdout=subprocess.PIPE, text=True)
    try:
        ep = flood.stdout.readline().strip()
        assert ep.startswith("tcp://127.0.0.1:"), ep
        r = subprocess.run([sys.executable, "-m", "kvplay", "watch", "--events", ep, "--duration", "3", "--json",
                            "--db", str(tmp_path / "w.db")], capture_output=True, text=True, timeout=110)
        assert flood.poll() is None  # the flood is still going: watch stopped on its clock
    finally:
        flood.kill()
        flood.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["summary"] and summary["pods"]


# --- 6. the summary says why; SIGTERM ends like Ctrl-C ---------------------------------------
def test_watch_summary_says_state_and_why_and_sigterm_prints_it(hostile, tmp_path):
    h = hostile(replay=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "kvplay", "watch", "--events", h.endpoint, "--topic", "kv",
                          "--json", "--db", str(tmp_path / "w.db")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    t.start()
    def seen(seq):
        assert p.poll() is None, lines
        return any(f'"seq": {seq}' in line for line in lines)

    try:
        # seq 0 again and again until watch shows it: its subscription is through
        wait_for(lambda: seen(0), 60, before=lambda: h.send(0, good(1000)), poll=0.1)
        h.send(1, raw_batch(ev(block_hashes=[5]), ev(session_id=["x"]), {"type": "SomethingNew"},
                            ev(block_hashes=[6], medium="CPU")))
        h.send(2, b"not msgpack")
        h.send(5, good(7))   # 3 and 4 are lost (no replay endpoint)
        wait_for(lambda: seen(5), 60, poll=0.05)
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    t.join(5)
    assert p.returncode == 0, p.stderr.read()
    s = json.loads(lines[-1])["pods"][h.endpoint[len("tcp://"):]]
    assert s["state"] == "stale"
    assert s["bad_events"] == 1 and s["unknown_events"] == 1 and s["other_medium"] == 1
    assert s["bad_payloads"] == 1 and s["lost"] == 3  # the undecodable batch and seqs 3-4
    assert s["blocks"] == 3  # 1000, 5, 7


def test_attach_status_shows_why_a_pod_is_stale(hostile):
    """In `kvplay attach` (RemoteBackend's subscriber thread) a bad event leaves the thread alive
    and the status panel names the counts behind the stale pod."""
    from kvplay.tui.attach import AttachCacheRoom
    from kvplay.wire.remote import RemoteBackend

    h = hostile(replay=False)
    backend = RemoteBackend("http://127.0.0.1:9", None, [PodSource("p", h.endpoint, topic="kv")], model="m",
                            slots=64)  # no HTTP: model and slots given
    def applied(seq):
        assert backend._thread.is_alive()
        return backend.fleet.pod("p").last_seq >= seq

    try:
        wait_for(lambda: applied(0), 20, before=lambda: h.send(0, good(1000)), poll=0.05)  # subscribed
        h.send(1, raw_batch(ev(block_size="4")))
        h.send(2, good(2))
        wait_for(lambda: applied(2), 20, poll=0.05)
        stats = backend.stats()
        assert stats["pods"]["p"] == "stale" and stats["pod_trouble"]["p"] == {"bad_events": 1}
        app = AttachCacheRoom.__new__(AttachCacheRoom)  # status_view reads only the backend
        app.backend = backend
        text = app.status_view(stats).plain
        assert "pod p stale" in text and "bad events 1" in text
    finally:
        backend.close()


# --- a consumer can wait until the join replay is over -------------------------------------------
@pytest.mark.parametrize("how", ["answered", "silent"])
def test_wait_joined_holds_until_the_join_replay_is_applied(hostile, how):
    """`attach` predicts a turn's cached tokens from the mirror; before the join replay is over the
    mirror lacks what the pod cached before we came, and a prediction said 0 where the server hit.
    wait_joined is False while the replay is asked and unanswered, True once the replayed blocks
    are in the mirror; a publisher that never answers ends the wait at the replay timeout."""
    go = threading.Event()

    def answer(start):
        go.wait(10)
        return [(0, good(1000))]

    h = hostile(answer=answer, silent=how == "silent")
    sub = subscribe(h, replay_timeout=1.0)
    loop = threading.Thread(target=sub.run, daemon=True)
    loop.start()
    try:
        assert not sub.wait_joined(0.5)
        assert h.requests == [0] and 1000 not in sub.fleet.pod("p").blocks
        go.set()
        assert sub.wait_joined(10)
        if how == "answered":
            assert 1000 in sub.fleet.pod("p").blocks and sub.states()["p"] == "live"
        else:
            assert 1000 not in sub.fleet.pod("p").blocks
    finally:
        sub.stop()
        loop.join(5)
        sub.close()
    h2 = hostile(replay=False)
    with subscribe(h2) as sub2:
        assert sub2.wait_joined(0)  # no replay endpoint: nothing to catch up on
