"""Write transactions that wait for the write lock instead of failing (shared DB, WAL)."""
from __future__ import annotations

import contextlib
import sqlite3

import sqlite_utils

from kvplay.engine.errors import EngineError


class DatabaseBusy(EngineError):
    """The sessions DB stayed locked (or failed) past the busy timeout: one line, exit 2."""


@contextlib.contextmanager
def write_txn(db: sqlite_utils.Database):
    """`db.atomic()` holding the write lock from the start (BEGIN IMMEDIATE).

    With a plain deferred BEGIN, a transaction that reads first (sqlite-utils introspects the
    table) and then writes fails at once with "database is locked" when another connection
    committed in between (WAL snapshot conflict; the busy timeout does not apply). Taking the
    write lock first makes concurrent writers (the app and a replay) wait their turn instead.
    """
    try:
        db.conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        raise DatabaseBusy(f"cannot write to the sessions database: {exc}") from None
    try:
        with db.atomic():  # a savepoint inside our transaction
            yield db
    except sqlite3.Error as exc:
        db.rollback()
        raise DatabaseBusy(f"cannot write to the sessions database: {exc}") from None
    except BaseException:
        db.rollback()
        raise
    try:
        db.conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise DatabaseBusy(f"cannot commit to the sessions database: {exc}") from None
