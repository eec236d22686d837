"""Tuning jobs one at a time as they come (just-in-time tuning): :class:`OnlineTuner` keeps the
compile workers, the timing process and the DB connection of one device from one job to the
next, gives every job its own time budget, and tunes a job only while it holds its claim (a job
another process is tuning is answered ``busy`` at once, not waited for). Its rows are marked
``origin = "jit"``; everything else is the offline tuner's pipeline."""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import torch

from ..env import current_environment
from . import budget
from .claims import JobClaims
from .jobs import CPU_DEFAULTS, GPU_DEFAULTS, STORED, Job, JobResult, _Ctx
from .measurer import _PacedMeasurer
from .run import _chosen_backends, _close_run, _default_workers, _guarded_job, _open_db, _open_pool, _resolve_devices

#: a job's time on the GPU, in seconds: it stops asking for trials then once it has a measured
#: result (and gives up at twice that). Sized so that Llama-3.1-8B's 40 jobs of M <= 512 (4 shapes
#: x 10 buckets, 40 x 3 s = 2 minutes) and the worker's start fit in 3 minutes.
GPU_BUDGET_S = 3.0


class OnlineTuner:
    """Tunes single jobs on ``device`` on demand into the DB at ``db_path``.

    ``budget_s``: each job's time (default :data:`GPU_BUDGET_S` on the GPU, none on the CPU,
    where the reference backend's three trials bound it); ``backends``: names (default: every
    backend that runs on the device, the reference backend only where no other applies);
    ``duty``: the share of the wall time spent measuring (:class:`~.measurer._PacedMeasurer`;
    a job's time stretches by ``1 / duty``). ``compile_grace_s``: once a job has a measured
    config, how long it waits for another candidate's compile (None: while its time lasts; a
    blocking caller's jobs take what is compiled, the rest still lands in the kernel cache). The compile workers and the timing process start
    here, before any job's clock."""

    def __init__(self, device: torch.device | str, db_path: Any, budget_s: float | None = None,
                 backends: Sequence[str] | None = None, workers: int | None = None, duty: float = 1.0,
                 compile_grace_s: float | None = None) -> None:
        dev = _resolve_devices(None, None, device)[0]
        on_gpu = dev.type == "cuda"
        defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        if compile_grace_s is not None and not compile_grace_s >= 0:
            raise ValueError(f"compile_grace_s must be >= 0, got {compile_grace_s}")
        self.budget_s = (GPU_BUDGET_S if on_gpu else None) if budget_s is None else float(budget_s)
        workers = _default_workers(on_gpu) if workers is None else workers
        self.db, _, path = _open_db(db_path)
        self.meas = _PacedMeasurer(dev, on_gpu, defaults.trial_timeout_s, duty)
        self.meas.launch()  # the timing process starts while the compile workers do
        try:
            self.ctx = self._settings(dev, defaults, _chosen_backends(backends, dev), workers, not backends,
                                      JobClaims(path))
            self.ctx.compile_grace_s = compile_grace_s
            self.db.add_environment(self.ctx.env)
            self.ctx.pool = _open_pool(workers, on_gpu)
            self.meas.start()
        except BaseException:
            self.meas.close()
            raise

    @staticmethod
    def _settings(dev: torch.device, defaults: Any, chosen: list, workers: int, auto: bool, claims: JobClaims) -> _Ctx:
        env = current_environment(dev)
        return _Ctx(
            device=dev, env=env, env_key=env.key(), backends=chosen, budget=defaults.budget,
            warmup=defaults.warmup, reps=defaults.reps, deadline=None, force=False, storage=None, ask_lock=None,
            window=max(1, workers), pool=None, compile_timeout_s=defaults.trial_timeout_s, stop=threading.Event(),
            pbar=None, lock=threading.Lock(), seed=int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF,
            reference_as_fallback=auto, claims=claims, origin="jit", measure_first=True, firsts_only=True,
        )

    def tune(self, job: Job, then: Job | Sequence[Job] | None = None) -> JobResult:
        """Tune ``job`` now and store its winner, unless another process holds its claim (then
        status ``busy``, nothing done). A job already tuned (here or elsewhere) is ``skipped``.
        ``then``: the job (or jobs) expected next, whose default configs the compile workers compile while
        this one is measured (into the kernel cache, where the next job's first trial finds it)."""
        claim = self.ctx.claims.take(self.ctx.env_key, job)
        if claim is None:
            return JobResult(job, "busy", note="another process is tuning it")
        result = JobResult(job, "error", note="not finished")
        try:
            self._arm()
            result = _guarded_job(job, self.ctx, self.db, self.meas, then=then)
        finally:
            claim.release(done=result.status in STORED)
        return result

    def _arm(self) -> None:
        """The next job's time: its share ends ``budget_s`` (over the duty) from now, the hard
        stop at twice that (setup such as a problem's random weights may stretch the share)."""
        if self.budget_s is None:
            return
        now, span = budget._now(), self.budget_s / self.meas.duty
        self.ctx.job_deadline, self.ctx.deadline = now + span, now + 2 * span
        self.ctx.jobs_after = 0

    def close(self) -> None:
        """Stop the compile workers and the timing process; close the DB."""
        self.meas.close()
        _close_run(self.ctx.pool, None, self.db)
        self.ctx.claims.close()
