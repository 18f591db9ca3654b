"""`kvplay tree SESSION|URL [--at N] [--json]`: the cached prefixes as a radix tree of text, by who
made and who reused them (wire/tree.py), headless.

    kvplay tree 3f2a                      # a recorded session, at its end
    kvplay tree 3f2a --at 120 --json      # ... after its first 120 events, as JSON
    kvplay tree http://127.0.0.1:8000     # a server: its KV events, found as `watch URL` finds them
    kvplay tree http://127.0.0.1:8000 --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558

A session's mirror is its recorded events up to N applied in order; its text comes from the
session's model's tokenizer when it is on this machine (else token ids; `--ids` skips it). A
server's mirror is its KV events (the endpoints it advertises, like `watch URL`, or
`--events`), listened to for `--duration` seconds (with `--replay`, the
server re-sends what it kept, so the tree covers what was cached before); its text comes from
the server's `/detokenize`. Each node: its text, blocks and tokens, who made it → who reused it,
hits, age; where prompts branch from it (`⑂ prompts branch at token 497`, and on the branch
`⑂ diverged at 497 from alice`) and which of its chains were evicted and then recomputed
(`↻ recomputed 4 blk, evicted 12s ago by carol`): the miss attribution of the events
(wire/miss_watch.py); `--json` gives each node `branch_at` and `marks`. `--children K` lists K
children per node, then "+ N more branches".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvplay.commands.watch import add_source_args, url_sources
from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg, check_url
from kvplay.sessions.event_log import read_batches
from kvplay.sessions.history import flat_events, pool_state, recorded_pool_size
from kvplay.sessions.query import resolve_session
from kvplay.sessions.store import open_db
from kvplay.sessions.tokenizer import session_detokenizer
from kvplay.wire.miss_watch import recorded_marks
from kvplay.wire.remote import RemoteBackend
from kvplay.wire.tree import SHOWN_CHILDREN, Labels, PrefixTree, to_json, to_text


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="SESSION|URL", help="a recorded session id (or unique prefix), or a server's URL")
    add_db_arg(p)
    p.add_argument("--at", type=int, default=None, metavar="N", help="a session: the tree after its first N events")
    p.add_argument("--json", action="store_true", help="print the tree as JSON")
    p.add_argument("--children", type=int, default=SHOWN_CHILDREN, metavar="K",
                   help=f"children listed per node before '+ N more branches' (default {SHOWN_CHILDREN})")
    p.add_argument("--ids", action="store_true", help="label nodes with token ids (load no tokenizer)")
    add_source_args(p)
    p.add_argument("--topic", default="", help="a server: topic prefix of the KV events (default: all)")
    p.add_argument("--api-key", default=None, metavar="K", help="a server: bearer token (default: env KVPLAY_API_KEY)")
    p.add_argument("--duration", type=float, default=2.0, metavar="S",
                   help="a server: listen to its KV events for S seconds (default 2)")


def session_trees(args) -> tuple[dict, dict, object]:
    """{pod: PrefixTree} of a recorded session after --at events, its header, and detokenize."""
    db = open_db(args.db, create=False)
    try:
        s = resolve_session(db, args.target)
        batches, bad = read_batches(db, s["id"])
    finally:
        db.close()
    events = flat_events(batches)
    n = len(events) if args.at is None else args.at
    if not 0 <= n <= len(events):
        raise KvplayError(f"--at {args.at}: session {s['id']} has events 0 to {len(events)}")
    m = pool_state(batches, n, recorded_pool_size(s, batches) or 1).mirror
    hits = m.block_hits()
    marks = recorded_marks(batches, n)
    trees = {pod: PrefixTree(blocks, hits, m.version, marks) for pod, blocks in m.pods_blocks().items()}
    head = {"session": s["id"], "model": s.get("model"), "at": n, "events": len(events),
            "at_ts": (events[n - 1].ts or None) if n else None}  # ages count to event N
    if bad:
        head["bad_events"] = bad
    detok = None if args.ids else session_detokenizer(s.get("model"))
    return trees, head, detok


def server_trees(args) -> tuple[dict, dict, object]:
    """{pod: PrefixTree} of a server's KV events heard for --duration seconds."""
    if args.at is not None:
        raise KvplayError("--at reads a recorded session; a server's tree is its cache now")
    if not args.duration > 0:
        raise KvplayError(f"--duration {args.duration:g}: give a number of seconds above 0")
    url, key = check_url(args.target), args.api_key or os.environ.get("KVPLAY_API_KEY")
    backend = RemoteBackend(url, key, url_sources(args, url))
    try:
        time.sleep(args.duration)
        with backend.fleet.lock:
            trees = {name: PrefixTree(m.copy().blocks, None, m.version, backend.misses.pod(name).marks())
                     for name, m in backend.fleet.pods.items()}
            states = {name: m.pod_state for name, m in backend.fleet.pods.items()}
        detok = None
        if not args.ids:
            texts: dict = {}

            def detok(ids):  # one /detokenize per label, at most LABEL_TOKENS tokens each
                key = tuple(ids)
                if key not in texts:
                    texts[key] = backend.decode(ids)
                return texts[key]
            for t in trees.values():  # labels while the connection is open
                labels = Labels(detok)
                for node in t.nodes[:4096]:
                    labels(t, node)
        head = {"url": backend.url, "model": backend.model_name, "pods": states}
        return trees, head, (lambda ids: texts.get(tuple(ids), "")) if detok else None
    finally:
        backend.close()


def main(args: argparse.Namespace) -> int:
    if args.children < 1:
        raise KvplayError(f"--children {args.children}: give at least 1")
    url = args.target.startswith(("http://", "https://"))
    if not url and (args.sources or args.replay or args.pod):
        raise KvplayError("--events/--replay/--pod go with a server's URL, not a recorded session")
    trees, head, detok = server_trees(args) if url else session_trees(args)
    labels = Labels(detok)
    now = head.get("at_ts") or time.time()
    if args.json:
        out = dict(head)
        out["pods"] = {str(pod if pod is not None else "local"): to_json(t, labels, args.children, now)
                       for pod, t in trees.items()}
        if url:
            for name in out["pods"]:
                out["pods"][name]["state"] = head["pods"].get(name)
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    where = head.get("session") and f"session {head['session']} after event {head['at']} of {head['events']}"
    print(inert(f"kvplay tree: {where or head['url']} · {head.get('model') or '?'}", limit=1024))  # a server's model id
    if not trees:
        print("(no cached blocks)")
    for pod, t in trees.items():
        if pod is not None:
            state = head["pods"].get(pod) if url else None
            print(inert(f"pod {pod}" + (f" ({state})" if state else ""), limit=1024))
        for line in to_text(t, labels, args.children, now):
            print(line)
    return 0
