"""`kvplay show ID [--db PATH] [--json]`: one recorded session (id or unique prefix).

What the session recorded (prompts, replies, names, the model, paths) is shown inert
(kvplay/inert.py), as `Text`: never parsed as markup."""
from __future__ import annotations

import argparse
import json

from rich.table import Table
from rich.text import Text

from kvplay.inert import inert
from kvplay.options import add_db_arg
from kvplay.sessions.query import load_session
from kvplay.sessions.report import cached_cell, computed_cell, console, excerpt, fmt_num, human_bytes, print_json, when
from kvplay.sessions.store import open_db


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="session id (or a unique prefix)")
    add_db_arg(parser)
    parser.add_argument("--json", action="store_true", help="the session, its users and turns as one JSON object")
    parser.add_argument("--events", action="store_true", help="also list the recorded cache events")


def main(args: argparse.Namespace) -> int:
    db = open_db(args.db, create=False)
    try:
        s = load_session(db, args.id, args.events)
    finally:
        db.close()
    if args.json:
        print_json(s)
        return 0
    con = console()
    cfg = s["engine_config"]
    con.print(Text.assemble((f"session {inert(s['id'])}", "bold"), f"  {inert(s['source'])}  {inert(s['model'])}  "
                            f"{when(s['created'])} → {when(s['ended']) if s['ended'] else 'unfinished'}"), highlight=False)
    con.print(Text("engine: " + ", ".join(f"{k}={inert(v)}" for k, v in cfg.items() if v is not None)), highlight=False)
    st = s.get("stats") or {}
    if st:
        con.print(f"at the end: hit rate {st.get('hit_rate', 0):.1%}, {st.get('blocks_cached')} cached / "
                  f"{st.get('blocks_total')} blocks, evictions {st.get('evictions')}, preemptions "
                  f"{st.get('preemptions')}, saved {human_bytes(st.get('bytes_saved'))} vs a cache per user",
                  highlight=False)
    if s.get("dropped_events"):
        con.print(f"[yellow]the recorder dropped {s['dropped_events']:,} events it could not keep up with: "
                  "the cache history of this session is incomplete[/yellow]", highlight=False)
    if s.get("bad_events"):
        con.print(f"[yellow]{s['bad_events']:,} recorded events were damaged and skipped[/yellow]", highlight=False)
    if s.get("replay_of"):
        con.print(Text(f"replay of {inert(s['replay_of'])}"), highlight=False)
    if s.get("script_path"):
        con.print(Text(f"script: {inert(s['script_path'])}"), highlight=False)
    con.print(Text(f"system prompt: {excerpt(s['system_prompt'] or '', 100)}"), highlight=False)
    con.print(Text("users: " + ", ".join(f"{inert(u['name'], limit=64)} (seed {u['seed']}"
                                         + (f", group {inert(u['group'], limit=64)}" if u.get("group") else "") + ")"
                                         for u in s["users"])), highlight=False)
    table = Table(header_style="bold")
    for name in ("#", "user", "text", "prompt", "cached", "computed", "TTFT ms", "tok/s", "reply"):
        table.add_column(name, no_wrap=name in ("cached", "computed"))
    for t in s["turns"]:
        cached = cached_cell(t["cached_tokens"], None, t["cached_from"], t["user"])
        reply = Text(f"error: {excerpt(t['error'], 200)}", style="red") if t.get("error") else Text(excerpt(t["reply"], 48))
        table.add_row(str(t["seq"]), Text(inert(t["user"], limit=64)), Text(excerpt(t["text"], 30)),
                      fmt_num(t["prompt_tokens"]), Text(cached),
                      Text(computed_cell(t["computed_tokens"], t.get("miss"), t["user"])), fmt_num(t["ttft_ms"]),
                      fmt_num(t["decode_tok_s"]), reply)
    con.print(table)
    if "events" in s:
        for e in s["events"]:
            con.print(Text(json.dumps(e)), highlight=False)  # ASCII: JSON escapes what it quotes
    else:
        con.print(f"{s['event_count']} engine events recorded (--events to list them)", highlight=False)
    return 0
