"""Claims on jobs between tuning processes: a process tunes a job only while it holds its claim.

:class:`JobClaims` serves the processes of one host that write one DB (no shared optuna
storage); :class:`RDBClaims` the processes of several hosts that share an optuna RDB storage
(``autofp4 tune --devices ... --storage postgresql://...``): a table in that database.

File claims:

A process tunes a job only while it holds the job's claim: an exclusive ``flock`` on a lock file
in a folder beside the DB (``<db>.claims/``), which the operating system releases when the
process ends, also when it is killed. A job another process holds is put back at the end of the
queue and taken up again once that process is done with it; the job then finds that process's
result in the DB and is skipped. The lock file of a job whose result is stored is removed.

Where files cannot be locked (no ``fcntl``, a folder that cannot be written), every claim is
granted: the processes then fall back to re-checking the DB before each job.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None  # type: ignore[assignment]


class Claim:
    """A held claim (``fd`` None: granted without a lock)."""

    def __init__(self, path: Path | None = None, fd: int | None = None) -> None:
        self.path, self.fd = path, fd

    def release(self, done: bool = False) -> None:
        """Give the claim up; ``done``: the job's result is stored (its lock file is removed)."""
        if self.fd is None:
            return
        try:
            if done and self.path is not None:
                try:
                    os.unlink(self.path)  # while still held: a waiting peer re-opens the path
                except OSError:
                    pass
        finally:
            os.close(self.fd)  # releases the lock
            self.fd = None


class JobClaims:
    """The claims of the jobs of one DB file."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        p = Path(db_path)
        self.dir = p.with_name(p.name + ".claims")

    def _path(self, env_key: str, job: Any) -> Path:
        k = job.key
        ident = f"{env_key}|{k.op}|{k.fmt}|{k.dtype}|{k.n}|{k.k}|{k.experts}|{k.topk}|{job.m}"
        return self.dir / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".lock")

    def take(self, env_key: str, job: Any) -> Claim | None:
        """The claim of ``job`` in environment ``env_key``, or None when another process holds it."""
        if fcntl is None:
            return Claim()
        path = self._path(env_key, job)
        for _ in range(3):  # the holder may remove the file between our open and our lock
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the folder was removed by a peer that finished: again
                continue
            except OSError:
                return Claim()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError:  # a file system without locks
                os.close(fd)
                return Claim()
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except OSError:
                same = False
            if same:
                return Claim(path, fd)
            os.close(fd)  # locked a file that was removed meanwhile: open the path again
        return Claim()

    def close(self) -> None:
        """Remove the claims folder where no claim is left in it."""
        try:
            self.dir.rmdir()
        except OSError:
            pass


# -----------------------------------------------------------------------------------------
# claims in an RDB, for processes on several hosts
# -----------------------------------------------------------------------------------------
#: a claim whose holder has not renewed it for this long is taken over (its holder died)
RDB_CLAIM_TTL_S = 60.0


class RDBClaim(Claim):
    """A claim held in :class:`RDBClaims`' table (``elsewhere``: the job's result was stored
    by another process; nothing is held, the job is to be skipped)."""

    def __init__(self, owner: "RDBClaims | None", ident: str, elsewhere: bool = False) -> None:
        super().__init__()
        self.owner, self.ident, self.elsewhere = owner, ident, elsewhere

    def release(self, done: bool = False) -> None:
        if self.owner is not None:
            self.owner._release(self.ident, done)
            self.owner = None


def claim_ttl_s() -> float:
    """``$AUTOFP4_CLAIM_TTL_S`` (default :data:`RDB_CLAIM_TTL_S`): seconds after which a claim not
    renewed is taken over; ValueError naming the variable where it is not a positive number."""
    text = os.environ.get("AUTOFP4_CLAIM_TTL_S", "").strip()
    if not text:
        return RDB_CLAIM_TTL_S
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"AUTOFP4_CLAIM_TTL_S={os.environ['AUTOFP4_CLAIM_TTL_S']!r}: expected a positive number "
                         f"of seconds (default {RDB_CLAIM_TTL_S:g})")
    return v


class RDBClaims:
    """The claims of jobs in a table of an SQL database (``autofp4_job_claims`` in the optuna
    storage's database: PostgreSQL, MySQL or SQLite by SQLAlchemy URL), for tuning processes on
    several hosts: a claim is a row (``INSERT`` of the job's key, unique), renewed by its
    holder every ``ttl_s / 4`` seconds; a row not renewed for ``ttl_s`` (its holder died) is
    taken over by a compare-and-set ``UPDATE``; a job whose result was stored keeps its row,
    marked done, and the others skip it (their own DB may not hold that row: per-host DBs are
    merged with ``autofp4 db merge``)."""

    def __init__(self, url: str, ttl_s: float | None = None) -> None:
        import socket
        import threading
        import uuid

        import sqlalchemy as sa

        self.ttl_s = float(ttl_s) if ttl_s is not None else claim_ttl_s()
        kw: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
        self.engine = sa.create_engine(url, **kw)
        meta = sa.MetaData()
        self.table = sa.Table(
            "autofp4_job_claims", meta,
            sa.Column("ident", sa.String(64), primary_key=True),
            sa.Column("owner", sa.String(200), nullable=False),
            sa.Column("heartbeat", sa.Float, nullable=False),
            sa.Column("done", sa.Integer, nullable=False),
        )
        for attempt in range(5):  # peers may create the table at the same moment
            try:
                meta.create_all(self.engine, checkfirst=True)
                break
            except sa.exc.SQLAlchemyError:
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._renew, name="autofp4-claims", daemon=True)
        self._beat.start()

    @staticmethod
    def ident(env_key: str, job: Any) -> str:
        k = job.key
        text = f"{env_key}|{k.op}|{k.fmt}|{k.dtype}|{k.n}|{k.k}|{k.experts}|{k.topk}|{job.m}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def take(self, env_key: str, job: Any) -> RDBClaim | None:
        """The claim of ``job``; an ``elsewhere`` claim where another process stored its result;
        None while another live process holds it."""
        import sqlalchemy as sa

        t, ident = self.table, self.ident(env_key, job)
        for _ in range(3):
            now = time.time()
            try:
                with self.engine.begin() as c:
                    c.execute(t.insert().values(ident=ident, owner=self.me, heartbeat=now, done=0))
                return self._held(ident)
            except sa.exc.IntegrityError:
                pass
            with self.engine.begin() as c:
                row = c.execute(sa.select(t.c.owner, t.c.heartbeat, t.c.done).where(t.c.ident == ident)).first()
                if row is None:  # released between our insert and our read: again
                    continue
                if row.done:
                    return RDBClaim(None, ident, elsewhere=True)
                if now - row.heartbeat <= self.ttl_s:
                    return None
                taken = c.execute(t.update().where(t.c.ident == ident, t.c.owner == row.owner,
                                                   t.c.heartbeat == row.heartbeat)
                                  .values(owner=self.me, heartbeat=now)).rowcount
            if taken == 1:
                return self._held(ident)
            return None  # another process took it over first
        return None

    def _held(self, ident: str) -> RDBClaim:
        with self._lock:
            self.held.add(ident)
        return RDBClaim(self, ident)

    def _release(self, ident: str, done: bool) -> None:
        t = self.table
        with self._lock:
            self.held.discard(ident)
        mine = (t.c.ident == ident) & (t.c.owner == self.me)
        with self.engine.begin() as c:
            if done:
                c.execute(t.update().where(mine).values(done=1, heartbeat=time.time()))
            else:
                c.execute(t.delete().where(mine))

    def _renew(self) -> None:
        t = self.table
        while not self._stop.wait(self.ttl_s / 4):
            with self._lock:
                held = list(self.held)
            if not held:
                continue
            try:
                with self.engine.begin() as c:
                    c.execute(t.update().where(t.c.ident.in_(held), t.c.owner == self.me, t.c.done == 0)
                              .values(heartbeat=time.time()))
            except Exception:  # a lost connection: renewed again on the next beat
                pass

    def close(self) -> None:
        """Stop renewing; the claims still held are released (not done)."""
        self._stop.set()
        for ident in list(self.held):
            try:
                self._release(ident, False)
            except Exception:
                pass
        self.engine.dispose()
