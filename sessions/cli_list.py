"""`kvplay sessions [--db PATH] [--json] [--limit N]`: list recorded sessions, newest first."""
from __future__ import annotations

import argparse
import datetime as dt

from kvplay.options import add_db_arg

from .query import list_sessions
from .report import console, print_json
from .store import open_db, resolve_path


def configure(parser: argparse.ArgumentParser) -> None:
    add_db_arg(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per session")
    parser.add_argument("--limit", type=int, default=None, help="show at most N sessions")


def when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def hit_rate(row: dict) -> float | None:
    return (row["cached"] or 0) / row["prompt"] if row.get("prompt") else None


def main(args: argparse.Namespace) -> int:
    # start-up time: imported when this first runs
    from rich.table import Table

    path = resolve_path(args.db)
    if not path.exists():
        if not args.json:
            print(f"no sessions recorded yet ({path} does not exist)")
        return 0
    db = open_db(path, create=False)
    try:
        rows = list_sessions(db, args.limit)
    finally:
        db.close()
    # an app opened and closed without a turn recorded nothing worth listing (older kvplay wrote them)
    empty = sum(1 for r in rows if r["source"] == "app" and not r["turns"])
    rows = [r for r in rows if not (r["source"] == "app" and not r["turns"])]
    if args.json:
        for r in rows:
            print_json({"id": r["id"], "created": r["created"], "ended": r["ended"], "source": r["source"],
                        "model": r["model"], "users": r["users"], "turns": r["turns"], "hit_rate": hit_rate(r),
                        "replay_of": r["replay_of"], "script": r["script_path"]})
        return 0
    if not rows:
        print(f"no sessions recorded yet in {path}")
        return 0
    hidden = f" ({empty} app session{'s' if empty != 1 else ''} without turns not shown)" if empty else ""
    table = Table(title=f"sessions in {path}{hidden}", header_style="bold")
    for name, kw in [("id", {"no_wrap": True}), ("when", {"no_wrap": True}), ("source", {}), ("model", {"no_wrap": True}),
                     ("users", {"justify": "right"}), ("turns", {"justify": "right"}),
                     ("hit rate", {"justify": "right"}), ("note", {"no_wrap": True})]:
        table.add_column(name, **kw)
    for r in rows:
        hr = hit_rate(r)
        note = []
        if r["ended"] is None:
            note.append("unfinished")
        if r["replay_of"]:
            note.append(f"replay of {r['replay_of'][:10]}")
        table.add_row(r["id"], when(r["created"]), r["source"], r["model"] or "-", str(r["users"]), str(r["turns"]),
                      "-" if hr is None else f"{hr:.1%}", ", ".join(note))
    console().print(table)
    return 0
