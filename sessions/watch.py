"""The watch loop (`kvplay watch`): subscribe to the pods' KV events, mirror them in a Fleet
(wire/mirror.py), attribute what each pod computed (wire/miss_watch.py: recomputed after a
removal, branches, other tiers), record them as a session (watch_recording.py) and report as it
goes, until the duration is up, Ctrl-C or SIGTERM; the summary of each pod is what it returns.
The human lines quote the servers' session ids inert (kvplay/inert.py).
"""
from __future__ import annotations

import signal
import sys
import time
from collections import Counter

from kvplay.inert import inert, json_dumps
from kvplay.options import KvplayError
from kvplay.wire.codec import WireError
from kvplay.wire.mirror import Fleet
from kvplay.wire.miss_watch import MissWatch
from kvplay.wire.subscriber import TROUBLE, PodSource, Subscriber
from kvplay.wire.translate import counts

from .watch_recording import WatchRecording


def summary_of(fleet: Fleet, sub: Subscriber, misses: MissWatch | None = None) -> dict:
    """The fleet's summary with each pod's state and trouble counts (and what it computed why)."""
    out = fleet.summary()
    for name, s in out["pods"].items():
        info = sub.pod_info(name)
        s.update({"state": info["state"], **{k: info[k] for k in TROUBLE}, "mirror_s": round(info["mirror_s"], 6)})
        if misses is not None:
            s["misses"] = misses.pod(name).summary()
            took = misses.seconds.get(name, 0.0)
            s["misses"]["cost"] = {"seconds": round(took, 6),
                                   "of_mirror": round(took / info["mirror_s"], 4) if info["mirror_s"] else None}
    return out


def misses_text(blocks: dict, tiers: dict | None = None) -> str:
    """`recomputed 12 (evicted 10, cleared 2) · diverged 40 · isolated 4 · CPU hits 6`: blocks by
    reason (a watch's human line and summary), "" when none."""
    parts = []
    again = {k: blocks.get(k, 0) for k in ("evicted", "cleared", "config") if blocks.get(k)}
    if again:
        parts.append(f"recomputed {sum(again.values()):,} (" + ", ".join(f"{k} {v:,}" for k, v in again.items()) + ")")
    for k in ("diverged", "isolated"):
        if blocks.get(k):
            parts.append(f"{k} {blocks[k]:,}")
    for tier, c in (tiers or {}).items():
        if any(c.values()):
            parts.append(inert(f"{tier} +{c['stored']:,} -{c['removed']:,} hits {c['hits']:,}", limit=128))
    return " · ".join(parts)


def by_session_text(counts: dict, top: int = 8) -> str:
    """`alice 12, bob 3, + 2 more`: the `top` largest of {session id: blocks}, the ids inert."""
    common = Counter({k: v for k, v in counts.items() if v}).most_common()
    out = ", ".join(f"{inert(k, limit=64)} {v}" for k, v in common[:top])
    return out + (f", + {len(common) - top:,} more" if len(common) > top else "")


def _human_line(fleet: Fleet, sub: Subscriber, last: dict, misses: MissWatch | None) -> str:
    parts = []
    for name, m in fleet.pods.items():
        prev = last.get(name, (0, 0))
        top = by_session_text(m.by_session, 4)
        info = sub.pod_info(name)
        trouble = "".join(f" {k.replace('_', ' ')} {info[k]}" for k in TROUBLE if info[k])
        parts.append(f"{inert(name, limit=256)} [{m.pod_state}] seq {m.last_seq} blocks {len(m.blocks)}"
                     f"{' (' + top + ')' if top else ''} +{m.stored - prev[0]} -{m.removed - prev[1]}"
                     f" gaps {m.gaps} replayed {m.replayed} restarts {m.restarts}{trouble}")
        if misses is not None and name in misses.pods:
            pm = misses.pods[name]
            why = misses_text(pm.counts["blocks"], pm.tiers)
            if why:
                parts[-1] += " · " + why
        last[name] = (m.stored, m.removed)
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def watch(sources: list[PodSource], duration: float | None = None, replay_timeout: float = 3.0,
          db: str | None = None, record: bool = True, as_json: bool = False,
          drops: list[tuple[str, list[int]]] = (), out=None, misses: bool = True,
          detokenize=None) -> dict:
    """Mirror `sources` until `duration` seconds are up (None: until Ctrl-C or SIGTERM), printing
    one JSON line per applied batch to `out` (stdout) when `as_json`, else one line per second
    per pod; the watched events are recorded as a session in `db` when `record`. `misses`:
    attribute what each pod computed (wire/miss_watch.py; `detokenize(ids)` gives branch points
    their text). `drops`: live batches to drop on purpose (pod, seqs), for tests of the gap
    handling. Returns the summary."""
    out = out or sys.stdout
    fleet = Fleet()
    for s in sources:
        fleet.pod(s.name)
    recording = None
    why = MissWatch(fleet, detokenize=detokenize) if misses else None

    def on_batch(pod, seq, batch, replayed):
        if recording is not None:
            recording.on_batch(pod, seq, batch)
        miss = why.on_batch(pod, batch, as_json) if why is not None else None
        if as_json:
            stored, removed, cleared = counts(batch)
            d = {"pod": pod, "seq": seq, "stored": stored, "removed": removed, "cleared": cleared}
            if replayed:
                d["replayed"] = True
            if miss:
                d["miss"] = miss
            out.write(json_dumps(d) + "\n")

    def on_restart(pod, batch):
        if recording is not None:
            recording.on_restart(pod, batch)
        if why is not None:
            why.on_batch(pod, batch)

    def on_state(pod, state):
        print(f"kvplay: pod {inert(pod, limit=256)} is {state}", file=sys.stderr, flush=True)

    last: dict = {}

    def tick():
        if recording is not None:
            recording.flush()
        if as_json:
            out.flush()
        else:
            print(_human_line(fleet, sub, last, why), flush=True)

    try:
        sub = Subscriber(sources, fleet, on_batch=on_batch, on_state=on_state, on_restart=on_restart,
                         replay_timeout=replay_timeout).open()
    except WireError as exc:
        raise KvplayError(str(exc)) from None
    if record:  # after the sockets opened: a refused watch records nothing
        try:
            recording = WatchRecording(db, title="watch " + " ".join(s.name for s in sources))
        except BaseException:
            sub.close()
            raise
    for pod, seqs in drops:
        sub.drop_live(pod, seqs)
    if recording is not None:
        print(f"kvplay: recording the watched events as session {recording.session_id} in {recording.path}",
              file=sys.stderr)
    if not as_json:
        for s in sources:
            how = "bound" if s.bind else "connected to"
            print(inert(f"kvplay: pod {s.name}: {how} {sub.endpoint(s.name)}"
                        f"{', replay ' + s.replay if s.replay else ', no replay endpoint'}", limit=1024), file=sys.stderr)
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
        sub.run(duration, tick=tick)
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: the summary still follows
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        summary = summary_of(fleet, sub, why)
        sub.close()
        if recording is not None:
            recording.close()
    return summary
