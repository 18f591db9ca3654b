"""A few checks on the embedded SmolLM2-135M-Instruct (slow: the first run converts it once,
21 s on an idle 2-core machine, up to ~70 s when the cores are shared)."""
from __future__ import annotations

import pytest
import torch

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are the support assistant of a small bakery. " +
          "Answer customers politely, mention opening hours when relevant, and never invent prices. " * 12)


def test_shared_system_prompt_is_reused_across_users(smollm):
    with Engine(EngineConfig(num_blocks=256), smollm) as eng:
        msgs = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        a = eng.generate("alice", msgs("When do you open?"), SamplingParams(max_tokens=8), timeout=120)
        b = eng.generate("bob", msgs("Do you sell rye bread?"), SamplingParams(max_tokens=8), timeout=120)
        assert a.stats.prompt_tokens > 200
        sys_tokens = eng.encode(msgs("x"))[1]
        assert b.stats.cached_from.get("alice", 0) >= sys_tokens // 16 * 16
        assert a.text.strip() and b.text.strip()


def test_deterministic_cold_and_warm_are_bitwise_equal(smollm):
    with Engine(EngineConfig(num_blocks=256, deterministic=True), smollm) as eng:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Are you open on Sunday?"}]
        cold = eng.submit("alice", msgs, SamplingParams(max_tokens=16), trace_logits=True)
        cold.result(120)
        warm = eng.submit("bob", msgs, SamplingParams(max_tokens=16), trace_logits=True)
        res = warm.result(120)
        assert res.stats.cached_tokens > 200
        assert cold.result().text == res.text
        assert all(torch.equal(x, y) for x, y in zip(cold.request.logits_trace, warm.request.logits_trace))
