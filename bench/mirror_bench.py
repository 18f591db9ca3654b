"""How many KV events per second one process mirrors: a synthetic vLLM-like stream, decoded and
applied exactly as `kvplay watch` does (wire/codec.decode_batch, the pod's wire/translate.FromWire,
wire/mirror.Mirror.apply), and once more through a real ZMQ socket and the Subscriber.

The stream looks like a busy GPU server's: each engine step stores a few prompts' blocks (one
`BlockStored` per request, 1-8 blocks of 16 tokens, half of them continuing a shared prefix,
a quarter re-announcing reused blocks with another session, as kv_cache_report_mode "full"
does) and evicts old blocks one `BlockRemoved` per block, as vLLM does; the pool stays near
`pool_blocks`.

    python -m kvplay.bench.mirror_bench [--events N] [--pool-blocks N] [--misses] [--json]

`--content prompts` gives the blocks a tokenizer's token ids instead of the default pattern (64
blocks' worth of ids under 80, which Python keeps as shared small ints and which make every
prompt that starts at the root the same tokens as an older one under another hash): ids across a
49,152-token vocabulary (SmolLM2's), and prompts that start at the root open with a shared
chat-template run and part from one another within their first block, as one template's
requests do.

`--misses` measures the miss attribution `kvplay watch` runs on each applied batch
(wire/miss_watch.py) too: decode + translate + apply with it and without it, alternating in one
process, nine times: the ratio of the best CPU times, and the median of each adjacent pair's ratio
(on a shared machine the steadier of the two); `--inside N` also times each of the attribution's
calls over N more runs (what it costs itself, less noisy than a difference of two whole runs), in
all and per event.
`--watch` instead publishes the stream over ZMQ to a real `kvplay watch` process and prints what
that watch reports at its end: the attribution's time against its mirror's (decode + translate +
apply), as a watch of a server reports it.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import re
import signal
import socket as _socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from array import array
from collections import deque

import zmq

from kvplay.labs.stats import median_ci
from kvplay.sessions.event_log import batch_row
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.script import UserSpec
from kvplay.sessions.watch_recording import WatchRecording
from kvplay.tui.attach import AttachApp
from kvplay.wire.codec import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch, encode_frames
from kvplay.wire.mirror import Fleet, Mirror
from kvplay.wire.miss_watch import MissWatch
from kvplay.wire.remote import RemoteBackend
from kvplay.wire.subscriber import PodSource, Subscriber
from kvplay.wire.translate import FromWire

BLOCK_SIZE = 16
MISSES_RUNS = 9  # off and on runs, alternating, with --misses (each pair: two runs next to each other in time)
CONTENTS = ("pattern", "prompts")  # the blocks' token ids (module docstring)
VOCAB = 49_152  # token ids of the "prompts" content: SmolLM2's vocabulary


def synthetic_stream(n_events: int, pool_blocks: int = 100_000, sessions: int = 16, seed: int = 0,
                     events_per_batch: int = 64, content: str = "pattern") -> list[bytes]:
    """Encoded EventBatch payloads holding about `n_events` events in all; `content`: the
    blocks' token ids, "pattern" or "prompts" (module docstring)."""
    if content not in CONTENTS:
        raise ValueError(f"content: one of {', '.join(CONTENTS)} (got {content!r})")
    rng = random.Random(seed)
    resident: deque = deque()
    next_hash = 1
    payloads = []
    made = 0
    tokens16 = [list(range(i, i + BLOCK_SIZE)) for i in range(64)]
    prompts = content == "prompts"
    template = [rng.randrange(VOCAB) for _ in range(BLOCK_SIZE - 1)]  # a chat template's opening tokens
    held: dict = {}  # ("prompts") a resident block's tokens, for its re-announcements

    def ids(k: int) -> list:  # k token ids of the vocabulary
        return [t % VOCAB for t in array("H", rng.randbytes(2 * k))]

    while made < n_events:
        events = []
        while len(events) < events_per_batch:
            kind = rng.random()
            if kind < 0.25 and resident:  # reuse: re-announce resident blocks for another session
                h = resident[rng.randrange(len(resident))]
                events.append(BlockStored([h], None, list(held[h] if prompts else tokens16[h % 64]), BLOCK_SIZE,
                                          None, "GPU", None, session_id=f"s{rng.randrange(sessions)}"))
                continue
            n = rng.randint(1, 8)
            parent = resident[-1] if resident and rng.random() < 0.5 else None
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            if prompts:  # at the root: the template's first k tokens, then the prompt's own
                k = rng.randint(1, BLOCK_SIZE - 1) if parent is None else 0
                toks = template[:k] + ids(n * BLOCK_SIZE - k)
                for i, h in enumerate(hashes):
                    held[h] = toks[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            else:
                toks = []
                for h in hashes:
                    toks.extend(tokens16[h % 64])
            events.append(BlockStored(hashes, parent, toks, BLOCK_SIZE, None, "GPU", None,
                                      session_id=f"s{rng.randrange(sessions)}"))
            resident.extend(hashes)
            while len(resident) > pool_blocks:
                gone = resident.popleft()
                held.pop(gone, None)
                events.append(BlockRemoved([gone], "GPU"))
        made += len(events)
        payloads.append(encode_batch(EventBatch(time.time(), events, 0)))
    return payloads


def count_events(payloads: list[bytes]) -> tuple[int, int]:
    events = blocks = 0
    for p in payloads:
        b = decode_batch(p)
        events += len(b.events)
        blocks += sum(len(e.block_hashes) for e in b.events)
    return events, blocks


def _feed(payloads: list[bytes], m, w, attribute, base: int = 0) -> None:
    """Decode, translate and apply each payload (seq from `base`), and attribute it when
    `attribute` is not None."""
    for seq, p in enumerate(payloads, base):
        b = w(decode_batch(p), seq)
        m.apply(b)
        if attribute is not None:
            attribute(b)


def _warmed(warm: list[bytes] | None, misses: bool):
    """A fresh pod's mirror, its FromWire and (with `misses`) its attribution's `apply` (else
    None), after `warm` went through them, and a full collection: (mirror, from_wire, attribute,
    the next batch's seq)."""
    fleet = Fleet()
    m = fleet.pod("bench")
    w = fleet.from_wire("bench")
    attribute = MissWatch(fleet).pod("bench").apply if misses else None
    _feed(warm or [], m, w, attribute)
    gc.collect()
    return m, w, attribute, len(warm or [])


def measure_apply(payloads: list[bytes], warm: list[bytes] | None = None,
                  misses: bool = False) -> tuple[float, float]:
    """(seconds, this thread's CPU seconds) to decode and apply every payload into a fresh
    mirror (after `warm`); with `misses`, each applied batch also goes through the miss
    attribution (wire/miss_watch.py), as `kvplay watch` does. On a shared machine the CPU time
    says what the code costs; the wall time also holds what the other processes took.

    Each run pays for its own garbage: it starts after a full collection and ends with a
    collection of the young generation, timed. (The mirror's stores and removals balance the
    collector's allocation count, so its young generation grows without a collection for as long
    as nothing else allocates: 100,000+ objects in a 200,000-event run. Whichever run allocates a
    little more then pays for that whole generation in one 40-80 ms collection, and the other run
    leaves it uncounted.)"""
    m, w, attribute, base = _warmed(warm, misses)
    t0, c0 = time.perf_counter(), time.thread_time()
    if attribute is None:
        for seq, p in enumerate(payloads, base):
            m.apply(w(decode_batch(p), seq))
    else:
        for seq, p in enumerate(payloads, base):
            b = w(decode_batch(p), seq)
            m.apply(b)
            attribute(b)
    gc.collect(0)
    return time.perf_counter() - t0, time.thread_time() - c0


def measure_inside(payloads: list[bytes], warm: list[bytes] | None = None) -> float:
    """Seconds spent inside the miss attribution's calls, one per batch, in a run with it on (as
    `measure_apply(misses=True)` runs; the clock read around each call): what the attribution
    itself costs, without the other processes' share of the whole run's time."""
    m, w, attribute, base = _warmed(warm, True)
    clock = time.perf_counter
    inside = 0.0
    for seq, p in enumerate(payloads, base):
        b = w(decode_batch(p), seq)
        m.apply(b)
        t = clock()
        attribute(b)
        inside += clock() - t
    return inside


def measure_memory(payloads: list[bytes], warm: list[bytes] | None = None) -> dict:
    """What the miss attribution holds after the whole stream: the memory Python's allocators
    hold (tracemalloc) with the mirror alone and with the attribution too, each a fresh pod
    after a full collection, and the attribution's own `memory` summary."""
    out = {}
    for misses in (False, True):
        gc.collect()
        tracemalloc.start()
        m, w, attribute, base = _warmed(warm, misses)
        _feed(payloads, m, w, attribute, base)
        gc.collect()
        out["on_mib" if misses else "off_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
        tracemalloc.stop()
        if attribute is not None:
            out["summary"] = attribute.__self__.summary()["memory"]
        del m, w, attribute
    out["held_mib"] = round(out["on_mib"] - out["off_mib"], 1)
    return out


WATCH_COST = re.compile(r"the attribution took ([0-9.e+-]+) s, ([0-9.]+) % of the mirror's ([0-9.e+-]+) s")


def measure_watch(payloads: list[bytes], timeout: float = 600.0) -> dict:
    """A `kvplay watch` process (human lines, no recording) fed `payloads` over ZMQ as fast as it
    takes them, stopped once it applied the last: what it reports of the attribution's cost
    (seconds, and its share of the mirror's decode + translate + apply seconds)."""
    with _socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        ep = f"tcp://127.0.0.1:{sk.getsockname()[1]}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(ep)
    w = subprocess.Popen([sys.executable, "-m", "kvplay", "watch", "--events", ep, "--pod", "bench", "--no-record"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(w.stdout), daemon=True)  # (its lines, as they come)
    reader.start()
    last = f"seq {len(payloads)} "
    try:
        deadline = time.monotonic() + timeout
        probe = encode_batch(EventBatch(0.0, []))
        while not any("[live]" in x for x in lines):  # (empty batches until it is subscribed)
            if w.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvplay watch did not subscribe")
            pub.send_multipart(encode_frames("", 0, probe))
            time.sleep(0.05)
        for i, p in enumerate(payloads, 1):
            pub.send_multipart(encode_frames("", i, p), copy=False)
        while not any(last in x for x in lines):
            if w.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvplay watch did not apply the whole stream")
            time.sleep(0.1)
        w.send_signal(signal.SIGTERM)
        w.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
        pub.close(0)
        ctx.term()
    found = [m for m in map(WATCH_COST.search, lines) if m]
    if not found:
        raise RuntimeError("kvplay watch reported no attribution cost")
    took, share, mirror = (float(x) for x in found[-1].groups())
    return {"watch_misses_s": took, "watch_mirror_s": mirror, "watch_of_mirror": round(share / 100, 4)}


def measure_recording(payloads: list[bytes], db_path: str) -> tuple[float, int]:
    """(seconds, events dropped) to decode, apply and record (the mirror's engine events ->
    SQLite, flushed every 1,000 batches as `kvplay watch` flushes about once a second) every
    payload, until the recording is closed (everything written)."""
    m = Mirror(pod="bench")
    w = FromWire(m)
    rec = WatchRecording(db_path, title="mirror bench")
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        batch = w(decode_batch(p), seq)
        m.apply(batch)
        rec.on_batch("bench", seq, batch)
        if seq % 1000 == 999:
            rec.flush()
    rec.close()
    return time.perf_counter() - t0, rec.rec.dropped_events


def _engine_batches(payloads: list[bytes]):
    """Each payload as a batch of kvplay engine events (decoded, translated and applied as a
    watched server's are), its events numbered in order."""
    m = Mirror(pod="bench")
    w = FromWire(m)
    out = []
    seq = 0
    for wire_seq, p in enumerate(payloads):
        batch = w(decode_batch(p), wire_seq)
        m.apply(batch)
        for ev in batch.events:
            seq += 1
            ev.seq = seq
        batch.pod = "bench"
        out.append(batch)
    return out


def measure_recorder(payloads: list[bytes], db_path: str) -> tuple[float, int]:
    """(seconds, engine events) the recorder alone takes to write every payload's events: the
    batches are decoded, translated and applied first (untimed), then written with
    `Recorder.write_rows` 1,000 batches at a time (as `kvplay watch` flushes), and closed."""
    batches = _engine_batches(payloads)
    n = sum(len(b.events) for b in batches)
    rec = Recorder.open(db_path, None, "remote", "watch", "", title="mirror bench")
    t0 = time.perf_counter()
    for k in range(0, len(batches), 1000):
        chunk = batches[k:k + 1000]
        rec.write_rows([batch_row(rec.session_id, b) for b in chunk], sum(len(b.events) for b in chunk))
    rec.close()
    return time.perf_counter() - t0, n


def measure_engine_recorder(payloads: list[bytes], db_path: str) -> tuple[float, int, int] | None:
    """(seconds, engine events, dropped) for the local engine's recording path: each payload's
    engine events handed to `Recorder.record_batch` as one engine step's batch (what the engine
    thread does), the recorder's writer thread writing them, until `close` has written the
    last. None on a kvplay whose recorder has no batch queue."""
    if not hasattr(Recorder, "record_batch"):
        return None
    batches = _engine_batches(payloads)
    for step, b in enumerate(batches, 1):
        b.step, b.forwards, b.pod, b.wire_seq = step, step, None, None
    rec = Recorder.open(db_path, None, "bench", "run", "", title="mirror bench (engine path)")
    t0 = time.perf_counter()
    for b in batches:
        rec.record_batch(b)
    rec.close()
    return time.perf_counter() - t0, sum(len(b.events) for b in batches), rec.dropped_events


def measure_socket(payloads: list[bytes]) -> float:
    """Seconds for the Subscriber to receive, decode and apply every batch over a real ZMQ
    socket (inproc, bound by the subscriber; a sender thread pushes pre-encoded frames)."""
    ctx = zmq.Context()
    ep = f"inproc://kvplay-mirror-bench-{id(payloads)}"
    fleet = Fleet()
    sub = Subscriber([PodSource("bench", ep, bind=True)], fleet, context=ctx).open()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(ep)
    m = fleet.pod("bench")
    # wait for the subscription to reach the publisher
    probe = encode_batch(EventBatch(0.0, []))
    while m.last_seq < 0:
        pub.send_multipart(encode_frames("", 0, probe))
        sub.poll(10)
    frames = [encode_frames("", seq, p) for seq, p in enumerate(payloads, 1)]
    last = len(payloads)

    def send():
        for f in frames:
            pub.send_multipart(f, copy=False)

    t0 = time.perf_counter()
    th = threading.Thread(target=send)
    th.start()
    while m.last_seq < last:
        sub.poll(100)
    dt = time.perf_counter() - t0
    th.join()
    sub.close()
    pub.close(0)
    ctx.term()
    return dt


def _publish(eps: list[str], per_pod: int, pool_blocks: int, rate: int, go, done, sent) -> None:
    """The publishers, in a process of their own as a server's are: bind each endpoint, send
    empty probes (seq 0) until `go`, then each pod's synthetic stream paced to `rate` events/s
    in all; `sent[k]`: the last seq sent to pod k."""
    streams = [synthetic_stream(per_pod, pool_blocks, seed=20 + k) for k in range(len(eps))]
    counts = [[len(decode_batch(p).events) for p in st] for st in streams]
    ctx = zmq.Context()
    pubs = []
    for ep in eps:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(ep)
        pubs.append(pub)
    probe = encode_batch(EventBatch(0.0, []))
    while not go.wait(0.02):
        for pub in pubs:
            pub.send_multipart(encode_frames("", 0, probe))
    t0 = time.perf_counter()
    total = 0
    for i in range(max(len(st) for st in streams)):
        for k, pub in enumerate(pubs):
            if i < len(streams[k]):
                pub.send_multipart(encode_frames("", i + 1, streams[k][i]), copy=False)
                sent[k] = i + 1
                total += counts[k][i]
        ahead = total / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
    done.set()
    time.sleep(0.5)
    for pub in pubs:
        pub.close(0)
    ctx.term()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def measure_app(rate: int = 50_000, seconds: float = 10.0, pool_blocks: int = 100_000, pods: int = 1,
                record: bool = False, size: tuple[int, int] = (160, 48), progress=None) -> dict:
    """The attach app (headless, `size`) while its pods' KV events arrive at `rate` events/s in all
    over real ZMQ sockets on loopback (the publishers bind, as `kvplay serve` does; the app's
    RemoteBackend connects): the frame time (each screen update: layout, compositing, the map's
    and panels' lines) and the event loop's lag (how late a 10 ms timer fires: what a keystroke
    waits), p50/p95/max, and how many events/s the mirror applied (`kept_up`: it drained what was
    sent within a second of the end)."""
    def free_port() -> int:
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    per_pod = max(1, int(rate * seconds) // pods)
    counts = [[len(decode_batch(p).events) for p in synthetic_stream(per_pod, pool_blocks, seed=20 + k)]
              for k in range(pods)]
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(pods)]
    mp = multiprocessing.get_context("spawn")
    go, done, sent = mp.Event(), mp.Event(), mp.Array("i", pods)
    publisher = mp.Process(target=_publish, args=(eps, per_pod, pool_blocks, rate, go, done, sent), daemon=True)
    publisher.start()
    backend = RemoteBackend("http://127.0.0.1:9", model="synthetic", slots=pool_blocks + 1024,  # + what a batch stores before it evicts
                            sources=[PodSource(f"pod{k}", ep) for k, ep in enumerate(eps)])
    tmp = tempfile.TemporaryDirectory()
    app = AttachApp(backend, [UserSpec("alice"), UserSpec("bob")], "", record=record,
                    db=os.path.join(tmp.name, "bench.db"), timings=True)
    frames: list[float] = []
    lags: list[float] = []

    async def main() -> dict:
        async with app.run_test(size=size) as pilot:
            while app.backend is None:
                await pilot.pause(0.05)
            while any(backend.fleet.pod(f"pod{k}").last_seq < 0 for k in range(pods)):
                await pilot.pause(0.02)  # the publishers' probes arrive: subscribed
            timer = app.screen._update_timer  # the screen's update: one call, one frame
            real_update = timer._callback

            def timed_update():
                t = time.perf_counter()
                real_update()
                frames.append((time.perf_counter() - t) * 1000)

            timer._callback = timed_update
            try:
                t0 = time.perf_counter()
                go.set()
                last_report = t0
                while not done.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.01)
                    lags.append((time.perf_counter() - t - 0.01) * 1000)
                    if progress and time.perf_counter() - last_report > 2:
                        last_report = time.perf_counter()
                        progress(f"app: {time.perf_counter() - t0:.0f} s of {seconds:.0f}")
                send_s = time.perf_counter() - t0
                end = time.perf_counter() + 10
                while time.perf_counter() < end and any(
                        backend.fleet.pod(f"pod{k}").last_seq < sent[k] for k in range(pods)):
                    await asyncio.sleep(0.01)
                drain_s = time.perf_counter() - t0
                await pilot.pause(0.3)
                scale = app.query_one("#map").scale_text()
            finally:
                timer._callback = real_update
            return {"send_s": send_s, "drain_s": drain_s, "scale": scale}

    try:
        r = asyncio.run(main())
    finally:
        backend.close()
        publisher.join(5)
        if publisher.is_alive():
            publisher.kill()
        tmp.cleanup()
    applied = sum(sum(counts[k][:backend.fleet.pod(f"pod{k}").last_seq]) for k in range(pods))
    offered = sum(sum(c) for c in counts)
    return {"rate": rate, "pods": pods, "pool_blocks": pool_blocks, "record": record,
            "events": offered, "applied": applied, "send_s": round(r["send_s"], 2),
            "offered_per_s": round(offered / r["send_s"]), "applied_per_s": round(applied / r["drain_s"]),
            "kept_up": applied == offered and r["drain_s"] - r["send_s"] < 1.0,
            "frames": len(frames), "frame_ms_p50": round(_pct(frames, 0.5), 1),
            "frame_ms_p95": round(_pct(frames, 0.95), 1), "frame_ms_max": round(max(frames, default=0), 1),
            "lag_ms_p50": round(_pct(lags, 0.5), 1), "lag_ms_p95": round(_pct(lags, 0.95), 1),
            "lag_ms_max": round(max(lags, default=0), 1), "map": r["scale"]}


def run(n_events: int = 200_000, pool_blocks: int = 100_000, socket: bool = True, record: bool = False,
        misses: bool = False, warm_events: int | None = None, pairs: int = MISSES_RUNS,
        content: str = "pattern", inside: int = 0, memory: bool = False) -> dict:
    # a pool already filling up (by default); its hashes count from 1 as the measured stream's do,
    # so a warm-up longer than the pool makes a window that stores again what was evicted
    warm = synthetic_stream(pool_blocks // 4 if warm_events is None else warm_events, pool_blocks, seed=1,
                            content=content)
    payloads = synthetic_stream(n_events, pool_blocks, seed=2, content=content)
    events, blocks = count_events(payloads)
    runs, on = [], []
    for _ in range(max(1, pairs) if misses else 2):  # with misses: off and on alternate, in this one process
        runs.append(measure_apply(payloads, warm))
        if misses:
            on.append(measure_apply(payloads, warm, misses=True))
    dt, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    out = {"events": events, "blocks": blocks, "batches": len(payloads), "pool_blocks": pool_blocks, "content": content,
           "apply_s": round(dt, 4), "events_per_s": round(events / dt), "blocks_per_s": round(blocks / dt),
           "apply_cpu_s": round(cpu, 4), "events_per_cpu_s": round(events / cpu), "load": os.getloadavg()[0]}
    if misses:
        on_dt, on_cpu = min(r[0] for r in on), min(r[1] for r in on)
        ratios = sorted(b[1] / a[1] for a, b in zip(runs, on))  # each on run over the off run before it
        med, lo, hi = median_ci(ratios)  # (what a few pairs on a shared machine can resolve)
        out.update(misses_apply_s=round(on_dt, 4), misses_events_per_s=round(events / on_dt),
                   misses_events_per_cpu_s=round(events / on_cpu), misses_ratio=round(on_cpu / cpu, 3),
                   misses_ratio_pairs=[round(x, 3) for x in ratios], misses_runs=len(ratios),
                   misses_ratio_median=round(med, 3), misses_ratio_median_ci=[round(lo, 3), round(hi, 3)])
    if inside:  # (runs of their own: the clock around each call is not in the ratio's)
        ins = sorted(measure_inside(payloads, warm) for _ in range(inside))
        out.update(inside_s=round(ins[len(ins) // 2], 4), inside_runs=inside,
                   inside_share=round(ins[len(ins) // 2] / min(r[0] for r in runs), 3),
                   inside_ns_per_event=round(1e9 * ins[len(ins) // 2] / events, 1))
    if memory:
        out["memory"] = measure_memory(payloads, warm)
    if socket:
        ds = measure_socket(payloads)
        out.update(socket_s=round(ds, 4), socket_events_per_s=round(events / ds))
    if record:
        with tempfile.TemporaryDirectory() as tmp:
            dr, dropped = measure_recording(payloads, os.path.join(tmp, "bench.db"))
            dw, engine_events = measure_recorder(payloads, os.path.join(tmp, "alone.db"))
            eng = measure_engine_recorder(payloads, os.path.join(tmp, "engine.db"))
        if eng is not None:
            out.update(engine_recorder_s=round(eng[0], 4), engine_recorder_events_per_s=round(eng[1] / eng[0]),
                       engine_recorder_dropped=eng[2])
        out.update(record_s=round(dr, 4), record_events_per_s=round(events / dr), record_dropped=dropped,
                   recorder_s=round(dw, 4), recorder_events_per_s=round(events / dw),
                   recorder_engine_events=engine_events, recorder_engine_events_per_s=round(engine_events / dw))
    return out


def _emit(r: dict, as_json: bool, *lines: str) -> int:
    """A measurement's result: one JSON line, or its lines for people."""
    print(json.dumps(r) if as_json else "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvplay.bench.mirror_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--pool-blocks", type=int, default=100_000)
    ap.add_argument("--warm", type=int, default=None, metavar="N",
                    help="events before the measured ones (default: a quarter of --pool-blocks); with more than the "
                         "pool holds, the measured events store again what was evicted (recomputed chains)")
    ap.add_argument("--content", choices=CONTENTS, default="pattern",
                    help="the blocks' token ids: the default pattern (64 blocks' worth of small ids), or prompts "
                         "(a tokenizer's ids, prompts opening with a shared template run)")
    ap.add_argument("--no-socket", action="store_true")
    ap.add_argument("--record", action="store_true", help="also measure with recording to SQLite")
    ap.add_argument("--misses", action="store_true",
                    help="also measure with the miss attribution on (wire/miss_watch.py), alternating with off")
    ap.add_argument("--pairs", type=int, default=MISSES_RUNS, metavar="N",
                    help=f"off and on runs with --misses (default {MISSES_RUNS}; the median's interval narrows with more)")
    ap.add_argument("--inside", type=int, default=0, metavar="N",
                    help="also N runs timing each of the attribution's calls: the median time inside them, and its "
                         "share of the best run without the attribution")
    ap.add_argument("--memory", action="store_true",
                    help="also what the miss attribution holds after the stream (tracemalloc, with and without it)")
    ap.add_argument("--watch", action="store_true",
                    help="instead: a kvplay watch process fed the stream over ZMQ, and what it reports the "
                         "attribution cost (its share of the mirror's time)")
    ap.add_argument("--app", action="store_true",
                    help="instead: the attach app while events arrive at --rate over ZMQ (frame time, loop lag)")
    ap.add_argument("--rate", type=int, default=50_000, help="events/s in all, with --app (default 50,000)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to send, with --app")
    ap.add_argument("--pods", type=int, default=1, help="publishers, with --app (the rate is split)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.app:
        r = measure_app(args.rate, args.seconds, args.pool_blocks, args.pods, args.record,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
        return _emit(r, args.json,
                     f"attach app, {r['pods']} pod(s), {r['pool_blocks']:,} slots each ({r['map']}), "
                     f"recording {'on' if r['record'] else 'off'}: offered {r['offered_per_s']:,} events/s, "
                     f"applied {r['applied_per_s']:,} events/s ({'kept up' if r['kept_up'] else 'fell behind'})",
                     f"frame time p50 {r['frame_ms_p50']} ms, p95 {r['frame_ms_p95']} ms, max {r['frame_ms_max']} ms "
                     f"({r['frames']} frames); event-loop lag p50 {r['lag_ms_p50']} ms, p95 {r['lag_ms_p95']} ms, "
                     f"max {r['lag_ms_max']} ms")
    if args.pairs < 1:
        ap.error(f"--pairs must be at least 1 (got {args.pairs})")
    if args.watch:
        payloads = synthetic_stream(args.events, args.pool_blocks, seed=2, content=args.content)
        events = count_events(payloads)[0]
        r = {"events": events, "content": args.content, **measure_watch(payloads)}
        return _emit(r, args.json,
                     f"kvplay watch over ZMQ, {events:,} events ({args.content} content): the attribution took "
                     f"{r['watch_misses_s']} s, {100 * r['watch_of_mirror']:.1f} % of the mirror's {r['watch_mirror_s']} s "
                     f"(its own report; {time.strftime('%H:%M UTC', time.gmtime())})")
    r = run(args.events, args.pool_blocks, socket=not args.no_socket, record=args.record, misses=args.misses,
            warm_events=args.warm, pairs=args.pairs, content=args.content, inside=args.inside, memory=args.memory)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"mirror: {r['events']:,} events ({r['blocks']:,} block entries, {r['content']} content) in {r['apply_s']} s "
              f"= {r['events_per_s']:,} events/s, {r['blocks_per_s']:,} blocks/s (decode + apply); "
              f"{r['events_per_cpu_s']:,} events per CPU second of the thread; load average {r['load']:.2f}, "
              f"{time.strftime('%H:%M UTC', time.gmtime())}")
        if "misses_ratio" in r:
            pairs, (lo, hi) = r["misses_ratio_pairs"], r["misses_ratio_median_ci"]
            print(f"with the miss attribution: {r['misses_events_per_s']:,} events/s, "
                  f"{r['misses_events_per_cpu_s']:,} events per CPU second: {r['misses_ratio']:.2f}x the CPU time "
                  f"(off and on alternating, best of {r['misses_runs']} each; each pair "
                  f"{r['misses_ratio_median']:.2f}x median [{lo:.2f}, {hi:.2f}] (the median's interval, "
                  f"at least 95 % where the pairs allow), {pairs[0]:.2f}-{pairs[-1]:.2f})")
        if "inside_s" in r:
            print(f"inside the attribution's calls: {1000 * r['inside_s']:.1f} ms (median of {r['inside_runs']} runs), "
                  f"{r['inside_ns_per_event']:.0f} ns an event, {100 * r['inside_share']:.1f} % of the best run without it")
        if "memory" in r:
            mem = r["memory"]
            sm = mem["summary"]
            print(f"memory: the miss attribution holds {mem['held_mib']} MiB ({mem['on_mib']} against {mem['off_mib']} "
                  f"MiB without it, tracemalloc): {sm['chain_slots']:,} chain slots, {sm['removed_recent']:,} recent "
                  f"removals in {sm['removed_recent_bytes'] / 2**20:.2f} MiB, filters {sm['removed_filter_bytes'] / 2**20:.2f} "
                  f"MiB (false positives at most {sm['false_positive_bound']:.1e})")
        if "socket_s" in r:
            print(f"through ZMQ + Subscriber: {r['socket_events_per_s']:,} events/s")
        if "record_s" in r:
            print(f"decode + apply + record to SQLite: {r['record_events_per_s']:,} events/s "
                  f"({r['record_dropped']:,} engine events dropped)")
            print(f"the recorder alone (write to SQLite, the wire events as {r['recorder_engine_events']:,} engine "
                  f"events): {r['recorder_events_per_s']:,} events/s ({r['recorder_engine_events_per_s']:,} engine events/s)")
        if "engine_recorder_s" in r:
            print(f"the same engine events as engine steps' batches through the recorder's queue and writer "
                  f"thread: {r['engine_recorder_events_per_s']:,} engine events/s "
                  f"({r['engine_recorder_dropped']:,} dropped)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
