"""`kvplay import TRACE [--format auto|vllm|mooncake] [--block-size N] [--num-blocks N]
[--policy P] [--isolation I] [--db PATH]`: record a trace file as a session.

Reads vLLM KV events (JSONL batches as `kvplay export --format vllm-jsonl` writes them, or msgpack
payloads back to back, as captured off vLLM's ZMQ socket) or a Mooncake-style JSONL trace. The
requests become turns, and replaying them through the real scheduler and pool (no model) under
the given settings gives the session's cache events, so `kvplay scrub` and `kvplay simulate`
open it like a recorded one. A bad record: one line naming it and the field, exit 2; the
records before it are still imported.
"""
from __future__ import annotations

import argparse
import sys

from kvplay.engine.config import EVICTION_POLICIES, ISOLATION_MODES
from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import read_trace_file


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="the trace file")
    parser.add_argument("--format", choices=("auto", "vllm", "mooncake"), default="auto")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per hash id of a Mooncake trace (default 16; vLLM events carry their own)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="pool size to replay it in (default: vLLM's peak of resident blocks, or room for two requests)")
    parser.add_argument("--policy", choices=EVICTION_POLICIES, default="lru")
    parser.add_argument("--isolation", choices=ISOLATION_MODES, default="shared")
    parser.add_argument("--title", default=None)
    add_db_arg(parser)


def main(args: argparse.Namespace) -> int:
    if args.block_size <= 0 or (args.num_blocks is not None and args.num_blocks <= 0):
        raise KvplayError("--block-size and --num-blocks must be positive")
    read = read_trace_file(args.trace, args.format, args.block_size, args.num_blocks, args.policy, args.isolation)
    # Lazy, the command boundary: the import replays the trace through the simulator, whose import
    # (the engine's scheduler: torch, transformers) takes 2.4 s niced on the 2-core machine.
    from kvplay.sessions.simulate import import_trace

    db = open_db(args.db)
    try:
        sid = import_trace(db, read, args.title)
    finally:
        db.close()
    t = read.trace
    print(f"imported {len(t.requests)} requests ({read.records} {read.format} records) from {args.trace} as session "
          f"{sid}: {t.config.num_blocks} blocks of {t.config.block_size} tokens, {t.config.eviction}, "
          f"isolation {t.config.isolation}")
    if read.error:
        print(f"kvplay: error: {inert(read.error)} (imported the records before it)", file=sys.stderr)
        return 2
    return 0
