"""`kvplay audit URL` against `kvplay serve` on the tiny model over loopback HTTP, with API keys.

Sizes: 30 + 30 probes of 1000-letter prompts. The tiny model's tokenizer is character-level (a
letter and its space are 2 tokens), so a prompt is 1999 tokens and a hit probe shares 1900 of
them: a miss prefills ~2000 tokens, a hit ~100, several times faster even on a loaded machine,
and 30 + 30 call a CDF gap of 0.78 at α = 1e-8 (a few overlapping probes still pass). The
cached_tokens channel is exact: its counts are asserted to the probe. Timing is asserted only
where the effect is that large (shared cache, same key); where nothing is shared the test checks
the verdict and cached counts, and that hits time as the controls do (the A/A procedures: the
victim's request first too) with the ROC AUC, whose chance is exactly 0.5 and whose 99.9 %
interval holds it at its level. Not AP against 0.5: AP's chance is above 0.5 in small samples
and its percentile interval missed 0.5 one run in ten at 95 % (stats.ap_ci)."""
from __future__ import annotations

import io
import json
import sqlite3
from contextlib import redirect_stderr, redirect_stdout

import pytest
from support import serve as serve_util
from support.gateway import GatewayThread, gateway_app

from kvplay import cli
from kvplay.labs import audit, stats
from kvplay.labs.common import Progress
from kvplay.serve.keys import load_keys

KEYS_TOML = serve_util.KEYS_TOML + """
[[keys]]
key = "sk-carol-0123456789"
user = "carol"
group = "team-a"
"""
ALICE, CAROL, BOB = serve_util.ALICE, "sk-carol-0123456789", serve_util.BOB
N = 30
LETTERS = 1000


@pytest.fixture
def keyed(serve, tmp_path):  # noqa: F811
    """keyed(isolation) -> the URL of kvplay serve with three keys (alice and carol in team-a)."""
    p = tmp_path / "keys.toml"
    p.write_text(KEYS_TOML)

    def start(isolation="user", **cfg):
        srv, _ = serve(keys=load_keys(str(p)), isolation=isolation, num_blocks=2048, **cfg)
        return srv.url
    return start


def params(url, levels, **kw):
    kw.setdefault("probes", N)
    kw.setdefault("prompt_length", LETTERS)
    return audit.AuditParams(url=url, levels=levels, delay=0.0, **kw)


def groups(result):
    return {g["level"]: g for g in result.data["groups"]}


def test_shared_cache_is_detected_across_organisations(keyed, tmp_path):
    url = keyed("shared")
    r = audit.execute(params(url, ["global"], control=True), [ALICE, BOB], str(tmp_path / "a.db"))
    g = groups(r)["global"]
    assert g["control"]["cached_flags"] == 0  # the A/A procedures share nothing with the victim
    c, ch = g["client"], g["cached"]
    assert c["n_hit"] == c["n_miss"] == N
    # cached_tokens, exact: every hit reused the victim's 1900 shared tokens in whole blocks of 16, no miss any
    assert g["shared_tokens"] == 1900 and g["shared_blocks"] == 118
    assert ch["hits_flagged"] == N and ch["misses_flagged"] == 0 and ch["median_hit"] == 118 * 16
    assert ch["p"] < 1e-8 and ch["detected"]
    # timing: a large effect (a hit prefills ~100 tokens instead of ~2000)
    assert c["ks_p"] < 1e-8 and c["direction_ok"] and c["detected"] and c["ap"] > 0.9
    assert g["server"] is not None and g["server"]["detected"]  # kvplay serve reports its own TTFT
    assert g["detected"] and r.verdict.startswith("global: shared across organisations' keys: detected, p = ")
    assert r.data["tokenization"]["per_letter"] == 2 and r.data["block_size"] == 16


def test_isolating_keys_hide_every_level_but_the_keys_own(keyed, tmp_path):
    """Isolation by group: alice's own cache (user) and her team's (org) are visible to her,
    bob's (global) is not."""
    url = keyed("group")
    r = audit.execute(params(url, ["user", "org", "global"], confidence=0.999), [ALICE, CAROL, BOB],
                      str(tmp_path / "a.db"))
    g = groups(r)
    for lv in ("user", "org"):
        assert g[lv]["cached"]["hits_flagged"] == N and g[lv]["cached"]["misses_flagged"] == 0
        assert g[lv]["detected"] and g[lv]["client"]["ks_p"] < 1e-8 and g[lv]["client"]["direction_ok"]
    out = g["global"]
    assert out["cached"]["hits_flagged"] == 0 and out["cached"]["misses_flagged"] == 0
    assert out["cached"]["median_hit"] == 0 and not out["cached"]["detected"]
    assert not out["detected"] and out["client"]["ks_p"] > 1e-8
    assert "global: shared across organisations' keys: not detected at this power (p = " in r.verdict
    assert "30 + 30 probes call a CDF gap D >= 0.78 at α = 1e-08" in r.verdict


def test_the_default_isolation_of_kvplay_serve_keeps_keys_apart(keyed, tmp_path):
    """`kvplay serve --api-keys` isolates users by default: not detected, cached_tokens 0; with
    --control the A/A procedures (the victim sends, the attacker's prompt unrelated) report beside
    them, with 0 cached tokens too, and the hits time as the controls do (ROC AUC ~ 0.5)."""
    r = audit.execute(params(keyed(isolation="user"), ["global"], probes=20, confidence=0.999, control=True),
                      [ALICE, BOB], str(tmp_path / "a.db"))
    g = groups(r)["global"]
    assert not g["detected"] and g["cached"]["hits_flagged"] == 0 and g["cached"]["median_hit"] == 0
    hit, ctl = g["client"]["samples"]["hit"], g["control"]["samples"]["hit"]
    _, lo, hi = stats.auc_ci(ctl, hit, level=0.999)
    assert lo <= 0.5 <= hi  # a hit probe and a control are the same steps: no cache, no separation
    assert g["control"]["n_hit"] == 20 and g["control"]["cached_flags"] == 0 and not g["control"]["detected"]
    assert " Control (the victim sends, the attacker's prompt unrelated, 20 probes): KS p = " in r.verdict


def test_every_request_is_recorded_and_an_interrupted_run_resumes(keyed, tmp_path):
    url = keyed("shared")
    db = str(tmp_path / "a.db")

    class Interrupt(Progress):
        def advance(self, n=1):
            super().advance(n)
            if self.done == 12:
                raise KeyboardInterrupt

    notes = []
    with pytest.raises(KeyboardInterrupt):
        audit.execute(params(url, ["global"], probes=16, prompt_length=200), [ALICE, BOB], db,
                      progress=Interrupt("audit", enabled=False), say=notes.append)
    sid = notes[-1].split("session ")[1].split(";")[0]
    assert notes[-1].startswith("interrupted: 12 requests recorded") and f"--resume {sid}" in notes[-1]
    con = sqlite3.connect(db)
    ended, par = con.execute("select ended, params from sessions where id = ?", [sid]).fetchone()
    assert ended is None and json.loads(par)["attempt"] == 0 and ALICE not in par and BOB not in par
    assert con.execute("select count(*) from turns where session_id = ?", [sid]).fetchone()[0] == 12
    # the same run, resumed with its keys: only unfinished procedures run, with fresh prompts
    with pytest.raises(audit.AuditError, match="not the run's"):
        audit.execute(None, [BOB, ALICE], db, resume=sid[:12])
    with pytest.raises(audit.AuditError, match="--probes cannot change"):
        audit.execute(None, [ALICE, BOB], db, resume=sid, overrides={"probes": 3})
    r = audit.execute(None, [ALICE, BOB], db, resume=sid)
    g = groups(r)["global"]
    assert g["cached"]["hits_flagged"] == 16 and g["cached"]["misses_flagged"] == 0  # a hit is a hit after resume
    rows = [json.loads(p) for (p,) in con.execute("select probe from turns where session_id = ? order by seq", [sid])]
    attacker = [p for p in rows if p["role"] == "attacker"]
    assert sorted(p["procedure"] for p in attacker) == list(range(32))  # every procedure once
    assert {p["attempt"] for p in rows} == {0, 1} and r.data["session"] == sid
    assert con.execute("select ended from sessions where id = ?", [sid]).fetchone()[0] is not None
    assert con.execute("select count(*) from turns where probe like '%sk-%'").fetchone()[0] == 0
    # a finished run, resumed without keys: its report again from the record, nothing sent
    n = con.execute("select count(*) from turns where session_id = ?", [sid]).fetchone()[0]
    again = audit.execute(None, [], db, resume=sid)
    assert again.verdict == r.verdict and again.data["requests"] == n
    assert con.execute("select count(*) from turns where session_id = ?", [sid]).fetchone()[0] == n


def test_one_request_at_a_time_unless_asked(keyed, tmp_path):
    url = keyed("shared")
    db = str(tmp_path / "a.db")
    for conc in (1, 3):
        r = audit.execute(params(url, ["user"], probes=12, prompt_length=200, concurrency=conc), [ALICE], db)
        con = sqlite3.connect(db)
        spans = sorted(con.execute("select started, ended from turns where session_id = ?", [r.data["session"]]))
        most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
        assert most <= conc and (conc == 1 or most > 1)  # never more in flight than asked


def test_sweep_of_the_prefix_fraction(keyed, tmp_path):
    url = keyed("shared")
    p = params(url, ["global"], probes=16, prompt_length=400, sweep="prefix-fraction",
               sweep_values=[0.95, 0.25, 0.0])
    r = audit.execute(p, [ALICE, BOB], str(tmp_path / "a.db"))
    by = {g["value"]: g for g in r.data["groups"]}
    assert [by[v]["shared_blocks"] for v in (0.95, 0.25, 0.0)] == [47, 12, 0]  # 2 tokens a letter, 16 a block
    assert by[0.95]["cached"]["hits_flagged"] == 16 and by[0.25]["cached"]["hits_flagged"] == 16
    assert by[0.0]["cached"]["hits_flagged"] == 0 and by[0.0]["cached"]["ap"] == 0.5
    assert all(g["cached"]["misses_flagged"] == 0 for g in r.data["groups"])
    assert r.verdict.startswith("global: AP of the client time against the shared prefix (chance 0.5) — 47 blocks")
    out = tmp_path / "sweep.png"
    audit.audit_report.plot(r, str(out))
    assert out.stat().st_size > 10_000


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["audit", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_json_plot_key_file_and_sessions(keyed, tmp_path):
    url = keyed("shared")
    kf = tmp_path / "keys.txt"
    kf.write_text(f"# attacker, then the other organisation's key\n{ALICE}\n\n{BOB}\n")
    png = tmp_path / "cdf.png"
    rc, out, err = _cli(url, "--key-file", str(kf), "--level", "global", "--probes", "16", "--prompt-length",
                        "300", "--delay", "0", "--json", "--plot", str(png), "--db", str(tmp_path / "a.db"))
    assert rc == 0 and "kvplay audit:" not in err  # --json: no progress, no notes
    rep = json.loads(out)
    assert rep["lab"] == "audit" and rep["data"]["groups"][0]["cached"]["hits_flagged"] == 16
    assert rep["data"]["params"]["key_prints"] == [audit.fingerprint(ALICE), audit.fingerprint(BOB)]
    assert ALICE not in out and png.stat().st_size > 10_000
    rc, out, err = _cli(url, "--key", ALICE, "--probes", "4", "--prompt-length", "100", "--delay", "0",
                        "--db", str(tmp_path / "a.db"))
    assert rc == 0 and "verdict: audit" in out and "kvplay audit: recording to session" in err
    assert "ETA" in err  # the progress lines (stderr, not a terminal: plain lines)
    rc, out, _ = _cli(url, "--key", ALICE, "--probes", "4", "--prompt-length", "100", "--delay", "0", "--json",
                      "--db", str(tmp_path / "a.db"))
    verdict = json.loads(out)["verdict"]
    # 4 + 4 probes cannot reach 1e-8 even perfectly separated (1/C(8,4) = 0.014): the verdict says so
    assert verdict.startswith("user: cached for one key: not detected at this power (p = ")  # timing: not asserted
    assert "4 + 4 probes cannot reach p < 1e-08 even perfectly separated (floor 0.01): raise --probes" in verdict
    assert "cached_tokens: 4/4 hits vs 0/4 misses at >= 158 tokens (p = 0.014)" in verdict
    with redirect_stdout(io.StringIO()) as listing:
        assert cli.main(["sessions", "--db", str(tmp_path / "a.db"), "--json"]) == 0
    sessions = [json.loads(x) for x in listing.getvalue().splitlines()]
    assert [s["source"] for s in sessions] == ["audit"] * 3 and sessions[-1]["turns"] == 16 * 3 + 1


@pytest.mark.parametrize("argv,line", [
    (["http://127.0.0.1:9", "--key", ALICE], "cannot connect"),
    (["{url}", "--key", "sk-nobody-0123456789"], "refused the attacker's key (key 1) (HTTP 401): invalid API key"),
    (["{url}", "--key", ALICE, "--key", "sk-nobody-0123456789", "--level", "global"],
     "refused the victim's key for --level global (key 2) (HTTP 401)"),
    (["{url}", "--key", ALICE, "--key", BOB], "say which levels they audit"),
    (["{url}", "--key", ALICE, "--level", "global"], "--level global takes 2 keys"),
    (["{url}", "--key", ALICE, "--key", ALICE, "--level", "org"], "the attacker's own: that is --level user"),
    (["{url}", "--key", ALICE, "--level", "planet"], "--level: one or more of user, org, global"),
    (["{url}", "--key", ALICE, "--prefix-fraction", "1.5"], "--prefix-fraction must be from 0 to 1"),
    (["{url}", "--key", ALICE, "--probes", "500", "--max-requests", "100"], "over --max-requests 100"),
    (["{url}", "--key", ALICE, "--sweep-values", "0.5"], "--sweep-values needs --sweep"),
    (["{url}", "--key", ALICE, "--sweep", "prefix-fraction", "--sweep-values", "2"], "a prefix fraction is from 0"),
    (["{url}", "--key-file", "/nonexistent/keys"], "--key-file /nonexistent/keys: No such file"),
    (["{url}", "--resume", "01ZZZ", "--probes", "5"], "drop --probes"),
    (["--resume", "01ZZZ"], "no sessions database at"),
    ([], "give the server's URL"),
])
def test_cli_bad_input_is_one_line_and_exit_2(keyed, tmp_path, argv, line):
    url = keyed("user")
    argv = [a.replace("{url}", url) for a in argv]
    rc, out, err = _cli(*argv, "--db", str(tmp_path / "a.db"))
    assert rc == 2 and line in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("kvplay: error: ") and not out


def test_a_server_that_refuses_max_tokens_1_stops_the_run_and_keeps_what_was_sent(keyed, tmp_path):
    url = keyed("shared")
    gw = GatewayThread(gateway_app(url, [ALICE], min_max_tokens=2, upstream_key=BOB)).start()
    try:
        rc, out, err = _cli(gw.url, "--key", ALICE, "--probes", "4", "--prompt-length", "100", "--delay", "0",
                            "--db", str(tmp_path / "a.db"))
    finally:
        gw.stop()
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("kvplay: error: the server rejects max_tokens=1, which the procedure needs")
    assert "1 requests recorded in session" in last and "--resume" in last
    con = sqlite3.connect(str(tmp_path / "a.db"))
    assert con.execute("select count(*), max(error) like '%HTTP 400%' from turns").fetchone() == (1, 1)


class _Tokenizing:
    """The one part of audit.Server check_tokenization uses: a text's tokens (here the pieces
    themselves: only their count and equality matter)."""

    def __init__(self, split):
        self.split = split

    def tokenize(self, text):
        return self.split(text)


def test_tokenization_check():
    p = audit.AuditParams(prompt_length=200)
    rng = audit.random.Random(0)
    one = audit.check_tokenization(_Tokenizing(lambda t: t.split(" ")), p, rng)
    assert one["per_letter"] == 1 and one["head"] == 0 and one["note"] == "one token per letter (POST /tokenize)"
    merged = _Tokenizing(lambda t: [t[i:i + 6] for i in range(0, len(t), 6)])  # "a b c " pieces: 3 letters a token
    with pytest.raises(audit.AuditError, match="merges letters.*--force runs the audit anyway"):
        audit.check_tokenization(merged, p, rng)
    p.force = True
    assert audit.check_tokenization(merged, p, rng)["per_letter"] is None


def _control(ap_lo, ap_hi, auc_lo, auc_hi):
    return {"n_hit": 30, "ks_p": 0.4, "detected": False, "ap": (ap_lo + ap_hi) / 2, "ap_lo": ap_lo, "ap_hi": ap_hi,
            "auc": (auc_lo + auc_hi) / 2, "auc_lo": auc_lo, "auc_hi": auc_hi}


def test_the_control_shift_reads_the_auc_interval_not_aps():
    """AP's chance sits above 0.5 in small samples and its percentile interval misses 0.5 more
    often than its level: a control whose AP interval misses 0.5 while its AUC's holds it is no
    shift; an AUC interval off 0.5 is."""
    p = audit.AuditParams(levels=["global"])
    base = {"level": "global", "value": None, "prompt_letters": 1000, "shared_letters": 950,
            "client": audit.audit_report.timing([10.0 + i % 7 for i in range(30)], [10.0 + i % 5 for i in range(30)],
                                                p.alpha, p.confidence),
            "cached": audit.audit_report.cached_channel([0] * 30, [0] * 30, 900, p.alpha, p.confidence),
            "server": None, "power": stats.ks_detectable(30, 30, p.alpha)}
    quiet = audit.audit_report.verdict_line({**base, "control": _control(0.52, 0.71, 0.41, 0.63)}, p)
    shifted = audit.audit_report.verdict_line({**base, "control": _control(0.55, 0.80, 0.52, 0.74)}, p)
    assert "shifts the times" not in quiet
    assert "the procedure alone shifts the times a little (ROC AUC 0.63 [0.52, 0.74] misses 0.5)" in shifted
