"""`kvplay serve` on a network it does not control (issue 20): each test is one reproduced
attack, run for real on loopback (tiny model, real ZMQ, real HTTP)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import pytest
import zmq

from support.serve import ALICE, BOB, chat, keys
from support.wait import wait_for
from support.subscribe import Handshakes


def sse_events(resp):
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in resp.iter_lines() if line.startswith("data: ")]


def events_config(**kw):
    from kvplay.wire.publisher import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, endpoint=kw.pop("endpoint", "tcp://127.0.0.1:*"),
                          replay_endpoint=kw.pop("replay_endpoint", "tcp://127.0.0.1:*"), **kw)


def publish_until(pub, sock, timeout=5.0):
    """Publish batches until `sock` receives one (or the time is up); the frames or None."""
    from kvplay.wire.codec import AllBlocksCleared, EventBatch

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.publish(EventBatch(time.time(), [AllBlocksCleared()]))
        if sock.poll(100):
            return sock.recv_multipart()
    return None


@contextlib.contextmanager
def live_publisher():
    """A publisher on loopback and a subscriber already receiving its live batches."""
    from kvplay.wire.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    ctx = zmq.Context()
    try:
        good = ctx.socket(zmq.SUB)
        good.setsockopt(zmq.SUBSCRIBE, b"kv")
        good.connect(pub.endpoint)
        assert publish_until(pub, good) is not None
        yield pub, ctx, good
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)


# --- 1. events are private: CURVE on both sockets -------------------------------------------------
def test_curve_publisher_admits_only_allowed_subscribers(tmp_path):
    from kvplay.wire import curve
    from kvplay.wire.publisher import ZmqEventPublisher

    d = curve.generate(tmp_path / "keys")
    server = curve.ServerCurve.load(d)
    allowed = curve.ClientCurve.load(str(d / "server.key"), str(d / "client.key_secret"))
    _, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
    stranger = curve.ClientCurve.load(str(d / "server.key"), stranger_secret)
    assert oct(os.stat(d).st_mode & 0o777) == "0o700"
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", curve=server)
    ctx = zmq.Context()
    try:
        def sub(keys):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            if keys is not None:
                keys.apply(s)
            hs = Handshakes(s)
            s.connect(pub.endpoint)
            return s, hs

        (plain, plain_hs), (wrong, wrong_hs), (good, good_hs) = sub(None), sub(stranger), sub(allowed)
        frames = publish_until(pub, good)
        assert frames is not None and frames[0] == b"kv"  # the allowed key decodes the stream
        for hs in (plain_hs, wrong_hs):  # the server refused both handshakes (no CURVE; a key it does not allow)
            hs.wait(ok=0, failed=1)
        assert publish_until(pub, good) is not None  # a batch sent after the refusals
        for s in (plain, wrong):  # a plain SUB and an unknown key get nothing, however long
            assert not s.poll(300)
        for hs in (plain_hs, wrong_hs, good_hs):
            hs.close()

        def replay(keys):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                keys.apply(dealer)
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
            return dealer

        r_plain, r_good = replay(None), replay(allowed)
        assert r_good.poll(5000) and r_good.recv_multipart()[1] == b"kv"
        assert not r_plain.poll(500)  # the whole history is not handed to an anonymous DEALER
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)


def test_event_endpoints_off_loopback_need_keys_and_curve_or_insecure(tmp_path):
    from kvplay.engine.errors import EngineError
    from kvplay.serve.server import check_event_endpoints
    from kvplay.wire import curve

    ks = keys(tmp_path)
    # without keys: the guard catches every non-loopback spelling, not only * / 0.0.0.0 / ::
    for ep in ("tcp://0:5558", "tcp://eth0:5558", "tcp://10.1.2.3:5558", "tcp://nonexistent.invalid:5558"):
        with pytest.raises(EngineError, match="loopback"):
            check_event_endpoints(events_config(replay_endpoint=ep), None, loopback=True)
    assert check_event_endpoints(events_config(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558"),
                                 None, loopback=True) == []  # vLLM's default, rewritten to 127.0.0.1
    assert check_event_endpoints(events_config(replay_endpoint="tcp://localhost:5558"), None, loopback=True) == []
    # with keys on a network: CURVE, or the operator's explicit insecure flag
    wide = events_config(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    with pytest.raises(EngineError, match="kv-events-curve"):
        check_event_endpoints(wide, ks, loopback=False)
    assert check_event_endpoints(wide, ks, loopback=False, insecure=True) == ["tcp://*:5557", "tcp://*:5558"]
    server = curve.ServerCurve.load(curve.generate(tmp_path / "k"))
    assert check_event_endpoints(wide, ks, loopback=False, curve=server) == []


def test_http_loopback_guard_resolves_the_host():
    from kvplay.serve.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    for host in ("0", "0.0.0.0", "::", "eth0", "10.0.0.1", "nonexistent.invalid", ""):
        assert not is_loopback(host), host


def test_cli_refuses_open_events_without_keys_before_loading(tmp_path, capsys):
    from kvplay.cli import main

    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0:5558"})
    assert main(["serve", "--kv-events-config", cfg, "--no-record", "--model", "tiny:llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tcp://0:5558" in err[0] and "loopback" in err[0]
    kf = tmp_path / "keys.toml"
    kf.write_text('[[keys]]\nkey = "sk-alice-0123456789"\nuser = "alice"\n')
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    assert main(["serve", "--api-keys", str(kf), "--host", "0.0.0.0", "--kv-events-config", cfg,
                 "--no-record", "--model", "tiny:llama"]) == 2
    assert "--kv-events-insecure" in capsys.readouterr().err
    assert main(["serve", "--explain-across-keys", "--no-record", "--model", "tiny:llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--explain-across-keys goes with --api-keys" in err[0]


def test_watch_subscribes_with_curve_keys(tmp_path):
    """`kvplay watch`'s flags give the subscriber's sockets the keys (kvplay/commands/watch.py)."""
    import argparse

    from kvplay.wire import curve
    from kvplay.wire.publisher import ZmqEventPublisher
    from kvplay.wire.subscriber import Subscriber
    from kvplay.commands.watch import configure, sources_from_args

    d = curve.generate(tmp_path / "keys")
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=curve.ServerCurve.load(d))
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--events", pub.endpoint, "--replay", pub.replay_endpoint,
                         "--events-curve-server-key", str(d / "server.key"),
                         "--events-curve-key", str(d / "client.key_secret")])
    sub = Subscriber(sources_from_args(args)).open()
    try:
        from kvplay.wire.codec import AllBlocksCleared, EventBatch

        def got():
            pub.publish(EventBatch(time.time(), [AllBlocksCleared()]))
            sub.poll(50)
            return sub.fleet.pods[next(iter(sub.fleet.pods))].last_seq >= 0

        wait_for(got)
    finally:
        sub.close()
        pub.shutdown()


def test_attach_by_url_subscribes_with_curve_keys(make_engine, tmp_path):
    """`kvplay attach URL` finds a CURVE server's endpoints and subscribes with its flags' keys;
    without them its map stays empty (kvplay/commands/attach.py)."""
    from kvplay.cli import build_parser
    from kvplay.serve.server import ServerThread, build_state, close_state
    from kvplay.commands.attach import open_backend
    from kvplay.wire import curve

    d = curve.generate(tmp_path / "keys")
    state = build_state(make_engine(), kv_events=events_config(), curve=curve.ServerCurve.load(d))
    srv = ServerThread(state).start()
    backends = []
    try:
        for flags in ([], ["--events-curve-server-key", str(d / "server.key"),
                           "--events-curve-key", str(d / "client.key_secret")]):
            args = build_parser("attach").parse_args(["attach", srv.url, *flags])
            backends.append(open_backend(args))
        # the keyed subscriber's subscription is through: a probe batch reaches it (the other is refused)
        from kvplay.wire.codec import AllBlocksCleared, EventBatch

        pub = state.side.events.publisher
        wait_for(lambda: any(m.last_seq >= 0 for m in backends[1].fleet.pods.values()), 15,
                 before=lambda: pub.publish(EventBatch(time.time(), [AllBlocksCleared()])), poll=0.05)
        with httpx.Client(timeout=60) as c:
            assert chat(c, srv.url, content="a secret", user="alice").status_code == 200
        wait_for(lambda: any(p.blocks for p in backends[1].fleet.pods.values()), 15)
        assert not any(p.blocks for p in backends[0].fleet.pods.values())
    finally:
        for be in backends:
            be.close()
        srv.stop()
        close_state(state)


# --- 2. a request can only fail itself -----------------------------------------------------------
def test_sampling_failure_ends_only_that_request(make_engine):
    from kvplay.engine.sampling import SamplingParams

    eng = make_engine()
    other = eng.submit("bob", prompt_ids=list(range(5, 40)), sampling=SamplingParams(max_tokens=24, stop_on_eos=False))
    poison = SamplingParams(temperature=1.0, max_tokens=24)
    req = eng.make_request("mallory", prompt_ids=list(range(50, 80)), sampling=poison)
    poison.temperature = float("nan")  # past validation, before the engine sees it: the sampler itself raises
    eng.call(lambda: eng.take_in(req))
    r_bad, r_other = req.handle.result(60), other.result(60)
    assert r_bad.finish_reason == "error" and "sampling" in r_bad.error
    assert r_other.error is None and len(r_other.token_ids) == 24
    assert eng.alive
    assert eng.generate("carol", [{"role": "user", "content": "still there?"}],
                        SamplingParams(max_tokens=3)).error is None


def test_tiny_and_infinite_temperatures_while_another_user_streams(serve):
    srv, _ = serve()
    out = {}

    def stream():
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 48,
                    "temperature": 0.8, "seed": 1, "stream": True, "user": "alice", "ignore_eos": True}) as s:
                out["alice"] = sse_events(s)

    t = threading.Thread(target=stream)
    t.start()
    with httpx.Client(timeout=60) as c:
        tiny = chat(c, srv.url, content="x", temperature=1e-300, user="mallory")
        greedy = chat(c, srv.url, content="x", temperature=0, user="mallory")
        inf = c.post(srv.url + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"x"}],'
                                                                b'"temperature":Infinity}')
        nan_p = c.post(srv.url + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"x"}],'
                                                                  b'"top_p":NaN}')
        t.join(60)
        health = c.get(srv.url + "/health")
    assert tiny.status_code == 200, tiny.text  # below vLLM's epsilon: greedy
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    assert inf.status_code == 400 and inf.json()["error"]["param"] == "temperature"
    assert nan_p.status_code == 400 and nan_p.json()["error"]["param"] == "top_p"
    events = out["alice"]
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert health.status_code == 200


# --- 3. bounded work before admission --------------------------------------------------------------
def test_prompts_refused_by_size_before_tokenizing(serve):
    srv, state = serve()
    calls = []
    real = state.tokenizers.run
    state.tokenizers.run = lambda *a: calls.append(1) or real(*a)
    with httpx.Client(timeout=60) as c:
        many = c.post(srv.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}] * 200_000})
        huge = c.post(srv.url + "/v1/completions", json={"prompt": "x" * (4 << 20)})
        huge_chat = chat(c, srv.url, content="y" * (1 << 20))
        ok = chat(c, srv.url, content="two tokens", user="ann")
    assert many.status_code == 400 and "at most 1024" in many.json()["error"]["message"]
    for r in (huge, huge_chat):
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "characters" in r.json()["error"]["message"]
    assert ok.status_code == 200
    assert len(calls) == 1  # only the small prompt was tokenized


def test_a_long_tokenization_does_not_hold_other_requests(serve):
    """No global tokenizer lock: while one tokenization runs (held here until the other request
    is answered), another user's chat is tokenized on a copy."""
    srv, state = serve()
    started, release = threading.Event(), threading.Event()

    def slow(tok):
        started.set()
        release.wait(60)

    holder = threading.Thread(target=state.tokenizers.run, args=(slow,))
    holder.start()
    try:
        assert started.wait(10)
        with httpx.Client(timeout=60) as c:
            r = chat(c, srv.url, content="not waiting", user="ann")
        assert r.status_code == 200 and holder.is_alive()  # answered while the other still tokenizes
    finally:
        release.set()
        holder.join(10)


def test_a_body_that_does_not_arrive_gets_408(serve, monkeypatch):
    import kvplay.serve.app as app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)
    srv, _ = serve()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408")


def test_concurrency_cap_answers_503_with_retry_after(make_engine):
    from kvplay.serve.server import ServerThread, build_state, close_state

    state = build_state(make_engine(), max_concurrent=1)
    srv = ServerThread(state).start()
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hold"}], "max_tokens": 64, "stream": True,
                    "ignore_eos": True}) as s:
                lines = s.iter_lines()
                next(lines)  # the stream is admitted and running
                busy = chat(c, srv.url, content="me too")
                for _ in lines:
                    pass
            after = chat(c, srv.url, content="now")
    finally:
        srv.stop()
        close_state(state)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "server_busy"
    assert after.status_code == 200 and state.admission.active == 0


def test_slow_and_idle_connections_are_closed(serve, monkeypatch):
    import kvplay.serve.server as server

    monkeypatch.setattr(server, "HEADER_TIMEOUT_S", 0.5)
    srv, _ = serve()
    socks = []
    for i in range(4):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        if i % 2:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        socks.append(s)
    try:
        for s in socks:
            assert s.recv(1024) == b""  # closed by the server, not left open
        with httpx.Client(timeout=30) as c:
            assert c.get(srv.url + "/health").status_code == 200
    finally:
        for s in socks:
            s.close()


def test_threads_do_not_grow_with_n(serve):
    srv, _ = serve()
    before = threading.active_count()
    seen = []
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "many"}], "max_tokens": 16, "n": 16, "stream": True,
                "ignore_eos": True, "temperature": 0.7}) as s:
            for line in s.iter_lines():
                seen.append(threading.active_count())
    assert seen and max(seen) - before < 8  # was one thread per choice (16)


def test_health_is_503_only_once_the_engine_thread_has_stopped(serve):
    srv, state = serve()
    with httpx.Client(timeout=30) as c:
        bad = c.post(srv.url + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"x"}],'
                                                              b'"temperature":NaN}')
        up = c.get(srv.url + "/health")
        state.side.engine.shutdown()
        down = c.get(srv.url + "/health")
    assert bad.status_code == 400 and up.status_code == 200
    assert down.status_code == 503 and "engine is down" in down.json()["error"]["message"]


# --- 4. ZMQ under abuse ------------------------------------------------------------------------------
FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.XSUB)
s.setsockopt(zmq.SNDHWM, 0)
s.setsockopt(zmq.RECONNECT_IVL, 600_000)  # once cut, stay away
gone = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
s.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.send(b"\\x01" + b"spam-%08d" % i)
print("cut" if gone.poll(30_000) else "not cut", flush=True)
time.sleep(600)  # the subject: connected (if it was not cut) until the test kills it
"""


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stored_batch(n_tokens: int):
    from kvplay.wire.codec import BlockStored, EventBatch

    return EventBatch(time.time(), [BlockStored([1], None, list(range(n_tokens)), 16, None, "GPU", None)])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_subscription_flood_peer_is_cut_and_its_memory_returned():
    """libzmq keeps every subscription a peer sends until it leaves (300k: ~60 MB held with the
    old XPUB_MANUAL socket): the flooding connection is cut, the live subscriber keeps its feed."""
    with live_publisher() as (pub, ctx, good):
        before = rss_mb()
        flood = subprocess.Popen([sys.executable, "-c", FLOODER, pub.endpoint, "300000"],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout.readline().strip() == "cut"  # the server hung up on it
            assert pub.peers_cut >= 1
            for _ in range(20):  # the live feed meanwhile and after
                pub.publish(stored_batch(4))
            assert publish_until(pub, good) is not None
            wait_for(lambda: pub.heap_trims >= 1, 10)  # the publisher trims the heap after a cut
            assert rss_mb() - before < 25  # held while the flooder stayed connected: ~60 MB
        finally:
            flood.kill()
            flood.wait()


def test_replay_hammer_is_cut_and_live_batches_keep_flowing():
    with live_publisher() as (pub, ctx, good):
        hammers = []
        for _ in range(4):
            h = ctx.socket(zmq.DEALER)
            h.setsockopt(zmq.SNDHWM, 0)
            h.setsockopt(zmq.LINGER, 0)
            h.connect(pub.replay_endpoint)
            for _ in range(10_000):
                h.send_multipart([b"", (0).to_bytes(8, "big")])
            hammers.append(h)
        live, sent = 0, 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and live < 50:
            if sent < 50:
                pub.publish(stored_batch(4))
                sent += 1
            while good.poll(20):
                good.recv_multipart()
                live += 1
        assert live == 50  # every live batch arrived, in the middle of the hammer
        wait_for(lambda: pub.peers_cut >= 4, 10)  # 10k requests is over any peer's budget
        assert pub.replay_refused > 0


def test_replay_waits_for_a_slow_reader_instead_of_dropping_frames():
    """An answer larger than the peer's pipes goes out as the peer reads (ROUTER_MANDATORY):
    none of it is silently dropped."""
    from kvplay.wire.codec import END_SEQ
    from kvplay.wire.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_steps=3000)
    ctx = zmq.Context()
    try:
        for _ in range(3000):
            pub.publish(stored_batch(2000))  # ~6 kB a batch: 18 MB, more than the pipes hold
        wait_for(lambda: pub.next_seq == 3000, 30)
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 100)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1.5)  # the subject: a reader that does not read for a while (the server's pipe to it fills)
        seqs = []
        while d.poll(5000):
            frames = d.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                break
            seqs.append(seq)
        assert seqs == list(range(3000))
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)


# --- 5. safe defaults with keys ---------------------------------------------------------------------
def test_keys_default_to_user_isolation_and_shared_says_what_leaks(tmp_path):
    kf = tmp_path / "keys.toml"
    kf.write_text('[[keys]]\nkey = "sk-alice-0123456789"\nuser = "alice"\n')

    def first_lines(*extra):
        p = subprocess.Popen([sys.executable, "-m", "kvplay", "serve", "--api-keys", str(kf), "--port", "0",
                              "--no-record", "--model", "tiny:llama", "--num-blocks", "32", *extra],
                             stderr=subprocess.PIPE, text=True)
        lines = []
        killer = threading.Timer(120, p.kill)  # a line that never comes fails the test, never hangs it
        killer.start()
        try:
            for line in p.stderr:
                lines.append(line)
                if "serving" in line:
                    if "shared" in line or "--explain-across-keys" in extra:
                        lines.append(p.stderr.readline())
                    break
        finally:
            killer.cancel()
            p.terminate()
            p.wait(30)
        return "".join(lines)

    assert "isolation user" in first_lines()
    out = first_lines("--isolation", "shared")
    assert "isolation shared" in out and "cached_from" in out
    out = first_lines("--explain-across-keys")
    assert "isolation user" in out and "can time that walk" in out


# --- 6. the small ones ------------------------------------------------------------------------------
def test_metrics_users_flag_gives_the_user_series_to_every_key(make_engine, tmp_path):
    from kvplay.serve.server import ServerThread, build_state, close_state

    state = build_state(make_engine(), keys(tmp_path), metrics_users=True)
    srv = ServerThread(state).start()
    try:
        with httpx.Client(timeout=30) as c:
            chat(c, srv.url, ALICE, "one")
            chat(c, srv.url, BOB, "one")
            alice = c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
    finally:
        srv.stop()
        close_state(state)
    assert "# TYPE kvplay:cached_tokens_total" in alice  # without the flag: admin keys only


def test_hostile_bodies_are_400_without_exception_text(serve):
    srv, _ = serve()
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with httpx.Client(timeout=60) as c:
        url = srv.url + "/v1/chat/completions"
        r_deep = c.post(url, content=deep)
        r_sur = c.post(url, content=b'{"messages":[{"role":"user","content":"\\ud800"}]}')
        r_key = c.post(url, content=b'{"messages":[{"role":"user","content":"x"}],"\\udc00":1}')
        r_opts = chat(c, srv.url, stream_options={"include_usage": True})
    for r in (r_deep, r_sur, r_key, r_opts):
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "Error" not in msg and "Traceback" not in msg
    assert r_opts.json()["error"]["param"] == "stream_options"


def test_encrypted_tls_key_takes_a_password_and_never_prompts(make_engine, tmp_path, capsys):
    import shutil

    from kvplay.cli import main
    from kvplay.serve.server import ServerThread, build_state, close_state

    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:s3cret", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert main(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--no-record"]) == 2
    assert "--ssl-keyfile-password" in capsys.readouterr().err
    state = build_state(make_engine())
    srv = ServerThread(state, ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_keyfile_password="s3cret").start()
    try:
        with httpx.Client(timeout=30, verify=False) as c:
            assert c.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
        close_state(state)


def test_sessions_db_is_created_owner_only(tmp_path):
    from kvplay.sessions.store import open_db

    p = tmp_path / "sessions.db"
    open_db(p).close()
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
