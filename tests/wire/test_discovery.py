"""Discovery of KV-event endpoints by URL (wire/discovery.py), over real HTTP on 127.0.0.1: vLLM's
three /kv_event_sources shapes, SGLang's /server_info, wildcard vs concrete endpoints, bounded
and hostile answers; `kvplay watch URL` end to end against a real publisher."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


from kvplay.wire.codec import BlockStored, EventBatch, WireError
from kvplay.wire.discovery import MAX_RESPONSE_BYTES, Unreachable, discover
from kvplay.wire.publisher import ZmqEventPublisher


class Canned:
    """An HTTP server on 127.0.0.1 answering GET paths with canned bodies (status, bytes)."""

    def __init__(self, routes: dict):
        self.routes = routes
        self.seen: list[tuple[str, str | None]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.seen.append((self.path, self.headers.get("authorization")))
                status, body = outer.routes.get(self.path, (404, b'{"detail": "Not Found"}'))
                if not isinstance(body, (bytes, bytearray)):
                    body = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned():
    made = []

    def make(routes):
        c = Canned(routes)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


VLLM_032 = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
                  "max_queue_size": 100000, "topic": "kv"},
            "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.1.2.3:6001",
                  "replay_endpoint": "tcp://0.0.0.0:6002", "topic": "kv"}}
ARRAY = [{"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": None, "topic": ""},
         {"data_parallel_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560", "topic": ""}]


@pytest.mark.parametrize("body", [VLLM_032, ARRAY, {"sources": ARRAY}])
def test_vllm_kv_event_sources_all_three_shapes(canned, body):
    c = canned({"/kv_event_sources": (200, body)})
    found = discover(c.url)
    port = c.url.rpartition(":")[2]
    assert found.via == "GET /kv_event_sources"
    names = [s.name for s in found.sources]
    assert names == [f"127.0.0.1:{port}/dp0", f"127.0.0.1:{port}/dp1"]  # one pod per DP rank, in rank order
    r0, r1 = found.sources
    assert r0.endpoint == "tcp://127.0.0.1:5557" and not r0.bind  # wildcard: the server's host
    if body is VLLM_032:
        assert r0.replay == "tcp://127.0.0.1:5558" and r0.topic == "kv"
        assert r1.endpoint == "tcp://10.1.2.3:6001" and r1.bind  # concrete: the server connects, we bind
        assert r1.replay == "tcp://127.0.0.1:6002"               # a replay ROUTER is always bound by the server
    else:
        assert r0.replay == "tcp://127.0.0.1:5560" and r1.endpoint == "tcp://127.0.0.1:5558" and r1.replay is None


def test_sglang_server_info(canned):
    c = canned({"/kv_event_sources": (404, {}), "/server_info": (200, {
        "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 7000, "topic": "t",
                      "block_size": 16, "dp_size": 2}, "page_size": 16})})
    found = discover(c.url + "/v1", api_key="sk-x")
    assert found.via == "GET /server_info" and found.block_size == 16
    assert [(s.endpoint, s.bind, s.replay, s.topic) for s in found.sources] == [
        ("tcp://127.0.0.1:7000", False, None, "t"), ("tcp://127.0.0.1:7001", False, None, "t")]
    assert ("/server_info", "Bearer sk-x") in c.seen  # the key is sent


def test_a_single_rank_pod_is_named_for_the_server(canned):
    c = canned({"/kv_event_sources": (200, {"0": VLLM_032["0"]})})
    (src,) = discover(c.url).sources
    assert src.name == c.url[len("http://"):]


@pytest.mark.parametrize("routes, msg", [
    ({}, "lists no KV-event publisher"),
    ({"/kv_event_sources": (200, {})}, "lists no KV-event publisher"),       # vLLM without events
    ({"/server_info": (200, {"kv_events": None})}, "lists no KV-event publisher"),  # SGLang without
    ({"/kv_event_sources": (200, {"0": {"enable_kv_cache_events": False, "publisher": "null"}})},
     "lists no KV-event publisher"),
    ({"/kv_event_sources": (200, b"not json")}, "not JSON"),
    ({"/kv_event_sources": (200, b"[" * 100000)}, "not JSON"),
    ({"/kv_event_sources": (200, {"x": {}})}, "not a DP rank"),
    ({"/kv_event_sources": (200, [{"endpoint": "tcp://*:99999"}])}, "no usable port"),
    ({"/kv_event_sources": (200, [{"endpoint": "http://evil"}])}, "ZeroMQ endpoint"),
    ({"/kv_event_sources": (200, [{"endpoint": ["tcp://*:1"]}])}, "not an endpoint"),
    ({"/kv_event_sources": (200, [{"endpoint": "tcp://*:1"}] * 1000)}, "at most"),
    ({"/kv_event_sources": (200, b" " * (MAX_RESPONSE_BYTES + 10))}, "larger than"),
    ({"/server_info": (200, {"kv_events": {"endpoint_port_base": "5557"}})}, "not a port"),
    ({"/server_info": (200, {"kv_events": {"endpoint_port_base": 5557, "dp_size": 10 ** 9}})}, "ranks"),
    ({"/kv_event_sources": (401, {})}, "refused the API key"),
])
def test_nothing_or_nonsense_is_one_line(canned, routes, msg):
    c = canned(routes)
    with pytest.raises(WireError) as e:
        discover(c.url)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_an_unreachable_server_is_unreachable(free_port):
    with pytest.raises(Unreachable):
        discover(f"http://127.0.0.1:{free_port()}", timeout=2)


def test_watch_url_finds_the_publisher_itself(canned, tmp_path):
    """`kvplay watch URL` with no --events: the server's /kv_event_sources says where (a
    wildcard bound on loopback), watch connects there and mirrors what it publishes."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", bind=True)
    port = pub.endpoint.rpartition(":")[2]
    rport = pub.replay_endpoint.rpartition(":")[2]
    c = canned({"/kv_event_sources": (200, {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://*:{port}",
                                                   "replay_endpoint": f"tcp://*:{rport}", "topic": "kv"}})})
    try:
        for i in range(3):
            pub.publish(EventBatch(time.time(), [BlockStored([i + 1], i or None, [1, 2], 2, None, "GPU", None,
                                                             session_id="alice")]))
        p = subprocess.Popen([sys.executable, "-m", "kvplay", "watch", c.url, "--json", "--duration", "6",
                              "--no-record"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=120)
    finally:
        pub.shutdown()
    assert p.returncode == 0, err
    assert "GET /kv_event_sources" in err and f"connect to tcp://127.0.0.1:{port}" in err
    s = json.loads(out.strip().splitlines()[-1])["pods"][c.url[len("http://"):]]
    assert s["blocks"] == 3 and s["by_session"] == {"alice": 3}  # published before it joined: a replay brought them


def test_watch_url_with_nothing_advertised_is_exit_2(canned, capsys):
    from kvplay.cli import main

    c = canned({})
    assert main(["watch", c.url, "--no-record"]) == 2
    err = capsys.readouterr().err
    assert "lists no KV-event publisher" in err and err.count("\n") == 1
