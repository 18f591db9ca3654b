"""`kvplay run SCRIPT.toml [--json] [engine flags] [--db PATH] [--no-record]`: play a script headless
through one Engine and report, per finished turn, how much of the prompt came from the cache
and whose blocks it was (sessions/headless.py). Records the session in the sessions DB unless
--no-record.

Exit code: 0 every turn ok, 1 some turn failed, 2 bad input (one line, no traceback).
"""
from __future__ import annotations

import argparse

from kvplay.options import KvplayError, add_db_arg, add_engine_args, config_from_args
from kvplay.sessions.headless import print_summary, run_script
from kvplay.sessions.report import console, print_json
from kvplay.sessions.script import load_script


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="TOML script ([engine], [system], [[users]], [[turns]])")
    parser.add_argument("--json", action="store_true", help="one JSON object per finished turn, then a summary")
    add_db_arg(parser)
    parser.add_argument("--no-record", action="store_true", help="do not record this run in the sessions DB")
    parser.add_argument("--speed", type=float, default=1.0, help="divide every turn's `at` offset by X")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise KvplayError(f"--speed must be positive (got {args.speed})")
    script = load_script(args.script)
    config = config_from_args(args, script.engine, where=f"{args.script}: [engine]")
    summ = run_script(script, config, args.db, record=not args.no_record, as_json=args.json, speed=args.speed)
    if args.json:
        print_json(summ)
    else:
        print_summary(console(), summ)
    return 1 if summ["failed"] else 0
