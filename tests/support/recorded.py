"""Reading and editing a test's recorded events (sessions/event_log.py: rows of either format)."""
from __future__ import annotations

from kvplay.engine.events import decode_events, encode_events
from kvplay.sessions.event_log import event_dicts, read_batches
from kvplay.sessions.store import open_db


def recorded(db_path, sid: str | None = None, kinds: tuple | None = None) -> list[dict]:
    """The recorded events of session `sid`, or of every session in the DB, in order, as plain
    data (sessions/event_log.event_dicts: each event's fields and its batch's envelope)."""
    db = open_db(db_path, create=False)
    try:
        sids = [sid] if sid else [r[0] for r in db.execute("select id from sessions order by id")]
        out = []
        for s in sids:
            out += event_dicts(read_batches(db, s, kinds)[0])
        return out
    finally:
        db.close()


def drop_recorded(db_path, sid: str, drop) -> int:
    """Remove from session `sid`'s recorded batches every event for which `drop(event)` is true
    (as if it had never been recorded); returns how many went."""
    db = open_db(db_path)
    gone = 0
    try:
        with db.conn:
            for rid, blob in db.execute("select id, events from event_batches where session_id = ?", [sid]).fetchall():
                events, _ = decode_events(blob)
                keep = [e for e in events if not drop(e)]
                if len(keep) != len(events):
                    gone += len(events) - len(keep)
                    db.execute("update event_batches set events = ?, n = ? where id = ?",
                               [encode_events(keep), len(keep), rid])
    finally:
        db.close()
    return gone


def as_batches(dicts: list) -> list:
    """Recorded-form events (dicts: each an event's fields, its kind, and its batch's envelope
    `forwards`, `pod`, `wire_seq`) as the recording reader gives them back: validated, one batch
    per event, a watched pod's blocks named by pod and hash (sessions/event_log.py)."""
    from kvplay.engine.events import EngineBatch, event_from_dict
    from kvplay.sessions.event_log import name_blocks
    from kvplay.wire.translate import Slots

    slots = Slots()
    out = []
    for d in dicts:
        env = {k: d[k] for k in ("forwards", "pod", "wire_seq") if k in d}
        ev = event_from_dict({k: v for k, v in d.items() if k not in env})
        out.append(name_blocks(EngineBatch(0, ev.ts, [ev], **env), slots))
    return out


def as_batch(d: dict):
    """One recorded-form event as the batch a reader gives back (`as_batches`)."""
    return as_batches([d])[0]


def scrubber(db_path, sid: str):
    """The scrubber (tui/scrub.py ScrubApp) on session `sid`'s recording."""
    from kvplay.sessions.history import load_recording
    from kvplay.tui.scrub import ScrubApp

    db = open_db(db_path, create=False)
    try:
        return ScrubApp(load_recording(db, sid))
    finally:
        db.close()
