"""The units of a tuning run and what it reports: :class:`Job`, :class:`JobResult`,
:class:`TuneReport` (with its table), :func:`jobs_for`, the run defaults on the GPU and the
CPU, and the settings one job stream runs with."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from ..backends.base import Backend
from ..problem import DTYPES, FORMATS, ProblemKey, is_moe, shape_errors, standard_bucket

#: M buckets tuned on the CPU (the reference backend; the CPU is a fallback, not a target).
CPU_M_BUCKETS: tuple[int, ...] = (1, 16, 128)


@dataclass(frozen=True)
class _Defaults:
    budget: int
    warmup: int
    reps: int
    trial_timeout_s: float
    time_budget_s: float | None  # wall clock of a whole run, shared fairly by its jobs


# 32 trials per job and 15 minutes per run: Llama-3.1-8B (4 shapes x 14 M buckets) fits
GPU_DEFAULTS = _Defaults(budget=32, warmup=10, reps=30, trial_timeout_s=300.0, time_budget_s=900.0)
# on the CPU the correctness check's call is the warm-up
CPU_DEFAULTS = _Defaults(budget=3, warmup=0, reps=3, trial_timeout_s=600.0, time_budget_s=None)


# -----------------------------------------------------------------------------------------
# public data
# -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One unit of tuning: a problem at one M bucket (``name``: the model's layer names).
    ``experts_global``: a MoE job of one rank's slice of an expert-parallel layer (see
    :class:`~autofp4.models.ModelShape`): its trials route each token's top-k among that many
    experts and run the slice with the rank's expert map, so that the slice gets its share of
    the pairs; 0: every pair is routed to the job's own experts."""

    key: ProblemKey
    m: int
    name: str = ""
    experts_global: int = 0


#: the statuses of a job whose result is stored (by this run or another)
STORED = ("tuned", "skipped", "kept")


@dataclass
class JobResult:
    """What tuning one job found (``status``: tuned | skipped | kept | no_valid_config |
    interrupted | out_of_time; ``kept``: a forced re-tune that did not get to measure the
    stored winner again, whose row therefore stays)."""

    job: Job
    status: str
    backend: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    median_us: float | None = None
    spread_us: float | None = None
    default_backend: str = ""
    default_config: dict[str, Any] = field(default_factory=dict)
    default_us: float | None = None
    trials_run: int = 0
    trials_failed: int = 0
    note: str = ""
    #: where the job's time went, seconds: ``prepare`` (its stored rows, candidates and study,
    #: before the first trial), ``setup`` (the trials' one-off data: random weights, packed
    #: layouts, reference outputs), ``compile_wait``, ``measure`` (checking and timing, setup
    #: aside), ``choose`` (the pick, its skewed-routing check, the row stored); empty for a job
    #: that measured nothing
    time_s: dict[str, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if self.median_us and self.default_us:
            return self.default_us / self.median_us
        return None


@dataclass
class TuneReport:
    """Everything a tuning run did, one :class:`JobResult` per job, in job order."""

    device: str
    env_key: str
    results: list[JobResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False
    failed_devices: dict[str, int | None] = field(default_factory=dict)  # devices whose process died: exit codes

    @property
    def tuned(self) -> list[JobResult]:
        return [r for r in self.results if r.status == "tuned"]

    @property
    def trials_run(self) -> int:
        return sum(r.trials_run for r in self.results)

    @property
    def trials_failed(self) -> int:
        return sum(r.trials_failed for r in self.results)

    def table(self) -> str:
        """A fixed-width summary table (name, op, fmt, dtype, N, K, E, topk, M, winner, times, speedup), then the
        note of every job that has one (what cut it short, why the default stayed, ...; the
        already tuned jobs aside)."""
        head = ("name", "op", "fmt", "dtype", "N", "K", "E", "topk", "M", "status", "winner", "us", "default us", "speedup",
                "trials", "failed")
        rows = [head]
        for r in self.results:
            k = r.job.key
            cfg = json.dumps(r.config, sort_keys=True, separators=(",", ":")) if r.config else ""
            winner = f"{r.backend} {cfg}".strip()
            rows.append((
                r.job.name or "-", k.op, k.fmt, k.dtype, str(k.n), str(k.k),
                str(k.experts) if is_moe(k.op) else "-", str(k.topk) if is_moe(k.op) else "-",
                str(r.job.m), r.status, winner or "-",
                _fmt_us(r.median_us), _fmt_us(r.default_us),
                f"{r.speedup:.2f}x" if r.speedup else "-", str(r.trials_run), str(r.trials_failed),
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = []
        for j, row in enumerate(rows):
            cells = [c.ljust(w) if i in (0, 1, 2, 3, 9, 10) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        notes = [f"  {r.job.name or r.job.key.op} N={r.job.key.n} K={r.job.key.k} M={r.job.m}: {r.note}"
                 for r in self.results if r.note and r.status != "skipped"]
        if notes:
            lines += ["", "notes:", *notes]
        return "\n".join(lines) + "\n"


def _fmt_us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _checked_key(key: ProblemKey, where: str) -> ProblemKey:
    """A ProblemKey given to the tuner as it is (it checks its op, format, dtype and sizes
    itself): ValueError naming a K or N no FP4 weight of its format has."""
    bad = shape_errors(key.op, key.fmt, key.n, key.k)
    if bad:
        raise ValueError(f"{where}: " + "; ".join(f"{f}={why}" for f, why in bad.items()))
    return key


def jobs_for(
    shapes: Iterable[Any], m_buckets: Sequence[int], fmt: str = "nvfp4", dtype: str = "bfloat16"
) -> list[Job]:
    """One :class:`Job` per (shape, M bucket); shapes are ModelShapes or ProblemKeys. Each M is
    rounded up to its standard bucket (:func:`~autofp4.problem.standard_bucket`: the bucket whose
    calls it serves), so ``m_buckets=[3]`` tunes bucket 4, which serves M = 3 and 4."""
    if isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in DTYPES:
        dtype = str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    for name, v, allowed in (("fmt", fmt, FORMATS), ("dtype", dtype, DTYPES)):
        if v not in allowed:
            raise ValueError(f"{name}={v!r} is not one of {', '.join(allowed)}"
                             + (" (names, as strings)" if not isinstance(v, str) else ""))
    out: list[Job] = []
    seen: set[tuple[ProblemKey, int]] = set()
    for i, s in enumerate(shapes):
        if isinstance(s, ProblemKey):
            key, name, eg = _checked_key(s, f"shapes[{i}]"), "", 0
        elif hasattr(s, "problem_key"):
            key, name, eg = s.problem_key(fmt, dtype), getattr(s, "name", ""), getattr(s, "experts_global", 0)
        else:
            raise TypeError(f"shapes[{i}]: expected a ModelShape or a ProblemKey, got {type(s).__name__}")
        for m in m_buckets:
            m = standard_bucket(m)
            if (key, m) not in seen:
                seen.add((key, m))
                out.append(Job(key, m, name, eg))
    return out


# -----------------------------------------------------------------------------------------
# the settings of one job stream
# -----------------------------------------------------------------------------------------
@dataclass
class _Ctx:
    device: torch.device
    env: Any
    env_key: str
    backends: list[Backend]
    budget: int
    warmup: int
    reps: int
    deadline: float | None
    force: bool
    storage: Any  # None (in memory) or one optuna RDBStorage shared by the run's job streams
    ask_lock: str | None  # SQLite storage: a lock file that serializes study.ask() across processes
    window: int
    pool: cf.ProcessPoolExecutor | None
    compile_timeout_s: float
    stop: threading.Event
    pbar: Any
    lock: threading.Lock
    seed: int
    streams: int = 1  # job streams (devices) sharing the run's time budget
    reference_as_fallback: bool = False  # backends chosen automatically: see candidates._applicable
    job_deadline: float | None = None  # this stream's current job stops asking for trials here
    jobs_after: int = 0  # jobs queued behind the current one when it started
    setups_after: int = 0  # problems queued behind it that this stream has not set up
    set_up: set = field(default_factory=set)  # the problems (ProblemKeys) this stream's jobs set up
    setup_s: dict = field(default_factory=dict)  # ProblemKey -> its first setup on this stream, seconds
    trial_s: list[float] = field(default_factory=list)  # this stream's trials: wall time, setup excluded
    started_at: str = ""  # when the run started (UTC, as rows' created_at): rows from then on are this run's or a peer's
    claims: Any = None  # JobClaims of the DB (no shared storage): one process per job at a time
    origin: str = "offline"  # what the rows stored say about how they were tuned (schema.Origin)
    measure_first: bool = False  # the hard stop waits for the job's first measured config (just in time)
    compile_grace_s: float | None = None  # with a result in hand, wait at most this for a compile (None: the share)
    firsts_only: bool = False  # ask for no trial beyond the ranked first candidates (just in time: try the right few)
