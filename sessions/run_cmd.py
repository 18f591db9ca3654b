"""`kvplay run SCRIPT.toml [--json] [engine flags] [--db PATH] [--no-record]`: play a script headless
through one Engine and report, per finished turn, how much of the prompt came from the cache
and whose blocks it was. Records the session in the sessions DB unless --no-record.

Exit code: 0 every turn ok, 1 some turn failed, 2 bad input (one line, no traceback).
"""
from __future__ import annotations

import argparse
import sys
import time

from kvplay.options import add_engine_args, config_from_args

from .player import Done, Job, play
from .report import attribution, excerpt, fmt_num, human_bytes, print_json, turn_object
from .report import console as make_console
from .script import Script, load_script, sampling_for


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="TOML script ([engine], [system], [[users]], [[turns]])")
    parser.add_argument("--json", action="store_true", help="one JSON object per finished turn, then a summary")
    parser.add_argument("--db", default=None, help="sessions database (default: XDG data dir, env KVPLAY_DB)")
    parser.add_argument("--no-record", action="store_true", help="do not record this run in the sessions DB")
    parser.add_argument("--speed", type=float, default=1.0, help="divide every turn's `at` offset by X")
    add_engine_args(parser)


def script_jobs(script: Script) -> list[Job]:
    """Script turns -> player jobs (per-user sampling from [[users]], overridden per turn)."""
    jobs = []
    for i, t in enumerate(script.turns, 1):
        u = script.user(t.user)
        jobs.append(Job(i, t.user, t.text, sampling_for(u, t), group=u.group, at=t.at))
    return jobs


def make_table(title: str | None = None):
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for name, kw in [("turn", {"justify": "right"}), ("user", {}), ("prompt", {"justify": "right"}),
                     ("cached", {"no_wrap": True}), ("computed", {"justify": "right"}), ("TTFT ms", {"justify": "right"}),
                     ("tok/s", {"justify": "right"}), ("reply", {"no_wrap": True, "overflow": "ellipsis", "max_width": 48})]:
        table.add_column(name, **kw)
    return table


def table_row(done: Done) -> list[str]:
    st = done.result.stats if done.result else None
    if st is None or done.error:
        reply = f"[red]error: {done.error}[/red]"
    else:
        reply = excerpt(done.result.text, 48)
    cached = "-" if st is None else f"{st.cached_tokens}" + (
        f" ({attribution(st.cached_from, done.job.user)})" if st.cached_tokens else "")
    return [str(done.job.turn), done.job.user, fmt_num(st.prompt_tokens if st else None), cached,
            fmt_num(st.computed_tokens if st else None), fmt_num(st.ttft_ms if st else None, 1),
            fmt_num(st.decode_tok_s if st else None, 1), reply]


def summary_object(engine, dones: list[Done], wall_s: float, session_id: str | None, db_path: str | None) -> dict:
    s = engine.stats()
    failed = sum(1 for d in dones if not d.ok)
    return {
        "summary": True, "model": s["model"], "turns": len(dones), "failed": failed,
        "hit_rate": round(s["hit_rate"], 4), "hit_tokens": s["hit_tokens"], "query_tokens": s["query_tokens"],
        "blocks": {"total": s["blocks_total"], "free": s["blocks_free"], "cached": s["blocks_cached"],
                   "in_use": s["blocks_in_use"], "block_size": s["block_size"]},
        "evictions": s["evictions"], "bytes_saved": s["bytes_saved"], "preemptions": s["preemptions"],
        "collisions_caught": s["collisions_caught"], "isolation": s["isolation"],
        "deterministic": s["deterministic"], "wall_s": round(wall_s, 3),
        "session": session_id, "db": db_path,
    }


def print_summary(console, summ: dict) -> None:
    b = summ["blocks"]
    lines = [
        f"[bold]{summ['turns']} turns[/bold] ({summ['failed']} failed) on {summ['model']} in {summ['wall_s']:.1f} s, "
        f"isolation {summ['isolation']}{', deterministic' if summ['deterministic'] else ''}",
        f"hit rate {summ['hit_rate']:.1%} ({summ['hit_tokens']}/{summ['query_tokens']} prompt tokens from the cache)",
        f"blocks {b['total']}: {b['cached']} cached, {b['in_use']} in use, {b['free']} free; "
        f"evictions {summ['evictions']}, preemptions {summ['preemptions']}; "
        f"saved {human_bytes(summ['bytes_saved'])} vs a cache per user",
    ]
    if summ.get("session"):
        lines.append(f"recorded as session {summ['session']} in {summ['db']}")
    for line in lines:
        console.print(line, highlight=False)


def run_jobs(engine, jobs: list[Job], system: str, as_json: bool, recorder=None, speed: float = 1.0,
             title: str | None = None, extra_row=None) -> tuple[list[Done], float]:
    """Play jobs, print each finished turn (JSON line or live table row), record each one."""
    from rich.live import Live

    console = make_console()
    table = make_table(title)
    t0 = time.perf_counter()

    def finished(done: Done) -> None:
        if recorder is not None and done.result is not None:
            recorder.record_turn(done.job.user, done.job.text, done.messages, done.job.sampling, done.result,
                                 at=done.job.at, started=done.started)
        if as_json:
            obj = turn_object(done)
            if extra_row:
                obj.update(extra_row(done))
            print_json(obj)
        else:
            table.add_row(*table_row(done))
            live.refresh()

    if as_json:
        dones = play(engine, jobs, system, finished, speed)
    else:
        with Live(table, console=console, auto_refresh=False, transient=False) as live:
            dones = play(engine, jobs, system, finished, speed)
        console.print()
    return dones, time.perf_counter() - t0


def start_engine(config):
    from kvplay.engine.engine import Engine

    print(f"kvplay: loading {config.model} …", file=sys.stderr, flush=True)
    t = time.perf_counter()
    engine = Engine(config).start()
    print(f"kvplay: {engine.model_name} ready in {time.perf_counter() - t:.1f} s "
          f"({engine.pool.num_blocks} blocks of {config.block_size} tokens)", file=sys.stderr, flush=True)
    return engine


def main(args: argparse.Namespace) -> int:
    from .recorder import Recorder, close_run
    from .store import open_db

    if args.speed <= 0:
        from kvplay.cli import KvplayError

        raise KvplayError(f"--speed must be positive (got {args.speed})")
    script = load_script(args.script)
    config = config_from_args(args, script.engine, where=f"{args.script}: [engine]")
    jobs = script_jobs(script)
    if not args.no_record:
        open_db(args.db).close()  # refuse a bad DB before spending time on the model
    engine = start_engine(config)
    rec = None
    try:
        if not args.no_record:
            rec = Recorder.open(args.db, config, engine.model_name, "run", script.system, script_path=script.path)
            rec.attach(engine)
            for u in script.users:
                rec.add_user(u.name, group=u.group, colour=u.colour, seed=u.seed, temperature=u.temperature,
                             max_tokens=u.max_tokens, top_p=u.top_p, top_k=u.top_k)
        dones, wall = run_jobs(engine, jobs, script.system, args.json, rec, args.speed)
        summ = summary_object(engine, dones, wall, rec.session_id if rec else None, rec.path if rec else None)
    finally:
        close_run(rec, engine)
    if args.json:
        print_json(summ)
    else:
        print_summary(make_console(), summ)
    return 1 if summ["failed"] else 0
