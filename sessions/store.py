"""Open the sessions database safely.

Default path: `<XDG data dir>/kvplay/sessions.db` (platformdirs); env `KVPLAY_DB` overrides it,
`--db PATH` overrides both. Only the default's folders are created; a `--db` in a missing
folder is refused ("no such directory"). WAL mode so the app and a headless replay can share one DB.

A file that is not SQLite, a DB written by a newer kvplay, a locked DB or an unwritable path
is refused with one clear line (KvplayError) — and such a file is never modified: every check
runs before the first write (WAL mode and migrations are written only after they pass). Readers
(`create=False`) refuse an empty file too; writers treat it as a new database.
"""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import sqlite_utils
from platformdirs import user_data_dir

from kvplay.engine.errors import EngineError

from .migrations import MIGRATIONS_TABLE, is_newer, migrate
from .txn import write_txn  # noqa: F401  (re-exported)

SQLITE_MAGIC = b"SQLite format 3\x00"


class StoreError(EngineError):
    """A sessions DB that cannot be used (one line, exit code 2)."""


def default_db_path() -> Path:
    env = os.environ.get("KVPLAY_DB")
    if env:
        return Path(env).expanduser()

    return Path(user_data_dir("kvplay", appauthor=False)) / "sessions.db"


def resolve_path(path: str | os.PathLike | None) -> Path:
    return Path(path).expanduser() if path else default_db_path()


def _check_file(p: Path) -> None:
    if p.is_dir():
        raise StoreError(f"{p} is a directory, not a sessions database")
    try:
        with open(p, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise StoreError(f"cannot read {p}: {exc.strerror or exc}") from None
    if head and head != SQLITE_MAGIC:
        raise StoreError(f"{p} is not a SQLite database (left unchanged)")


def open_db(path: str | os.PathLike | None = None, create: bool = True,
            timeout: float | None = None) -> sqlite_utils.Database:
    """Open (and migrate) the sessions DB; `create=False` refuses a missing file instead.

    The connection may be used from any thread (callers serialise access with a lock).
    """
    p = resolve_path(path)
    if p.exists():
        _check_file(p)
        if not create and p.is_file() and p.stat().st_size == 0:
            # A reader never writes a schema into someone's empty file. (A writer may: SQLite
            # treats an empty file as an empty database, and `touch x.db; kvplay run --db x.db`
            # clearly asks for a new one.)
            raise StoreError(f"{p} is an empty file, not a sessions database (left unchanged)")
    elif not create:
        raise StoreError(f"no sessions database at {p} (record one with `kvplay run` or the app)")
    else:
        if path:  # a --db the user named: its folder must exist (a typo makes no directories)
            if not p.parent.is_dir():
                what = "not a directory" if p.parent.exists() else "no such directory"
                raise StoreError(f"cannot create a database at {p}: {what}: {p.parent}")
        else:  # the default place (XDG data dir, KVPLAY_DB) is ours to make
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create a database at {p}: {exc.strerror or exc}") from None
        if not os.access(p.parent, os.W_OK):
            raise StoreError(f"cannot create a database at {p}: directory is not writable")
        try:  # owner-only from the start (it holds every prompt; SQLite gives -wal/-shm the same mode)
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot create a database at {p}: {exc.strerror or exc}") from None
    t = float(os.environ.get("KVPLAY_DB_TIMEOUT", "5")) if timeout is None else timeout
    try:
        conn = sqlite3.connect(str(p), timeout=t, check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {p}: {exc}") from None
    try:
        db = sqlite_utils.Database(conn, execute_plugins=False)
        tables = db.table_names()
        if tables and MIGRATIONS_TABLE not in tables:
            raise StoreError(f"{p} is a SQLite database but not a kvplay sessions database (left unchanged)")
        if is_newer(db):
            raise StoreError(f"{p} was written by a newer kvplay (schema {db.execute('PRAGMA user_version').fetchone()[0]}); "
                             "upgrade kvplay to open it (left unchanged)")
        if db.journal_mode != "wal":
            db.enable_wal()
        migrate(db)
        db.execute("PRAGMA foreign_keys = ON")
    except StoreError:
        conn.close()
        raise
    except sqlite3.DatabaseError as exc:
        conn.close()
        msg = str(exc)
        if "locked" in msg or "busy" in msg:
            raise StoreError(f"{p} is locked by another process (tried for {t:g} s)") from None
        if "readonly" in msg or "read-only" in msg or "unable to open" in msg:
            raise StoreError(f"cannot write {p}: {msg}") from None
        if "not a database" in msg or "malformed" in msg:
            raise StoreError(f"{p} is not a usable SQLite database: {msg}") from None
        raise StoreError(f"cannot use {p}: {msg}") from None
    return db

