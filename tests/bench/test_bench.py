"""The bench's own logic: metrics maths, workload construction, and a tiny end-to-end run that
checks the report's structure (no timing assertions)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvplay.bench.metrics import (PeerResult, RequestRecord, Target, percentile, ratio, ratios, speedup,
                                  summarize, union_seconds)
from kvplay.bench.workloads import WORKLOADS, build_workload, shared_prefix_len
from kvplay.engine.chat import encode_chat
from kvplay.engine.errors import EngineError

SHORT_SYSTEM = "You are a terse shop assistant. Answer in one sentence. Be kind and exact."


# --- metrics -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[3.0], [1, 2, 3, 4], [10, 1, 7, 3, 3, 9, 2], list(range(100))])
@pytest.mark.parametrize("q", [0, 5, 50, 95, 100])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_union_seconds_counts_overlaps_once():
    assert union_seconds([]) == 0
    assert union_seconds([(0, 1), (2, 3)]) == pytest.approx(2)  # sequential: add up
    assert union_seconds([(0, 2), (1, 3), (1.5, 2.5)]) == pytest.approx(3)  # concurrent: overlap
    assert union_seconds([(5, 6), (0, 1), (0.5, 5.5)]) == pytest.approx(6)
    with pytest.raises(ValueError):
        union_seconds([(2, 1)])


def test_ratio_and_speedup():
    assert ratio(1, 4) == 0.25
    assert ratio(None, 4) is None and ratio(1, None) is None and ratio(1, 0) is None
    ours, peer = {"wall_s": 2.0, "decode_tok_s": 30.0}, {"wall_s": 5.0, "decode_tok_s": 10.0}
    assert speedup(ours, peer) == 2.5
    r = ratios(ours, peer)
    assert r == {"wall_s": 0.4, "decode_tok_s": 3.0}
    assert ratios(ours, {"unavailable": "unavailable: x"}) == {}
    assert speedup(ours, {"unavailable": "unavailable: x"}) is None


def _rec(user, rnd, cold, arrival, first, end, prompt=100, reused=0, out=5):
    return RequestRecord(user, rnd, cold, prompt, reused, out, arrival, first, end)


def test_summarize_made_up_records():
    res = PeerResult("p", "peer", wall_s=10.0, peak_kv_bytes=123, records=[
        _rec("a", 0, True, 0.0, 1.0, 2.0, reused=0),
        _rec("b", 0, True, 0.0, 3.0, 4.0, reused=50),
        _rec("a", 1, False, 5.0, 5.1, 6.0, reused=90),
        _rec("b", 1, False, 5.0, 5.3, 6.0, reused=90),
    ])
    s = summarize(res)
    assert s["ttft_cold_p50_ms"] == pytest.approx(2000)
    assert s["ttft_cold_p95_ms"] == pytest.approx(2900)
    assert s["ttft_warm_p50_ms"] == pytest.approx(200)
    assert s["prompt_tokens"] == 400 and s["reused_tokens"] == 230 and s["computed_tokens"] == 170
    assert s["hit_rate"] == pytest.approx(230 / 400)
    # decode: 4 x 4 tokens after the first, over [1,2] u [3,4] u [5.1,6] = 2.9 s
    assert s["decode_tok_s"] == pytest.approx(16 / 2.9)
    assert s["throughput_tok_s"] == pytest.approx(2.0)
    assert s["peak_kv_bytes"] == 123


def test_summarize_unknown_reuse_and_unavailable():
    res = PeerResult("p", "peer", wall_s=1.0, records=[RequestRecord("a", 0, True, 10, None, 3, 0, 0.5, 1)])
    s = summarize(res)
    assert s["reused_tokens"] is None and s["hit_rate"] is None and s["computed_tokens"] is None
    s = summarize(PeerResult("p", "peer", unavailable="unavailable: no CPU support"))
    assert s["unavailable"].startswith("unavailable:")


def test_target_met():
    assert Target("t", 0.1, 0.15, True).met is True
    assert Target("t", 0.2, 0.15, True).met is False
    assert Target("t", 2.5, 2.0, False).met is True
    assert Target("t", None, 2.0, False).met is None


# --- workloads ----------------------------------------------------------------------------------------

def test_shared_system_workload_shape(tiny_llama):
    tok = tiny_llama.tokenizer
    w = build_workload("shared-system", tok, users=3, turns=2, system_prompt=SHORT_SYSTEM)
    assert len(w.rounds) == 2 and all(len(r) == 3 for r in w.rounds)
    assert w.users == ["user1", "user2", "user3"]
    assert [t.cold for t in w.turns] == [True] * 3 + [False] * 3
    sys_ids, sys_len = encode_chat(tok, [{"role": "system", "content": SHORT_SYSTEM}, {"role": "user", "content": "x"}])
    for t in w.turns:
        assert t.system_tokens == sys_len > 0
        assert t.prompt_ids[:sys_len] == sys_ids[:sys_len]
    # every prompt shares the system prompt, and no more than what the users have in common
    assert shared_prefix_len([t.prompt_ids for t in w.turns]) >= sys_len
    # a user's second turn extends their first prompt (the conversation grows)
    for first, second in zip(w.rounds[0], w.rounds[1]):
        assert first.user == second.user
        assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
        assert len(second.prompt_ids) > len(first.prompt_ids)
    assert w.prompt_tokens() == sum(len(t.prompt_ids) for t in w.turns)
    assert w.new_tokens == 32
    assert w.summary()["requests"] == 6


def test_default_system_prompt_is_about_500_tokens(tiny_llama):
    # the real model's tokenizer is not available in fast tests: ~4 characters a token
    from kvplay.bench.workloads import SYSTEM_PROMPT

    assert 1600 <= len(SYSTEM_PROMPT) <= 2800


def test_conversation_and_pressure(tiny_llama):
    tok = tiny_llama.tokenizer
    c = build_workload("conversation", tok, turns=4, system_prompt=SHORT_SYSTEM)
    assert c.users == ["user1"] and len(c.rounds) == 4
    for a, b in zip(c.turns, c.turns[1:]):
        assert b.prompt_ids[:len(a.prompt_ids)] == a.prompt_ids
    p = build_workload("pressure", tok, users=6, turns=2, block_size=16, system_prompt=SHORT_SYSTEM)
    assert p.num_blocks is not None
    per_request = -(-p.max_context() // 16)
    assert per_request <= p.num_blocks < per_request * len(p.users)  # fits one, not everyone


def test_shared_prefix_len():
    assert shared_prefix_len([]) == 0
    assert shared_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert shared_prefix_len([[1, 2], [1, 2]]) == 2


def test_bad_workload_names(tiny_llama):
    with pytest.raises(EngineError):
        build_workload("nope", tiny_llama.tokenizer)
    with pytest.raises(EngineError):
        build_workload("shared-system", tiny_llama.tokenizer, users=0)
    assert set(WORKLOADS) == {"shared-system", "conversation", "pressure"}


# --- an end-to-end run on the tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_report():
    from kvplay.bench.run import run_bench
    from kvplay.engine.config import EngineConfig

    cfg = EngineConfig(model="tiny:llama", device="cpu", dtype="float32", num_blocks=256)
    return run_bench(cfg, ["shared-system", "pressure"], users=2, turns=2, quick=True, system_prompt=SHORT_SYSTEM)


def test_report_has_every_peer(tiny_report):
    from kvplay.bench.run import PEER_ORDER

    assert json.loads(json.dumps(tiny_report, default=str))  # serialisable
    for w in tiny_report["workloads"]:
        assert list(w["peers"]) == list(PEER_ORDER)
        for key, p in w["peers"].items():
            if p.get("unavailable"):
                assert p["unavailable"].startswith("unavailable:")
                continue
            assert p["requests"] == w["workload"]["requests"]
            assert p["output_tokens"] == 32 * p["requests"]  # exactly 32 new tokens everywhere
            assert p["prompt_tokens"] == w["workload"]["prompt_tokens"]
            assert p["wall_s"] > 0 and p["ttft_cold_p50_ms"] > 0
            assert len(p["load_1min"]) == 2  # the machine's load around this peer, reported with it


def test_report_ratios_match_raw_numbers(tiny_report):
    for w in tiny_report["workloads"]:
        ours = w["peers"]["kvplay"]
        for key, r in w["ratios"].items():
            peer = w["peers"][key]
            for metric, value in r.items():
                assert value == pytest.approx(ours[metric] / peer[metric])
            if not peer.get("unavailable"):
                assert w["speedups"][key] == pytest.approx(peer["wall_s"] / ours["wall_s"])


def test_report_cache_figures(tiny_report):
    ss = next(w for w in tiny_report["workloads"] if w["workload"]["name"] == "shared-system")
    assert ss["peers"]["hf-generate"]["reused_tokens"] == 0
    for key in ("kvplay", "kvplay-det", "hf-cache-per-user"):
        p = ss["peers"][key]
        assert 0 < p["reused_tokens"] < p["prompt_tokens"]
        assert p["peak_kv_bytes"] > 0
    raw = ss["raw"]["kvplay"]["records"]
    assert all(r["reused_tokens"] > 0 for r in raw if r["round"] == 1)  # turn 2 reuses turn 1
    pressure = next(w for w in tiny_report["workloads"] if w["workload"]["name"] == "pressure")
    kv = pressure["peers"]["kvplay"]
    assert kv["pool_blocks"] == pressure["workload"]["num_blocks"]
    assert kv["peak_kv_bytes"] <= kv["pool_bytes"]
    names = [t["name"] for t in tiny_report["targets"]]
    assert any("warm/cold" in n for n in names) and any("decode" in n for n in names)
    probe = tiny_report["decode_probe"]
    assert probe["kvplay_1_user_tok_s"] > 0 and probe["hf_1_user_tok_s"] > 0
    assert probe["kvplay_alone_cold_ttft_ms"] > 0 and probe["kvplay_alone_warm_ttft_ms"] > 0


def test_hf_cb_peer_is_warmed_like_kvplay(tiny_report):
    # transformers' own default (warmup() before start) plus one throwaway request, before timing
    for w in tiny_report["workloads"]:
        cb = w["peers"]["hf-cb"]
        if cb.get("unavailable"):
            continue
        assert cb["warmed_up"] is True and cb["throwaway_requests"] == 1
        assert cb["output_tokens"] == 32 * cb["requests"]  # the throwaway request is not counted


def test_script_workload_from_shared_system_example(tiny_llama):
    from kvplay.bench.workloads import script_workload

    w = script_workload("examples/shared-system.toml", tiny_llama.tokenizer)
    assert w.name == "script:shared-system" and w.users == ["alice", "bob"]
    assert [len(r) for r in w.rounds] == [1, 1]  # turns without `at` run one after the other
    assert [t.cold for t in w.turns] == [True, False]
    assert w.new_tokens == 48  # the script's max_tokens
    a, b = w.turns
    assert a.system_tokens == b.system_tokens > 100
    assert shared_prefix_len([a.prompt_ids, b.prompt_ids]) >= a.system_tokens
    assert script_workload("examples/shared-system.toml", tiny_llama.tokenizer, new_tokens=5).new_tokens == 5


def test_script_workload_rounds_and_history(tiny_llama, tmp_path):
    from kvplay.bench.workloads import script_workload

    path = tmp_path / "s.toml"
    path.write_text('[system]\nprompt = "Be brief."\n[[users]]\nname = "a"\n[[users]]\nname = "b"\n'
                    '[[turns]]\nuser = "a"\ntext = "one"\nat = 0.0\nmax_tokens = 4\n'
                    '[[turns]]\nuser = "b"\ntext = "two"\nat = 0.0\nmax_tokens = 6\n'
                    '[[turns]]\nuser = "a"\ntext = "three"\nat = 1.0\n')
    w = script_workload(str(path), tiny_llama.tokenizer)
    assert [[t.user for t in r] for r in w.rounds] == [["a", "b"], ["a"]]  # same `at`: one round
    assert [t.cold for t in w.turns] == [True, True, False]
    first, _, again = w.turns
    assert again.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids  # a's history carries turn 1
    assert w.new_tokens == 48 and any("every turn generates 48" in n for n in w.notes)


@pytest.mark.parametrize("argv, needle", [
    (["--peer-url", "http://127.0.0.1:9"], "cannot connect"),
    (["--peer-url", "ftp://x"], "expected http://"),
    (["--peer-model", "x"], "needs --peer-url"),
    (["--script", "no/such.toml"], "no such file"),
])
def test_cli_peer_and_script_errors_are_one_line(argv, needle, capsys):
    from kvplay.cli import main

    assert main(["bench", "--model", "tiny:llama", "--no-probe", "--peers", "kvplay"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_scale_workload_report_and_print(monkeypatch, tiny_llama):
    from rich.console import Console

    from kvplay.bench import scale
    from kvplay.bench.report import print_scale_report
    from kvplay.bench.run import run_scale_report

    # the same step and stats() measurements on a shorter workload, so the test takes seconds; the
    # fresh-interpreter ready-time probe (~20 s of imports) is left to `kvplay bench --workload scale`
    monkeypatch.setattr(scale, "_workload", lambda tok: build_workload("shared-system", tok, users=2, turns=2,
                                                                       new_tokens=4, system_prompt=SHORT_SYSTEM))
    monkeypatch.setattr(scale, "ready_at", lambda blocks, progress: {"blocks": blocks, "error": "not run here"})
    report = run_scale_report(loaded=tiny_llama, small=64, large=4096, huge=8192, reps=1)
    assert json.loads(json.dumps(report, default=str))
    step = report["scale"]["step"]
    assert step["small_blocks"] == 64 and step["large_blocks"] == 4096 and step["step_ratio"] > 0
    assert step["stats_us"] > 0 and step["mirror_summary_1000_cells_ms"] > 0 and step["blocks_cached"] > 0
    names = [t["name"] for t in report["targets"]]
    assert names == ["step cost at 4,096 vs 64 blocks", "stats() at 4,096 blocks (ms)"]
    assert report["targets"][1]["value"] == pytest.approx(step["stats_us"] / 1000)
    console = Console(record=True, width=200, file=io.StringIO())
    print_scale_report(report, console)
    text = console.export_text()
    assert "step cost" in text and "stats() at 4,096 blocks" in text and "targets" in text
    assert "ready at 8,192 blocks: failed: not run here" in text


@pytest.mark.parametrize("flag", [["--plot", "x.png"], ["--script", "examples/shared-system.toml"],
                                  ["--peer-url", "http://127.0.0.1:9"]])
def test_scale_workload_refuses_what_it_does_not_use(flag, capsys):
    from kvplay.cli import main

    assert main(["bench", "--workload", "scale"] + flag) == 2
    err = capsys.readouterr().err.strip()
    assert "measures the engine alone" in err and len(err.splitlines()) == 1


def test_print_and_plot(tiny_report, tmp_path):
    from rich.console import Console

    from kvplay.bench.report import plot_report, print_report

    console = Console(record=True, width=200)
    print_report(tiny_report, console)
    text = console.export_text()
    for key in ("kvplay", "hf-generate", "hf-cache-per-user", "hf-cb", "kvplay-det", "targets",
                "1-minute load average before→after each peer: kvplay"):
        assert key in text
    out = tmp_path / "bench.png"
    plot_report(tiny_report, str(out))
    assert out.stat().st_size > 1000


def test_cli_json_and_errors(capsys):
    from kvplay.cli import main

    rc = main(["bench", "--model", "tiny:llama", "--num-blocks", "200", "--users", "1", "--turns", "1",
               "--workload", "shared-system", "--peers", "kvplay,hf-generate", "--no-probe", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["workloads"][0]["peers"]) == ["kvplay", "hf-generate"]
    assert main(["bench", "--model", "tiny:llama", "--users", "0"]) == 2
    assert main(["bench", "--model", "tiny:llama", "--peers", "vllm"]) == 2
    assert "error" in capsys.readouterr().err


def test_miss_workload_measures_on_and_off_in_one_process(tiny_llama, capsys):
    """`kvplay bench --workload miss` in small: both sides run, the attribution's own time is
    counted, the clock wrapper is removed afterwards (no ratio is asserted: timings are the
    bench's job)."""
    from kvplay.bench import miss_bench
    from kvplay.engine.miss import MissTracker

    explain = MissTracker.explain
    e = miss_bench.engine_ab(tiny_llama, "shared-system", reps=1)
    assert e["steps"] > 0 and e["step_ms_on"] > 0 and e["step_ms_off"] > 0 and e["attribution_ms_per_step"] > 0
    assert MissTracker.explain is explain
    s = miss_bench.simulate_ab(tiny_llama, "pressure", reps=1)
    assert s["ms_on"] > 0 and s["ms_off"] > 0 and 0 < s["hit_rate"] < 1
    miss_bench.print_report({"model": "tiny:llama", "load_avg_before": None, "engine": {"shared-system": e},
                             "simulate": {"pressure": s}})
    out = capsys.readouterr().out
    assert "engine step, shared-system" in out and "simulate, pressure" in out
