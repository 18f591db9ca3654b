"""`kvplay replay ID [--db PATH] [--headless] [--speed X] [--json] [--no-record] [engine flags]`.

Without --headless the turns play in the app (as a script, with the recorded settings changes,
clears and group changes at their turns). With it, the recorded turns are re-driven through a
fresh Engine (sessions/replay.py), making the recorded engine changes again before the turns
that followed them, and each turn prints equal or differs (first differing token and its
position) and cached tokens then vs now, with whether they, their creators and the reasons for
the computed tokens match (engine/miss.py; a difference in reasons shows both); the replay is
recorded as a new session (replay_of = ID) unless --no-record.

A session reproduces when every turn's output and cache match (outputs alone when its turns
overlapped: then arrival order decides who computes a shared block). Exit code 1 when a session
recorded in deterministic mode no longer gives the same outputs (or a turn fails), else 0:
cached tokens also depend on timing where turns overlapped (`at`).
"""
from __future__ import annotations

import argparse
import time

from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvplay.inert import inert
from kvplay.engine.miss import miss_text
from kvplay.options import KvplayError, add_db_arg, add_engine_args, config_from_args
from kvplay.sessions.headless import start_engine
from kvplay.sessions.query import (resolve_session, session_script, session_turns, session_users,
                                   settings_timeline, timeline_events, with_misses)
from kvplay.sessions.recorder import Recorder, close_run
from kvplay.sessions.replay import replay, replay_summary
from kvplay.sessions.report import console, excerpt, fmt_num, print_json
from kvplay.sessions.store import open_db
from kvplay.tui.app import run_app


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
        return int(run_app(config, script.users, script.system, script.turns, speed=args.speed or 1.0,
                           db=args.db, record=not args.no_record,
                           title=f"replay of {session['id']}", replay_of=session["id"]) or 0)
    return headless(args, session, turns, users, events, config)


def _row(c) -> list:
    """A compared turn's cells: Text, so what the turn quotes is shown inert, never parsed."""
    if c.error:
        verdict = Text(f"error: {excerpt(c.error, 200)}", style="red")
    elif c.equal:
        verdict = Text("equal", style="green")
    else:
        verdict = Text.assemble(("differs", "yellow"), f" at token {c.first_diff}: {inert(repr(c.then_token), limit=64)}"
                                f" → {inert(repr(c.now_token), limit=64)}")
    cached = f"{fmt_num(c.cached_then)} → {fmt_num(c.cached_now)}"
    if not c.error and not c.miss_equal:
        cached += f" (missed {inert(miss_text(c.miss_then, c.user))} → {inert(miss_text(c.miss_now, c.user))})"
    cached = Text(cached)
    if not c.error and not c.cache_equal:
        cached = Text(f"{cached} differs", style="yellow")
    return [str(c.seq), Text(inert(c.user, limit=64)), Text(excerpt(c.text, 28)), verdict, cached,
            f"{fmt_num(c.ttft_then)} → {fmt_num(c.ttft_now)}", Text(excerpt(c.now_reply or "", 36))]


def headless(args, session: dict, turns: list[dict], users: list[dict], events: list[dict], config) -> int:
    """Re-drive the recorded turns through a fresh Engine: a table (or JSON lines) of the
    comparisons as they finish, then the verdict."""
    recorded_det = bool(session["engine_config"].get("deterministic"))
    engine = start_engine(config)
    rec = None
    comps = []
    t0 = time.perf_counter()
    try:
        if not args.no_record:
            rec = Recorder.open(args.db, config, engine.model_name, "replay", session.get("system_prompt") or "",
                                script_path=session.get("script_path"), replay_of=session["id"])
            rec.attach(engine)
            for u in users:
                rec.add_user(u["name"], group=u["group"], colour=u["colour"], seed=u["seed"],
                             temperature=u["temperature"], max_tokens=u["max_tokens"], top_p=u["top_p"], top_k=u["top_k"])
        groups, changes = settings_timeline(users, turns, events)
        it = replay(engine, turns, session.get("system_prompt") or "", groups, args.speed, rec, changes)
        if args.json:
            for c in it:
                comps.append(c)
                print_json(c.to_dict())
        else:
            con = console()
            table = Table(title=Text(f"replay of {inert(session['id'])} ({inert(session['model'])})"), header_style="bold")
            for name in ("#", "user", "text", "output", "cached then → now", "TTFT ms then → now", "reply now"):
                table.add_column(name, no_wrap=name.startswith("cached"))
            with Live(table, console=con, auto_refresh=False) as live:
                for c in it:
                    comps.append(c)
                    table.add_row(*_row(c))
                    live.refresh()
            con.print()
    finally:
        close_run(rec, engine)
    strict = recorded_det and config.deterministic
    v = replay_summary(comps, turns, recorded_det, strict)
    failed = v.pop("failed")  # the exit code is the determinism claim (the same output tokens)
    summ = {"summary": True, "replay_of": session["id"], **v, "wall_s": round(time.perf_counter() - t0, 3),
            "session": rec.session_id if rec else None, "db": rec.path if rec else None}
    if args.json:
        print_json(summ)
    else:
        con = console()
        same, differs, text_differs, cache_differs, errors = (v[k] for k in (
            "equal", "differs", "text_differs", "cache_differs", "errors"))
        verdict = ("reproduces" if differs == 0 else "NO LONGER REPRODUCES" if strict and text_differs
                   else "differs (not deterministic mode)" if text_differs else "the cache differs")
        con.print(f"{same}/{len(comps)} turns equal, {differs} differ ({text_differs} in output, "
                  f"{cache_differs} in cached tokens), {errors} failed: {verdict}", highlight=False)
        if not v["cache_compared"] and cache_differs:
            con.print("turns overlapped in this session: who computes a shared block depends on arrival "
                      "order, so cached tokens are shown but not part of the verdict", highlight=False)
        if rec:
            con.print(Text(f"recorded as session {rec.session_id} (replay of {inert(session['id'])})"), highlight=False)
    return 1 if failed else 0
