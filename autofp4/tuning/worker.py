"""The tuning worker process of just-in-time tuning, and the parent's end of it.

``python -m autofp4.tuning.worker SETTINGS`` runs an :class:`~.online.OnlineTuner` over the jobs
its parent sends, one JSON line each on its stdin, and answers every job's status on a pipe of
its own (:class:`WorkerClient` is the parent's end). It is a new interpreter, not a fork: the
parent's CUDA context and main module stay out of it. A job another process holds the claim of
is answered ``busy`` (not final) and taken up again every :data:`RETRY_S` until that process is
done with it; it then finds that process's row and ends ``skipped``. When its stdin closes (the
parent closed it, or died) the worker finishes the job in flight and exits. A killed worker
loses only the job in flight: every row and trial is one SQLite transaction. A worker that
cannot start its tuner (its DB cannot be opened or is not an autofp4 DB, a bad setting) says why
in a ``fatal`` line and exits: that cannot change by starting it again, so the parent warns once
and drops the jobs instead of restarting it.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Callable

from ..problem import DEFAULT_M_BUCKETS, ProblemKey
from .jobs import Job

#: a job another process is tuning is tried again this often (seconds)
RETRY_S = 0.5
#: a worker that died is started again (its unfinished jobs sent again) this many times at most
MAX_RESTARTS = 3
#: how often a waiting parent looks whether its worker is still alive (seconds)
POLL_S = 0.2


# -----------------------------------------------------------------------------------------
# the worker process
# -----------------------------------------------------------------------------------------
def _inbox(stream: IO[str], on_end: Callable[[], Any] | None = None) -> "queue.Queue[str | None]":
    """The lines of ``stream`` as they come, then None at its end (read by a thread, which then
    calls ``on_end``)."""
    q: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            q.put(line)
        q.put(None)
        if on_end is not None:
            on_end()

    threading.Thread(target=read, daemon=True).start()
    return q


def _job(line: str) -> tuple[int, Job]:
    msg = json.loads(line)
    return int(msg["id"]), Job(ProblemKey(**msg["key"]), int(msg["m"]), "jit", int(msg.get("experts_global", 0)))


def _take(inbox: "queue.Queue[str | None]", todo: deque, later: deque) -> bool:
    """Move the jobs waiting in ``inbox`` to ``todo``; with nothing to do, wait for one (at most
    until the first job of ``later`` is due). False once the inbox has ended."""
    block = not todo
    while True:
        timeout = max(0.0, later[0][0] - time.monotonic()) if later else None
        try:
            line = inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return True
        if line is None:
            return False
        todo.append(_job(line))
        block = False


class _NextGuess:
    """Which jobs come after this one. A workload meets its layers in the same order at every
    M bucket (a forward pass), and a blocking call sends one job at a time: the problem that
    followed a problem last time is guessed to follow it again, at the same M; and a warm-up
    goes through growing M, so the same problem at the next M bucket is guessed too."""

    def __init__(self) -> None:
        self.after: dict[ProblemKey, ProblemKey] = {}
        self.last: ProblemKey | None = None

    def __call__(self, job: Job, queued: deque) -> list[Job]:
        """The jobs expected after ``job`` (which starts now): the first one queued, else the
        guessed next problem; then ``job``'s problem at the next M bucket."""
        if self.last is not None and self.last != job.key:
            self.after[self.last] = job.key
        self.last = job.key
        out: list[Job] = []
        if queued:
            out.append(queued[0][1])
        elif job.key in self.after:
            out.append(Job(self.after[job.key], job.m, job.name))
        bigger = [b for b in DEFAULT_M_BUCKETS if b > job.m]
        if bigger and not any(j.key == job.key and j.m == bigger[0] for j in out):
            out.append(Job(job.key, bigger[0], job.name, job.experts_global))
        return out


def serve(tuner: Any, inbox: "queue.Queue[str | None]", out: IO[str]) -> None:
    """Tune the jobs of ``inbox`` in order, each job's status written to ``out`` (``busy`` once,
    not final; the job is taken up again after :data:`RETRY_S`), until the inbox ends. Each job
    is told the job expected next (:class:`_NextGuess`: its default compiles meanwhile)."""
    todo: deque[tuple[int, Job]] = deque()
    later: deque[tuple[float, int, Job]] = deque()  # (when, id, job): jobs another process holds
    told: set[int] = set()
    guess = _NextGuess()
    while _take(inbox, todo, later):
        while later and later[0][0] <= time.monotonic():
            todo.append(later.popleft()[1:])
        if not todo:
            continue
        i, job = todo.popleft()
        t0 = time.perf_counter()
        res = tuner.tune(job, guess(job, todo))
        status = res.status
        if status == "busy":
            later.append((time.monotonic() + RETRY_S, i, job))
            if i in told:
                continue
            told.add(i)
        out.write(json.dumps({"id": i, "status": status, "final": status != "busy",
                              "report": _report(res, time.perf_counter() - t0)}) + "\n")
        out.flush()


def _report(res: Any, wall_s: float) -> dict[str, Any]:
    """What a job's status line tells its parent besides the status: the fields of its
    :class:`~.jobs.JobResult` (the pick, its time against the default's, the trials, the note)
    and the job's wall time in the worker (seconds)."""
    fields = {k: v for k, v in asdict(res).items() if k not in ("job", "status")}
    return {**fields, "wall_s": round(wall_s, 3)}


def main(argv: list[str] | None = None) -> int:
    """The worker process: SETTINGS is the JSON :class:`WorkerClient` passes."""
    s = json.loads((sys.argv[1:] if argv is None else argv)[0])
    for p in s["sys_path"]:  # where the parent found its modules (plug-in backends among them)
        if p not in sys.path:
            sys.path.append(p)
    from ..backends import register
    from .online import OnlineTuner

    for name, spec in (s["backends"] or {}).items():
        register(name, spec)
    if s.get("nice"):  # below the workload on the CPU too (the compile workers inherit it)
        os.nice(s["nice"])
    out = os.fdopen(s["fd"], "w", encoding="utf-8")
    try:
        tuner = OnlineTuner(s["device"], s["db"], s["budget_s"], list(s["backends"] or ()) or None, s.get("workers"),
                            duty=s["duty"], compile_grace_s=s.get("compile_grace_s"))
    except Exception as e:  # noqa: BLE001 - whatever stops the tuner from starting stops every restart too
        try:
            out.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
            out.flush()
        except BrokenPipeError:
            _parent_gone(out)
        return 3
    try:
        # the parent closing the inbox (or exiting) ends the paced rests: the job in flight
        # finishes at full speed and the worker exits, not hours later
        serve(tuner, _inbox(sys.stdin, tuner.meas.wake.set), out)
    except BrokenPipeError:  # the parent exited (its status pipe closed): nothing to tell, nobody to tell it to
        _parent_gone(out)
    finally:
        tuner.close()
    return 0


def _copy_lines(stream: IO[str]) -> None:
    """Copy the worker's standard error to this process's (as it is when each line comes)."""
    with stream:
        for line in stream:
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):  # no stderr any more: the lines go nowhere
                pass


def _parent_gone(out: Any) -> None:
    """The status pipe's reader has gone: point the pipe's descriptor at /dev/null, so that the
    buffered lines flushed at exit go nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


# -----------------------------------------------------------------------------------------
# the parent's end
# -----------------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    """The worker's environment: this one, with this autofp4 importable and no autotuning of its own."""
    env = {k: v for k, v in os.environ.items()
           if k != "AUTOFP4_AUTOTUNE" and not k.startswith("AUTOFP4_AUTOTUNE_")}  # the parent's tuner's settings
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


class WorkerClient:
    """One worker process, seen from its parent: :meth:`submit` sends a job, :meth:`wait_for`
    and :meth:`drain` wait for statuses. The process starts with the first job and again (its
    unfinished jobs sent again) when it died, :data:`MAX_RESTARTS` times at most.

    ``settings``: ``device``, ``db`` (path), ``budget_s``, ``backends`` (``{name: "module:Class"}``
    or None), ``duty`` (see :class:`~.online.OnlineTuner`), ``nice`` (the worker's CPU priority
    below its parent's, inherited by its compile workers and timing process)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.pending: dict[int, Job] = {}  # sent, no final status yet
        self.status: dict[int, str] = {}  # the latest status of each job
        self.reports: dict[int, dict[str, Any]] = {}  # the final report of each job (see _report)
        self.restarts = 0
        self.fatal: str | None = None  # why the worker could not start (it is not started again)
        self._reading = False  # a reader thread is on the current worker's status pipe
        self._ids = itertools.count()
        self._cv = threading.Condition()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def submit(self, job: Job) -> int:
        """Send ``job`` (returns at once); its id."""
        with self._cv:
            live = self._ensure()
            i = next(self._ids)
            if not live and self.fatal is not None:
                return i  # just-in-time tuning is off (warned once): the job is dropped
            self.pending[i] = job
            self._send(i, job)
        return i

    def start(self) -> bool:
        """Start the worker process now, before any job (it then sets up, compile workers and
        timing process included, while its parent does other work); False where it cannot start."""
        with self._cv:
            return self._ensure()

    def finished(self) -> list[dict[str, Any]]:
        """The reports of the jobs finished so far, in the order they finished."""
        with self._cv:
            return list(self.reports.values())

    def wait_for(self, i: int, timeout: float | None) -> str | None:
        """The first status of job ``i`` (``busy`` or final), or None after ``timeout`` seconds."""
        ok = self._wait(lambda: i in self.status, timeout)
        return self.status.get(i) if ok else None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job sent has its final status; False after ``timeout`` seconds, or
        when a worker that kept dying was given up or cannot start (its jobs dropped)."""
        return self._wait(lambda: not self.pending, timeout) and self.fatal is None

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not done():
                left = None if end is None else end - time.monotonic()
                if (left is not None and left <= 0) or not self._ensure():
                    return False
                self._cv.wait(POLL_S if left is None else min(POLL_S, left))
            return True

    def _ensure(self) -> bool:
        """A live worker, started or restarted (with the unfinished jobs) where needed; False
        when it died once more than :data:`MAX_RESTARTS` allow (the unfinished jobs dropped)."""
        if self.proc is not None and self.proc.poll() is None:
            return True
        if self.proc is not None:
            self._cv.wait_for(lambda: not self._reading, timeout=5.0)  # its last lines (a fatal one) read
        if self.fatal is not None:
            if self.pending:
                warnings.warn(f"autofp4: just-in-time tuning is off: its worker cannot start ({self.fatal}); "
                              f"{len(self.pending)} jobs not tuned", RuntimeWarning, stacklevel=4)
                self.pending.clear()
            return False
        if self.proc is not None:
            if self.restarts >= MAX_RESTARTS:
                if self.pending:
                    warnings.warn(f"autofp4: the tuning worker died {self.restarts + 1} times; "
                                  f"{len(self.pending)} jobs not tuned", RuntimeWarning, stacklevel=4)
                    self.pending.clear()
                return False
            self.restarts += 1
        try:
            self._start()
        except (OSError, subprocess.SubprocessError) as e:  # cannot spawn: no tuning, the calls run untuned
            self.fatal = f"{type(e).__name__}: {e}"
            warnings.warn(f"autofp4: just-in-time tuning is off: its worker cannot start ({self.fatal}); calls "
                          f"run untuned{f', {len(self.pending)} jobs not tuned' if self.pending else ''}",
                          RuntimeWarning, stacklevel=4)
            self.pending.clear()
            return False
        for i, job in self.pending.items():
            self._send(i, job)
        return True

    def _start(self) -> None:
        r, w = os.pipe()
        settings = {**self.settings, "fd": w, "sys_path": list(sys.path)}
        try:
            # its standard error through a pipe this process copies to its own: a worker still
            # finishing after this process exited holds no descriptor of the caller's (a
            # subprocess.run(capture_output=True) of this process returns when it exits)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, json.dumps(settings)], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(w,), env=_child_env(),
                start_new_session=True, text=True, encoding="utf-8", errors="replace",
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._reading = True
        threading.Thread(target=self._read, args=(os.fdopen(r, encoding="utf-8"),), daemon=True).start()
        threading.Thread(target=_copy_lines, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                msg = json.loads(line)
                with self._cv:
                    if "fatal" in msg:
                        self.fatal = msg["fatal"]
                        continue
                    self.status[msg["id"]] = msg["status"]
                    if msg["final"]:
                        job = self.pending.pop(msg["id"], None)
                        if job is not None:
                            self.reports[msg["id"]] = {**asdict(job.key), "m": job.m, "status": msg["status"],
                                                       **msg.get("report", {})}
                    self._cv.notify_all()
        with self._cv:  # the worker ended
            self._reading = False
            self._cv.notify_all()

    def _send(self, i: int, job: Job) -> None:
        try:
            msg = {"id": i, "key": asdict(job.key), "m": job.m}
            if job.experts_global:
                msg["experts_global"] = job.experts_global
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it died: started again, the job with it, by the next wait
            pass

    def disown(self) -> None:
        """In a child forked from the parent: close this process's copy of the worker's stdin, so
        that the worker still ends when the parent closes its own."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, wait_s: float = 0.0) -> None:
        """Close the worker's stdin: it finishes the job in flight and exits (waited for up to
        ``wait_s`` seconds, then killed)."""
        with self._cv:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        if wait_s > 0:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
