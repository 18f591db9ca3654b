"""`kvplay app`, `attach` and `scrub` end by returning, not by `os._exit`: each runs here in a
subprocess under Textual's `run_test` on the loop `tui/lifecycle.py` gives them, quits (with a
reply in flight, or while the model is still loading), and the process must then exit on its
own within a bound, with no thread of kvplay's left behind (a model load that cannot finish is
left on a daemon thread: it never holds the exit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

EXIT_BOUND_S = 120  # a hang bound for a loaded 2-core machine, not a timing claim

DRIVER = textwrap.dedent('''
    import asyncio, json, sys, threading, time
    from kvplay.engine.config import EngineConfig
    from kvplay.sessions.script import UserSpec
    from kvplay.tui.lifecycle import run_until_done

    mode, db, model = sys.argv[1], sys.argv[2], sys.argv[3]
    USERS = [UserSpec("alice", max_tokens=400), UserSpec("bob", max_tokens=400)]
    SYSTEM = "You answer briefly. " * 4
    closers = []

    async def until(pilot, cond, limit=60.0):
        end = time.monotonic() + limit
        while not cond():
            if time.monotonic() > end:
                raise AssertionError("timed out waiting")
            await pilot.pause(0.05)

    async def chat_then_quit(app, pilot, ready):
        await until(pilot, ready)
        pane = app.pane("alice")
        pane.input.focus()
        pane.input.value = "Are you open on Mondays?"
        await pilot.press("enter")
        await until(pilot, lambda: app.busy or app.cache.requests)  # in flight (or, over HTTP, maybe done)
        await pilot.press("ctrl+q")

    async def scenario():
        if mode == "app":
            from kvplay.tui.app import KvplayApp
            app = KvplayApp(EngineConfig(model=model, num_blocks=64), USERS, SYSTEM, db=db, timings=False)
            async with app.run_test(size=(140, 40)) as pilot:
                await chat_then_quit(app, pilot, lambda: app.backend is not None)
        elif mode == "loading":
            from kvplay.tui.app import KvplayApp
            app = KvplayApp(EngineConfig(model=model), USERS, SYSTEM, db=db, record=False)
            async with app.run_test(size=(140, 40)) as pilot:
                await until(pilot, lambda: any(w.group == "engine" and w.is_running for w in app.workers))
                await pilot.press("ctrl+q")  # the load has started: quit while it runs
            assert app.backend is None  # it never loaded
        elif mode == "attach":
            from kvplay.cli import build_parser
            from kvplay.engine.engine import Engine
            from kvplay.engine.model import load_model
            from kvplay.serve.server import ServerThread, build_state, close_state
            from kvplay.tui.attach import AttachApp
            from kvplay.commands.attach import open_backend
            eng = Engine(EngineConfig(model=model, num_blocks=64), load_model(model, "cpu", "float32")).start()
            state = build_state(eng, None, None)
            srv = ServerThread(state).start()
            closers.extend([srv.stop, lambda: close_state(state), eng.shutdown])  # the server's, not the app's
            backend = open_backend(build_parser("attach").parse_args(["attach", srv.url]))
            closers.insert(0, backend.close)
            app = AttachApp(backend, USERS, SYSTEM, db=db, record=False, timings=False)
            async with app.run_test(size=(140, 40)) as pilot:
                await chat_then_quit(app, pilot, lambda: app.backend is not None)
        elif mode == "scrub":
            from kvplay.tui.scrub import ScrubApp, ScrubScreen
            from kvplay.commands.scrub import load
            import sqlite3
            (sid,), = sqlite3.connect(db).execute("select id from sessions").fetchall()
            app = ScrubApp(load(db, sid), None)
            async with app.run_test(size=(140, 40)) as pilot:
                await until(pilot, lambda: isinstance(app.screen, ScrubScreen) and app.screen.is_mounted)
                await pilot.press("right", "right", "ctrl+q")

    run_until_done(scenario())
    for close in closers:
        close()
    end = time.monotonic() + 10  # threads still ending get 10 s in all
    for t in threading.enumerate():
        if t is not threading.main_thread():
            t.join(max(0.0, end - time.monotonic()))
    left = [(t.name, t.daemon) for t in threading.enumerate() if t is not threading.main_thread()]
    print(json.dumps(left), flush=True)
''')


def drive(mode: str, db: str, model: str = "tiny:llama") -> list[list]:
    """Run the driver; it must exit on its own (rc 0) within the bound. Returns the threads it
    saw alive after the app and its loop had closed: [name, daemon] pairs."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", DRIVER, mode, db, model], capture_output=True, text=True,
                          timeout=EXIT_BOUND_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_app_and_scrub_exit_cleanly_with_a_reply_in_flight(tmp_path):
    db = str(tmp_path / "s.db")
    assert drive("app", db) == []  # the engine, the recorder and every worker have ended
    assert drive("scrub", db) == []  # the session the app recorded, scrubbed


@pytest.mark.slow
def test_attach_exits_cleanly_with_a_reply_in_flight(tmp_path):
    assert drive("attach", str(tmp_path / "s.db")) == []


@pytest.mark.slow
def test_quitting_while_the_model_loads_never_waits_for_the_load(tmp_path):
    """Quit as soon as the embedded model has started loading (imports and weights take
    seconds): the process ends; a load still running is on daemon threads only (the app's
    worker, and the thread that ends with the load, engine/threads.py)."""
    left = drive("loading", str(tmp_path / "s.db"), "default")
    assert all(daemon and name.startswith(("kvplay-worker", "kvplay-load")) for name, daemon in left), left


def test_a_worker_that_never_ends_does_not_hold_the_exit():
    """The cause of the old `os._exit`: asyncio.run joins its default executor's threads with no
    limit (and Python joins them again at exit), so one stuck worker (a load on a stuck file
    system) held the process for ever. On the lifecycle loop it is a daemon thread, waited for at
    most QUIT_WAIT_S when the loop closes and EXIT_WAIT_S at exit (a load in native code must not
    run while the process tears down: see test_quitting_while_the_model_loads...)."""
    code = textwrap.dedent('''
        import asyncio, threading
        from kvplay.tui import lifecycle
        from kvplay.tui.lifecycle import run_until_done
        lifecycle.EXIT_WAIT_S = 1.0  # at exit, a worker still running is waited for this long

        async def main():
            asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # never ends
            await asyncio.to_thread(sum, [1, 2])  # a worker that ends
            return "returned"

        print(run_until_done(main()), flush=True)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=EXIT_BOUND_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "returned", proc.stderr[-2000:]
    assert "waiting for 1 background job" in proc.stderr  # said, then the stuck one is left
