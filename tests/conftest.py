"""Fixtures every test group shares: tiny random-initialised models built in-process (no
download), real engines on them, `kvplay serve` around one (`serve`), loopback ports reserved
for the test (`free_port`), and a default sessions DB of the test's own. Tests marked `slow`
use the embedded SmolLM2 model. Helpers (not fixtures) live in tests/support/."""
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


@pytest.fixture
def serve(make_engine, tmp_path):
    """serve(keys=None, kv_events=None, record=False, report_full=False, explain_across_keys=False,
    **engine_config) ->
    (ServerThread, ServeState): a real `kvplay serve` (uvicorn in a thread on a loopback port
    it bound itself) around a real engine on a tiny model. Everything is stopped after the test."""
    from kvplay.serve.server import ServerThread, build_state, close_state
    from kvplay.sessions.recorder import Recorder

    made = []

    def factory(keys=None, kv_events=None, record=False, report_full=False, explain_across_keys=False, **cfg):
        eng = make_engine(**cfg)
        rec = None
        if record:
            rec = Recorder.open(str(tmp_path / "sessions.db"), eng.config, eng.model_name, "serve", "")
        state = build_state(eng, keys, kv_events, report_full=report_full, recorder=rec,
                            explain_across_keys=explain_across_keys)
        srv = ServerThread(state).start()
        made.append((srv, state, rec))
        return srv, state

    yield factory
    for srv, state, rec in made:
        srv.stop()
        close_state(state)
        if rec is not None:
            rec.close()


@pytest.fixture
def free_port():
    """free_port() -> a loopback port reserved for this test (support/ports.py): nothing else
    is given it until the test ends, the code under test can bind it, and until it does a
    connection there is refused."""
    from support.ports import PortReservations

    ports = PortReservations()
    yield ports
    ports.close()


@pytest.fixture
def pubs():
    """A list to put the ZMQ publishers a test starts in: each is shut down after the test."""
    made = []
    yield made
    for p in made:
        p.shutdown()


@pytest.fixture
def watch_json():
    """watch_json(*args) -> a `kvplay watch` subprocess (support/watch.py `Watch`), killed after the
    test if it is still running."""
    from support.watch import Watch

    made = []

    def start(*args):
        w = Watch(*args)
        made.append(w)
        return w
    yield start
    for w in made:
        if w.p.poll() is None:
            w.p.kill()


@pytest.fixture(autouse=True)
def default_db(tmp_path, monkeypatch):
    """Every test's default sessions DB (KVPLAY_DB, inherited by the commands it runs) is its own:
    no test reads or writes the user's."""
    path = tmp_path / "default.db"
    monkeypatch.setenv("KVPLAY_DB", str(path))
    return path


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
