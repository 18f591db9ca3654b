"""`kvplay replay ID [--db PATH] [--headless] [--speed X] [--json] [engine flags]`.

Without --headless the turns play in the app (as a script, with the recorded settings changes,
clears and group changes at their turns); with it, sessions/cli_replay.headless re-drives them
through a fresh Engine and compares outputs and cached tokens (see there). The command lives
here, above both, so sessions never imports the app.
"""
from __future__ import annotations

import argparse

from kvplay.engine.options import KvplayError, add_db_arg, add_engine_args, config_from_args
from kvplay.sessions.cli_replay import headless
from kvplay.sessions.query import (resolve_session, session_script, session_turns, session_users, timeline_events,
                                   with_misses)
from kvplay.sessions.store import open_db


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="session id (or a unique prefix)")
    add_db_arg(parser)
    parser.add_argument("--headless", action="store_true", help="replay without the app and compare outputs")
    parser.add_argument("--speed", type=float, default=None,
                        help="submit turns at their recorded pace times X (default: recorded order, as fast as possible)")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn, then a summary (headless)")
    parser.add_argument("--no-record", action="store_true", help="do not record the replay as a new session")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    if args.speed is not None and args.speed <= 0:
        raise KvplayError(f"--speed must be positive (got {args.speed})")
    db = open_db(args.db, create=False)
    try:
        session = resolve_session(db, args.id)
        turns = session_turns(db, session["id"])
        if args.headless:  # the recorded reasons for the computed tokens, compared per turn
            with_misses(db, session["id"], turns)
        users = session_users(db, session["id"])
        # the app replays the session as a script (session_script reads its events itself)
        events = timeline_events(db, session["id"]) if args.headless else []
        script = None if args.headless else session_script(db, session, timed=True)
    finally:
        db.close()
    if not turns:
        raise KvplayError(f"session {session['id']} has no recorded turns to replay")
    config = config_from_args(args, session["engine_config"], where=f"session {session['id']}: engine config")
    if not args.headless:
        from .app import run_app  # start-up time: the app (Textual) loads only when it is asked for

        return int(run_app(config, script.users, script.system, script.turns, speed=args.speed or 1.0,
                           db=args.db, record=not args.no_record,
                           title=f"replay of {session['id']}", replay_of=session["id"]) or 0)
    return headless(args, session, turns, users, events, config)


