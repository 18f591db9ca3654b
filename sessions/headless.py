"""Playing a script headless through one Engine (`kvplay run`): the turns as player jobs, a
table (or JSON lines) of each finished turn's cache use and whose blocks it was, the run's
summary, and start_engine (the model loads with a line before and after; `kvplay serve` and the
headless replay use it too). Each turn is recorded in the sessions DB unless asked not to.
What a row quotes (names, replies, errors, the model) is inert (kvplay/inert.py): a row's cells
are `Text`, never markup.
"""
from __future__ import annotations

import sys
import time

from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvplay.engine.model_spec import check_model_spec
from kvplay.inert import inert

from .player import Done, Job, play
from .recorder import Recorder, close_run
from .report import cached_cell, computed_cell, excerpt, fmt_num, human_bytes, print_json, turn_object
from .report import console as make_console
from .script import Script, sampling_for
from .store import open_db


def script_jobs(script: Script) -> list[Job]:
    """Script turns -> player jobs (per-user sampling from [[users]], overridden per turn)."""
    jobs = []
    for i, t in enumerate(script.turns, 1):
        u = script.user(t.user)
        jobs.append(Job(i, t.user, t.text, sampling_for(u, t), at=t.at, group=t.group, clear=bool(t.clear),
                        engine=t.engine))
    return jobs


COLUMNS = ["turn", "user", "prompt", "cached", "computed", "TTFT ms", "tok/s", "reply"]
FLEXIBLE = ("cached", "computed", "reply")  # text columns that shrink (with an ellipsis) to fit


def make_table(title: str | None = None, rows: list[list[str]] = (), width: int | None = None,
               users: list[str] = ()):
    """A Rich table of finished turns that fits `width` columns. No header is ever clipped (each
    column is at least as wide as its name and the user names); the attribution, why tokens
    were computed and the reply take what is left and end in an ellipsis. Narrow terminals get
    no border, then no reply."""
    need = {name: len(name) for name in COLUMNS}
    need["user"] = max([4, *(len(inert(u, limit=64)) for u in users)])
    need["reply"] = 8
    names = list(COLUMNS)
    kw_table: dict = {}
    if width is not None and sum(need.values()) + 3 * len(names) + 1 > width:
        kw_table = {"box": None, "padding": (0, 1), "pad_edge": False}
        if sum(need.values()) + 2 * (len(names) - 1) > width:
            names.remove("reply")
    widths: dict[str, int] = {}
    if width is not None:  # exact widths: Rich never shrinks a no-wrap column, so decide here
        for i, name in enumerate(names):
            widths[name] = max([need[name], *(as_text(r[i]).cell_len for r in rows)])
        overhead = 2 * (len(names) - 1) if kw_table else 3 * len(names) + 1
        fixed = sum(widths[n] for n in names if n not in FLEXIBLE)
        room = width - overhead - fixed
        reply_min = need["reply"] if "reply" in names else 0
        widths["cached"] = max(need["cached"], min(widths["cached"], room - reply_min - need["computed"]))
        widths["computed"] = max(need["computed"], min(widths["computed"], room - reply_min - widths["cached"]))
        if "reply" in names:
            widths["reply"] = max(need["reply"], room - widths["cached"] - widths["computed"])
    table = Table(title=title, show_lines=False, header_style="bold", **kw_table)
    for name in names:
        kw = {"min_width": need[name], "no_wrap": True, "overflow": "ellipsis"}
        if name in widths:
            kw["width"] = widths[name]
        if name not in ("user", *FLEXIBLE):
            kw["justify"] = "right"
        table.add_column(name, **kw)
    for row in rows:
        table.add_row(*row[:len(names)])
    return table


def as_text(cell):
    """A row's cell as Text: a Text as it is, a string as markup (the columns' own)."""
    return cell if isinstance(cell, Text) else Text.from_markup(cell)


class TurnTable:
    """Finished turns in turn order, whatever order they finish in. On a terminal: a live table
    that fits its width. Otherwise (piped, redirected): plain columns, one line per turn, each
    printed as soon as every earlier turn has been printed."""

    def __init__(self, console, turns: list[int], users: list[str], title: str | None = None) -> None:
        self.console, self.title = console, title
        self.order = sorted(turns)
        self.rows: dict[int, list[str]] = {}
        self.printed = 0
        self.live = None
        w_user = max([4, *(len(inert(u, limit=64)) for u in users)])
        self.users = users
        # (plain lines: "computed" fits "260: 240 cold, 16 isolated from alice, 4 tail"; a longer
        # cell pushes the rest of its own line only)
        self.widths = [max(4, len(str(max(turns, default=1)))), w_user, 6, 22, 46, 7, 6, 0]

    def table(self):
        return make_table(self.title, [self.rows[t] for t in self.order if t in self.rows],
                          self.console.width, self.users)

    def __enter__(self) -> "TurnTable":
        if self.console.is_terminal:
            self.live = Live(self.table(), console=self.console, auto_refresh=False, transient=False)
            self.live.start()
        else:
            if self.title:
                print(self.title, file=self.console.file)
            self._print_plain(COLUMNS)
        return self

    def add(self, turn: int, row: list[str]) -> None:
        self.rows[turn] = row
        if self.live is not None:
            self.live.update(self.table(), refresh=True)
            return
        while self.printed < len(self.order) and self.order[self.printed] in self.rows:
            self._print_plain(self.rows[self.order[self.printed]])
            self.printed += 1

    def _print_plain(self, cells: list) -> None:
        out = []
        for i, (cell, w) in enumerate(zip(cells, self.widths)):
            text = as_text(cell).plain
            right = COLUMNS[i] not in ("user", *FLEXIBLE)
            out.append(text.rjust(w) if right else text.ljust(w))
        print("  ".join(out).rstrip(), file=self.console.file, flush=True)

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()
        else:  # turns that never finished (a failure in the player) leave gaps: print the rest
            for t in self.order[self.printed:]:
                if t in self.rows:
                    self._print_plain(self.rows[t])


def table_row(done: Done) -> list:
    """A finished turn's cells (Text where they quote a user or the model)."""
    st = done.result.stats if done.result else None
    if st is None or done.error:
        reply = Text(f"error: {excerpt(done.error, 200)}", style="red")
    else:
        reply = Text(excerpt(done.result.text, 48))
        if done.result.finish_reason == "pool_exhausted":
            reply = Text.assemble(("(stopped: the pool is full)", "yellow"), " ", reply)
    cached = Text(cached_cell(st.cached_tokens if st else None, None, st.cached_from if st else None, done.job.user))
    return [str(done.job.turn), Text(inert(done.job.user, limit=64)), fmt_num(st.prompt_tokens if st else None), cached,
            Text(computed_cell(st.computed_tokens if st else None, st.miss if st else None, done.job.user)),
            fmt_num(st.ttft_ms if st else None, 1),
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
        Text.assemble((f"{summ['turns']} turns", "bold"), f" ({summ['failed']} failed) on {inert(summ['model'])} in "
                      f"{summ['wall_s']:.1f} s, isolation {summ['isolation']}"
                      f"{', deterministic' if summ['deterministic'] else ''}"),
        f"hit rate {summ['hit_rate']:.1%} ({summ['hit_tokens']}/{summ['query_tokens']} prompt tokens from the cache)",
        f"blocks {b['total']}: {b['cached']} cached, {b['in_use']} in use, {b['free']} free; "
        f"evictions {summ['evictions']}, preemptions {summ['preemptions']}; "
        f"saved {human_bytes(summ['bytes_saved'])} vs a cache per user",
    ]
    if summ.get("session"):
        lines.append(Text(f"recorded as session {summ['session']} in {inert(summ['db'])}"))
    for line in lines:
        console.print(line, highlight=False)


def run_jobs(engine, jobs: list[Job], system: str, as_json: bool, recorder=None, speed: float = 1.0,
             title: str | None = None, extra_row=None) -> tuple[list[Done], float]:
    """Play jobs, print each finished turn (JSON line or live table row), record each one."""
    console = make_console()
    t0 = time.perf_counter()
    table = TurnTable(console, [j.turn for j in jobs], [j.user for j in jobs], title)

    def finished(done: Done) -> None:
        done.record(recorder)
        if as_json:
            obj = turn_object(done)
            if extra_row:
                obj.update(extra_row(done))
            print_json(obj)
        else:
            table.add(done.job.turn, table_row(done))

    if as_json:
        dones = play(engine, jobs, system, finished, speed)
    else:
        with table:
            dones = play(engine, jobs, system, finished, speed)
        console.print()
    return dones, time.perf_counter() - t0


def start_engine(config):
    t = time.perf_counter()
    print(f"kvplay: loading {inert(config.model)} …", file=sys.stderr, flush=True)  # before torch's import
    check_model_spec(config.model)  # a bad --model is one line at once, not after torch's import
    # Lazy, where run, replay and serve start their model: importing the engine (torch,
    # transformers) takes 2.6 s niced on the 2-core machine, after the line above, not before it.
    from kvplay.engine.engine import Engine

    engine = Engine(config).start()
    print(f"kvplay: {inert(engine.model_name)} ready in {time.perf_counter() - t:.1f} s "
          f"({engine.num_blocks} blocks of {config.block_size} tokens; decode attention: "
          f"{engine.decode_attention()})", file=sys.stderr, flush=True)
    return engine


def run_script(script: Script, config, db: str | None = None, record: bool = True, as_json: bool = False,
               speed: float = 1.0) -> dict:
    """Play `script` through a fresh Engine on `config`, printing each finished turn (a table
    row, or a JSON line), recorded in the sessions DB `db` unless not `record`; the summary."""
    jobs = script_jobs(script)
    if record:
        open_db(db).close()  # refuse a bad DB before spending time on the model
    engine = start_engine(config)
    for u in script.users:  # identity is bound here, once; turns carry only the user name
        engine.register_user(u.name, u.group)

    rec = None
    try:
        if record:
            rec = Recorder.open(db, config, engine.model_name, "run", script.system, script_path=script.path)
            rec.attach(engine)
            for u in script.users:
                rec.add_user(u.name, group=u.group, colour=u.colour, seed=u.seed, temperature=u.temperature,
                             max_tokens=u.max_tokens, top_p=u.top_p, top_k=u.top_k)
        dones, wall = run_jobs(engine, jobs, script.system, as_json, rec, speed)
        return summary_object(engine, dones, wall, rec.session_id if rec else None, rec.path if rec else None)
    finally:
        close_run(rec, engine)
