"""Headless `kvplay replay ID --headless`: re-drive the recorded turns through a fresh Engine,
making the recorded engine changes (settings, clears, groups) again before the turns that
followed them, and print, per turn, equal or differs (first differing token and its position),
and cached tokens then vs now with whether they, their creators and the reasons for the computed
tokens match (engine/miss.py; a difference in reasons shows both); the replay is recorded
as a new session (replay_of = ID) unless --no-record. A session reproduces when every turn's
output and cache match (outputs alone when its turns overlapped: then arrival order decides who
computes a shared block). Exit code 1 when a session recorded in deterministic mode no longer
gives the same outputs (or a turn fails), else 0: cached tokens also depend on timing where
turns overlapped (`at`). The command itself (and the replay in the app) is tui/replay_cli.py.
"""
from __future__ import annotations

import time

from kvplay.engine.miss import miss_text

from .query import settings_timeline
from .recorder import Recorder, close_run
from .report import console, excerpt, fmt_num, print_json
from .run_cmd import start_engine


def _row(c) -> list[str]:
    if c.error:
        verdict = f"[red]error: {c.error}[/red]"
    elif c.equal:
        verdict = "[green]equal[/green]"
    else:
        verdict = f"[yellow]differs[/yellow] at token {c.first_diff}: {c.then_token!r} → {c.now_token!r}"
    cached = f"{fmt_num(c.cached_then)} → {fmt_num(c.cached_now)}"
    if not c.error and not c.miss_equal:
        cached += f" (missed {miss_text(c.miss_then, c.user)} → {miss_text(c.miss_now, c.user)})"
    if not c.error and not c.cache_equal:
        cached = f"[yellow]{cached} differs[/yellow]"
    return [str(c.seq), c.user, excerpt(c.text, 28), verdict, cached,
            f"{fmt_num(c.ttft_then)} → {fmt_num(c.ttft_now)}", excerpt(c.now_reply or "", 36)]


def headless(args, session: dict, turns: list[dict], users: list[dict], events: list[dict], config) -> int:
    from rich.live import Live  # start-up time: `kvplay replay --help` imports this module
    from rich.table import Table

    from .replay import replay  # start-up time: the player imports the engine (torch)

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
            table = Table(title=f"replay of {session['id']} ({session['model']})", header_style="bold")
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
    errors = sum(1 for c in comps if c.error)
    text_differs = sum(1 for c in comps if not c.equal and not c.error)
    cache_differs = sum(1 for c in comps if not c.cache_equal and not c.error)
    miss_differs = sum(1 for c in comps if not c.miss_equal and not c.error)
    # When turns overlapped (`at`), arrival order decides who computes a shared block, so who is
    # credited (and how much hits) can change from run to run: then a cache difference is shown
    # and counted, but the verdict rests on the outputs alone (`cache_compared` says which).
    cache_compared = not any(t.get("at") is not None for t in turns)
    same = sum((c.reproduces if cache_compared else c.equal) for c in comps)
    differs = len(comps) - same
    strict = recorded_det and config.deterministic
    # the exit code is the determinism claim (the same output tokens)
    failed = errors > 0 or (strict and text_differs > 0)
    summ = {"summary": True, "replay_of": session["id"], "turns": len(comps), "equal": same, "differs": differs,
            "text_differs": text_differs, "cache_differs": cache_differs, "miss_differs": miss_differs,
            "cache_compared": cache_compared,
            "errors": errors, "deterministic": recorded_det, "reproduces": differs == 0,
            "wall_s": round(time.perf_counter() - t0, 3),
            "session": rec.session_id if rec else None, "db": rec.path if rec else None}
    if args.json:
        print_json(summ)
    else:
        con = console()
        verdict = ("reproduces" if differs == 0 else "NO LONGER REPRODUCES" if strict and text_differs
                   else "differs (not deterministic mode)" if text_differs else "the cache differs")
        con.print(f"{same}/{len(comps)} turns equal, {differs} differ ({text_differs} in output, "
                  f"{cache_differs} in cached tokens), {errors} failed: {verdict}", highlight=False)
        if not cache_compared and cache_differs:
            con.print("turns overlapped in this session: who computes a shared block depends on arrival "
                      "order, so cached tokens are shown but not part of the verdict", highlight=False)
        if rec:
            con.print(f"recorded as session {rec.session_id} (replay of {session['id']})", highlight=False)
    return 1 if failed else 0
