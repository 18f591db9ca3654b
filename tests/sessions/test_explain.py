"""`kvplay explain` and the per-turn miss objects of show, export and replay, on sessions recorded
by the real engine (tiny model): the cache breaker is named where it is, and its projected hit
rate matches a real re-run with the breaker removed, within one block per turn."""
from __future__ import annotations

import json
import re

import pytest

from support import EXAMPLES

from kvplay.cli import main as cli
from kvplay.engine.miss import miss_object
from kvplay.sessions.explain import across_keys

EXAMPLE = EXAMPLES / "cache-breaker.toml"
HEADER = re.compile(r"\[request [0-9a-f]{4} at [0-9TZ:-]+\]")


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]


def run(capsys, script: str, *more) -> tuple[list[dict], dict]:
    assert cli(["run", script, "--json", "--model", "tiny:llama", *more]) == 0
    objs = lines(capsys.readouterr().out)
    return objs[:-1], objs[-1]


# The example's pool (40 blocks) is sized for the default model's tokens; the tiny model's
# character-level tokenizer makes prompts ~3.4x longer: the same pressure takes 128 blocks.
POOL = ("--num-blocks", "128")


@pytest.fixture
def recorded(capsys):
    turns, summary = run(capsys, str(EXAMPLE), *POOL)
    return summary["session"], turns


def test_explain_names_the_breaker_and_its_projection_matches_a_rerun_without_it(recorded, capsys, tmp_path):
    sid, turns = recorded
    # as recorded: bob and carol diverge right after "[request ", dave is salted apart, alice's
    # second turn finds her first one evicted
    assert [t["miss"]["reasons"]["diverged"] > 0 for t in turns] == [False, True, True, False, False]
    assert turns[3]["miss"]["isolated_from"] == {"alice": turns[3]["miss"]["reasons"]["isolated"]} != {}
    assert turns[4]["miss"]["reasons"]["evicted"] > 0 and set(turns[4]["miss"]["evicted_by"]) <= {"carol", "dave"}
    assert cli(["explain", sid, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["attribution"] == "recorded"
    assert rep["missed"]["tokens"] == sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns)
    assert rep["missed"]["reasons"]["evicted"] == turns[4]["miss"]["reasons"]["evicted"]
    b = rep["breakers"][0]
    at = turns[1]["miss"]["diverged_at"]
    assert b["at"] == at and b["requests"] == 2
    assert b["before"].endswith("[request ") and b["after"].startswith("Z]\nTools")
    assert b["variants"][0]["text"] == "4f1c at 2026-12-05T10:00:01" and b["variants"][0]["count"] == 2
    assert rep["isolation"]["from"] == [{"user": "dave", "from": "alice", "tokens": turns[3]["miss"]["reasons"]["isolated"]}]
    assert rep["evictions"]["projected"] and rep["isolation"]["projected"]["isolation"] == "shared"
    assert b["projected_hit_rate"] > rep["simulated_hit_rate"] + 0.3
    # the same session with every header as the breaker's most common variant, run for real
    text = EXAMPLE.read_text()
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(HEADER.sub("[request 4f1c at 2026-12-05T10:00:01Z]", text))
    again, summary = run(capsys, str(fixed), "--no-record", *POOL)
    projected = {p["turn"]: p["cached_if_fixed"] for p in b["per_turn"]}
    for t in again:
        assert abs(t["cached_tokens"] - projected[t["turn"]]) <= 16, (t["turn"], t["cached_tokens"], projected)
    real = summary["hit_tokens"] / summary["query_tokens"]
    assert abs(real - b["projected_hit_rate"]) <= 16 * len(again) / summary["query_tokens"]
    # the text report and the plot
    out_png = tmp_path / "explain.png"
    assert cli(["explain", sid, "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert f"at token {at} in 2 prompts" in out and "'4f1c at 2026-12-05T10:00:01' x2" in out
    assert "dave would have hit alice's" in out and "evicted alice's" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_export_and_replay_carry_each_turns_miss(recorded, capsys, tmp_path):
    sid, turns = recorded
    assert cli(["show", sid, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["turns"]
    assert [t["miss"] for t in shown] == [t["miss"] for t in turns]
    assert cli(["show", sid]) == 0
    out = capsys.readouterr().out
    assert f"diverged at {turns[1]['miss']['diverged_at']}" in out and "isolated from alice" in out
    assert cli(["export", sid, "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["miss"] for r in rows if r["type"] == "turn"] == [t["miss"] for t in turns]
    assert sum(r["type"] == "event" and r["kind"] == "MissExplained" for r in rows) == len(turns)
    assert cli(["export", sid, "--format", "md"]) == 0
    assert f"{turns[4]['miss']['reasons']['evicted']} evicted" in capsys.readouterr().out
    assert cli(["replay", sid, "--headless", "--json", "--no-record"]) == 0
    comps = lines(capsys.readouterr().out)
    assert all(c["miss_equal"] and c["miss_then"] == c["miss_now"] for c in comps[:-1])
    assert comps[-1]["miss_differs"] == 0


def test_explain_a_trace_file_by_simulation(recorded, capsys, tmp_path):
    sid, turns = recorded
    trace = tmp_path / "t.jsonl"
    assert cli(["export", sid, "--format", "mooncake", "-o", str(trace)]) == 0
    capsys.readouterr()
    assert cli(["explain", str(trace), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["attribution"] == "simulated" and rep["requests"] == len(turns)
    assert rep["missed"]["tokens"] == rep["prompt_tokens"] - rep["cached_tokens"]
    assert rep["missed"]["reasons"]["evicted"] > 0  # the pool size travels with the trace


@pytest.mark.parametrize("argv,msg", [(["explain", "nope.jsonl"], "no such file"),
                                      (["explain", "X", "--plot", "out.pdf"], ".png or .svg"),
                                      (["explain", "X", "--top", "-1"], "--top")])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.slow
def test_the_example_on_the_embedded_model_names_its_breaker_in_text(capsys):
    """What docs/miss.md shows: on SmolLM2's tokens the request id starts a block, and the
    breaker is still found, with its text."""
    turns, summary = run(capsys, str(EXAMPLE), "--model", "default")
    assert turns[1]["miss"]["diverged_at"] == turns[1]["cached_tokens"]  # on a block boundary
    assert "[request 9a07" in turns[1]["miss"]["excerpt"]["prompt"]
    assert "[request 4f1c" in turns[1]["miss"]["excerpt"]["cached"]
    assert turns[4]["miss"]["reasons"]["evicted"] > 0 and turns[3]["miss"]["reasons"]["isolated"] > 0
    assert cli(["explain", summary["session"], "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["breakers"][0]
    assert b["before"].endswith("[request ") and b["variants"][0]["text"] == "4f1c at 2026-12-05T10:00:01"


def test_across_keys_renames_only_the_cold_tokens_another_key_held():
    """sessions/explain.py's `across_keys`: a miss object explained from the sender's own keys
    gets the simulation's isolated / config tokens where it says cold, nothing else changes, and
    the counts still sum to the same uncached tokens."""
    own = miss_object([[0, 64, "evicted", "bob", "carol"], [64, 96, "cold", "", ""], [160, 5, "tail", "", ""]],
                      evicted_at=1.0, eviction_policy="lru", own_keys=True)
    sim = miss_object([[0, 32, "isolated", "dan", ""], [32, 96, "isolated", "erin", ""], [128, 16, "config", "fay", ""],
                       [144, 16, "cold", "", ""], [160, 5, "tail", "", ""]])
    out, renamed = across_keys(own, sim)
    assert renamed == 80 and out["tokens"] == own["tokens"] == 165
    assert out["spans"] == [[0, 64, "evicted", "bob", "carol"], [64, 64, "isolated", "erin", ""],
                            [128, 16, "config", "fay", ""], [144, 16, "cold", "", ""], [160, 5, "tail", "", ""]]
    assert out["isolated_from"] == {"erin": 64} and out["evicted_by"] == {"carol": 64}
    assert out["evicted_at"] == 1.0 and "own_keys" not in out
    assert across_keys(own, None) == (own, 0) and across_keys(own, miss_object([[0, 165, "cold", "", ""]])) == (own, 0)
    # one span of theirs across two cold spans, the recorded spans out of order
    own2 = miss_object([[32, 16, "cold", "", ""], [0, 16, "cold", "", ""], [16, 16, "evicted", "bob", "bob"]], own_keys=True)
    out2, renamed2 = across_keys(own2, miss_object([[0, 48, "isolated", "x", ""]]))
    assert renamed2 == 32 and out2["spans"] == [[0, 16, "isolated", "x", ""], [16, 16, "evicted", "bob", "bob"],
                                                [32, 16, "isolated", "x", ""]]
