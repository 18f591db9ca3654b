"""`kvplay scrub SESSION_ID [--db PATH] [--at N] [--screenshot OUT.svg] [--size WxH]`: open a
recorded session in the scrubber (no model is loaded). With --screenshot, render it headless
at event N (default: the end) and save an SVG instead."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvplay.commands.screenshot import parse_size
from kvplay.options import KvplayError, add_db_arg, check_output_file
from kvplay.sessions.history import load_recording, turn_ends
from kvplay.sessions.store import open_db

from kvplay.tui.lifecycle import run_app, run_until_done
from kvplay.tui.screenshot import save_svg
from kvplay.tui.scrub import ScrubApp


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="session id (or a unique prefix)")
    add_db_arg(parser)
    parser.add_argument("--at", type=int, default=None, metavar="N", help="start with the cursor after event N")
    parser.add_argument("--turn", type=int, default=None, metavar="K", help="start with the cursor after turn K")
    parser.add_argument("--screenshot", default=None, metavar="OUT.svg", help="save an SVG headless and exit")
    parser.add_argument("--size", default="160x48", help="terminal size for --screenshot (default 160x48)")


def load(db_path: str | None, ident: str):
    db = open_db(db_path, create=False)
    try:
        return load_recording(db, ident)
    finally:
        db.close()


def main(args: argparse.Namespace) -> int:
    rec = load(args.db, args.id)
    cursor = args.at
    if args.turn is not None:
        ends = turn_ends(rec)
        if not 1 <= args.turn <= len(ends):
            raise KvplayError(f"--turn {args.turn}: session {rec.id} has turns 1 to {len(ends)}")
        cursor = ends[args.turn - 1]
    if cursor is not None and not 0 <= cursor <= len(rec.events):
        raise KvplayError(f"--at {cursor}: session {rec.id} has events 0 to {len(rec.events)}")
    app = ScrubApp(rec, cursor)
    if args.screenshot:
        check_output_file(args.screenshot, "--screenshot", ".svg")
        out = run_until_done(save_svg(app, Path(args.screenshot), parse_size(args.size)))
        print(f"kvplay: saved {out}", file=sys.stderr)
        return 0
    run_app(app)
    return 0
