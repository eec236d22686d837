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


def job_share_deadline(now: float, deadline: float | None, jobs_left: int, streams: int = 1,
                       reserve: float = 0.0) -> float | None:
    """When a job that starts ``now`` should stop asking for trials: an equal share of the time
    left among the ``jobs_left`` jobs (this one included) that ``streams`` streams still run,
    less ``reserve`` (the one-off setups of the problems queued behind it, see
    :func:`setup_reserve`). Time a job does not use (it ran out of candidates) goes to the jobs
    after it."""
    if deadline is None:
        return None
    left = max(0.0, deadline - now - reserve)
    return now + left * max(1, streams) / max(1, jobs_left)


def setup_reserve(setup_s: Sequence[float], setups_after: int, streams: int = 1) -> float:
    """Time to keep back, per stream, for the one-off setup of the ``setups_after`` problems
    queued behind a job that this stream has not set up: one mean of the setups seen so far
    (``setup_s``) each."""
    return (sum(setup_s) / len(setup_s) if setup_s else 0.0) * setups_after / max(1, streams)


def setup_cap(deadline: float | None, jobs_after: int, trial_s: Sequence[float], streams: int = 1,
              setup_s: Sequence[float] = (), setups_after: int = 0) -> float | None:
    """The latest a job may stretch its share to for one-off setup (a problem's random weights,
    a layout packed for a new kernel): the run's deadline less one mean trial for every job
    queued behind it and one mean setup (``setup_s``: the setups seen so far) for every problem
    queued behind it that has not been set up (``setups_after``), per stream, so that those jobs
    still get their first measurement (uncapped setup is the likely reason why the last two jobs
    of one 70B tuning run got no trial; without the setups of the problems queued behind, 11 of
    17 MoE jobs of one H200 run got none)."""
    if deadline is None:
        return None
    mean = sum(trial_s) / len(trial_s) if trial_s else 0.0
    return deadline - mean * jobs_after / max(1, streams) - setup_reserve(setup_s, setups_after, streams)


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
