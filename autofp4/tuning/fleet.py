"""Tuning on several devices of a host: one tuning process per device, all on one job queue.

:func:`tune_on_devices` spawns one process per device (the ``spawn`` start method: each builds
its own CUDA context, compile workers sized to its share of the CPU cores, timing process and
DB connection) and gives every process the whole job list in the same order. A process tunes a
job only while it holds the job's claim (:mod:`.claims`: a lock beside the DB), so each job is
measured on one device only and stored once; a job another process holds goes to the back of
the queue, and once its result is stored the others skip it. A process that dies (a GPU fault,
a hang killed, ``kill -9``) loses only the job it was on: the operating system releases its
claim, and another process takes the job up again. The run's rows are the same kind as a
one-device run's (same provenance, one environment: the devices of one host are one model).

With an optuna RDB storage (``storage=``) the studies live there as in a one-device run; the
claims still decide which process measures a job.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import time
from typing import Any, Callable, Sequence

import torch

from .jobs import Job, JobResult, TuneReport

#: a job's results in the processes' reports, best first: the process that did the work
#: speaks for the job
_RANK = {"tuned": 0, "kept": 1, "no_valid_config": 2, "error": 3, "skipped": 4, "out_of_time": 5,
         "interrupted": 6}


def compile_workers_per_device(devices: int, cores: int | None = None) -> int:
    """Compile worker processes for each of ``devices`` tuning processes on a GPU host: the
    cores less two, shared evenly (at least one each, at most 16)."""
    cores = cores or os.cpu_count() or 2
    return max(1, min(16, (cores - 2) // max(1, devices)))


class _EventBar:
    """The progress-bar interface a job stream drives (:func:`~.run.tune_jobs`), forwarding to
    the parent over the process's pipe: ``("update", i, n)`` per finished job, ``("trial", i,
    text)`` per measured trial."""

    def __init__(self, index: int, conn: Any) -> None:
        self.index, self.conn = index, conn

    def update(self, n: int = 1) -> None:
        self.conn.send(("update", self.index, n))

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.conn.send(("trial", self.index, text))

    def close(self) -> None:
        pass


def _child(index: int, device: str, jobs: list[Job], kwargs: dict[str, Any], conn: Any,
           sys_path: list[str], registry: dict[str, str]) -> None:
    for p in sys_path:  # where the parent found its modules (plug-in backends among them)
        if p not in sys.path:
            sys.path.append(p)
    from ..backends import register
    from .run import tune_jobs

    for name, spec in registry.items():  # the parent's backends, plug-ins included
        register(name, spec)
    conn.send(("started", index, os.getpid()))
    try:
        report = tune_jobs(jobs, devices=[device], progress=_EventBar(index, conn), exclusive=True, **kwargs)
    except BaseException as e:
        conn.send(("failed", index, f"{type(e).__name__}: {e}"[:500]))
        raise
    conn.send(("report", index, report.results, report.interrupted))
    conn.close()


def _merge(jobs: Sequence[Job], reports: dict[int, list[JobResult]], devices: Sequence[str]) -> list[JobResult]:
    """One result per job: the best-ranked status among the processes' results (the one that
    tuned it), its note naming the device; jobs no process finished are ``error``."""
    out = []
    for j, job in enumerate(jobs):
        best: tuple[int, JobResult, str] | None = None
        for i, results in sorted(reports.items()):
            r = results[j]
            rank = _RANK.get(r.status, 3)
            if best is None or rank < best[0]:
                best = (rank, r, devices[i])
        if best is None:
            out.append(JobResult(job, "error", note="no tuning process finished it"))
            continue
        r, dev = best[1], best[2]
        if r.status != "skipped":
            r.note = f"on {dev}" + (f"; {r.note}" if r.note else "")
        out.append(r)
    return out


def tune_on_devices(
    jobs: Sequence[Job], devices: Sequence[torch.device | str], *, workers: int | None = None,
    progress: bool = True, on_event: Callable[..., None] | None = None, **kwargs: Any,
) -> TuneReport:
    """Tune ``jobs`` with one process per entry of ``devices`` (CUDA devices, or ``"cpu"``
    entries standing in for them: the reference backend in several processes); ``kwargs`` go
    to each process's :func:`~.run.tune_jobs` (``db``, ``storage``, ``backends``, budgets, ...).
    ``workers``: compile workers per process (default :func:`compile_workers_per_device` on
    the GPU, none on the CPU). ``progress``: a bar per device. ``on_event(kind, index, pid,
    *data)``: called in this process for every event of the processes (``started``, ``trial``,
    ``update``, ``report``, ``failed``, ``exited`` with the exit code). The run's time budget
    (``budget_total_s``) is each process's."""
    from ..env import current_environment

    devs = [str(torch.device(d)) for d in devices]
    if len(devs) < 1:
        raise ValueError("tune_on_devices needs at least one device")
    on_gpu = devs[0].startswith("cuda")
    if any(d.startswith("cuda") != on_gpu for d in devs):
        raise ValueError(f"devices must all be CUDA devices or all 'cpu', got {devs}")
    if on_gpu and len(set(devs)) != len(devs):
        raise ValueError(f"a CUDA device is given twice: {devs}")
    per = workers if workers is not None else (compile_workers_per_device(len(devs)) if on_gpu else 0)
    kwargs = dict(kwargs, workers=per)
    if kwargs.get("db") is not None and not isinstance(kwargs["db"], (str, os.PathLike)):
        kwargs["db"] = str(kwargs["db"].path)  # a TuningDB: each process opens its own connection
    jobs = list(jobs)
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    from ..backends import _REGISTRY

    # one pipe per process, not one shared queue: a process killed while it writes takes only its
    # own channel with it (a shared queue's lock would stay taken and hang the others' exit)
    procs, conns = [], []
    for i, d in enumerate(devs):
        r, w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_child, args=(i, d, jobs, kwargs, w, list(sys.path), dict(_REGISTRY)),
                                 name=f"autofp4-tune-{d}"))
        conns.append((r, w))
    bars = _bars(devs, len(jobs)) if progress else []
    reports: dict[int, list[JobResult]] = {}
    interrupted = False
    pids: dict[int, int] = {}
    try:
        for p, (_, w) in zip(procs, conns):
            p.start()
            w.close()  # the child holds the write end: its exit ends the parent's reads
        live = {r: i for i, (r, _) in enumerate(conns)}
        while live:
            for r in mp_connection.wait(list(live), timeout=1.0):
                i = live[r]
                try:
                    ev = r.recv()
                except (EOFError, OSError, pickle.UnpicklingError):  # ended (or died mid-message)
                    del live[r]
                    procs[i].join()
                    if on_event is not None:
                        on_event("exited", i, pids.get(i), procs[i].exitcode)
                    continue
                interrupted |= _handle(ev, bars, reports, pids, on_event)
    except KeyboardInterrupt:
        interrupted = True
        for p in procs:
            if p.is_alive():
                p.terminate()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for r, _ in conns:
            r.close()
        for b in bars:
            b.close()
    env = current_environment(torch.device(devs[0]))
    report = TuneReport(device=", ".join(devs), env_key=env.key(), interrupted=interrupted)
    report.results = _merge(jobs, reports, devs)
    lost = [devs[i] for i, p in enumerate(procs) if i not in reports]
    if lost:
        report.failed_devices = {devs[i]: procs[i].exitcode for i in range(len(procs)) if i not in reports}
        print(f"autofp4 tune: the process on {', '.join(lost)} ended without a report "
              f"(exit codes {list(report.failed_devices.values())}); its jobs went to the others", file=sys.stderr)
    report.elapsed_s = time.monotonic() - t0
    return report


def _handle(ev: tuple, bars: list, reports: dict, pids: dict, on_event: Callable[..., None] | None) -> bool:
    kind, i, *data = ev
    if kind == "started":
        pids[i] = data[0]
    elif kind == "update" and bars:
        bars[i].update(data[0])
    elif kind == "trial" and bars:
        bars[i].set_postfix_str(data[0], refresh=False)
    elif kind == "report":
        reports[i] = data[0]
    if on_event is not None:
        on_event(kind, i, pids.get(i), *data)
    return kind == "report" and bool(data[1])


def _bars(devs: Sequence[str], total: int) -> list:
    from tqdm.auto import tqdm

    return [tqdm(total=total, desc=d, unit="job", position=i, dynamic_ncols=True, file=sys.stderr)
            for i, d in enumerate(devs)]
