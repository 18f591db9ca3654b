"""The decoder written out (engine/llama_step.py) against transformers' own modules, on real
tiny models of each family it takes (Llama, Qwen2 with q/k/v biases and a sliding window, Mistral
with a sliding window) and on the embedded SmolLM2."""
import copy

import pytest
import torch

from kvplay.engine.llama_step import LlamaStep
from kvplay.engine.model import LoadedModel
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.tiny import build_tiny


def _loaded(kind, window=None):
    model, tok = build_tiny(kind, layers=3, sliding_window=window)
    return LoadedModel(model=model, tokenizer=tok, name=f"tiny:{kind}", device=torch.device("cpu"),
                       dtype=torch.float32)


def _steps(runner, written_out: bool, deterministic=False):
    """Prefill two requests (one on scattered blocks), then mixed steps: a decode row next to a
    cached-prefix prefill row, and decode rows together."""
    saved = runner.llama_step
    runner.llama_step = saved if written_out else None
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(5, 90, (n,), generator=g).tolist()
    a_table, b_table = list(range(0, 8)), [11, 3 + 20, 9 + 20, 30, 31, 40, 41, 42]
    a, b = ids(37), ids(21)
    try:
        out = [runner.forward([Row(a_table, 0, a), Row(b_table, 0, b)], deterministic)]
        out.append(runner.forward([Row(a_table, 37, ids(1)), Row(b_table, 16, ids(12))], deterministic))
        out.append(runner.forward([Row(a_table, 38, ids(1)), Row(b_table, 28, ids(1))], deterministic))
        out.append(runner.forward([Row(b_table, 29, ids(1))], deterministic))
    finally:
        runner.llama_step = saved
    return out


@pytest.mark.parametrize("kind,window", [("llama", None), ("qwen2", 8), ("mistral", 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_same_logits_as_the_modules(kind, window, threads):
    loaded = _loaded(kind, window)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = ModelRunner(loaded, 64, 8)
        assert runner.llama_step is not None
        modules = _steps(runner, written_out=False)
        written = _steps(runner, written_out=True)
    finally:
        torch.set_num_threads(old)
    for x, y in zip(modules, written):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
        assert torch.equal(y.argmax(-1), x.argmax(-1))


def test_fused_weights_are_the_modules_own_memory():
    loaded = _loaded("qwen2", 8)
    before = copy.deepcopy(loaded.model)
    ids = torch.randint(5, 90, (1, 30), generator=torch.Generator().manual_seed(1))
    runner = ModelRunner(loaded, 64, 8)
    step = runner.llama_step
    layer = loaded.model.model.layers[1]
    a, m = layer.self_attn, layer.mlp
    assert a.q_proj.weight.data_ptr() == step.layers[1].qkv.data_ptr()
    assert a.v_proj.bias.data_ptr() == step.layers[1].qkv_bias[-a.v_proj.bias.shape[0]:].data_ptr()
    assert m.up_proj.weight.data_ptr() == step.layers[1].gate_up[m.gate_proj.weight.shape[0]:].data_ptr()
    # transformers' own forward (HF generate, the bench's HF peers) is unchanged, bit for bit
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, before(ids).logits)
    # a second runner on the same model reuses the fused weights
    again = ModelRunner(loaded, 64, 8).llama_step
    assert again.layers[1].qkv.data_ptr() == step.layers[1].qkv.data_ptr()


def test_other_structures_keep_the_module_path():
    loaded = _loaded("llama")
    loaded.model.model.layers[0].mlp.down_proj = torch.nn.Sequential(loaded.model.model.layers[0].mlp.down_proj)
    assert LlamaStep.for_model(loaded.model) is None
    assert ModelRunner(loaded, 64, 8).llama_step is None


def test_deterministic_mode_on_both_paths_is_batch_invariant():
    """Deterministic mode written out: a row's logits are the same bits alone and packed with
    another request, as on the module path."""
    loaded = _loaded("llama")
    runner = ModelRunner(loaded, 64, 8)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 90, (23,), generator=g).tolist()
    other = torch.randint(5, 90, (40,), generator=g).tolist()
    for written_out in (True, False):
        saved = runner.llama_step
        runner.llama_step = saved if written_out else None
        try:
            alone = runner.forward([Row(list(range(8)), 0, prompt)], deterministic=True)
            packed = runner.forward([Row(list(range(20, 31)), 0, other), Row(list(range(8, 16)), 0, prompt)],
                                    deterministic=True)
        finally:
            runner.llama_step = saved
        assert torch.equal(alone[0], packed[1]), written_out


@pytest.mark.slow
def test_embedded_model_greedy_tokens_match_the_modules(smollm):
    tok = smollm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "How do I patch a bicycle tube?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    runner = ModelRunner(smollm, 64, 16)
    assert runner.llama_step is not None
    out = {}
    for written_out in (False, True):
        saved = runner.llama_step
        runner.llama_step = saved if written_out else None
        try:
            table = list(range(16))
            logits = runner.forward([Row(table, 0, prompt)])
            toks, past = [int(logits.argmax())], len(prompt)
            for _ in range(40):
                logits = runner.forward([Row(table, past, [toks[-1]])])
                toks.append(int(logits.argmax()))
                past += 1
        finally:
            runner.llama_step = saved
        out[written_out] = toks
    assert out[True] == out[False]


@pytest.mark.parametrize("rows", [1, 2, 33])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_is_the_modules_bit_for_bit(rows, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    x = torch.randn(rows, hidden, generator=g)
    with torch.no_grad():
        assert torch.equal(LlamaStep._rms(x, norm.weight, norm.variance_epsilon), norm(x))
