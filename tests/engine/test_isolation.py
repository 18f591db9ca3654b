"""Isolation and accounting (issue 9, items 1-5): identity from the engine's registry, salts
that never alias, keys frozen at admission, collisions and hits counted once, and a request
stopped by a full pool says so. Each test failed on the code before the fix."""
from __future__ import annotations

import inspect
import json

import pytest

from support.recorded import recorded
from support.steps import drain

from support import EXAMPLES

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.errors import EngineError
from kvplay.engine.events import CollisionCaught, UserGroupChanged
from kvplay.engine.prefix import block_extras, salt_for
from kvplay.engine.sampling import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 4}


def chat(text):
    return [SYSTEM, {"role": "user", "content": text}]


def local_engine(loaded, **cfg):
    """An engine whose scheduler the test drives itself (no engine thread)."""
    cfg.setdefault("model", "tiny:llama")
    return Engine(EngineConfig(**cfg), loaded)


def push(eng, user, prompt_ids, max_tokens=4, **kw):
    req = eng.make_request(user, prompt_ids=list(prompt_ids),
                           sampling=SamplingParams(max_tokens=max_tokens, stop_on_eos=False), **kw)
    eng.take_in(req)
    return req


# --- item 1: identity and salts -----------------------------------------------------------------
def test_a_group_named_like_a_user_never_gets_that_users_salt():
    assert salt_for("group", "alice", None) != salt_for("group", "mallory", "alice")
    assert salt_for("group", "alice", None) == salt_for("user", "alice", None)  # no group: private
    assert salt_for("group", "bob", "g") == salt_for("group", "carol", "g")
    for iso in ("user", "group", "system"):
        assert block_extras(iso, "alice", None, "m", 1, 0, 16) != block_extras(iso, "mallory", "alice", "m", 1, 0, 16)


def test_submit_takes_no_group():
    assert "group" not in inspect.signature(Engine.submit).parameters
    assert "group" not in inspect.signature(Engine.generate).parameters


def test_group_attack_gets_nothing_from_the_victim(make_engine):
    eng = make_engine(isolation="group", num_blocks=128)
    eng.register_user("alice")
    eng.register_user("mallory", "alice")
    secret = chat("my private notes: penicillin allergy, results on the 14th")
    eng.generate("alice", secret, SamplingParams(max_tokens=2), timeout=60)
    m = eng.generate("mallory", secret, SamplingParams(max_tokens=2), timeout=60)
    assert m.stats.cached_from.get("alice", 0) == 0
    assert m.stats.cached_tokens == 0


def test_registry_binds_groups_and_set_group_applies_to_later_requests(make_engine):
    eng = make_engine(isolation="group", num_blocks=128)
    events = []
    eng.subscribe_batches(lambda b: events.extend(e for e in b.events if isinstance(e, UserGroupChanged)))
    eng.register_user("alice", "g1")
    eng.register_user("alice", "g1")  # idempotent
    eng.register_user("bob", "g2")
    with pytest.raises(EngineError, match="set_group"):
        eng.register_user("bob", "g1")
    with pytest.raises(EngineError, match="non-empty"):
        eng.register_user("", "g1")
    eng.generate("alice", chat("team question"), SamplingParams(max_tokens=2), timeout=60)
    assert eng.generate("bob", chat("team question"), SamplingParams(max_tokens=2), timeout=60).stats.cached_tokens == 0
    eng.set_group("bob", "g1")
    b = eng.generate("bob", chat("team question"), SamplingParams(max_tokens=2), timeout=60)
    assert b.stats.cached_from.get("alice", 0) > 0
    assert [(e.user, e.old_group, e.new_group) for e in events] == [("bob", "g2", "g1")]
    eng.set_group("bob", "g1")  # unchanged: no event
    eng.call(lambda: None)
    assert len(events) == 1
    assert eng.users.users() == {"alice": "g1", "bob": "g1"}


def test_an_unregistered_user_is_registered_without_a_group(make_engine):
    eng = make_engine(isolation="group")
    eng.generate("zoe", chat("hi"), SamplingParams(max_tokens=1), timeout=60)
    assert eng.users.users() == {"zoe": None}


def test_group_change_is_recorded(make_engine, tmp_path):
    from kvplay.sessions.recorder import Recorder

    eng = make_engine(isolation="group")
    rec = Recorder.open(str(tmp_path / "s.db"), eng.config, eng.model_name, "run", "")
    rec.attach(eng)
    eng.register_user("bob", "g2")
    eng.set_group("bob", "g1")
    eng.call(lambda: None)
    rec.close()
    rows = recorded(tmp_path / "s.db", kinds=("UserGroupChanged",))
    assert len(rows) == 1 and rows[0]["user"] == "bob" and rows[0]["new_group"] == "g1"


def test_kvplay_run_group_attack_example_gives_zero_tokens_from_alice(capsys, tmp_path, monkeypatch):
    from kvplay.cli import main as cli

    monkeypatch.setenv("KVPLAY_DB", str(tmp_path / "unused.db"))
    rc = cli(["run", str(EXAMPLES / "group-attack.toml"), "--isolation", "group", "--json",
              "--model", "tiny:llama", "--no-record"])
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert rc == 0
    turns = {o["user"]: o for o in objs if not o.get("summary")}
    assert turns["mallory"]["cached_from"].get("alice", 0) == 0
    assert objs[-1]["isolation"] == "group"


# --- item 2: keys frozen at admission -------------------------------------------------------------
def test_isolation_change_while_requests_run_and_get_preempted_gives_no_false_collision(tiny_llama):
    eng = local_engine(tiny_llama, num_blocks=14, prefill_budget=64)
    caught = []
    eng.subscribe_batches(lambda b: caught.extend(e for e in b.events if isinstance(e, CollisionCaught)))
    reqs = [push(eng, f"u{i}", [10 + i] * 40, max_tokens=40) for i in range(3)]
    for _ in range(3):  # all three running, their full blocks registered under `shared`
        eng.step()
    assert all(r.status == "running" for r in reqs)
    eng.reconfigure(isolation="user")
    preempted_before = eng.scheduler.preemptions
    drain(eng)
    assert eng.scheduler.preemptions > preempted_before, "the pool should force a preemption"
    assert caught == [] and eng.scheduler.collisions_caught == 0
    assert all(r.stats.finish_reason == "length" for r in reqs)
    eng.pool.check()


def test_a_running_request_keeps_its_keys_and_a_readmitted_one_takes_the_current_ones(tiny_llama):
    eng = local_engine(tiny_llama, num_blocks=64)
    r = push(eng, "alice", [7] * 40, max_tokens=3)
    eng.step()
    keys = r.keys
    assert keys.isolation == "shared" and keys.salt is None
    eng.reconfigure(isolation="user")
    eng.step()
    assert r.keys is keys  # running: unchanged
    eng.scheduler._preempt(r)
    assert r.hashes == [] and r.keys is None
    eng.step()  # re-admitted under the mode in force now
    assert r.keys.isolation == "user" and r.keys.salt == ("salt", "user:alice")
    drain(eng)
    eng.pool.check()


def test_blocks_filled_after_a_hash_change_are_not_indexed(tiny_llama):
    eng = local_engine(tiny_llama, num_blocks=64, prefill_budget=16)
    r = push(eng, "alice", [9] * 48, max_tokens=2)
    eng.step()  # first 16 tokens
    eng.reconfigure(hash="blake2b64")  # a new cache generation
    drain(eng)
    assert r.stats.finish_reason == "length"
    assert eng.pool.num_cached() == 0  # nothing from the old generation entered the new index
    eng.pool.check()


# --- item 3: a collision counts once per request --------------------------------------------------
def test_a_collision_is_counted_once_per_request_not_per_admission_retry(tiny_llama):
    eng = local_engine(tiny_llama, num_blocks=8, hash="trunc:1")
    big = push(eng, "big", [20] * 100, max_tokens=12)  # 7 of the 8 blocks: the others wait
    eng.step()
    extras0 = block_extras("shared", "x", None, eng.model_name, 1, 0, 16)[0]
    target = eng.hasher.block_hash(None, [20] * 16, extras0)
    tok = next(t for t in range(30, 200) if eng.hasher.block_hash(None, [t] * 16, extras0) == target)
    waiter = push(eng, "waiter", [tok] * 40, max_tokens=2)  # its block 0 hash collides with big's
    caught = []
    eng.subscribe_batches(lambda b: caught.extend(e for e in b.events if isinstance(e, CollisionCaught)))
    steps = 0
    while waiter.status == "waiting":
        eng.step()
        steps += 1
    assert steps > 3, "the waiter should retry admission several times"
    drain(eng)
    assert waiter.stats.collisions_caught == 1
    assert [e.request_id for e in caught] == [waiter.request_id]
    assert eng.scheduler.collisions_caught == 1
    assert big.stats.finish_reason == "length"


# --- item 4: a re-admission is not a new hit ------------------------------------------------------
def test_readmission_after_preemption_does_not_count_block_hits_again(tiny_llama):
    eng = local_engine(tiny_llama, num_blocks=64)
    prefix = list(range(40, 88))  # 3 full blocks
    push(eng, "alice", prefix + [1, 2], max_tokens=1)
    drain(eng)
    bob = push(eng, "bob", prefix + [3, 4, 5], max_tokens=20)
    eng.step()
    hit = bob.block_table[:3]
    assert [eng.pool.blocks[b].hits for b in hit] == [1, 1, 1]
    eng.scheduler._preempt(bob)
    eng.step()  # re-admitted: the same cached blocks again
    assert bob.block_table[:3] == hit
    assert [eng.pool.blocks[b].hits for b in hit] == [1, 1, 1]
    assert all(eng.pool.blocks[b].users_seen == {"alice", "bob"} for b in hit)
    drain(eng)
    assert eng.scheduler.hit_tokens == 48


# --- item 5: a full pool has its own finish reason ------------------------------------------------
def test_a_lone_request_stopped_by_a_full_pool_finishes_pool_exhausted(make_engine):
    eng = make_engine(num_blocks=4)
    res = eng.submit("alice", prompt_ids=[5] * 40,
                     sampling=SamplingParams(max_tokens=100, stop_on_eos=False)).result(60)
    assert res.finish_reason == "pool_exhausted" and res.error is None
    assert res.stats.output_tokens == 4 * 16 - 40 + 1  # the last slot's token is sampled, not stored


def test_pool_exhausted_is_shown_in_kvplay_run_rows(make_engine):
    from kvplay.sessions.player import Done, Job
    from kvplay.sessions.headless import table_row

    eng = make_engine(num_blocks=4)
    sp = SamplingParams(max_tokens=100, stop_on_eos=False)
    res = eng.submit("alice", prompt_ids=[5] * 40, sampling=sp).result(60)
    row = table_row(Done(Job(1, "alice", "x", sp), [], res, None, 0.0, 0.0))
    assert "pool is full" in row[-1]


@pytest.mark.parametrize("cfg,flag", [(dict(num_blocks=1), "--num-blocks"), (dict(num_blocks=None, cache_mb=0.01), "--cache-mb")])
def test_too_long_message_names_the_flag_in_use(tiny_llama, cfg, flag):
    eng = local_engine(tiny_llama, **cfg)
    n = eng.pool.num_blocks
    with pytest.raises(EngineError) as exc:
        eng.make_request("alice", prompt_ids=[5] * (16 * n + 5))
    msg = str(exc.value)
    assert flag in msg
    assert f"holds {n} block{'' if n == 1 else 's'} —" in msg
