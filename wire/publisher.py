"""vLLM's KV-event publisher: a ZMQ PUB for the live stream and a ROUTER for replay.

Same semantics as vLLM's ``ZmqEventPublisher`` (vllm/distributed/kv_events.py):

- ``--kv-events-config`` is vLLM's JSON (``KVEventsConfig``): ``enable_kv_cache_events``,
  ``publisher`` ("zmq" | "null"; default "zmq" when enabled), ``endpoint`` (default
  ``tcp://*:5557``), ``replay_endpoint``, ``buffer_steps`` (10,000), ``hwm`` (100,000),
  ``max_queue_size`` (100,000), ``topic`` ("").
- The PUB socket **binds only when the endpoint has ``*`` or ``::``, or is ipc/inproc**, and
  connects otherwise (then the subscriber binds). The replay ROUTER always binds.
- Each batch goes out as ``[topic, seq (8 bytes BE, from 0), msgpack EventBatch]``; the last
  ``buffer_steps`` payloads are kept. A replay request (a DEALER sends ``[b"", seq8]``) gets
  every kept batch with seq >= start as ``[b"", topic, seq8, payload]``, then the end marker
  ``[b"", b"", -1 as 8 bytes, b""]``.

One thread owns each socket (ZMQ sockets are not thread-safe): the live thread the PUB, the
replay thread the ROUTER; `publish` only enqueues.

Under abuse (anyone who reaches the ports, unless CURVE is on; wire/curve.py):

- Both sockets are watched by a PeerGuard (wire/zmq_guard.py): a connection that has sent more
  than 64 KiB, the largest ones while all together have sent more than 1 MiB, and any past 256
  connections are cut. That is what bounds a subscription flood: libzmq keeps every
  subscription a peer sends (XPUB_MANUAL too) until the peer leaves. Incoming frames are capped
  (``MAXMSGSIZE``, a peer over it is disconnected).
- Replay runs on its own thread, so live batches go out as soon as they are queued whatever
  replay is asked. Requests are read at most REPLAY_READ_RATE a second (the rest wait in their
  peer's pipe; the ROUTER reads peers in turn), rate-limited per peer and in total (token
  buckets; over the limit a request is dropped and counted, the consumer retries); at most
  REPLAY_MAX_PENDING are answered at once, REPLAY_FRAMES_PER_TURN frames at a time; a peer that
  does not read is not written past REPLAY_FRAMES_PER_TURN frames and loses its answer after
  REPLAY_STALL_S.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

import zmq

from kvplay.engine.errors import EngineError

from .codec import END_SEQ_BYTES, EventBatch, encode_batch, pack_seq, topic_bytes
from .zmq_guard import CHECK_INTERVAL, PeerGuard

LOOPBACK = "127.0.0.1"
MAX_INCOMING_BYTES = 1024  # any frame a peer sends us (subscriptions, replay requests)
REPLAY_READ_RATE, REPLAY_READ_BURST = 200.0, 256  # requests read a second, all peers together
REPLAY_FRAMES_PER_TURN = 256
REPLAY_MAX_PENDING = 16
REPLAY_PEER_RATE, REPLAY_PEER_BURST = 2.0, 4  # requests per second per peer (ZMQ routing id)
REPLAY_TOTAL_RATE, REPLAY_TOTAL_BURST = 20.0, 40
REPLAY_PEERS_KEPT = 4096
REPLAY_PAUSE = 0.002  # between two slices of answers
REPLAY_STALL_S = 10.0  # an answer its peer does not read for this long is dropped


class TokenBucket:
    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.at = rate, burst, float(burst), now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def enabled(self) -> bool:
        return bool(self.enable_kv_cache_events) and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str, flag: str = "--kv-events-config") -> "KVEventsConfig":
        """Parse vLLM's JSON; a bad value is one EngineError line."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{flag}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(d, dict):
            raise EngineError(f"{flag}: expected a JSON object like "
                              '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
        kinds = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
                 "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
        for key, value in d.items():
            if key not in kinds:
                raise EngineError(f"{flag}: unknown field {key!r} ({', '.join(kinds)})")
            want = kinds[key]
            ok = value is None and key in ("publisher", "replay_endpoint") or (
                isinstance(value, want) and not (want is int and isinstance(value, bool)))
            if not ok:
                raise EngineError(f"{flag}: {key} must be {want.__name__}, got {value!r}")
        cfg = cls(**d)
        if cfg.publisher not in ("zmq", "null"):
            raise EngineError(f"{flag}: unknown publisher {cfg.publisher!r} (zmq, null)")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(cfg, key) < 1:
                raise EngineError(f"{flag}: {key} must be at least 1")
        for key in ("endpoint", "replay_endpoint"):
            ep = getattr(cfg, key)
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise EngineError(f"{flag}: {key} {ep!r} must start with tcp://, ipc:// or inproc://")
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def loopback_only(endpoint: str | None) -> str | None:
    """A bind endpoint limited to 127.0.0.1 (for a server that serves loopback only): a
    wildcard interface (``tcp://*:5557``, ``tcp://[::]:5557``, ``tcp://0.0.0.0:5557``) becomes
    ``tcp://127.0.0.1:5557``; a wildcard *port* (``tcp://127.0.0.1:*``) stays a wildcard."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep:
        return endpoint
    if host in ("*", "[::]", "::", "0.0.0.0", "[*]", ""):
        host = LOOPBACK
    return f"tcp://{host}:{port}"


class ZmqEventPublisher:
    """PUB + replay ROUTER with an in-memory buffer of the last `buffer_steps` batches.
    `curve` (wire.curve.ServerCurve): both sockets are CURVE servers that admit only the
    allowed subscriber keys."""

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 topic: str = "", data_parallel_rank: int = 0, ctx: zmq.Context | None = None,
                 bind: bool | None = None, curve=None):
        self._own_ctx = curve is not None and ctx is None  # a ZAP handler serves a whole context
        self._ctx = zmq.Context() if self._own_ctx else (ctx or zmq.Context.instance())
        self._auth = curve.start_authenticator(self._ctx) if curve is not None else None
        self.curve = curve
        self.replay_refused = 0  # replay requests over the rate limits
        self._replay_pending: deque = deque()  # [client, next seq, last seq, last progress]
        self._peers: OrderedDict = OrderedDict()  # routing id -> TokenBucket
        now = time.monotonic()
        self._replay_total = TokenBucket(REPLAY_TOTAL_RATE, REPLAY_TOTAL_BURST, now)
        self._replay_reads = TokenBucket(REPLAY_READ_RATE, REPLAY_READ_BURST, now)
        self._queue: "queue.Queue[EventBatch | None]" = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()  # the live thread appends, the replay thread reads
        self._topic = topic_bytes(topic)
        self.settings = {"buffer_steps": buffer_steps, "hwm": hwm, "max_queue_size": max_queue_size, "topic": topic}
        self._rank = data_parallel_rank
        self._seq = 0
        self.dropped = 0
        self.binds = is_bind_endpoint(endpoint) if bind is None else bind
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.RCVHWM, 1000)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INCOMING_BYTES)
        if curve is not None:
            curve.apply(self._pub)
        self._guard = PeerGuard(self._pub)
        self._replay = self._replay_guard = None
        try:
            if self.binds:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # wildcard port resolved
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INCOMING_BYTES)
                self._replay.setsockopt(zmq.RCVHWM, 1000)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_FRAMES_PER_TURN)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer is EAGAIN, not a silent drop
                if curve is not None:
                    curve.apply(self._replay)
                self._replay_guard = PeerGuard(self._replay)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise EngineError(f"KV events: cannot open {endpoint if self._replay is None else replay_endpoint}: "
                              f"{exc.strerror}") from None
        self._running = True
        self._threads = [threading.Thread(target=self._run_live, name="kvplay-kv-events", daemon=True)]
        if self._replay is not None:
            self._threads.append(threading.Thread(target=self._run_replay, name="kvplay-kv-replay", daemon=True))
        for t in self._threads:
            t.start()

    @classmethod
    def from_config(cls, cfg: KVEventsConfig, data_parallel_rank: int = 0,
                    loopback: bool = False, curve=None) -> "ZmqEventPublisher":
        """With `loopback`, what would bind every interface binds 127.0.0.1 (same port)."""
        binds = is_bind_endpoint(cfg.endpoint)
        endpoint, replay = cfg.endpoint, cfg.replay_endpoint
        if loopback:
            endpoint = loopback_only(endpoint) if binds else endpoint
            replay = loopback_only(replay)
        return cls(endpoint, replay, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic,
                   data_parallel_rank, bind=binds, curve=curve)

    # --- producer side (any thread) ------------------------------------------------------------
    def publish(self, batch: EventBatch) -> None:
        """Queue one step's batch (never blocks: a full queue drops it and counts it)."""
        if not self._running:
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def peers_cut(self) -> int:
        """Connections cut for sending too much (both sockets; wire/zmq_guard.py)."""
        return self._guard.cut + (self._replay_guard.cut if self._replay_guard is not None else 0)

    @property
    def idle(self) -> bool:
        """Every batch queued so far has been sent (or dropped): none waits in the queue or in the
        live thread's hands."""
        return self._queue.unfinished_tasks == 0

    @property
    def subscribers(self) -> int:
        """Connections to the live socket, as its guard last counted them (every CHECK_INTERVAL)."""
        return self._guard.peers

    @property
    def heap_trims(self) -> int:
        """Heap trims after cuts (wire/zmq_guard.py), both sockets: what a cut peer held is back."""
        return self._guard.trims + (self._replay_guard.trims if self._replay_guard is not None else 0)

    def shutdown(self, timeout: float = 2.0) -> None:
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        for t in self._threads:
            t.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for g in (self._guard, self._replay_guard):
            if g is not None:
                g.close()
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    # --- the live thread: owns the PUB ----------------------------------------------------------
    def _run_live(self) -> None:
        """Sends every queued batch as soon as it is queued; between batches, the guard."""
        while True:
            self._guard.check()
            try:
                batch = self._queue.get(timeout=CHECK_INTERVAL)
            except queue.Empty:
                continue
            while batch is not None:
                self._send_live(batch)
                self._queue.task_done()
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch is None:
                break

    def _send_live(self, batch: EventBatch) -> None:
        try:
            payload = encode_batch(batch)
            seq = self._seq
            self._pub.send_multipart((self._topic, pack_seq(seq), payload))
        except (zmq.ZMQError, TypeError, ValueError):
            self.dropped += 1
            return
        with self._buffer_lock:
            self._buffer.append((seq, payload))
            self._seq += 1

    # --- the replay thread: owns the ROUTER ------------------------------------------------------
    def _run_replay(self) -> None:
        """Requests are read at a bounded rate (the rest wait in their peers' pipes, read
        fairly peer by peer), answers go out in slices: its work per second is bounded, so it
        cannot starve the live thread or the engine, whatever is asked."""
        while self._running:
            self._replay_guard.check()
            now = time.monotonic()
            self._take_replay_requests(now)
            self._send_replay(now)
            if self._replay_pending:
                time.sleep(REPLAY_PAUSE)
            elif self._replay_reads.tokens < 1:
                time.sleep(1 / REPLAY_READ_RATE)
            else:
                try:
                    self._replay.poll(CHECK_INTERVAL * 1000)
                except zmq.ZMQError:
                    return

    def _take_replay_requests(self, now: float) -> None:
        while self._replay_reads.take(now):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self._replay_reads.tokens += 1  # nothing was read
                return
            except zmq.ZMQError:
                return
            if len(frames) != 3 or len(frames[2]) != 8:  # [client id, b"", seq8] from a DEALER
                continue
            client = frames[0]
            bucket = self._peers.get(client)
            if bucket is None:
                bucket = self._peers[client] = TokenBucket(REPLAY_PEER_RATE, REPLAY_PEER_BURST, now)
                if len(self._peers) > REPLAY_PEERS_KEPT:
                    self._peers.popitem(last=False)
            else:
                self._peers.move_to_end(client)
            if (len(self._replay_pending) >= REPLAY_MAX_PENDING or not bucket.take(now)
                    or not self._replay_total.take(now)):
                self.replay_refused += 1
                continue
            with self._buffer_lock:
                last = self._seq - 1
            self._replay_pending.append([client, int.from_bytes(frames[2], "big"), last, now])

    def _slice(self, nxt: int, last: int, n: int) -> list[tuple[int, bytes]]:
        """Up to `n` kept batches from seq `nxt` (or the oldest kept) to `last`."""
        with self._buffer_lock:
            if not self._buffer:
                return []
            first = self._buffer[0][0]
            i = max(nxt, first) - first
            return [self._buffer[j] for j in range(i, min(len(self._buffer), i + n)) if self._buffer[j][0] <= last]

    def _send_replay(self, now: float) -> None:
        """Up to REPLAY_FRAMES_PER_TURN frames of the pending answers, oldest request first; a
        peer whose pipe is full waits (its answer goes to the back), one that made no progress
        for REPLAY_STALL_S or is gone loses its answer."""
        budget = REPLAY_FRAMES_PER_TURN
        for _ in range(len(self._replay_pending)):
            if budget <= 0:
                return
            entry = self._replay_pending.popleft()
            client, nxt, last, _ = entry
            try:
                for seq, payload in self._slice(nxt, last, budget):
                    self._replay.send_multipart((client, b"", self._topic, pack_seq(seq), payload), zmq.NOBLOCK)
                    budget -= 1
                    entry[1], entry[3] = seq + 1, now
                if entry[1] > last or not self._slice(entry[1], last, 1):
                    self._replay.send_multipart((client, b"", b"", END_SEQ_BYTES, b""), zmq.NOBLOCK)
                    continue  # answered
            except zmq.Again:  # its pipe is full: later, unless it stopped reading
                if now - entry[3] > REPLAY_STALL_S:
                    continue
            except zmq.ZMQError:  # the peer is gone
                continue
            self._replay_pending.append(entry)
