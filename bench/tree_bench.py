"""How long the prefix tree (wire/tree.py) takes on a big mirror: `conversations` chains of
`turn_blocks`-block turns under one shared system prompt, filled up to `--blocks` cached blocks,
then the tree built, the prediction's index built and one prompt matched (attach's prediction)
and the tree printed as text
(8 children a node, as `kvplay tree` does); then 64 conversations stored and 64 evicted and what
changed found (`diff_s`: tui/tree_anim.diff_trees, what the tree view animates; on its build
thread, like the build) and the UI thread's share of a refresh (`snapshot_ms`: the mirror
copied for the build thread, `Mirror.copy`, as the tree views' snapshot does).

    python -m kvplay.bench.tree_bench [--blocks 1000000] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import time

from kvplay.tui.tree_anim import diff_trees
from kvplay.wire.codec import BlockRemoved, BlockStored, EventBatch
from kvplay.wire.mirror import Mirror
from kvplay.wire.translate import FromWire
from kvplay.wire.tree import Labels, PrefixMatcher, PrefixTree, to_text

BLOCK_SIZE = 16


def feed(w: FromWire, batch: EventBatch) -> None:
    """A wire batch through its pod's translator, applied to the pod's mirror."""
    w.mirror.apply(w(batch))


def fill(blocks: int, system_blocks: int = 32, turn_blocks: int = 4, seed: int = 0) -> tuple[FromWire, list[int]]:
    """A mirror of `blocks` blocks (with its translator): one system prompt, then conversations
    of a few turns each."""
    rng = random.Random(seed)
    m = Mirror()
    w = FromWire(m)
    system = [rng.randrange(50_000) for _ in range(system_blocks * BLOCK_SIZE)]
    hs = list(range(1, system_blocks + 1))
    feed(w, EventBatch(0.0, [BlockStored(hs, None, system, BLOCK_SIZE, session_id="u0")]))
    next_h = system_blocks + 1
    conv = 0
    last = system
    while len(m.blocks) < blocks:
        parent = hs[-1]
        toks = list(system)
        for _turn in range(rng.randint(1, 6)):
            n = min(turn_blocks, blocks - len(m.blocks))
            if n <= 0:
                break
            t = [rng.randrange(50_000) for _ in range(n * BLOCK_SIZE)]
            new = list(range(next_h, next_h + n))
            next_h += n
            feed(w, EventBatch(float(conv), [BlockStored(new, parent, t, BLOCK_SIZE, session_id=f"u{conv % 64}")]))
            parent = new[-1]
            toks += t
        conv += 1
        last = toks
    return w, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplay.bench.tree_bench", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    w, prompt = fill(args.blocks)
    m = w.mirror
    t_fill = time.perf_counter() - t0
    before = m.copy()  # the tree keeps what it was built from: a copy, as the view's snapshot is
    t0 = time.perf_counter()
    tree = PrefixTree(before.blocks)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = PrefixMatcher(m.blocks)
    t_index = time.perf_counter() - t0
    t0 = time.perf_counter()
    matched = matcher.predicted_hit(prompt + [1])
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    lines = to_text(tree, Labels(None), 8, now=0.0)
    t_text = time.perf_counter() - t0
    rng = random.Random(1)
    leaves = [n for n in tree.nodes if not n.children and n.parent is not None][:64]
    feed(w, EventBatch(1e9, [BlockRemoved(list(n.keys)) for n in leaves]))
    top = max(m.blocks) + 1
    feed(w, EventBatch(1e9, [BlockStored([top + i], 32, [rng.randrange(50_000) for _ in range(BLOCK_SIZE)],
                                         BLOCK_SIZE, session_id="new") for i in range(64)]))
    t0 = time.perf_counter()
    snap = m.copy()
    t_snap = time.perf_counter() - t0
    after = PrefixTree(snap.blocks)
    t0 = time.perf_counter()
    changes, more = diff_trees(tree, after, {}, {})
    t_diff = time.perf_counter() - t0
    out = {"blocks": len(m.blocks), "nodes": len(tree), "root_children": len(tree.roots[0].children),
           "fill_s": round(t_fill, 3), "build_s": round(t_build, 3), "index_s": round(t_index, 3), "match_ms": round(t_match * 1000, 3),
           "matched_tokens": matched, "text_s": round(t_text, 3), "text_lines": len(lines),
           "snapshot_ms": round(t_snap * 1000, 1), "diff_s": round(t_diff, 3), "changes": len(changes) + more}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['blocks']:,} blocks → {out['nodes']:,} nodes ({out['root_children']:,} branches under the "
              f"system prompt): tree built in {out['build_s']} s; prediction index built in {out['index_s']} s "
              f"(attach keeps it up to date instead), one {len(prompt) + 1}-token prompt matched in "
              f"{out['match_ms']} ms; text {out['text_s']} s ({out['text_lines']} lines); "
              f"{out['changes']} changes found in {out['diff_s']} s, the UI thread's snapshot {out['snapshot_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
