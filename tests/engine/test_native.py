"""The compiled kernels (engine/native.py, engine/csrc/): built with this machine's compiler, the
decode-attention kernel gives every decode row the logits of the per-row SDPA path, the prefill
kernel every prompt chunk the causal SDPA over its keys (each query's bits independent of the
chunk, the step and the thread count: deterministic mode's attention), and the fused passes the
torch ops they replace — on random tensors and on real tiny models over a pool of random K/V
(GQA, several block sizes, both forward paths, sliding windows); and where they cannot be built
the engine runs on torch's ops."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvplay.engine import cbuild, native
from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.model import LoadedModel
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.sampling import SamplingParams
from kvplay.engine.llama_step import LlamaStep
from kvplay.engine.tiny import build_tiny
from support.steps import NUM_BLOCKS, random_step, shared_prompt_traces
from support.steps import deterministic_rows_are_batch_invariant, switch_reaches_the_runner, with_and_without

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler on this machine")


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
    rows = native.KernelRows.of(list(range(len(lens))), row_slots, toks, [n - 1 for n in lens])
    assert native.decode_attention(fn, query, pool[0], pool[1], rows, 0.3, out, 2)
    for r, t in enumerate(toks):
        k = pool[0].index_select(1, row_slots[r]).unsqueeze(0)
        v = pool[1].index_select(1, row_slots[r]).unsqueeze(0)
        want = F.scaled_dot_product_attention(query[:, :, t:t + 1], k, v, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[0, t], want[0, :, 0], rtol=2e-5, atol=2e-5)
    assert out[0, 1].isnan().all()  # tokens that are not decode rows are left alone


def _causal_sdpa(query, pool, row_slots, past, tok, n, scale):
    """SDPA of a row's n queries (tokens tok ..) over its keys, query i seeing keys 0 .. past + i."""
    k = pool[0].index_select(1, row_slots).unsqueeze(0)
    v = pool[1].index_select(1, row_slots).unsqueeze(0)
    kpos = torch.arange(past + n).view(1, -1)
    qpos = torch.arange(past, past + n).view(-1, 1)
    out = F.scaled_dot_product_attention(query[:, :, tok:tok + n], k, v, attn_mask=kpos <= qpos,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, Hq, D]


@pytest.mark.parametrize("dim", [16, 24, 64])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (10, 2), (16, 1)])  # 1 to 16 lanes a token
def test_the_prefill_kernel_is_causal_sdpa_over_each_rows_keys(dim, heads, kv_heads):
    lib = native.kernel()
    g = torch.Generator().manual_seed(dim * heads)
    slots_n = 4096
    pool = torch.randn((2, kv_heads, slots_n, dim), generator=g)
    # (past, new): a cold chunk, chunks after cached keys (not on a 16-key tile edge), one token,
    # a chunk longer than a query block whose keys cross many tiles
    shapes = [(0, 37), (300, 21), (17, 1), (0, 1), (45, 70)]
    row_slots = [torch.randperm(slots_n, generator=g)[:p + n] for p, n in shapes]
    toks, t = [], 2
    for _, n in shapes:
        toks.append(t)
        t += n + 1  # other tokens between the rows
    qkv = torch.randn((t, heads + kv_heads, dim), generator=g)
    query = qkv[:, :heads].transpose(0, 1).unsqueeze(0)  # strided, as llama_step hands it over
    out = torch.full((1, t, heads, dim), float("nan"))
    rows = native.KernelRows.of(list(range(len(shapes))), row_slots, toks, [p for p, _ in shapes])
    assert native.prefill_attention(lib, query, pool[0], pool[1], rows, 0.3, out, 2)
    for r, (past, n) in enumerate(shapes):
        want = _causal_sdpa(query, pool, row_slots[r], past, toks[r], n, 0.3)
        torch.testing.assert_close(out[0, toks[r]:toks[r] + n], want, rtol=2e-5, atol=2e-5)
    assert out[0, :2].isnan().all() and out[0, toks[1] - 1].isnan().all()  # other tokens left alone


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_a_prefill_querys_bits_depend_only_on_its_own_keys(heads, kv_heads):
    """The same 60-token prompt computed cold in one chunk, in chunks of 7, token by token, beside
    other rows, at one and two threads: every query's output is bitwise the same (deterministic
    mode's cached == cold)."""
    lib = native.kernel()
    g = torch.Generator().manual_seed(heads)
    dim, n = 64, 60
    pool = torch.randn((2, kv_heads, 512, dim), generator=g)
    slots = torch.randperm(512, generator=g)[:n]
    q = torch.randn((n, heads, dim), generator=g)

    def run(chunks, threads, others=0):
        got = torch.empty((n, heads, dim))
        start = 0
        for size in chunks:
            extra = [torch.randperm(512, generator=g)[:40] for _ in range(others)]
            qs = torch.cat([q[start:start + size]] + [torch.randn((5, heads, dim), generator=g) for _ in extra])
            out = torch.empty((1, qs.shape[0], heads, dim))
            rows = native.KernelRows.of(list(range(1 + others)), [slots[:start + size]] + extra,
                                        [0] + [size + 5 * j for j in range(others)],
                                        [start] + [35] * others)
            assert native.prefill_attention(lib, qs.transpose(0, 1).unsqueeze(0), pool[0], pool[1], rows,
                                            0.125, out, threads)
            got[start:start + size] = out[0, :size]
            start += size
        return got

    cold = run([n], 1)
    assert torch.equal(run([7] * 8 + [4], 2), cold)
    assert torch.equal(run([1] * n, 1), cold)
    assert torch.equal(run([16, 13, 31], 2, others=2), cold)


def test_the_fused_passes_are_the_torch_ops():
    lib = native.kernel()
    g = torch.Generator().manual_seed(3)
    for rows, hidden in ((1, 64), (5, 576), (40, 72)):  # 72: a tail past the 16-float vectors
        x = torch.randn((rows, hidden), generator=g)
        w, delta = torch.randn(hidden, generator=g), torch.randn((rows, hidden), generator=g)
        torch.testing.assert_close(native.rms_norm(lib, x.clone(), w, 1e-5, 2), F.rms_norm(x, (hidden,), w, 1e-5))
        x2 = x.clone()
        got = native.rms_norm(lib, x2, w, 1e-5, 2, delta=delta)
        torch.testing.assert_close(x2, x + delta)  # the residual stream, in place
        torch.testing.assert_close(got, F.rms_norm(x + delta, (hidden,), w, 1e-5))
        gu = torch.randn((rows, 2 * hidden), generator=g) * 6
        torch.testing.assert_close(native.silu_mul(lib, gu, 2), F.silu(gu[:, :hidden]) * gu[:, hidden:])
    for hq, hk, d in ((9, 3, 64), (4, 2, 16), (2, 1, 12)):
        n = 21
        qkv = torch.randn((n, (hq + 2 * hk) * d), generator=g)
        angle = torch.randn((n, d // 2), generator=g)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        pool = torch.zeros((2, hk, 64, d))
        slots = torch.randperm(64, generator=g)[:n]
        q = native.rope_write(lib, qkv, hq, hk, d, cos, sin, slots, pool[0], pool[1], 2)
        heads = qkv.view(n, hq + 2 * hk, d)
        c, s = cos.unsqueeze(1), LlamaStep._signed_sin(sin.unsqueeze(1))
        torch.testing.assert_close(q, LlamaStep._rotate(heads[:, :hq], c, s))
        torch.testing.assert_close(pool[0][:, slots].transpose(0, 1), LlamaStep._rotate(heads[:, hq:hq + hk], c, s))
        assert torch.equal(pool[1][:, slots].transpose(0, 1), heads[:, hq + hk:])


def test_a_layout_it_does_not_take_is_refused_not_misread():
    fn = native.kernel()
    pool = torch.randn((2, 2, 64, 16))
    rows = native.KernelRows.of([0], [torch.arange(5)], [0], [4])
    query = torch.randn((1, 4, 1, 16))
    out = torch.empty((1, 1, 4, 16))
    assert not native.decode_attention(fn, query, pool[0].transpose(1, 2), pool[1], rows, None, out, 1)
    assert not native.decode_attention(fn, torch.randn((1, 3, 1, 16)), pool[0], pool[1], rows, None,
                                       torch.empty((1, 1, 3, 16)), 1)  # 3 heads over 2 kv heads
    assert not native.prefill_attention(fn, query, pool[0].transpose(1, 2), pool[1], rows, None, out, 1)
    assert not native.prefill_attention(fn, query.double(), pool[0].double(), pool[1].double(), rows, None,
                                        out.double(), 1)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_every_row_gets_the_per_row_logits(kv_heads, block_size):
    """Decode rows by the decode kernel, prompt chunks by the prefill kernel: the logits of each
    row attended alone by SDPA."""
    runner = _runner(kv_heads=kv_heads, block_size=block_size)
    rng = random.Random(block_size * 10 + kv_heads)
    before, chunks = runner.native_rows, runner.prefill_rows
    for _ in range(6):
        rows = random_step(rng, block_size)
        plan = runner._plan(rows, False)[2]
        assert plan.decode is not None and plan.cascade is None
        assert sorted(plan.decode.rows + (plan.prefill.rows if plan.prefill else []) + plan.rest) == list(range(len(rows)))
        alone, native_ = _both(runner, rows)
        torch.testing.assert_close(native_, alone, rtol=1e-5, atol=1e-5)
    assert runner.native_rows > before and runner.prefill_rows > chunks


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_passes_give_the_torch_ops_logits(kind, threads):
    """Prompts cold and after a cache hit, then decode rows with a chunk beside them: the compiled
    passes (norms, rotary + K/V write, SiLU) give the logits and the pool of torch's ops."""
    model, tok = build_tiny(kind, layers=2, heads=4, kv_heads=2)
    loaded = LoadedModel(model, tok, f"tiny:{kind}", torch.device("cpu"), torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {}
        for fused in (True, False):
            runner = ModelRunner(loaded, NUM_BLOCKS, 4, fused=fused)
            assert runner.fused is fused
            runner.store.data.zero_()  # compare every slot below: the unwritten ones stay 0
            a, b = list(range(10)), [30, 31, 32, 40, 41, 42, 43, 44]
            ids = [(7 * i) % 80 + 5 for i in range(40)]
            got[fused] = ([runner.forward([Row(a, 0, ids[:37]), Row(b, 0, ids[:21])]),
                           runner.forward([Row(a, 37, [9]), Row(b, 16, ids[21:33]), Row(b[:4] + [50], 16, [11])]),
                           runner.forward([Row(a, 38, [3]), Row(b, 28, [4])])],
                          runner.store.data.clone())
    finally:
        torch.set_num_threads(old)
    for x, y in zip(got[True][0], got[False][0]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("written_out", [True, False])
def test_both_forward_paths(written_out):
    runner = _runner(block_size=4)
    saved = runner.llama_step
    runner.llama_step = saved if written_out else None  # transformers' modules + paged attention
    try:
        prefix = [3, 9, 4, 50, 51, 52]
        rows = [Row(prefix, 23, [7]), Row(prefix + [60], 25, [8]), Row([80, 81], 5, [10]),
                Row(prefix + [90, 91], 24, [11, 12, 13])]  # a prompt chunk: SDPA in the same step
        assert runner._plan(rows, False)[2].prefill.rows == [3]
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


def test_deterministic_mode_attends_every_row_by_the_prefill_kernel():
    """Not the decode kernel (its sums differ from a chunk's): every row, decode rows too, by the
    prefill kernel, whose query bits depend on their own keys only."""
    runner = _runner(block_size=4)
    rows = [Row(list(range(100, 106)) + [10 + i], 25, [7 + i]) for i in range(4)]
    rows.append(Row(list(range(120, 126)), 9, [5, 6, 7]))
    plan = runner._plan(rows, True)[2]
    assert plan.decode is None and plan.prefill.rows == list(range(5)) and plan.rest == []
    deterministic_rows_are_batch_invariant(runner, rows)
    deterministic_rows_are_batch_invariant(runner, rows[::-1])


def test_the_switches_reach_the_runner(tiny_llama):
    switch_reaches_the_runner(tiny_llama, "--no-native-attention", "native_attention", "native")
    switch_reaches_the_runner(tiny_llama, "--no-fused-ops", "fused_ops", "fused")


def test_the_path_is_named_where_users_read_it(tiny_llama):
    """The start-up line and bench's peer label say which path decode rows take."""
    with Engine(EngineConfig(model="tiny:llama", num_blocks=32), tiny_llama) as eng:
        assert eng.runner.decode_attention(False) == "compiled kernel"
        assert eng.runner.decode_attention(True) == "exact per query, compiled kernel (deterministic)"
    cfg = EngineConfig(model="tiny:llama", num_blocks=32, native_attention=False)
    with Engine(cfg, tiny_llama) as eng:
        assert eng.runner.decode_attention(False) == "torch, shared prefixes once (cascade)"


def test_requests_decode_through_it_in_the_engine(tiny_llama):
    """Three requests on a cached 320-token prompt decode in the same steps: their logits are
    those of the engine on torch's ops (attention, then the element-wise passes too)."""
    on, off = shared_prompt_traces(tiny_llama, "native_rows", {"native_attention": True},
                                   {"native_attention": False})
    assert on >= 3 * 5 and off == 0
    on, off = shared_prompt_traces(tiny_llama, "prefill_rows", {},
                                   {"native_attention": False, "fused_ops": False})
    assert on >= 1 and off == 0  # the warm-up prompt


def test_without_a_compiler_the_engine_runs_on_torch_ops(tiny_llama, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVPLAY_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None
    assert native.why_not().startswith("build failed")
    assert "using torch ops" in caplog.text
    with Engine(EngineConfig(model="tiny:llama", num_blocks=32), tiny_llama) as eng:
        assert eng.runner.native is False and eng.runner.fused is False and eng.runner.cascade
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
