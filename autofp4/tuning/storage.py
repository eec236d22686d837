"""The checks of an optuna study storage URL (``autofp4 tune --storage``, ``autofp4.tune(storage=)``).

An SQLite storage (any ``sqlite`` dialect, read as SQLAlchemy reads the URL) is a file optuna adds
its tables to and SQLite writes side files beside, so it cannot be: private to the process (in
memory), the tuning DB or another autofp4 tuning DB (both schemas have a ``trials`` table),
another database's -wal/-shm/-journal (SQLite removes or rewrites it), a folder, a FIFO or other
special file, one whose side files are (SQLite blocks on a FIFO), or a path written so that the
file checked here would not be the file SQLAlchemy opens (percent-escapes, which it decodes; a
leading ``~``, which it does not expand). Other databases (PostgreSQL, MySQL) are optuna's to
check.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from urllib.parse import unquote


def _memory_problem(url: str, what: str) -> str | None:
    head, _, rest = url.partition("://")
    if head.lower().split("+")[0] == "sqlite" and rest.split("?", 1)[0] in ("", "/", "/:memory:"):
        return (f"{what} {url} is an in-memory SQLite database, which no other process can share; "
                "name a file (sqlite:///study.db) or leave it out")
    return None


def _written_path(url: str) -> str:
    """The database path of an SQLite URL as written: what follows the authority's ``/``
    (``sqlite:///x.db``: ``x.db``; ``sqlite+pysqlcipher://:pw@/x.db``: ``x.db``), before any query."""
    rest = url.split("://", 1)[1]
    slash = rest.find("/")
    return "" if slash < 0 else rest[slash + 1:].split("?", 1)[0]


def storage_problem(url: str, db_path: str | os.PathLike, what: str = "storage") -> str | None:
    """Why ``url`` cannot be the study storage of a run whose tuning DB is ``db_path`` (``what``:
    the option or argument it came from, for the message); None where it can (or is not SQLite)."""
    from ..db import TuningDBError, expand_path, sqlite_open_problem
    from ..paths import REGULAR, kind_of

    if not isinstance(url, str):
        return f"{what} must be a storage URL string (such as 'sqlite:///study.db'), got {type(url).__name__}"
    if why := _memory_problem(url, what):
        return why
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # no SQLAlchemy, or a URL it cannot read: optuna names it
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    text = _written_path(url)
    if text != parsed.database:
        if "%" in text and unquote(text) == parsed.database:
            return (f"{what} {url:.80}: its path has percent-escapes, which SQLAlchemy decodes ({text!r:.60} is "
                    f"the file {parsed.database!r:.60}); write the path plainly")
        return f"{what} {url:.80}: SQLAlchemy reads its file as {parsed.database!r:.80}, not {text!r:.80}"
    if text.startswith("~"):
        return f"{what} {url:.80}: SQLAlchemy does not expand a leading '~'; give the full path"
    try:  # the checks of a DB file's path: length, a name, not another database's side file
        path = expand_path(text, what, file=True, written=True, sqlite=True)
    except TuningDBError as e:
        return str(e)
    kind = kind_of(path)
    if kind not in (None, REGULAR):
        return f"{what} {url:.80}: {path} is {kind}, not an SQLite file"
    if why := sqlite_open_problem(path, "study storage"):  # SQLite would block on a FIFO there, or destroy a DB
        return f"{what}: {why}"
    lock = path.with_name(path.name + ".ask.lock")  # autofp4's lock beside the study (search._ask_lock_path)
    if kind_of(lock) not in (None, REGULAR):
        return (f"{what} {url:.80}: {lock} (the lock file autofp4 keeps beside the study) is {kind_of(lock)}, "
                "not a file; move it away")
    try:
        same = path.resolve() == Path(db_path).resolve() or (path.exists() and Path(db_path).exists()
                                                             and path.samefile(db_path))
    except OSError:
        same = False
    if same:
        return f"{what} {url} is the tuning DB ({db_path}); optuna's study storage must be another file"
    try:
        if path.is_file() and path.stat().st_size:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if {"results", "environments", "meta"} <= tables:
                return f"{what} {url} is an autofp4 tuning DB; optuna's study storage must be another file"
    except sqlite3.DatabaseError:
        return None  # not SQLite: optuna names it
    return None
