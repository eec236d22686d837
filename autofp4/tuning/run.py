"""Running jobs: :func:`tune_jobs` (one job stream per device, sharing one job queue, the
compile pool and the time budget), :func:`tune` and :func:`tune_from_misses`."""
from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..backends import available_backends, get_backend
from ..backends.base import Backend
from ..problem import ProblemKey
from ..dispatch import DEFAULT_M_BUCKETS, load_misses
from . import budget
from .budget import _out_of_time, job_share_deadline
from .claims import JobClaims
from .compile_pool import _pool_init, _short_error, _start_pool
from .job import _Interrupted, _tune_job
from .jobs import (CPU_DEFAULTS, CPU_M_BUCKETS, GPU_DEFAULTS, STORED, Job, JobResult, TuneReport, _Ctx, _Defaults,
                   jobs_for)
from .measurer import _Measurer
from . import args as A
from .search import _ask_lock_path, _open_storage


def _claims(db_path: Path, url: str | None, storage: Any, exclusive: bool) -> Any:
    """Who may tune a job: file claims beside the DB (processes of one host), claims in the
    storage's database with ``exclusive`` and a shared storage (processes on several hosts), or
    none (a shared storage without ``exclusive``: the processes share each job's study)."""
    if storage is None:
        return JobClaims(db_path)
    if exclusive:
        from .claims import RDBClaims

        return RDBClaims(url)
    return None


def _open_db(db: Any) -> tuple[Any, bool, Path]:
    """``(TuningDB, owned, path)`` for a TuningDB, a path or None (the user DB)."""
    from ..db import TuningDB
    from ..dispatch import user_db_path

    if db is None:
        t = TuningDB(user_db_path())
        return t, True, t.path
    if isinstance(db, (str, os.PathLike)):
        t = TuningDB(db)
        return t, True, t.path
    return db, False, Path(db.path)


#: a job stream whose queue holds only jobs other processes are tuning polls it this often
CLAIM_POLL_S = 0.2


def _stream(
    jobs: "queue.Queue[tuple[int, Job]]", ctx: _Ctx, db: Any, meas: _Measurer, out: dict[int, JobResult]
) -> None:
    """Work through the job queue on one device (one thread per device). A job another process
    holds the claim of (:mod:`.claims`) goes back to the end of the queue."""
    busy = 0  # jobs put back in a row
    try:
        while True:
            try:
                i, job = jobs.get_nowait()
            except queue.Empty:
                return
            claim = None
            if ctx.stop.is_set():
                out[i] = JobResult(job, "interrupted", note="not started")
            elif _out_of_time(ctx):
                out[i] = JobResult(job, "out_of_time", note="time budget used up")
            elif ctx.claims is not None and (claim := ctx.claims.take(ctx.env_key, job)) is None:
                jobs.put((i, job))  # another process is tuning it: after the others
                busy += 1
                if busy > jobs.qsize():  # every job left is another process's now
                    time.sleep(CLAIM_POLL_S)
                    busy = 0
                continue
            elif getattr(claim, "elsewhere", False):
                out[i] = JobResult(job, "skipped", note="tuned by another process of the shared storage")
            else:
                busy = 0
                try:
                    out[i] = _run_job(jobs, job, ctx, db, meas)
                finally:
                    if claim is not None:
                        claim.release(done=i in out and out[i].status in STORED)
            if ctx.pbar is not None:
                with ctx.lock:
                    ctx.pbar.update(1)
    finally:
        meas.close()


def _run_job(jobs: "queue.Queue[tuple[int, Job]]", job: Job, ctx: _Ctx, db: Any, meas: _Measurer) -> JobResult:
    """Tune ``job`` with its share of the time (the jobs still queued after it share the rest)."""
    with jobs.mutex:  # peek: the next job's first compile overlaps this job
        nxt = jobs.queue[0][1] if jobs.queue else None
        queued = {j.key for _, j in jobs.queue}
    ctx.jobs_after = jobs.qsize()
    ctx.set_up.add(job.key)
    ctx.setups_after = len(queued - ctx.set_up)
    ctx.job_deadline = job_share_deadline(budget._now(), ctx.deadline, ctx.jobs_after + 1, ctx.streams,
                                          budget.setup_reserve(list(ctx.setup_s.values()), ctx.setups_after,
                                                               ctx.streams))
    return _guarded_job(job, ctx, db, meas, nxt)


def _guarded_job(job: Job, ctx: _Ctx, db: Any, meas: _Measurer,
                 then: Job | Sequence[Job] | None = None) -> JobResult:
    """:func:`_tune_job`, with Ctrl-C stopping the run (``ctx.stop``) and any other failure
    reported as the job's ``error``."""
    try:
        return _tune_job(job, ctx, db, meas, then=then)
    except _Interrupted as e:
        ctx.stop.set()
        return e.result
    except Exception as e:  # a DB or optuna failure ends this job, not the run
        return JobResult(job, "error", note=_short_error(e))


def _stream_owned_db(q: Any, ctx: _Ctx, db_path: Path, meas: _Measurer, out: dict[int, JobResult]) -> None:
    """A job stream on its own thread, with its own DB connection (SQLite connections stay
    on the thread that opened them)."""
    from ..db import TuningDB

    try:
        db = TuningDB(db_path)
    except Exception:
        meas.close()
        raise
    try:
        _stream(q, ctx, db, meas, out)
    finally:
        db.close()


def _resolve_devices(
    gpus: Sequence[int] | None, devices: Sequence[torch.device | str] | None, device: torch.device | str | None
) -> list[torch.device]:
    """The devices of the run's job streams, from ``gpus``, ``devices`` or ``device``."""
    if gpus and devices:
        raise ValueError("give gpus or devices, not both")
    if gpus:
        if not torch.cuda.is_available():
            raise RuntimeError(f"gpus={list(gpus)} given, but no CUDA GPU is available")
        return [torch.device("cuda", int(g)) for g in gpus]
    if devices:
        devs = [torch.device(A.device(d, f"devices[{i}]")) for i, d in enumerate(devices)]
        if len({d.type for d in devs}) != 1:
            raise ValueError(f"devices must all be of one type, got {[str(d) for d in devs]}")
        return devs
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return [dev]


def _budgets(budget_per_shape: int | None, budget_total_s: float | None, defaults: _Defaults
             ) -> tuple[int, float | None]:
    """Trials per job and the run's time budget in seconds (None: no limit), checked."""
    per_job = int(budget_per_shape or defaults.budget)
    if per_job < 1:
        raise ValueError(f"budget_per_shape must be >= 1, got {per_job}")
    if budget_total_s is None:
        budget_total_s = defaults.time_budget_s
    elif not budget_total_s > 0:
        raise ValueError(f"budget_total_s must be > 0 (math.inf: no limit), got {budget_total_s}")
    if budget_total_s is not None and math.isinf(budget_total_s):
        budget_total_s = None
    return per_job, budget_total_s


def _chosen_backends(backends: Sequence[str] | None, device: torch.device) -> list[Backend]:
    """The named backends (each must run on ``device``), else every backend available there."""
    if not backends:
        return available_backends(device)
    chosen = [get_backend(n) for n in backends]
    for b in chosen:
        why = b.unavailable_reason(device)
        if why:
            raise RuntimeError(f"backend {b.name!r} cannot run on {device}: {why}")
    return chosen


def _default_workers(on_gpu: bool) -> int:
    """Compile worker processes: CPU cores - 2 (at most 16) on the GPU, none (in-process) on the CPU."""
    return max(1, min(16, (os.cpu_count() or 2) - 2)) if on_gpu else 0


def _open_pool(workers: int, on_gpu: bool) -> cf.ProcessPoolExecutor | None:
    """The compile worker processes, all started (None for ``workers`` 0: compile in-process)."""
    if workers <= 0:
        return None
    from ..kernel_cache import target_arch

    arch = target_arch() if on_gpu else ""
    pool = cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_pool_init, initargs=(arch, True)
    )
    _start_pool(pool, workers)
    return pool


def _progress_bar(progress: Any, total: int) -> Any:
    """A tqdm bar (``progress`` True), none (False), or ``progress`` itself: an object with
    tqdm's ``update``, ``set_postfix_str`` and ``close``."""
    if not isinstance(progress, bool):
        return progress
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="tuning", unit="job", dynamic_ncols=True, file=sys.stderr)


def _job_queue(jobs: Sequence[Job]) -> "queue.Queue[tuple[int, Job]]":
    """The run's jobs with their indices, shared by its job streams."""
    q: queue.Queue[tuple[int, Job]] = queue.Queue()
    for i, j in enumerate(jobs):
        q.put((i, j))
    return q


def _close_run(pool: cf.ProcessPoolExecutor | None, pbar: Any, db: Any) -> None:
    """Stop the compile workers (queued compiles cancelled), close the progress bar and ``db``
    (the DB the run opened, None for one it was given)."""
    if pool is not None:
        _stop_pool(pool)
    if pbar is not None:
        pbar.close()
    if db is not None:
        db.close()


def _stop_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Shut the compile pool down without waiting for the compiles still running: they serve
    no job of this run any more, and a process exits only once its pool's workers have (a cold
    compile can take a minute). Killing one mid-compile loses nothing: the kernel cache
    writes its files under a temporary name and renames them."""
    terminate = getattr(pool, "terminate_workers", None)  # Python >= 3.14
    if terminate is not None:
        terminate()
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()


def _run_streams(
    q: "queue.Queue[tuple[int, Job]]", devices: Sequence[torch.device], ctx_for: Callable[[torch.device], _Ctx],
    main_db: Any, db_path: Path, isolate: bool, timeout: float, out: dict[int, JobResult],
) -> None:
    """One job stream per device: on this thread with ``main_db`` for one device, else one
    thread each with its own DB connection (Ctrl-C waits for them)."""
    if len(devices) == 1:
        _stream(q, ctx_for(devices[0]), main_db, _Measurer(devices[0], isolate, timeout), out)
        return
    threads = []
    for dev in devices:
        ctx = ctx_for(dev)
        th = threading.Thread(
            target=_stream_owned_db, args=(q, ctx, db_path, _Measurer(dev, True, timeout), out), daemon=True
        )
        th.start()
        threads.append(th)
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.5)
    except KeyboardInterrupt:
        ctx.stop.set()  # one event, shared by every stream's settings
        for th in threads:
            th.join()


def tune_jobs(
    jobs: Sequence[Job],
    backends: Sequence[str] | None = None,
    db: Any = None,
    device: torch.device | str | None = None,
    budget_per_shape: int | None = None,
    budget_total_s: float | None = None,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
    *,
    gpus: Sequence[int] | None = None,
    storage: str | None = None,
    isolate: bool | None = None,
    trial_timeout_s: float | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
    exclusive: bool = False,
) -> TuneReport:
    """Tune explicit :class:`Job` s (see :func:`tune` for the parameters).

    ``devices`` generalizes ``gpus``: one job stream (a thread driving its own timing
    worker process and DB connection) per entry; entries may repeat (``["cpu", "cpu"]``).
    ``exclusive``: with a shared ``storage`` too, a job is tuned by one process at a time (claims
    in the storage's database, :class:`~.claims.RDBClaims`), not by every process on the shared
    study (:mod:`.fleet`).
    """
    from ..env import current_environment
    from ..schema import utc_now

    _check_run_args(backends, db, device, budget_per_shape, budget_total_s, force, workers, progress, gpus,
                    isolate, trial_timeout_s, warmup, reps)
    devices = _resolve_devices(gpus, devices, device)
    on_gpu = devices[0].type == "cuda"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    per_job, budget_total_s = _budgets(budget_per_shape, budget_total_s, defaults)
    chosen = _chosen_backends(backends, devices[0])
    if workers is None:
        workers = _default_workers(on_gpu)
    if isolate is None:
        isolate = on_gpu
    timeout = float(trial_timeout_s or defaults.trial_timeout_s)
    env = current_environment(devices[0])
    t0 = budget._now()
    started_at = utc_now()
    report = TuneReport(device=", ".join(str(d) for d in devices), env_key=env.key())
    main_db, owned, db_path = _open_db(db)
    if storage is not None:
        from .storage import storage_problem

        if why := storage_problem(storage, db_path, "storage"):
            if owned:
                main_db.close()
            raise ValueError(why)
    storage_obj = _open_storage(storage)
    main_db.add_environment(env)
    claims = _claims(db_path, storage, storage_obj, exclusive)
    pool = _open_pool(workers, on_gpu)
    pbar = _progress_bar(progress, len(jobs))
    lock = threading.Lock()
    stop = threading.Event()
    seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    out: dict[int, JobResult] = {}
    q = _job_queue(jobs)

    def ctx_for(dev: torch.device) -> _Ctx:
        return _Ctx(
            device=dev, env=current_environment(dev), env_key=env.key(), backends=chosen, budget=per_job,
            warmup=int(warmup if warmup is not None else defaults.warmup),
            reps=int(reps if reps is not None else defaults.reps),
            deadline=None if budget_total_s is None else t0 + float(budget_total_s),
            force=force, storage=storage_obj, ask_lock=_ask_lock_path(storage), window=max(1, workers), pool=pool,
            compile_timeout_s=timeout, stop=stop, pbar=pbar, lock=lock, seed=seed, streams=len(devices),
            reference_as_fallback=not backends, started_at=started_at, claims=claims,
        )

    try:
        _run_streams(q, devices, ctx_for, main_db, db_path, isolate, timeout, out)
    except KeyboardInterrupt:
        stop.set()
    finally:
        _close_run(pool, pbar, main_db if owned else None)
        if claims is not None:
            claims.close()
    report.interrupted = stop.is_set()
    for i, j in enumerate(jobs):
        report.results.append(out.get(i) or JobResult(j, "interrupted" if report.interrupted else "out_of_time"))
    report.elapsed_s = budget._now() - t0
    return report


def _check_run_args(backends: Any, db: Any, device: Any, budget_per_shape: Any, budget_total_s: Any, force: Any,
                    workers: Any, progress: Any, gpus: Any, isolate: Any, trial_timeout_s: Any, warmup: Any,
                    reps: Any) -> None:
    """The arguments of :func:`tune_jobs`, checked before any work (see :mod:`.args`)."""
    A.names(backends, "backends")
    A.db(db)
    A.device(device)
    A.count(budget_per_shape, "budget_per_shape", 1)
    A.seconds(budget_total_s, "budget_total_s")
    A.flag(force, "force")
    A.workers(workers, "workers")
    A.progress(progress)
    if gpus is not None:
        if isinstance(gpus, (str, bytes, Mapping)) or not hasattr(gpus, "__iter__"):
            raise TypeError(f"gpus must be a list of CUDA device indices such as [0, 1], got {gpus!r:.80}")
        for i, g in enumerate(list(gpus)):
            A.count(g, f"gpus[{i}]", 0)
    A.flag(isolate, "isolate", none_ok=True)
    A.seconds(trial_timeout_s, "trial_timeout_s", inf_ok=False)
    A.count(warmup, "warmup", 0)
    A.count(reps, "reps", 1)


def tune(
    shapes: Sequence[Any],
    m_buckets: Sequence[int] | None = None,
    backends: Sequence[str] | None = None,
    db: Any = None,
    device: torch.device | str | None = None,
    budget_per_shape: int | None = None,
    budget_total_s: float | None = None,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
    *,
    fmt: str = "nvfp4",
    dtype: str = "bfloat16",
    gpus: Sequence[int] | None = None,
    storage: str | None = None,
    isolate: bool | None = None,
    trial_timeout_s: float | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
) -> TuneReport:
    """Tune every (shape, M bucket) and store the winners in the tuning DB.

    ``shapes``: :class:`~autofp4.models.ModelShape` s (with ``fmt``/``dtype``) or
    :class:`ProblemKey` s. ``m_buckets``: default ``DEFAULT_M_BUCKETS`` on the GPU,
    ``CPU_M_BUCKETS`` on the CPU. ``backends``: backend names (default: every backend that
    applies to the device). ``db``: a TuningDB, a path, or None for the user DB.
    ``budget_per_shape``: trials per (shape, bucket) (default 32 GPU / 3 CPU);
    ``budget_total_s``: wall-clock budget of the whole run (default 900 s on the GPU, none on
    the CPU; ``math.inf``: none). Each job gets an equal share of the time left when it starts
    and stops asking for trials at the end of it once it has a measured result; jobs that
    cannot start in time are reported as ``out_of_time``. ``force``: re-tune jobs that already
    have a result, starting from the stored winner. ``workers``: compile worker processes
    (default: CPU count based on the GPU, 0 on the CPU = compile in-process). ``gpus``: CUDA
    device indices, one job stream each (``devices``: the same with explicit devices, e.g.
    ``["cpu", "cpu"]``). ``storage``: an optuna RDB URL shared by cooperating processes.
    ``isolate``: run trials in a restartable child process (default: on the GPU).
    ``trial_timeout_s``: per-trial limit in the child.
    """
    if isinstance(shapes, (str, bytes, Mapping)) or not hasattr(shapes, "__iter__"):
        raise TypeError(f"shapes must be a list of ModelShapes (autofp4.models.model_shapes) or ProblemKeys, "
                        f"got {type(shapes).__name__}")
    shapes = list(shapes)
    if not shapes:
        raise ValueError("shapes is empty: nothing to tune (autofp4.models.model_shapes gives a model's shapes)")
    A.device(device)
    first = devices[0] if devices else (device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = bool(gpus) or torch.device(first).type == "cuda"
    if m_buckets is None:
        m_buckets = DEFAULT_M_BUCKETS if on_gpu else CPU_M_BUCKETS
    ms = sorted(set(A.m_values(m_buckets)))
    return tune_jobs(
        jobs_for(shapes, ms, fmt, dtype), backends, db, device, budget_per_shape, budget_total_s, force,
        workers, progress, gpus=gpus, storage=storage, isolate=isolate, trial_timeout_s=trial_timeout_s,
        warmup=warmup, reps=reps, devices=devices,
    )


def misses_jobs(misses_path: str | os.PathLike | None = None) -> list[Job]:
    """The jobs of the ``(key, M bucket)`` pairs a workload missed, ordered by how many calls
    missed them (most first); ``misses_path`` defaults to the misses file next to the user DB."""
    counts: dict[tuple[ProblemKey, int], int] = {}
    eg: dict[tuple[ProblemKey, int], int] = {}
    for key, m, c, g in load_misses(misses_path, experts_global=True):
        counts[(key, m)] = counts.get((key, m), 0) + c
        if g:
            eg.setdefault((key, m), g)
    return [Job(k, m, f"{c} missed calls", experts_global=eg.get((k, m), 0))
            for (k, m), c in sorted(counts.items(), key=lambda kv: -kv[1])]


def tune_from_misses(misses_path: str | os.PathLike | None = None, **kwargs: Any) -> TuneReport:
    """Tune exactly the ``(key, M bucket)`` pairs a workload missed (see :mod:`autofp4.dispatch`;
    :func:`misses_jobs`); ``kwargs`` go to :func:`tune_jobs`."""
    return tune_jobs(misses_jobs(misses_path), **kwargs)
