"""The engine thread's start-up forward (Engine._warm_up, ModelRunner.warm_up): a full first
prompt chunk into the blocks the pool hands out first, before any command runs. It must cost
the requests nothing but time: not a forward on the step clock, not a block, not a bit of their
logits (its K/V sits in free blocks the first request then writes over)."""
from __future__ import annotations

import torch

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.sampling import SamplingParams

PROMPT = [{"role": "system", "content": "You are a careful assistant. " * 6},
          {"role": "user", "content": "what is in the warm-up blocks?"}]


def first_logits(loaded, monkeypatch, warm: bool):
    monkeypatch.setenv("KVPLAY_WARM_UP", "1" if warm else "0")
    with Engine(EngineConfig(model="tiny:llama", num_blocks=64, prefill_budget=256), loaded) as eng:
        ids, _ = eng.encode(PROMPT)
        h = eng.submit("alice", prompt_ids=ids, sampling=SamplingParams(max_tokens=4), trace_logits=True)
        res = h.result(60)
        stats = eng.stats()
        return h.request.logits_trace, res, eng.warmed_up, stats, eng.pool.free_ids()


def test_the_start_up_forward_runs_and_changes_no_result(tiny_llama, monkeypatch):
    cold_logits, cold_res, cold_warm, cold_stats, cold_free = first_logits(tiny_llama, monkeypatch, False)
    logits, res, warmed, stats, free = first_logits(tiny_llama, monkeypatch, True)
    assert cold_warm == 0
    assert warmed == 256  # the prefill budget's tokens, into the first 16 free blocks
    assert res.error is None and res.text == cold_res.text
    for got, want in zip(logits, cold_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # not on the step clock, no block taken or cached by it
    assert stats["forwards"] == cold_stats["forwards"]
    assert free == cold_free


def test_a_pool_smaller_than_the_budget_is_warmed_up_to_its_size(tiny_llama, monkeypatch):
    monkeypatch.setenv("KVPLAY_WARM_UP", "1")
    with Engine(EngineConfig(model="tiny:llama", num_blocks=4, prefill_budget=1024), tiny_llama) as eng:
        eng.call(lambda: None)  # queued behind the start-up forward
        assert eng.warmed_up == 4 * 16
        assert eng.stats()["forwards"] == 0


def test_a_deterministic_engine_warms_up_in_its_mode(tiny_llama, monkeypatch):
    """Its start-up forward runs the calibrated tiles (invariance.py): the calibration is done
    before the first request, which gets the same bits as without the warm-up."""
    got = {}
    for warm in (False, True):
        monkeypatch.setenv("KVPLAY_WARM_UP", "1" if warm else "0")
        with Engine(EngineConfig(model="tiny:llama", num_blocks=64, deterministic=True), tiny_llama) as eng:
            eng.call(lambda: None)
            calibrated = eng.runner.linear_plan is not None and len(eng.runner.linear_plan.shapes)
            ids, _ = eng.encode(PROMPT)
            h = eng.submit("alice", prompt_ids=ids, sampling=SamplingParams(max_tokens=4), trace_logits=True)
            h.result(60)
            got[warm] = (calibrated, h.request.logits_trace)
    assert not got[False][0] and got[True][0]
    for a, b in zip(got[False][1], got[True][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
