"""`kvplay watch URL --json` on a real vLLM CPU server with a small KV cache (scripts/vllm-cpu.sh):
from vLLM's KV events alone, a prompt that branches from another's cached prefix is reported as
diverged at the first differing token, and a prompt whose blocks were evicted is reported as
recomputed after eviction; the block counts are exactly what vLLM's own usage implies."""
from __future__ import annotations

import pytest

from support.vllm import VllmServer, post

from kvplay.wire.miss_watch import common_prefix

BS = 32  # scripts/vllm-cpu.sh: --block-size 32
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are the assistant of a small bakery on Elm Street. You answer questions about bread, cakes, "
          "opening hours, prices and orders, briefly and kindly, and you never make anything up. ") * 4
# two questions long enough that each fills blocks of its own after the shared system prompt
ALICE = "When do you open on Sundays? " + "We would like to come by with the whole family after the market. " * 3
BOB = "Do you sell rye bread? " + "My grandmother only eats dark rye, sliced thin, with caraway seeds in it. " * 3


def messages(system, text):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def chat(base, user, system, text):
    """One greedy token (so only prompt blocks are stored): (prompt token ids, cached tokens)."""
    ids = post(base + "/tokenize", {"model": MODEL, "messages": messages(system, text)})["tokens"]
    r = post(base + "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "temperature": 0, "session_id": user, "user": user,
        "messages": messages(system, text)})
    u = r["usage"]
    assert u["prompt_tokens"] == len(ids)
    return ids, (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.mark.vllm
def test_watch_real_vllm_reports_a_recompute_after_eviction_and_a_divergence(tmp_path, free_port, watch_json):
    vllm = VllmServer(tmp_path, free_port)
    w = watch_json(vllm.base, "--events-bind", vllm.events, "--replay", vllm.replay, "--pod", "vllm",
                   "--topic", "kv-events", "--json", "--no-record")
    try:
        # a KV cache of 48 blocks of 32 tokens: a few prompts fill it (vLLM CPU sizes its cache from
        # VLLM_CPU_KVCACHE_SPACE, whole GiB, which the block count overrides)
        vllm("start", "--events", vllm.events, "--replay", vllm.replay, "--num-gpu-blocks-override", "48",
             "--max-model-len", "1024")
        alice, alice_cached = chat(vllm.base, "alice", SYSTEM, ALICE)
        bob, bob_cached = chat(vllm.base, "bob", SYSTEM, BOB)
        for i, who in enumerate(("carol", "dave", "erin", "frank", "grace")):  # others fill the cache
            chat(vllm.base, who, f"Ticket {i}: " + "the quick brown fox jumps over the lazy dog " * (30 + i), "Go.")
        again, again_cached = chat(vllm.base, "alice", SYSTEM, ALICE)
        got = w.until(lambda d: any(r["session"] == "alice" for r in d.get("miss", {}).get("recomputed", ())),
                      timeout=60)
        rest = w.stop()
    finally:
        vllm.stop()  # (the watch_json fixture ends the watch)
    assert w.p.returncode == 0, w.err
    assert alice_cached == 0 and again == alice
    # bob: vLLM reused the full blocks of the shared prefix; his first new block branches from
    # alice's at the first token where the two prompts differ
    split = common_prefix(alice, bob)
    assert bob_cached == split // BS * BS and split < len(alice) // BS * BS
    bob_new = len(bob) // BS - bob_cached // BS
    assert bob_new > 0
    branch = [b for d in got for b in d.get("miss", {}).get("branches", ()) if b["session"] == "bob"]
    assert len(branch) == 1, (got[:4], rest[-1]["pods"]["vllm"]["misses"]["by_session"].get("bob"), split, bob_cached, len(bob))
    text = branch[0].pop("text")  # vLLM's /detokenize around the branch point, both sides
    assert branch[0] == {"session": "bob", "reason": "diverged", "at": split, "within_block": split - bob_cached,
                         "blocks": bob_new, "tokens": bob_new * BS, "from": "alice"}
    assert "Do you sell" in text["prompt"] and "When do you" in text["cached"], text
    # alice again: her blocks were evicted (vLLM says it reused fewer), the rest is recomputed
    assert again_cached < len(alice) // BS * BS, "the small cache should have evicted alice's blocks"
    recomputed = len(alice) // BS - again_cached // BS
    pod = rest[-1]["pods"]["vllm"]
    why = pod["misses"]
    assert why["by_session"]["bob"]["blocks"] == {"diverged": bob_new}
    assert why["by_session"]["bob"]["tokens"] == {"diverged": bob_new * BS}
    assert why["by_session"]["alice"]["blocks"] == {"cold": len(alice) // BS, "evicted": recomputed}
    assert why["blocks"]["evicted"] >= recomputed and why["evicted_from"].get("alice", 0) >= recomputed
    assert pod["removed"] > 0
    assert pod["mirror_s"] > 0 and why["cost"]["seconds"] > 0 and why["cost"]["of_mirror"] > 0  # (its cost, reported)
    alice_again = [r for d in got for r in d.get("miss", {}).get("recomputed", ()) if r["session"] == "alice"]
    assert [(r["reason"], r["blocks"]) for r in alice_again] == [("evicted", recomputed)]
    assert alice_again[0]["evicted_by"] in {"carol", "dave", "erin", "frank", "grace"}
