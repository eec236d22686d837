"""The tuner: for each problem and M bucket, find the fastest correct config and store it.

Pipeline of one job ``(ProblemKey, M bucket)``
----------------------------------------------
1. **Candidates**: the union over the applicable backends (registry order) of
   ``backend.candidates(key)`` (``candidates(key, m)`` where a backend narrows its grid by
   M); the job's *default* (what the dispatcher runs untuned: the
   first applicable backend's ``default(key, M)``) comes first, then the stored winners of
   the job (a re-tune) and of its neighbours (the other formats at this M, this format at the
   nearest stored M buckets), then each backend's ``seeds`` (configs that won measurements
   near this shape). Configs already recorded as
   failed for this environment and kernel source are skipped without running.
2. **Search**: an optuna study. When the candidate list fits in the trial budget it is a
   grid: every candidate is enqueued in order (default first) and the storage hands each
   queued trial to exactly one process. Otherwise ``TPESampler`` (constant liar, the default
   and the seeds enqueued first, at most half the budget) samples one categorical parameter
   per config field (so it learns which
   tile sizes, stages, ... are fast); a sampled combination that is not a valid candidate
   runs its nearest candidate. The study may live in an RDB storage
   (``storage="sqlite:///study.db"``, a PostgreSQL URL, ...) shared by several processes or
   hosts: its name is derived from the environment key, the problem, the bucket and the
   candidate list; the first process creates and fills it, the others load it. With a
   persistent storage, a re-run (also with ``force``) reuses the measurements stored there.
3. **Trial**: compile (in a pool of spawned worker processes when ``workers > 0``, so
   compilation overlaps the serial GPU timing; the timing process re-creates the runner from
   the backend's warm cache), **check** against the reference backend on fresh random data
   (random weights quantized with :func:`autofp4.quantize`, random activations; relative
   Frobenius error ``||out - ref|| / ||ref||`` at most ``TOLERANCE[dtype]``: 1e-2 for
   bfloat16, 5e-3 for float16, 3e-2 for the W4A8 MoE layer, ``OP_TOLERANCE``; non-finite
   outputs fail), then **time** it
   (:mod:`autofp4.timing`: CUDA events with cold-L2 argument rotation, a CUDA graph for
   kernels shorter than ``GRAPH_BELOW_US``; ``perf_counter`` on the CPU). Every trial is
   recorded (``ok``, ``compile_error``, ``runtime_fault``, ``wrong_result``, ``timeout``,
   ``invalid``). On the GPU each trial's check and timing run in one persistent worker
   process per GPU, restarted when it dies, hangs past ``trial_timeout_s`` or reports a CUDA
   fault, so a dead CUDA context only costs that worker.
4. **Choice**: the fastest correct candidate (ties: backend name, then config JSON) replaces
   the default only when :func:`~autofp4.timing.faster_beyond_noise` says so; otherwise the
   default is stored. When the default itself failed, the fastest correct candidate wins.

Runs are resumable (jobs that already have a result for this environment are skipped unless
``force``; every trial and result is written as soon as it is known, so Ctrl-C loses only
the trial in flight) and refine: a forced re-run tries the stored winner right after the
default, so it keeps it unless another config measures faster in the same run (and a job
whose share ends before the stored winner was measured again keeps its row: status ``kept``). A result
measured with an older source of its kernel is re-tuned, and its winner is tried right
after the default too (re-measured: a changed kernel usually keeps its best configs). They scale
out: ``gpus=[0, 1, ...]`` runs one job stream per GPU, and
several hosts can run the same command against one optuna storage and one shared DB. Runs
that write one DB at once keep the faster row of each job; without a shared storage they
split the jobs through lock files beside the DB (:mod:`.claims`).

Modules, each importing only those above it: :mod:`.jobs` (jobs, results, reports, run
defaults), :mod:`.budget` (the clock and the time shares), :mod:`.claims` (one process per
job), :mod:`.candidates`,
:mod:`.compile_pool` (compile workers, trial requests, backend specs), :mod:`.trial` (one
trial: data, check, timing), :mod:`.measurer` (the timing process), :mod:`.search` (optuna),
:mod:`.job` (tuning one job), :mod:`.run` (:func:`tune_jobs`, :func:`tune`,
:func:`tune_from_misses`), :mod:`.fleet` (:func:`~.fleet.tune_on_devices`: one process per
device), :mod:`.warm` (:func:`warm_kernel_cache`), then just-in-time tuning:
:mod:`.online` (jobs one at a time, as they come), :mod:`.worker` (the tuning worker process and
its parent's end) and :mod:`.jit` (:class:`~.jit.autotune`, the dispatcher's miss hook).
"""
from __future__ import annotations

from .budget import job_share_deadline, setup_cap, setup_reserve, trial_estimate
from .jobs import CPU_DEFAULTS, CPU_M_BUCKETS, GPU_DEFAULTS, Job, JobResult, TuneReport, jobs_for
from .fleet import tune_on_devices
from .run import misses_jobs, tune, tune_from_misses, tune_jobs
from .trial import TOLERANCE, run_trial
from .warm import WarmReport, warm_kernel_cache

__all__ = [
    "TOLERANCE",
    "CPU_M_BUCKETS",
    "GPU_DEFAULTS",
    "CPU_DEFAULTS",
    "Job",
    "JobResult",
    "TuneReport",
    "WarmReport",
    "tune",
    "tune_jobs",
    "tune_from_misses",
    "tune_on_devices",
    "misses_jobs",
    "warm_kernel_cache",
    "jobs_for",
    "run_trial",
    "job_share_deadline",
    "setup_cap",
    "setup_reserve",
    "trial_estimate",
]
