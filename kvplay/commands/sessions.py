"""`kvplay sessions [--db PATH] [--json] [--limit N]`: list recorded sessions, newest first; what
they recorded (titles, models, paths) is shown inert (kvplay/inert.py), as Text cells."""
from __future__ import annotations

import argparse
import datetime as dt
import os

from rich.table import Table
from rich.text import Text

from kvplay.inert import inert
from kvplay.options import add_db_arg

from kvplay.sessions.query import list_sessions
from kvplay.sessions.report import console, print_json
from kvplay.sessions.store import open_db, resolve_path


def configure(parser: argparse.ArgumentParser) -> None:
    add_db_arg(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per session")
    parser.add_argument("--limit", type=int, default=None, help="show at most N sessions")


def hit_rate(row: dict) -> float | None:
    return (row["cached"] or 0) / row["prompt"] if row.get("prompt") else None


def main(args: argparse.Namespace) -> int:
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
    con = console()
    piped = not con.is_terminal
    if piped:  # every cell whole (ids to copy, paths to grep): as wide as the longest row needs
        con = console(width=10_000)
    con.print(table_of(rows, inert(f"sessions in {path}{hidden}"), None if piped else con.width))
    return 0


def note_of(r: dict) -> str:
    """What tells sessions apart: the script a run played, the title, a replay's original,
    an unfinished recording."""
    note = []
    if r.get("script_path"):
        note.append(os.path.splitext(os.path.basename(r["script_path"]))[0])  # examples/x.toml: x
    elif r.get("title"):
        note.append(r["title"])
    if r["replay_of"]:
        note.append(f"replay of {r['replay_of']}")
    if r["ended"] is None:
        note.append("unfinished")
    return ", ".join(note)


def table_of(rows: list[dict], title: str, width: int | None):
    """Ids, times and numbers never shrink (an 80-column terminal still shows whole ids and hit
    rates); in `width` columns the model loses its org/ prefix, then what the session is (source
    and note: a run's script) and the model give way with an ellipsis, the model first (under
    ~90 columns it is left out). `width` None (piped): every cell whole."""
    cells = []
    for r in rows:
        hr = hit_rate(r)
        model = inert(r["model"] or "-", limit=256)
        what = inert(" ".join(x for x in (r["source"], note_of(r)) if x), limit=256)
        cells.append([r["id"], short_when(r["created"]), str(r["users"]), str(r["turns"]),
                      "-" if hr is None else f"{hr:.1%}", what, model if width is None else model.rsplit("/", 1)[-1]])
    names = ["id", "when", "users", "turns", "hit", "what", "model"]
    widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, name in enumerate(names)]
    if width is not None:
        room = max(16, width - sum(widths[:5]) - len(names))  # one space after each column
        if room < 28:  # 80 columns: the model (mostly the same one) goes, what the session is stays
            names, widths, cells = names[:6], widths[:6], [c[:6] for c in cells]
            widths[5] = min(widths[5], room + 1)
        else:
            model = min(widths[6], max(8, room // 3))
            widths[5] = min(widths[5], room - model)
            widths[6] = min(widths[6], room - widths[5])
    table = Table(title=Text(title, style="table.title"), header_style="bold underline", box=None,
                  padding=(0, 1, 0, 0), title_justify="left")
    for i, name in enumerate(names):
        table.add_column(name, no_wrap=True, overflow="ellipsis", width=widths[i], justify="right" if 2 <= i <= 4 else "left")
    for c in cells:
        table.add_row(*map(Text, c))
    return table


def short_when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%m-%d %H:%M")
