"""`kvplay serve` and miss attribution: the opt-in per-request breakdown (`return_miss_details`),
only for the key that sent the request and without other tenants in it unless the key is an
admin's, and the `kvplay:prefix_cache_miss_tokens_total{reason}` counters."""
from __future__ import annotations

import json

import httpx

from kvplay.cli import main as cli
from kvplay.serve.keys import load_keys
from kvplay.sessions.query import session_turns, with_misses
from kvplay.sessions.store import open_db

from support.serve import chat
from support.wait import wait_for

KEYS = """
[[keys]]
key = "sk-alice-0123456789"
user = "alice"
[[keys]]
key = "sk-carol-0123456789"
user = "carol"
[[keys]]
key = "sk-root-0123456789"
user = "root"
admin = true
"""
ALICE, CAROL, ROOT = "sk-alice-0123456789", "sk-carol-0123456789", "sk-root-0123456789"


def three_keys(tmp_path):
    p = tmp_path / "keys.toml"
    p.write_text(KEYS)
    return load_keys(str(p))


def samples(text: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def miss_series(text: str) -> dict:
    return {k.split('reason="')[1].split('"')[0]: v for k, v in samples(text).items()
            if k.startswith("kvplay:prefix_cache_miss_tokens_total")}


def test_isolated_tokens_are_named_for_an_admin_and_cold_for_a_tenant(serve, tmp_path):
    srv, _ = serve(keys=three_keys(tmp_path), isolation="user", explain_across_keys=True)
    with httpx.Client(timeout=30) as c:
        first = chat(c, srv.url, ALICE, "the same question")
        assert "miss" not in first.json()["kvplay"]  # opt-in
        carol = chat(c, srv.url, CAROL, "the same question", return_miss_details=True).json()
        root = chat(c, srv.url, ROOT, "the same question", return_miss_details=True).json()
        bad = chat(c, srv.url, CAROL, "x", return_miss_details="yes")
        admin_text = c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {ROOT}"}).text
        tenant_text = c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {CAROL}"}).text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_miss_details"
    usage = carol["usage"]
    n, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == 0
    m = carol["kvplay"]["miss"]  # carol's own view: alice's identical blocks are not hers to know about
    assert m["tokens"] == n - cached and m["reasons"]["isolated"] == 0 and m["isolated_from"] == {}
    assert m["reasons"]["cold"] == (n - 1) // 16 * 16
    assert "alice" not in json.dumps(carol)
    full = root["kvplay"]["miss"]  # an admin key sees whose blocks would have hit
    assert full["reasons"]["isolated"] == (n - 1) // 16 * 16 and set(full["isolated_from"]) == {"alice"}
    # the counters: by reason only; a tenant's scrape counts isolated tokens as cold
    admin, tenant = miss_series(admin_text), miss_series(tenant_text)
    assert admin["isolated"] == 2 * ((n - 1) // 16 * 16) and admin["tail"] > 0
    assert "isolated" not in tenant and tenant["cold"] == admin["cold"] + admin["isolated"]
    assert sum(admin.values()) == sum(tenant.values())
    q = samples(admin_text)
    total = q['vllm:prefix_cache_queries_total{model_name="tiny:llama",engine="0"}']
    hits = q['vllm:prefix_cache_hits_total{model_name="tiny:llama",engine="0"}']
    assert sum(admin.values()) == total - hits  # every uncached prompt token has one reason
    assert all("user=" not in line for line in admin_text.splitlines() if "miss_tokens" in line)


def test_by_default_keys_are_not_looked_across_so_isolated_tokens_are_cold_for_everyone(serve, tmp_path):
    """Without --explain-across-keys a keyed server explains a miss from the sender's own keys
    only (the lookup across keys would take longer the further another key's identical prompt
    goes: a time channel through isolation): an admin sees alice's identical blocks as cold too,
    and the counters have no isolated tokens."""
    srv, _ = serve(keys=three_keys(tmp_path), isolation="user")
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "the same question")
        root = chat(c, srv.url, ROOT, "the same question", return_miss_details=True).json()
        admin = miss_series(c.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {ROOT}"}).text)
    n = root["usage"]["prompt_tokens"]
    full = root["kvplay"]["miss"]
    assert full["reasons"]["isolated"] == 0 and full["isolated_from"] == {}
    assert full["reasons"]["cold"] == (n - 1) // 16 * 16
    assert admin.get("isolated", 0) == 0 and admin["cold"] == 2 * ((n - 1) // 16 * 16)


def test_explain_finds_offline_what_a_keyed_server_did_not_look_across_keys_for(serve, tmp_path, capsys):
    """The server explains each miss from its sender's own keys (no lookup across keys on the
    request's path) and records that it did (`own_keys`); `kvplay explain` on the recording then
    names, from the simulation of the same trace, the tokens another key held: isolated, from
    whom, and what shared isolation would give. The recorded counts are only renamed."""
    srv, state = serve(keys=three_keys(tmp_path), isolation="user", record=True)
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, "the same question")
        root = chat(c, srv.url, ROOT, "the same question", return_miss_details=True).json()
        chat(c, srv.url, CAROL, "a question of her own")
    n = root["usage"]["prompt_tokens"]
    assert root["kvplay"]["miss"]["own_keys"] is True and root["kvplay"]["miss"]["reasons"]["isolated"] == 0
    db_path = str(tmp_path / "sessions.db")

    def recorded() -> list[dict]:
        db = open_db(db_path, create=False)
        try:
            sid = db.execute("select id from sessions").fetchone()[0]
            return with_misses(db, sid, session_turns(db, sid))
        finally:
            db.close()
    wait_for(lambda: len(recorded()) == 3 and all(t["miss"] for t in recorded()), timeout=30)
    turns = recorded()
    assert all(t["miss"]["own_keys"] for t in turns)
    sid = open_db(db_path, create=False).execute("select id from sessions").fetchone()[0]
    capsys.readouterr()
    assert cli(["explain", sid, "--db", db_path, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    full = (n - 1) // 16 * 16
    assert r["attribution"] == "recorded"
    by_user = {t["user"]: t for t in r["turns"]}
    # root's prompt is alice's; carol's shares the chat template's first blocks with alice's
    assert by_user["root"]["reasons"]["isolated"] == full and by_user["root"]["reasons"]["cold"] == 0
    assert by_user["alice"]["reasons"]["isolated"] == 0 and 0 < by_user["carol"]["reasons"]["isolated"] < full
    iso = by_user["root"]["reasons"]["isolated"] + by_user["carol"]["reasons"]["isolated"]
    assert r["own_keys"] == {"turns": 3, "renamed_turns": 2, "tokens": iso}
    assert r["missed"]["reasons"]["isolated"] == iso
    for t in r["turns"]:  # renamed, not recounted: each turn's reasons still sum to its uncached tokens
        assert sum(t["reasons"].values()) == t["prompt_tokens"] - t["cached_tokens"]
    assert {(e["user"], e["from"]) for e in r["isolation"]["from"]} == {("root", "alice"), ("carol", "alice")}
    assert r["isolation"]["projected"]["hit_rate"] > r["simulated_hit_rate"]
    assert cli(["explain", sid, "--db", db_path]) == 0
    text = capsys.readouterr().out
    assert "3 turns were explained from their sender's own keys" in text and "root would have hit alice's" in text
    # a replay explains each miss as the recording did (from the sender's own keys): the same reasons
    assert cli(["replay", sid, "--db", db_path, "--headless", "--json", "--no-record"]) == 0
    comps = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()][:-1]
    assert len(comps) == 3 and all(c["miss_equal"] for c in comps), [(c["user"], c["miss_then"], c["miss_now"]) for c in comps]


def test_another_tenants_eviction_says_others_and_a_stream_carries_the_miss(serve, tmp_path):
    srv, _ = serve(keys=three_keys(tmp_path), isolation="user", num_blocks=24)
    system, question = "Be brief.", "one question, asked at length " * 4
    with httpx.Client(timeout=30) as c:
        chat(c, srv.url, ALICE, question, system=system)
        # carol's allocation (22 of the 24 blocks) evicts alice's cached ones
        chat(c, srv.url, CAROL, "tell me everything about sourdough " * 9, system=system, max_tokens=16)
        events = []
        with c.stream("POST", srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ALICE}"}, json={
                "model": "tiny:llama", "stream": True, "max_tokens": 2, "return_miss_details": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    assert events and "error" not in events[0], events[:2]
    final = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")][0]
    m = final["kvplay"]["miss"]
    assert m["reasons"]["evicted"] > 0 and m["evicted_by"] == {"others": m["reasons"]["evicted"]}
    assert "carol" not in json.dumps(events)
    assert events[-1]["kvplay"]["miss"] == m  # the usage chunk carries it too
