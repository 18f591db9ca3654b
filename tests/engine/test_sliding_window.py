"""Sliding-window models (Mistral, Qwen2 with use_sliding_window) get windowed attention in the
paged runner: logits equal transformers' own forward on the same tokens, prompt longer than
the window, rows batched, prefill chunked and cached, in both attention modes."""
from __future__ import annotations

import random

import pytest
import torch

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.model import LoadedModel
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.sampling import SamplingParams
from kvplay.engine.tiny import build_tiny

WINDOW = 8


def _reference(model, ids):
    """transformers' own forward (its SDPA path and its sliding-window mask), all positions."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        model.config._attn_implementation = impl


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_windowed_logits_equal_transformers(kind, deterministic):
    model, tok = build_tiny(kind, sliding_window=WINDOW)
    rng = random.Random(0)
    seqs = [[rng.randrange(5, 90) for _ in range(n)] for n in (37, 5, 70, 1)]
    refs = [_reference(model, s) for s in seqs]
    unwindowed, _ = build_tiny(kind)  # same seed and weights, full attention
    assert not torch.allclose(refs[2][-1], _reference(unwindowed, seqs[2])[-1], atol=1e-3), \
        "the window must matter for this test to mean anything"
    runner = ModelRunner(LoadedModel(model, tok, kind, torch.device("cpu"), torch.float32), 64, 16)
    runner.store.data.fill_(float("nan"))  # nothing unwritten may be read
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    tables[2] = [45, 33, 40, 34, 47, 36]  # scattered blocks (a gather) next to consecutive ones (a view)
    chunks = [[20, 17], [5], [30, 1, 24, 15], [1]]  # chunked prefill, a decode-shaped step, batched
    past = [0] * 4
    while any(chunks):
        rows, idx = [], []
        for i, c in enumerate(chunks):
            if c:
                n = c.pop(0)
                rows.append(Row(tables[i], past[i], seqs[i][past[i]:past[i] + n]))
                idx.append(i)
        logits = runner.forward(rows, deterministic)
        for j, i in enumerate(idx):
            past[i] += len(rows[j].new_tokens)
            torch.testing.assert_close(logits[j], refs[i][past[i] - 1], rtol=1e-4, atol=1e-4)


def test_engine_serves_a_windowed_model_with_cache_hits():
    model, tok = build_tiny("mistral", sliding_window=WINDOW)
    loaded = LoadedModel(model, tok, "tiny-mistral-sw", torch.device("cpu"), torch.float32)
    ids = list(range(10, 60))
    with Engine(EngineConfig(model="tiny:mistral", num_blocks=64), loaded) as eng:
        first = eng.submit("alice", prompt_ids=ids, sampling=SamplingParams(max_tokens=4), trace_logits=True)
        first.result(60)
        again = eng.submit("bob", prompt_ids=ids, sampling=SamplingParams(max_tokens=4), trace_logits=True)
        assert again.result(60).stats.cached_tokens >= 32
    ref = _reference(model, ids)[-1]
    for h in (first, again):
        torch.testing.assert_close(h.request.logits_trace[0], ref, rtol=1e-4, atol=1e-4)
