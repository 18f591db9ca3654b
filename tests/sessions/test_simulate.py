"""`kvplay simulate`: a recorded run replays through the real scheduler and pool with no model,
reproduces its live hits under its own settings, and Belady's optimum bounds every policy."""
import json

import pytest

from support import EXAMPLES

from kvplay.cli import main as cli
from kvplay.sessions.simulate import (SIM_POLICIES, Trace, TraceRequest, simulate,
                                      simulate_grid)
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import session_trace

PRESSURE = str(EXAMPLES / "eviction-pressure.toml")


@pytest.fixture(scope="module")
def pressure_run(tmp_path_factory):
    """`kvplay run examples/eviction-pressure.toml` on the tiny model, recorded. The tiny
    model's tokenizer is one token per character, so its prompts are ~400 tokens: 80 blocks
    keep the four concurrent users under pressure (evictions, a preemption) as 24 do for SmolLM2."""
    db = str(tmp_path_factory.mktemp("sim") / "s.db")
    assert cli(["run", PRESSURE, "--model", "tiny:llama", "--num-blocks", "80", "--db", db, "--json"]) == 0
    d = open_db(db)
    sid = next(d.query("select id from sessions"))["id"]
    d.close()
    return db, sid


def _trace(db, sid) -> Trace:
    d = open_db(db)
    try:
        return session_trace(d, sid)
    finally:
        d.close()


def test_recorded_settings_reproduce_the_live_hits(pressure_run):
    db, sid = pressure_run
    trace = _trace(db, sid)
    assert trace.config.num_blocks == 80 and trace.config.isolation == "user"
    res = simulate(trace)
    assert (res.hit_tokens, res.query_tokens) == (trace.recorded_hit_tokens, trace.recorded_query_tokens)
    assert trace.recorded_query_tokens > 0
    # turn by turn, not only in total
    assert res.cached == {r.request_id: r.cached_tokens for r in trace.requests}
    assert res.evictions > 0  # the pool really was under pressure


def test_belady_bounds_every_policy_at_every_pool_size(pressure_run):
    trace = _trace(*pressure_run)
    sizes = [36, 50, 64, 80, 100, 140]
    results = simulate_grid(trace, sizes, list(SIM_POLICIES), ["user", "shared"])
    assert len(results) == len(sizes) * 2 * len(SIM_POLICIES)
    best = {(r.num_blocks, r.isolation): r.hit_tokens for r in results if r.policy == "belady"}
    for r in results:
        assert r.hit_tokens <= best[(r.num_blocks, r.isolation)], r
        assert r.of_optimum is None or r.of_optimum <= 1.0
    # somewhere the optimum is strictly better than LRU (else the comparison shows nothing)
    assert any(r.policy == "lru" and r.hit_tokens < best[(r.num_blocks, r.isolation)] for r in results)


def test_belady_beats_lru_on_a_cycle():
    """Three prompts of 4 blocks taken in turn, a pool of 10 blocks (two prompts cached plus one
    running): LRU evicts the prompt needed next; Belady keeps the next one whole."""
    prompts = {p: [100 * p + i for i in range(4 * 4 + 1)] for p in range(3)}
    reqs = [TraceRequest(f"r{i}", "u", prompts[i % 3], [7], clock=None) for i in range(12)]
    from kvplay.engine.config import EngineConfig

    trace = Trace(EngineConfig(model="x", block_size=4, num_blocks=10, prefill_budget=64), "x", reqs)
    lru = simulate(trace, policy="lru")
    opt = simulate(trace, policy="belady")
    assert opt.hit_tokens > lru.hit_tokens
    assert opt.hit_tokens >= max(simulate(trace, policy=p).hit_tokens for p in ("lfu", "fifo"))


def test_cli_json_shape(pressure_run, capsys):
    db, sid = pressure_run
    capsys.readouterr()
    assert cli(["simulate", sid[:12], "--db", db, "--json", "--num-blocks", "60", "80", "--policy", "lru,belady"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"recorded", "results"}
    assert set(out["recorded"]) == {"policy", "num_blocks", "hit_rate"}
    assert out["recorded"]["policy"] == "lru" and out["recorded"]["num_blocks"] == 80
    assert [(r["policy"], r["num_blocks"]) for r in out["results"]] == [("lru", 60), ("belady", 60), ("lru", 80), ("belady", 80)]
    for r in out["results"]:
        assert set(r) == {"policy", "num_blocks", "isolation", "hit_rate", "of_optimum"}
        assert 0.0 <= r["hit_rate"] <= 1.0
    lru80 = out["results"][2]
    assert lru80["hit_rate"] == out["recorded"]["hit_rate"]


def test_cli_human_and_plot(pressure_run, capsys, tmp_path):
    db, sid = pressure_run
    png = tmp_path / "sim.png"
    assert cli(["simulate", sid, "--db", db, "--num-blocks", "80", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "reproduces" in out
    assert "LRU got" in out and "of the optimum" in out or "as did the optimum" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, msg", [
    (["--policy", "lru,mru"], "--policy"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--isolation", "nobody"], "--isolation"),
    (["--plot", "x.jpg"], "--plot"),
])
def test_cli_bad_flags_one_line(pressure_run, capsys, argv, msg):
    db, sid = pressure_run
    assert cli(["simulate", sid, "--db", db, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_unknown_session(pressure_run, capsys):
    db, _ = pressure_run
    assert cli(["simulate", "NOPE", "--db", db]) == 2
    assert "unknown session" in capsys.readouterr().err


def test_settings_changed_during_the_session_are_flagged(pressure_run, tmp_path, capsys):
    """An app session whose isolation was switched (F2) ended under other settings than it began
    with; the replay says so instead of claiming to reproduce it."""
    import shutil

    db, sid = pressure_run
    copy = str(tmp_path / "copy.db")
    d = open_db(db)
    d.execute("PRAGMA wal_checkpoint(FULL)")
    d.close()
    shutil.copy(db, copy)
    d = open_db(copy)
    stats = json.loads(d["sessions"].get(sid)["stats"])
    stats["isolation"] = "shared"
    d["sessions"].update(sid, {"stats": json.dumps(stats)})
    d.close()
    assert cli(["simulate", sid, "--db", copy, "--num-blocks", "80", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "settings changed during the session (isolation user → shared)" in out
