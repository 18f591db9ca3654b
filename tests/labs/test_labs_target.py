"""The leak and determinism labs against a real server (`--target URL`): `kvplay serve` on the tiny
model over loopback HTTP (fast), and briefly a real vLLM CPU server (marked vllm + slow). No
timing assertions: what is checked is what the server reported (cached tokens, agreement), the
lab's cold baselines and its bad input."""
from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest
from support.serve import ALICE, BOB, keys
from support.vllm import vllm_cpu

from kvplay.engine.errors import EngineError
from kvplay.commands import lab as lab_cli
from kvplay.labs import target as tg


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    lab_cli.configure(p)
    return p.parse_args(list(argv))


def _leak(url, **kw):
    t = tg.Target(url, kw.pop("api_key", None), kw.pop("other_api_key", None)).connect()
    try:
        p = tg.TargetLeakParams(blocks=[1, 2], samples=3, calibration=1, **kw)
        return t, tg.run_leak(t, p)
    finally:
        t.close()


def test_leak_against_kvplay_serve_finds_block_size_and_the_victims_blocks(serve):  # noqa: F811
    srv, state = serve(num_blocks=256)
    t, r = _leak(srv.url, salts=["none", "per-user"])
    assert r.config["block_size"] == state.side.engine.config.block_size == 16  # found from cached_tokens
    assert r.config["reset_before"] == "POST /reset_prefix_cache"
    rows = r.data["results"]
    assert [(x["salt"], x["blocks"]) for x in rows] == [("none", 1), ("none", 2), ("per-user", 1), ("per-user", 2)]
    for x in rows:
        assert len(x["hit_ms"]) == len(x["miss_ms"]) == 3 and 0.0 <= x["auc"] <= 1.0
        assert x["hit_cached_tokens"] == x["tokens"]  # every hit probe reused exactly the victim's k blocks
    # kvplay serve salts by API key, never by a body field: the per-user cache_salt is ignored, and the verdict says so
    assert "ignores cache_salt" in r.verdict and "With no cache_salt (3 hit + 3 miss probes per row) — " in r.verdict
    assert all(x["auc_lo"] <= x["auc"] <= x["auc_hi"] and x["call"] for x in r.data["results"])


def test_leak_two_api_keys_under_user_isolation_share_nothing(serve, tmp_path):  # noqa: F811
    srv, _ = serve(keys=keys(tmp_path), isolation="user", num_blocks=256)
    t, r = _leak(srv.url, api_key=ALICE, other_api_key=BOB, block_size=16)
    assert all(x["hit_cached_tokens"] == 0 for x in r.data["results"])  # bob's blocks are salted with bob's key
    with pytest.raises(EngineError, match="401"):
        tg.Target(srv.url, "sk-not-a-key-123").connect()


def test_leak_verdict_says_a_separation_without_reuse_is_not_the_cache():
    # the rows as run_leak makes them; a "leak" call where the server cached nothing for any hit probe
    row = {"salt": "none", "blocks": 1, "tokens": 16, "n_hit": 102, "n_miss": 102, "auc": 0.37, "auc_lo": 0.30,
           "auc_hi": 0.45, "ks_p": 0.96, "accuracy": 0.5, "median_hit_ms": 38.0, "median_miss_ms": 37.4,
           "call": "leak", "hit_cached_tokens": 0.0}
    said = tg._leak_verdict([row], "kvplay")
    assert "LEAK" in said and "reused none of the victim's blocks" in said and "another --seed" in said
    reused = tg._leak_verdict([dict(row, hit_cached_tokens=16.0, auc=1.0, auc_lo=1.0, auc_hi=1.0)], "kvplay")
    quiet = tg._leak_verdict([dict(row, call="no evidence of a leak", auc=0.5, auc_lo=0.42, auc_hi=0.58)], "kvplay")
    assert "reused none" not in reused and "reused none" not in quiet


def test_determinism_against_kvplay_serve_deterministic_mode_agrees(serve):  # noqa: F811
    srv, _ = serve(num_blocks=256, deterministic=True)
    t = tg.Target(srv.url).connect()
    try:
        p = tg.TargetDeterminismParams(prompts=["Hello there?", "Why?"], max_tokens=4)
        r = tg.run_determinism(t, p)
    finally:
        t.close()
    kinds = r.data["summary"]["kinds"]
    assert set(kinds) == {"cold again", "warm: same prompt (alice)", "warm: system prompt (alice)"}
    assert all(k["n"] == 2 and k["agree"] == 2 for k in kinds.values())  # deterministic mode: cached == cold
    assert kinds["cold again"]["warm"] == 0 and kinds["warm: same prompt (alice)"]["warm"] == 2
    assert kinds["warm: system prompt (alice)"]["warm"] == 2
    assert r.data["summary"]["by"] == ["text"]  # kvplay serve sends no logprobs
    assert "POST /reset_prefix_cache before every cold run" in r.verdict


def test_compare_outputs_by_token_ids_and_gap():
    def got(ids, gaps, text="x"):
        return {"text": text, "logprobs": [{"tokens": [f"token_id:{i}" for i in ids],
                                            "top_logprobs": [{"a": -0.1, "b": -0.1 - g} for g in gaps]}]}
    same = tg.compare_outputs(got([5, 6, 7], [2.0, 0.5, 1.0]), got([5, 6, 7], [2.0, 0.5, 1.0]))
    assert same["agree"] and same["by"] == "token ids" and same["min_top2_gap_cold"] == pytest.approx(0.5)
    d = tg.compare_outputs(got([5, 6, 7], [2.0, 0.5, 1.0]), got([5, 9, 7], [2.0, 0.5, 1.0]))
    assert not d["agree"] and d["first_divergence"] == 1 and d["top2_gap_cold"] == pytest.approx(0.5)
    t = tg.compare_outputs({"text": "abc"}, {"text": "ab"})  # no logprobs: by text, a shorter output diverges
    assert t["by"] == "text" and not t["agree"] and t["first_divergence"] == 2


def test_cli_leak_target_json_and_bad_input(serve):  # noqa: F811
    srv, _ = serve(num_blocks=256)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = lab_cli.main(_args("leak", "--target", srv.url, "--blocks", "1", "--samples", "2", "--json",
                                "--cache-salt-per-user"))
    assert rc == 0
    res = json.loads(out.getvalue())
    assert res["lab"] == "leak" and [x["salt"] for x in res["data"]["results"]] == ["none", "per-user"]
    from kvplay.options import KvplayError

    with pytest.raises(SystemExit):  # collide has no --target option (`kvplay lab collide --help`)
        _args("collide", "--target", srv.url)
    with pytest.raises(KvplayError, match="need --target"):
        lab_cli.main(_args("leak", "--cache-salt-per-user"))
    with pytest.raises(EngineError, match="cannot connect"):
        lab_cli.main(_args("leak", "--target", "http://127.0.0.1:9", "--samples", "1"))


@pytest.mark.vllm
@pytest.mark.slow
def test_labs_against_a_real_vllm(tmp_path, free_port):
    with vllm_cpu(tmp_path, free_port) as url:
        t, r = _leak(url, salts=["none", "per-user"])
        assert r.config["block_size"] == 32 and r.config["vocab_ids"][1] == 32000
        by = {x["salt"]: x for x in r.data["results"] if x["blocks"] == 2}
        assert by["none"]["hit_cached_tokens"] == 64  # the attacker reused the victim's two blocks
        assert by["per-user"]["hit_cached_tokens"] == 0  # vLLM's cache_salt isolated them
        assert "the salts isolated them" in r.verdict
        t = tg.Target(url).connect()
        try:
            d = tg.run_determinism(t, tg.TargetDeterminismParams(prompts=tg.PROMPTS[:1], max_tokens=6))
        finally:
            t.close()
        assert d.data["summary"]["by"] == ["token ids"]  # vLLM streams logprobs with token ids
        kinds = d.data["summary"]["kinds"]
        assert kinds["warm: same prompt (alice)"]["warm"] == 1 and kinds["cold again"]["warm"] == 0
