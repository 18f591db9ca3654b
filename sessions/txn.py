"""Write transactions that wait for the write lock instead of failing (shared DB, WAL)."""
from __future__ import annotations

import contextlib

import sqlite_utils


@contextlib.contextmanager
def write_txn(db: sqlite_utils.Database):
    """`db.atomic()` holding the write lock from the start (BEGIN IMMEDIATE).

    With a plain deferred BEGIN, a transaction that reads first (sqlite-utils introspects the
    table) and then writes fails at once with "database is locked" when another connection
    committed in between (WAL snapshot conflict; the busy timeout does not apply). Taking the
    write lock first makes concurrent writers (the app and a replay) wait their turn instead.
    """
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        with db.atomic():  # a savepoint inside our transaction
            yield db
    except BaseException:
        db.rollback()
        raise
    db.conn.execute("COMMIT")
