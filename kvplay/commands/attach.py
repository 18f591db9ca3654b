"""`kvplay attach URL`: the playground on a running OpenAI-compatible server (vLLM, SGLang,
kvplay serve), its block map mirrored from the server's KV events.

    kvplay attach http://127.0.0.1:8000 --events-bind tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
    kvplay attach http://pod-a:8000 --events tcp://pod-a:5557 --events tcp://pod-b:5557 --pod a --pod b

Each pane's turn is a streamed chat completion with the pane's user as `user` and `session_id`
(wire/remote.py). `--events`/`--events-bind`/`--replay`/`--pod` mean what they mean for
`kvplay watch`; several pods share one map, pod after pod (the status panel gives each pod's
range, state and blocks). Without `--events` the endpoints are asked from the server (vLLM's
`GET /kv_event_sources`, SGLang's `GET /server_info`, both answered by `kvplay serve`); when it
advertises none the panes still work and show the cached tokens the server's `usage` reports.
The server is checked (`/v1/models`) before the app opens: a bad URL, a refused key or an
unreachable server is one line and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvplay.commands.app import APP_SYSTEM, parse_users
from kvplay.commands.screenshot import parse_size
from kvplay.commands.watch import add_source_args, sources_from_args
from kvplay.engine.errors import EngineError
from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg, check_output_file, check_url
from kvplay.sessions.script import load_script
from kvplay.tui.attach import AttachApp
from kvplay.tui.lifecycle import run_app, run_until_done
from kvplay.tui.screenshot import take_screenshot
from kvplay.wire.curve import client_from_args
from kvplay.wire.discovery import Unreachable, discover
from kvplay.wire.remote import RemoteBackend


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("KVPLAY_API_KEY"), metavar="K",
                   help="bearer token for the server (default: env KVPLAY_API_KEY)")
    add_source_args(p)
    p.add_argument("--topic", default="", help="topic prefix of the KV events (default: all)")
    p.add_argument("--slots", type=int, default=None, metavar="N",
                   help="map size per pod when the server's /metrics does not tell its pool size (default 4096)")
    p.add_argument("--users", default=None, help="comma-separated user names (default alice,bob,carol)")
    p.add_argument("--system", default=None, help="the shared system prompt")
    p.add_argument("--script", default=None, metavar="FILE",
                   help="a TOML script whose users and turns play through the panes (its engine settings "
                        "are the server's business: ignored)")
    p.add_argument("--speed", type=float, default=1.0, help="script pace multiplier (default 1)")
    p.add_argument("--screenshot", default=None, metavar="OUT.svg",
                   help="with --script: play it headless, save an SVG of the app, and exit")
    p.add_argument("--size", default="160x48", help="--screenshot's terminal size, WIDTHxHEIGHT (default 160x48)")
    add_db_arg(p)
    p.add_argument("--no-record", dest="record", action="store_false", help="do not record this session")


def discover_or_none(url: str, api_key: str | None, topic: str = "", curve=None) -> list:
    """The server's advertised event endpoints (subscribed with `curve` when given), or none
    (said on stderr: the panes still work)."""
    try:
        found = discover(url, api_key)
    except Unreachable as exc:
        raise KvplayError(str(exc)) from None
    except EngineError as exc:
        print(f"kvplay: {inert(exc)}; the map stays empty", file=sys.stderr)
        return []
    for s in found.sources:
        if topic:
            s.topic = topic
        s.curve = curve
    print(inert(f"kvplay: KV events from {found.via}: " + ", ".join(  # the server's endpoints
        f"{s.name} {'bind' if s.bind else 'connect'} {s.endpoint}" for s in found.sources), limit=2048), file=sys.stderr)
    return found.sources


def open_backend(args):
    """The RemoteBackend for `args` (EngineError, one line, when the server or a pod refuses)."""
    url = check_url(args.url)
    if args.sources:
        sources = sources_from_args(args)
    elif args.replay or args.pod:
        raise KvplayError("--replay and --pod pair with --events/--events-bind: give the pod's events too")
    else:
        sources = discover_or_none(url, args.api_key, args.topic,
                                   client_from_args(args.events_curve_server_key, args.events_curve_key))
    if args.slots is not None and args.slots <= 0:
        raise KvplayError(f"--slots {args.slots}: give a positive number of blocks")
    return RemoteBackend(url, args.api_key, sources, slots=args.slots)


def main(args: argparse.Namespace) -> int:
    users = parse_users(args.users or "alice,bob,carol")
    system, turns = APP_SYSTEM, None
    if args.script:
        script = load_script(args.script)
        system, turns = script.system, script.turns
        if not args.users:
            users = script.users
    if args.system:
        system = args.system
    if args.screenshot:
        if not turns:
            raise KvplayError("--screenshot plays a script: give --script FILE with turns")
        check_output_file(args.screenshot, "--screenshot", ".svg")
        size = parse_size(args.size)
    backend = open_backend(args)

    app = AttachApp(backend, users, system, turns=turns, speed=args.speed, db=args.db, record=args.record)
    try:
        if args.screenshot:
            run_until_done(take_screenshot(app, Path(args.screenshot), size))
            print(f"kvplay: saved {args.screenshot}", file=sys.stderr)
        else:
            run_app(app)  # workers never hold the exit (tui/lifecycle.py)
    finally:
        backend.close()
    if app.recorder_error:
        print(f"kvplay: recording failed: {inert(app.recorder_error)}", file=sys.stderr)
    if app.recorder is not None:
        print(f"kvplay: recorded session {app.recorder.session_id} in {app.recorder.path}", file=sys.stderr)
    return 0
