"""Subscribe to vLLM-format KV events from one or more pods and keep their mirrors exact.

One SUB socket per pod: `connect` to a publisher that binds (``--events``), or `bind` for a
publisher that connects (``--events-bind``; vLLM connects whenever its endpoint is not a wildcard).
Per pod the subscriber tracks the last applied seq and the last live seq and handles what the
ecosystem's consumers got wrong (vLLM's example subscriber never advances its last seq on live
batches, so its gap check cannot fire; llm-d-kv-cache's indexer keeps a last and a last-live seq
and clears a pod whose seq goes back; a replayed ``Stored(A)`` applied after a live ``Removed(A)``
brings A back, as the review of Mooncake PR #4159 found):

- **gap** (a live seq beyond last applied + 1): ask the pod's replay ROUTER through a DEALER for
  every batch from last applied + 1 (``[b"", seq8]``), read until the end marker (seq -1), and
  meanwhile *buffer* live batches; then apply the buffer in seq order, dropping what the replay
  already applied — so a replayed ``Stored(A)`` never resurrects a block a later live
  ``Removed(A)`` took away. Without a replay endpoint, or when the publisher no longer holds the
  missed batches, the batches are counted as lost and the pod shows *stale*.
- **join**: PUB/SUB drops what is published before our subscription reaches the publisher (a
  bound SUB subscribes a connecting publisher only while it is polled). So when a publisher
  connects (socket monitor) and a replay endpoint is known, replay from 0 at once; a first live
  seq > 0 does the same.
- **restart**: a live seq going backwards (or equal to the last one after the peer left) means
  the publisher restarted: clear that pod's mirror and follow the new one from its seq 0. A
  restarted publisher may already be *past* our seq when we hear it again, which a seq-only
  consumer takes for a gap; so after a reconnect we replay from our last applied seq and compare
  its payload with the one we applied: the same bytes, the same publisher; anything else, a restart.
  Nothing the peer sends after it left is applied before that check, whichever comes first: its
  CONNECTED event or its first live batch (a gap replay under way is abandoned for it).
- **reconnect**: ZeroMQ reconnects by itself (a short reconnect interval is set); the monitor
  notices the peer leaving, so the pod shows *stale* until it is back.
- Without heartbeats a lost batch shows only when a later one arrives: an idle server's last
  batch can be missing unnoticed until its next step.

Pod state: ``waiting`` (nothing yet), ``live``, ``replaying``, ``stale`` (peer gone, or the mirror
may miss batches; an ``AllBlocksCleared`` makes it exact again).

**A hostile publisher** cannot wedge, crash or flood it (tests/wire/test_hostile_publisher.py):
message size (``ZMQ_MAXMSGSIZE``) and receive queues (``RCVHWM``) are bounded; the live socket
takes only ``[topic, seq8, payload]`` (a 2-frame or replay-shaped message is a bad frame, never a
seq to act on); a live seq more than `MAX_SEQ_JUMP` past the last one is dropped as a lost batch
(never a wedge); a replay that brings nothing new is not asked again, and a hole is asked for at
most `MAX_REPLAY_RETRIES` times; live batches buffered during a replay are capped
(`MAX_BUFFERED`); a bad payload or a batch with bad events is counted (`pod_info`) and leaves the
pod *stale*, never a dead thread. Each `poll` reads at most `MAX_PER_POLL` messages per socket, so
a loop driving it sees the clock under any load.

Nothing here blocks for long: `poll(timeout_ms)` handles what is ready and returns, so a CLI loop
or an app worker thread can drive it; `fleet.lock` is held while a batch is applied, so a view on
another thread can read a consistent mirror by taking it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvplay.engine.events import AllBlocksCleared, EngineBatch

from .codec import WireError, decode_batch, parse_frames, replay_request, topic_bytes, unpack_seq
from .mirror import Fleet, Mirror
from .translate import FromWire

SCHEMES = ("tcp://", "ipc://", "inproc://")

MAX_MESSAGE_BYTES = 16 << 20  # ZMQ_MAXMSGSIZE: a bigger frame drops the connection (ZeroMQ reconnects)
RCV_HWM = 1000                # messages queued per socket before ZeroMQ drops (a gap, then a replay)
MAX_PER_POLL = 256            # messages read per socket per poll: the caller's loop sees the clock
MAX_BUFFERED = 10_000         # live batches held during a replay; more abandons the replay
MAX_REPLAY_RETRIES = 3        # asks for one hole before its batches count as lost
MAX_SEQ_JUMP = 1 << 20        # a live seq this far past the last one is a bad frame, not a gap
REDIAL_AFTER = 3.0            # seconds a connecting SUB waits for ZeroMQ's own reconnect
# Why a pod's mirror may be partial (pod_info keys; watch's summary and attach's status show them)
TROUBLE = ("lost", "bad_payloads", "bad_events", "unknown_events", "other_medium")


def parse_live(frames) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a live message: exactly ``[topic, seq8, payload]``, seq >= 0
    (replay-shaped or 2-frame messages, and the end marker, are not live batches)."""
    if len(frames) != 3:
        raise WireError(f"a live KV-event message has 3 frames, got {len(frames)}")
    topic, seq8, payload = frames
    seq = unpack_seq(seq8)
    if seq < 0:
        raise WireError("a live KV-event message with a negative seq")
    return bytes(topic), seq, payload


def check_endpoint(ep: str, flag: str = "--events") -> str:
    """Refuse an endpoint ZeroMQ would not take, with one line."""
    if not isinstance(ep, str) or not ep.startswith(SCHEMES):
        raise WireError(f"{flag} {ep!r}: give a ZeroMQ endpoint like tcp://127.0.0.1:5557")
    if ep.startswith("tcp://"):
        host, _, port = ep[len("tcp://"):].rpartition(":")
        if not host or not (port.isdigit() or port == "*"):
            raise WireError(f"{flag} {ep!r}: give host:port, like tcp://127.0.0.1:5557")
        if port.isdigit() and not 0 < int(port) < 65536:
            raise WireError(f"{flag} {ep!r}: port out of range")
    return ep


def default_pod_name(ep: str) -> str:
    for s in SCHEMES:
        if ep.startswith(s):
            return ep[len(s):]
    return ep


@dataclass
class PodSource:
    """Where one pod's events come from."""
    name: str
    endpoint: str
    bind: bool = False
    replay: str | None = None
    topic: str = ""
    curve: object = None  # wire.curve.ClientCurve: subscribe to a CURVE publisher with these keys


@dataclass
class _Pod:
    src: PodSource
    mirror: Mirror
    wire: FromWire              # the pod's wire batches -> engine batches (slots, attribution)
    sub: object = None
    dealer: object = None
    monitor: object = None
    last_applied: int = -1
    last_live: int = -1
    seen: bool = False
    connected: bool = False
    peer_left: bool = False     # a disconnect since the last live batch (a restart may follow)
    incomplete: bool = False    # batches were lost: the mirror may be wrong until a clear/restart
    replaying: bool = False
    replay_deadline: float = 0.0
    buffer: list = field(default_factory=list)
    last_payload: bytes = b""   # the last applied batch as sent: tells the same publisher from a new one
    verify: tuple | None = None  # (seq, payload) a reconnect replay must show first, else a restart
    drop: set = field(default_factory=set)  # test hook: live seqs to treat as lost in transit
    bad_payloads: int = 0       # frames or payloads that were not a KV-event batch
    bad_events: int = 0         # wrongly typed or oversized events skipped inside good batches
    unknown_events: int = 0     # events of a type we do not know (skipped)
    replay_start: int = -1      # last_applied when the replay under way was asked for
    replay_tries: int = 0       # asks in a row for the same hole
    replays_given_up: int = 0
    left_at: float = 0.0        # when the peer left (a connecting SUB is re-dialled if it stays away)
    mirror_s: float = 0.0       # seconds spent decoding, translating and applying its batches
    joined: threading.Event = field(default_factory=threading.Event)  # the join replay is over (or none)

    @property
    def state(self) -> str:
        if self.replaying:
            return "replaying"
        if not self.seen:
            return "waiting"
        if self.incomplete or self.peer_left:
            return "stale"
        return "live"


class Subscriber:
    """Drives the pods' sockets and applies their batches to `fleet` in seq order.

    on_batch(pod, seq, batch, replayed) is called after each applied batch (`batch`: the pod's
    wire batch as the `EngineBatch` its mirror applied, wire/translate.py) (the CLI prints it, the
    recorder writes it, attach's views read it); on_state(pod, state) when a pod changes state;
    on_restart(pod, batch) when a pod's publisher restarted (`batch`: the clear its mirror applied).
    """

    def __init__(self, sources: list[PodSource], fleet: Fleet | None = None, on_batch=None,
                 on_state=None, on_restart=None, replay_timeout: float = 3.0, context=None):
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise WireError(f"pod names must differ: {names}")
        self.sources = sources
        self.fleet = fleet if fleet is not None else Fleet()
        self.on_batch = on_batch
        self.on_state = on_state
        self.on_restart = on_restart
        self.replay_timeout = replay_timeout
        self._ctx = context or zmq.Context.instance()
        self._pods: dict[str, _Pod] = {}
        self._by_socket: dict = {}
        self._poller = zmq.Poller()
        self._stop = threading.Event()
        self._opened = False

    # --- sockets ------------------------------------------------------------------------------
    def open(self) -> "Subscriber":
        if self._opened:
            return self
        try:
            for src in self.sources:
                check_endpoint(src.endpoint, "--events-bind" if src.bind else "--events")
                if src.replay:
                    check_endpoint(src.replay, "--replay")
                pod = _Pod(src, self.fleet.pod(src.name), self.fleet.from_wire(src.name))
                self._pods[src.name] = pod
                self._open_sub(pod)
                if src.replay:
                    self._open_dealer(pod)
                else:
                    pod.joined.set()  # nothing to catch up on: the mirror starts from what comes live
        except BaseException:
            self.close()
            raise
        self._opened = True
        return self

    def _zmq_call(self, fn, ep: str, flag: str) -> None:
        try:
            fn(ep)
        except zmq.ZMQError as exc:
            raise WireError(f"{flag} {ep}: {exc.strerror or exc}") from None

    def _open_sub(self, pod: _Pod) -> None:
        src = pod.src
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)  # bounded: a flood past it is a gap (then a replay), not RAM
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, topic_bytes(src.topic))
        if src.curve is not None:
            src.curve.apply(sub)
        pod.sub = sub
        self._by_socket[sub] = (pod, "sub")
        pod.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._by_socket[pod.monitor] = (pod, "monitor")
        if src.bind:
            self._zmq_call(sub.bind, src.endpoint, "--events-bind")
        else:
            self._zmq_call(sub.connect, src.endpoint, "--events")
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(pod.monitor, zmq.POLLIN)

    def _open_dealer(self, pod: _Pod) -> None:
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, RCV_HWM)
        d.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        d.setsockopt(zmq.RECONNECT_IVL, 100)
        d.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if pod.src.curve is not None:
            pod.src.curve.apply(d)
        self._zmq_call(d.connect, pod.src.replay, "--replay")
        pod.dealer = d
        self._by_socket[d] = (pod, "dealer")
        self._poller.register(d, zmq.POLLIN)

    def _reset_dealer(self, pod: _Pod) -> None:
        """A fresh DEALER, so a late answer to an abandoned replay cannot be taken for a new one."""
        if pod.dealer is not None:
            self._poller.unregister(pod.dealer)
            self._by_socket.pop(pod.dealer, None)
            pod.dealer.close(0)
            pod.dealer = None
        self._open_dealer(pod)

    def close(self) -> None:
        # the SUB's monitor is stopped while its PAIR end is still open: libzmq sends that PAIR a
        # last event as it stops, and with the PAIR closed first that send was seen to hang close()
        for pod in self._pods.values():
            for name in ("sub", "monitor", "dealer"):
                s = getattr(pod, name)
                if s is None:
                    continue
                try:
                    if name == "sub":
                        s.disable_monitor()
                except zmq.ZMQError:
                    pass
                s.close(0)
                setattr(pod, name, None)
        self._by_socket.clear()
        self._poller = zmq.Poller()
        self._opened = False

    def __enter__(self) -> "Subscriber":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public view --------------------------------------------------------------------------
    def states(self) -> dict[str, str]:
        return {name: p.state for name, p in self._pods.items()}

    def wait_joined(self, timeout: float) -> bool:
        """Wait (up to `timeout` s in all) until every pod's join replay is over, answered or
        given up: before that, the mirror lacks what the pods cached before we came. True if all
        are."""
        end = time.monotonic() + timeout
        return all(p.joined.wait(max(0.0, end - time.monotonic())) for p in list(self._pods.values()))

    def pod_info(self, name: str) -> dict:
        p = self._pods[name]
        return {"state": p.state, "last_applied": p.last_applied, "last_live": p.last_live,
                "buffered": len(p.buffer), "lost": p.mirror.lost, "bad_payloads": p.bad_payloads,
                "bad_events": p.bad_events, "unknown_events": p.unknown_events,
                "other_medium": p.mirror.other_medium, "replays_given_up": p.replays_given_up,
                "mirror_s": p.mirror_s}

    def endpoint(self, pod: str) -> str:
        """The pod's SUB endpoint as bound or connected (a wildcard port resolved)."""
        p = self._pods[pod]
        ep = p.sub.getsockopt_string(zmq.LAST_ENDPOINT) if p.src.bind else ""
        return ep or p.src.endpoint

    def drop_live(self, pod: str, seqs) -> None:
        """Test hook: treat these live seqs of `pod` as lost in transit (forces a gap)."""
        self._pods[pod].drop.update(int(s) for s in seqs)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """`stop()` was called: `run` ends within one poll."""
        return self._stop.is_set()

    # --- the loop -----------------------------------------------------------------------------
    def run(self, duration: float | None = None, tick=None, tick_every: float = 1.0) -> None:
        """Poll until `stop()` or `duration` seconds; `tick()` is called about every `tick_every` s."""
        self.open()
        end = None if duration is None else time.monotonic() + duration
        next_tick = time.monotonic() + tick_every
        while not self._stop.is_set():
            now = time.monotonic()
            if end is not None and now >= end:
                break
            wait = 100 if end is None else max(0, min(100, int((end - now) * 1000)))
            self.poll(wait)
            if tick is not None and time.monotonic() >= next_tick:
                tick()
                next_tick = time.monotonic() + tick_every

    def poll(self, timeout_ms: int = 100) -> int:
        """Handle whatever is ready (waiting up to timeout_ms); returns how many batches applied."""
        applied = 0
        try:
            ready = self._poller.poll(timeout_ms)
        except zmq.ZMQError:
            ready = []
        for sock, _ in ready:
            entry = self._by_socket.get(sock)
            if entry is None:
                continue
            pod, kind = entry
            if kind == "monitor":
                self._on_monitor(pod)
                continue
            for _ in range(MAX_PER_POLL):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                if kind == "sub":
                    # A batch from a restarted publisher becomes readable only after its
                    # CONNECTED/ACCEPTED event (and the old peer's DISCONNECTED) was queued on the
                    # monitor: handle those first, so such a batch is never taken for the next one
                    # of the publisher that left.
                    if pod.monitor is not None and pod.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._on_monitor(pod)
                    applied += self._on_live(pod, frames)
                else:
                    applied += self._on_replay(pod, frames)
                    if pod.dealer is not sock:  # the replay finished and the DEALER was replaced
                        break
        now = time.monotonic()
        for pod in self._pods.values():
            if pod.replaying and now >= pod.replay_deadline:
                applied += self._finish_replay(pod, complete=False)
            if not pod.connected and pod.left_at and now - pod.left_at > REDIAL_AFTER and not pod.src.bind:
                self._redial(pod)
        return applied

    def _redial(self, pod: _Pod) -> None:
        """ZeroMQ does not reconnect after a protocol error (a message over MAX_MESSAGE_BYTES):
        dial again, so one oversized message costs a gap, not the pod."""
        pod.left_at = time.monotonic()
        ep = pod.src.endpoint
        try:
            pod.sub.disconnect(ep)
        except zmq.ZMQError:
            pass  # the session is already gone
        try:
            pod.sub.connect(ep)
        except zmq.ZMQError:
            pass

    # --- handlers -----------------------------------------------------------------------------
    def _set_state(self, pod: _Pod, before: str) -> None:
        after = pod.mirror.pod_state = pod.state
        if after != before and self.on_state is not None:
            self.on_state(pod.src.name, after)

    def _on_monitor(self, pod: _Pod) -> None:
        while True:
            try:
                msg = recv_monitor_message(pod.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            before = pod.state
            ev = msg["event"]
            if ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                pod.connected = True
                self._on_connect(pod)
            elif ev == zmq.EVENT_DISCONNECTED:
                pod.connected = False
                pod.left_at = time.monotonic()
                if pod.seen:
                    pod.peer_left = True
            self._set_state(pod, before)

    def _on_connect(self, pod: _Pod) -> None:
        """A publisher (re)connected. PUB/SUB drops what is sent before our subscription reaches
        it, and after a reconnect we may have missed batches or be facing a restarted publisher
        whose seq has already passed ours. With a replay endpoint, ask at once: from 0 when we
        have nothing; else from our last applied seq, whose payload must come back unchanged
        (the same publisher) — anything else means a restart."""
        if pod.dealer is None:
            return
        if pod.replaying and (pod.verify is not None or pod.last_applied < 0):
            return  # already verifying, or replaying from 0 (nothing to verify)
        if pod.last_applied < 0:
            self._start_replay(pod, 0)
        else:
            # A gap replay under way may be answered by the new publisher: verify first.
            self._begin_verify(pod)

    def _begin_verify(self, pod: _Pod) -> None:
        """Replay from our last applied seq, whose payload must come back unchanged before
        anything else of this publisher is applied. A replay under way (asked before the peer
        left, for a gap) is abandoned on a fresh DEALER; its buffered live batches stay buffered
        (kept if the publisher is the same, cleared with the mirror by `_restart` if not)."""
        if pod.replaying:
            self._reset_dealer(pod)
        pod.verify = (pod.last_applied, pod.last_payload)
        self._start_replay(pod, pod.last_applied)

    def _decode(self, pod: _Pod, payload: bytes):
        t = time.perf_counter()
        try:
            batch = decode_batch(payload)
        except WireError:
            pod.bad_payloads += 1
            return None
        finally:
            pod.mirror_s += time.perf_counter() - t
        pod.bad_events += batch.bad_events
        pod.unknown_events += batch.unknown_events
        return batch

    def _apply(self, pod: _Pod, seq: int, batch, replayed: bool, payload: bytes = b"") -> int:
        m = pod.mirror
        pod.last_payload = payload
        with self.fleet.lock:
            t = time.perf_counter()
            try:
                eb = pod.wire(batch, seq)
                m.apply(eb)
            except Exception:  # decode typed every field, so this is a bug: never the loop's death
                eb = EngineBatch(ts=batch.ts, wire_seq=seq)
                pod.bad_events += len(batch.events)
                pod.incomplete = True
            pod.mirror_s += time.perf_counter() - t
            if replayed:
                m.replayed += 1
        pod.last_applied = seq
        pod.seen = True
        if pod.incomplete and not pod.replaying and any(type(e) is AllBlocksCleared for e in eb.events):
            pod.incomplete = False  # the cache was reset: the mirror is exact again
        if batch.bad_events:
            pod.incomplete = True  # events were skipped: the mirror may miss blocks
        if self.on_batch is not None:
            self.on_batch(pod.src.name, seq, eb, replayed)
        return 1

    def _on_live(self, pod: _Pod, frames) -> int:
        try:
            _topic, seq, payload = parse_live(frames)
        except WireError:
            pod.bad_payloads += 1
            return 0
        if pod.drop and seq in pod.drop:
            pod.drop.discard(seq)
            return 0
        if (seq == pod.last_applied + 1 and seq > pod.last_live and pod.seen and not pod.replaying
                and not pod.peer_left):
            # the steady state: the next batch, in order (no state can change except via a clear)
            pod.last_live = seq
            pod.replay_tries = 0
            batch = self._decode(pod, payload)
            if batch is not None:
                before = pod.state
                self._apply(pod, seq, batch, False, payload)
                if pod.state != before:
                    self._set_state(pod, before)
                return 1
            before = pod.state
            self._apply_or_skip(pod, seq, None, False, payload)
            self._set_state(pod, before)
            return 0
        before = pod.state
        if pod.last_live >= 0 and not pod.peer_left and seq > pod.last_live + MAX_SEQ_JUMP:
            # No publisher skips a million batches while connected: a bogus seq. Taking it would
            # make every later batch look old (a wedge, or a restart a batch): drop it as lost.
            pod.bad_payloads += 1
            pod.mirror.lost += 1
            pod.incomplete = True
            self._set_state(pod, before)
            return 0
        applied = 0
        if pod.last_live >= 0 and (seq < pod.last_live or (seq == pod.last_live and pod.peer_left)
                                   or seq + MAX_SEQ_JUMP < pod.last_applied):
            # backwards: a restart (also when a bogus replay seq pushed last_applied far ahead)
            self._restart(pod)
        elif seq == pod.last_live:
            return 0  # a duplicate
        # The peer left since our last live batch and this one is further on: it may come from a
        # restarted publisher already past our seq. Never apply it (nor gap-replay from
        # last_applied + 1) as the old one's continuation before the replay of our last batch
        # says it is the same publisher.
        verify_first = (pod.peer_left and pod.last_applied >= 0 and pod.dealer is not None
                        and pod.verify is None)
        pod.last_live = seq
        pod.seen = True
        pod.peer_left = False
        batch = self._decode(pod, payload)
        if pod.replaying or verify_first:
            pod.buffer.append((seq, batch, payload))
            if verify_first:
                self._begin_verify(pod)
            elif len(pod.buffer) >= MAX_BUFFERED:  # a flood while the replay is slow: stop waiting
                applied += self._finish_replay(pod, complete=False)
        elif pod.last_applied < 0 and seq > 0 and pod.dealer is not None:
            pod.buffer.append((seq, batch, payload))   # joined late: catch up from the publisher's start
            self._start_replay(pod, 0)
        elif pod.last_applied < 0:
            if seq > 0:
                pod.incomplete = True  # joined late with no replay: earlier blocks are unknown
            applied += self._apply_or_skip(pod, seq, batch, False, payload)
        elif seq <= pod.last_applied:
            pass  # already applied (a replay got ahead of the live stream)
        elif seq == pod.last_applied + 1:
            applied += self._apply_or_skip(pod, seq, batch, False, payload)
        else:
            pod.mirror.gaps += 1
            if pod.dealer is not None:
                pod.buffer.append((seq, batch, payload))
                self._start_replay(pod, pod.last_applied + 1)
            else:
                pod.mirror.lost += seq - pod.last_applied - 1
                pod.incomplete = True
                applied += self._apply_or_skip(pod, seq, batch, False, payload)
        self._set_state(pod, before)
        return applied

    def _apply_or_skip(self, pod: _Pod, seq: int, batch, replayed: bool, payload: bytes = b"") -> int:
        if batch is None:  # undecodable: its events are lost, later seqs still apply in order
            pod.last_applied = seq
            pod.last_payload = payload
            pod.mirror.lost += 1
            pod.incomplete = True
            return 0
        return self._apply(pod, seq, batch, replayed, payload)

    def _restart(self, pod: _Pod) -> None:
        with self.fleet.lock:
            cleared = pod.wire.restart()
            pod.mirror.apply(cleared)
        pod.last_applied = -1
        pod.last_live = -1
        pod.incomplete = False
        pod.peer_left = False  # the publisher that left is known to be gone: its successor is followed
        pod.verify = None
        pod.last_payload = b""
        pod.buffer.clear()
        if pod.replaying:
            pod.replaying = False
            self._reset_dealer(pod)
        if self.on_restart is not None:
            self.on_restart(pod.src.name, cleared)

    def _start_replay(self, pod: _Pod, start: int) -> None:
        pod.replaying = True
        pod.replay_start = pod.last_applied
        pod.replay_deadline = time.monotonic() + self.replay_timeout
        try:
            pod.dealer.send_multipart(replay_request(start), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not connected yet: the deadline ends the attempt

    def _on_replay(self, pod: _Pod, frames) -> int:
        if not pod.replaying:
            return 0  # an answer nobody waits for
        try:
            _topic, seq, payload = parse_frames(frames)
        except WireError:
            pod.bad_payloads += 1
            return 0
        if pod.verify is not None:
            want_seq, want_payload = pod.verify
            pod.verify = None
            if seq != want_seq or payload != want_payload:
                # not the publisher we were following: it restarted while we were away
                before = pod.state
                self._restart(pod)
                self._start_replay(pod, 0)
                self._set_state(pod, before)
                return 0
            pod.peer_left = False  # the same publisher is back
            if seq >= 0:
                return 0  # our last batch, as applied: the same publisher; the rest follows
        if seq < 0:
            return self._finish_replay(pod, complete=True)
        pod.replay_deadline = time.monotonic() + self.replay_timeout  # it is answering
        if seq <= pod.last_applied:
            return 0
        if pod.last_live >= 0 and seq > pod.last_live + MAX_SEQ_JUMP:
            pod.bad_payloads += 1  # a replayed seq the live stream never came near: bogus
            return 0
        batch = self._decode(pod, payload)
        if seq > pod.last_applied + 1:
            # The publisher no longer holds what we missed (it keeps the last 10,000 batches).
            pod.mirror.lost += min(seq - pod.last_applied - 1, MAX_SEQ_JUMP)
            pod.incomplete = True
        return self._apply_or_skip(pod, seq, batch, True, payload)

    def _finish_replay(self, pod: _Pod, complete: bool) -> int:
        before = pod.state
        pod.replaying = False
        pod.verify = None
        if not complete:
            if pod.buffer or pod.seen:  # a join replay nobody answered yet loses nothing
                pod.incomplete = True
            self._reset_dealer(pod)
        applied = 0
        buffered = sorted(pod.buffer, key=lambda sb: sb[0])
        pod.buffer.clear()
        for i, (seq, batch, payload) in enumerate(buffered):
            if seq <= pod.last_applied:
                continue  # the replay already applied it
            if seq > pod.last_applied + 1:
                progressed = pod.last_applied > pod.replay_start
                if complete and pod.dealer is not None and progressed and pod.replay_tries < MAX_REPLAY_RETRIES:
                    # lost in transit after the publisher answered: ask again from the hole
                    # (only while replays bring something new, a few times at most)
                    pod.replay_tries += 1
                    pod.mirror.gaps += 1
                    pod.buffer = buffered[i:]
                    self._start_replay(pod, pod.last_applied + 1)
                    self._set_state(pod, before)
                    return applied
                if complete:
                    pod.replays_given_up += 1
                pod.replay_tries = 0
                if pod.last_applied >= 0:
                    pod.mirror.lost += min(seq - pod.last_applied - 1, MAX_SEQ_JUMP)
                pod.incomplete = True
            applied += self._apply_or_skip(pod, seq, batch, False, payload)
        pod.joined.set()  # after the buffered batches: a waiter sees the mirror caught up
        self._set_state(pod, before)
        return applied
