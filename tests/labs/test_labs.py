"""The labs on the tiny random model: each verdict's key measurement, and the CLI's bad input."""
from __future__ import annotations

import argparse
import inspect
import io
import json

import pytest
import torch

from kvplay.labs import collide, determinism, leak, response_cache, stats
from kvplay.commands.lab import build_params, configure
from kvplay.labs.common import LabContext


def test_compare_finds_first_divergence_and_gap():
    a = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 1.9])]
    same = determinism.compare(a, [t.clone() for t in a])
    assert same["bitwise"] and not same["diverged"] and same["max_delta"] == 0
    b = [torch.tensor([1.0, 0.0, 1e-6]), torch.tensor([0.0, 1.9, 2.0])]
    d = determinism.compare(a, b)
    assert not d["bitwise"] and d["diverged"] and d["first_divergence"] == 1
    assert d["top2_gap_cold"] == pytest.approx(0.1, abs=1e-5)
    assert d["per_step"][0] == pytest.approx(1e-6)


def test_determinism_is_bitwise_in_deterministic_mode(make_engine):
    eng = make_engine(num_blocks=128)
    p = determinism.DeterminismParams(prompts=determinism.PROMPTS[:1], max_tokens=6, batch_sizes=[3],
                                      modes=["deterministic"])
    r = determinism.run(eng, p)
    s = r.data["summary"]["modes"]["deterministic"]
    assert s["compared"] == 4  # cold again, 2 warm, 1 batch
    assert s["bitwise"] == s["compared"] and s["diverged"] == 0 and s["max_delta"] == 0
    warm = [x for x in r.data["runs"] if x["variant"].startswith("warm")]
    assert all(x["cached_tokens"] > 0 for x in warm)  # warm runs really used another user's blocks
    assert "deterministic mode: cached (warm) vs cold bitwise equal in 2/2" in r.verdict
    assert ("In deterministic mode: reusing another user's cached prefix gave the same answer as a cold cache "
            "in 2/2 runs, bit for bit; so the claim does not hold here") in r.verdict
    assert "95 % CI 0–84 %" in r.verdict  # 0 of 2: the interval says how little 2 runs show
    assert r.data["summary"]["modes"]["deterministic"]["by_kind"]["warm"]["diverged_ci"][1] == pytest.approx(0.842,
                                                                                                            abs=1e-3)
    assert eng.config.deterministic is False  # restored


def _kind(n, bitwise, diverged, max_delta):
    return {"n": n, "bitwise": bitwise, "diverged": diverged, "max_delta": max_delta,
            "bitwise_ci": stats.clopper_pearson(bitwise, n), "diverged_ci": stats.clopper_pearson(diverged, n)}


def test_determinism_plain_sentence_follows_the_counts():
    ok = {"by_kind": {"warm": _kind(6, 6, 0, 0.0), "batch": _kind(3, 0, 0, 5e-5)}, "min_top2_gap_cold": 0.047}
    text = determinism.plain("default", ok)
    assert "same answer as a cold cache in 6/6 runs, bit for bit; so the claim does not hold" in text
    assert "95 % CI 0–46 %" in text and "940× less than the closest call" in text and "no answer (0/3)" in text
    flips = {"by_kind": {"warm": _kind(10, 2, 3, 0.02), "batch": _kind(4, 0, 1, 0.03)}, "min_top2_gap_cold": 0.01}
    text = determinism.plain("default", flips)
    assert "CHANGED the answer in 3/10 (95 % CI 6.7–65 %) runs, so the claim holds here" in text
    assert "changed the answer in 1/4" in text
    drift = {"by_kind": {"warm": _kind(6, 4, 0, 3e-5), "batch": _kind(0, 0, 0, 0.0)}, "min_top2_gap_cold": None}
    assert "last digits in 2 of them (at most 3e-05)" in determinism.plain("default", drift)


def test_leak_attacker_sees_only_its_client():
    src = inspect.getsource(leak.Attacker)
    for word in ("engine", "stats", "snapshot", "pool", "subscribe", "cached", "user"):
        assert word not in src
    # a client holds a connection and names no one per request: identity is bound at connect
    assert list(inspect.signature(leak.Attacker.__init__).parameters) == ["self", "connection"]
    assert list(inspect.signature(leak.Connection.complete).parameters) == ["self", "prompt_ids"]


def test_leak_identity_is_bound_when_the_client_connects(make_engine):
    from kvplay.engine.events import RequestFinished
    from kvplay.labs.common import LabContext

    eng = make_engine(num_blocks=64)
    server = leak.Server(eng, LabContext())
    conn = server.connect("eve", group="red")
    assert eng.users.users()["eve"] == "red"  # registered by the server, before any request
    finished = []
    eng.subscribe_batches(lambda b: finished.extend(e.user for e in b.events if isinstance(e, RequestFinished)))
    assert leak.Attacker(conn).ttft_ms(list(range(5, 25))) > 0
    eng.call(lambda: None)  # the step that finished it has handed over its batch
    assert finished == ["eve"]  # the request ran as the connection's user
    r = leak.run(eng, leak.LeakParams(blocks=[1], samples=2, calibration=1, isolations=["user"],
                                      mitigations=[], seed=1))
    users = eng.users.users()
    assert users[leak.ATTACKER] is None and users[leak.VICTIM] is None  # the lab's clients connected
    assert r.data["results"][0]["isolation"] == "user"


def test_leak_auc_high_when_shared_and_chance_when_isolated(make_engine):
    # 16 shared blocks with a 16-token prefill budget: a miss needs 17 forwards, a hit 1.
    eng = make_engine(num_blocks=512, prefill_budget=16)
    p = leak.LeakParams(blocks=[16], samples=25, calibration=3, mitigations=[], seed=3)
    r = leak.run(eng, p)
    by = {x["isolation"]: x for x in r.data["results"]}
    assert by["shared"]["auc"] >= 0.85, by["shared"]
    assert by["shared"]["ks_p"] < 0.01
    assert by["shared"]["call"] == "leak" and by["shared"]["auc_lo"] > 0.5
    assert abs(by["user"]["auc"] - 0.5) <= 0.3, by["user"]
    # words follow the interval: "leak" exactly when it excludes 0.5, on either side (stats.leak_call);
    # 25 probes a side under a loaded machine can land a 2-3 sigma interval off chance now and then
    user_off = by["user"]["auc_lo"] > 0.5 or by["user"]["auc_hi"] < 0.5
    assert (by["user"]["call"] == "leak") == user_off, by["user"]
    assert "shared isolation — LEAK" in r.verdict
    assert eng.config.isolation == "shared"


class _Seen:
    """A session recorder stand-in that keeps, per attacker request, whom its cached tokens came from."""

    def __init__(self):
        self.turns = []

    def record_turn(self, user, text, messages, sampling, result):
        self.turns.append((user, dict(result.stats.cached_from or {})))


def test_leak_rows_pool_seeds_with_intervals_and_a_control_unrelated_to_the_victim(make_engine):
    eng = make_engine(num_blocks=256)
    seen = _Seen()
    p = leak.LeakParams(blocks=[2], samples=6, repeats=3, calibration=1, isolations=["shared"], mitigations=[],
                        control=True, seed=4)
    r = leak.run(eng, p, LabContext(recorder=seen))
    content, control = r.data["results"]
    assert (content["probes"], control["probes"]) == ("content", "control")
    for row in (content, control):
        assert row["n_hit"] == row["n_miss"] == 6 and len(row["hit_ms"]) == 6
        assert [s["seed"] for s in row["per_seed"]] == [4, 5, 6] and [s["n"] for s in row["per_seed"]] == [2, 2, 2]
        assert row["auc_lo"] <= row["auc"] <= row["auc_hi"] and row["call"] in ("leak", "inconclusive")
    from_victim = [u for u, src in seen.turns if u == leak.ATTACKER and leak.VICTIM in src]
    # shared cache: each content hit probe reused the victim's blocks; no control probe did
    assert len(from_victim) == 6
    assert content["hit_ms"] != control["hit_ms"]
    assert "Control (" in r.verdict and "95 % intervals" in r.verdict
    assert r.data["expected_halfwidth"] > 0.3  # 6 + 6 probes: a wide interval, and the verdict says so
    assert "wider than ±0.08" in r.verdict


def _row(call, auc=0.5, lo=0.4, hi=0.6, probes="content", iso="user"):
    return {"isolation": iso, "probes": probes, "blocks": 1, "auc": auc, "auc_lo": lo, "auc_hi": hi, "call": call,
            "ks_p": 0.5, "median_hit_ms": 10.0, "median_miss_ms": 10.0, "n_hit": 102, "n_miss": 102}


@pytest.mark.parametrize("content, control, needle", [
    ("leak", "no evidence of a leak", "a channel, not chance"),
    ("leak", "leak", "not the victim"),
    ("no evidence of a leak", "no evidence of a leak", "what an attacker sees is chance"),
    ("inconclusive", "no evidence of a leak", "more probes are needed"),
])
def test_leak_control_sentence_decides_chance_or_channel(content, control, needle):
    v = leak._verdict([_row(content), _row(control, probes="control")], [], leak.LeakParams())
    assert needle in v and f"user isolation — {content.upper()}" in v
    assert "wider than" not in v  # ± 0.1 intervals at 102 + 102 probes: nothing to add


def test_leak_default_samples_give_plus_minus_0_08():
    p = leak.LeakParams()
    assert p.samples == 102 and p.repeats == 3 and p.samples % p.repeats == 0
    assert stats.auc_halfwidth(p.samples, p.samples) <= 0.08 < stats.auc_halfwidth(leak.QUICK_SAMPLES, 15)
    assert leak.overall(["leak", "no evidence of a leak"]) == "leak"
    assert leak.overall(["no evidence of a leak", "inconclusive"]) == "inconclusive"


def test_cli_leak_quick_repeats_and_control():
    def params(*argv):
        parser = argparse.ArgumentParser()
        configure(parser)
        return build_params(parser.parse_args(["leak", *argv]))[1]

    assert (params().samples, params().repeats, params().control) == (102, 3, False)
    assert (params("--quick").samples, params("--quick").repeats) == (15, 1)
    assert (params("--quick", "--samples", "40").samples, params("--control").control) == (40, True)


def test_collide_finds_collisions_and_verify_catches_every_one(make_engine):
    eng = make_engine(num_blocks=200)
    r = collide.run(eng, collide.CollideParams(bits=8, feed=120, offline=2000, max_tokens=6))
    off, feed = r.data["offline"], r.data["feed"]
    assert abs(off["pairs"] - off["expected"]) < 0.2 * off["expected"]
    assert feed["predicted"] > 0 and feed["caught"] == feed["predicted"] and feed["false_hits"] == 0
    off = r.data["offline"]
    for d, k in ((off, "pairs"), (feed, "predicted")):
        assert d["ci"][0] <= d[k] <= d["ci"][1] and d["bound_in_ci"] == (d["ci"][0] <= d["expected"] <= d["ci"][1])
    assert feed["caught_ci"][1] == 1.0 and feed["false_hit_ci"][0] == 0.0
    assert "95 % CI of the mean" in r.verdict and f"false hits in 0/{feed['n']} (95 % CI 0–" in r.verdict
    pair = r.data["pair"]
    assert pair["code_a"] != pair["code_b"] and pair["tokenization_matches"]
    off_demo, on_demo = r.data["demos"]
    assert not off_demo["verify_on_hit"] and off_demo["collisions_caught"] == 0
    assert off_demo["bob_cached_tokens"] > pair["block"] * eng.config.block_size  # served alice's KV
    assert on_demo["collisions_caught"] >= 1 and on_demo["bob_correct"]
    assert on_demo["bob_cached_tokens"] <= pair["block"] * eng.config.block_size
    assert eng.config.hash == "sha256" and eng.config.verify_on_hit  # restored


def test_birthday_bound_numbers():
    assert collide.p_any(1e9, 64) == pytest.approx(0.0267, rel=0.01)
    assert collide.expected_pairs(1e12, 256) == pytest.approx(4.3e-54, rel=0.01)
    assert collide.expected_repeats(100, 64) == pytest.approx(collide.expected_pairs(100, 64), rel=1e-3)


def test_response_cache_identical_only_with_response_cache(make_engine):
    eng = make_engine()
    r = response_cache.run(eng, response_cache.ResponseCacheParams(max_tokens=12))
    s = r.data["summary"]
    assert s["response_cache_identical"] and s["response_cache_engine_calls"] == 1
    assert not s["kv_identical"] and s["kv_distinct_answers"] == 3
    assert all(c > 0 for c in s["kv_cached_tokens"][1:])
    assert r.verdict == response_cache.make_verdict(s)  # the verdict is a function of the measurements


def _rc_summary(rc, kv, cold, cached=(0, 32, 32), calls=1):
    return {"users": ["alice", "bob", "carol"], "temperature": 0.8, "response_cache_texts": rc,
            "kv_texts": kv, "cold_texts": cold, "response_cache_engine_calls": calls,
            "kv_distinct_answers": len(set(kv)), "kv_cached_tokens": list(cached), "kv_prompt_tokens": 34,
            "kv_equals_cold": [a == b for a, b in zip(kv, cold)]}


def test_response_cache_verdict_follows_the_measurements():
    claim_rc_only = response_cache.make_verdict(_rc_summary(["A", "A", "A"], ["A", "B", "C"], ["A", "B", "C"]))
    assert "held for the response cache but not for the KV prefix cache" in claim_rc_only
    assert "3/3 answers equal the same seed" in claim_rc_only and "2 of 2 later users" in claim_rc_only
    # a KV cache that served alice's answer to everyone (their own seeds give other answers cold)
    kv_leaks = response_cache.make_verdict(_rc_summary(["A", "A", "A"], ["A", "A", "A"], ["A", "B", "C"]))
    assert "held for the KV prefix cache and for the response cache" in kv_leaks
    assert "1/3 answers equal the same seed on a cold cache; 95 % CI of the rate 1–91 %" in kv_leaks
    # a response cache that did not answer from its store (e.g. keyed per user)
    neither = response_cache.make_verdict(_rc_summary(["A", "B", "C"], ["A", "B", "C"], ["A", "B", "C"], calls=3))
    assert "held for neither cache" in neither and "0 of 2 later users" in neither and "3 engine calls" in neither
    # the KV cache changed answers, but not into alice's
    drift = response_cache.make_verdict(_rc_summary(["A", "A", "A"], ["A", "X", "C"], ["A", "B", "C"]))
    assert "1 of 3 answers differ from the same seed on a cold cache" in drift
    partial = response_cache.make_verdict(_rc_summary(["A", "A", "A"], ["A", "A", "C"], ["A", "B", "C"]))
    assert "only 1 of 2 later users" in partial
    assert len({claim_rc_only, kv_leaks, neither, drift, partial}) == 5


def test_lab_reports_print_no_python_reprs(make_engine):
    """What a person reads (tables and verdicts, as the CLI prints them) holds no dict or list repr."""
    from rich.console import Console

    from kvplay.labs.common import fmt, renderables

    assert fmt({"alice": 32, "bob": 16}) == "alice 32, bob 16" and fmt(["alice"]) == "alice" and fmt([]) == "—"
    eng = make_engine(num_blocks=200)
    results = [
        response_cache.run(eng, response_cache.ResponseCacheParams(max_tokens=4)),
        collide.run(eng, collide.CollideParams(bits=8, feed=30, offline=300, max_tokens=4)),
        determinism.run(eng, determinism.DeterminismParams(prompts=determinism.PROMPTS[:1], max_tokens=3,
                                                           batch_sizes=[2], modes=["default"])),
        leak.run(eng, leak.LeakParams(blocks=[1], samples=2, calibration=1, isolations=["shared"],
                                      mitigations=["delay"], seed=2)),
    ]
    for r in results:
        console = Console(record=True, width=200, file=io.StringIO())
        for x in renderables(r):
            console.print(x)
        text = console.export_text()
        assert f"verdict: {r.lab}" in text
        assert "{'" not in text and "['" not in text and "{\"" not in text, (r.lab, text)


@pytest.mark.parametrize("argv, needle", [
    (["lab", "collide", "--bits", "0"], "1 to 256"),
    (["lab", "collide", "--hash", "trunc:257"], "1 to 256"),
    (["lab", "leak", "--samples", "0"], "from 1 to 10000"),
    (["lab", "collide", "--feed", "0"], "at least 1"),
    (["lab", "leak", "--repeats", "0"], "from 1 to 10000"),
    (["lab", "leak", "--samples", "99999999"], "from 1 to 10000"),
    (["lab", "leak", "--target", "http://127.0.0.1:9", "--control"], "not --target"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, needle, capsys):
    from kvplay.cli import main

    assert main(argv + ["--model", "tiny:llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_lab_without_a_name_is_one_line_listing_the_labs(capsys):
    from kvplay.cli import main

    assert main(["lab"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in ("determinism", "leak", "collide", "response-cache"))
    with pytest.raises(SystemExit) as exc:
        main(["lab", "nope"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "invalid choice: 'nope'" in err


def test_lab_help_lists_only_that_labs_options(capsys):
    from kvplay.cli import main

    with pytest.raises(SystemExit):
        main(["lab", "collide", "--help"])
    out = capsys.readouterr().out
    assert "--bits" in out and "--feed" in out and "--model" in out
    assert "--question" not in out and "--samples" not in out and "--batch-sizes" not in out and "--target" not in out


def test_cli_json_plot_and_recording(tmp_path, capsys):
    from kvplay.cli import main

    png, db = tmp_path / "rc.png", tmp_path / "s.db"
    rc = main(["lab", "response-cache", "--model", "tiny:llama", "--num-blocks", "64", "--max-tokens", "6", "--json",
               "--plot", str(png), "--db", str(db)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lab"] == "response-cache" and out["data"]["summary"]["response_cache_identical"]
    assert png.stat().st_size > 1000
    try:
        from kvplay.sessions.recorder import Recorder  # noqa: F401
    except ImportError:
        return
    import sqlite3

    con = sqlite3.connect(db)
    (source,) = con.execute("select source from sessions").fetchone()
    assert source == "lab:response-cache"
    assert con.execute("select count(*) from turns").fetchone()[0] == 7  # 1 + 3 + 3 engine calls
