"""Traces out and in: a recorded session as vLLM KV events (JSONL, msgpack) and as a Mooncake
trace; each imports as a session that the scrubber and the simulator open; bad files get one
line naming the record and field (exit 2) and keep what came before."""
import json

import msgpack
import pytest

from support import EXAMPLES, FIXTURES

from kvplay.cli import main as cli
from kvplay.sessions.history import load_recording, pool_state
from kvplay.sessions.simulate import simulate
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import read_trace_file, session_trace
from kvplay.wire.codec import BlockStored, decode_batch


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A recorded `kvplay run` (tiny model, shared isolation so users reuse each other) exported
    in the three trace formats."""
    d = tmp_path_factory.mktemp("traces")
    db = str(d / "s.db")
    script = EXAMPLES / "eviction-pressure.toml"
    assert cli(["run", str(script), "--model", "tiny:llama", "--num-blocks", "80", "--isolation", "shared",
                "--db", db, "--json"]) == 0
    sid = next(open_db(db).query("select id from sessions"))["id"]
    files = {}
    for fmt in ("vllm-jsonl", "vllm-msgpack", "mooncake"):
        files[fmt] = d / f"trace.{fmt}"
        assert cli(["export", sid, "--db", db, "--format", fmt, "-o", str(files[fmt])]) == 0
    return {"db": db, "sid": sid, "files": files, "dir": d}


def _recorded(exported):
    d = open_db(exported["db"])
    try:
        return load_recording(d, exported["sid"])
    finally:
        d.close()


def test_vllm_exports_decode_with_the_wire_codec(exported):
    rec = _recorded(exported)
    stored = [e for e in rec.events if e.kind == "BlockStored"]
    removed = sum(len(e.block_hashes) for e in rec.events if e.kind == "BlockRemoved" and e.reason == "evicted")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(exported["files"]["vllm-msgpack"].read_bytes())
    batches = [decode_batch(msgpack.packb(o, use_bin_type=True)) for o in unpacker]
    evs = [ev for b in batches for ev in b.events]
    wire_stored = [ev for ev in evs if isinstance(ev, BlockStored)]  # a request's chain in one, as vLLM sends
    assert sum(len(ev.block_hashes) for ev in wire_stored) == sum(len(e.block_hashes) for e in stored)
    assert len(evs) - len(wire_stored) == removed  # one BlockRemoved per evicted block, as vLLM sends
    first = wire_stored[0]
    assert isinstance(first.block_hashes[0], int) and first.medium == "GPU"
    assert first.token_ids[:len(stored[0].token_ids)] == stored[0].token_ids and first.session_id == stored[0].user
    lines = exported["files"]["vllm-jsonl"].read_text().splitlines()
    assert len(lines) == len(batches)
    assert json.loads(lines[0])["events"][0]["block_hashes"] == batches[0].events[0].block_hashes


def test_mooncake_export(exported):
    lines = [json.loads(x) for x in exported["files"]["mooncake"].read_text().splitlines()]
    rec = _recorded(exported)
    assert len(lines) == len(rec.turns)
    for r in lines:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // 16)
    # everyone starts with the same system prompt: the leading ids are shared
    assert len({tuple(r["hash_ids"][:5]) for r in lines}) == 1
    assert lines == sorted(lines, key=lambda r: r["timestamp"])


@pytest.mark.parametrize("fmt", ["vllm-jsonl", "vllm-msgpack", "mooncake"])
def test_import_opens_in_scrubber_and_simulator(exported, fmt, tmp_path, capsys):
    db = str(tmp_path / "imp.db")
    assert cli(["import", str(exported["files"][fmt]), "--db", db]) == 0
    out = capsys.readouterr().out
    assert "imported" in out
    sid = out.split("as session ")[1].split(":")[0]
    d = open_db(db)
    try:
        rec = load_recording(d, sid)
        trace = session_trace(d, sid)
    finally:
        d.close()
    assert rec.session["source"] == "import" and rec.turns
    end = pool_state(rec.batches, len(rec.events), rec.num_blocks)
    assert end.count("cached") > 0 and end.hit_tokens > 0  # the users' shared system prompt is reused
    res = simulate(trace)  # the imported session replays to its own hits
    assert (res.hit_tokens, res.query_tokens) == (trace.recorded_hit_tokens, trace.recorded_query_tokens)
    assert cli(["simulate", str(exported["files"][fmt]), "--json", "--num-blocks", "40", "80"]) == 0
    j = json.loads(capsys.readouterr().out)
    opt = {r["num_blocks"]: r["hit_rate"] for r in j["results"] if r["policy"] == "belady"}
    assert all(r["hit_rate"] <= opt[r["num_blocks"]] for r in j["results"])
    assert cli(["scrub", sid, "--db", db, "--screenshot", str(tmp_path / "s.svg")]) == 0


def _one_line_exit_2(capsys, argv, *needles):
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_truncated_file_imports_up_to_its_last_good_record(exported, tmp_path, capsys):
    text = exported["files"]["vllm-jsonl"].read_text()
    lines = text.splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    db = str(tmp_path / "imp.db")
    _one_line_exit_2(capsys, ["import", str(cut), "--db", db], f"record {len(lines)}", "truncated")
    good = read_trace_file(str(cut))
    assert good.records == len(lines) - 1 and good.error
    d = open_db(db)
    assert next(d.query("select count(*) as n from sessions"))["n"] == 1  # the good part is there
    d.close()
    raw = exported["files"]["vllm-msgpack"].read_bytes()
    (tmp_path / "cut.msgpack").write_bytes(raw[:-7])
    _one_line_exit_2(capsys, ["import", str(tmp_path / "cut.msgpack"), "--db", db], "truncated msgpack")
    moon = exported["files"]["mooncake"].read_text().splitlines()
    (tmp_path / "cut.mooncake").write_text("\n".join(moon[:-1]) + "\n" + moon[-1][:20])
    _one_line_exit_2(capsys, ["simulate", str(tmp_path / "cut.mooncake"), "--json"], f"record {len(moon)}")


def test_other_formats_and_broken_chains(exported, tmp_path, capsys):
    db = str(tmp_path / "imp.db")
    toml = EXAMPLES / "eviction-pressure.toml"
    _one_line_exit_2(capsys, ["import", str(toml), "--db", db], "record 1")
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "hello", "model": "x"}\n')
    _one_line_exit_2(capsys, ["import", str(other), "--db", db], "record 1", "events")
    # a Mooncake id that follows another parent than before: the hashes do not chain
    moon = [json.loads(x) for x in exported["files"]["mooncake"].read_text().splitlines()]
    moon[1]["hash_ids"][3] = moon[0]["hash_ids"][5]
    bad = tmp_path / "bad.mooncake"
    bad.write_text("\n".join(json.dumps(r) for r in moon) + "\n")
    _one_line_exit_2(capsys, ["import", str(bad), "--db", db], "record 2", "hash_ids[3]", "do not chain")
    # a vLLM BlockStored whose parent was never stored
    lines = exported["files"]["vllm-jsonl"].read_text().splitlines()
    b = json.loads(lines[2])
    ev = next(e for e in b["events"] if e["type"] == "BlockStored" and e["parent_block_hash"] is not None)
    ev["parent_block_hash"] = 12345
    lines[2] = json.dumps(b)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    _one_line_exit_2(capsys, ["import", str(broken), "--db", db], "record 3", "parent_block_hash", "do not chain")
    # a Mooncake trace read with the wrong block size
    _one_line_exit_2(capsys, ["import", str(exported["files"]["mooncake"]), "--db", db, "--block-size", "32"],
                     "record 1", "hash_ids", "--block-size")


def test_a_real_vllm_capture_imports_and_simulates(tmp_path, capsys):
    """Events captured off a real vLLM 0.32 (CPU, SmolLM2, users sharing a system prompt;
    scripts/capture_vllm_events.py): payloads back to back (the bakery trace) and the watch
    helper's captures of whole ZMQ messages, int and bytes hashes. Each imports and simulates,
    and the reuse it shows is the server's own count."""
    caps = sorted(p for p in FIXTURES.glob("*") if "vllm" in p.name and p.suffix in (".jsonl", ".msgpack"))
    assert any(p.name == "vllm-capture-bakery.msgpack" for p in caps)
    for cap in caps:
        read = read_trace_file(str(cap))
        assert read.error is None and len(read.trace.requests) >= 2, cap
        assert read.trace.config.block_size == 32
        db = str(tmp_path / "v.db")
        assert cli(["import", str(cap), "--db", db]) == 0
        sid = capsys.readouterr().out.split("as session ")[1].split(":")[0]
        d = open_db(db)
        rec = load_recording(d, sid)
        d.close()
        assert pool_state(rec.batches, len(rec.events), rec.num_blocks).hit_tokens > 0
        assert cli(["simulate", str(cap), "--json", "--policy", "lru,fifo,belady"]) == 0
        j = json.loads(capsys.readouterr().out)
        assert j["recorded"]["hit_rate"] > 0.25  # the users shared the system prompt on the server
        if cap.name.startswith("vllm_capture"):  # its requests' usage: 192 cached tokens in all (bob's first turn)
            assert read.trace.recorded_hit_tokens == 192
        opt = {r["num_blocks"]: r["hit_rate"] for r in j["results"] if r["policy"] == "belady"}
        assert all(r["hit_rate"] <= opt[r["num_blocks"]] for r in j["results"])


def test_a_blocks_only_session_simulates(tmp_path, capsys):
    """A session with block events and no requests (what `kvplay watch` records of a real server)
    simulates from its stored chains."""
    from kvplay.sessions.ids import new_ulid
    from kvplay.sessions.store import write_txn

    db = open_db(str(tmp_path / "w.db"))
    sid = new_ulid()
    sys_blocks = [[i] * 4 for i in range(1, 4)]
    evs, seq, parent = [], 0, None
    for i, toks in enumerate(sys_blocks):  # alice stores a 3-block system prompt
        seq += 1
        evs.append({"kind": "BlockStored", "seq": seq, "ts": 1.0, "block_hashes": [f"s{i}"], "parent_block_hash": parent,
                    "token_ids": toks, "block_size": 4, "user": "alice"})
        parent = f"s{i}"
    for who, t in (("bob", 2.0), ("carol", 3.0)):  # then bob and carol store their own block under it
        seq += 1
        evs.append({"kind": "BlockStored", "seq": seq, "ts": t, "block_hashes": [f"{who}1"], "parent_block_hash": "s2",
                    "token_ids": [9, 9, 9, ord(who[0])], "block_size": 4, "user": who})
    with write_txn(db):
        db["sessions"].insert({"id": sid, "created": 1.0, "source": "watch", "model": "remote", "engine_config": "{}"})
        db["cache_events"].insert_all([{"session_id": sid, "seq": e["seq"], "ts": e["ts"], "kind": e["kind"],
                                        "payload": json.dumps(e)} for e in evs])
    trace = session_trace(db, sid)
    db.close()
    assert [r.user for r in trace.requests] == ["alice", "bob", "carol"]
    assert trace.recorded_hit_tokens == 24  # bob and carol each reused alice's 12 tokens on the server
    assert simulate(trace).hit_tokens == 24
    assert cli(["simulate", sid, "--db", str(tmp_path / "w.db"), "--json"]) == 0
    assert cli(["scrub", sid, "--db", str(tmp_path / "w.db"), "--screenshot", str(tmp_path / "w.svg")]) == 0


@pytest.mark.parametrize("event", [{"type": "BlockStored", "block_hashes": "ab", "token_ids": [1], "block_size": 1},
                                   {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": "1"}])
def test_a_trace_with_a_wrongly_typed_event_is_refused_in_one_line(tmp_path, capsys, event):
    """The wire decoder skips a bad event in a live stream; an imported trace is refused whole."""
    db = str(tmp_path / "imp.db")
    mp = tmp_path / "bad.msgpack"
    mp.write_bytes(msgpack.packb([1.0, [event]]))
    _one_line_exit_2(capsys, ["import", str(mp), "--db", db], "record 1", "wrongly typed")
    js = tmp_path / "bad.jsonl"
    js.write_text(json.dumps({"ts": 1.0, "events": [event]}) + "\n")
    _one_line_exit_2(capsys, ["import", str(js), "--db", db], "record 1", "events[0]")
