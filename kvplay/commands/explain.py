"""`kvplay explain SESSION_ID|TRACE [--json] [--plot OUT.png|OUT.svg] [--top N] [--db PATH]`.

Why the prompt tokens of a recorded session (or a trace file: vLLM KV events, Mooncake JSONL)
missed the cache, the cache breakers, who evicted whom, what isolation cost, and the hit rate
each fix would give, every projection simulated on the same trace (sessions/explain.py). A
session of kvplay's own engine uses the reasons its engine recorded per turn; anything else
gets them from the simulator (the engine's scheduler and pool, no model).
"""
from __future__ import annotations

import argparse
import sys

from rich.text import Text

from kvplay.commands.simulate import load_source
from kvplay.engine.miss import REASONS
from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg, check_output_file, pyplot, save_plot
from kvplay.sessions.query import resolve_session, session_turns, with_misses
from kvplay.sessions.report import console, print_json
from kvplay.sessions.store import open_db
from kvplay.sessions.tokenizer import session_detokenizer


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SESSION_ID|TRACE", help="a recorded session (id or unique prefix) or a trace file")
    parser.add_argument("--json", action="store_true", help="the whole report as one JSON object")
    parser.add_argument("--plot", metavar="OUT.png|OUT.svg", default=None,
                        help="save missed tokens by reason per turn, and the hit rate each fix would give")
    parser.add_argument("--top", type=int, default=3, help="cache breakers to report and simulate (default 3)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per hash id of a Mooncake trace file (default 16)")
    add_db_arg(parser)


def _session_side(source: str, db_path: str | None, trace) -> tuple[dict, dict, object]:
    """(request id -> recorded miss object, request id -> turn seq, detokenizer) of a session."""
    if not trace.source.startswith("session "):
        return {}, {}, None

    db = open_db(db_path, create=False)
    try:
        session = resolve_session(db, source)
        turns = with_misses(db, session["id"], session_turns(db, session["id"]))
    finally:
        db.close()
    rec = {t["request_id"]: t["miss"] for t in turns if t.get("request_id") and t.get("miss")}
    return rec, {t["request_id"]: t["seq"] for t in turns if t.get("request_id")}, \
        session_detokenizer(session.get("model"))


def main(args: argparse.Namespace) -> int:
    if args.plot and not args.plot.lower().endswith((".png", ".svg")):
        raise KvplayError(f"--plot {args.plot!r}: give a .png or .svg file name")
    check_output_file(args.plot, "--plot")
    if args.top < 0:
        raise KvplayError(f"--top must be 0 or more (got {args.top})")
    if args.block_size <= 0:
        raise KvplayError(f"--block-size must be positive (got {args.block_size})")
    trace, bad = load_source(args.source, args.db, args.block_size)
    recorded, numbers, detok = _session_side(args.source, args.db, trace)
    # Lazy, the command boundary: the explanation replays the trace through the simulator, whose
    # import (the engine's scheduler: torch, transformers) takes 2.4 s niced on the 2-core machine.
    from kvplay.sessions.explain import explain, figure

    report = explain(trace, recorded, numbers, detok, top=args.top)
    if args.json:
        print_json(report)
    else:
        print_report(report)
    if args.plot:
        plt = pyplot()
        fig = figure(report, plt)
        save_plot(lambda p: fig.savefig(p, dpi=110), args.plot)
        plt.close(fig)
    if bad:
        print(f"kvplay: error: {bad} (explained the records before it)", file=sys.stderr)
        return 2
    return 0


def _pct(x: float) -> str:
    return f"{x:.1%}".replace("%", " %")


def print_report(r: dict) -> None:
    con = console()

    def say(text: str = "") -> None:  # users' text and names: shown, never obeyed (kvplay/inert.py)
        con.print(Text(inert(text, limit=8192)), highlight=False)

    how = {"recorded": "the reasons its engine recorded", "simulated": "reasons from the simulator",
           "mixed": "recorded reasons, simulated where none was recorded"}[r["attribution"]]
    say(f"{r['source']}: {r['requests']} requests, {r['prompt_tokens']:,} prompt tokens, {r['cached_tokens']:,} "
        f"from the cache ({_pct(r['hit_rate'])}); {how}")
    m = r["missed"]
    parts = [f"{n:,} {k}" for k, n in sorted(m["reasons"].items(), key=lambda kv: (-kv[1], REASONS.index(kv[0]))) if n]
    say(f"missed {m['tokens']:,} tokens: " + (", ".join(parts) or "none"))
    own = r.get("own_keys")
    if own:  # a keyed server's turns: explained without looking across keys, renamed from the simulation
        found = (f"{own['tokens']:,} of their cold tokens were held under another key in {own['renamed_turns']} "
                 "of them, counted above as the simulation names them") if own["tokens"] else \
            "none of their cold tokens was held under another key"
        say(f"  ({own['turns']} turns were explained from their sender's own keys, as a keyed server does; "
            f"in the simulation of the same trace {found})")
    base = r["simulated_hit_rate"]
    say(f"projections (each a simulation of the same trace; as recorded it gives {_pct(base)}):")
    if r["breakers"]:
        say("cache breakers (prompts diverge here from an otherwise shared prefix):")
    for i, b in enumerate(r["breakers"], 1):
        vs = " | ".join(f"{v['text']!r} x{v['count']}" for v in b["variants"])
        more = f" | … {b['more_variants']} more" if b["more_variants"] else ""
        say(f"  {i}. at token {b['at']} in {b['requests']} prompts, {b['tokens']:,} tokens computed after it: "
            f"{b['before']!r} [{vs}{more}] {b['after']!r}")
        say(f"     removed (every prompt gets {b['variants'][0]['text']!r}): {_pct(base)} -> "
            f"{_pct(b['projected_hit_rate'])} ({b['projected_gain_tokens']:+,} tokens from the cache)")
    ev = r["evictions"]
    if ev["tokens"]:
        who = ", ".join(f"{e['evictor']} evicted {e['victim']}'s {e['tokens']:,}" for e in ev["by"][:6])
        say(f"evictions: {ev['tokens']:,} tokens ({who})")
        for p in ev["projected"]:
            never = " (never evicts)" if p["never_evicts"] else ""
            say(f"     a pool of {p['num_blocks']:,} blocks{never}: {_pct(base)} -> {_pct(p['hit_rate'])}")
    iso = r["isolation"]
    if iso["tokens"]:
        who = ", ".join(f"{e['user']} would have hit {e['from']}'s {e['tokens']:,}" for e in iso["from"][:6])
        say(f"isolation ({iso['mode']}): {iso['tokens']:,} tokens ({who})")
        say(f"     shared isolation: {_pct(base)} -> {_pct(iso['projected']['hit_rate'])}")
    cl = r["clears"]
    if cl["tokens"]:
        say(f"clears and reconfigures: {cl['tokens']:,} tokens"
            + (f"; without them: {_pct(base)} -> {_pct(cl['projected']['hit_rate'])}" if cl["projected"] else ""))
    if not (r["breakers"] or ev["tokens"] or iso["tokens"] or cl["tokens"]):
        say("  nothing to fix: every miss was a first use (cold), a divergence without a breaker, or a tail")
