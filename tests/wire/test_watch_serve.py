"""The mirror against `kvplay serve` (the same wire as vLLM): two users chat over HTTP, the pool
evicts, and the mirror built from the KV events holds exactly the blocks the engine indexes,
coloured by the user that stored them; usage.cached_tokens equals the blocks re-announced."""
from __future__ import annotations

import threading

import httpx

from support.serve import ALICE, BOB, chat, keys
from support.wait import wait_for

from kvplay.wire.codec import hex_to_wire_hash
from kvplay.wire.mirror import Fleet
from kvplay.wire.publisher import KVEventsConfig
from kvplay.wire.subscriber import PodSource, Subscriber

FULL = {"vllm_xargs": {"kv_cache_report_mode": "full"}}
SYSTEM = "Be brief and kind. " * 4


def engine_index(eng) -> dict:
    """wire hash -> creator of every block the engine's prefix index holds (read while idle)."""
    pool = eng.pool
    out = {}
    for bid in range(len(pool.blocks)):
        b = pool.blocks[bid]
        if b.hash is not None and b.indexed:
            out[hex_to_wire_hash(pool.hex(b.hash))] = b.creator
    return out


def test_mirror_equals_the_engine_index_through_evictions(serve, tmp_path, free_port):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    fleet = Fleet()
    # kvplay serve follows vLLM: a non-wildcard endpoint connects, so we bind
    sub = Subscriber([PodSource("kvplay", ev, bind=True, replay=rep, topic="kv-events")], fleet).open()
    # a bound SUB subscribes a connecting publisher only while it is polled: poll all along, as watch does
    th = threading.Thread(target=sub.run, daemon=True)
    th.start()
    try:
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
        srv, state = serve(keys=keys(tmp_path), kv_events=cfg, num_blocks=48)
        m = fleet.pod("kvplay")
        cached = {}
        with httpx.Client(timeout=60) as c:
            for i, (key, who) in enumerate([(ALICE, "alice"), (BOB, "bob")] * 3):
                r = chat(c, srv.url, key, f"question number {i} from {who}: " + "why? " * (20 * i),
                         system=SYSTEM, **FULL)
                assert r.status_code == 200, r.text
                cached.setdefault(who, []).append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        pub = state.side.events.publisher
        state.side.engine.call(lambda: None)  # every step of those turns has ended and handed its batch over
        wait_for(lambda: pub.idle and pub.next_seq > 0 and m.last_seq == pub.next_seq - 1 and m.pod_state == "live",
                 timeout=20.0)
    finally:
        sub.stop()
        th.join(5)
        sub.close()
    want = engine_index(state.side.engine)
    assert m.removed > 0, "the small pool should have evicted"
    assert set(m.blocks) == set(want)  # no missing block, no resurrected one
    assert {h: b.creator for h, b in m.blocks.items()} == want
    assert set(m.by_session) <= {"alice", "bob"} and m.creators()["alice"] > 0
    # every cached token a reply reported was re-announced (report mode "full") as a hit
    bs = state.side.engine.config.block_size
    assert m.reannounced * bs == sum(sum(v) for v in cached.values()) and m.reannounced > 0
    assert m.gaps == 0 and m.restarts == 0
