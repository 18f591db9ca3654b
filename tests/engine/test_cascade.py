"""Cascade attention (engine/cascade.py): decode rows sharing prefix blocks attend over them once
per group, merged by log-sum-exp — the same logits as every row attending alone, on real tiny
models over a pool of random K/V, with GQA, several block sizes, sliding windows, both forward
paths; never in deterministic mode."""
from __future__ import annotations

import random

import pytest
import torch

from kvplay.engine import cascade
from kvplay.engine.model import LoadedModel
from kvplay.engine.runner import ModelRunner, Row
from kvplay.engine.tiny import build_tiny
from support.steps import NUM_BLOCKS, random_step, shared_prompt_traces
from support.steps import deterministic_rows_are_batch_invariant, switch_reaches_the_runner, with_and_without

def _runner(kind="llama", kv_heads=2, block_size=8, window=None, seed=0):
    model, tok = build_tiny(kind, layers=2, heads=4, kv_heads=kv_heads, sliding_window=window)
    loaded = LoadedModel(model, tok, f"tiny:{kind}", torch.device("cpu"), torch.float32)
    runner = ModelRunner(loaded, NUM_BLOCKS, block_size, native=False)  # the kernel supersedes it
    assert runner.cascade
    g = torch.Generator().manual_seed(seed)
    runner.store.data.copy_(torch.randn(runner.store.data.shape, generator=g))  # every slot readable
    return runner


@pytest.fixture
def group_any(monkeypatch):
    """Group rows however few keys they share (the tiny steps here share few)."""
    monkeypatch.setattr(cascade, "MIN_SAVED_KEYS", 1)


@pytest.fixture(params=["padded", "per row"])
def own_keys(request, monkeypatch):
    """The rows' own keys in one padded call (the tiny steps' always fit), or one call per row."""
    if request.param == "per row":
        monkeypatch.setattr(cascade, "PAD_KEYS", -1)
    return request.param


def _both(runner, rows, deterministic=False):
    return with_and_without(runner, "cascade", rows, deterministic)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # 4, 2 and 1 query heads per kv head
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cascade_gives_the_per_row_logits(kv_heads, block_size, group_any, own_keys):
    runner = _runner(kv_heads=kv_heads, block_size=block_size)
    rng = random.Random(block_size * 10 + kv_heads)
    grouped = multi = 0
    for _ in range(6):
        rows = random_step(rng, block_size)
        plan = runner._plan(rows, False)[2].cascade
        if plan is not None:
            assert (plan.own_pad is not None) == (own_keys == "padded")
            grouped += len(plan.groups)
            multi += len(plan.groups) > 1  # groups' own sides attended and merged together
        alone, cascaded = _both(runner, rows)
        torch.testing.assert_close(cascaded, alone, rtol=1e-5, atol=1e-5)
    assert grouped >= 3 and multi >= 1  # the cascade really ran


@pytest.mark.parametrize("written_out", [True, False])
def test_both_forward_paths_and_a_row_whose_context_is_all_shared(written_out, own_keys, group_any):
    runner = _runner(block_size=4)
    saved = runner.llama_step
    runner.llama_step = saved if written_out else None  # transformers' modules + paged attention
    try:
        prefix = [3, 9, 4, 50, 51, 52]
        rows = [Row(prefix, 23, [7]),  # its 24 keys are all the shared part
                Row(prefix + [60], 25, [8]), Row(prefix + [70, 71], 30, [9]), Row([80, 81], 5, [10])]
        plan = runner._plan(rows, False)[2]
        (group,) = plan.cascade.groups
        assert group.rows == [0, 1, 2] and group.shared.n == 24 and plan.solo == [3]
        assert plan.cascade.own[0] is None and group.shared.first is None  # scattered: one gather
        alone, cascaded = _both(runner, rows)
        torch.testing.assert_close(cascaded, alone, rtol=1e-5, atol=1e-5)
        assert runner._plan(rows[:1], False)[2].cascade is None  # a single row: the per-row path
    finally:
        runner.llama_step = saved


def test_the_group_shares_the_longest_common_run_each_row_reads_in_full(group_any):
    bs = 4
    used = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 10]]
    totals = [16, 15, 10]  # the third reads blocks 5 and 6 in full, 10 in part
    slots = [torch.tensor([b * bs + i for b in t for i in range(bs)])[:n] for t, n in zip(used, totals)]
    plan, solo = cascade.plan_groups(used, totals, [1, 1, 1], [0, 1, 2], slots, bs)
    (group,) = plan.groups
    assert group.shared.n == 8 and group.shared.first == 20 and solo == []
    assert [k.n for k in plan.own] == [8, 7, 2]
    assert plan.own[0].first == 28 and plan.own[1].first is None  # 7, 8 consecutive; 7, 9 not
    pad = plan.own_pad.view(3, 8)  # each row's own slots, padded to the longest (8)
    assert [pad[j, :n].tolist() for j, n in enumerate((8, 7, 2))] == [s[8:].tolist() for s in slots]
    assert (plan.own_mask[:, 0, 0] == 0).sum(1).tolist() == [8, 7, 2]  # the padding masked out
    # prompt chunks are never grouped
    assert cascade.plan_groups(used, totals, [1, 2, 1], [0, 1, 3], slots, bs)[1] == [1]


def test_only_groups_that_pay_are_formed():
    """2 or 3 rows sharing one 16-token block stay on the per-row path; 2 rows sharing the serving
    workload's 384-token prefix, or 8 sharing one block, are grouped."""
    runner = _runner(block_size=16)
    shared = lambda rows, blocks, own: [Row(list(range(100, 100 + blocks)) + [10 + i], blocks * 16 + own, [7])
                                        for i in range(rows)]
    assert runner._plan(shared(2, 1, 5), False)[2].cascade is None
    assert runner._plan(shared(3, 1, 8), False)[2].cascade is None
    assert runner._plan(shared(2, 24, 5), False)[2].cascade is not None
    assert runner._plan(shared(8, 1, 5), False)[2].cascade is not None


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_row_alone_on_its_prefix_attends_its_leading_run_as_a_view(block_size, monkeypatch, own_keys):
    """A decode row no other row shares a prefix with is a group of one: its leading consecutive
    blocks attended as a view of the pool, only the rest gathered, merged as any group's; the
    same logits as attending alone."""
    monkeypatch.setattr(cascade, "SOLO_KEYS", 1)
    monkeypatch.setattr(cascade, "MIN_SAVED_KEYS", 1)
    runner = _runner(block_size=block_size)
    rng = random.Random(block_size + 7)
    solo_groups = 0
    for _ in range(10):
        rows = random_step(rng, block_size)
        plan = runner._plan(rows, False)[2].cascade
        if plan is not None:
            solo_groups += sum(len(g.rows) == 1 and g.shared.first is not None for g in plan.groups)
        alone, cascaded = _both(runner, rows)
        torch.testing.assert_close(cascaded, alone, rtol=1e-5, atol=1e-5)
    assert solo_groups >= 1  # the group of one really ran


def test_which_rows_alone_on_a_prefix_are_grouped():
    """At the serving workload's sizes (block 16): a row with 24 consecutive prefix blocks and
    scattered blocks of its own is a group of one (384 keys a view); a row whose blocks are all
    consecutive is a view already, and one whose leading run is short stays on the per-row path."""
    runner = _runner(block_size=16)
    prefix = list(range(100, 124))
    rows = [Row(prefix + [20, 5], 24 * 16 + 20, [7]),   # a long run, then its own blocks
            Row(list(range(60, 72)), 12 * 16 - 3, [8]),  # all consecutive, the last block in part
            Row([30, 31, 40, 2, 7], 70, [9])]            # a 32-key run
    plan = runner._plan(rows, False)[2]
    (group,) = plan.cascade.groups
    assert group.rows == [0] and group.shared.n == 384 and group.shared.first == 1600
    assert plan.solo == [1, 2]
    alone, cascaded = _both(runner, rows)
    torch.testing.assert_close(cascaded, alone, rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_keep_the_per_row_path(group_any):
    """Qwen2 with a window: its first layer attends fully (cascade), the others within 8 keys
    (per row). A cascade in a windowed layer would read keys outside the window."""
    runner = _runner("qwen2", block_size=4, window=8)
    prefix = list(range(100, 106))
    rows = [Row(prefix + [10 + i], 25 + i, [7 + i]) for i in range(3)]
    assert runner._plan(rows, False)[2].cascade is not None
    alone, cascaded = _both(runner, rows)
    torch.testing.assert_close(cascaded, alone, rtol=1e-5, atol=1e-5)


def test_deterministic_mode_never_groups_and_stays_batch_invariant(group_any):
    runner = _runner(block_size=4)
    prefix = list(range(100, 106))
    rows = [Row(prefix + [10 + i], 25, [7 + i]) for i in range(4)]
    assert runner._plan(rows, False)[2].cascade is not None and runner._plan(rows, True)[2].cascade is None
    deterministic_rows_are_batch_invariant(runner, rows)


def test_the_switch_reaches_the_runner(tiny_llama):
    switch_reaches_the_runner(tiny_llama, "--no-cascade-attention", "cascade_attention", "cascade")


def test_requests_on_one_cached_prompt_decode_as_a_group_in_the_engine(tiny_llama):
    """Three requests on a cached 320-token prompt hold its blocks and decode in the same steps:
    the engine groups them, and their logits are those of the engine without the cascade."""
    on, off = shared_prompt_traces(tiny_llama, "grouped_rows",
                                   {"cascade_attention": True, "native_attention": False},
                                   {"cascade_attention": False, "native_attention": False})
    assert on >= 3 * 4 and off == 0
