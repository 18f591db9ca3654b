"""Block-level traces: read one out of a recorded session (for the simulator), and export or
import them as files other tools read (vLLM KV events, Mooncake-style request traces)."""
from __future__ import annotations

import json

from kvplay.engine.config import EngineConfig

from .history import recorded_pool_size, session_events
from .query import resolve_session, session_turns, session_users
from .simulate import Clear, Trace, TraceRequest
from .store import StoreError


def session_config(session: dict, events: list[dict] | None = None) -> EngineConfig:
    """The engine settings a session ran under, with the pool size resolved."""
    cfg = EngineConfig.from_dict(dict(session.get("engine_config") or {}), where=f"session {session['id']}: engine config")
    if cfg.num_blocks is None:
        n = recorded_pool_size(session, events or [])
        if not n:
            raise StoreError(f"session {session['id']} did not record its pool size; "
                             "give --num-blocks to simulate it")
        cfg = cfg.replace(num_blocks=n)
    return cfg


def session_trace(db, ident: str) -> Trace:
    """The block-level trace of a recorded session: its turns in the order they reached the engine,
    each with the step clock and the requests finished before it (see sessions/simulate.py)."""
    session = resolve_session(db, ident)
    sid = session["id"]
    turns = {t["request_id"]: t for t in session_turns(db, sid) if t.get("request_id")}
    events = session_events(db, sid)
    groups = {u["name"]: u.get("group") for u in session_users(db, sid)}
    items: list = []
    finished: set[str] = set()
    queued: set[str] = set()
    for e in events:
        kind = e.get("kind")
        if kind == "RequestQueued" and e.get("request_id") in turns:
            t = turns[e["request_id"]]
            if not t.get("prompt_ids"):
                raise StoreError(f"session {sid}: turn {t['seq']} has no recorded prompt token ids "
                                 "(recorded by an older kvplay); record it again to simulate it")
            items.append(TraceRequest(
                t["request_id"], t["user"], list(t["prompt_ids"]), list(t.get("token_ids") or []),
                group=groups.get(t["user"]), system_tokens=t.get("system_tokens") or 0,
                stop=t.get("finish_reason") == "stop", clock=e.get("forwards"),
                after=frozenset(finished & set(turns)), cached_tokens=t.get("cached_tokens"), ts=e.get("ts")))
            queued.add(t["request_id"])
        elif kind == "RequestFinished":
            finished.add(e.get("request_id"))
        elif kind == "UserGroupChanged":
            groups[e.get("user")] = e.get("new_group")
        elif kind == "AllBlocksCleared":
            items.append(Clear(e.get("forwards"), frozenset(finished & set(turns)), e.get("reason") or "cleared"))
    if not any(isinstance(i, TraceRequest) for i in items):
        raise StoreError(f"session {sid} has no recorded requests to simulate")
    stats = session.get("stats") or {}
    hit, query = stats.get("hit_tokens"), stats.get("query_tokens")
    if hit is None:  # unfinished session: the turns' own counts
        done = [t for t in turns.values() if t.get("request_id") in queued and t.get("prompt_tokens")]
        hit = sum(t.get("cached_tokens") or 0 for t in done)
        query = sum(t["prompt_tokens"] for t in done if t.get("error") is None)
    return Trace(session_config(session, events), session.get("model") or "", items,
                 source=f"session {sid}", recorded_hit_tokens=hit, recorded_query_tokens=query)
