"""Shared fixtures: tiny random-initialised models built in-process (no download), and real
engines on them. Tests marked `slow` use the embedded SmolLM2 model."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama():
    from kvplay.engine.model import load_model

    return load_model("tiny:llama", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from kvplay.engine.model import load_model

    return load_model("tiny:qwen2", device="cpu", dtype="float32")


@pytest.fixture
def make_engine(tiny_llama):
    """make_engine(loaded=None, **config) -> a started Engine on a tiny model; shut down after."""
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine

    made = []

    def factory(loaded=None, **cfg):
        cfg.setdefault("model", "tiny:llama")
        cfg.setdefault("num_blocks", 64)
        eng = Engine(EngineConfig(**cfg), loaded or tiny_llama).start()
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="session")
def smollm():
    """The embedded model (converted once into the user cache dir)."""
    from kvplay.engine.model import load_model

    return load_model("default", device="cpu", dtype="float32")


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` start a real vLLM CPU server (minutes each, both cores): they run only
    when asked for, with `-m vllm` (`./dev test -m vllm`) or KVPLAY_VLLM_TESTS=1, so `./dev test`
    and CI stay well inside their time on machines that happen to have a vLLM venv."""
    if "vllm" in (config.option.markexpr or "") or os.environ.get("KVPLAY_VLLM_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a real vLLM: run ./dev test -m vllm (after scripts/vllm-cpu.sh setup)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
