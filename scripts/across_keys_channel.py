#!/usr/bin/env python
"""Is explaining misses across keys a time channel? `kvplay audit` against `kvplay serve` with two
API keys in two organisations, per-key isolation, once with --explain-across-keys and once
without (the default).

Under isolation a hit probe shares nothing cached with the victim, so it should time as the A/A
control (the victim sends first too, the attacker's prompt unrelated). The explanation walks as
far as another key's identical prefix goes when it may look across keys; this script prints,
for each setting, the median attacker time of hits, controls and misses and the ROC AUC of
"controls slower than hits" with its interval (0.5: no channel; below: hits slower).

Runs in-process on 127.0.0.1 (`kvplay serve`'s HTTP app and engine in this process), on the
tiny random-init model by default (`--model`; a real one makes each probe longer and the
same extra work harder to see).

    .venv/bin/python scripts/across_keys_channel.py [--probes 30] [--letters 1000] [--model tiny:llama]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvplay.engine.config import EngineConfig
from kvplay.labs import audit, stats
from kvplay.serve.keys import load_keys
from kvplay.serve.server import ServerThread, build_state, close_state
from kvplay.sessions.headless import start_engine

KEYS = """
[[keys]]
key = "sk-attacker-0123456789"
user = "mallory"
group = "org-a"
[[keys]]
key = "sk-victim-0123456789"
user = "victor"
group = "org-b"
"""


def measure(across: bool, a, tmp: Path) -> dict:
    keys_file = tmp / "keys.toml"
    keys_file.write_text(KEYS)
    keys = load_keys(str(keys_file))
    engine = start_engine(EngineConfig(model=a.model, num_blocks=a.num_blocks, isolation="user"))
    state = build_state(engine, keys, explain_across_keys=across)
    srv = ServerThread(state).start()
    try:
        p = audit.AuditParams(url=srv.url, levels=["global"], probes=a.probes, prompt_length=a.letters, delay=0.0,
                              control=True, seed=a.seed)
        r = audit.execute(p, ["sk-attacker-0123456789", "sk-victim-0123456789"], str(tmp / f"audit-{across}.db"))
    finally:
        srv.stop()
        close_state(state)
        engine.shutdown()
    g = r.data["groups"][0]
    hit, ctl, miss = g["client"]["samples"]["hit"], g["control"]["samples"]["hit"], g["client"]["samples"]["miss"]
    auc, lo, hi = stats.auc_ci(ctl, hit, level=0.95)
    return {"hit": statistics.median(hit), "control": statistics.median(ctl), "miss": statistics.median(miss),
            "auc": auc, "lo": lo, "hi": hi, "cached_flags": g["cached"]["hits_flagged"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--letters", type=int, default=1000)
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for across in (True, False):
            m = measure(across, a, Path(d))
            flag = "--explain-across-keys" if across else "default (own keys only)"
            print(f"{flag:26s} median ms: hit {m['hit']:.2f}  control {m['control']:.2f}  miss {m['miss']:.2f}; "
                  f"AUC control>hit {m['auc']:.2f} {stats.interval(m['lo'], m['hi'])}; "
                  f"hits reporting cached tokens: {m['cached_flags']}", flush=True)


if __name__ == "__main__":
    main()
