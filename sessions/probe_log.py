"""An audit's requests in the sessions DB (`kvplay audit URL`, labs/audit.py), as they are sent.

A run is a session of source "audit" (listed by `kvplay sessions`, shown by `kvplay show`): its
`params` hold the run's parameters (JSON), and every request it sends is one turn — the prompt,
the client-side TTFT, the server's prompt and cached token counts, the error if it failed — with
`probe` saying what the request was in the procedure (JSON: procedure, kind, role, level …).
Each turn is committed on its own as soon as its request ends, so a run that is interrupted (or
fails on a bad answer) keeps every probe it sent; `ProbeLog.reopen` continues it. API keys are
never written: only the fingerprints the caller puts in `params`.
"""
from __future__ import annotations

import json
import threading
import time

from .ids import new_ulid
from .query import resolve_session
from .recorder import versions
from .store import StoreError, open_db, resolve_path
from .txn import write_txn

SOURCE = "audit"


class ProbeLog:
    """One audit run in the sessions DB; `add` may be called from several threads."""

    def __init__(self, db, session_id: str, path: str, params: dict):
        self.db = db
        self.session_id = session_id
        self.path = path
        self.params = params
        self._lock = threading.Lock()
        self._seq = db.execute("select coalesce(max(seq), 0) from turns where session_id = ?",
                               [session_id]).fetchone()[0]

    @classmethod
    def create(cls, db_path: str | None, model: str, title: str, params: dict, users: list[tuple[str, str]]) -> "ProbeLog":
        """A new run: its session row, with `users` as (name, group) rows (the keys' roles)."""
        db = open_db(db_path)
        db.execute("PRAGMA synchronous = NORMAL")  # a commit survives the process dying
        sid = new_ulid()
        with write_txn(db):
            db["sessions"].insert({
                "id": sid, "created": time.time(), "ended": None, "source": SOURCE, "model": model,
                "engine_config": None, "versions": json.dumps(versions()), "system_prompt": "",
                "script_path": None, "replay_of": None, "title": title, "params": json.dumps(params),
            })
            for name, group in users:
                db["users"].insert({"session_id": sid, "name": name, "group": group})
        return cls(db, sid, str(resolve_path(db_path)), params)

    @classmethod
    def reopen(cls, db_path: str | None, ident: str) -> "ProbeLog":
        """An earlier run (id or unique prefix), to continue it; refuses a session that is not one."""
        db = open_db(db_path, create=False)
        try:
            s = resolve_session(db, ident)
            if s["source"] != SOURCE or not s.get("params"):
                raise StoreError(f"session {s['id']} is not an audit run (its source is {s['source']!r})")
            try:
                params = json.loads(s["params"])
            except ValueError:
                raise StoreError(f"session {s['id']}: its audit parameters are damaged") from None
            if not isinstance(params, dict):
                raise StoreError(f"session {s['id']}: its audit parameters are damaged")
        except BaseException:
            db.close()
            raise
        db.execute("PRAGMA synchronous = NORMAL")
        return cls(db, s["id"], str(resolve_path(db_path)), params)

    def save_params(self, params: dict) -> None:
        self.params = params
        with self._lock, write_txn(self.db):
            self.db["sessions"].update(self.session_id, {"params": json.dumps(params), "ended": None})

    def add(self, user: str, text: str, probe: dict, started: float, ended: float, ttft_ms: float | None = None,
            prompt_tokens: int | None = None, cached_tokens: int | None = None, output_tokens: int | None = None,
            reply: str = "", request_id: str | None = None, error: str | None = None,
            sampling: dict | None = None) -> int:
        """Commit one request as a turn; returns its seq."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            computed = None if prompt_tokens is None or cached_tokens is None else prompt_tokens - cached_tokens
            with write_txn(self.db):
                self.db["turns"].insert({
                    "id": new_ulid(), "session_id": self.session_id, "seq": seq, "user": user, "text": text,
                    "reply": reply, "messages": None, "sampling": json.dumps(sampling or {}), "seed": None,
                    "at": None, "started": started, "ended": ended, "request_id": request_id, "ttft_ms": ttft_ms,
                    "decode_tok_s": None, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
                    "computed_tokens": computed, "output_tokens": output_tokens, "cached_from": None,
                    "preemptions": None, "finish_reason": None if error is None else "error", "error": error,
                    "token_ids": None, "probe": json.dumps(probe),
                })
        return seq

    def probes(self) -> list[dict]:
        """Every recorded request, in order: the turn's columns with `probe` parsed (rows whose
        `probe` is damaged are left out)."""
        out = []
        with self._lock:
            rows = list(self.db.query(
                "select seq, user, started, ended, ttft_ms, prompt_tokens, cached_tokens, output_tokens, error, probe "
                "from turns where session_id = ? order by seq", [self.session_id]))
        for r in rows:
            try:
                probe = json.loads(r["probe"]) if r["probe"] else None
            except ValueError:
                probe = None
            if isinstance(probe, dict):
                r["probe"] = probe
                out.append(r)
        return out

    def close(self, ended: bool = True) -> None:
        """Close the DB; `ended` marks the run finished (an interrupted run stays unfinished)."""
        try:
            if ended:
                with self._lock, write_txn(self.db):
                    self.db["sessions"].update(self.session_id, {"ended": time.time()})
        finally:
            self.db.close()
