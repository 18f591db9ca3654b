"""`kvplay` (no arguments) / `kvplay app`: open the multi-user playground."""
from __future__ import annotations

import argparse

from kvplay.options import KvplayError, add_db_arg, add_engine_args, config_from_args
from kvplay.sessions.script import UserSpec, load_script
from kvplay.sessions.store import open_db
from kvplay.tui.app import run_app


def parse_users(text: str) -> list[UserSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise KvplayError("--users needs at least one name, e.g. --users alice,bob,carol")
    if len(set(names)) != len(names):
        raise KvplayError(f"--users: duplicate names in {text!r}")
    if len(names) > 9:
        raise KvplayError("--users: at most 9 panes fit on one screen")
    return [UserSpec(n) for n in names]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", default=None, help="comma-separated user names (default alice,bob,carol)")
    parser.add_argument("--system", default=None, help="the shared system prompt")
    parser.add_argument("--script", default=None, metavar="FILE",
                        help="a TOML script whose turns play through the panes (F11 pause, F12 step)")
    parser.add_argument("--speed", type=float, default=1.0, help="script pace multiplier (default 1)")
    add_db_arg(parser)
    parser.add_argument("--no-record", dest="record", action="store_false", help="do not record this session")
    add_engine_args(parser)


# The playground's default: long enough (~130 tokens, 8 blocks) that the second user's reuse of
# the first user's blocks is plain to see in the map and the badge.
APP_SYSTEM = (
    "You are Tern, the assistant of a small seaside bookshop and café called The Tern's Nest. "
    "The shop sells new and second-hand books, maps and nautical charts, and the café serves coffee, "
    "tea and cakes baked every morning. Opening hours: Tuesday to Sunday, 9 am to 6 pm; closed on "
    "Mondays. Answer customers in two or three friendly sentences. If you do not know something, "
    "say so plainly and suggest asking at the counter. Never invent prices, stock levels or events."
)


def main(args: argparse.Namespace) -> int:
    base, turns, system = {}, None, APP_SYSTEM
    users = parse_users(args.users or "alice,bob,carol")
    if args.script:
        script = load_script(args.script)
        base, turns, system = script.engine, script.turns, script.system
        if not args.users:
            users = script.users
    if args.system:
        system = args.system
    config = config_from_args(args, base)
    if args.record:  # a DB that cannot record is one line now, not a warning at the first message

        open_db(args.db).close()
    return run_app(config, users, system, turns=turns, speed=args.speed, db=args.db, record=args.record)
