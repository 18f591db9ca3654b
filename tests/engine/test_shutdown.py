"""Shutdown never loses a request and never lets two threads drive the scheduler (issue 9 item 6):
a submit racing the final drain is served or refused, a join timeout leaves the failing to the
engine thread, and waiting on a result never hangs."""
from __future__ import annotations

import threading

import pytest

from support.wait import wait_for

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.errors import EngineError
from kvplay.engine.events import FirstToken, RequestFinished
from kvplay.engine.sampling import SamplingParams


def _wait_dead(eng, limit=30.0):
    wait_for(lambda: not eng.alive, limit, "the engine thread to stop")


def test_submits_racing_shutdown_are_served_or_refused(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=256), tiny_llama).start()
    handles, refused, stop = [], [], threading.Event()
    lock = threading.Lock()

    def client(i):
        n = 0
        while not stop.is_set():
            try:
                h = eng.submit(f"u{i}", prompt_ids=[3 + i, 4, 5, n % 50 + 6], sampling=SamplingParams(max_tokens=2))
            except EngineError as exc:
                with lock:
                    refused.append(str(exc))
                return
            with lock:
                handles.append(h)
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(handles) >= 50, what="the clients to be submitting")  # then shut down under them
    eng.shutdown()
    stop.set()
    for t in threads:
        t.join(10)
    assert handles and refused and all("shut down" in r for r in refused)
    for h in handles:  # every accepted request ends: a reply or the shutdown error, never a hang
        res = h.result(10)
        assert res.ok or "shut down" in res.error
    assert eng.stats()["blocks_in_use"] == 0
    eng.pool.check()


def test_join_timeout_leaves_failing_to_the_engine_thread(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=128), tiny_llama).start()
    in_step, release = threading.Event(), threading.Event()
    events = []

    def listener(ev):
        events.append(ev)
        if isinstance(ev, FirstToken) and not in_step.is_set():
            in_step.set()
            release.wait(10)  # hold the engine thread inside its step

    eng.subscribe_batches(lambda b: [listener(e) for e in b.events])
    sp = SamplingParams(max_tokens=50, stop_on_eos=False)
    hs = [eng.submit(u, prompt_ids=[7, 8, 9, i + 10] * 5, sampling=sp) for i, u in enumerate("abc")]
    assert in_step.wait(30)
    thread = eng._thread
    eng.shutdown(timeout=0.05)  # times out: the engine thread is still in its step
    with pytest.raises(EngineError, match="shut down"):
        eng.submit("late", prompt_ids=[1, 2, 3])
    with pytest.raises(EngineError, match="shut down"):
        eng.clear_cache()
    release.set()
    results = [h.result(10) for h in hs]
    thread.join(30)
    assert not thread.is_alive() and not eng.alive
    assert eng.failure is None, eng.failure  # nobody freed blocks under the running step
    for r in results:
        assert r.finish_reason == "error" and "shut down" in r.error
    finished = {e.request_id: e.seq for e in events if isinstance(e, RequestFinished)}
    assert set(finished) == {h.request_id for h in hs}
    for e in events:  # nothing happens to a request after it finished
        rid = getattr(e, "request_id", None)
        if rid in finished and not isinstance(e, RequestFinished):
            assert e.seq < finished[rid], e
    assert eng.stats()["blocks_in_use"] == 0
    eng.pool.check()


def test_a_handle_never_waits_for_an_engine_that_is_not_running(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=64), tiny_llama)  # never started
    req = eng.make_request("alice", prompt_ids=[1, 2, 3])
    with pytest.raises(EngineError, match="engine stopped"):
        req.handle.result()
    eng.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        eng.submit("alice", prompt_ids=[1, 2, 3])


def test_player_reports_a_stuck_turn_as_failed_and_cancels_it(make_engine, monkeypatch):
    from kvplay.sessions import player

    monkeypatch.setattr(player, "TURN_TIMEOUT_S", 0.3)
    eng = make_engine()
    # the engine thread held between steps until the turn has timed out: stuck whatever the
    # machine's speed (a tiny model reaches its context limit within 0.3 s on a quiet machine)
    entered, gate = threading.Event(), threading.Event()
    holder = threading.Thread(target=eng.call, args=(lambda: (entered.set(), gate.wait(30)),), daemon=True)
    holder.start()
    assert entered.wait(10)
    job = player.Job(1, "alice", "go on for ever", SamplingParams(max_tokens=100000, stop_on_eos=False),
                     messages=[{"role": "user", "content": "go on for ever"}])
    try:
        [done] = player.play(eng, [job], "")
    finally:
        gate.set()
        holder.join(10)
    assert not done.ok and "not finished" in done.error
    wait_for(lambda: eng.stats()["running"] == 0, 10, poll=0.05)
    assert eng.stats()["running"] == 0 and eng.stats()["blocks_in_use"] == 0
