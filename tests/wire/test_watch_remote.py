"""The remote ChatBackend (`kvplay attach`) against `kvplay serve`: panes' turns stream over
HTTP, the block map reads slots filled from the KV events, per turn "cached N tokens, from whom"."""
from __future__ import annotations

import pytest

from support.recorded import recorded
from support.wait import wait_for

from kvplay.engine.sampling import SamplingParams
from kvplay.wire.publisher import KVEventsConfig
from kvplay.wire.remote import RemoteBackend
from kvplay.wire.subscriber import PodSource

SYSTEM = "Be brief and kind to every customer of the bakery. " * 3


def msgs(text):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def test_remote_backend_over_kvplay_serve(serve, tmp_path, free_port):
    ev, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=ev, replay_endpoint=rep, topic="kv-events")
    backend = None
    try:
        # the server's publisher connects (a non-wildcard endpoint): the backend binds, polls all along
        srv, state = serve(kv_events=cfg, num_blocks=64)
        backend = RemoteBackend(srv.url, sources=[PodSource("kvplay", ev, bind=True, replay=rep, topic="kv-events")])
        assert backend.model_name == "tiny:llama"
        seen = []
        backend.subscribe_batches(lambda b: seen.extend(b.events))
        # the app's recorder takes a backend as it takes an engine (subscribe, stats)
        from kvplay.sessions.recorder import Recorder

        rec = Recorder.open(str(tmp_path / "s.db"), None, backend.model_name, "app", SYSTEM)
        rec.attach(backend)
        sp = SamplingParams(max_tokens=4)
        backend.register_user("alice")
        backend.register_user("bob")
        a = backend.submit("alice", msgs("hello there"), sp)
        deltas = list(a)
        ra = a.result(30)
        assert ra.error is None and ra.text == "".join(d.text for d in deltas) and ra.text
        assert ra.stats.prompt_tokens > 0 and ra.stats.cached_tokens == 0 and ra.stats.ttft_ms is not None
        b = backend.submit("bob", msgs("hello again"), sp)
        rb = b.result(30)
        assert rb.stats.cached_tokens > 0
        assert rb.stats.cached_from == {"alice": rb.stats.cached_tokens}  # from whom: alice's blocks
        # the block map: every mirrored block has a slot, coloured by its creator
        wait_for(lambda: any(e.kind == "BlockHit" for e in seen), 10, poll=0.05)
        m = backend.fleet.pod("kvplay")
        st = backend.stats()
        assert st["blocks_cached"] == len(m.blocks) > 0 and st["hit_tokens"] == rb.stats.cached_tokens
        arr = backend.arrays()
        assert int((arr.state == 1).sum()) == len(m.blocks)
        creators = {arr.users[c] for c in arr.creator[arr.state == 1]}
        assert creators == {"alice", "bob"}
        summ = backend.summary(8)
        assert int(summ.cached.sum()) == len(m.blocks) and summ.free.sum() + summ.cached.sum() == backend.num_blocks
        stored = [e for e in seen if e.kind == "BlockStored"]
        assert stored and all(len(e.block_ids) == len(e.block_hashes) for e in stored)
        view = backend.block(stored[0].block_ids[0])
        assert view.state == "cached" and view.creator == "alice" and "bob" in view.users
        assert backend.block(backend.num_blocks - 1).state == "free"
        rec.record_turn("bob", "hello again", msgs("hello again"), sp, rb)
        rec.close()
        import sqlite3

        con = sqlite3.connect(tmp_path / "s.db")
        assert con.execute("select user, cached_tokens, cached_from from turns").fetchall() == [
            ("bob", rb.stats.cached_tokens, '{"alice":%d}' % rb.stats.cached_tokens)]
        assert recorded(tmp_path / "s.db", kinds=("BlockStored",))
    finally:
        if backend is not None:
            backend.close()


def test_remote_backend_unreachable_is_one_line(free_port):
    from kvplay.engine.errors import EngineError

    with pytest.raises(EngineError, match="cannot reach"):
        RemoteBackend(f"http://127.0.0.1:{free_port()}")
