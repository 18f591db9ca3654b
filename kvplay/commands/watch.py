"""`kvplay watch`: mirror the prefix cache of running vLLM, SGLang or kvplay servers from their
KV events, headless.

    kvplay watch http://127.0.0.1:8000          # the server says where its events are
    kvplay watch --events-bind tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --json
    kvplay watch --events tcp://pod-a:5557 --events tcp://pod-b:5557 --pod a --pod b

Given a server's URL (and no `--events`), the endpoints come from the server itself: vLLM's
`GET /kv_event_sources` or SGLang's `GET /server_info` (wire/discovery.py), one pod per DP rank.

`--events EP` connects to a publisher that binds (vLLM binds when its endpoint has `*` or `::`);
`--events-bind EP` binds for publishers that connect (vLLM with any other endpoint). One per pod;
`--replay` and `--pod` pair with them in the order given. With `--json` each applied batch is a
line `{"pod", "seq", "stored", "removed", "cleared"}` (plus `"replayed": true` for batches a
replay brought) and the last line is the summary
`{"summary": true, "pods": {POD: {"state", "blocks", "by_session", "stored_by_session", "stored",
"removed", "gaps", "replayed", "restarts", "lost", "bad_payloads", "bad_events", "unknown_events",
"other_medium"}}}` (`lost`: batches known missed; `bad_*`: frames, payloads or events rejected at
decode; `unknown_events`: event types we do not know; `other_medium`: blocks of another tier,
not mirrored). Without it, one line per second per pod.
The watched events are recorded as a session (source "watch") unless `--no-record`.
Stops after `--duration` seconds (under any load), on Ctrl-C or on SIGTERM (the summary is still
printed).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from kvplay.options import KvplayError, add_db_arg
from kvplay.wire.codec import WireError
from kvplay.wire.curve import client_from_args
from kvplay.wire.discovery import discover
from kvplay.wire.mirror import Fleet
from kvplay.wire.subscriber import TROUBLE, PodSource, Subscriber, check_endpoint, default_pod_name

from kvplay.sessions.watch_recording import WatchRecording


class _Source(argparse.Action):
    """--events / --events-bind into one ordered list of (bind, endpoint)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((option_string == "--events-bind", values))
        setattr(namespace, self.dest, items)


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The pods' KV-event sources (--events/--events-bind, --replay, --pod), read back by
    `sources_from_args` (kvplay watch and kvplay attach)."""
    p.add_argument("--events", dest="sources", action=_Source, metavar="EP", default=[],
                   help="connect to a pod's KV-event publisher that binds (tcp://host:port); one per pod")
    p.add_argument("--events-bind", dest="sources", action=_Source, metavar="EP", default=[],
                   help="bind EP for a publisher that connects (vLLM with a non-wildcard endpoint); one per pod")
    p.add_argument("--replay", action="append", default=[], metavar="EP",
                   help="the pod's replay endpoint (vLLM's replay_endpoint), in the order of the pods")
    p.add_argument("--pod", action="append", default=[], metavar="NAME",
                   help="a name for each pod, in order (default: its endpoint's host:port)")
    p.add_argument("--events-curve-server-key", default=None, metavar="FILE",
                   help="the CURVE publisher's public key (its server.key, or the 40-character key): "
                        "for a `kvplay serve --kv-events-curve` server")
    p.add_argument("--events-curve-key", default=None, metavar="FILE",
                   help="this subscriber's CURVE key pair (a .key_secret file whose public key the server allows)")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default=None, metavar="URL",
                   help="a vLLM, SGLang or kvplay server's base URL: its event endpoints are asked from it "
                        "(GET /kv_event_sources or /server_info) unless --events is given")
    p.add_argument("--api-key", default=os.environ.get("KVPLAY_API_KEY"), metavar="K",
                   help="bearer token for URL (default: env KVPLAY_API_KEY)")
    add_source_args(p)
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all; vLLM's is in "
                                              "its kv-events-config)")
    p.add_argument("--json", action="store_true", help="one JSON line per applied batch, then a summary")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--replay-timeout", type=float, default=3.0, metavar="S",
                   help="give up a replay that is silent for S seconds (the pod shows stale)")
    add_db_arg(p)
    p.add_argument("--no-record", action="store_true", help="do not record the watched events as a session")
    p.add_argument("--drop", action="append", default=[], metavar="POD:SEQ", help=argparse.SUPPRESS)


def discovered_sources(url: str, api_key: str | None, topic: str = "", curve=None) -> list[PodSource]:
    """The pods a server at `url` advertises (one line, exit 2, when it advertises none), each
    subscribed with `curve` (the --events-curve-* keys) when given."""
    try:
        found = discover(url, api_key)
    except WireError as exc:
        raise KvplayError(str(exc)) from None
    for s in found.sources:
        if topic:
            s.topic = topic
        s.curve = curve
        how = "bind" if s.bind else "connect to"
        print(f"kvplay: {found.via}: pod {s.name}: {how} {s.endpoint}"
              f"{', replay ' + s.replay if s.replay else ''}{', topic ' + repr(s.topic) if s.topic else ''}",
              file=sys.stderr)
    return found.sources


def sources_from_args(args) -> list[PodSource]:
    """The pods asked for, checked (one line per mistake)."""
    if not args.sources:
        raise KvplayError("give each pod's KV events with --events EP (it binds) or --events-bind EP (it connects)")
    n = len(args.sources)
    if len(args.replay) > n:
        raise KvplayError(f"{len(args.replay)} --replay for {n} pod(s): give at most one per --events/--events-bind")
    if len(args.pod) > n:
        raise KvplayError(f"{len(args.pod)} --pod names for {n} pod(s)")
    out = []
    curve = client_from_args(args.events_curve_server_key, args.events_curve_key)
    try:
        for i, (bind, ep) in enumerate(args.sources):
            check_endpoint(ep, "--events-bind" if bind else "--events")
            replay = args.replay[i] if i < len(args.replay) else None
            if replay is not None:
                check_endpoint(replay, "--replay")
            name = args.pod[i] if i < len(args.pod) else default_pod_name(ep)
            if not name:
                raise KvplayError("--pod: a name cannot be empty")
            out.append(PodSource(name, ep, bind, replay, args.topic, curve=curve))
    except WireError as exc:
        raise KvplayError(str(exc)) from None
    names = [s.name for s in out]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise KvplayError(f"two pods are named {dup[0]!r}: give each a --pod NAME")
    return out


def _drops(args, names) -> list[tuple[str, list[int]]]:
    out = []
    for d in args.drop:
        pod, _, seqs = d.rpartition(":")
        if pod not in names:
            raise KvplayError(f"--drop {d!r}: no pod {pod!r}")
        try:
            out.append((pod, [int(x) for x in seqs.split(",")]))
        except ValueError:
            raise KvplayError(f"--drop {d!r}: give POD:SEQ[,SEQ...]") from None
    return out


def summary_of(fleet: Fleet, sub: Subscriber) -> dict:
    """The fleet's summary with each pod's state and trouble counts."""
    out = fleet.summary()
    for name, s in out["pods"].items():
        info = sub.pod_info(name)
        s.update({"state": info["state"], **{k: info[k] for k in TROUBLE}})
    return out


def _human_line(fleet: Fleet, sub: Subscriber, last: dict) -> str:
    parts = []
    for name, m in fleet.pods.items():
        prev = last.get(name, (0, 0))
        top = ", ".join(f"{k} {v}" for k, v in m.by_session.most_common(4))
        info = sub.pod_info(name)
        trouble = "".join(f" {k.replace('_', ' ')} {info[k]}" for k in TROUBLE if info[k])
        parts.append(f"{name} [{m.pod_state}] seq {m.last_seq} blocks {len(m.blocks)}"
                     f"{' (' + top + ')' if top else ''} +{m.stored - prev[0]} -{m.removed - prev[1]}"
                     f" gaps {m.gaps} replayed {m.replayed} restarts {m.restarts}{trouble}")
        last[name] = (m.stored, m.removed)
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def main(args) -> int:
    if args.url and not args.sources:
        if args.replay or args.pod:
            raise KvplayError("--replay and --pod pair with --events/--events-bind: give the pod's events too")
        sources = discovered_sources(args.url, args.api_key, args.topic,
                                     client_from_args(args.events_curve_server_key, args.events_curve_key))
    else:
        sources = sources_from_args(args)
    if args.duration is not None and not args.duration > 0:
        raise KvplayError(f"--duration {args.duration:g}: give a number of seconds above 0")
    if not args.replay_timeout > 0:
        raise KvplayError(f"--replay-timeout {args.replay_timeout:g}: give a number of seconds above 0")
    drops = _drops(args, {s.name for s in sources})
    fleet = Fleet()
    for s in sources:
        fleet.pod(s.name)
    recording = None
    out = sys.stdout
    as_json = args.json

    def on_batch(pod, seq, batch, counts, replayed):
        if recording is not None:
            recording.on_batch(pod, seq, counts.events)
        if as_json:
            d = {"pod": pod, "seq": seq, "stored": counts[0], "removed": counts[1], "cleared": counts[2]}
            if replayed:
                d["replayed"] = True
            out.write(json.dumps(d) + "\n")

    def on_restart(pod):
        if recording is not None:
            recording.on_restart(pod)

    def on_state(pod, state):
        print(f"kvplay: pod {pod} is {state}", file=sys.stderr, flush=True)

    last: dict = {}

    def tick():
        if recording is not None:
            recording.flush()
        if as_json:
            out.flush()
        else:
            print(_human_line(fleet, sub, last), flush=True)

    try:
        sub = Subscriber(sources, fleet, on_batch=on_batch, on_state=on_state, on_restart=on_restart,
                         replay_timeout=args.replay_timeout).open()
    except WireError as exc:
        raise KvplayError(str(exc)) from None
    if not args.no_record:  # after the sockets opened: a refused watch records nothing
        try:
            recording = WatchRecording(args.db, fleet, title="watch " + " ".join(s.name for s in sources))
        except BaseException:
            sub.close()
            raise
        for s in sources:
            recording.watch(s.name)
    for pod, seqs in drops:
        sub.drop_live(pod, seqs)
    if recording is not None:
        print(f"kvplay: recording the watched events as session {recording.session_id} in {recording.path}",
              file=sys.stderr)
    if not as_json:
        for s in sources:
            how = "bound" if s.bind else "connected to"
            print(f"kvplay: pod {s.name}: {how} {sub.endpoint(s.name)}"
                  f"{', replay ' + s.replay if s.replay else ', no replay endpoint'}", file=sys.stderr)
    def on_signal(signum, frame):
        # SIGTERM or Ctrl-C: the loop ends within one poll and the summary follows. The loop is
        # never interrupted mid-batch (a KeyboardInterrupt could land inside a callback or a
        # socket swap); a second Ctrl-C while it winds down interrupts for real.
        if signum == signal.SIGINT and sub.stopping:
            raise KeyboardInterrupt
        sub.stop()

    old_term = signal.signal(signal.SIGTERM, on_signal)
    old_int = signal.signal(signal.SIGINT, on_signal)
    try:
        sub.run(args.duration, tick=tick)
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: the summary still follows
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        summary = summary_of(fleet, sub)
        sub.close()
        if recording is not None:
            recording.close()
    if as_json:
        out.write(json.dumps(summary) + "\n")
        out.flush()
    else:
        for name, s in summary["pods"].items():
            trouble = "".join(f", {k.replace('_', ' ')} {s[k]}" for k in TROUBLE)
            print(f"{name} [{s['state']}]: {s['blocks']} blocks cached; held by {s['by_session'] or '-'}; "
                  f"stored {s['stored']} (by {s['stored_by_session'] or '-'}), removed {s['removed']}, "
                  f"gaps {s['gaps']}, replayed {s['replayed']}, restarts {s['restarts']}{trouble}")
    return 0
