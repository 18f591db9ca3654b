"""`kvplay screenshot OUT.svg`: play a script headless in the real app and save an SVG.

Uses the same KvplayApp as `kvplay`, driven by Textual's headless test harness
(tui/screenshot.py); it waits until every turn has finished and the map has caught up, then
exports the screen.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvplay.options import KvplayError, add_engine_args, check_output_file, config_from_args
from kvplay.sessions.script import load_script, parse_script
from kvplay.tui.app import KvplayApp
from kvplay.tui.demo import DEMO_TOML
from kvplay.tui.lifecycle import run_until_done
from kvplay.tui.screenshot import take_screenshot


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise KvplayError(f"--size must look like 160x48 (got {text!r})") from None
    if w < 80 or h < 24:
        raise KvplayError(f"--size {text}: the app needs at least 80x24")
    return w, h


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="the SVG file to write")
    parser.add_argument("--script", default=None, help="TOML script to play (default: a built-in three-user demo)")
    parser.add_argument("--size", default="160x48", help="terminal size, WIDTHxHEIGHT (default 160x48)")
    parser.add_argument("--speed", type=float, default=0.0,
                        help="pace of turns with `at` (default 0: as fast as possible)")
    parser.add_argument("--show-events", action="store_true", help="show the event log panel")
    parser.add_argument("--select-block", type=int, default=None, metavar="N",
                        help="show the details of block N under the map")
    parser.add_argument("--title", default=None, help="subtitle shown in the header")
    parser.add_argument("--tree", action="store_true",
                        help="show the prefix tree (ctrl+r) with its first node open and its second branch selected")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    script = load_script(args.script) if args.script else parse_script(DEMO_TOML, "built-in demo")
    config = config_from_args(args, script.engine)
    size = parse_size(args.size)
    out = Path(args.out)
    if out.suffix.lower() != ".svg":
        out = out.with_suffix(".svg")
    check_output_file(str(out), "OUT")  # before minutes of play, and no folders made
    print(f"kvplay: playing {len(script.turns)} turns of {script.path or 'the built-in demo'} "
          f"on {config.model} at {size[0]}x{size[1]} …", file=sys.stderr)
    app = KvplayApp(config, script.users, script.system, turns=script.turns, speed=args.speed,
                    record=False, title=args.title)
    run_until_done(take_screenshot(app, out, size, args.timeout, args.show_events, args.select_block, tree=args.tree))
    print(f"kvplay: saved {out}", file=sys.stderr)
    return 0
