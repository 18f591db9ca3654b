"""Read recorded sessions: resolve an id (or unique prefix), load users and turns, and turn a
session back into a Script (for export and replay in the app)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvplay.engine.events import AllBlocksCleared, MissExplained, RequestQueued, SettingsChanged, UserGroupChanged
from kvplay.engine.miss import miss_from_event

from .event_log import count_events, event_dicts, read_batches
from .script import Script, TurnSpec, UserSpec
from .store import StoreError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed")


def resolve_session(db, ident: str) -> dict:
    ident = (ident or "").strip().upper()
    if not ident:
        raise StoreError("no session id given")
    rows = list(db.query("select * from sessions where id = ?", [ident]))
    if not rows:
        rows = list(db.query("select * from sessions where id like ? order by id", [ident + "%"]))
    if not rows:
        raise StoreError(f"unknown session id {ident!r} (see `kvplay sessions`)")
    if len(rows) > 1:
        raise StoreError(f"session id prefix {ident!r} is ambiguous ({len(rows)} sessions match)")
    row = rows[0]
    for k in ("engine_config", "versions", "stats"):
        row[k] = json.loads(row[k]) if row.get(k) else {}
    return row


def session_users(db, sid: str) -> list[dict]:
    return list(db.query("select * from users where session_id = ? order by rowid", [sid]))


def session_turns(db, sid: str) -> list[dict]:
    rows = list(db.query("select * from turns where session_id = ? order by seq", [sid]))
    for r in rows:
        for k in ("messages", "sampling", "cached_from", "token_ids", "prompt_ids"):
            r[k] = json.loads(r[k]) if r.get(k) else ({} if k in ("sampling", "cached_from") else [])
    return rows


def with_misses(db, sid: str, turns: list[dict], events: list | None = None) -> list[dict]:
    """Give each turn its `miss` object (why its uncached prompt tokens were computed), from the
    session's MissExplained events (`events`: the session's events, when already read); None for
    turns recorded before kvplay explained misses."""
    if events is None:
        events = [e for b in read_batches(db, sid, ("MissExplained",))[0] for e in b.events]
    misses = {e.request_id: miss_from_event(e) for e in events if type(e) is MissExplained}
    for t in turns:
        t["miss"] = misses.get(t.get("request_id"))
    return turns


TIMELINE_KINDS = ("UserGroupChanged", "SettingsChanged", "AllBlocksCleared", "RequestQueued")
# The clears a replay makes again: F4 / an admin reset ("cleared"). A "reconfigured" clear is
# made by the settings change right before it (hash, seed, determinism), which the replay makes
# again too: clearing first would turn its blocks' reason from `config` into `cleared`. A watched
# server's restart is no change of this engine.
CLEAR_REASONS = ("cleared",)


def timeline_events(db, sid: str) -> list:
    """The recorded events `settings_timeline` reads (settings, groups, clears and each request's
    queueing), in order, without loading the session's cache events."""
    batches = read_batches(db, sid, TIMELINE_KINDS)[0]  # a damaged row is skipped, never a traceback
    return [e for b in batches for e in b.events]


@dataclass
class Changes:
    """What changed in the engine before one turn was queued: the user's group ("" = none;
    None: unchanged), whether the cache was emptied, and the settings' new values."""
    group: str | None = None
    clear: bool = False
    engine: dict = field(default_factory=dict)


def settings_timeline(users: list[dict], turns: list[dict], events: list) -> tuple[dict, dict]:
    """(each user's group when the session began, {turn seq: Changes made before it}) from the
    recorded `UserGroupChanged`, `SettingsChanged` and `AllBlocksCleared` events, placed by the
    turns' `RequestQueued` events.

    A group only salts its own user's requests, so a change applies at that user's next turn. A
    settings change or a clear applies to the whole engine, so it lands on the next turn queued
    after it (changes after the last turn change nothing that was recorded). Several changes
    between two turns merge: the last value of each field, and `clear` when any of them was a
    clear (F4; clearing first, then setting, ends in the same state as any order of the two; a
    change that needs a fresh cache empties it by itself, see CLEAR_REASONS).
    The users table holds a user's group as first registered (`kvplay run`) or as last set (the
    app): the first change's `old_group` is the starting one either way."""
    start = {u["name"]: u.get("group") for u in users}
    seq_of = {t["request_id"]: t for t in turns if t.get("request_id")}
    seen: set = set()
    groups: dict = {}
    engine: dict = {}
    clear = False
    at_turn: dict = {}
    for e in events:
        cls = type(e)
        if cls is UserGroupChanged:
            user = e.user
            if user not in seen:
                seen.add(user)
                start[user] = e.old_group
            groups[user] = e.new_group or ""
        elif cls is SettingsChanged:
            engine.update(e.changes)
        elif cls is AllBlocksCleared and e.reason in CLEAR_REASONS:
            clear = True
        elif cls is RequestQueued and e.request_id in seq_of:
            t = seq_of[e.request_id]
            ch = Changes(group=groups.pop(t["user"], None), clear=clear, engine=engine)
            if ch.group is not None or ch.clear or ch.engine:
                at_turn[t["seq"]] = ch
            engine, clear = {}, False
    return start, at_turn


def submit_order(turns: list[dict]) -> list[dict]:
    """Turns in the order they were submitted (seq is the order they finished)."""
    return sorted(turns, key=lambda t: (t.get("started") or 0.0, t["seq"]))


def list_sessions(db, limit: int | None = None) -> list[dict]:
    sql = """
      select s.id, s.created, s.ended, s.source, s.model, s.replay_of, s.script_path, s.title,
        (select count(*) from users u where u.session_id = s.id) as users,
        (select count(*) from turns t where t.session_id = s.id) as turns,
        (select sum(cached_tokens) from turns t where t.session_id = s.id) as cached,
        (select sum(prompt_tokens) from turns t where t.session_id = s.id) as prompt
      from sessions s order by s.id desc"""
    if limit:
        sql += f" limit {int(limit)}"
    return list(db.query(sql))


def session_script(db, session: dict, timed: bool = False) -> Script:
    """A `kvplay run` script reproducing the session: engine table, system prompt, users with
    seeds, and every turn with its exact sampling (and `at` where the original had one).
    `timed`: give every turn `at` = its recorded submit offset (to play at the recorded pace)."""
    cfg = dict(session.get("engine_config") or {})
    rows = session_users(db, session["id"])
    recorded = session_turns(db, session["id"])
    start, changes = settings_timeline(rows, recorded, timeline_events(db, session["id"]))
    users = []
    for u in rows:
        u = dict(u, group=start.get(u["name"]))
        kw = {k: u[k] for k in ("group", "seed", "colour") if u.get(k) is not None}
        for k in ("temperature", "max_tokens", "top_p", "top_k"):
            if u.get(k) is not None:
                kw[k] = u[k]
        users.append(UserSpec(u["name"], **kw))
    turns = []
    names = {u.name for u in users}
    ordered = submit_order(recorded)
    t0 = min((t["started"] for t in ordered if t.get("started") is not None), default=0.0)
    for t in ordered:
        s = t["sampling"]
        at = t.get("at")
        if timed and t.get("started") is not None:
            at = round(t["started"] - t0, 3)
        ch = changes.get(t["seq"]) or Changes()
        turns.append(TurnSpec(t["user"], t["text"], at=at, group=ch.group, clear=ch.clear or None,
                              engine=ch.engine or None,
                              **{k: s.get(k) for k in SAMPLING_KEYS if s.get(k) is not None}))
        if t["user"] not in names:  # a user the app never registered
            users.append(UserSpec(t["user"]))
            names.add(t["user"])
    return Script(engine=cfg, system=session.get("system_prompt") or "", users=users, turns=turns)


def load_session(db, ident: str, events: bool = False) -> dict:
    """A session (id or unique prefix) as one dict: its row, users and turns, and its recorded
    events (`events`; `bad_events` counts damaged ones) or their count."""
    s = resolve_session(db, ident)
    out = dict(s)
    out["users"] = session_users(db, s["id"])
    out["turns"] = with_misses(db, s["id"], session_turns(db, s["id"]))
    for u in out["users"]:
        u.pop("session_id", None)
    for t in out["turns"]:
        t.pop("session_id", None)
    if events:
        batches, bad = read_batches(db, s["id"])
        out["events"] = event_dicts(batches)
        if bad:
            out["bad_events"] = bad
    else:
        out["event_count"] = count_events(db, s["id"])
    return out
