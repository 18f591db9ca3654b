"""Random decode steps over a shared pool, for the attention paths' tests (test_cascade.py,
test_native.py): rows on shared prefixes, rows alone, a prompt chunk; and `drain`, for tests
that step an engine themselves."""
from __future__ import annotations

import argparse
import random

import torch

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.options import add_engine_args, config_from_args
from kvplay.engine.runner import Row
from kvplay.engine.sampling import SamplingParams

NUM_BLOCKS = 160


def drain(eng, limit=2000):
    """Step an engine the test drives itself (no engine thread) until its requests are done."""
    for _ in range(limit):
        if not eng.scheduler.has_work():
            return
        eng.step()
    raise AssertionError("the scheduler did not finish its requests")


def random_step(rng: random.Random, bs: int) -> list[Row]:
    """Decode rows on 1-3 prefixes (scattered or consecutive blocks), each row holding some of a
    prefix's first blocks and then blocks of its own; one row per prefix whose whole context is
    the shared part; rows on no prefix; a prompt chunk on a prefix. No two rows write one slot."""
    start = 100 + rng.randint(0, 10)
    prefixes = [list(range(start, start + rng.randint(1, 6)))]  # consecutive: a view of the pool
    ids = [b for b in range(NUM_BLOCKS) if b not in prefixes[0]]
    rng.shuffle(ids)
    fresh = iter(ids)
    for _ in range(rng.randint(0, 2)):  # scattered blocks: one gather
        prefixes.append([next(fresh) for _ in range(rng.randint(1, 6))])
    rows = []
    for blocks in prefixes:
        rows.append(Row(list(blocks), len(blocks) * bs - 1, [rng.randint(5, 90)]))  # all shared
        for _ in range(rng.randint(1, 4)):
            keep = rng.randint(1, len(blocks))
            own = [next(fresh) for _ in range(rng.randint(1, 3))]
            past = keep * bs + rng.randint(0, len(own) * bs - 1)
            rows.append(Row(blocks[:keep] + own, past, [rng.randint(5, 90)]))
    for _ in range(rng.randint(0, 2)):
        own = [next(fresh) for _ in range(rng.randint(1, 4))]
        rows.append(Row(own, rng.randint(0, len(own) * bs - 1), [rng.randint(5, 90)]))
    if rng.random() < 0.5:  # a prompt chunk after a cached prefix: not grouped, attended alone
        blocks = prefixes[0]
        own = [next(fresh) for _ in range(2)]
        rows.append(Row(blocks + own, len(blocks) * bs, [rng.randint(5, 90) for _ in range(bs + 1)]))
    rng.shuffle(rows)
    return rows


def shared_prompt_traces(loaded, counter: str, on: dict, off: dict) -> tuple[int, int]:
    """Three requests on a cached 320-token prompt decode in the same steps, once under the
    config fields `on` and once under `off`: their logits agree. Returns the runner's `counter`
    (rows taken by the path under test) for each run."""
    prompt = [5 + (i * 7) % 80 for i in range(320)]
    traces, counted = [], []
    for fields in (on, off):
        with Engine(EngineConfig(model="tiny:llama", num_blocks=128, **fields), loaded) as eng:
            eng.submit("warm", prompt_ids=prompt, sampling=SamplingParams(max_tokens=1)).result(60)
            sp = SamplingParams(max_tokens=6, stop_on_eos=False)
            # submitted from the engine thread, between two steps: all three are in before the
            # next step whatever the machine's speed (from this thread, a slow machine's engine
            # could step the first alone)
            handles = eng.call(lambda: [eng.submit(f"u{i}", prompt_ids=prompt + [10 + i], sampling=sp,
                                                   trace_logits=True) for i in range(3)])
            for h in handles:
                assert h.result(60).stats.cached_tokens >= 320 - 16
            traces.append([h.request.logits_trace for h in handles])
            counted.append(getattr(eng.runner, counter))
    for a, b in zip(*traces):
        assert len(a) == len(b) == 6
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    return counted[0], counted[1]


def deterministic_rows_are_batch_invariant(runner, rows: list[Row]) -> None:
    """In deterministic mode a row's logits do not depend on the rows beside it."""
    alone = runner.forward(rows[:1], deterministic=True)
    together = runner.forward(rows, deterministic=True)
    assert torch.equal(alone[0], together[0])


def switch_reaches_the_runner(loaded, flag: str, field: str, attr: str) -> None:
    """`flag` turns the config `field` off (on by default), and the runner's `attr` follows."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = config_from_args(parser.parse_args([flag]))
    assert getattr(cfg, field) is False
    assert getattr(config_from_args(parser.parse_args([])), field) is True
    assert getattr(Engine(cfg.replace(model="tiny:llama", num_blocks=32), loaded).runner, attr) is False
    assert getattr(Engine(EngineConfig(model="tiny:llama", num_blocks=32), loaded).runner, attr)


def with_and_without(runner, attr: str, rows: list[Row], deterministic: bool = False):
    """(logits with the runner's path `attr` off, logits with it on)."""
    setattr(runner, attr, False)
    try:
        off = runner.forward(rows, deterministic)
    finally:
        setattr(runner, attr, True)
    return off, runner.forward(rows, deterministic)
