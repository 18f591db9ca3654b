"""The engine end to end on tiny real models: reuse, attribution, isolation, determinism."""
from __future__ import annotations

import torch
import pytest

from support.steps import drain
from support.wait import wait_for

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.errors import EngineError
from kvplay.engine.sampling import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 8}
GREEDY = SamplingParams(max_tokens=12)


def chat(text, system=SYSTEM):
    return [system, {"role": "user", "content": text}]


def test_second_user_reuses_first_users_blocks(make_engine):
    eng = make_engine()
    a = eng.generate("alice", chat("hello"), GREEDY, timeout=60)
    b = eng.generate("bob", chat("hello"), GREEDY, timeout=60)
    assert a.stats.cached_tokens == 0
    full_blocks = (b.stats.prompt_tokens - 1) // 16 * 16
    assert b.stats.cached_tokens == full_blocks > 0
    assert b.stats.cached_from == {"alice": full_blocks}
    assert b.stats.computed_tokens == b.stats.prompt_tokens - full_blocks
    assert a.text == b.text  # same prompt, greedy
    eng.pool.check()


def test_attribution_three_users(make_engine):
    eng = make_engine(num_blocks=128)
    eng.generate("alice", chat("first question"), GREEDY, timeout=60)
    # bob shares alice's system prompt, then extends with his own long turn
    long_q = "tell me about caches " * 4
    eng.generate("bob", chat(long_q), GREEDY, timeout=60)
    c = eng.generate("carol", chat(long_q + "please"), GREEDY, timeout=60)
    by = c.stats.cached_from
    assert set(by) == {"alice", "bob"}
    assert by["alice"] > 0 and by["bob"] > 0
    assert sum(by.values()) == c.stats.cached_tokens
    # alice's blocks end where her prompt diverged from bob's
    a_prompt = eng.encode(chat("first question"))[0]
    c_prompt = eng.encode(chat(long_q + "please"))[0]
    common = next(i for i, (x, y) in enumerate(zip(a_prompt, c_prompt)) if x != y)
    assert by["alice"] == common // 16 * 16


@pytest.mark.parametrize("mode,shares", [("shared", True), ("user", False), ("group", "group"), ("system", "system")])
def test_isolation_modes(make_engine, mode, shares):
    eng = make_engine(isolation=mode, num_blocks=128)
    for user, group in (("alice", "g1"), ("bob", "g1"), ("carol", "g2")):
        eng.register_user(user, group)
    eng.generate("alice", chat("same question"), GREEDY, timeout=60)
    b = eng.generate("bob", chat("same question"), GREEDY, timeout=60)
    c = eng.generate("carol", chat("same question"), GREEDY, timeout=60)
    sys_tokens = eng.encode(chat("same question"))[1]
    if shares is True:
        assert b.stats.cached_from.get("alice", 0) > 0
    elif shares is False:
        assert b.stats.cached_tokens == 0 and c.stats.cached_tokens == 0
    elif shares == "group":
        assert b.stats.cached_from.get("alice", 0) > 0
        assert c.stats.cached_tokens == 0
    else:  # system: exactly the blocks wholly inside the system prompt are shared
        assert b.stats.cached_from == {"alice": sys_tokens // 16 * 16}
        assert c.stats.cached_from == {"alice": sys_tokens // 16 * 16}
    # a user always reuses their own blocks
    a2 = eng.generate("alice", chat("same question"), GREEDY, timeout=60)
    assert a2.stats.cached_from.get("alice", 0) >= (a2.stats.prompt_tokens - 1) // 16 * 16 - 16


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
def test_cached_logits_match_uncached(request, kind):
    loaded = request.getfixturevalue(kind)
    for det in (False, True):
        with Engine(EngineConfig(model="tiny:" + kind[5:], num_blocks=64, deterministic=det), loaded) as eng:
            cold = eng.submit("alice", chat("compare me"), GREEDY, trace_logits=True)
            cold_res = cold.result(60)
            warm = eng.submit("bob", chat("compare me"), GREEDY, trace_logits=True)
            warm_res = warm.result(60)
            assert warm_res.stats.cached_tokens > 0
            a, b = cold.request.logits_trace, warm.request.logits_trace
            assert len(a) == len(b) > 0
            for x, y in zip(a, b):
                if det:
                    assert torch.equal(x, y), "deterministic mode must be bitwise equal"
                else:
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            assert cold_res.token_ids == warm_res.token_ids


def test_uncached_engine_matches_plain_transformers(tiny_llama):
    """The paged path computes what the model computes without any cache."""
    with Engine(EngineConfig(model="tiny:llama", num_blocks=64), tiny_llama) as eng:
        ids, _ = eng.encode(chat("reference"))
        h = eng.submit("alice", prompt_ids=ids, sampling=SamplingParams(max_tokens=1), trace_logits=True)
        h.result(60)
        got = h.request.logits_trace[0]
    with torch.no_grad():
        ref = tiny_llama.model.model(input_ids=torch.tensor([ids]))
        ref_logits = tiny_llama.model.lm_head(ref.last_hidden_state[0, -1]).float()
    torch.testing.assert_close(got, ref_logits, rtol=1e-4, atol=1e-4)


def test_deterministic_batch_invariance(make_engine):
    """In deterministic mode a request's logits do not depend on what else is in the batch."""
    eng = make_engine(deterministic=True, num_blocks=128)
    alone = eng.submit("alice", chat("batch me"), GREEDY, trace_logits=True)
    alone.result(60)
    eng.clear_cache()
    others = [eng.submit(u, chat(f"other {u} " * (i + 1)), SamplingParams(max_tokens=20)) for i, u in enumerate("xyz")]
    crowd = eng.submit("alice", chat("batch me"), GREEDY, trace_logits=True)
    crowd.result(60)
    for h in others:
        h.result(60)
    for x, y in zip(alone.request.logits_trace, crowd.request.logits_trace):
        assert torch.equal(x, y)


def test_same_seed_same_tokens_regardless_of_load(make_engine):
    eng = make_engine(num_blocks=128)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = eng.generate("alice", chat("sample"), sp, timeout=60)
    noise = [eng.submit(u, chat("noise " + u), SamplingParams(max_tokens=16, temperature=1.0, seed=i))
             for i, u in enumerate("abc")]
    again = eng.generate("alice", chat("sample"), sp, timeout=60)
    for h in noise:
        h.result(60)
    assert alone.token_ids == again.token_ids
    other_seed = eng.generate("alice", chat("sample"), SamplingParams(max_tokens=16, temperature=1.0, seed=8), timeout=60)
    assert other_seed.token_ids != alone.token_ids


def test_concurrent_users_all_complete_and_stream(make_engine):
    eng = make_engine(num_blocks=128)
    handles = [eng.submit(u, chat(f"question from {u}"), SamplingParams(max_tokens=20, stop_on_eos=False))
               for u in ("alice", "bob", "carol", "dave")]
    for h in handles:
        deltas = list(h)
        res = h.result(5)
        assert res.ok and res.stats.output_tokens == 20
        assert "".join(d.text for d in deltas) == res.text
    s = eng.stats()
    assert s["blocks_in_use"] == 0 and s["running"] == 0
    eng.pool.check()


def all_at_once(eng, turns, sp):
    """Every turn taken in before the first step, then stepped to the end on this thread (no
    engine thread): a pool too small for them all preempts whatever the machine's speed (with
    `submit`, a slow machine's engine thread may finish the first before the others arrive)."""
    reqs = [eng.make_request(user, messages, sp) for user, messages in turns]
    for r in reqs:
        eng.take_in(r)
    drain(eng, 5000)
    return [r.handle.result(0) for r in reqs]


def test_pool_exhaustion_preempts_and_completes_identically(tiny_llama):
    prompts = [chat(f"user {i} asks about pressure " * 3) for i in range(4)]
    sp = SamplingParams(max_tokens=40, stop_on_eos=False)

    def run(num_blocks):
        eng = Engine(EngineConfig(model="tiny:llama", num_blocks=num_blocks, deterministic=True), tiny_llama)
        return all_at_once(eng, [(f"u{i}", p) for i, p in enumerate(prompts)], sp), eng.stats()

    relaxed, s1 = run(256)
    pressured, s2 = run(44)
    assert s1["preemptions"] == 0
    assert s2["preemptions"] > 0
    for a, b in zip(relaxed, pressured):
        assert b.ok and b.token_ids == a.token_ids


def test_cancel_frees_blocks_and_others_continue(make_engine):
    eng = make_engine(num_blocks=256)  # (room for ~0.7 s of decoding: the cancel lands long before it ends)
    long = eng.submit("alice", chat("long one"), SamplingParams(max_tokens=3000, stop_on_eos=False))
    other = eng.submit("bob", chat("short"), SamplingParams(max_tokens=10, stop_on_eos=False))
    next(iter(long))
    long.cancel()
    res = long.result(30)
    assert res.finish_reason == "cancelled"
    assert other.result(30).ok
    s = eng.stats()
    assert s["blocks_in_use"] == 0


def test_failing_request_does_not_disturb_others(make_engine):
    eng = make_engine(num_blocks=20)
    ok = eng.submit("bob", chat("fine"), SamplingParams(max_tokens=30, stop_on_eos=False))
    with pytest.raises(EngineError, match="pool"):
        eng.submit("alice", chat("x" * 400), GREEDY)
    with pytest.raises(EngineError, match="empty"):
        eng.submit("alice", [SYSTEM, {"role": "user", "content": "   "}], GREEDY)
    assert ok.result(60).ok and ok.result().stats.output_tokens == 30


def test_verify_on_hit_catches_truncated_hash_collisions(make_engine):
    eng = make_engine(hash="trunc:1", num_blocks=256)  # 1-bit hash: almost every block collides
    outs = []
    for i in range(6):
        outs.append(eng.generate(f"u{i}", chat(f"distinct prompt number {i} " * 2), GREEDY, timeout=60))
    assert eng.stats()["collisions_caught"] > 0
    # with verification every answer equals a cold run of the same prompt
    for i, r in enumerate(outs):
        eng.clear_cache()
        cold = eng.generate("ref", chat(f"distinct prompt number {i} " * 2), GREEDY, timeout=60)
        assert cold.token_ids == r.token_ids


def test_events_describe_block_lifecycle(make_engine):
    from kvplay.engine import events as ev

    eng = make_engine(num_blocks=24)
    seen = []
    eng.subscribe_batches(lambda b: seen.extend(b.events))
    for i in range(4):
        eng.generate(f"u{i}", chat(f"different {i} " * 10), GREEDY, timeout=60)
    kinds = {e.kind for e in seen}
    assert {"BlockStored", "BlockRemoved", "RequestQueued", "RequestStarted", "FirstToken", "RequestFinished"} <= kinds
    seqs = [e.seq for e in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = [e for e in seen if isinstance(e, ev.BlockStored)]
    assert all(len(e.token_ids) == 16 and e.user for e in stored)
    assert eng.stats()["evictions"] > 0


def test_reconfigure_isolation_and_clear(make_engine):
    eng = make_engine(num_blocks=128)
    eng.generate("alice", chat("q"), GREEDY, timeout=60)
    assert not eng.needs_fresh_cache(isolation="user")
    assert eng.needs_fresh_cache(deterministic=True)
    eng.reconfigure(isolation="user")
    assert eng.generate("bob", chat("q"), GREEDY, timeout=60).stats.cached_tokens == 0
    eng.reconfigure(isolation="shared", eviction="lfu")
    assert eng.generate("carol", chat("q"), GREEDY, timeout=60).stats.cached_from.get("alice", 0) > 0
    assert eng.clear_cache() > 0
    assert eng.stats()["blocks_cached"] == 0
    with pytest.raises(EngineError):
        eng.reconfigure(block_size=8)


def test_users_arriving_together_compute_a_shared_prefix_once(make_engine):
    eng = make_engine(num_blocks=256)
    hs = eng.call(lambda: [eng.submit(u, chat(f"question from {u}"), GREEDY) for u in ("alice", "bob", "carol", "dave")])
    res = [h.result(60) for h in hs]
    full = (eng.encode(chat("x"))[1]) // 16 * 16
    assert res[0].stats.cached_tokens == 0
    for r in res[1:]:
        assert r.stats.cached_from.get("alice", 0) >= full, r.stats
    assert eng.stats()["hit_tokens"] >= 3 * full


def test_deterministic_mode_in_bfloat16(make_engine):
    from kvplay.engine.model import load_model

    loaded = load_model("tiny:llama", device="cpu", dtype="bfloat16")
    eng = make_engine(loaded=loaded, deterministic=True, num_blocks=128)
    cold = eng.submit("alice", chat("half precision"), GREEDY, trace_logits=True)
    cold.result(60)
    others = [eng.submit(u, chat(f"noise {u}"), SamplingParams(max_tokens=8)) for u in "xy"]
    warm = eng.submit("bob", chat("half precision"), GREEDY, trace_logits=True)
    assert warm.result(60).stats.cached_tokens > 0
    for h in others:
        h.result(60)
    assert all(torch.equal(x, y) for x, y in zip(cold.request.logits_trace, warm.request.logits_trace))


def test_shutdown_finishes_inflight_requests_with_an_error(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=1024), tiny_llama).start()  # (seconds of room)
    h = eng.submit("alice", chat("never ends"), SamplingParams(max_tokens=100000, stop_on_eos=False))
    next(iter(h))
    eng.shutdown()
    res = h.result(5)
    assert res.finish_reason == "error" and "shut down" in res.error


def test_result_timeout_is_a_timeout_error(make_engine):
    eng = make_engine(num_blocks=1024)  # (a request that runs for seconds before the pool ends it)
    h = eng.submit("alice", chat("slow"), SamplingParams(max_tokens=100000, stop_on_eos=False))
    with pytest.raises(TimeoutError):
        h.result(0.05)
    h.cancel()
    assert h.result(10).finish_reason == "cancelled"


def test_concurrent_reconfigures_do_not_undo_each_other(make_engine):
    import threading

    eng = make_engine()
    gate = threading.Event()
    eng._cmds.put(("call", gate.wait, __import__("concurrent.futures").futures.Future()))  # hold the engine
    t1 = threading.Thread(target=eng.reconfigure, kwargs={"isolation": "user"})
    t2 = threading.Thread(target=eng.reconfigure, kwargs={"eviction": "lfu"})
    t1.start()
    t2.start()
    wait_for(lambda: eng._cmds.qsize() == 2)  # both reconfigures are queued behind the held engine
    gate.set()
    t1.join(10)
    t2.join(10)
    assert (eng.config.isolation, eng.config.eviction) == ("user", "lfu")


def test_recompute_after_preemption_counts_only_tokens_computed_before(tiny_llama):
    sp = SamplingParams(max_tokens=40, stop_on_eos=False)
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=30, deterministic=True), tiny_llama)
    res = all_at_once(eng, [(f"u{i}", chat(f"user {i} pressure " * 3)) for i in range(4)], sp)
    pre = [r.stats for r in res if r.stats.preemptions]
    assert pre, "the pool should force a preemption"
    for st in pre:
        # never more than what the request had computed (prompt + generated) before
        assert 0 <= st.recomputed_tokens <= st.prompt_tokens + st.output_tokens
