"""Claims on jobs between tuning processes that write one DB without a shared optuna storage.

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
import os
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
