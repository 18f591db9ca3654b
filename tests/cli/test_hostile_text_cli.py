"""Issue #42: text that came from a user, a recording or a file is data in every command-line view.
The hostile corpus (tests/support/hostile.py) goes through `kvplay run`, `show`, `replay --headless`,
`export --format md` (a terminal and a file), `tree`, `sessions` and an error line, each run on a
pseudo-terminal (Rich renders for a real one: an interpreted `[link=…]` would be an OSC 8 link):
each exits 0 and writes no raw control, bidi or invisible character and no interpreted markup.
The machine outputs (`show --json`, `export jsonl`) keep the bytes, and `export --format toml`
replays to the same prompts, byte for byte."""
from __future__ import annotations

import json
import sqlite3
import time

import pytest

from support.hostile import CORPUS, LIVE, LONG, MARKUP, MODEL_ID, assert_inert, run_tty

from kvplay.sessions.script import parse_script

ENGINE = ["--model", "tiny:llama", "--num-blocks", "256", "--threads", "1"]
HOSTILE_ID = "HOSTILE00000000000000000000"


def toml_str(s: str) -> str:
    """A TOML basic string written independently of kvplay's own writer (JSON's escapes are
    TOML's; DEL, which JSON leaves raw, escaped too)."""
    return json.dumps(s).replace("\x7f", "\\u007f")


def hostile_script() -> str:
    out = ['[system]', f'prompt = {toml_str("You are terse. " + CORPUS[4])}', '']
    for name in ("alice", "bob"):
        out += ['[[users]]', f'name = "{name}"', 'max_tokens = 6', '']
    for i, text in enumerate(CORPUS):
        out += ['[[turns]]', f'user = "{("alice", "bob")[i % 2]}"', f'text = {toml_str(text)}', '']
    return "\n".join(out)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """`kvplay run` of the hostile script on a terminal: (exit code, output, db, session id), and
    a tampered session (HOSTILE_ID) whose names, model, texts and errors are all hostile, with a
    64 KB prompt: what an older kvplay, another tool or an attacker may have written."""
    d = tmp_path_factory.mktemp("hostile")
    script = d / "hostile.toml"
    script.write_text(hostile_script(), encoding="utf-8")
    db = str(d / "s.db")
    rc, out = run_tty(["run", str(script), "--db", db, *ENGINE])
    con = sqlite3.connect(db)
    sid = con.execute("select id from sessions where source = 'run'").fetchone()[0]
    now = time.time()
    with con:
        con.execute("insert into sessions (id, created, ended, source, model, engine_config, system_prompt, "
                    "title, replay_of, script_path) values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [HOSTILE_ID, now, now, "run\x1b[2J", MODEL_ID, json.dumps({"model": MODEL_ID, "block_size": 16}),
                     "\n".join(CORPUS), CORPUS[3], CORPUS[1], CORPUS[5]])
        names = [CORPUS[1], CORPUS[0], "eve\x1b]0;t\x07\u202e"]
        for n in names:
            con.execute('insert into users (session_id, name, "group", colour, seed, temperature, max_tokens, '
                        'top_p, top_k) values (?, ?, ?, ?, 1, 0, 8, 1, 0)', [HOSTILE_ID, n, CORPUS[6], "[/b]"])
        texts = CORPUS + [LONG]
        for i, text in enumerate(texts):
            con.execute("insert into turns (id, session_id, seq, user, text, reply, messages, sampling, seed, "
                        "started, ended, prompt_tokens, cached_tokens, computed_tokens, output_tokens, cached_from, "
                        "finish_reason, error) values (?, ?, ?, ?, ?, ?, '[]', '{}', 1, ?, ?, 40, 16, 24, 8, ?, ?, ?)",
                        [f"T{i}", HOSTILE_ID, i + 1, names[i % 3], text, CORPUS[-1 - i % len(CORPUS)] + LONG[:100],
                         now, now, json.dumps({names[(i + 1) % 3]: 16}), "stop",
                         CORPUS[5] + " [/b]" if i == 2 else None])
    con.close()
    return rc, out, db, sid


def test_run_on_a_terminal_is_inert(recorded):
    rc, out, _db, _sid = recorded
    assert rc == 0, out
    assert_inert(out, LIVE)  # a live table on a terminal, the tiny model's random replies in it
    assert f"{len(CORPUS)} turns (0 failed)" in LIVE.sub("", out)


@pytest.mark.parametrize("which", ["run", "tampered"])
def test_show_on_a_terminal_is_inert(recorded, which):
    _rc, _out, db, sid = recorded
    rc, out = run_tty(["show", sid if which == "run" else HOSTILE_ID, "--db", db])
    assert rc == 0, out  # was: rich.errors.MarkupError (closing tag '[/b]')
    assert_inert(out)
    for m in MARKUP:
        assert m in out  # shown literally: no hyperlink to e.vl, no style
    assert "␛]0;" in out or "␛[2J" in out


def test_show_events_on_a_terminal_is_inert(recorded):
    _rc, _out, db, sid = recorded
    rc, out = run_tty(["show", sid, "--db", db, "--events"])
    assert rc == 0, out
    assert_inert(out)


def test_export_md_to_a_terminal_and_a_file_is_inert(recorded, tmp_path):
    _rc, _out, db, _sid = recorded
    rc, out = run_tty(["export", HOSTILE_ID, "--format", "md", "--db", db])
    assert rc == 0, out
    assert_inert(out)
    assert "␛]52;c;cm0gLXJmIH4K␇" in out and "<U+202E>txt.exe" in out and "[/b]" in out
    assert LONG in out  # a transcript is whole
    f = tmp_path / "t.md"
    rc, out = run_tty(["export", HOSTILE_ID, "--format", "md", "--db", db, "-o", str(f)])
    assert rc == 0, out
    text = f.read_text(encoding="utf-8")
    assert_inert(text, None)  # a document is read in terminals, editors and renderers alike
    assert "␛]52;c" in text and "\nbidi <U+202E>txt.exe" in text  # bodies keep their lines


def test_machine_outputs_keep_the_bytes(recorded, tmp_path):
    _rc, _out, db, _sid = recorded
    rc, out = run_tty(["show", HOSTILE_ID, "--db", db, "--json"])
    assert rc == 0
    assert_inert(out, None)  # JSON escapes what it quotes, bidi and C1 included
    s = json.loads(out)
    assert [t["text"] for t in s["turns"]] == CORPUS + [LONG] and s["model"] == MODEL_ID
    f = tmp_path / "t.jsonl"
    rc, out = run_tty(["export", HOSTILE_ID, "--format", "jsonl", "--db", db, "-o", str(f)])
    assert rc == 0, out
    text = f.read_text(encoding="utf-8")
    assert_inert(text, None)
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["text"] for r in rows if r["type"] == "turn"] == CORPUS + [LONG]


def test_export_toml_parses_back_byte_for_byte(recorded, tmp_path):
    """Every string of the tampered session (names, the 64 KB prompt, ESC, NUL, bidi) survives."""
    _rc, _out, db, _sid = recorded
    f = tmp_path / "t.toml"
    rc, out = run_tty(["export", HOSTILE_ID, "--format", "toml", "--db", db, "-o", str(f)])
    assert rc == 0, out  # was: invalid TOML (a raw ESC)
    text = f.read_text(encoding="utf-8")
    assert_inert(text, None)  # escaped: the file itself is inert to look at
    script = parse_script(text)
    assert [t.text for t in script.turns] == CORPUS + [LONG]
    assert [u.name for u in script.users] == [CORPUS[1], CORPUS[0], "eve\x1b]0;t\x07\u202e"]
    assert script.system == "\n".join(CORPUS)


def test_export_toml_replays_to_the_same_prompts(recorded, tmp_path):
    """The exported script of the recorded run, run again: the new session's prompts are the old ones."""
    _rc, _out, db, sid = recorded
    f = tmp_path / "again.toml"
    rc, out = run_tty(["export", sid, "--format", "toml", "--db", db, "-o", str(f)])
    assert rc == 0, out
    db2 = str(tmp_path / "again.db")
    rc, out = run_tty(["run", str(f), "--db", db2, "--json", *ENGINE])
    assert rc == 0, out
    old = sqlite3.connect(db).execute("select text from turns where session_id = ? order by seq", [sid]).fetchall()
    new = sqlite3.connect(db2).execute("select text from turns order by seq").fetchall()
    assert sorted(new) == sorted(old) and sorted(t for (t,) in new) == sorted(CORPUS)


def test_replay_headless_on_a_terminal_is_inert(recorded):
    _rc, _out, db, sid = recorded
    rc, out = run_tty(["replay", sid, "--headless", "--no-record", "--db", db, *ENGINE])
    assert rc == 0, out  # was: rich.errors.MarkupError
    assert_inert(out, LIVE)
    assert "[/b]" in out


def test_tree_of_a_session_on_a_terminal_is_inert(recorded):
    """The labels are the session's own tokenizer's decoding of the hostile prompts."""
    _rc, _out, db, sid = recorded
    rc, out = run_tty(["tree", sid, "--db", db])
    assert rc == 0, out
    assert_inert(out)
    assert "cached blocks in" in out


def test_sessions_list_on_a_terminal_is_inert(recorded):
    _rc, _out, db, _sid = recorded
    rc, out = run_tty(["sessions", "--db", db])
    assert rc == 0, out
    assert_inert(out)


def test_an_error_line_quoting_hostile_text_is_inert(recorded):
    _rc, _out, db, _sid = recorded
    rc, out = run_tty(["show", "\x1b]0;x\x07[/b]\u202e", "--db", db])
    assert rc == 2
    assert_inert(out)
    assert out.count("\n") == 1 and out.startswith("kvplay: error: unknown session id")
