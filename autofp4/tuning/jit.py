"""Just-in-time tuning: ``with autofp4.autotune(mode=...):`` (or ``AUTOFP4_AUTOTUNE=blocking|
background``) tunes every (problem, M bucket) a workload misses, with the offline tuner's
pipeline, in a tuning worker process on the call's device (:mod:`.worker`).

* ``blocking``: the call that misses waits for its job (about ``budget_s``) and runs the winner;
  later calls run it as well.
* ``background``: the call runs the default at once and its job is queued; the worker measures
  at most ``duty`` of the wall time. The rows are picked up as they are stored.

Rows stored by any process (the worker, a peer, ``autofp4 tune``) are picked up without a
restart: on a miss, at most every :data:`RELOAD_S`, one ``PRAGMA data_version`` says whether the
DB changed, and if so the dispatchers are renewed (:func:`autofp4.dispatch.refresh`). Tuned
calls never get here. Nothing is tuned or reloaded while a CUDA graph is captured (the call runs
its current pick, its job is queued); :meth:`autotune.wait` finishes every queued job and picks
up the rows, so that a capture after it captures the winners. Processes that meet the same job
tune it once: the worker that holds its claim (:mod:`.claims`); the others keep the default and
pick up its row.
"""
from __future__ import annotations

import atexit
import math
import numbers
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import dispatch
from ..backends import get_backend
from ..db import ChangeMonitor, TuningDBError
from ..problem import OPS
from . import args as A
from .compile_pool import _spec
from .jobs import STORED, Job
from .measurer import MIN_DUTY
from .worker import WorkerClient

MODES = ("blocking", "background")
#: on a miss, the DB is looked at for new rows at most this often (seconds)
RELOAD_S = 0.5
#: the background worker's default share of the wall time spent measuring
BACKGROUND_DUTY = 0.5
#: and its CPU priority below the workload's (compiles must not take the serving loop's cores)
BACKGROUND_NICE = 10
#: in blocking mode a job with a measured config waits at most this long for another candidate's
#: compile (the caller waits for the job; what is not compiled yet still lands in the kernel cache)
BLOCKING_COMPILE_GRACE_S = 0.25
#: a blocking call waits this long for its job, plus three times the job's budget (seconds):
#: the worker's start (imports, compile workers, timing process) comes first
START_WAIT_S = 300.0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _settings(mode: str, budget_s: float | None, ops: Iterable[str], backends: Sequence[str] | None,
              duty: float | None, workers: int | None = None) -> dict[str, Any]:
    """The settings of an activation, checked (ValueError), with the mode's default duty."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if ops is None or isinstance(ops, (str, bytes)):
        raise TypeError(f"ops must be a list of ops such as ['linear'] (an empty one: none), got {ops!r}")
    ops = frozenset(A.names(ops, "ops", "['linear', 'moe']"))
    if not ops <= set(OPS):
        raise ValueError(f"ops must be among {OPS}, got {sorted(ops)}")
    budget_s = A.seconds(budget_s, "budget_s")
    if duty is not None and (isinstance(duty, bool) or not isinstance(duty, numbers.Real)):
        raise TypeError(f"duty must be a number in [{MIN_DUTY}, 1] or None, got {type(duty).__name__} {duty!r:.80}")
    backends = A.names(backends, "backends")
    if backends == []:  # taken for "every backend" further on, where None means that
        raise ValueError("backends=[] names no backend to tune with: leave it None for every backend that "
                         "applies, or name some, such as ['sm90_w4a16']")
    duty = (BACKGROUND_DUTY if mode == "background" else 1.0) if duty is None else float(duty)
    if not MIN_DUTY <= duty <= 1:
        raise ValueError(f"duty must be in [{MIN_DUTY}, 1] (the share of the wall time the worker measures; less "
                         f"would spread a job's trials over hours), got {duty}")
    try:
        A.workers(workers, "workers")
    except TypeError as e:
        raise ValueError(str(e)) from None
    # named backends travel to the worker by class, so that plug-ins run there too
    specs = None if backends is None else {n: _spec(get_backend(n)) for n in backends}
    return dict(mode=mode, budget_s=budget_s, ops=ops, backends=specs, duty=duty, workers=workers)


class _Scope:
    """One activation (settings of :func:`_settings`): the jobs met so far, one worker per
    (device, DB)."""

    def __init__(self, mode: str, budget_s: float | None, ops: frozenset, backends: dict | None,
                 duty: float, workers: int | None = None) -> None:
        self.mode, self.budget_s, self.ops, self.backends, self.duty = mode, budget_s, ops, backends, duty
        self.workers_n = workers
        self.path = dispatch.user_db_path()
        self.monitor = ChangeMonitor(self.path)
        self.next_check = 0.0
        self.seen: set[tuple] = set()  # (device, (key, M bucket)) met with the DB at self.path
        self.workers: dict[tuple, WorkerClient] = {}
        self.lock = threading.Lock()

    # -- the miss hook --
    def on_miss(self, disp: dispatch.Dispatcher, mk: tuple) -> dispatch.Dispatcher | None:
        """A miss of ``disp``: pick up new rows if due, queue the job if new; in blocking mode
        (not capturing) wait for it and return the dispatcher that has its row."""
        if time.monotonic() >= self.next_check:
            self._reload(disp.device)
        key, m = mk
        met = (disp.device, mk)
        if key.op not in self.ops or met in self.seen:  # the common case: no lock
            return None
        with self.lock:
            if met in self.seen:
                return None
            self.seen.add(met)
            worker = self._worker(disp.device)
        i = worker.submit(Job(key, m, "jit", experts_global=disp.miss_experts_global(mk)))
        if self.mode == "background" or _capturing(disp.device):
            return None
        if worker.wait_for(i, START_WAIT_S + 3 * (self.budget_s or 0.0)) not in STORED:
            return None  # busy (another process tunes it), failed, or not in time: the default runs
        dispatch.refresh()
        return dispatch.get_dispatcher(disp.device)

    def _reload(self, device: torch.device) -> None:
        """Renew the dispatchers if the DB changed (not while a CUDA graph is captured)."""
        self.next_check = time.monotonic() + RELOAD_S
        path = dispatch.user_db_path()
        if path != self.path:  # set_db: watch the new DB; its jobs are new
            with self.lock:
                self.path, self.monitor, self.seen = path, ChangeMonitor(path), set()
        if not _capturing(device) and self.monitor.changed():
            dispatch.refresh()

    def _worker(self, device: torch.device) -> WorkerClient:
        w = self.workers.get((device, self.path))
        if w is None:
            w = self.workers[(device, self.path)] = WorkerClient({
                "device": str(device), "db": str(self.path), "budget_s": self.budget_s, "backends": self.backends,
                "duty": self.duty, "workers": self.workers_n, "nice": BACKGROUND_NICE if self.mode == "background" else 0,
                "compile_grace_s": BLOCKING_COMPILE_GRACE_S if self.mode == "blocking" else None,
            })
        return w

    def start(self, device: torch.device) -> bool:
        """Start the worker of ``device`` now (see :meth:`autotune.start`)."""
        if not self.ops:
            return False
        with self.lock:
            worker = self._worker(device)
        return worker.start()

    # -- waiting and closing --
    def wait(self, timeout: float | None = None) -> bool:
        """Finish every job queued so far, then pick up the rows; False when some job did not
        finish within ``timeout`` seconds."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("autofp4.autotune.wait() during CUDA graph capture: call it before capturing")
        end = None if timeout is None else time.monotonic() + timeout
        ok = True
        for w in list(self.workers.values()):
            ok = w.drain(None if end is None else max(0.0, end - time.monotonic())) and ok
        dispatch.refresh()
        return ok

    def reports(self) -> list[dict[str, Any]]:
        with self.lock:
            workers = list(self.workers.values())
        return [r for w in workers for r in w.finished()]

    def forked(self) -> None:
        """In a child forked from this process: workers, DB connection and lock of its own (the
        parent's worker answers only the parent; the jobs the parent met are still its own)."""
        for w in self.workers.values():
            w.disown()
        self.workers, self.lock = {}, threading.Lock()
        self.monitor, self.next_check = ChangeMonitor(self.path), 0.0

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the workers: each finishes the job in flight (waited for up to ``wait_s``)."""
        for w in list(self.workers.values()):
            w.close(wait_s)
        self.monitor.close()


_STACK: list[_Scope] = []
#: the jobs the last ``with autotune()`` block to end finished (``autotune.jobs()`` after it)
_LAST_REPORTS: list[dict[str, Any]] = []
_STACK_LOCK = threading.Lock()


def _push(s: _Scope) -> None:
    with _STACK_LOCK:
        _STACK.append(s)
        dispatch.set_miss_hook(s.on_miss)


def _pop(s: _Scope) -> None:
    with _STACK_LOCK:
        if s in _STACK:
            _STACK.remove(s)
        dispatch.set_miss_hook(_STACK[-1].on_miss if _STACK else None)


def _after_fork() -> None:
    global _STACK_LOCK
    _STACK_LOCK = threading.Lock()
    for s in _STACK:
        s.forked()


os.register_at_fork(after_in_child=_after_fork)


def active() -> _Scope | None:
    """The autotuning in effect (the innermost), or None."""
    return _STACK[-1] if _STACK else None


class autotune:
    """Tune what a workload misses, just in time::

        with autofp4.autotune(mode="blocking"):      # or "background"
            model(warmup_batch)                       # untuned (problem, M bucket)s are tuned
        autofp4.autotune.wait()                       # (background) every queued job done

    ``mode``: ``blocking`` (a call that misses waits for its job and runs the winner) or
    ``background`` (it runs the default; the job is queued for the worker). ``budget_s``: each
    job's time (default 3 s on the GPU; none on the CPU). ``ops``: the ops tuned (an empty tuple:
    none, new rows are only picked up). ``backends``: backend names (default: every one that
    runs on the device). ``duty``: the share of the wall time the worker may spend measuring
    (default 0.5 in background mode, 1 in blocking mode). ``workers``: the worker's compile
    processes (default: the tuner's, CPU cores - 2 on the GPU; 0 compiles in the worker itself).

    Leaving the block in blocking mode first finishes the jobs queued during CUDA graph capture
    (:meth:`wait`); in background mode the worker finishes the job in flight and the rest are
    dropped (call :meth:`wait` first to keep them). ``AUTOFP4_AUTOTUNE=blocking|background`` turns
    it on for a whole process (with ``AUTOFP4_AUTOTUNE_BUDGET_S``, ``AUTOFP4_AUTOTUNE_DUTY``,
    ``AUTOFP4_AUTOTUNE_WORKERS`` and ``AUTOFP4_AUTOTUNE_OPS``, comma-separated).
    """

    def __init__(self, mode: str = "blocking", budget_s: float | None = None, ops: Iterable[str] = OPS,
                 backends: Sequence[str] | None = None, duty: float | None = None,
                 workers: int | None = None) -> None:
        self.settings = _settings(mode, budget_s, ops, backends, duty, workers)
        self._scopes: list[_Scope] = []  # one per block this object is entered in (they may nest)

    def __enter__(self) -> "autotune":
        s = _Scope(**self.settings)
        self._scopes.append(s)
        _push(s)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self._scopes:
            return
        s = self._scopes.pop()
        try:
            if s.mode == "blocking" and exc_type is None:
                s.wait()
        finally:
            _pop(s)
            s.close()
            global _LAST_REPORTS
            _LAST_REPORTS = s.reports()

    @staticmethod
    def start(device: torch.device | str | int | None = None) -> bool:
        """Start the tuning worker of ``device`` (default: the current CUDA device, else the CPU)
        now, so that its start (a process importing torch and the kernel compiler, its compile
        workers, the timing process and its CUDA context: seconds) overlaps what comes before the
        first call, such as loading the model, instead of delaying the first call that misses::

            with autofp4.autotune(mode="blocking"):
                autofp4.autotune.start()
                model = autofp4.from_pretrained(path, device_map="cuda")
                model(warmup_batch)

        True when the worker runs (False: no ops are tuned, or it cannot start, warned once).
        Raises ``RuntimeError`` with no autotuning on, ``ValueError`` for a device this machine
        lacks or one that runs no kernels (only cuda and cpu do)."""
        s = active()
        if s is None:
            raise RuntimeError("autofp4.autotune.start(): no autotuning is on: call it inside `with "
                               "autofp4.autotune(...)`, or with AUTOFP4_AUTOTUNE set")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dev = dispatch._checked_device(device, "autofp4.autotune.start()")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"autofp4.autotune.start(): device {device!r} cannot run kernels; autofp4 tunes on "
                             "cuda or cpu")
        return s.start(dev)

    @staticmethod
    def pending() -> int:
        """Jobs queued or being tuned, not finished yet (0 with no autotuning on)."""
        s = active()
        return 0 if s is None else sum(len(w.pending) for w in list(s.workers.values()))

    @staticmethod
    def jobs() -> list[dict[str, Any]]:
        """The jobs finished so far under the autotuning in effect (after a ``with autotune()``
        block: the jobs that block finished), in the order they finished: the problem (op, fmt,
        dtype, n, k, ...), ``m``, ``status``, the pick (``backend``, ``config``, ``median_us``
        against ``default_us``), ``trials_run`` / ``trials_failed``, ``note``, and ``wall_s``: the
        job's time in the worker (its queueing left out)."""
        s = active()
        return list(_LAST_REPORTS) if s is None else s.reports()

    @staticmethod
    def wait(timeout: float | None = None) -> bool:
        """Finish every job queued so far (blocking mode: those met during CUDA graph capture;
        background mode: the worker's queue; both: jobs another process is tuning), then pick up
        the rows. True when all finished within ``timeout`` seconds (also with no autotuning on)."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                raise TypeError(f"autotune.wait(timeout): timeout must be a number of seconds or None, got "
                                f"{type(timeout).__name__} {timeout!r:.40}")
            if not timeout >= 0:
                raise ValueError(f"autotune.wait(timeout): timeout must be >= 0 seconds, got {timeout}")
        s = active()
        return True if s is None else s.wait(timeout)


def _env_number(name: str, kind: type, what: str, ok: Callable[[Any], bool]) -> Any:
    """The number in the environment variable ``name`` (None where unset or empty); ValueError
    naming the variable and its value where it is not a finite ``kind`` (int or float) that
    passes ``ok`` (``what`` says what it must be)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    try:
        v = kind(raw.strip())
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or not ok(v):
        raise ValueError(f"{name}={raw!r} is not {what}")
    return v


def from_env() -> None:
    """Turn autotuning on for the process where ``AUTOFP4_AUTOTUNE`` asks for it (a bad setting
    warns, naming the variable at fault and its value, and leaves it off)."""
    raw_mode = os.environ.get("AUTOFP4_AUTOTUNE", "")
    mode = raw_mode.strip().lower()
    if mode in ("", "0", "off", "none"):
        return
    ops_text = os.environ.get("AUTOFP4_AUTOTUNE_OPS")
    ops = OPS if ops_text is None else tuple(o.strip() for o in ops_text.split(",") if o.strip())
    try:
        if mode not in MODES:
            raise ValueError(f"use {', '.join(MODES)} or off")
        if not frozenset(ops) <= set(OPS):
            raise ValueError(f"AUTOFP4_AUTOTUNE_OPS={ops_text!r} is not a comma-separated subset of "
                             f"{', '.join(OPS)}")
        budget_s = _env_number("AUTOFP4_AUTOTUNE_BUDGET_S", float, "a positive number of seconds", lambda v: v > 0)
        duty = _env_number("AUTOFP4_AUTOTUNE_DUTY", float, f"a number in [{MIN_DUTY}, 1] (the share of the wall "
                           "time the worker may measure, e.g. 0.5)", lambda v: MIN_DUTY <= v <= 1)
        workers = _env_number("AUTOFP4_AUTOTUNE_WORKERS", int, f"an integer from 0 to {A.max_workers()} (compile "
                              f"processes, at most {A.WORKERS_PER_CORE} per CPU core)",
                              lambda v: 0 <= v <= A.max_workers())
        s = _Scope(**_settings(mode, budget_s, ops, None, duty, workers))
    except (ValueError, TuningDBError) as e:  # TuningDBError: an AUTOFP4_DB that names no usable path
        warnings.warn(f"autofp4: AUTOFP4_AUTOTUNE={raw_mode!r} ignored (just-in-time tuning stays off): {e}",
                      RuntimeWarning, stacklevel=2)
        return
    _push(s)
    atexit.register(s.close)
