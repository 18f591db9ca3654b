"""How many KV events per second one process mirrors: a synthetic vLLM-like stream, decoded and
applied exactly as `kvplay watch` does (wire/codec.decode_batch + wire/mirror.Mirror.apply), and
once more through a real ZMQ socket and the Subscriber.

The stream looks like a busy GPU server's: each engine step stores a few prompts' blocks (one
`BlockStored` per request, 1-8 blocks of 16 tokens, half of them continuing a shared prefix,
a quarter re-announcing reused blocks with another session, as kv_cache_report_mode "full"
does) and evicts old blocks one `BlockRemoved` per block, as vLLM does; the pool stays near
`pool_blocks`.

    python -m kvplay.bench.mirror_bench [--events N] [--pool-blocks N] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import deque

from kvplay.wire.codec import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch, encode_frames
from kvplay.wire.mirror import Fleet, Mirror

BLOCK_SIZE = 16


def synthetic_stream(n_events: int, pool_blocks: int = 100_000, sessions: int = 16, seed: int = 0,
                     events_per_batch: int = 64) -> list[bytes]:
    """Encoded EventBatch payloads holding about `n_events` events in all."""
    rng = random.Random(seed)
    resident: deque = deque()
    next_hash = 1
    payloads = []
    made = 0
    tokens16 = [list(range(i, i + BLOCK_SIZE)) for i in range(64)]
    while made < n_events:
        events = []
        while len(events) < events_per_batch:
            kind = rng.random()
            if kind < 0.25 and resident:  # reuse: re-announce resident blocks for another session
                h = resident[rng.randrange(len(resident))]
                events.append(BlockStored([h], None, list(tokens16[h % 64]), BLOCK_SIZE, None, "GPU", None,
                                          session_id=f"s{rng.randrange(sessions)}"))
                continue
            n = rng.randint(1, 8)
            parent = resident[-1] if resident and rng.random() < 0.5 else None
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            toks = []
            for h in hashes:
                toks.extend(tokens16[h % 64])
            events.append(BlockStored(hashes, parent, toks, BLOCK_SIZE, None, "GPU", None,
                                      session_id=f"s{rng.randrange(sessions)}"))
            resident.extend(hashes)
            while len(resident) > pool_blocks:
                events.append(BlockRemoved([resident.popleft()], "GPU"))
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


def measure_apply(payloads: list[bytes], warm: list[bytes] | None = None) -> float:
    """Seconds to decode and apply every payload into a fresh mirror (after `warm`)."""
    m = Mirror("bench")
    for seq, p in enumerate(warm or []):
        m.apply(decode_batch(p), seq)
    base = len(warm or [])
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads, base):
        m.apply(decode_batch(p), seq)
    return time.perf_counter() - t0


def measure_recording(payloads: list[bytes], db_path: str) -> float:
    """Seconds to decode, apply and record (journal -> engine events -> SQLite, flushed every
    1,000 batches as `kvplay watch` flushes about once a second) every payload."""
    from kvplay.wire.recording import WatchRecording

    fleet = Fleet()
    rec = WatchRecording(db_path, fleet, title="mirror bench")
    rec.watch("bench")
    m = fleet.pod("bench")
    t0 = time.perf_counter()
    for seq, p in enumerate(payloads):
        b = decode_batch(p)
        m.apply(b, seq)
        rec.on_batch("bench", seq, b.ts)
        if seq % 1000 == 999:
            rec.flush()
    rec.close()
    return time.perf_counter() - t0


def measure_socket(payloads: list[bytes]) -> float:
    """Seconds for the Subscriber to receive, decode and apply every batch over a real ZMQ
    socket (inproc, bound by the subscriber; a sender thread pushes pre-encoded frames)."""
    import zmq

    from kvplay.wire.subscriber import PodSource, Subscriber

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


def run(n_events: int = 200_000, pool_blocks: int = 100_000, socket: bool = True, record: bool = False) -> dict:
    warm = synthetic_stream(pool_blocks // 4, pool_blocks, seed=1)  # a pool already filling up
    payloads = synthetic_stream(n_events, pool_blocks, seed=2)
    events, blocks = count_events(payloads)
    dt = min(measure_apply(payloads, warm) for _ in range(2))
    out = {"events": events, "blocks": blocks, "batches": len(payloads), "pool_blocks": pool_blocks,
           "apply_s": round(dt, 4), "events_per_s": round(events / dt), "blocks_per_s": round(blocks / dt)}
    if socket:
        ds = measure_socket(payloads)
        out.update(socket_s=round(ds, 4), socket_events_per_s=round(events / ds))
    if record:
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            dr = measure_recording(payloads, os.path.join(tmp, "bench.db"))
        out.update(record_s=round(dr, 4), record_events_per_s=round(events / dr))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvplay.bench.mirror_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--pool-blocks", type=int, default=100_000)
    ap.add_argument("--no-socket", action="store_true")
    ap.add_argument("--record", action="store_true", help="also measure with recording to SQLite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run(args.events, args.pool_blocks, socket=not args.no_socket, record=args.record)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"mirror: {r['events']:,} events ({r['blocks']:,} block entries) in {r['apply_s']} s "
              f"= {r['events_per_s']:,} events/s, {r['blocks_per_s']:,} blocks/s (decode + apply)")
        if "socket_s" in r:
            print(f"through ZMQ + Subscriber: {r['socket_events_per_s']:,} events/s")
        if "record_s" in r:
            print(f"decode + apply + record to SQLite: {r['record_events_per_s']:,} events/s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
