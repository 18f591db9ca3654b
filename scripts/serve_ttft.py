#!/usr/bin/env python
"""Client-side TTFT of `kvplay serve` under 1, 8 and 32 concurrent streaming clients.

Starts the server on loopback as `kvplay serve` runs it (the HTTP server in this process, the
engine in its engine-core process; `--in-process-engine`: both here), then for each concurrency
C runs rounds of C clients that start together, each streaming one chat turn (a shared system prompt + its own question, `max_tokens` tokens). TTFT is measured
by the client: from sending the request to the first content chunk. Prints one JSON line per
concurrency and a table.

    .venv/bin/python scripts/serve_ttft.py [--model default] [--concurrency 1,8,32]
        [--requests 32] [--max-tokens 16] [--threads N] [--timeout 600] [--in-process-engine]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

SYSTEM = ("You are a helpful assistant for a team of engineers. Answer briefly and precisely, "
          "prefer concrete numbers, and say when you do not know. ") * 4


def one(url: str, i: int, max_tokens: int, out: list, deadline: float) -> None:
    import httpx

    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Question {i}: what is a KV cache block?"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "user": f"user{i % 8}"}
    ttft = None
    usage = kv = None
    try:
        # the client is built first: httpx.Client() loads an SSL context (~50 ms), not the server's time
        with httpx.Client(timeout=max(1.0, deadline - time.monotonic())) as c:
            t0 = time.perf_counter()
            with c.stream("POST", url + "/v1/chat/completions", json=body) as s:
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if ttft is None and obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
                        ttft = (time.perf_counter() - t0) * 1000
                    if obj.get("usage"):
                        usage, kv = obj["usage"], obj.get("kvplay")
        out.append({"ok": usage is not None, "ttft_ms": ttft, "usage": usage, "server_ttft_ms": (kv or {}).get("ttft_ms")})
    except Exception as exc:  # counted as not completed
        out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level (rounded up to whole rounds)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-running", type=int, default=None)
    ap.add_argument("--in-process-engine", action="store_true", help="run the engine in this process")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds in all")
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout

    from kvplay.bench.metrics import percentile
    from kvplay.engine.config import EngineConfig
    from kvplay.serve.core_client import RemoteSide
    from kvplay.serve.core_proc import CoreParams, build_side
    from kvplay.serve.server import ServerThread, state_for

    cfg = EngineConfig(model=args.model, threads=args.threads)
    if args.max_running:
        cfg.max_running = args.max_running
    params = CoreParams(cfg.validate())
    engine = None
    if args.in_process_engine:
        engine, _, side = build_side(params)
    else:
        side = RemoteSide(params)
    srv = ServerThread(state_for(side)).start()
    rows = []
    try:
        warm: list = []
        one(srv.url, 999, 2, warm, deadline)  # first request: tokenizer/template warm-up, not counted
        for conc in [int(x) for x in args.concurrency.split(",")]:
            rounds = max(1, -(-args.requests // conc))
            results: list = []
            t0 = time.perf_counter()
            for r in range(rounds):
                if time.monotonic() > deadline:
                    break
                threads = [threading.Thread(target=one, args=(srv.url, r * conc + i, args.max_tokens, results, deadline))
                           for i in range(conc)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()))
                print(f"serve_ttft: concurrency {conc}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
            wall = time.perf_counter() - t0
            ok = [x for x in results if x["ok"] and x["ttft_ms"] is not None]
            ttfts = [x["ttft_ms"] for x in ok]
            row = {"concurrency": conc, "requests": rounds * conc, "completed": len(ok),
                   "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
                   "ttft_p95_ms": round(percentile(ttfts, 95), 1) if ttfts else None,
                   "server_ttft_p50_ms": round(statistics.median([x["server_ttft_ms"] for x in ok]), 1) if ok else None,
                   "cached_tokens_mean": round(statistics.mean([x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in ok]), 1) if ok else None,
                   "prompt_tokens": ok[0]["usage"]["prompt_tokens"] if ok else None,
                   "output_tok_s": round(sum(x["usage"]["completion_tokens"] for x in ok) / wall, 1),
                   "wall_s": round(wall, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        srv.stop()
        side.close()
        if engine is not None:
            engine.shutdown()
    print(f"\nmodel {side.model_name}, {args.max_tokens} tokens per reply, client-side TTFT (ms)")
    print(f"{'clients':>8} {'done':>9} {'p50':>8} {'p95':>8} {'tok/s':>7}")
    for r in rows:
        print(f"{r['concurrency']:>8} {str(r['completed']) + '/' + str(r['requests']):>9} {r['ttft_p50_ms']!s:>8} "
              f"{r['ttft_p95_ms']!s:>8} {r['output_tok_s']:>7}")
    return 0 if all(r["completed"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
