"""What scrubbing a recorded session costs at 512 vs 1,000,000 blocks (`kvplay bench --workload scrub`).

The session: a real `BlockPool` (no model) driven like a multi-user chat — each turn reuses its
user's cached prefix (BlocksTouched + BlockHit), allocates the rest, stores its full blocks,
releases everything — with its events stamped and serialised exactly as the recorder writes
them. The same events are then scrubbed the way `kvplay scrub` does (sessions/history.History
over wire/mirror.Mirror): open at event 45 with a whole-pool map summary, the counters and
one block's detail; seek to the end; seek back to the middle. Times are best of `reps`;
memory is tracemalloc's peak over one open-and-seek.

    python -m kvplay.bench.scrub_bench [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc

from kvplay.engine.events import BlockHit, EngineBatch, EventQueue, RequestFinished, RequestQueued, RequestStarted
from kvplay.engine.pool import BlockPool
from kvplay.sessions.history import History

SMALL, HUGE = 512, 1_000_000
BLOCK = 16
MAP_CELLS = 12 * 80  # about the scrubber's overview map


def recorded_events(num_blocks: int, turns: int = 160, users: int = 8) -> list[EngineBatch]:
    """A session's recorded batches (one per turn, as sessions/history.session_batches reads them)."""
    out: list[EngineBatch] = []

    class Stamped(EventQueue):  # a clock of its own: the same events every run
        def put(self, ev) -> None:
            super().put(ev)
            ev.ts = 1000.0 + ev.seq * 0.001

    queue = Stamped()
    emit = queue.put
    pool = BlockPool(num_blocks, BLOCK, "lru", events=queue)
    system = list(range(1, 1 + 4 * BLOCK))  # a 4-block shared system prompt
    chains: dict[str, list[int]] = {}
    for t in range(turns):
        user = f"u{t % users}"
        rid = f"r{t}"
        prompt = chains.get(user, system) + [7 + t % users] * BLOCK * 2
        emit(RequestQueued(request_id=rid, user=user, prompt_tokens=len(prompt)))
        matched, parent, h = [], None, 0
        for j in range(len(prompt) // BLOCK):
            h = hash((h, tuple(prompt[j * BLOCK:(j + 1) * BLOCK]))) & 0xFFFFFFFFFFFF
            bid = pool.index.get(h)
            if bid is None:
                break
            matched.append(bid)
        pool.touch(matched)
        if matched:
            emit(BlockHit(request_id=rid, user=user, block_ids=list(matched), cached_tokens=len(matched) * BLOCK))
        emit(RequestStarted(request_id=rid, user=user, cached_tokens=len(matched) * BLOCK))
        need = -(-(len(prompt) + 1) // BLOCK) - len(matched)
        table = matched + pool.allocate(need)
        h = 0
        for j in range(len(prompt) // BLOCK):
            toks = prompt[j * BLOCK:(j + 1) * BLOCK]
            h = hash((h, tuple(toks))) & 0xFFFFFFFFFFFF
            if j >= len(matched):
                pool.register(table[j], h, table[j - 1] if j else None, toks, (), user, rid)
                pool.add_user(table[j], user)
        pool.release(table)
        emit(RequestFinished(request_id=rid, user=user))
        chains[user] = prompt
        events = queue.take()
        out.append(EngineBatch(t + 1, events[-1].ts, events, t + 1))
    return out


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def scrub_costs(batches: list[EngineBatch], num_blocks: int, reps: int = 5) -> dict:
    n = sum(len(b.events) for b in batches)

    def open_at(k: int = 45):
        h = History(batches, num_blocks)
        st = h.state(min(k, n))
        st.mirror.summary(MAP_CELLS)
        st.mirror.counts()
        st.mirror.block(0)
        return h

    def seeks():
        h = open_at()
        for k in (n, n // 2, n, 3):
            st = h.state(k)
            st.mirror.summary(MAP_CELLS)
            st.mirror.counts()

    out = {"blocks": num_blocks, "events": n, "open_ms": _best(open_at, reps) * 1000,
           "open_and_4_seeks_ms": _best(seeks, reps) * 1000}
    tracemalloc.start()
    seeks()
    out["peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return out


def run(small: int = SMALL, huge: int = HUGE, reps: int = 9) -> dict:
    res = {}
    for n in (small, huge):
        res[str(n)] = scrub_costs(recorded_events(n), n, reps)
    s, h = res[str(small)], res[str(huge)]
    res["ratio_open"] = h["open_ms"] / s["open_ms"]
    res["ratio_seeks"] = h["open_and_4_seeks_ms"] / s["open_and_4_seeks_ms"]
    res["target"] = "1,000,000 blocks at most 2x 512 (issue #19)"
    return res


def print_report(res: dict) -> None:
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"{int(k):>9,} blocks, {v['events']} events: open at event 45 {v['open_ms']:.1f} ms, "
                  f"open + 4 seeks {v['open_and_4_seeks_ms']:.1f} ms, peak {v['peak_mb']:.1f} MiB")
    print(f"1M / 512: open {res['ratio_open']:.2f}x, open + seeks {res['ratio_seeks']:.2f}x "
          f"(target: at most 2x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run()
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
