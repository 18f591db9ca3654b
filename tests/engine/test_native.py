"""The compiled decode-attention kernel (engine/native.py, engine/csrc/decode_attention.c): built
with this machine's compiler, it gives every decode row the logits of the per-row SDPA path, on
real tiny models over a pool of random K/V (GQA, several block sizes, prompt chunks in the same
step, both forward paths, sliding windows); never in deterministic mode; and where it cannot be
built the engine runs on torch's ops."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvplay.engine import native
from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.model import LoadedModel
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.sampling import SamplingParams
from kvplay.engine.tiny import build_tiny
from support.steps import NUM_BLOCKS, random_step, shared_prompt_traces
from support.steps import deterministic_rows_are_batch_invariant, switch_reaches_the_runner, with_and_without

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")


def _runner(kind="llama", kv_heads=2, block_size=8, window=None):
    model, tok = build_tiny(kind, layers=2, heads=4, kv_heads=kv_heads, sliding_window=window)
    loaded = LoadedModel(model, tok, f"tiny:{kind}", torch.device("cpu"), torch.float32)
    runner = ModelRunner(loaded, NUM_BLOCKS, block_size, cascade=False)
    assert runner.native, native.why_not()
    g = torch.Generator().manual_seed(0)
    runner.store.data.copy_(torch.randn(runner.store.data.shape, generator=g))  # every slot readable
    return runner


def _both(runner, rows, deterministic=False):
    return with_and_without(runner, "native", rows, deterministic)


def test_it_builds_here_once_and_shares_torchs_openmp_runtime():
    assert native.kernel() is not None, native.why_not()
    path = native.library_path()
    assert path.exists()
    gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(gomp) == 1, gomp  # one OpenMP runtime: no second pool of spinning threads


@pytest.mark.parametrize("dim", [16, 24, 64, 128])  # 24: the plain loops, no 16-wide vectors
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_the_kernel_is_sdpa_over_each_rows_keys(dim, heads, kv_heads):
    fn = native.kernel()
    g = torch.Generator().manual_seed(dim + heads)
    slots_n = 4096
    pool = torch.randn((2, kv_heads, slots_n, dim), generator=g)
    lens = [1, 17, 300, 2500, 64]  # one key only; a long row (its scores buffer)
    row_slots = [torch.randperm(slots_n, generator=g)[:n] for n in lens]
    n_tok = len(lens) + 3
    toks = [0, 2, 3, 5, 7]  # decode rows packed among other tokens
    qkv = torch.randn((n_tok, heads + kv_heads, dim), generator=g)
    query = qkv[:, :heads].transpose(0, 1).unsqueeze(0)  # strided, as llama_step hands it over
    out = torch.full((1, n_tok, heads, dim), float("nan"))
    rows = native.DecodeRows.of(list(range(len(lens))), row_slots, toks)
    assert native.decode_attention(fn, query, pool[0], pool[1], rows, 0.3, out, 2)
    for r, t in enumerate(toks):
        k = pool[0].index_select(1, row_slots[r]).unsqueeze(0)
        v = pool[1].index_select(1, row_slots[r]).unsqueeze(0)
        want = F.scaled_dot_product_attention(query[:, :, t:t + 1], k, v, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[0, t], want[0, :, 0], rtol=2e-5, atol=2e-5)
    assert out[0, 1].isnan().all()  # tokens that are not decode rows are left alone


def test_a_layout_it_does_not_take_is_refused_not_misread():
    fn = native.kernel()
    pool = torch.randn((2, 2, 64, 16))
    rows = native.DecodeRows.of([0], [torch.arange(5)], [0])
    query = torch.randn((1, 4, 1, 16))
    out = torch.empty((1, 1, 4, 16))
    assert not native.decode_attention(fn, query, pool[0].transpose(1, 2), pool[1], rows, None, out, 1)
    assert not native.decode_attention(fn, torch.randn((1, 3, 1, 16)), pool[0], pool[1], rows, None,
                                       torch.empty((1, 1, 3, 16)), 1)  # 3 heads over 2 kv heads


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_rows_get_the_per_row_logits(kv_heads, block_size):
    runner = _runner(kv_heads=kv_heads, block_size=block_size)
    rng = random.Random(block_size * 10 + kv_heads)
    before = runner.native_rows
    for _ in range(6):
        rows = random_step(rng, block_size)
        plan = runner._plan(rows, False)[2]
        assert plan.decode is not None and plan.cascade is None
        assert sorted(plan.decode.rows + plan.rest) == list(range(len(rows)))
        alone, native_ = _both(runner, rows)
        torch.testing.assert_close(native_, alone, rtol=1e-5, atol=1e-5)
    assert runner.native_rows > before


@pytest.mark.parametrize("written_out", [True, False])
def test_both_forward_paths(written_out):
    runner = _runner(block_size=4)
    saved = runner.llama_step
    runner.llama_step = saved if written_out else None  # transformers' modules + paged attention
    try:
        prefix = [3, 9, 4, 50, 51, 52]
        rows = [Row(prefix, 23, [7]), Row(prefix + [60], 25, [8]), Row([80, 81], 5, [10]),
                Row(prefix + [90, 91], 24, [11, 12, 13])]  # a prompt chunk: SDPA in the same step
        assert runner._plan(rows, False)[2].rest == [3]
        alone, native_ = _both(runner, rows)
        torch.testing.assert_close(native_, alone, rtol=1e-5, atol=1e-5)
    finally:
        runner.llama_step = saved


def test_sliding_window_layers_keep_the_per_row_path():
    """Qwen2 with a window: its first layer attends fully (kernel), the others within 8 keys (per
    row). The kernel reads every key of a row, so it must not run in a windowed layer."""
    model, tok = build_tiny("qwen2", layers=2, heads=4, kv_heads=2, sliding_window=8)
    runner = ModelRunner(LoadedModel(model, tok, "tiny:qwen2", torch.device("cpu"), torch.float32),
                         NUM_BLOCKS, 4, cascade=False)
    runner.store.data.copy_(torch.randn(runner.store.data.shape, generator=torch.Generator().manual_seed(1)))
    rows = [Row(list(range(100, 106)) + [10 + i], 25 + i, [7 + i]) for i in range(3)]
    alone, native_ = _both(runner, rows)
    torch.testing.assert_close(native_, alone, rtol=1e-5, atol=1e-5)


def test_deterministic_mode_never_takes_it():
    runner = _runner(block_size=4)
    rows = [Row(list(range(100, 106)) + [10 + i], 25, [7 + i]) for i in range(4)]
    assert runner._plan(rows, True)[2].decode is None
    deterministic_rows_are_batch_invariant(runner, rows)


def test_the_switch_reaches_the_runner(tiny_llama):
    switch_reaches_the_runner(tiny_llama, "--no-native-attention", "native_attention", "native")


def test_the_path_is_named_where_users_read_it(tiny_llama):
    """The start-up line and bench's peer label say which path decode rows take."""
    with Engine(EngineConfig(model="tiny:llama", num_blocks=32), tiny_llama) as eng:
        assert eng.runner.decode_attention(False) == "compiled kernel"
        assert eng.runner.decode_attention(True) == "exact per query (deterministic)"
    cfg = EngineConfig(model="tiny:llama", num_blocks=32, native_attention=False)
    with Engine(cfg, tiny_llama) as eng:
        assert eng.runner.decode_attention(False) == "torch, shared prefixes once (cascade)"


def test_requests_decode_through_it_in_the_engine(tiny_llama):
    """Three requests on a cached 320-token prompt decode in the same steps: their logits are
    those of the engine on torch's ops."""
    on, off = shared_prompt_traces(tiny_llama, "native_rows", {"native_attention": True},
                                   {"native_attention": False})
    assert on >= 3 * 5 and off == 0


def test_without_a_compiler_the_engine_runs_on_torch_ops(tiny_llama, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVPLAY_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None
    assert native.why_not().startswith("build failed")
    assert "using torch ops" in caplog.text
    with Engine(EngineConfig(model="tiny:llama", num_blocks=32), tiny_llama) as eng:
        assert eng.runner.native is False and eng.runner.cascade
        assert eng.runner.decode_attention(False) == "torch, shared prefixes once (cascade)"
        done = eng.submit("a", prompt_ids=list(range(5, 40)), sampling=SamplingParams(max_tokens=3)).result(60)
        assert len(done.token_ids) == 3
    assert not list(tmp_path.glob("native/*"))  # no half-written library left behind


def test_a_compiler_that_writes_nothing_or_a_damaged_cache_is_not_loaded(tmp_path, monkeypatch):
    """A compiler that exits 0 but writes no library, and a cached library that is not one: no
    load, one line says why, and the damaged file is removed so the next start builds again."""
    monkeypatch.setenv("KVPLAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("true") or "/bin/true")
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None
    assert native.why_not().startswith("build failed") and "wrote no library" in native.why_not()
    path = native.library_path()
    path.write_bytes(b"not an ELF file")
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and native.why_not().startswith("load failed")
    assert not path.exists()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVPLAY_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and native.why_not() == "KVPLAY_NATIVE=0"
