"""Why each uncached prompt token was computed (engine/miss.py), on the real engine: every reason
built on purpose, with exact counts and positions, and a property test that the reasons always
cover the uncached tokens exactly."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.events import MissExplained
from kvplay.engine.miss import (REASONS, Removal, RemovedLog, RotatingBloom, miss_from_event, miss_object, miss_text,
                                redact)
from kvplay.engine.prefix import BlockHasher
from kvplay.engine.sampling import SamplingParams
from kvplay.tui.format import event_line

BS = 16
G = SamplingParams(max_tokens=3, stop_on_eos=False)


def ids(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny character vocabulary (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 100) for _ in range(n)]


def ask(eng, user, prompt, sampling=G):
    r = eng.submit(user, prompt_ids=prompt, sampling=sampling).result(60)
    assert r.ok, r.error
    return r


def check_sum(st):
    m = st.miss
    assert m is not None
    assert m["tokens"] == sum(m["reasons"].values()) == st.prompt_tokens - st.cached_tokens
    assert set(m["reasons"]) == set(REASONS)
    pos = st.cached_tokens  # spans cover [cached, prompt) in order, once
    for start, n, reason, _, _ in m["spans"]:
        assert start == pos and n > 0 and reason in REASONS
        pos += n
    assert pos == st.prompt_tokens
    return m


def limit_tokens(n: int) -> int:
    """Tokens of the reusable full blocks of an n-token prompt (the last token's block is not)."""
    return (n - 1) // BS * BS


def test_cold_and_tail(make_engine):
    eng = make_engine()
    for n in (100, 96, 7):  # a partial last block; a prompt ending on a block boundary; less than a block
        m = check_sum(ask(eng, "alice", ids(n, n)).stats)
        assert m["reasons"]["cold"] == limit_tokens(n)
        assert m["reasons"]["tail"] == n - limit_tokens(n)
        assert m["spans"][-1][:3] == [limit_tokens(n), n - limit_tokens(n), "tail"]
    assert m["reasons"]["tail"] == 7  # a prompt shorter than a block is all tail
    assert miss_text(m) == "7 (tail)"


def test_a_timestamp_in_the_system_prompt_diverges_exactly_there(make_engine):
    eng = make_engine()
    system = "You are a careful assistant for the bakery. Current time: 10:0{}:00 UTC. " \
             "Answer briefly and plainly, in the customer's language, and never invent prices. " * 1
    msgs = [[{"role": "system", "content": system.format(d) + "Keep it short. " * 6},
             {"role": "user", "content": "Are you open on Mondays?"}] for d in (1, 2)]
    a = eng.generate("alice", msgs[0], G, timeout=60)
    b = eng.generate("bob", msgs[1], G, timeout=60)
    pa, pb = eng.encode(msgs[0])[0], eng.encode(msgs[1])[0]
    at = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
    assert eng.tokenizer.decode(pb[at:at + 1]) == "2"  # the character-level tokenizer: the minute
    check_sum(a.stats)
    m = check_sum(b.stats)
    assert b.stats.cached_tokens == at // BS * BS and b.stats.cached_from == {"alice": at // BS * BS}
    assert m["diverged_at"] == at and m["diverged_from"] == "alice"
    n = b.stats.prompt_tokens
    assert m["reasons"]["diverged"] == limit_tokens(n) - at // BS * BS
    assert m["reasons"]["tail"] == n - limit_tokens(n)
    assert m["reasons"]["diverged"] + m["reasons"]["tail"] == m["tokens"]
    ex = m["excerpt"]  # the decoded text on both sides of the divergence point
    assert "10:02:00" in ex["prompt"] and "10:01" in ex["cached"]
    assert miss_text(m, "bob").startswith(f"{m['tokens']}: {m['reasons']['diverged']} diverged at {at}")


def test_a_divergence_on_a_block_boundary_is_still_a_divergence(make_engine):
    eng = make_engine()
    p = ids(11, 80)
    ask(eng, "alice", p)
    q = p[:32] + [x + 1 if x < 99 else 10 for x in p[32:]]  # differs from token 32 on: a block's first
    m = check_sum(ask(eng, "bob", q).stats)
    assert m["diverged_at"] == 32 and m["diverged_from"] == "alice"
    assert m["reasons"]["diverged"] == limit_tokens(80) - 32
    r = ask(eng, "carol", [x + 2 if x < 98 else 11 for x in p])  # nothing in common: cold, not diverged at 0
    assert r.stats.miss["reasons"]["cold"] == limit_tokens(80) and r.stats.miss["diverged_at"] is None


def test_a_pool_too_small_for_two_users_says_who_evicted(make_engine):
    eng = make_engine(num_blocks=24, isolation="user")
    removed = []
    eng.subscribe_batches(lambda b: removed.extend(e for e in b.events if e.kind == "BlockRemoved"))
    pa = ids(1, 150)
    a1 = ask(eng, "alice", pa)
    ask(eng, "bob", ids(2, 300))  # needs 19+ of the 24 blocks: evicts alice's cached ones
    eng.call(lambda: None)  # the step that finished it has handed over its batch
    evicted = {h for e in removed if e.by_user == "bob" for h in e.block_hashes}
    assert evicted and all(e.policy == "lru" for e in removed if e.reason == "evicted")
    a2 = ask(eng, "alice", pa)
    m = check_sum(a2.stats)
    n_evicted_blocks = limit_tokens(150) // BS - a2.stats.cached_tokens // BS
    assert n_evicted_blocks > 0
    assert m["reasons"]["evicted"] == n_evicted_blocks * BS
    assert m["evicted_by"] == {"bob": n_evicted_blocks * BS}
    assert m["eviction_policy"] == "lru" and m["evicted_at"] is not None
    assert m["reasons"]["tail"] == 150 - limit_tokens(150)
    assert a1.stats.miss["reasons"]["cold"] == limit_tokens(150)
    assert miss_text(m, "alice") == f"{m['tokens']}: {n_evicted_blocks * BS} evicted by bob, {m['reasons']['tail']} tail"


@pytest.mark.parametrize("mode", ["user", "group", "system"])
def test_isolation_says_whose_blocks_would_have_hit(make_engine, mode):
    eng = make_engine(isolation=mode, num_blocks=128)
    for user, group in (("alice", "g1"), ("bob", "g1"), ("carol", "g2")):
        eng.register_user(user, group)
    msgs = [{"role": "system", "content": "A system prompt shared by everyone on this engine. " * 3},
            {"role": "user", "content": "the same question from three users"}]
    eng.generate("alice", msgs, G, timeout=60)
    b = eng.generate("bob", msgs, G, timeout=60)
    c = eng.generate("carol", msgs, G, timeout=60)
    n = c.stats.prompt_tokens
    sys_blocks = eng.encode(msgs)[1] // BS * BS
    for res, isolated in ((b, mode != "group"), (c, True)):
        m = check_sum(res.stats)
        expect = limit_tokens(n) - (sys_blocks if mode == "system" else 0)
        if isolated:
            assert m["reasons"]["isolated"] == expect and m["isolated_from"] == {"alice": expect}
            assert res.stats.cached_tokens == limit_tokens(n) - expect
        else:  # bob shares alice's group: a hit, only the tail computed
            assert res.stats.cached_tokens == limit_tokens(n) and m["reasons"]["isolated"] == 0
        assert m["reasons"]["tail"] == n - limit_tokens(n)


@pytest.mark.parametrize("mode", ["user", "system"])
def test_without_across_keys_a_miss_and_its_work_do_not_depend_on_other_keys_blocks(make_engine, monkeypatch, mode):
    """`set_miss_across_keys(False)` (kvplay serve with keys): carol's miss is explained from her
    own keys only, so neither its reasons nor the work done on her request's path (content keys
    computed: the across-keys walk makes one per block of another tenant's identical prefix) tell
    her whether alice cached the same prompt."""
    from kvplay.engine import miss as miss_mod

    calls, inside = [], []  # content keys made while a miss is explained (storing blocks makes them too)
    real, explain = miss_mod.content_key, miss_mod.MissTracker.explain
    monkeypatch.setattr(miss_mod, "content_key", lambda parent, tokens: (inside and calls.append(1)) or real(parent, tokens))
    monkeypatch.setattr(miss_mod.MissTracker, "explain",
                        lambda self, *a, **k: inside.append(1) or (explain(self, *a, **k), inside.clear())[0])
    msgs = [{"role": "system", "content": "A system prompt shared by everyone on this engine. " * 3},
            {"role": "user", "content": "the same question, asked at some length by two users " * 3}]
    other = [msgs[0], {"role": "user", "content": "an unrelated question of about the same length, asked once " * 3}]
    seen = {}
    for across in (True, False):
        eng = make_engine(isolation=mode, num_blocks=256)
        eng.set_miss_across_keys(across)
        for user, group in (("alice", "g1"), ("carol", "g2")):
            eng.register_user(user, group)
        eng.generate("alice", msgs, G, timeout=60)
        for name, prompt in (("twin", msgs), ("other", other)):
            calls.clear()
            m = check_sum(eng.generate("carol", prompt, G, timeout=60).stats)
            seen[across, name] = (m["reasons"], len(calls))
    n_iso = seen[True, "twin"][0]["isolated"]
    assert n_iso > 0 and seen[True, "twin"][1] >= n_iso // BS  # across keys: alice's blocks walked
    (twin, w_twin), (other_r, w_other) = seen[False, "twin"], seen[False, "other"]
    assert twin["isolated"] == 0 and twin["cold"] == n_iso + seen[True, "twin"][0]["cold"]
    assert w_twin == w_other == 0  # own keys only: no content walk, whoever cached what


def test_a_reset_says_cleared(make_engine):
    eng = make_engine()
    p = ids(3, 90)
    ask(eng, "alice", p)
    eng.clear_cache()
    m = check_sum(ask(eng, "alice", p).stats)
    assert m["reasons"]["cleared"] == limit_tokens(90) and m["cleared_at"] is not None
    assert m["spans"][0][3] == "alice"  # whose blocks the clear removed


@pytest.mark.parametrize("change", [{"hash": "blake2b64"}, {"deterministic": True}, {"hash_seed": "other"}])
def test_a_reconfigure_says_config(make_engine, change):
    """A hash change makes new hashes (remembered by content); a determinism change keeps them."""
    eng = make_engine()
    p = ids(4, 90)
    ask(eng, "alice", p)
    eng.reconfigure(**change)
    m = check_sum(ask(eng, "alice", p).stats)
    assert m["reasons"]["config"] == limit_tokens(90)
    assert m["reasons"]["tail"] == 90 - limit_tokens(90)


def test_a_caught_collision_is_its_own_reason(make_engine):
    eng = make_engine(hash="trunc:12")
    h = BlockHasher("trunc:12", BS)
    a = ids(5, 40)
    target = h.chain(a[:BS], [[("model", eng.model_name)]])[0]
    rng = random.Random(6)
    for _ in range(200_000):  # a different first block with the same 12-bit hash
        b0 = [rng.randrange(10, 100) for _ in range(BS)]
        if b0 != a[:BS] and h.chain(b0, [[("model", eng.model_name)]])[0] == target:
            break
    else:
        pytest.fail("no colliding block found")
    ask(eng, "alice", a)
    bob = ask(eng, "bob", b0 + ids(7, 24))
    m = check_sum(bob.stats)
    assert bob.stats.collisions_caught == 1 and bob.stats.cached_tokens == 0
    assert m["spans"][0][:4] == [0, BS, "collision", "alice"]
    assert m["reasons"]["collision"] == BS and m["reasons"]["tail"] == 40 - limit_tokens(40)


def test_the_event_carries_the_same_object(make_engine):
    eng = make_engine()
    seen = []
    eng.subscribe_batches(lambda b: seen.extend(e for e in b.events if isinstance(e, MissExplained)))
    p = ids(8, 70)
    ask(eng, "alice", p)
    r = ask(eng, "bob", p[:50] + ids(9, 30))
    eng.call(lambda: None)  # the step that finished it has handed over its batch
    ev = next(e for e in seen if e.request_id == r.request_id)
    assert ev.cached_tokens == r.stats.cached_tokens and ev.prompt_tokens == r.stats.prompt_tokens
    assert miss_from_event(ev) == r.stats.miss == miss_from_event(ev.to_dict())  # live, or recorded
    assert r.stats.miss["diverged_at"] == 50
    # 80 tokens: 48 cached (50 // 16 blocks), 16 diverged, 16 tail (the last token's block)
    assert event_line(ev, {}).endswith("missed  bob: 32: 16 diverged at 50, 16 tail")
    fin = r.stats.to_dict()
    assert fin["miss"] == r.stats.miss  # RequestFinished.stats (and so recordings) carry it


def test_attribution_off_leaves_no_trace(make_engine):
    eng = make_engine()
    eng.set_miss_attribution(False)
    seen = []
    eng.subscribe_batches(lambda b: seen.extend(e for e in b.events if isinstance(e, MissExplained)))
    r = ask(eng, "alice", ids(10, 40))
    eng.call(lambda: None)  # the step that finished it has handed over its batch
    assert r.stats.miss is None and not seen


def test_redaction_hides_other_tenants():
    spans = [[32, 16, "evicted", "alice", "bob"], [48, 16, "evicted", "mallory", "mallory"],
             [64, 32, "isolated", "carol", ""], [96, 16, "diverged", "dave", ""], [112, 5, "tail", "", ""]]
    full = miss_object(spans, 97, ("…10:01", "…10:02"))
    assert full["evicted_by"] == {"bob": 16, "mallory": 16} and full["isolated_from"] == {"carol": 32}
    mine = redact(full, "alice")
    assert mine["tokens"] == full["tokens"]
    assert mine["reasons"]["evicted"] == 16 and mine["evicted_by"] == {"others": 16}
    assert mine["reasons"]["isolated"] == 0 and mine["isolated_from"] == {}
    assert mine["reasons"]["diverged"] == 0 and mine["diverged_at"] is None and mine["excerpt"] is None
    assert mine["reasons"]["cold"] == 16 + 32 + 16
    text = repr(mine)
    for other in ("bob", "mallory", "carol", "dave", "10:02"):
        assert other not in text


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["shared", "user", "group", "system"]),
       blocks=st.integers(12, 40),
       policy=st.sampled_from(["lru", "lfu", "fifo"]),
       ops=st.lists(st.one_of(
           st.tuples(st.just("ask"), st.sampled_from(["alice", "bob", "carol"]), st.integers(0, 3),
                     st.integers(0, 3), st.integers(1, 70)),
           st.tuples(st.just("clear"), st.just(""), st.just(0), st.just(0), st.just(0)),
           st.tuples(st.just("hash"), st.just(""), st.just(0), st.just(0), st.just(0))),
           min_size=2, max_size=9))
def test_reasons_always_sum_to_the_uncached_tokens(tiny_llama, mode, blocks, policy, ops):
    """Random mixes of shared prefixes, tails, pool sizes, isolation modes, clears and
    reconfigures: every request's reasons cover exactly its uncached prompt tokens."""
    heads = [ids(100 + i, 40) for i in range(4)]  # shared starts (a system prompt), then variants
    with Engine(EngineConfig(model="tiny:llama", num_blocks=blocks, isolation=mode, eviction=policy,
                             prefill_budget=32), tiny_llama) as eng:
        for user, group in (("alice", "g1"), ("bob", "g1"), ("carol", None)):
            eng.register_user(user, group)
        pending = []
        hashes = iter(["blake2b64", "sha256"] * 5)
        for op, user, head, tail, n in ops:
            if op == "clear":
                eng.clear_cache()
            elif op == "hash":
                eng.reconfigure(hash=next(hashes))
            else:
                prompt = heads[head][:max(1, n // 2)] + ids(200 + tail, n)
                if len(prompt) + 4 > blocks * BS:
                    prompt = prompt[:blocks * BS - 8]
                pending.append(eng.submit(user, prompt_ids=prompt, sampling=SamplingParams(max_tokens=3)))
        for h in pending:
            r = h.result(60)
            if r.ok:
                check_sum(r.stats)
        eng.call(eng.pool.check)


# --- the bounded memory of removed blocks ------------------------------------------------------
def test_rotating_bloom_false_positive_rate_and_size():
    b = RotatingBloom(capacity=20_000, bits_per_item=24, probes=12)
    assert b.nbytes == 2 * 938 * 64  # two generations of 24 bits per item, in whole 64-byte blocks
    rng = random.Random(1)
    added = [rng.getrandbits(256) for _ in range(40_000)]  # fills both generations
    b.add_many(added)
    assert len(b) == 40_000
    assert all(k in b for k in added[20_000:])  # the last `capacity` items are always remembered
    probes = [rng.getrandbits(256) for _ in range(200_000)]
    fp = sum(k in b for k in probes) / len(probes)
    assert b.false_positive_bound == pytest.approx(2 * 5.1e-5, rel=0.05)
    assert fp <= 2 * b.false_positive_bound  # measured: 200,000 never-added keys
    b.add_many([rng.getrandbits(64) for _ in range(20_000)])  # a third generation forgets the first
    assert sum(k in b for k in added[:20_000]) / 20_000 < 0.01
    seq = RotatingBloom(capacity=20_000, bits_per_item=24, probes=12)  # a server's counter-like hashes
    seq.add_many(list(range(1, 40_001)))
    assert all(k in seq for k in range(20_001, 40_001))
    assert sum(k in seq for k in range(10**6, 10**6 + 200_000)) / 200_000 <= 2 * seq.false_positive_bound


def test_removed_log_keeps_details_for_the_recent_ones_and_the_reason_for_older():
    log = RemovedLog(recent=100, bloom_capacity=1000, flush_every=16)
    for k in range(1, 1001):
        log.add(k, Removal("evicted" if k % 2 else "cleared", float(k), "lru", "bob", "alice"))
    assert 100 <= len(log.recent) < 100 + 16  # bounded: the oldest leave 16 at a time
    assert log.get(1000) == Removal("cleared", 1000.0, "lru", "bob", "alice")  # recent: details
    old = log.get(3)
    assert old is not None and old.reason == "evicted" and old.by is None  # older: the reason only
    assert log.get(4).reason == "cleared"
    assert log.get(10**9) is None
    assert set(log.blooms) == {"evicted", "cleared"} and log.nbytes == 2 * 2 * 47 * 64  # 24 bits an item, whole blocks
    assert log.false_positive_bound == pytest.approx(6 * 5.0e-5, rel=0.05)


def test_default_sizes_are_what_the_docs_say():
    log = RemovedLog()
    assert log.recent_capacity == 16384
    assert log.false_positive_bound < 3.1e-4
    for reason in ("evicted", "cleared", "config"):
        log.blooms[reason] = RotatingBloom()
    assert log.nbytes / 2**20 == pytest.approx(2.25, abs=0.01)  # 2.25 MiB with all six filters
