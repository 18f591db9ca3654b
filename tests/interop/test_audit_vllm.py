"""`kvplay audit` against a real vLLM CPU server (marked vllm + slow: start ~1 min, both cores).

vLLM has no API keys of its own here: a gateway on loopback (tests/support/gateway.py) holds two
customers' keys and forwards to vLLM as one identity, as CacheProbe's OpenRouter default keys
did. Pooled (no salt), the two customers share vLLM's prefix cache: the audit at level global
detects it. With a per-key ``cache_salt`` added by the gateway (vLLM 0.32's request field,
hashed into the first block), nothing is shared: not detected, and vLLM reports 0 cached
tokens on every hit probe. Sizes: 300-letter prompts (one token each with SmolLM2's tokenizer:
9 blocks of 32 shared), 20 + 20 probes (a miss prefills ~300 tokens, a hit ~30: several
times faster; 20 + 20 still reach p < 1e-8 with a probe or two overlapping)."""
from __future__ import annotations

import pytest
from support.gateway import GatewayThread, gateway_app
from support.vllm import vllm_cpu

from kvplay.labs import audit

ALICE, BOB = "sk-gw-alice-0123456789", "sk-gw-bob-0123456789"
N = 20


@pytest.mark.vllm
@pytest.mark.slow
def test_audit_detects_a_pooling_gateway_and_not_a_salting_one(tmp_path, free_port):
    with vllm_cpu(tmp_path, free_port) as url:
        db = str(tmp_path / "a.db")
        results = {}
        for salt in (None, "per-key"):
            gw = GatewayThread(gateway_app(url, [ALICE, BOB], salt=salt)).start()
            try:
                p = audit.AuditParams(url=gw.url, levels=["global"], probes=N, prompt_length=300, delay=0.0)
                results[salt] = audit.execute(p, [ALICE, BOB], db)
            finally:
                gw.stop()
        pooled = results[None].data["groups"][0]
        assert results[None].data["tokenization"]["per_letter"] == 1 and results[None].data["block_size"] == 32
        assert pooled["shared_tokens"] == 285 and pooled["shared_blocks"] == 8
        assert pooled["cached"]["hits_flagged"] == N and pooled["cached"]["misses_flagged"] == 0
        assert pooled["cached"]["median_hit"] == 8 * 32 and pooled["cached"]["p"] < 1e-8
        assert pooled["client"]["ks_p"] < 1e-8 and pooled["client"]["direction_ok"] and pooled["detected"]
        assert results[None].verdict.startswith("global: shared across organisations' keys: detected, p = ")
        salted = results["per-key"].data["groups"][0]
        assert salted["cached"]["hits_flagged"] == 0 and salted["cached"]["median_hit"] == 0
        assert not salted["detected"] and salted["client"]["ks_p"] > 1e-8
        assert "not detected at this power" in results["per-key"].verdict
