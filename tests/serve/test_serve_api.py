"""`kvplay serve` over real HTTP on loopback, tiny model: identity, isolation, shapes, bad input,
disconnects, load."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from support.serve import ALICE, BOB, SYSTEM, chat, keys
from support.wait import wait_for


def sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_completion_and_stream_shapes(serve):
    srv, _ = serve()
    with httpx.Client(timeout=30) as c:
        r = chat(c, srv.url, user="ann")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "tiny:llama"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
        assert body["kvplay"]["user"] == "ann" and body["kvplay"]["cached_from"] == {}
        # the same prompt again, streamed: the reply is the same (greedy) and the prefix is cached
        with c.stream("POST", srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
                "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "user": "ben"}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        assert text == body["choices"][0]["message"]["content"]
        last = events[-2]
        assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert last["kvplay"]["cached_from"] == {"ann": last["usage"]["prompt_tokens_details"]["cached_tokens"]}
        assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_completions_string_and_token_ids(serve):
    srv, state = serve()
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    ids = list(state.side.engine.tokenizer(prompt)["input_ids"])
    with httpx.Client(timeout=30) as c:
        a = c.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        b = c.post(srv.url + "/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0})
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["usage"]["prompt_tokens"] == len(ids)
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16


@pytest.mark.parametrize("isolation", ["shared", "user"])
def test_two_keys_shared_vs_user_isolation(serve, tmp_path, isolation):
    srv, _ = serve(keys=keys(tmp_path), isolation=isolation)
    with httpx.Client(timeout=30) as c:
        a = chat(c, srv.url, ALICE, "first question")
        b = chat(c, srv.url, BOB, "second question")
    assert a.status_code == b.status_code == 200
    assert a.json()["kvplay"]["user"] == "alice" and b.json()["kvplay"]["user"] == "bob"
    cached = b.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    if isolation == "shared":
        assert cached >= 64 and b.json()["kvplay"]["cached_from"] == {"alice": cached}
    else:
        assert cached == 0 and b.json()["kvplay"]["cached_from"] == {}


def test_body_cannot_claim_another_user(serve, tmp_path):
    srv, _ = serve(keys=keys(tmp_path), isolation="user")
    with httpx.Client(timeout=30) as c:
        assert chat(c, srv.url, ALICE, "my secret").status_code == 200
        r = chat(c, srv.url, BOB, "my secret", user="alice", session_id="alice", cache_salt="user:alice")
        again = chat(c, srv.url, ALICE, "my secret")
    assert r.status_code == 200
    assert r.json()["kvplay"]["user"] == "bob"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "alice" not in r.json()["kvplay"]["cached_from"]
    assert again.json()["kvplay"]["cached_from"].get("alice", 0) > 0  # alice's own blocks still serve her


def test_api_key_errors(serve, tmp_path):
    srv, _ = serve(keys=keys(tmp_path))
    with httpx.Client(timeout=30) as c:
        missing = chat(c, srv.url)
        wrong = chat(c, srv.url, "sk-not-a-key-000")
        models = c.get(srv.url + "/v1/models")
        ok = c.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {BOB}"})
        health = c.get(srv.url + "/health")
    for r in (missing, wrong, models):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny:llama"
    assert health.status_code == 200


def test_bad_inputs_get_openai_errors(serve):
    srv, _ = serve(num_blocks=12)  # 12 blocks of 16 tokens: a 300-token prompt cannot fit
    url = srv.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(content=b"{not json"), 400),
        (dict(content=b""), 400),
        (dict(json=[1, 2]), 400),
        (dict(json={"model": "gpt-4", "messages": msgs}), 404),
        (dict(json={"messages": []}), 400),
        (dict(json={"messages": "hi"}), 400),
        (dict(json={"messages": [{"role": "wizard", "content": "x"}]}), 400),
        (dict(json={"messages": msgs, "max_tokens": -3}), 400),
        (dict(json={"messages": msgs, "max_tokens": 10 ** 12}), 400),
        (dict(json={"messages": msgs, "max_tokens": "ten"}), 400),
        (dict(json={"messages": msgs, "temperature": "hot"}), 400),
        (dict(json={"messages": msgs, "top_p": 0}), 400),
        (dict(json={"messages": msgs, "stream": "yes"}), 400),
        (dict(json={"messages": msgs, "n": 0}), 400),
        (dict(json={"messages": msgs, "n": 17}), 400),
        (dict(json={"messages": msgs, "n": 1.5}), 400),
        (dict(json={"messages": [{"role": "user", "content": "x" * 5000}]}), 400),  # > 4096 context
        (dict(json={"messages": [{"role": "user", "content": "x" * 300}]}), 413),  # > the pool
    ]
    with httpx.Client(timeout=30) as c:
        for kw, status in cases:
            r = c.post(url, headers={"content-type": "application/json"}, **kw)
            assert r.status_code == status, (kw, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in r.text, r.text
        r = c.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 10 ** 9]})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        r = c.post(srv.url + "/v1/nothing", json={})
        assert r.status_code == 404 and r.json()["error"]["message"]
        ctx = c.post(url, json={"messages": [{"role": "user", "content": "x" * 5000}]}).json()["error"]
        assert ctx["code"] == "context_length_exceeded"
        # and the server still serves
        assert c.post(url, json={"messages": msgs, "max_tokens": 2}).status_code == 200


def test_stop_strings_cut_the_reply(serve):
    srv, _ = serve()
    with httpx.Client(timeout=30) as c:
        full = chat(c, srv.url, max_tokens=12, user="u").json()["choices"][0]["message"]["content"]
        stop = full[3:5]
        cut = full[:full.find(stop)]
        r = chat(c, srv.url, max_tokens=12, stop=[stop], user="u").json()
        with c.stream("POST", srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
                "max_tokens": 12, "temperature": 0, "stop": stop, "stream": True}) as s:
            events = sse_events(s)
    assert r["choices"][0]["message"]["content"] == cut and r["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e.get("choices"))
    assert streamed == cut


def test_openai_sdk_streams_a_chat(serve, tmp_path):
    openai = pytest.importorskip("openai")
    srv, _ = serve(keys=keys(tmp_path))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=ALICE, max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="tiny:llama", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=5, temperature=0)
    assert again.choices[0].message.content == text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong-00000", max_retries=0).models.list()


def test_disconnect_cancels_and_frees_blocks_at_once(serve):
    srv, state = serve(max_running=4)
    eng = state.side.engine
    other: dict = {}
    finished: dict = {}
    eng.subscribe_batches(lambda b: [finished.setdefault(ev.user, ev) for ev in b.events if type(ev).__name__ == "RequestFinished"])

    def bystander():
        with httpx.Client(timeout=60) as c:
            other["r"] = chat(c, srv.url, content="I keep going", max_tokens=40, user="calm", ignore_eos=True)

    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "talk forever " * 10}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True, "user": "leaver"}) as s:
            t = threading.Thread(target=bystander)
            t.start()
            lines = s.iter_lines()
            for line in lines:
                if '"content"' in line and '"content":""' not in line:
                    break
            assert eng.stats()["running"] >= 1
        # the response is closed: the request is cancelled and its blocks go back now,
        # long before 3000 tokens could have been generated
        wait_for(lambda: "leaver" in finished)
    assert finished["leaver"].finish_reason == "cancelled"
    assert finished["leaver"].stats["output_tokens"] < 3000
    t.join(60)
    assert other["r"].status_code == 200 and other["r"].json()["usage"]["completion_tokens"] == 40
    wait_for(lambda: eng.stats()["blocks_in_use"] == 0)
    eng.call(eng.pool.check)


def test_32_concurrent_streams_and_health_answers(serve):
    srv, state = serve(num_blocks=256, max_running=16)
    n = 32
    results: list = [None] * n
    health: list[int] = []
    done = threading.Event()

    def client(i):
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"client {i} says hello"}],
                    "max_tokens": 8, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "user": f"u{i % 4}"}) as s:
                results[i] = (s.status_code, sse_events(s))

    def poll_health():
        with httpx.Client(timeout=10) as c:
            while not done.is_set():
                health.append(c.get(srv.url + "/health").status_code)
                done.wait(0.05)  # sampled every 50 ms until the load is over

    h = threading.Thread(target=poll_health)
    h.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    done.set()
    h.join(10)
    assert all(r is not None for r in results)
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 8
    assert sum(e[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] for _, e in results) > 0
    assert health and set(health) == {200}


def test_metrics_and_reset(serve, tmp_path):
    srv, state = serve(keys=keys(tmp_path))
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "one")
        chat(c, srv.url, BOB, "two")
        open_text = c.get(srv.url + "/metrics").text
        text = c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {BOB}"}).text  # admin
        alice_text = c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}).text
        assert c.post(srv.url + "/reset_prefix_cache").status_code == 401
        denied = c.post(srv.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {ALICE}"})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
        reset = c.post(srv.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {BOB}"})
        after = chat(c, srv.url, BOB, "two")
    assert reset.status_code == 200
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    hits = samples['vllm:prefix_cache_hits_total{model_name="tiny:llama",engine="0"}']
    assert hits > 0 and samples['vllm:prefix_cache_queries_total{model_name="tiny:llama",engine="0"}'] > hits
    assert samples['kvplay:cached_tokens_total{model_name="tiny:llama",engine="0",creator="alice",user="bob"}'] == hits
    # who reuses whose cache: only for an admin key (issue 20, item 5)
    assert "creator=" not in open_text and "creator=" not in alice_text
    assert "vllm:prefix_cache_hits_total" in open_text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_cached_total"):
        assert f"# TYPE {name} " in text


def test_serve_records_turns(serve, tmp_path):
    import sqlite3

    srv, state = serve(keys=keys(tmp_path), record=True)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "one")
        chat(c, srv.url, BOB, "two")
    wait_for(lambda: sqlite3.connect(tmp_path / "sessions.db").execute(
        "select count(*) from turns").fetchone()[0] == 2)
    db = sqlite3.connect(tmp_path / "sessions.db")
    users = dict(db.execute("select name, \"group\" from users").fetchall())
    assert users == {"alice": "team-a", "bob": "team-b"}
    rows = db.execute("select user, text, cached_tokens, cached_from from turns order by seq").fetchall()
    assert [r[:2] for r in rows] == [("alice", "one"), ("bob", "two")]
    assert json.loads(rows[1][3]) == {"alice": rows[1][2]} and rows[1][2] > 0
    assert db.execute("select source from sessions").fetchone()[0] == "serve"


def test_a_served_session_replays_its_completion_turns_too(serve, tmp_path, capsys):
    """A completion turn has no messages: it is recorded with the token ids the engine was given,
    and `kvplay replay` sends those again (it used to fail the turn as an empty message)."""
    import sqlite3

    from kvplay.cli import main

    srv, _ = serve(keys=keys(tmp_path), record=True, deterministic=True)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "one")
        r = c.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {BOB}"},
                   json={"prompt": "abc abc abc def", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
    db = tmp_path / "sessions.db"
    wait_for(lambda: sqlite3.connect(db).execute("select count(*) from turns").fetchone()[0] == 2)
    con = sqlite3.connect(db)
    sid = con.execute("select id from sessions").fetchone()[0]
    messages, ids = con.execute("select messages, prompt_ids from turns where user = 'bob'").fetchone()
    assert json.loads(messages) == [] and len(json.loads(ids)) == r.json()["usage"]["prompt_tokens"]
    capsys.readouterr()
    assert main(["replay", sid, "--db", str(db), "--headless", "--json", "--no-record"]) == 0
    comps = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()][:-1]
    assert sorted(c["user"] for c in comps) == ["alice", "bob"]
    assert all(c["equal"] and not c["error"] for c in comps)


def test_n_choices_share_the_prompt_and_stream_with_their_index(serve, tmp_path):
    """n > 1: n requests for one prompt, each its own sample (seed, seed + 1, ...); the later
    ones reuse the first one's blocks; usage counts the prompt once and every completion."""
    import sqlite3

    srv, _ = serve(keys=keys(tmp_path), record=True)
    with httpx.Client(timeout=60) as c:
        kw = dict(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
        r = chat(c, srv.url, ALICE, "tell me a story", **kw).json()
        again = chat(c, srv.url, ALICE, "tell me a story", **kw).json()
        with c.stream("POST", srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {BOB}"}, json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
                "max_tokens": 5, "temperature": 0, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as s:
            events = sse_events(s)
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
    texts = [ch["message"]["content"] for ch in r["choices"]]
    assert texts == [ch["message"]["content"] for ch in again["choices"]]  # seeded per choice
    assert len(set(texts)) > 1  # different samples
    assert r["usage"]["completion_tokens"] == 18 and r["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
    per = r["kvplay"]["choices"]
    assert len(per) == 3 and len({p["request_id"] for p in per}) == 3
    assert max(p["cached_tokens"] for p in per[1:]) > 0  # the prompt's blocks are shared
    chunks = [e for e in events[:-1] if e.get("choices")]
    by_index = {}
    for e in chunks:
        ch = e["choices"][0]
        by_index.setdefault(ch["index"], []).append(ch)
    assert set(by_index) == {0, 1}
    for idx, chs in by_index.items():
        assert chs[0]["delta"].get("role") == "assistant" and chs[-1]["finish_reason"] == "length"
    greedy = ["".join(ch["delta"].get("content") or "" for ch in chs) for chs in by_index.values()]
    assert greedy[0] == greedy[1]  # temperature 0: the same reply twice
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 10 and events[-2]["choices"] == []
    wait_for(lambda: sqlite3.connect(tmp_path / "sessions.db").execute(
        "select count(*) from turns").fetchone()[0] == 8)  # every choice is a recorded turn


def test_cli_refuses_unsafe_setups(tmp_path, capsys):
    from kvplay.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--no-record"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert main(["serve", "--isolation", "user", "--no-record"]) == 2
    assert "--api-keys" in capsys.readouterr().err
    bad = tmp_path / "k.toml"
    bad.write_text('[[keys]]\nkey = "short"\nuser = "a"\n')
    assert main(["serve", "--api-keys", str(bad), "--no-record"]) == 2
    assert "8 characters" in capsys.readouterr().err
    assert main(["serve", "--kv-events-config", "{nope", "--no-record"]) == 2
    assert "JSON" in capsys.readouterr().err


def test_one_users_errors_never_disturb_anothers_stream(serve):
    srv, _ = serve(num_blocks=24)
    box: dict = {}

    def streamer():
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "a long story please"}], "max_tokens": 60,
                    "ignore_eos": True, "stream": True, "user": "steady"}) as s:
                box["events"] = sse_events(s)

    t = threading.Thread(target=streamer)
    t.start()
    with httpx.Client(timeout=30) as c:
        bad_requests = [{"messages": []}, {"messages": [{"role": "user", "content": "x" * 600}]},
                        {"messages": [{"role": "user", "content": "hi"}], "top_k": "many"}, "not an object"]
        for body in bad_requests * 3:
            r = c.post(srv.url + "/v1/chat/completions", json=body)
            assert r.status_code in (400, 413) and r.json()["error"]["message"]
    t.join(60)
    events = box["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events[1:-2] if e["choices"][0]["delta"].get("content") is not None) >= 1


@pytest.mark.slow
def test_two_people_chat_through_the_openai_sdk_on_the_embedded_model(serve, smollm, tmp_path):
    """The README's demo: two keys, the embedded model, the openai SDK; the second person's
    prompt reuses the first one's system prompt, and says from whom."""
    openai = pytest.importorskip("openai")
    srv, state = serve(loaded=smollm, model="default", num_blocks=None, cache_mb=64, keys=keys(tmp_path))
    system = "You are a concise assistant for the kvplay team. " * 6
    replies = {}
    for key, user in ((ALICE, "alice"), (BOB, "bob")):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=state.model_name, stream=True, stream_options={"include_usage": True}, max_tokens=8,
            temperature=0, messages=[{"role": "system", "content": system},
                                     {"role": "user", "content": f"Say hello to {user}."}])
        chunks = list(stream)
        replies[user] = ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1])
    alice_text, _ = replies["alice"]
    _, last = replies["bob"]
    assert alice_text.strip()
    cached = last.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64
    assert last.model_extra["kvplay"]["cached_from"] == {"alice": cached}


def test_a_non_streaming_client_that_leaves_is_cancelled_too(serve):
    # a pool that holds all 3,000 tokens: the request can only end by the client leaving (with 64
    # blocks it could end `pool_exhausted` first, before the server noticed the client was gone)
    srv, state = serve(num_blocks=256)
    eng = state.side.engine
    finished: dict = {}
    eng.subscribe_batches(lambda b: [finished.setdefault(ev.user, ev) for ev in b.events if type(ev).__name__ == "RequestFinished"])
    # the client leaves after 0.3 s: the 3,000 tokens took 1.0-1.5 s on the 2-core EPYC (a 1 s
    # timeout let them finish first in some runs)
    with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "ignore_eos": True,
                "user": "impatient"})
    wait_for(lambda: "impatient" in finished)
    assert finished["impatient"].finish_reason == "cancelled"
    wait_for(lambda: eng.stats()["blocks_in_use"] == 0)


def test_kvplay_serve_command_end_to_end(tmp_path):
    """The real command in a subprocess: listens, serves, records, and a SIGTERM ends the session."""
    import os
    import re
    import signal
    import sqlite3
    import subprocess
    import sys

    db = tmp_path / "s.db"
    proc = subprocess.Popen([sys.executable, "-m", "kvplay", "serve", "--model", "tiny:llama", "--num-blocks", "32",
                             "--port", "0", "--db", str(db)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "kvplay serve exited early"
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        with httpx.Client(timeout=30) as c:
            assert chat(c, url, user="solo").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    con = sqlite3.connect(db)
    assert con.execute("select ended is not null, source from sessions").fetchone() == (1, "serve")
    assert con.execute("select user from turns").fetchall() == [("solo",)]


def test_https_with_a_certificate(make_engine, tmp_path):
    import shutil
    import subprocess

    from kvplay.serve.server import ServerThread, build_state, close_state

    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    state = build_state(make_engine(), keys(tmp_path))
    srv = ServerThread(state, ssl_keyfile=str(key), ssl_certfile=str(cert)).start()
    try:
        assert srv.url.startswith("https://")
        with httpx.Client(timeout=30, verify=False) as c:
            r = chat(c, srv.url, ALICE, "over TLS")
        assert r.status_code == 200 and r.json()["kvplay"]["user"] == "alice"
    finally:
        srv.stop()
        close_state(state)


def test_cli_refuses_a_bad_certificate_before_loading(tmp_path, capsys):
    from kvplay.cli import main

    bad = tmp_path / "nope.pem"
    bad.write_text("not a certificate")
    assert main(["serve", "--ssl-certfile", str(bad), "--ssl-keyfile", str(bad), "--no-record"]) == 2
    assert "--ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", str(bad), "--no-record"]) == 2


def test_logprobs_chat_and_completions(serve):
    srv, _ = serve()
    with httpx.Client(timeout=30) as c:
        r = chat(c, srv.url, max_tokens=5, logprobs=True, top_logprobs=3, user="lp").json()
        with c.stream("POST", srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
                "max_tokens": 5, "temperature": 0, "logprobs": True, "stream": True}) as s:
            events = sse_events(s)
        comp = c.post(srv.url + "/v1/completions", json={"prompt": "abc abc abc", "max_tokens": 4, "temperature": 0,
                                                          "logprobs": 2}).json()
        refused = chat(c, srv.url, top_logprobs=2)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 5
    assert "".join(e["token"] for e in content) == r["choices"][0]["message"]["content"]
    for e in content:  # greedy: the chosen token is the most likely one
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
    streamed = [x for e in events[:-1] if e.get("choices") and e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["logprob"] for x in streamed] == [x["logprob"] for x in content]
    lp = comp["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"] and len(lp["token_logprobs"]) == 4
    assert lp["text_offset"][0] == 0 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert refused.status_code == 400
