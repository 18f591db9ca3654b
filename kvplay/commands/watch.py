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
replay brought, and `"miss"` when it stored blocks that were recomputed, branched or loaded from
another tier: `{"blocks": {reason: n}, "tokens": {reason: n}, "recomputed": [{"session", "reason",
"blocks", "tokens", "removed_at", "evicted_by"}], "branches": [{"session", "reason", "at",
"within_block", "blocks", "tokens", "from", "text"}], "tiers": {TIER: {"stored", "removed",
"hits"}}}`, wire/miss_watch.py) and the last line is the summary
`{"summary": true, "pods": {POD: {"state", "blocks", "by_session", "stored_by_session", "stored",
"removed", "gaps", "replayed", "restarts", "lost", "bad_payloads", "bad_events", "unknown_events",
"other_medium", "mirror_s", "misses"}}}` (`lost`: batches known missed; `bad_*`: frames, payloads or events
rejected at decode; `unknown_events`: event types we do not know; `other_medium`: blocks of
another tier, not mirrored; `mirror_s`: seconds spent decoding, translating and applying the
pod's batches; `misses`: the new blocks by reason — tier, evicted, cleared, config,
isolated, diverged, cold — in blocks and tokens, per session, whose blocks were evicted, the
other tiers, the attribution's memory, and its cost `{"seconds", "of_mirror"}`: its time on this
stream, and that time over `mirror_s`). Without it, one line per second per pod.
`--no-misses` skips the attribution (it costs CPU on a very busy server: see docs/miss.md).
The watched events are recorded as a session (source "watch") unless `--no-record`.
Stops after `--duration` seconds (under any load), on Ctrl-C or on SIGTERM (the summary is still
printed).
"""
from __future__ import annotations

import argparse
import os
import sys

from kvplay.inert import inert, json_dumps
from kvplay.options import KvplayError, add_db_arg
from kvplay.sessions.watch import by_session_text, misses_text, watch
from kvplay.wire.codec import WireError
from kvplay.wire.curve import client_from_args
from kvplay.wire.discovery import discover
from kvplay.wire.remote import ServerDetokenizer
from kvplay.wire.subscriber import TROUBLE, PodSource, check_endpoint, default_pod_name


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
    p.add_argument("--no-misses", action="store_true",
                   help="do not attribute the new blocks (recomputed, branched, other tiers): saves CPU")
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
        print(inert(f"kvplay: {found.via}: pod {s.name}: {how} {s.endpoint}"  # the server's strings
                    f"{', replay ' + s.replay if s.replay else ''}{', topic ' + repr(s.topic) if s.topic else ''}",
                    limit=2048), file=sys.stderr)
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


def url_sources(args, url: str) -> list[PodSource]:
    """A server's pods: the --events/--events-bind given, else what the server at `url` advertises."""
    if args.sources:
        return sources_from_args(args)
    if args.replay or args.pod:
        raise KvplayError("--replay and --pod pair with --events/--events-bind: give the pod's events too")
    return discovered_sources(url, args.api_key, args.topic,
                              client_from_args(args.events_curve_server_key, args.events_curve_key))


def main(args) -> int:
    sources = url_sources(args, args.url) if args.url else sources_from_args(args)
    if args.duration is not None and not args.duration > 0:
        raise KvplayError(f"--duration {args.duration:g}: give a number of seconds above 0")
    if not args.replay_timeout > 0:
        raise KvplayError(f"--replay-timeout {args.replay_timeout:g}: give a number of seconds above 0")
    drops = _drops(args, {s.name for s in sources})
    detok = None
    if args.url and not args.no_misses:
        detok = ServerDetokenizer(args.url, args.api_key)
    try:
        summary = watch(sources, duration=args.duration, replay_timeout=args.replay_timeout, db=args.db,
                        record=not args.no_record, as_json=args.json, drops=drops, misses=not args.no_misses,
                        detokenize=detok)
    finally:
        if detok is not None:
            detok.close()
    if args.json:
        sys.stdout.write(json_dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        for name, s in summary["pods"].items():
            trouble = "".join(f", {k.replace('_', ' ')} {s[k]}" for k in TROUBLE)
            print(f"{inert(name, limit=256)} [{s['state']}]: {s['blocks']} blocks cached; held by "
                  f"{by_session_text(s['by_session']) or '-'}; stored {s['stored']} (by "
                  f"{by_session_text(s['stored_by_session']) or '-'}), removed {s['removed']}, "
                  f"gaps {s['gaps']}, replayed {s['replayed']}, restarts {s['restarts']}{trouble}")
            why = s.get("misses")
            if why:
                text = misses_text(why["blocks"], why["tiers"])
                print(f"  new blocks: {why['blocks']['cold']:,} cold" + (f" · {text}" if text else ""))
                cost = why["cost"]
                if cost["of_mirror"] is not None:
                    print(f"  the attribution took {cost['seconds']:.4g} s, {100 * cost['of_mirror']:.1f} % of the "
                          f"mirror's {s['mirror_s']:.4g} s (--no-misses turns it off)")
    return 0
