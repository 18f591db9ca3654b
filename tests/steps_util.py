"""Random decode steps over a shared pool, for the attention paths' tests (test_cascade.py,
test_native.py): rows on shared prefixes, rows alone, a prompt chunk."""
from __future__ import annotations

import random

from kvplay.engine.runner import Row

NUM_BLOCKS = 160


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
