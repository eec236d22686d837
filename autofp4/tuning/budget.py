"""The time budget of a run: the clock, each job's share of the time left, how far one-off
setup may stretch a share, and the expected time of a job's next trial."""
from __future__ import annotations

import time
from typing import Sequence

from .jobs import _Ctx


def _now() -> float:
    """The clock of time budgets and shares (monotonic seconds). The other tuning modules read
    it as ``budget._now()``: one clock for the whole run."""
    return time.monotonic()


def job_share_deadline(now: float, deadline: float | None, jobs_left: int, streams: int = 1) -> float | None:
    """When a job that starts ``now`` should stop asking for trials: an equal share of the time
    left among the ``jobs_left`` jobs (this one included) that ``streams`` streams still run.
    Time a job does not use (it ran out of candidates) goes to the jobs after it."""
    if deadline is None:
        return None
    left = max(0.0, deadline - now)
    return now + left * max(1, streams) / max(1, jobs_left)


def setup_cap(deadline: float | None, jobs_after: int, trial_s: Sequence[float], streams: int = 1) -> float | None:
    """The latest a job may stretch its share to for one-off setup (a problem's random weights,
    a layout packed for a new kernel): the run's deadline less one mean trial for every job
    queued behind it (per stream), so that those still get their first measurement (uncapped
    setup is the likely reason why the last two jobs of one 70B tuning run got no trial)."""
    if deadline is None:
        return None
    mean = sum(trial_s) / len(trial_s) if trial_s else 0.0
    return deadline - mean * jobs_after / max(1, streams)


def trial_estimate(run_s: Sequence[float], wait_s: Sequence[float], compiled: bool) -> float:
    """Expected wall time of a job's next trial: the mean time of measuring one, plus the mean
    wait for a compile worker when its kernel is not compiled yet.

    ``run_s`` leaves out the one-off setup a trial reports as ``setup_s`` (the first job of every
    problem builds its random weights, which ended every M = 1 job of the Llama shapes after one
    trial on the H200); the job's share is extended by that time instead. The workers compile a
    job's first candidates together, so the first trial's wait (a cold compile) is usually the
    only one; counting it in every estimate stopped jobs after one trial."""
    est = sum(run_s) / len(run_s)
    if not compiled and wait_s:
        est += sum(wait_s) / len(wait_s)
    return est


def _out_of_time(ctx: _Ctx) -> bool:
    return ctx.stop.is_set() or (ctx.deadline is not None and _now() >= ctx.deadline)
