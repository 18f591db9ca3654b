"""`kvplay serve` discoverable like vLLM (GET /kv_event_sources) and SGLang (GET /server_info), with
/tokenize and /detokenize; and `kvplay attach URL` finding its events with no other flag. A real
server (tiny model) on 127.0.0.1."""
from __future__ import annotations

import httpx
import pytest

from support.attach import attach_args
from support.serve import ALICE, chat, keys
from support.wait import wait_for

from kvplay.commands.attach import open_backend
from kvplay.wire.discovery import discover
from kvplay.wire.publisher import KVEventsConfig


def events_cfg(endpoint=None, replay=True, topic="kv-events"):
    """Bound on ports the publisher picks (`*`): what it advertises is the port it got."""
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint or "tcp://*:*",
                          replay_endpoint="tcp://*:*" if replay else None, topic=topic)


def test_kv_event_sources_is_vllms_shape(serve):
    cfg = events_cfg()
    srv, state = serve(kv_events=cfg, num_blocks=32)
    pub = state.side.events.publisher
    body = httpx.get(srv.url + "/kv_event_sources").json()
    port, rport = pub.endpoint.rpartition(":")[2], pub.replay_endpoint.rpartition(":")[2]
    assert body == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                          "replay_endpoint": f"tcp://*:{rport}", "buffer_steps": 10000, "hwm": 100000,
                          "max_queue_size": 100000, "topic": "kv-events"}}
    info = httpx.get(srv.url + "/server_info").json()
    assert info["kv_events"] == {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": int(port),
                                 "topic": "kv-events", "block_size": 16, "dp_size": 1}
    assert info["page_size"] == 16 and info["dp_size"] == 1


def test_without_events_or_with_a_connecting_publisher(serve, free_port):
    srv, _ = serve(num_blocks=32)
    assert httpx.get(srv.url + "/kv_event_sources").json() == {}
    assert httpx.get(srv.url + "/server_info").json()["kv_events"] is None
    ep = f"tcp://127.0.0.1:{free_port()}"  # concrete: the publisher connects, the consumer binds
    srv2, _ = serve(kv_events=events_cfg(ep, replay=False), num_blocks=32)
    assert httpx.get(srv2.url + "/kv_event_sources").json()["0"]["endpoint"] == ep
    assert httpx.get(srv2.url + "/server_info").json()["kv_events"] is None  # SGLang's descriptor: bound TCP only
    (src,) = discover(srv2.url).sources
    assert src.endpoint == ep and src.bind


def test_detokenize_reverses_tokenize(serve):
    """/detokenize (ours) takes what /tokenize (vLLM's, serve/app.py) gives: vLLM's and SGLang's
    response keys."""
    srv, state = serve(num_blocks=32)
    tok = state.side.engine.tokenizer
    body = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello bakery"}).json()
    assert body["tokens"] == tok("Hello bakery")["input_ids"]
    d = httpx.post(srv.url + "/detokenize", json={"tokens": body["tokens"], "skip_special_tokens": False}).json()
    assert d["prompt"] == d["text"] == tok.decode(body["tokens"]) and "Hello bakery" in d["text"]


@pytest.mark.parametrize("path, body, status, text", [
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, 400, "not an integer"),
    ("/detokenize", {"tokens": [True]}, 400, "not an integer"),
    ("/detokenize", {"tokens": "1 2"}, 400, "list of token ids"),
    ("/detokenize", {"tokens": [1] * ((1 << 17) + 1)}, 413, "more than"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": "yes"}, 400, "true or false"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "does not exist"),
])
def test_bad_detokenize_input_is_an_openai_error(serve, path, body, status, text):
    srv, _ = serve(num_blocks=32)
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == status and text in r.json()["error"]["message"]


def test_with_keys_every_info_route_needs_one(serve, tmp_path):
    srv, _ = serve(keys=keys(tmp_path), kv_events=events_cfg(), num_blocks=32)
    for method, path, body in [("GET", "/kv_event_sources", None), ("GET", "/server_info", None),
                               ("POST", "/detokenize", {"tokens": [1]})]:
        assert httpx.request(method, srv.url + path, json=body).status_code == 401
        ok = httpx.request(method, srv.url + path, json=body, headers={"Authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200


def test_attach_url_alone_mirrors_kvplay_serve(serve, capsys):
    """`kvplay attach http://127.0.0.1:PORT` with no other flag: the endpoints come from the
    server's /kv_event_sources and the map mirrors its cache."""
    srv, state = serve(kv_events=events_cfg(), num_blocks=64)
    backend = open_backend(attach_args(srv.url))
    try:
        assert "GET /kv_event_sources" in capsys.readouterr().err
        (name,) = backend.pods
        m = backend.fleet.pod(name)
        with httpx.Client(timeout=120) as c:
            def ask():
                assert chat(c, srv.url, content="Do you sell rye bread?", user="alice").status_code == 200

            # the subscription may reach the publisher after a first step: alice asks until a batch arrives
            wait_for(lambda: m.last_seq >= 0, 60, before=ask, poll=0.2)
            assert chat(c, srv.url, content="And croissants?", user="bob").status_code == 200
        want = state.side.engine.stats()["blocks_cached"]
        wait_for(lambda: len(m.blocks) == want and m.pod_state == "live", 30, poll=0.05)
        assert set(m.by_session) <= {"alice", "bob"} and m.by_session["alice"] > 0
    finally:
        backend.close()


def test_watch_url_alone_mirrors_kvplay_serve(serve, tmp_path):
    """`kvplay watch http://127.0.0.1:PORT` with no --events mirrors kvplay serve's cache."""
    import json
    import subprocess
    import sys

    srv, state = serve(kv_events=events_cfg(), num_blocks=64)
    with httpx.Client(timeout=120) as c:  # before watch starts: only the replay can bring these
        assert chat(c, srv.url, content="Do you sell rye bread?", user="alice").status_code == 200
        assert chat(c, srv.url, content="And croissants?", user="bob").status_code == 200
    r = subprocess.run([sys.executable, "-m", "kvplay", "watch", srv.url, "--json", "--duration", "4", "--no-record"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GET /kv_event_sources" in r.stderr
    (pod,) = json.loads(r.stdout.strip().splitlines()[-1])["pods"].values()
    assert pod["blocks"] == state.side.engine.stats()["blocks_cached"] > 0
    assert pod["state"] == "live" and set(pod["by_session"]) == {"alice", "bob"}
