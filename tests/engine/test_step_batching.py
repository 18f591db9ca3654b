"""How a serving step is batched (issue #22): decode rows and prompt chunks share one forward,
and the CPU GEMMs read oneDNN's packed weights — each giving the logits the unbatched, unpacked
way gives, on real tiny models."""
import pytest
import torch

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.model import LoadedModel
from kvplay.engine import packed as packed_mod
from kvplay.engine.packed import pack
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.sampling import SamplingParams
from kvplay.engine.tiny import build_tiny


def _loaded(kind, window=None):
    model, tok = build_tiny(kind, layers=3, sliding_window=window)
    return LoadedModel(model=model, tokenizer=tok, name=f"tiny:{kind}", device=torch.device("cpu"),
                       dtype=torch.float32)


def _prefill(runner, tables, prompts):
    runner.forward([Row(t, 0, p) for t, p in zip(tables, prompts)])


def test_a_mixed_step_equals_its_decode_and_prefill_rows_apart():
    """Decode rows next to a cached-prefix prompt chunk in one forward give the logits the two
    forwards gave."""
    runner = ModelRunner(_loaded("llama"), 64, 8, packed=False)
    g = torch.Generator().manual_seed(2)
    tables = [list(range(0, 6)), list(range(10, 16)), list(range(20, 26))]
    _prefill(runner, tables, [torch.randint(5, 90, (n,), generator=g).tolist() for n in (9, 14, 16)])
    dec = [Row(tables[0], 9, [7]), Row(tables[1], 14, [8])]
    chunk = [Row(tables[2], 16, torch.randint(5, 90, (12,), generator=g).tolist())]
    mixed = runner.forward(dec + chunk)
    apart = torch.cat([runner.forward(dec), runner.forward(chunk)])
    torch.testing.assert_close(mixed, apart, rtol=1e-4, atol=1e-4)


@pytest.fixture
def pack_small(monkeypatch):
    """The tiny models' weights are below packed.MIN_ELEMENTS: pack them anyway."""
    monkeypatch.setattr(packed_mod, "MIN_ELEMENTS", 0)


@pytest.mark.skipif(pack(torch.ones(512, 512)) is None, reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_weights_give_the_plain_weights_logits(threads, pack_small):
    loaded = _loaded("qwen2", 8)  # q/k/v biases too
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = ModelRunner(loaded, 64, 8, packed=False)
        packed = ModelRunner(loaded, 64, 8, packed=True)
        assert packed.llama_step.packed and packed.head_packed is not None
        assert not plain.llama_step.packed and plain.head_packed is None
        assert packed.llama_step.layers[0].packed[0] is pack(packed.llama_step.layers[0].qkv)  # one copy
        g = torch.Generator().manual_seed(3)
        steps = [[Row(list(range(0, 6)), 0, torch.randint(5, 90, (21,), generator=g).tolist()),
                  Row(list(range(10, 16)), 0, torch.randint(5, 90, (9,), generator=g).tolist())],
                 [Row(list(range(0, 6)), 21, [5]), Row(list(range(10, 16)), 9, [6])]]
        for rows in steps:
            a, b = plain.forward(rows), packed.forward(rows)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    finally:
        torch.set_num_threads(old)


def test_small_weights_are_not_packed():
    assert pack(torch.ones(64, 64)) is None


def test_packed_weights_follow_the_engine_config(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=32, packed_weights=False), tiny_llama)
    assert eng.runner.head_packed is None and not eng.runner.llama_step.packed


def test_a_step_with_decode_rows_and_a_prompt_chunk_is_one_forward(tiny_llama):
    eng = Engine(EngineConfig(model="tiny:llama", num_blocks=64, prefill_budget=16), tiny_llama)
    sp = SamplingParams(max_tokens=8, stop_on_eos=False)
    first = eng.make_request("alice", prompt_ids=list(range(5, 15)), sampling=sp)
    eng.take_in(first)
    eng.step()  # alice's prompt: she decodes from now on
    eng.take_in(eng.make_request("bob", prompt_ids=list(range(20, 60)), sampling=sp))
    mixed = 0
    while eng.scheduler.has_work():
        out_before = eng.runner.forwards
        decoding = sum(1 for r in eng.scheduler.running if r.pending == 1)
        prefilling = sum(1 for r in eng.scheduler.running + eng.scheduler.waiting if r.pending > 1)
        eng.step()
        assert eng.runner.forwards - out_before == 1
        mixed += bool(decoding and prefilling)
    assert mixed >= 2  # bob's 40 tokens took chunks of 16 while alice decoded
