"""The tuning database: SQLite (through sqlite-utils) plus portable JSON exports.

Tables
------
``results``       the winning config per (op, fmt, dtype, backend, m_bucket, n, k, experts,
                  topk, env_key) with its timing evidence (median, spread, samples) and its
                  ``origin`` (``offline``: a tuning run; ``jit``: tuned on a workload's call).
``trials``        every config the tuner tried, including failures (never retried).
``environments``  env_key -> the :class:`~autofp4.schema.Environment` as JSON.
``meta``          the schema version; :data:`MIGRATIONS` bring older files up to date.

The file runs in WAL mode with a long busy timeout, so several tuner processes can write to
one database at the same time; every write is one ``BEGIN IMMEDIATE`` transaction, so a
killed process leaves only complete rows. :class:`ChangeMonitor` tells a reader cheaply that
another connection committed. Exports are sorted, pretty JSON validated with the
pydantic models on import (never executed), read in chunks with bounded memory.
"""
from __future__ import annotations

import codecs
import json
import math
import os
import re
import sqlite3
import stat
import time
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, BinaryIO, Callable, Collection, Iterable, Iterator, Mapping

import sqlite_utils
from pydantic import ValidationError

from . import paths
from .paths import DANGLING_LINK, REGULAR, kind_of
from .problem import DEFAULT_M_BUCKETS, bucket_for
from .schema import (
    EXPORT_SCHEMA_VERSION,
    KEY_FIELDS,
    MAX_RECORDS,
    SUPPORTED_EXPORT_VERSIONS,
    Environment,
    ExportDoc,
    ExportedRecord,
    TrialRecord,
    TuningRecord,
    config_json,
    format_timestamp,
    parse_timestamp,
    utc_now,
)

BUSY_TIMEOUT_S = 30.0
#: how long a read-only connection (the dispatcher's lookups, ``db list``) waits on a lock; in WAL
#: mode writers never block readers, so only another program's exclusive lock makes it wait
READ_BUSY_TIMEOUT_S = 2.0
MAX_IMPORT_BYTES = 256 * 2**20
#: an export is read this many bytes at a time
READ_CHUNK_BYTES = 2**20
#: the largest record of an export (a valid one is well under 16 KiB), the largest other value
#: at its top level (``environments``: 10,000 environments fit) and the largest key
MAX_RECORD_CHARS = 2**20
MAX_VALUE_CHARS = 8 * 2**20
MAX_KEY_CHARS = 4096
#: errors listed for an invalid export; the validation of its records stops there
MAX_REPORTED_ERRORS = 20
SQLITE_MAGIC = b"SQLite format 3\x00"

_RESULT_COLUMNS = (
    *KEY_FIELDS,
    "env_key",
    "config",
    "median_us",
    "spread_us",
    "samples",
    "default_median_us",
    "backend_source",
    "created_at",
    "origin",
)
_TRIAL_COLUMNS = (
    *KEY_FIELDS,
    "m",
    "env_key",
    "config",
    "outcome",
    "median_us",
    "spread_us",
    "error",
    "backend_source",
    "created_at",
)
_UNIQUE = (*KEY_FIELDS, "env_key")


class TuningDBError(Exception):
    """A database file that cannot be opened, read, migrated or written."""


class TuningFileError(ValueError):
    """An export file that cannot be read or does not validate (the message names the file)."""


class TuningDBWarning(UserWarning):
    """A layer (DB or JSON file) or a row that was skipped while loading tuning results."""


def _is_readonly_error(e: sqlite3.Error) -> bool:
    """SQLITE_READONLY and its extended codes (a read-only file, folder, mount or connection)."""
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == sqlite3.SQLITE_READONLY
    return "readonly database" in str(e)


#: the files SQLite keeps beside a database, by suffix, and what each is
SQLITE_SIDE_FILES = {"-wal": "write-ahead log", "-shm": "shared-memory index", "-journal": "rollback journal"}


#: the first bytes of an SQLite rollback journal
_JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


def _side_file_problem(path: Path, e: sqlite3.Error | None = None) -> str | None:
    """Why SQLite cannot use one of the files it keeps beside ``path`` (-wal, -shm, -journal; beside
    the file a symbolic link ``path`` leads to, where SQLite keeps them): one that is a directory, a
    link to nothing or a special file (SQLite would block for ever opening a FIFO), or an SQLite
    database (a tuning DB there: SQLite would take it for its own and delete or rewrite it; its own
    journal, log and index begin otherwise); None where each is SQLite's own or absent. ``e``: the
    error SQLite gave, if any."""
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        real = path
    for suffix, base in [(s, b) for b in dict.fromkeys((path, real)) for s in SQLITE_SIDE_FILES]:
        side = base.with_name(base.name + suffix)
        try:
            kind = f"a symbolic link (to {os.readlink(side)!r:.80}); SQLite keeps its own file there"
        except OSError:  # no link there
            kind = kind_of(side)
        if kind not in (None, REGULAR):
            return (f"cannot open {path}: {side} (SQLite's {suffix[1:]} file beside it) is not a regular file: it is "
                    f"{kind}; move it away" + (f" ({e})" if e is not None else ""))
        if kind == REGULAR and is_sqlite_file(side):
            return (f"{side} is an SQLite database (a tuning DB?), and SQLite opening {path} would take it for its "
                    f"{SQLITE_SIDE_FILES[suffix]} and delete or rewrite it; rename or move one of them")
    return None


def _readonly_message(path: Path, e: sqlite3.Error) -> str:
    side = _side_file_problem(path, e)
    if side:
        return side
    return (f"{path} is read-only: this process cannot write the tuning database (the file or its folder "
            f"is not writable, is immutable, or is on a read-only file system): {e}")


# --------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------


def is_sqlite_file(path: str | os.PathLike) -> bool:
    """Is ``path`` a regular file that begins as an SQLite database does?"""
    if kind_of(path) != REGULAR:
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def sqlite_would_open(path: str | os.PathLike) -> bool:
    """Would SQLite open ``path`` as a database (and so own the side files named after it)? An
    SQLite file, or an empty regular file (SQLite takes it for an empty database). Other files
    are not opened by autofp4 (:class:`TuningDB` refuses them before SQLite reads them)."""
    if is_sqlite_file(path):
        return True
    try:
        return kind_of(path) == REGULAR and os.path.getsize(path) == 0
    except OSError:
        return False


def sqlite_open_problem(path: Path, what: str = "tuning database") -> str | None:
    """Why SQLite must not open ``path`` (``what``: the database it is to hold, for the message;
    checked before SQLite opens it, as it may change files there at once):
    a file that is no SQLite database (SQLite takes one shorter than its header for an empty
    database and writes over it, and deletes what it takes for its journal), or a side file it
    cannot use or would destroy (:func:`_side_file_problem`)."""
    try:
        if kind_of(path) == REGULAR and path.stat().st_size and not is_sqlite_file(path):
            return (f"{path} is not a readable {what}: it is not an SQLite file (it does not begin as one), "
                    "and SQLite would take the files named after it for its own; name an SQLite database file, or a "
                    "new one")
    except OSError:
        pass
    return _side_file_problem(path)


def _not_a_db_file_name(text: str) -> str | None:
    """Names that a DB path cannot mean, beyond :func:`.paths.path_problem`'s."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text.strip()):
        return ("it is a URL, and a tuning DB is a file path (a storage URL such as sqlite:///x.db goes to "
                "autofp4 tune --storage)")
    if text.lstrip()[:5].lower() == "file:":
        return ("it is an SQLite URI (file:...), which SQLite reads its own way (a mode=memory one keeps the rows "
                "in memory only); give the DB file's plain path")
    if text.strip() == ":memory:":
        return ("it names SQLite's in-memory database, whose rows are lost when the process ends; "
                "name a DB file (such as ./tuning.db)")
    for suffix, what in SQLITE_SIDE_FILES.items():
        stem = text[:-len(suffix)]
        if text.endswith(suffix) and stem and sqlite_would_open(os.path.expanduser(stem)):
            return (f"it is where SQLite keeps the {what} of the database {stem}, which removes or rewrites that "
                    "file as it writes the database (a DB there would be lost); name another file")
    return None


#: the longest absolute path (bytes) SQLite opens a database by: its unix build keeps a
#: database's path with "-journal" after it within 512 bytes (measured: 504 opens, 505 does not)
SQLITE_PATH_MAX = 504


def sqlite_path_problem(path: str | os.PathLike) -> str | None:
    """Why SQLite cannot open a database at ``path`` by its length (as an absolute path, and with
    its symbolic links resolved, as SQLite opens it), or None."""
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    n = len(os.fsencode(full))
    if n > SQLITE_PATH_MAX:
        return (f"it is {n} bytes long as an absolute path, and SQLite opens a database only by a path of at most "
                f"{SQLITE_PATH_MAX} bytes; give a shorter path")
    try:
        real = os.path.realpath(full)
    except (OSError, ValueError):
        return None
    if len(os.fsencode(real)) > SQLITE_PATH_MAX:
        return (f"it leads through symbolic links to {real[:60]!r}..., {len(os.fsencode(real))} bytes long, and SQLite "
                f"opens a database by its resolved path, of at most {SQLITE_PATH_MAX} bytes; give a shorter path")
    return None


def expand_path(path: str | os.PathLike, what: str, file: bool = False, written: bool = False,
                sqlite: bool = False) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; :class:`TuningDBError` naming ``what``
    (the variable or option it came from) where that cannot be done (no such user, no home), or
    where no DB file can have that name (:func:`.paths.path_problem`: empty, a control character,
    a folder's name; a URL, an SQLite URI, ``:memory:``; with ``sqlite``, an SQLite database's
    path longer than SQLite opens)."""
    out = paths.expand_path(path, what, file=file, error=TuningDBError, first=_not_a_db_file_name, written=written)
    if sqlite and (why := sqlite_path_problem(out)):
        raise TuningDBError(f"{what}={os.fsdecode(os.fspath(path))!r:.80}: {why}")
    return out


def default_db_path() -> Path:
    """``$AUTOFP4_DB`` if set, else ``$XDG_CACHE_HOME/autofp4/tuning.db`` (default ``~/.cache``).
    An empty variable counts as unset; a whitespace-only one (or one with a NUL byte) is refused
    (:class:`TuningDBError` naming it)."""
    env = os.environ.get("AUTOFP4_DB")
    if env:
        return expand_path(env, "AUTOFP4_DB", file=True, written=True, sqlite=True)
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache and os.path.isabs(os.path.expanduser(cache)):  # a relative one is ignored (the XDG spec)
        return expand_path(cache, "XDG_CACHE_HOME") / "autofp4" / "tuning.db"
    try:
        home = Path.home()
    except RuntimeError:
        raise TuningDBError("the default tuning DB is in the home directory, and there is none (HOME is unset "
                            "and the user has no entry): set AUTOFP4_DB or XDG_CACHE_HOME") from None
    return home / ".cache" / "autofp4" / "tuning.db"


def shipped_db_dir() -> Path:
    """The folder of shipped exports: ``$AUTOFP4_SHIPPED_DB`` if set, else the repo's ``tuning_db/``
    (``$AUTOFP4_SHIPPED_DB`` may also name one export file: see :func:`shipped_db_files`)."""
    env = os.environ.get("AUTOFP4_SHIPPED_DB")
    if env:
        return expand_path(env, "AUTOFP4_SHIPPED_DB")
    return Path(__file__).resolve().parents[1] / "tuning_db"


def shipped_db_files() -> list[Path]:
    """The shipped exports the dispatcher reads, in its order: the ``*.json`` files of
    :func:`shipped_db_dir`, or that path itself where ``$AUTOFP4_SHIPPED_DB`` names a file."""
    shipped = shipped_db_dir()
    if shipped.is_dir():
        return sorted(shipped.glob("*.json"))
    return [shipped] if shipped.is_file() else []


# --------------------------------------------------------------------------------------
# migrations: MIGRATIONS[i] takes a database from version i to version i + 1
# --------------------------------------------------------------------------------------
def _m1_initial(db: sqlite_utils.Database) -> None:
    """Version 1: the four tables and the results' unique key."""
    existing = set(db.table_names()) & {"results", "trials", "environments"}
    if existing:
        raise TuningDBError(
            f"not an autofp4 tuning database: it has no version but already holds tables {sorted(existing)}"
        )
    key_cols: dict[str, Any] = {
        "op": str, "fmt": str, "dtype": str, "backend": str,
        "m_bucket": int, "n": int, "k": int, "experts": int, "topk": int,
    }
    db["environments"].create({"env_key": str, "env": str}, pk="env_key", not_null={"env"})
    db["results"].create(
        {
            "id": int, **key_cols, "env_key": str, "config": str,
            "median_us": float, "spread_us": float, "samples": int, "default_median_us": float,
            "backend_source": str, "created_at": str,
        },
        pk="id",
        not_null={*key_cols, "env_key", "config", "median_us", "spread_us", "samples", "created_at"},
    )
    db["results"].create_index(list(_UNIQUE), index_name="results_unique_key", unique=True)
    db["trials"].create(
        {
            "id": int, **key_cols, "m": int, "env_key": str, "config": str, "outcome": str,
            "median_us": float, "spread_us": float, "error": str, "backend_source": str,
            "created_at": str,
        },
        pk="id",
        not_null={*key_cols, "m", "env_key", "config", "outcome", "created_at"},
    )


def _m2_lookup_indexes(db: sqlite_utils.Database) -> None:
    """Version 2: indexes for the tuner's failure lookups and per-environment queries."""
    db["trials"].create_index(
        ["op", "fmt", "dtype", "backend", "n", "k", "experts", "topk", "env_key", "outcome"],
        index_name="trials_problem", if_not_exists=True,
    )
    db["results"].create_index(["env_key"], index_name="results_env", if_not_exists=True)


def _m3_origin(db: sqlite_utils.Database) -> None:
    """Version 3: ``results.origin``, how a row was tuned (``offline`` for the rows already there).
    A file that has it already (its stored version set back by hand) keeps it."""
    if "origin" not in db["results"].columns_dict:
        db["results"].add_column("origin", str, not_null_default="offline")


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_m1_initial, _m2_lookup_indexes, _m3_origin]
SCHEMA_VERSION = len(MIGRATIONS)
#: the oldest version a read-only connection reads as it is (the columns added since then take
#: their defaults); older files must be opened writable once, which migrates them
READ_AS_IS_FROM = 2

#: indexes that speed up reads without changing what a file holds: created when a file is
#: opened writable without them (no new schema version, so older autofp4 still reads the file).
#: ``results_problem``: the rows of one problem in one environment, what the dispatcher reads
#: the first time it meets a problem and the tuner before each job, in the order
#: :meth:`TuningDB.results` returns them (so SQLite needs no sort and prefers this index).
EXTRA_INDEXES: dict[str, tuple[str, tuple[str, ...]]] = {
    "results_problem": ("results", ("env_key", "op", "fmt", "dtype", "n", "k", "experts", "topk", "backend", "m_bucket")),
}


# --------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------
@dataclass
class Conflict:
    """Both sides hold a row for ``key`` and their configs differ."""

    key: dict[str, Any]
    ours: TuningRecord
    theirs: TuningRecord
    winner: str  # "ours" | "theirs"

    def describe(self) -> str:
        return (
            f"{self.ours.describe()} env={self.key['env_key']}: ours {config_json(self.ours.config)} "
            f"{self.ours.median_us:.2f}us x{self.ours.samples} vs theirs {config_json(self.theirs.config)} "
            f"{self.theirs.median_us:.2f}us x{self.theirs.samples} -> keep {self.winner}"
        )


@dataclass
class MergeReport:
    """What a merge (or import) did, counted per result row."""

    source: str
    added: int = 0
    replaced: int = 0
    kept: int = 0
    identical: int = 0
    environments_added: int = 0
    conflicts: list[Conflict] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.added + self.replaced + self.kept + self.identical

    def summary(self) -> str:
        return (
            f"{self.source}: {self.total} records: {self.added} added, {self.replaced} replaced, "
            f"{self.kept} kept (ours better-evidenced), {self.identical} identical; "
            f"{len(self.conflicts)} conflicts; {self.environments_added} new environments"
        )


@dataclass
class ImportReport(MergeReport):
    """What :meth:`TuningDB.import_file` did."""


@dataclass
class Difference:
    """One key on which two databases differ.

    ``kind``: ``"only_ours"``, ``"only_theirs"``, ``"config"`` (both have the key, configs
    differ) or ``"timing"`` (same config, different measurements or provenance: the fields that
    differ are named).
    """

    kind: str
    key: dict[str, Any]
    ours: TuningRecord | None
    theirs: TuningRecord | None

    def describe(self) -> str:
        rec = self.ours or self.theirs
        assert rec is not None
        head = f"{self.kind:<11} {rec.describe()} env={self.key['env_key']}"
        if self.kind == "only_ours":
            return f"{head}: {config_json(rec.config)} {rec.median_us:.2f}us"
        if self.kind == "only_theirs":
            return f"{head}: {config_json(rec.config)} {rec.median_us:.2f}us"
        assert self.ours is not None and self.theirs is not None
        return (
            f"{head}: ours {config_json(self.ours.config)} {self.ours.median_us:.2f}us x{self.ours.samples}"
            f" | theirs {config_json(self.theirs.config)} {self.theirs.median_us:.2f}us x{self.theirs.samples}"
            f"{self.fields()}"
        )

    def fields(self) -> str:
        """The fields besides the config whose values differ, as `` (differs: name ours -> theirs,
        ...)`` ("" when only the config does)."""
        a, b = self.ours.model_dump(mode="json"), self.theirs.model_dump(mode="json")
        names = [k for k in a if k != "config" and a[k] != b.get(k)]
        if not names:
            return ""
        shown = ", ".join(f"{k} {a[k]!r:.40} -> {b.get(k)!r:.40}" for k in names[:4])
        return f" (differs: {shown}{', ...' if len(names) > 4 else ''})"


def better_evidenced(a: TuningRecord, b: TuningRecord) -> bool:
    """Is ``a`` better evidence than ``b``? Measured with another source of the kernel: the newer
    (a re-tune after a kernel change replaces the rows it retired). Else more samples, then a
    lower spread/median ratio, then newer."""
    if a.backend_source != b.backend_source:
        return parse_timestamp(a.created_at) > parse_timestamp(b.created_at)
    if a.samples != b.samples:
        return a.samples > b.samples
    ra, rb = a.spread_ratio, b.spread_ratio
    if not math.isclose(ra, rb, rel_tol=1e-12, abs_tol=0.0):
        return ra < rb
    return parse_timestamp(a.created_at) > parse_timestamp(b.created_at)


def _same_measurement(a: TuningRecord, b: TuningRecord) -> bool:
    return a.model_dump() == b.model_dump()


def _key_dict(rec: TuningRecord) -> dict[str, Any]:
    return dict(zip(_UNIQUE, rec.unique_key()))


def unused_bucket(rec: TuningRecord) -> str | None:
    """Why the dispatcher never runs ``rec`` (None: it runs it for some M).

    A call with M tokens runs the row of the nearest tuned bucket at or above M if that bucket
    is at most M's standard bucket (:data:`~autofp4.problem.DEFAULT_M_BUCKETS`) and the config
    serves M (``m_max``); so a row serves M = its bucket when the bucket is at most the largest
    standard bucket and the config reaches it, and otherwise only M up to ``m_max`` within the
    bucket's standard range.
    """
    top = DEFAULT_M_BUCKETS[-1]
    if rec.m_bucket > top:
        return (f"M bucket {rec.m_bucket} is never used: the dispatcher looks rows up by the M buckets "
                f"{', '.join(map(str, DEFAULT_M_BUCKETS))} (a row tuned at another M from 1 to {top} serves "
                f"the M of its standard bucket up to its own)")
    m_max = rec.config.get("m_max")
    if isinstance(m_max, int) and not isinstance(m_max, bool) and (m_max < 1 or bucket_for(m_max) < rec.m_bucket):
        return (f"M bucket {rec.m_bucket} is never used: its config serves M <= m_max={m_max}, which the "
                f"dispatcher looks up in a smaller M bucket")
    return None


#: how far ahead of this machine's clock a record's created_at may be (another machine's clock)
FUTURE_SLACK_S = 86400.0


def _check_m_buckets(source: str, recs: list[TuningRecord]) -> None:
    """:class:`TuningFileError` for the first record of ``recs`` that the dispatcher would never
    run, or that claims to be made in the future (``db prune --older-than-days`` could never
    remove it, and it would win every tie on age)."""
    from .schema import parse_timestamp

    now = time.time()
    for i, rec in enumerate(recs):
        if parse_timestamp(rec.created_at).timestamp() > now + FUTURE_SLACK_S:
            raise TuningFileError(f"{source}: record #{i} ({rec.describe()}) field created_at: {rec.created_at} is "
                                  "in the future (more than a day past this machine's clock)")
        why = unused_bucket(rec)
        if why is not None:
            n = sum(unused_bucket(r) is not None for r in recs)
            raise TuningFileError(
                f"{source}: record #{i} ({rec.describe()}) field m_bucket: {why}"
                + (f"; {n} records like this" if n > 1 else "")
                + "; `autofp4 db prune --unused-buckets --db <database>` deletes such rows from the database "
                "they were exported from"
            )


# --------------------------------------------------------------------------------------
# reading export files: in chunks, one top-level value (or one record) at a time, so a file
# that is huge, deeply nested or has millions of records is refused after a bounded read
# --------------------------------------------------------------------------------------
def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are each given once (JSON would keep the last of a repeated key
    silently, while a reader of the file sees the first)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
#: a record's fields are each given once (the top-level members, which may hold many keys, are
#: read without building the pairs list this check needs)
_RECORD_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
_NOT_SPACE = re.compile(r"[^ \t\n\r]")
#: a value this close to the end of what was read may go on in the next chunk
_LOOKAHEAD = 64


def _open_export(path: Path) -> BinaryIO:
    """``path`` opened for reading; :class:`TuningFileError` for a missing file, a directory,
    a file over :data:`MAX_IMPORT_BYTES` or one that cannot be opened."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise TuningFileError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        raise TuningFileError(f"{path}: no such file") from None
    except OSError as e:
        raise TuningFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise TuningFileError(f"{path}: is a directory, not a tuning export file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device: open() or the read could wait forever
        raise TuningFileError(f"{path}: is not a regular file (a FIFO, socket or device), not a tuning export file")
    if st.st_size > MAX_IMPORT_BYTES:
        raise TuningFileError(f"{path}: {st.st_size} bytes is larger than the {MAX_IMPORT_BYTES} byte limit")
    try:
        return open(path, "rb")
    except OSError as e:
        raise TuningFileError(f"{path}: cannot read: {e.strerror or e}") from None


class _ExportReader:
    """The top level of a JSON export, read in chunks of :data:`READ_CHUNK_BYTES`.

    :meth:`items` yields ``("member", key, value)`` for each top-level member but ``records``,
    whose list is announced by ``("records", "records", None)`` and then yielded one element at
    a time as ``("record", index, value)``. Besides what the caller keeps, at most one value
    (:data:`MAX_VALUE_CHARS`, a record :data:`MAX_RECORD_CHARS`) and one chunk are held.
    """

    def __init__(self, path: Path, f: BinaryIO) -> None:
        self.path, self.f = path, f
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.base, self.nbytes, self.eof = "", 0, 0, 0, False
        head = self._read(len(SQLITE_MAGIC))
        if head == SQLITE_MAGIC:
            raise TuningFileError(
                f"{path}: is an SQLite database, not a JSON export; merge it with `autofp4 db merge {path}`"
            )
        self._feed(head)

    def _read(self, n: int) -> bytes:
        try:
            return self.f.read(n)
        except OSError as e:
            raise TuningFileError(f"{self.path}: cannot read: {e.strerror or e}") from None

    def _feed(self, data: bytes) -> None:
        self.nbytes += len(data)
        if self.nbytes > MAX_IMPORT_BYTES:
            raise TuningFileError(f"{self.path}: larger than the {MAX_IMPORT_BYTES} byte limit")
        try:
            text = self.decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise TuningFileError(f"{self.path}: not UTF-8 text near byte {self.nbytes - len(data) + e.start}: "
                                  f"{e.reason}") from None
        if self.pos:  # drop what was consumed
            self.base += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        self.buf += text
        self.eof = not data

    def _invalid(self, msg: str, pos: int) -> TuningFileError:
        return TuningFileError(f"{self.path}: invalid JSON at character {self.base + pos}: {msg}")

    def peek(self) -> str:
        """The next character that is not whitespace (``""`` at the end), skipping to it."""
        if self.pos < len(self.buf) and self.buf[self.pos] not in " \t\n\r":
            return self.buf[self.pos]
        while True:
            m = _NOT_SPACE.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if self.eof:
                return ""
            self._feed(self._read(READ_CHUNK_BYTES))

    def expect(self, chars: str, after: str, *args: Any) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise self._invalid(f"expected {' or '.join(repr(x) for x in chars)} {after.format(*args)}", self.pos)
        self.pos += 1
        return c

    def value(self, limit: int, what: str, *args: Any, decoder: json.JSONDecoder = _DECODER) -> Any:
        """The JSON value at the next non-whitespace character (at most ``limit`` characters);
        ``what.format(*args)`` names it in errors."""
        self.peek()
        while True:
            try:
                val, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - _LOOKAHEAD
                if self.eof or not cut:
                    raise self._invalid(e.msg, e.pos) from None
            except RecursionError:
                raise self._invalid(f"{what.format(*args)} is nested too deeply", self.pos) from None
            except ValueError as e:  # NaN or Infinity, an integer of too many digits
                raise self._invalid(str(e), self.pos) from None
            else:
                if self.eof or end < len(self.buf) - _LOOKAHEAD:
                    self.pos = end
                    return val
            if len(self.buf) - self.pos > limit:
                raise TuningFileError(f"{self.path}: {what.format(*args)} is larger than the {limit} character limit")
            self._feed(self._read(READ_CHUNK_BYTES))

    def items(self) -> Iterator[tuple[str, Any, Any]]:
        c = self.peek()
        if c != "{":
            if not c:
                raise self._invalid("the file holds no JSON value", self.pos)
            if c == "\ufeff":
                raise self._invalid("the file starts with a byte order mark; save it as UTF-8 without one", 0)
            raw = self.value(MAX_RECORD_CHARS, "the document")
            raise TuningFileError(f"{self.path}: expected a JSON object, got a {type(raw).__name__}")
        self.pos += 1
        if self.peek() == "}":
            self.pos += 1
        else:
            while True:
                if self.peek() != '"':
                    raise self._invalid("expected a key in double quotes", self.pos)
                key = self.value(MAX_KEY_CHARS, "a key")
                self.expect(":", "after the key {!r:.40}", key)
                if key == "records" and self.peek() == "[":
                    yield "records", key, None
                    yield from self._records()
                else:
                    yield "member", key, self.value(MAX_VALUE_CHARS, "the value of {!r:.40}", key)
                if self.expect(",}", "after the value of {!r:.40}", key) == "}":
                    break
        if self.peek():
            raise self._invalid("extra data after the document", self.pos)

    def _records(self) -> Iterator[tuple[str, Any, Any]]:
        self.pos += 1  # the '['
        if self.peek() == "]":
            self.pos += 1
            return
        i = 0
        while True:
            if i >= MAX_RECORDS:
                raise TuningFileError(f"{self.path}: more than {MAX_RECORDS} records; split the file")
            yield "record", i, self.value(MAX_RECORD_CHARS, "record #{}", i, decoder=_RECORD_DECODER)
            if self.expect(",]", "after record #{}", i) == "]":
                return
            i += 1


def _read_json(path: Path, env_key: str | None = None) -> Any:
    """The top-level object of an export as parsed JSON (read as :func:`read_export` reads it).

    With ``env_key``, a record that is not an object of that environment is kept as ``None``
    (its index stays), so memory holds only the records of that environment.
    """
    raw: dict[str, Any] = {}
    with _open_export(path) as f:
        for kind, key, value in _ExportReader(path, f).items():
            if kind == "record":
                keep = env_key is None or isinstance(value, dict) and value.get("env_key") == env_key
                raw["records"].append(value if keep else None)
            else:
                raw[key] = [] if kind == "records" else value
    return raw


def _check_version(path: Path, raw: dict[str, Any]) -> None:
    if "schema_version" not in raw:  # another JSON object (a misses file, a config, {})
        keys = ", ".join(sorted(map(str, raw))[:5]) + (", ..." if len(raw) > 5 else "") if raw else "none"
        raise TuningFileError(f"{path}: not a tuning export (it has no schema_version; its keys: {keys:.120}); "
                              "an export is what autofp4 db export writes")
    version = raw.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in SUPPORTED_EXPORT_VERSIONS:
        raise TuningFileError(
            f"{path}: unsupported schema_version {version!r:.40}; this autofp4 reads {sorted(SUPPORTED_EXPORT_VERSIONS)}"
        )


def brief(e: BaseException) -> str:
    """An error in one line: for a pydantic ValidationError each failing field and why, without
    pydantic's input dumps and links (where a value fails every branch of a union, the branch
    that bounds it, not the type mismatches, is kept)."""
    if not isinstance(e, ValidationError):
        return str(e)
    groups: dict[str, list[tuple[str, str]]] = {}
    for err in e.errors(include_url=False, include_input=False):
        loc = ".".join(str(x) for x in err.get("loc", ())[:2])
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        groups.setdefault(loc, []).append((str(err.get("type", "")), msg))
    parts = []
    for loc, errs in groups.items():
        bounds = [m for t, m in errs if not t.endswith("_type")]
        for m in dict.fromkeys(bounds or [m for _, m in errs]):
            parts.append(f"{loc}: {m}" if loc else m)
    return "; ".join(parts)


def _describe_raw_record(raw: Any) -> str:
    if not isinstance(raw, dict):
        return f"a {type(raw).__name__}, not an object"
    parts = [f"{f}={raw.get(f)!r:.40}" for f in ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k") if f in raw]
    return " ".join(parts) or "no key fields"


def _error_lines(e: ValidationError, record: int | None = None, raw: Any = None) -> list[str]:
    """One line per error: where (``record #i (...) field f`` or a document path) and what."""
    lines = []
    for loc_parts, msg in _merged_union_errors(e.errors()):
        loc = ".".join(str(p) for p in loc_parts)
        if record is not None:
            where = f"record #{record} ({_describe_raw_record(raw)}) field {loc or '<record>'}"
        else:
            where = loc or "<document>"
        msg = msg.removeprefix("Value error, ")
        lines.append(f"{where}: {msg if len(msg) <= 500 else msg[:500] + '...'}")
    return lines


_VALID_PREFIX = "Input should be a valid "


def _merged_union_errors(errors: list[dict[str, Any]]) -> list[tuple[tuple, str]]:
    """``(loc, message)`` per error, where a value that fails every branch of a union of scalar
    types (one "Input should be a valid ..." error per branch, the branch named last in ``loc``)
    gives one: "Input should be a valid boolean, integer, number or string (got a dict)"."""
    def union_head(err: dict[str, Any]) -> tuple | None:
        loc = tuple(err["loc"])
        ok = str(err.get("type", "")).endswith("_type") and str(err["msg"]).startswith(_VALID_PREFIX)
        return loc[:-1] if ok and len(loc) > 1 else None

    heads: dict[tuple, list[dict[str, Any]]] = {}
    for err in errors:
        head = union_head(err)
        if head is not None:
            heads.setdefault(head, []).append(err)
    out: list[tuple[tuple, str]] = []
    for err in errors:
        head = union_head(err)
        group = heads.get(head) if head is not None else None
        if not group or len(group) < 2:
            out.append((tuple(err["loc"]), str(err["msg"])))
        elif err is group[0]:
            kinds = list(dict.fromkeys(str(g["msg"])[len(_VALID_PREFIX):] for g in group))
            got = type(err.get("input")).__name__
            out.append((head, f"{_VALID_PREFIX}{', '.join(kinds[:-1])} or {kinds[-1]} (got a {got})"))
    return out


def _invalid_export(path: Path, lines: list[str], unchecked: bool) -> TuningFileError:
    """The first error on the first line (with the file), the others below it."""
    shown = lines[:MAX_REPORTED_ERRORS]
    text = f"{path}: invalid tuning export: {shown[0]}" + "".join(f"\n  {line}" for line in shown[1:])
    if len(lines) > len(shown):
        text += f"\n  ... and {len(lines) - len(shown)} more errors"
    if unchecked:
        text += f"\n  ... (the records after the first {MAX_REPORTED_ERRORS} errors were not checked)"
    return TuningFileError(text)


def read_export(path: str | Path) -> ExportDoc:
    """Read and fully validate an export file; :class:`TuningFileError` names what is wrong.

    The file is read in chunks and each record is validated as it is read, so memory holds the
    validated records plus one bounded value (see :class:`_ExportReader`). An SQLite file, a
    directory, an unsupported ``schema_version``, invalid JSON and the size limits are reported
    as such; after :data:`MAX_REPORTED_ERRORS` invalid fields the rest of the records is only
    parsed.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    records: list[ExportedRecord] = []
    record_errors: list[str] = []
    unchecked = False
    with _open_export(path) as f:
        for kind, key, value in _ExportReader(path, f).items():
            if kind == "record":
                if len(record_errors) >= MAX_REPORTED_ERRORS:
                    unchecked = True
                    continue
                try:
                    records.append(ExportedRecord.model_validate(value))
                except ValidationError as e:
                    record_errors += _error_lines(e, key, value)
                continue
            if key == "records":  # a repeated key: the last one counts, as in json.loads
                records, record_errors, unchecked = [], [], False
            header[key] = records if kind == "records" else value
    _check_version(path, header)
    if record_errors:
        try:
            ExportDoc.model_validate({**header, "records": []})
            lines = []
        except ValidationError as e:
            lines = _error_lines(e)
        raise _invalid_export(path, lines + record_errors, unchecked)
    try:
        return ExportDoc.model_validate(header)
    except ValidationError as e:
        raise _invalid_export(path, _error_lines(e), False) from None


def _is_sqlite_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def _looks_like_json(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4096).lstrip()[:1] == b"{"
    except OSError:
        return False


def _stored_config(text: Any) -> Any:
    """The JSON of a row's ``config`` column (ValueError for one that is not JSON or nests
    deeper than Python's parser goes, so that the row is skipped with the others)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("its config is nested too deeply to be a kernel config") from None


def read_records(source: "TuningDB | str | Path") -> tuple[str, list[TuningRecord]]:
    """``(name, every result row)`` of a tuning database, its file, or an export (``.json``).

    An SQLite file is read as a database and a file that starts with ``{`` as an export,
    whatever their names.
    """
    if isinstance(source, TuningDB):
        return str(source.path), source.results()
    path = Path(source)
    sqlite_file = _is_sqlite_file(path)
    if not sqlite_file and (path.suffix.lower() == ".json" or _looks_like_json(path)):
        return str(path), read_export(path).tuning_records()
    if path.is_dir():
        raise TuningDBError(f"{path} is a directory, not a tuning database file")
    if not path.is_file():
        raise TuningDBError(f"no tuning database at {path}")
    try:
        with TuningDB(path, readonly=True) as o:
            return str(path), o.results()
    except sqlite3.Error as e:
        raise TuningDBError(f"{path} is not a readable tuning database: {e}") from None


_PROBLEM_FIELDS = ("op", "fmt", "dtype", "n", "k", "experts", "topk")


def _raw_problem(rec: Mapping[str, Any]) -> tuple:
    """The problem fields of a raw export record (``experts``/``topk`` default to 0, as in the model)."""
    return tuple(rec.get(f, 0) if f in ("experts", "topk") else rec.get(f) for f in _PROBLEM_FIELDS)


@dataclass
class _ExportIndex:
    """A read export's environments and its records by environment and problem (raw: a record is
    only validated when its environment and problem are asked for)."""

    environments: dict[str, Any]
    by_env: dict[str, list[tuple[int, dict]]]
    by_problem: dict[tuple[str, tuple], list[tuple[int, dict]]]


#: the exports read in this process: path -> (size, mtime, inode) of the file read, its index
_EXPORTS: dict[Path, tuple[tuple[int, int, int], _ExportIndex]] = {}


def _export_index(path: Path) -> _ExportIndex:
    """The index of an export, read once per process (again when the file changes). The header
    must be valid, else :class:`TuningFileError`."""
    st = path.stat()
    sig = (st.st_size, st.st_mtime_ns, st.st_ino)
    hit = _EXPORTS.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise TuningFileError(f"{path}: expected a JSON object, got a {type(raw).__name__}")
    _check_version(path, raw)
    envs, records = raw.get("environments"), raw.get("records")
    if not isinstance(envs, dict) or not isinstance(records, list):
        raise TuningFileError(f"{path}: expected 'environments' (object) and 'records' (list)")
    index = _ExportIndex(envs, {}, {})
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("env_key"), str):
            continue
        item = (i, rec)
        index.by_env.setdefault(rec["env_key"], []).append(item)
        try:
            index.by_problem.setdefault((rec["env_key"], _raw_problem(rec)), []).append(item)
        except TypeError:  # an unhashable field: the record is invalid, found (and reported) per environment
            pass
    _EXPORTS[path] = (sig, index)
    return index


def shipped_raw_winners(op: str, dtype: str, m_bucket: int) -> list[dict]:
    """The raw records of every shipped export (every environment's: other GPUs' winners too) of
    ``op``, ``dtype`` and ``m_bucket``, as stored (not validated: a caller parses what it uses);
    an export that cannot be read is left out (the dispatcher's layers warn about it)."""
    out: list[dict] = []
    try:
        files = shipped_db_files()
    except (OSError, TuningDBError):
        return out
    for f in files:
        try:
            index = _export_index(f)
        except (TuningFileError, OSError):
            continue
        for items in index.by_env.values():
            out += [rec for _, rec in items
                    if rec.get("op") == op and rec.get("dtype") == dtype and rec.get("m_bucket") == m_bucket]
    return out


def _read_export_for_env(path: Path, env_key: str, problem: Any = None) -> list[TuningRecord]:
    """The records of ``env_key`` in an export (of one ``problem`` only: a
    :class:`~autofp4.problem.ProblemKey`; None: all); records of other environments and
    problems are not parsed.

    The header must be valid (else :class:`TuningFileError`); an invalid record of this
    environment is skipped with a warning.
    """
    index = _export_index(path)
    if env_key not in index.environments:
        return []
    try:
        env = Environment.model_validate(index.environments[env_key])
    except ValidationError as e:
        raise TuningFileError(f"{path}: environment {env_key}: {brief(e)}") from None
    if env.key() != env_key:
        raise TuningFileError(f"{path}: environment {env_key} hashes to {env.key()}")
    if problem is None:
        items = index.by_env.get(env_key, [])
    else:
        items = index.by_problem.get((env_key, tuple(getattr(problem, f) for f in _PROBLEM_FIELDS)), [])
    out = []
    for i, rec in items:
        try:
            out.append(ExportedRecord.model_validate(rec).to_record(env))
        except (ValidationError, ValueError) as e:
            warnings.warn(
                f"{path}: skipping record #{i} ({_describe_raw_record(rec)}): {brief(e)}",
                TuningDBWarning,
                stacklevel=3,
            )
    return out


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: readers see the old
    file or the new one, never a half-written one (also after a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export_json(doc: ExportDoc) -> str:
    """The canonical text of an export: pretty, sorted keys, records in key order. A record tuned
    offline leaves its ``origin`` out: the text of such records is what it was before the field
    existed, and an older autofp4 reads it."""
    data = doc.model_dump(mode="json")
    for r in data["records"]:
        if r.get("origin") == "offline":
            del r["origin"]
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _sort_key(rec: TuningRecord | ExportedRecord) -> tuple:
    env_key = rec.env_key
    return (env_key, rec.op, rec.fmt, rec.dtype, rec.n, rec.k, rec.experts, rec.topk, rec.backend, rec.m_bucket)


# --------------------------------------------------------------------------------------
# the database
# --------------------------------------------------------------------------------------
class TuningDB:
    """One SQLite tuning database file. Use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | Path | None = None, *, readonly: bool = False) -> None:
        self.path = (expand_path(path, "the tuning DB path", written=not readonly) if path is not None
                     else default_db_path())
        if why := sqlite_path_problem(self.path):
            raise TuningDBError(f"the tuning DB {str(self.path)[:60]!r}...: {why}")
        self.readonly = readonly
        if self.path.is_dir():
            raise TuningDBError(f"{self.path} is a directory, not a tuning database file")
        try:
            mode = self.path.stat().st_mode
        except OSError:
            mode = None  # not there yet (created on a write), or unreachable: opening it says why
        if mode is not None and not stat.S_ISREG(mode):
            raise TuningDBError(f"{self.path} is not a regular file (a device, FIFO or socket), not a tuning "
                                "database file; name a DB file (such as ./tuning.db)")
        why = sqlite_open_problem(self.path)
        if why:  # before SQLite opens it: a FIFO there would block the open for ever
            raise TuningDBError(why)
        try:
            self._open(readonly)
        except sqlite3.Error as e:
            if not (readonly and self._wal_without_index(e)):
                raise TuningDBError(self._open_error(e)) from None
            try:  # a WAL database in a folder this process cannot write: nothing to fold in
                self._open(readonly, immutable=True)
            except sqlite3.Error as e2:
                raise TuningDBError(self._open_error(e2)) from None

    def _open(self, readonly: bool, immutable: bool = False) -> None:
        try:
            if readonly:
                if not self.path.is_file():
                    raise TuningDBError(f"no tuning database at {self.path}")
                conn = sqlite3.connect(
                    self.path.resolve().as_uri() + ("?mode=ro&immutable=1" if immutable else "?mode=ro"),
                    uri=True, timeout=READ_BUSY_TIMEOUT_S,
                )
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S)
        except sqlite3.Error as e:
            raise TuningDBError(f"cannot open tuning database {self.path}: {e}") from None
        except OSError as e:
            raise TuningDBError(f"cannot open tuning database {self.path}: {e}") from None
        self._conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {int((READ_BUSY_TIMEOUT_S if readonly else BUSY_TIMEOUT_S) * 1000)}")
            self._db = sqlite_utils.Database(conn)
            self._setup(readonly)
        except BaseException:
            conn.close()
            raise

    def _wal_without_index(self, e: sqlite3.Error) -> bool:
        """Reading a WAL database needs its ``-shm`` index, which SQLite cannot create in a folder
        this process cannot write; without a write-ahead log to fold in, the file alone is the
        whole database and can be read as an immutable file."""
        code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
        if code not in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY) or self._hot_journal():
            return False
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            return not wal.exists() or wal.stat().st_size == 0
        except OSError:
            return False

    def _hot_journal(self) -> bool:
        """Is a rollback journal of an unfinished transaction next to the file? Read as it is,
        the file would show that transaction's half-written state."""
        journal = self.path.with_name(self.path.name + "-journal")
        if kind_of(journal) != REGULAR:
            return False
        try:
            with open(journal, "rb") as f:
                return f.read(8) == _JOURNAL_MAGIC  # a rollback journal's header
        except OSError:
            return False

    def _open_error(self, e: sqlite3.Error) -> str:
        side = _side_file_problem(self.path, e)
        if side:
            return side
        if self.readonly and self._hot_journal():
            return (f"{self.path} has an unfinished transaction (its rollback journal {self.path.name}-journal, left "
                    "by a writer that stopped mid-write): open it once with write access (autofp4 db import or "
                    f"merge into it, or a tuning run) to roll it back, then read it ({e})")
        if _is_readonly_error(e):
            return _readonly_message(self.path, e)
        code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
        folder = self.path.parent
        if code == sqlite3.SQLITE_CANTOPEN and not os.access(folder, os.W_OK):
            if not os.access(folder, os.X_OK):
                return f"cannot open {self.path}: its folder {folder} cannot be entered ({e})"
            if not self.path.exists():
                return f"cannot create {self.path}: its folder {folder} is not writable ({e})"
            if self.readonly:
                return (f"cannot read {self.path}: it has a write-ahead log ({self.path.name}-wal) that needs "
                        f"an index file next to it, and its folder {folder} is not writable ({e})")
            return _readonly_message(self.path, e)
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            wait = READ_BUSY_TIMEOUT_S if self.readonly else BUSY_TIMEOUT_S
            return f"{self.path} is locked by another connection (waited {wait:g} s): {e}"
        if code in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL) and not self.readonly:
            return (f"cannot write the tuning database {self.path}: {e} (a full disk, or a file size limit: "
                    "ulimit -f?)")
        return f"{self.path} is not a readable tuning database: {e}"

    def _setup(self, readonly: bool) -> None:
        """Check the file, switch it to WAL, migrate. Two processes opening a new file at the
        same moment can get "database is locked" here without the busy handler being consulted
        (switching the journal mode, initialising the WAL index): retried until the timeout."""
        deadline = time.monotonic() + (READ_BUSY_TIMEOUT_S if readonly else BUSY_TIMEOUT_S)
        delay = 0.005
        while True:
            try:
                # Reading the schema fails here on a file that is not an SQLite database.
                self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
                self._refuse_foreign_objects()
                if not readonly:
                    self._refuse_before_writing()
                    self._db.enable_wal()
                    self._conn.execute("PRAGMA synchronous = NORMAL")
                self._migrate()
                if not readonly:
                    self._ensure_indexes()
                return
            except sqlite3.OperationalError as e:
                msg = str(e).lower()
                if ("locked" not in msg and "busy" not in msg) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.2)

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r}{', readonly=True' if self.readonly else ''})"

    @contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        """One write transaction; taking the write lock up front, so waiting never deadlocks."""
        if self.readonly:
            raise TuningDBError(f"{self.path} was opened read-only")
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
            else:
                conn.commit()
        except sqlite3.OperationalError as e:
            if not _is_readonly_error(e):
                raise
            raise TuningDBError(_readonly_message(self.path, e)) from None

    # -- schema -----------------------------------------------------------------------
    def _refuse_before_writing(self) -> None:
        """Before the first write to a file opened writable (its switch to WAL): refuse a newer
        schema, and any file with tables besides ``meta`` but no schema version (another
        program's SQLite database, or tables autofp4 did not make), so that such a file is left
        byte for byte."""
        version = self._version_now()
        if version > SCHEMA_VERSION:
            raise TuningDBError(
                f"{self.path} has schema version {version}, newer than this autofp4 supports "
                f"({SCHEMA_VERSION}); upgrade autofp4"
            )
        self._refuse_unversioned(version)

    def _refuse_unversioned(self, version: int) -> None:
        """A file with tables besides ``meta`` but no schema version is not an autofp4 tuning
        database (autofp4 creates its tables and stores the version in one transaction): another
        program's SQLite database, or tables autofp4 did not make. Refused, read or written."""
        tables = set(self._db.table_names()) - {"meta"}  # a meta table alone: a first open cut short
        if version == 0 and tables:
            raise TuningDBError(f"{self.path} is not an autofp4 tuning database (it holds the tables "
                                f"{', '.join(sorted(tables)[:5])} and no schema version); it is left as it is")

    def _refuse_foreign_objects(self) -> None:
        """Refuse a file holding triggers or views: autofp4 creates neither, and a trigger can change
        or undo what autofp4 writes (an import would report rows that are gone), a view hide a table."""
        odd = self._conn.execute(
            "SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view') ORDER BY type, name"
        ).fetchall()
        if odd:
            names = ", ".join(f"{t} {n!r}" for t, n in odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
            raise TuningDBError(f"{self.path} holds {names}, which autofp4 never creates (a trigger can change or "
                                "undo what autofp4 writes and reads); not used as a tuning database: drop "
                                f"{'them' if len(odd) > 1 else 'it'} (DROP TRIGGER / DROP VIEW) or use another file")

    def _version_now(self) -> int:
        if "meta" not in self._db.table_names():
            return 0
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            return 0
        try:
            version = int(row[0])
        except (TypeError, ValueError):
            version = -1
        if version < 0:
            raise TuningDBError(f"{self.path}: corrupt schema_version {row[0]!r}")
        return version

    @property
    def schema_version(self) -> int:
        return self._version_now()

    def _migrate(self) -> None:
        version = self._version_now()
        if version > SCHEMA_VERSION:
            raise TuningDBError(
                f"{self.path} has schema version {version}, newer than this autofp4 supports "
                f"({SCHEMA_VERSION}); upgrade autofp4"
            )
        if version == SCHEMA_VERSION or (self.readonly and version >= READ_AS_IS_FROM):
            return
        if self.readonly:
            tables = set(self._db.table_names())
            if version == 0 and not tables:
                raise TuningDBError(f"{self.path} is an empty file, not a tuning database")
            self._refuse_unversioned(version)
            raise TuningDBError(
                f"{self.path} has schema version {version} and needs migrating to {SCHEMA_VERSION}; "
                "open it writable once"
            )
        with self._write() as db:
            version = self._version_now()  # another process may have migrated meanwhile
            if version == 0 and "meta" not in db.table_names():
                db["meta"].create({"key": str, "value": str}, pk="key")
            for i in range(version, SCHEMA_VERSION):
                try:
                    MIGRATIONS[i](db)
                except TuningDBError as e:
                    raise TuningDBError(f"{self.path}: {e}") from None
                db.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", [str(i + 1)]
                )

    def _ensure_indexes(self) -> None:
        """Create the :data:`EXTRA_INDEXES` this file lacks (a write only when one is missing).
        A file that cannot be written now (read-only, locked past the timeout) is read without
        them."""
        have = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        if "results_unique_key" not in have and "results" in self._db.table_names():
            self._restore_unique_index()
        if set(EXTRA_INDEXES) <= have:
            return
        try:
            with self._write():
                for name, (table, cols) in EXTRA_INDEXES.items():
                    self._conn.execute(f"CREATE INDEX IF NOT EXISTS [{name}] ON [{table}] ({', '.join(cols)})")
        except sqlite3.OperationalError:
            pass

    def _restore_unique_index(self) -> None:
        """The unique index of the results' keys, dropped by another tool: without it a replaced
        row would be stored beside the old one. Created again; a file whose rows already repeat a
        key is refused, naming it."""
        cols = ", ".join(_UNIQUE)
        try:
            with self._write():
                self._conn.execute(f"CREATE UNIQUE INDEX IF NOT EXISTS results_unique_key ON results ({cols})")
        except sqlite3.IntegrityError:
            raise TuningDBError(f"{self.path} lacks its unique index of result keys (results_unique_key), and some "
                                "of its rows share a key; autofp4 keeps one row per key: remove the duplicates or "
                                "use another file") from None
        except sqlite3.OperationalError:
            pass  # not writable now: read as it is

    # -- environments -----------------------------------------------------------------
    def add_environment(self, env: Environment) -> None:
        with self._write():
            self._put_env(env)

    def _put_env(self, env: Environment) -> bool:
        cur = self._conn.execute(
            "INSERT OR IGNORE INTO environments (env_key, env) VALUES (?, ?)",
            [env.key(), json.dumps(env.model_dump(mode="json"), sort_keys=True)],
        )
        return cur.rowcount > 0

    def environments(self) -> dict[str, Environment]:
        """env_key -> Environment for every environment stored (invalid rows are skipped)."""
        return self._environments()

    def _environments(self, keys: Collection[str] | None = None) -> dict[str, Environment]:
        """:meth:`environments`, only those of ``keys`` (all when None or many)."""
        sql, params = "SELECT env_key, env FROM environments", []
        if keys is not None and len(keys) <= 256:
            params = sorted(keys)
            sql += f" WHERE env_key IN ({', '.join('?' * len(params))})"
        out: dict[str, Environment] = {}
        for key, text in self._conn.execute(sql + " ORDER BY env_key", params):
            try:
                env = Environment.model_validate_json(text)
            except ValidationError as e:
                warnings.warn(f"{self.path}: skipping invalid environment {key}: {brief(e)}", TuningDBWarning,
                              stacklevel=2)
                continue
            if env.key() != key:
                warnings.warn(
                    f"{self.path}: skipping environment {key}: its fields hash to {env.key()}",
                    TuningDBWarning,
                    stacklevel=2,
                )
                continue
            out[key] = env
        return out

    # -- writes -------------------------------------------------------------------------
    @staticmethod
    def _result_row(rec: TuningRecord) -> dict[str, Any]:
        row = rec.model_dump(exclude={"env"})
        row["config"] = config_json(rec.config)
        row["env_key"] = rec.env_key
        return row

    def _upsert(self, rec: TuningRecord) -> None:
        self._put_env(rec.env)
        self._db["results"].insert(self._result_row(rec), replace=True)

    def _upsert_faster(self, rec: TuningRecord, replacing: TuningRecord | None = None) -> bool:
        """Inside a write: store ``rec`` unless the row with its unique key (and environment) was
        measured faster with the same kernel source. ``replacing``: the row ``rec`` deliberately
        replaces (a re-tune that measured it again), replaced while it is still the stored one.
        One statement, so the comparison and the write see the same row."""
        self._put_env(rec.env)
        row = self._result_row(rec)
        cols = list(row)
        keep = set(_UNIQUE)
        sets = ", ".join(f"[{c}] = excluded.[{c}]" for c in cols if c not in keep)
        cond = ("excluded.median_us < results.median_us"
                " OR excluded.backend_source IS NOT results.backend_source")
        params = [row[c] for c in cols]
        if replacing is not None:
            old = self._result_row(replacing)
            # the measurement identifies the row (its text fields may be spelled differently)
            cond += (" OR (results.median_us = ? AND results.spread_us = ? AND results.samples = ?"
                     " AND results.backend_source IS ?)")
            params += [old["median_us"], old["spread_us"], old["samples"], old["backend_source"]]
        sql = (
            f"INSERT INTO results ({', '.join(f'[{c}]' for c in cols)}) VALUES ({', '.join('?' * len(cols))})"
            f" ON CONFLICT ({', '.join(_UNIQUE)}) DO UPDATE SET {sets} WHERE {cond}"
        )
        return self._conn.execute(sql, params).rowcount > 0

    def upsert_result(
        self, rec: TuningRecord, *, replace: bool = False, replacing: TuningRecord | None = None
    ) -> bool:
        """Store ``rec`` where it is the faster measurement: a row with the same unique key (and
        environment) stays when it was measured with the same kernel source (``backend_source``)
        and is at least as fast (equal ``median_us``: the stored row stays). The comparison and
        the write are one transaction, so concurrent writers keep the fastest row.

        ``replacing``: the stored row that ``rec`` deliberately replaces (a re-tune that
        measured that config again in this run); it is replaced, faster or not, while it is still
        the stored row; once another writer replaced it, the faster row wins again.
        ``replace=True``: replace unconditionally. Returns whether ``rec`` was written.
        """
        with self._write():
            if replace:
                self._upsert(rec)
                return True
            return self._upsert_faster(rec, replacing)

    def upsert_results(self, recs: Iterable[TuningRecord], *, replace: bool = False) -> int:
        """Store several records in one transaction (all or none), each as :meth:`upsert_result`
        does (``replace=True``: unconditionally). Returns how many were written."""
        written = 0
        with self._write():
            for rec in recs:
                if replace:
                    self._upsert(rec)
                    written += 1
                else:
                    written += self._upsert_faster(rec)
        return written

    def add_trial(self, tr: TrialRecord) -> None:
        """Append one tuner trial (its environment should be stored with :meth:`add_environment`)."""
        self.add_trials([tr])

    def add_trials(self, trials: Iterable[TrialRecord]) -> None:
        rows = []
        for tr in trials:
            row = tr.model_dump()
            row["config"] = config_json(tr.config)
            rows.append(row)
        with self._write() as db:
            if rows:
                db["trials"].insert_all(rows)

    # -- queries --------------------------------------------------------------------------
    @staticmethod
    def _where(allowed: Iterable[str], env_key: str | None, filters: Mapping[str, Any]) -> tuple[str, list]:
        allowed = set(allowed)
        clauses, params = [], []
        if env_key is not None:
            clauses.append("env_key = ?")
            params.append(env_key)
        for name, value in filters.items():
            if name not in allowed:
                raise TypeError(f"unknown filter {name!r}; expected one of {sorted(allowed)}")
            if value is None:
                continue
            if isinstance(value, (list, tuple, set, frozenset)):
                values = list(value)
                if not values:
                    clauses.append("0")
                    continue
                clauses.append(f"[{name}] IN ({', '.join('?' for _ in values)})")
                params.extend(values)
            else:
                clauses.append(f"[{name}] = ?")
                params.append(value)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _rows(self, sql: str, params: list) -> list[dict[str, Any]]:
        return list(self._db.query(sql, params))

    def _record_from_row(self, row: dict[str, Any], envs: dict[str, Environment]) -> TuningRecord | None:
        row = dict(row)
        row.pop("id", None)
        env_key = row.pop("env_key")
        env = envs.get(env_key)
        try:
            if env is None:
                raise ValueError(f"its environment {env_key} is missing from the environments table or unreadable")
            row["config"] = _stored_config(row["config"])
            return TuningRecord.model_validate({**row, "env": env})
        except (ValueError, ValidationError) as e:
            warnings.warn(
                f"{self.path}: skipping invalid result row ({_describe_raw_record(row)} env={env_key}): {brief(e)}",
                TuningDBWarning,
                stacklevel=3,
            )
            return None

    def results(self, env_key: str | None = None, **filters: Any) -> list[TuningRecord]:
        """Result rows (all environments if ``env_key`` is None), filtered by key fields.

        A filter value may be a single value or a list of accepted values. Rows that no
        longer validate (e.g. a backend that was removed) are skipped with a warning.
        """
        where, params = self._where(KEY_FIELDS, env_key, filters)
        order = " ORDER BY env_key, op, fmt, dtype, n, k, experts, topk, backend, m_bucket"
        rows = self._rows(f"SELECT * FROM results{where}{order}", params)
        envs = self._environments({row["env_key"] for row in rows})
        return [r for r in (self._record_from_row(row, envs) for row in rows) if r is not None]

    def get_result(
        self, op: str, fmt: str, dtype: str, backend: str, m_bucket: int, n: int, k: int,
        experts: int, topk: int, env_key: str,
    ) -> TuningRecord | None:
        """The result row with exactly this unique key, or None."""
        recs = self.results(
            env_key, op=op, fmt=fmt, dtype=dtype, backend=backend, m_bucket=m_bucket,
            n=n, k=k, experts=experts, topk=topk,
        )
        return recs[0] if recs else None

    def has_result(
        self, op: str, fmt: str, dtype: str, backend: str, m_bucket: int, n: int, k: int,
        experts: int, topk: int, env_key: str,
    ) -> bool:
        where, params = self._where(
            KEY_FIELDS, env_key,
            dict(op=op, fmt=fmt, dtype=dtype, backend=backend, m_bucket=m_bucket, n=n, k=k,
                 experts=experts, topk=topk),
        )
        return self._conn.execute(f"SELECT 1 FROM results{where} LIMIT 1", params).fetchone() is not None

    def trials(self, env_key: str | None = None, **filters: Any) -> list[TrialRecord]:
        """Trial rows (oldest first), filtered by key fields, ``m`` and ``outcome``."""
        where, params = self._where((*KEY_FIELDS, "m", "outcome"), env_key, filters)
        out = []
        for row in self._rows(f"SELECT * FROM trials{where} ORDER BY id", params):
            row.pop("id", None)
            try:
                row["config"] = _stored_config(row["config"])
                out.append(TrialRecord.model_validate(row))
            except (ValueError, ValidationError) as e:
                warnings.warn(
                    f"{self.path}: skipping invalid trial row ({_describe_raw_record(row)}): {e}",
                    TuningDBWarning,
                    stacklevel=2,
                )
        return out

    def failed_configs(
        self, op: str, fmt: str, dtype: str, backend: str, m_bucket: int | None, n: int, k: int,
        experts: int, topk: int, env_key: str, *, backend_source: str | Collection[str] | None = None,
    ) -> set[str]:
        """Canonical config JSON (:func:`~autofp4.schema.config_json`) of every failed trial.

        ``m_bucket=None`` counts failures in any M bucket; ``backend_source`` (if given: one
        hash or several, e.g. one per kernel of the backend) counts only failures of those
        kernel source revisions, so fixed kernels are retried.
        """
        where, params = self._where(
            KEY_FIELDS, env_key,
            dict(op=op, fmt=fmt, dtype=dtype, backend=backend, m_bucket=m_bucket, n=n, k=k,
                 experts=experts, topk=topk),
        )
        where += " AND outcome != 'ok'"
        if backend_source is not None:
            sources = [backend_source] if isinstance(backend_source, str) else sorted(backend_source)
            where += f" AND backend_source IN ({', '.join('?' * len(sources))})"
            params.extend(sources)
        return {r[0] for r in self._conn.execute(f"SELECT DISTINCT config FROM trials{where}", params)}

    def counts(self) -> dict[str, int]:
        q = self._conn.execute
        return {
            "results": q("SELECT count(*) FROM results").fetchone()[0],
            "trials": q("SELECT count(*) FROM trials").fetchone()[0],
            "failed_trials": q("SELECT count(*) FROM trials WHERE outcome != 'ok'").fetchone()[0],
            "environments": q("SELECT count(*) FROM environments").fetchone()[0],
            "schema_version": self._version_now(),
        }

    # -- export / import / merge -----------------------------------------------------------
    def export_doc(self, env_key: str | None = None) -> ExportDoc:
        recs = self.results(env_key)
        envs = {r.env_key: r.env for r in recs}
        from .env import autofp4_version

        return ExportDoc(
            schema_version=EXPORT_SCHEMA_VERSION,
            exported_at=utc_now(),
            autofp4=autofp4_version(),
            environments=dict(sorted(envs.items())),
            records=sorted((r.to_exported() for r in recs), key=_sort_key),
        )

    def export(self, path: str | Path, env_key: str | None = None) -> ExportDoc:
        """Write the results (of ``env_key``, or all) to ``path`` as sorted, pretty JSON."""
        doc = self.export_doc(env_key)
        write_text_atomic(Path(path), export_json(doc))
        return doc

    def _merge_records(
        self, recs: Iterable[TuningRecord], report: MergeReport, replace: bool = False
    ) -> MergeReport:
        with self._write():
            current = {r.unique_key(): r for r in self.results()}
            for rec in recs:
                if self._put_env(rec.env):
                    report.environments_added += 1
                key = rec.unique_key()
                ours = current.get(key)
                if ours is None:
                    report.added += 1
                    self._upsert(rec)
                    current[key] = rec
                    continue
                if _same_measurement(ours, rec):
                    report.identical += 1
                    continue
                take = replace or better_evidenced(rec, ours)
                if config_json(ours.config) != config_json(rec.config):
                    report.conflicts.append(
                        Conflict(_key_dict(rec), ours, rec, "theirs" if take else "ours")
                    )
                if take:
                    report.replaced += 1
                    self._upsert(rec)
                    current[key] = rec
                else:
                    report.kept += 1
        return report

    def import_file(self, path: str | Path, *, replace: bool = False) -> ImportReport:
        """Validate an export file and merge its records in (better-evidenced row wins).

        ``replace=True`` makes the file's rows win every key. Raises
        :class:`TuningFileError` (naming the file and record) if anything fails validation;
        then nothing is written.
        """
        doc = read_export(path)
        recs = doc.tuning_records()
        _check_m_buckets(str(path), recs)
        return self._merge_records(recs, ImportReport(source=str(path)), replace=replace)  # type: ignore[return-value]

    def merge(self, other: "TuningDB | str | Path") -> MergeReport:
        """Merge another database (or export file) in; per key the better-evidenced row wins."""
        source, recs = read_records(other)
        _check_m_buckets(source, recs)
        return self._merge_records(recs, MergeReport(source=source))

    def diff(self, other: "TuningDB | str | Path") -> list[Difference]:
        """Keys whose rows differ between this database (ours) and ``other`` (theirs)."""
        _, theirs_list = read_records(other)
        ours = {r.unique_key(): r for r in self.results()}
        theirs = {r.unique_key(): r for r in theirs_list}
        out = []
        for key in sorted(set(ours) | set(theirs)):
            a, b = ours.get(key), theirs.get(key)
            kd = dict(zip(_UNIQUE, key))
            if b is None:
                out.append(Difference("only_ours", kd, a, None))
            elif a is None:
                out.append(Difference("only_theirs", kd, None, b))
            elif config_json(a.config) != config_json(b.config):
                out.append(Difference("config", kd, a, b))
            elif not _same_measurement(a, b):
                out.append(Difference("timing", kd, a, b))
        return out

    # -- maintenance -------------------------------------------------------------------------
    def prune(
        self,
        older_than_days: float | None = None,
        env_key: str | None = None,
        keep_current_env_only: bool = False,
        failed_trials: bool = False,
    ) -> int:
        """Delete rows; returns how many (results + trials) were deleted.

        The criteria combine with AND: ``older_than_days`` (created before now - days),
        ``env_key`` (rows of that environment), ``keep_current_env_only`` (rows of any other
        environment than the running one). ``failed_trials`` restricts the deletion to failed
        trials (results are kept). Environments no longer referenced are dropped. At least
        one criterion is required.
        """
        if older_than_days is None and env_key is None and not keep_current_env_only and not failed_trials:
            raise ValueError("prune needs at least one criterion (older_than_days, env_key, "
                             "keep_current_env_only or failed_trials)")
        clauses, params = [], []
        if older_than_days is not None:
            if not math.isfinite(older_than_days) or older_than_days < 0:
                raise ValueError(f"older_than_days must be a finite number >= 0, got {older_than_days}")
            cutoff = format_timestamp(datetime.now(timezone.utc) - timedelta(days=older_than_days))
            clauses.append("created_at < ?")  # the timestamp format sorts as text
            params.append(cutoff)
        if env_key is not None:
            clauses.append("env_key = ?")
            params.append(env_key)
        if keep_current_env_only:
            from .env import current_environment

            clauses.append("env_key != ?")
            params.append(current_environment().key())
        deleted = 0
        with self._write():
            if failed_trials:
                where = " WHERE " + " AND ".join([*clauses, "outcome != 'ok'"])
                deleted += self._conn.execute(f"DELETE FROM trials{where}", params).rowcount
            else:
                where = " WHERE " + " AND ".join(clauses)
                deleted += self._conn.execute(f"DELETE FROM results{where}", params).rowcount
                deleted += self._conn.execute(f"DELETE FROM trials{where}", params).rowcount
            self._drop_unused_environments()
        return deleted

    def _drop_unused_environments(self) -> None:
        """Inside a write: environments no row refers to any more."""
        self._conn.execute(
            "DELETE FROM environments WHERE env_key NOT IN (SELECT env_key FROM results)"
            " AND env_key NOT IN (SELECT env_key FROM trials)"
        )

    def delete_results(self, recs: Iterable[TuningRecord]) -> int:
        """Delete the result rows with the unique keys of ``recs`` (one transaction); returns
        how many were deleted. Environments no longer referenced are dropped."""
        where = " AND ".join(f"{c} = ?" for c in _UNIQUE)
        deleted = 0
        with self._write():
            for r in recs:
                deleted += self._conn.execute(f"DELETE FROM results WHERE {where}",
                                              [getattr(r, c) for c in _UNIQUE]).rowcount
            self._drop_unused_environments()
        return deleted


class ChangeMonitor:
    """Whether another connection committed to a database file since the last look: SQLite's
    ``PRAGMA data_version`` on one read-only connection kept open (microseconds; no row is read).
    A file that does not exist yet counts as changed once it appears. Any thread may ask."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None
        self._lock = threading.Lock()
        self.changed()  # the version now is the baseline

    def changed(self) -> bool:
        with self._lock:
            fresh = self._conn is None
            try:
                if fresh:
                    if not self.path.is_file():
                        return False
                    self._conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True,
                                                 timeout=READ_BUSY_TIMEOUT_S, check_same_thread=False)
                version = self._conn.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error:  # unreadable now: not a change (the next look opens it again)
                self.close()
                return False
            # a connection's versions compare only with its own: a new one counts as a change
            before, self._version = self._version, version
            return fresh or version != before

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# --------------------------------------------------------------------------------------
# layered lookup
# --------------------------------------------------------------------------------------
def _warn_skip(path: Path, e: BaseException) -> None:
    warnings.warn(f"skipping tuning layer {path}: {e}", TuningDBWarning, stacklevel=3)


def layer_results(env: Environment, user_path: str | Path | None = None,
                  problem: Any = None) -> list[tuple[str, list[TuningRecord]]]:
    """``(layer, results of env)`` of each layer :func:`load_layers` reads, in its order: the
    user DB (its path) and each shipped export (its path); unreadable layers are skipped with a
    warning."""
    key = env.key()
    filters = {} if problem is None else {f: getattr(problem, f) for f in _PROBLEM_FIELDS}
    layers: list[tuple[str, list[TuningRecord]]] = []
    user = expand_path(user_path, "the tuning DB path") if user_path is not None else default_db_path()
    if user.exists():
        try:  # read only: reading never changes a file (no tables, no migration, no journal mode)
            with TuningDB(user, readonly=True) as db:
                layers.append((str(user), db.results(key, **filters)))
        except (TuningDBError, sqlite3.Error, OSError) as e:
            _warn_skip(user, e)
    elif user.is_symlink():  # exists() is False for a link to nothing: say so, not "not created yet"
        _warn_skip(user, OSError(DANGLING_LINK))
    try:
        files = shipped_db_files()
    except (OSError, TuningDBError) as e:
        _warn_skip(Path(os.environ.get("AUTOFP4_SHIPPED_DB") or "tuning_db"), e)
        files = []
    for f in files:
        try:
            layers.append((str(f), _read_export_for_env(f, key, problem)))
        except (TuningFileError, OSError) as e:
            _warn_skip(f, e)
    return layers


def load_layers(env: Environment, user_path: str | Path | None = None, problem: Any = None) -> list[TuningRecord]:
    """Every result of ``env``: the user DB first, then each shipped ``tuning_db/*.json``.

    ``problem`` (a :class:`~autofp4.problem.ProblemKey`): only the rows of that problem (an
    indexed query; what the dispatcher reads the first time it meets a problem). The shipped
    exports are read and indexed once per process (again when a file changes).

    When several layers hold the same key (op, fmt, dtype, backend, m_bucket, n, k, experts,
    topk), the first layer wins: the user DB over the shipped exports, and among the shipped
    exports the first by file name, with a :class:`TuningDBWarning` naming both files when their
    rows differ (two exports of one machine that disagree). A layer that cannot be read (missing
    permissions, corrupt or truncated file, invalid JSON or header) is skipped with a
    :class:`TuningDBWarning` naming the file; this function never raises for bad files.
    """
    layers = layer_results(env, user_path, problem)
    user = str(expand_path(user_path, "the tuning DB path") if user_path is not None else default_db_path())
    seen: dict[tuple, tuple[str, TuningRecord]] = {}
    out: list[TuningRecord] = []
    for name, layer in layers:
        for rec in layer:
            k = rec.key_tuple()
            if k not in seen:
                seen[k] = (name, rec)
                out.append(rec)
            elif seen[k][0] != user and seen[k][0] != name and not _same_measurement(seen[k][1], rec):
                _warn_shipped_conflict(seen[k], (name, rec))
    return out


_CONFLICTS_WARNED: set[tuple[str, str]] = set()


def _warn_shipped_conflict(used: tuple[str, TuningRecord], other: tuple[str, TuningRecord]) -> None:
    """Once per pair of shipped exports: both hold a row of one key for this machine."""
    if (used[0], other[0]) in _CONFLICTS_WARNED:
        return
    _CONFLICTS_WARNED.add((used[0], other[0]))
    a, b = used[1], other[1]
    key = (f"{a.op} {a.fmt} {a.dtype} {a.backend} M={a.m_bucket} N={a.n} K={a.k}"
           + (f" E={a.experts} topk={a.topk}" if a.experts else ""))
    warnings.warn(f"shipped tuning exports {used[0]} and {other[0]} both hold a row for {key} on this machine "
                  f"({a.median_us:.2f} us vs {b.median_us:.2f} us, maybe more keys): the first by file name, "
                  f"{used[0]}, is used; merge them into one (autofp4 db merge) or remove one", TuningDBWarning,
                  stacklevel=4)
