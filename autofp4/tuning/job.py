"""Tuning one job: its candidates, the trials asked from its study (a window of them in flight,
compiling in the pool while one is measured), each measured trial recorded, and the choice of
the winner, which is stored."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections import deque
from typing import Any

from ..dispatch import backend_source_hash, backend_source_hashes
from ..schema import TuningRecord
from ..timing import TimingStats, faster_beyond_noise
from . import budget
from .budget import _out_of_time, setup_cap, trial_estimate
from .candidates import _Cand, _applicable, _candidates, _cfg_json, _parsed, _sibling_records, _stored_results
from .compile_pool import _compile_only, _prefetch_default, _request, _short_error
from .jobs import Job, JobResult, _Ctx
from .measurer import _Measurer
from .search import _ask, _finished, _make_study, _started, _was_enqueued

#: relative gain a tuned config needs over the default, on top of the noise rule.
MIN_GAIN = 0.0


class _Interrupted(Exception):
    def __init__(self, result: JobResult) -> None:
        super().__init__("interrupted")
        self.result = result


def _record_trial(db: Any, ctx: _Ctx, job: Job, cand: _Cand, res: dict[str, Any]) -> None:
    from ..schema import TrialRecord

    k = job.key
    ok = res["outcome"] == "ok"
    config = json.loads(cand.config_json)
    tr = TrialRecord(
        op=k.op, fmt=k.fmt, dtype=k.dtype, backend=cand.backend.name, m_bucket=job.m,
        n=k.n, k=k.k, experts=k.experts, topk=k.topk, m=job.m,
        config=config, outcome=res["outcome"],
        median_us=res.get("median_us") if ok else None,
        spread_us=res.get("spread_us") if ok else None,
        error=str(res.get("error") or ""), env_key=ctx.env_key,
        backend_source=backend_source_hash(cand.backend, config),
    )
    db.add_trial(tr)


def _tune_job(job: Job, ctx: _Ctx, db: Any, meas: _Measurer, then: Job | None = None) -> JobResult:
    """Tune one (key, M bucket). ``then``: the job that follows on this stream; its default
    config is sent to the compile workers right after this job's first candidates."""
    from optuna.trial import TrialState

    key = job.key
    backends = _applicable(key, ctx.backends, ctx.reference_as_fallback)
    if not backends:
        why = "; ".join(f"{b.name}: {b.supports(key)}" for b in ctx.backends)
        return JobResult(job, "no_valid_config", note=f"no selected backend supports it ({why})")
    current, stale, problem = _stored_results(db, ctx, key, job.m, backends)
    if current and not ctx.force:
        return JobResult(job, "skipped", note="already tuned for this environment")
    cands = _candidates(key, job.m, backends, _parsed(current + stale, backends),
                        _parsed(_sibling_records(problem, key, job.m), backends))
    if not cands:
        return JobResult(job, "no_valid_config", note="no valid candidate config")
    default = cands[0]
    failed: set[str] = set()
    for b in backends:
        for cj in db.failed_configs(
            key.op, key.fmt, key.dtype, b.name, None, key.n, key.k, key.experts, key.topk,
            ctx.env_key, backend_source=backend_source_hashes(b),
        ):
            failed.add(f"{b.name}:{cj}")
    study, space = _make_study(ctx, job, cands)
    grid = space is None
    choices = list(range(len(cands)))
    seed = ctx.seed  # one per run: the M buckets of a problem share its random weights
    result = JobResult(
        job, "tuned", default_backend=default.backend.name, default_config=json.loads(default.config_json)
    )
    inflight: deque[tuple[Any, _Cand, cf.Future | None]] = deque()
    asked = 0
    max_asks = 4 * ctx.budget + len(cands)
    measured_here: dict[str, dict[str, Any]] = {}

    run_s: list[float] = []  # per trial measured here: the time spent measuring it
    wait_s: list[float] = []  # and the time spent waiting for its compile worker
    stop_why = ""  # what ended the job at its share of the time (empty: it was not): said in its note

    def has_result() -> bool:
        return any(r["outcome"] == "ok" for r in measured_here.values())

    priors = [c.ident for c in cands if c.prior]
    # the winners stored for this environment and kernel source (only a forced re-tune gets here
    # with some): a pick that was not measured against them in this run does not replace them
    current_rows = {_Cand(b, cfg, _cfg_json(cfg)).ident: r for r in current for b, cfg in _parsed([r], backends)}

    def priors_left() -> bool:
        """Is a stored winner (the best evidence an earlier run left) not measured yet?"""
        return any(i not in measured_here and i not in failed for i in priors)

    def share_used(compiled: bool = False) -> bool:
        """With a result in hand, would one more trial (its kernel ``compiled`` already or not)
        end past this job's share of the time? A stored winner not measured yet (it comes right
        after the default) may take longer, as far as the run's deadline still leaves one trial
        for every job after this one: a short share must not reduce a re-tune to the default."""
        if ctx.job_deadline is None or not run_s or not has_result():
            return False
        end = budget._now() + trial_estimate(run_s, wait_s, compiled)
        if priors_left():
            cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams)
            return cap is not None and end > max(ctx.job_deadline, cap)
        return end > ctx.job_deadline

    def executed() -> int:
        return sum(1 for t in _finished(study) if t.user_attrs.get("executed"))

    def exhausted() -> bool:
        if grid:  # no grid point left waiting (all finished or being measured somewhere)
            return not study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return executed() + len(inflight) >= ctx.budget or asked >= max_asks

    def why_share(compiled: bool) -> str:
        est = trial_estimate(run_s, wait_s, compiled)
        return (f"the next trial, about {est:.2f} s by this job's mean of {len(run_s)} measured"
                + (f" and {len(wait_s)} compile waits" if wait_s and not compiled else "")
                + ", would have ended past it")

    def refill() -> None:
        nonlocal asked
        nonlocal stop_why
        while len(inflight) < ctx.window and not exhausted() and not _out_of_time(ctx):
            if share_used():
                stop_why = stop_why or why_share(False)
                break
            trial = _ask(ctx, study)
            asked += 1
            if grid and not _was_enqueued(study, trial):  # a peer took the last point
                trial.set_user_attr("outcome", "unused")
                study.tell(trial, state=TrialState.FAIL)
                break
            if space is None:
                cand = cands[trial.suggest_categorical("cand", choices)]
            else:
                cand = cands[space.sample(trial)]
            trial.set_user_attr("ident", cand.ident)
            if cand.ident in failed:
                trial.set_user_attr("outcome", "known_failed")
                study.tell(trial, state=TrialState.FAIL)
                continue
            prev = measured_here.get(cand.ident)
            if prev is not None:  # TPE asked for a point it already has
                if prev["outcome"] == "ok":
                    study.tell(trial, prev["median_us"])
                else:
                    study.tell(trial, state=TrialState.FAIL)
                continue
            fut = None
            if ctx.pool is not None:
                fut = ctx.pool.submit(_compile_only, _request(ctx, job, cand, seed))
            inflight.append((trial, cand, fut))

    try:
        refill()
        if then is not None:
            _prefetch_default(ctx, then)
        while inflight:
            trial, cand, fut = inflight.popleft()
            ready = fut is None or fut.done()
            late = _out_of_time(ctx)
            if late or share_used(compiled=ready):
                if not late:
                    stop_why = stop_why or why_share(ready)
                if fut is not None:
                    fut.cancel()
                study.tell(trial, state=TrialState.FAIL)
                continue
            t_trial = budget._now()
            res: dict[str, Any] | None = None
            if fut is not None:
                # with a result in hand, wait for a compile only as long as the job's share
                # lasts (a cold compile can take longer than a whole share; it still lands in
                # the kernel cache for a later run)
                wait = ctx.compile_timeout_s
                if ctx.job_deadline is not None and has_result() and not cand.prior:
                    wait = min(wait, max(0.0, ctx.job_deadline - t_trial))
                try:
                    err = fut.result(timeout=wait)
                except cf.TimeoutError:
                    if wait < ctx.compile_timeout_s:
                        stop_why = stop_why or f"a kernel compile outlasted the {wait:.2f} s left of it"
                        study.tell(trial, state=TrialState.FAIL)
                        continue
                    err = None
                    res = {"outcome": "timeout", "error": f"compilation took more than {ctx.compile_timeout_s:.0f} s"}
                except Exception as e:  # the pool process died
                    err = f"compile worker failed: {_short_error(e)}"
                if err is not None:
                    res = {"outcome": "invalid" if err.startswith("invalid: ") else "compile_error", "error": err}
            t_ready = budget._now()
            if fut is not None:
                wait_s.append(t_ready - t_trial)
            if res is None:
                res = meas.run(_request(ctx, job, cand, seed))
            setup = res.get("setup_s", 0.0)
            run_s.append(max(0.0, budget._now() - t_ready - setup))
            ctx.trial_s.append(max(0.0, budget._now() - t_trial - setup))
            if ctx.job_deadline is not None and setup > 0:
                # a problem's random weights serve all its M buckets: building them does not
                # use up the share of the job that happens to come first (as far as the jobs
                # after it keep time for one trial each)
                cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams)
                ctx.job_deadline = max(ctx.job_deadline, min(ctx.job_deadline + setup, cap))
            measured_here[cand.ident] = res
            with ctx.lock:
                _record_trial(db, ctx, job, cand, res)
            result.trials_run += 1
            trial.set_user_attr("executed", True)
            trial.set_user_attr("outcome", res["outcome"])
            if res["outcome"] == "ok":
                trial.set_user_attr("spread_us", res["spread_us"])
                trial.set_user_attr("samples", res["samples"])
                study.tell(trial, res["median_us"])
            else:
                result.trials_failed += 1
                failed.add(cand.ident)
                study.tell(trial, state=TrialState.FAIL)
            if ctx.pbar is not None:
                with ctx.lock:
                    ctx.pbar.set_postfix_str(
                        f"{job.name or key.op} N={key.n} K={key.k} M={job.m} trials={result.trials_run}", refresh=False
                    )
            refill()
    except KeyboardInterrupt:
        for trial, _, fut in inflight:
            if fut is not None:
                fut.cancel()
            try:
                study.tell(trial, state=TrialState.FAIL)
            except Exception:
                pass
        result.status = "interrupted"
        raise _Interrupted(result) from None

    # -- the choice (over every process's measurements of this study) --
    if ctx.storage is not None:  # let live peers finish the points they are measuring
        limit = time.monotonic() + 2 * ctx.compile_timeout_s
        while time.monotonic() < limit and not ctx.stop.is_set():
            if _started(study, ctx.compile_timeout_s) <= len(_finished(study)):
                break  # nothing running anywhere (stale trials of dead processes aside)
            time.sleep(0.1)
    stats: dict[str, TimingStats] = {}
    for t in _finished(study):
        if t.state == TrialState.COMPLETE and t.user_attrs.get("executed") and t.value is not None:
            ident = t.user_attrs.get("ident")
            if ident and ident not in stats:
                stats[ident] = TimingStats(
                    float(t.value), float(t.user_attrs.get("spread_us", 0.0)), int(t.user_attrs.get("samples", 1)), float(t.value)
                )
    by_ident = {c.ident: c for c in cands}
    oks = [by_ident[i] for i in stats if i in by_ident and i not in failed]
    if not oks:
        result.status = "out_of_time" if _out_of_time(ctx) else "no_valid_config"
        result.note = "no candidate passed the correctness check" if not _out_of_time(ctx) else "stopped before a config was measured"
        return result
    best = min(oks, key=lambda c: (stats[c.ident].median_us, c.backend.name, c.config_json))
    d_stats = stats.get(default.ident)
    notes = []
    if stop_why:
        notes.append(f"stopped at its share of the time budget after {result.trials_run} trials: {stop_why}")
    if d_stats is None:
        winner = best
        notes.append("default config failed or was not measured")
    elif best is not default and faster_beyond_noise(stats[best.ident], d_stats, MIN_GAIN):
        winner = best
    else:
        winner = default
        if best is not default:
            notes.append("no config beat the default beyond the noise")
    result.note = "; ".join(notes)
    unmeasured = [i for i in current_rows if i not in stats and i not in failed]
    if unmeasured and winner.ident not in current_rows:
        row = current_rows[unmeasured[0]]
        result.status = "kept"
        result.backend, result.config = row.backend, dict(row.config)
        result.median_us, result.spread_us = row.median_us, row.spread_us  # as stored
        result.note = (f"the stored winner was not measured again ({result.trials_run} trials in this job's "
                       "share of the time); its row stays")
        return result
    w_stats = stats[winner.ident]
    result.backend = winner.backend.name
    result.config = json.loads(winner.config_json)
    result.median_us = w_stats.median_us
    result.spread_us = w_stats.spread_us
    result.default_us = d_stats.median_us if d_stats is not None else None
    rec = TuningRecord(
        op=key.op, fmt=key.fmt, dtype=key.dtype, backend=winner.backend.name, m_bucket=job.m,
        n=key.n, k=key.k, experts=key.experts, topk=key.topk, config=result.config,
        median_us=w_stats.median_us, spread_us=w_stats.spread_us, samples=max(1, w_stats.samples),
        default_median_us=result.default_us, backend_source=backend_source_hash(winner.backend, result.config), env=ctx.env,
    )
    with ctx.lock:
        db.upsert_result(rec)
    return result
