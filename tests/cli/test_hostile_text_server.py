"""Issue #42, the servers' side: a hostile or compromised server's strings (session ids on the KV
events, its /v1/models id, /detokenize text, chat replies, discovery answers) are data in `kvplay
watch`, `watch URL`, `tree URL`, `tree SESSION` of a watch recording, `show`/`export md` of it and
`kvplay attach` (its lines and its screenshot); names that identify people are checked where
they enter (the API-keys file, a keyless server's body `user`). Real HTTP and ZMQ on loopback,
every command on a pseudo-terminal."""
from __future__ import annotations

import json
import sqlite3
import xml.etree.ElementTree as ET

import httpx
import pytest

from support.hostile import CORPUS, LIVE, MARKUP, MODEL_ID, HostilePub, HostileServer, assert_inert, run_tty
from support.serve import chat
from support.wait import wait_for

from kvplay.cli import main as cli_main


@pytest.fixture
def pub():
    p = HostilePub()
    yield p
    p.close()


@pytest.fixture
def hostile_server():
    made = []

    def make(**kw):
        s = HostileServer(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# --- names, checked where they enter ---------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("user", "ali\x1b]0;pwned\x07ce"), ("user", "bob\u202e"),
                                         ("group", "team\x1b[2J"), ("user", "ad\u200bmin")])
def test_keys_file_refuses_a_name_with_control_characters(tmp_path, capsys, field, value):
    entry = {"key": "sk-0123456789", "user": "alice", "group": "a"}
    entry[field] = value
    f = tmp_path / "keys.toml"
    f.write_text("[[keys]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items()), encoding="utf-8")
    rc = cli_main(["serve", "--api-keys", str(f), "--model", "tiny:llama", "--port", "0", "--no-record",
                   "--db", str(tmp_path / "s.db")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"[[keys]] #1: {field}" in err and "control or invisible character" in err
    assert_inert(err, None)  # the start-up line never printed it raw: it never starts


def test_a_keyless_servers_body_user_with_control_characters_is_refused(serve):
    srv, _state = serve()
    with httpx.Client(timeout=60) as c:
        r = chat(c, srv.url, user="eve\x1b]52;c;cm0gLXJmIH4K\x07")
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "user" and "control or invisible character (␛)" in err["message"]
        assert chat(c, srv.url, user="[/b] [link=http://e.vl]x[/link]").status_code == 200  # markup is text


def test_a_body_users_markup_is_shown_inert_in_the_servers_recording(serve, tmp_path):
    """A keyless playground keeps a name with brackets (it is printable text); the operator's
    `kvplay show` of the server's recording shows it literally."""
    srv, state = serve(record=True)
    with httpx.Client(timeout=60) as c:
        assert chat(c, srv.url, user=MARKUP[1], content=CORPUS[0] + " " + CORPUS[5]).status_code == 200
    db = str(tmp_path / "sessions.db")

    def turns():
        with sqlite3.connect(db) as con:
            return con.execute("select session_id from turns").fetchall()
    wait_for(turns)
    sid = turns()[0][0]
    rc, out = run_tty(["show", sid, "--db", db])
    assert rc == 0, out
    assert_inert(out)
    assert MARKUP[1] in out


# --- watch, tree and attach against hostile servers ------------------------------------------------
def test_watch_human_lines_show_hostile_session_ids_inert(pub, tmp_path):
    db = str(tmp_path / "w.db")
    rc, out = run_tty(["watch", "--events", pub.endpoint, "--duration", "3", "--db", db])
    assert rc == 0, out
    assert_inert(out)
    assert "blocks cached; held by" in out and "␛" in out  # the session ids, shown
    assert "the attribution took" in out and "% of the mirror's" in out  # (its cost on this stream)
    sid = sqlite3.connect(db).execute("select id from sessions where source = 'watch'").fetchone()[0]
    # the recording of it: tree, show and the transcript
    rc, out = run_tty(["tree", sid, "--db", db, "--ids"])
    assert rc == 0, out
    assert_inert(out)
    assert "␛" in out and "cached blocks in" in out
    for argv in (["show", sid, "--db", db], ["export", sid, "--format", "md", "--db", db]):
        rc, out = run_tty(argv)
        assert rc == 0, out
        assert_inert(out)


def test_watch_url_shows_a_hostile_servers_discovery_inert(pub, hostile_server):
    topic = "kv\x1b]0;t\x07"
    pub.topic = topic.encode()
    srv = hostile_server(events=pub.endpoint.replace("127.0.0.1", "*"), topic=topic)  # it binds: connect
    rc, out = run_tty(["watch", srv.url, "--duration", "2", "--no-record"])
    assert rc == 0, out
    assert_inert(out)
    assert "GET /kv_event_sources" in out and "blocks cached" in out


def test_tree_url_shows_a_hostile_servers_model_and_text_inert(pub, hostile_server):
    srv = hostile_server()
    rc, out = run_tty(["tree", srv.url, "--events", pub.endpoint, "--duration", "2"])
    assert rc == 0, out
    assert_inert(out)
    assert "[/b]" in out and "␛]0;pwned␇" in out  # the model id and /detokenize's text, shown
    rc, out = run_tty(["tree", srv.url, "--events", pub.endpoint, "--duration", "2", "--json"])
    assert rc == 0
    tree = json.loads(out)
    assert tree["model"] == MODEL_ID  # JSON keeps the bytes


def test_attach_lines_and_screenshot_against_a_hostile_server_are_inert(pub, hostile_server, tmp_path):
    """`kvplay attach --script … --screenshot` plays turns through the app headless against the
    hostile server (replies, model id, /detokenize, session ids) and saves what it showed."""
    srv = hostile_server(events=pub.endpoint.replace("127.0.0.1", "*"))
    script = tmp_path / "s.toml"
    script.write_text('[[turns]]\nuser = "alice"\ntext = "hi [/b]"\n', encoding="utf-8")
    svg = tmp_path / "a.svg"
    rc, out = run_tty(["attach", srv.url, "--script", str(script), "--screenshot", str(svg), "--no-record"],
                      timeout=300)
    assert rc == 0, out
    assert_inert(out, LIVE)
    text = svg.read_text(encoding="utf-8")
    ET.fromstring(text)  # a raw control character is not XML
    assert_inert(text, None)
    assert "␛" in text  # the server's words are in it, shown
