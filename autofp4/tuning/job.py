"""Tuning one job: its candidates, the trials asked from its study (a window of them in flight,
compiling in the pool while one is measured), each measured trial recorded, and the choice of
the winner, which is stored."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections import deque
from typing import Any, Sequence

from ..backends.base import Backend
from ..dispatch import backend_source_hash, backend_source_hashes
from ..problem import is_moe
from ..schema import TuningRecord
from ..timing import TimingStats, faster_beyond_noise
from . import budget
from .budget import _out_of_time, setup_cap, trial_estimate
from .candidates import (_Cand, _applicable, _cfg_json, _job_candidates, _other_problem_winners, _parsed, _sibling_records,
                         _stored_results)
from .compile_pool import _compile_only, _prefetch_default, _request, _short_error
from .jobs import Job, JobResult, _Ctx
from .measurer import _Measurer
from .search import _ask, _finished, _make_study, _started, _was_enqueued
from .trial import SKEWED_TRIAL, hot_experts

#: relative gain a tuned config needs over the default, on top of the noise rule.
MIN_GAIN = 0.0
#: a MoE pick is timed again with the default on the skewed routing (trial.ROUTINGS); slower
#: than the default there by more than this (relative), it is not stored
SKEW_MARGIN = 0.10
#: the picks checked so, fastest first, before the default is stored instead
SKEW_TRIES = 3


class _Interrupted(Exception):
    def __init__(self, result: JobResult) -> None:
        super().__init__("interrupted")
        self.result = result


def _record_trial(db: Any, ctx: _Ctx, job: Job, cand: _Cand, res: dict[str, Any], routing: str = "uniform") -> None:
    """One trial row; one on the skewed routing says so first in its ``error`` text."""
    from ..schema import TrialRecord

    k = job.key
    ok = res["outcome"] == "ok"
    config = json.loads(cand.config_json)
    error = str(res.get("error") or "")
    if routing == "skewed":
        error = f"{SKEWED_TRIAL}: {error}" if error else SKEWED_TRIAL
    tr = TrialRecord(
        op=k.op, fmt=k.fmt, dtype=k.dtype, backend=cand.backend.name, m_bucket=job.m,
        n=k.n, k=k.k, experts=k.experts, topk=k.topk, m=job.m,
        config=config, outcome=res["outcome"],
        median_us=res.get("median_us") if ok else None,
        spread_us=res.get("spread_us") if ok else None,
        error=error, env_key=ctx.env_key,
        backend_source=backend_source_hash(cand.backend, config),
    )
    db.add_trial(tr)


def _tune_job(job: Job, ctx: _Ctx, db: Any, meas: _Measurer,
              then: Job | Sequence[Job] | None = None) -> JobResult:
    """Tune one (key, M bucket). ``then``: the job (or jobs) expected after it on this stream; their default
    config is sent to the compile workers right after this job's first candidates."""
    key = job.key
    started = budget._now()
    backends = _applicable(key, ctx.backends, ctx.reference_as_fallback)
    if not backends:
        why = "; ".join(f"{b.name}: {b.supports(key)}" for b in ctx.backends)
        return JobResult(job, "no_valid_config", note=f"no selected backend supports it ({why})")
    current, stale, problem = _stored_results(db, ctx, key, job.m, backends)
    if current and not ctx.force:
        return JobResult(job, "skipped", note="already tuned for this environment")
    if current and ctx.started_at and any(r.created_at >= ctx.started_at for r in current):
        return JobResult(job, "skipped", note="tuned by another run since this one started")
    others = db.results(None, op=key.op, dtype=key.dtype, m_bucket=job.m, backend=[b.name for b in backends])
    siblings = _parsed(_sibling_records(problem, key, job.m), backends) + _other_problem_winners(others, key, job.m, backends)
    cands, firsts = _job_candidates(key, job.m, backends, _parsed(current + stale, backends), siblings,
                                      ctx.budget if ctx.firsts_only else None)
    if not cands:
        return JobResult(job, "no_valid_config", note="no valid candidate config")
    return JobTuner(job, ctx, db, meas, backends, current, cands, started, firsts).run(then)


class JobTuner:
    """One job with its candidates (``cands[0]``: the default) and the state of its tuning:
    the study, the trials in flight, what was measured here and how long measuring took."""

    def __init__(self, job: Job, ctx: _Ctx, db: Any, meas: _Measurer, backends: Sequence[Backend],
                 current: Sequence[TuningRecord], cands: Sequence[_Cand], started: float | None = None,
                 firsts: bool = False) -> None:
        self.job, self.ctx, self.db, self.meas = job, ctx, db, meas
        self.started = budget._now() if started is None else started  # when the job began (its time_s)
        self.cands = cands
        self.default = cands[0]
        self.failed = self._failed_configs(backends)
        self.study, self.space = _make_study(ctx, job, cands)
        self.grid = self.space is None
        self.choices = list(range(len(cands)))
        self.seed = ctx.seed  # one per run: the M buckets of a problem share its random weights
        self.result = JobResult(
            job, "tuned", default_backend=self.default.backend.name,
            default_config=json.loads(self.default.config_json),
        )
        self.inflight: deque[tuple[Any, _Cand, cf.Future | None]] = deque()
        self.asked = 0
        self.max_asks = 4 * ctx.budget + len(cands)
        self.measured_here: dict[str, dict[str, Any]] = {}
        self.run_s: list[float] = []  # per trial measured here: the time spent measuring it
        self.wait_s: list[float] = []  # and the time spent waiting for its compile worker
        self.setup_s: list[float] = []  # and its one-off setup (a trial's res["setup_s"])
        self.stop_why = ""  # what ended the job at its share of the time (empty: it was not): said in its note
        self.firsts_done = False  # ended having tried its ranked first candidates (ctx.firsts_only)
        self.firsts = firsts  # ``cands`` are only those (the grid was not built): done once all are asked
        self.priors = [c.ident for c in cands if c.prior]
        # the winners stored for this environment and kernel source (only a forced re-tune gets here
        # with some): a pick that was not measured against them in this run does not replace them
        self.current_rows = {_Cand(b, cfg, _cfg_json(b, cfg)).ident: r for r in current for b, cfg in _parsed([r], backends)}

    def _failed_configs(self, backends: Sequence[Backend]) -> set[str]:
        """The configs recorded as failed for this environment and kernel source (not run again)."""
        key = self.job.key
        failed: set[str] = set()
        for b in backends:
            for cj in self.db.failed_configs(
                key.op, key.fmt, key.dtype, b.name, None, key.n, key.k, key.experts, key.topk,
                self.ctx.env_key, backend_source=backend_source_hashes(b),
            ):
                failed.add(f"{b.name}:{cj}")
        return failed

    # -- the time share --
    def has_result(self) -> bool:
        return any(r["outcome"] == "ok" for r in self.measured_here.values())

    def priors_left(self) -> bool:
        """Is a stored winner (the best evidence an earlier run left) not measured yet?"""
        return any(i not in self.measured_here and i not in self.failed for i in self.priors)

    def late(self) -> bool:
        """Past the run's hard stop (or stopped). A just-in-time job (``ctx.measure_first``) is not
        late before it has a measured config: its caller waits for a row, and on a cold host the
        setup and first compile alone can outlast a short budget."""
        if self.ctx.measure_first and not self.ctx.stop.is_set() and not self.has_result():
            return False
        return _out_of_time(self.ctx)

    def share_used(self, compiled: bool = False) -> bool:
        """With a result in hand, would one more trial (its kernel ``compiled`` already or not)
        end past this job's share of the time? A stored winner not measured yet (it comes right
        after the default) may take longer, as far as the run's deadline still leaves one trial
        for every job after this one: a short share must not reduce a re-tune to the default."""
        ctx = self.ctx
        if ctx.job_deadline is None or not self.run_s or not self.has_result():
            return False
        end = budget._now() + trial_estimate(self.run_s, self.wait_s, compiled)
        if self.priors_left():
            cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams, list(ctx.setup_s.values()),
                            ctx.setups_after)
            return cap is not None and end > max(ctx.job_deadline, cap)
        return end > ctx.job_deadline

    def why_share(self, compiled: bool) -> str:
        est = trial_estimate(self.run_s, self.wait_s, compiled)
        return (f"the next trial, about {est:.2f} s by this job's mean of {len(self.run_s)} measured"
                + (f" and {len(self.wait_s)} compile waits" if self.wait_s and not compiled else "")
                + ", would have ended past it")

    # -- asking the study for trials --
    def executed(self) -> int:
        return sum(1 for t in _finished(self.study) if t.user_attrs.get("executed"))

    def exhausted(self) -> bool:
        from optuna.trial import TrialState

        if self.grid:  # no grid point left waiting (all finished or being measured somewhere)
            return not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return self.executed() + len(self.inflight) >= self.ctx.budget or self.asked >= self.max_asks

    def refill(self) -> None:
        """Ask the study for trials until the window is full (and send each to the compile pool)."""
        from optuna.trial import TrialState

        ctx, study, cands = self.ctx, self.study, self.cands
        while len(self.inflight) < ctx.window and not self.exhausted() and not self.late():
            if self.share_used():
                self.stop_why = self.stop_why or self.why_share(False)
                break
            if ctx.firsts_only and not self.grid and not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                self.firsts_done = True
                break
            trial = _ask(ctx, study)
            self.asked += 1
            if self.grid and not _was_enqueued(study, trial):  # a peer took the last point
                trial.set_user_attr("outcome", "unused")
                study.tell(trial, state=TrialState.FAIL)
                break
            if self.space is None:
                cand = cands[trial.suggest_categorical("cand", self.choices)]
            else:
                cand = cands[self.space.sample(trial)]
            trial.set_user_attr("ident", cand.ident)
            if cand.ident in self.failed:
                trial.set_user_attr("outcome", "known_failed")
                study.tell(trial, state=TrialState.FAIL)
                continue
            prev = self.measured_here.get(cand.ident)
            if prev is not None:  # TPE asked for a point it already has
                if prev["outcome"] == "ok":
                    study.tell(trial, prev["median_us"])
                else:
                    study.tell(trial, state=TrialState.FAIL)
                continue
            if not self.grid and self._taken_elsewhere(trial, cand):
                continue
            fut = None
            if ctx.pool is not None:
                fut = ctx.pool.submit(_compile_only, _request(ctx, self.job, cand, self.seed))
            self.inflight.append((trial, cand, fut))
        if self.firsts and self.exhausted():
            self.firsts_done = True

    def _taken_elsewhere(self, trial: Any, cand: _Cand) -> bool:
        """With a shared storage, TPE asked for a point that another trial of the study (a
        peer's, or one of ours in flight) measured or is measuring: ``trial`` is told that
        trial's value (a failure: not run here either) and True returned."""
        from optuna.trial import TrialState

        if self.ctx.storage is None:
            return False
        import datetime as _dt

        now = _dt.datetime.now()
        for t in self.study.get_trials(deepcopy=False):
            if t.number == trial.number or t.user_attrs.get("ident") != cand.ident:
                continue
            if t.state == TrialState.COMPLETE and t.user_attrs.get("executed") and t.value is not None:
                trial.set_user_attr("outcome", "measured_elsewhere")
                self.study.tell(trial, float(t.value))
                return True
            if t.state == TrialState.FAIL and t.user_attrs.get("executed"):
                self.failed.add(cand.ident)
                trial.set_user_attr("outcome", "known_failed")
                self.study.tell(trial, state=TrialState.FAIL)
                return True
            live = t.datetime_start is None or (now - t.datetime_start).total_seconds() < 2 * self.ctx.compile_timeout_s
            if t.state == TrialState.RUNNING and live:
                trial.set_user_attr("outcome", "measured_elsewhere")
                self.study.tell(trial, state=TrialState.FAIL)
                return True
        return False

    # -- measuring --
    def run(self, then: Job | Sequence[Job] | None = None) -> JobResult:
        """Measure the job's trials, then choose and store its winner (``then``: see
        :func:`_tune_job`). Ctrl-C gives up the trials in flight and raises :class:`_Interrupted`."""
        t_run = budget._now()
        # listing and ranking the candidates (the first job of a process: imports too) is not
        # measuring: the share is stretched by it, as by a trial's one-off setup
        self._stretch_share(t_run - self.started)
        try:
            self.refill()
            for nxt in (then,) if isinstance(then, Job) else (then or ()):
                _prefetch_default(self.ctx, nxt)
            while self.inflight:
                self._step()
        except KeyboardInterrupt:
            self._abandon()
            self.result.status = "interrupted"
            raise _Interrupted(self.result) from None
        t_choose = budget._now()
        result = self._choose()
        if self.run_s:
            result.time_s = {"prepare": t_run - self.started, "setup": sum(self.setup_s), "compile_wait": sum(self.wait_s),
                             "measure": sum(self.run_s), "choose": budget._now() - t_choose,
                             "total": budget._now() - self.started}
        return result

    def _step(self) -> None:
        """Measure the oldest trial in flight (or give it up: out of time, past the job's share),
        then ask for more."""
        from optuna.trial import TrialState

        ctx = self.ctx
        trial, cand, fut = self.inflight.popleft()
        ready = fut is None or fut.done()
        late = self.late()
        if late or self.share_used(compiled=ready):
            if not late:
                self.stop_why = self.stop_why or self.why_share(ready)
            if fut is not None:
                fut.cancel()
            self.study.tell(trial, state=TrialState.FAIL)
            return
        t_trial = budget._now()
        res: dict[str, Any] | None = None
        if fut is not None:
            gave_up, res = self._await_compile(trial, cand, fut, t_trial)
            if gave_up:
                return
        t_ready = budget._now()
        if fut is not None:
            self.wait_s.append(t_ready - t_trial)
        if res is None:
            res = self.meas.run(_request(ctx, self.job, cand, self.seed))
        self._account(res, t_trial, t_ready)
        self._record(trial, cand, res)
        self.refill()

    def _await_compile(self, trial: Any, cand: _Cand, fut: cf.Future, t_trial: float
                       ) -> tuple[bool, dict[str, Any] | None]:
        """Wait for ``cand``'s compile: ``(gave_up, res)``; ``res``: the trial's outcome when the
        compile failed or timed out (None: compiled); ``gave_up``: the trial was given up."""
        from optuna.trial import TrialState

        ctx = self.ctx
        res: dict[str, Any] | None = None
        # with a result in hand, wait for a compile only as long as the job's share
        # lasts (a cold compile can take longer than a whole share; it still lands in
        # the kernel cache for a later job of the run)
        wait = ctx.compile_timeout_s
        if ctx.job_deadline is not None and self.has_result() and not cand.prior:
            wait = min(wait, max(0.0, ctx.job_deadline - t_trial))
        if ctx.compile_grace_s is not None and self.has_result() and not cand.prior:
            wait = min(wait, ctx.compile_grace_s)  # a caller waits for this job: take what is compiled
        try:
            err = fut.result(timeout=wait)
        except cf.TimeoutError:
            if wait < ctx.compile_timeout_s:
                self.stop_why = self.stop_why or f"a kernel compile outlasted the {wait:.2f} s left of it"
                self.study.tell(trial, state=TrialState.FAIL)
                return True, None
            err = None
            res = {"outcome": "timeout", "error": f"compilation took more than {ctx.compile_timeout_s:.0f} s"}
        except Exception as e:  # the pool process died
            err = f"compile worker failed: {_short_error(e)}"
        if err is not None:
            res = {"outcome": "invalid" if err.startswith("invalid: ") else "compile_error", "error": err}
        return False, res

    def _account(self, res: dict[str, Any], t_trial: float, t_ready: float) -> None:
        """Count the trial's time (its one-off setup aside) and stretch the share by that setup."""
        ctx = self.ctx
        setup = res.get("setup_s", 0.0)
        self.setup_s.append(setup)
        self.run_s.append(max(0.0, budget._now() - t_ready - setup))
        ctx.trial_s.append(max(0.0, budget._now() - t_trial - setup))
        if ctx.job_deadline is not None and setup > 0:
            # a problem's random weights serve all its M buckets: building them does not
            # use up the share of the job that happens to come first
            ctx.setup_s.setdefault(self.job.key, setup)
            self._stretch_share(setup)

    def _stretch_share(self, seconds: float) -> None:
        """Extend the job's share by ``seconds`` of one-off work, as far as the jobs after it keep
        time for one trial each, and the problems after it for their setup (the first setup of
        each problem, its random weights, is what those expect)."""
        ctx = self.ctx
        if ctx.job_deadline is None or seconds <= 0:
            return
        cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams, list(ctx.setup_s.values()),
                        ctx.setups_after)
        ctx.job_deadline = max(ctx.job_deadline, ctx.job_deadline + seconds if cap is None
                               else min(ctx.job_deadline + seconds, cap))

    def _record(self, trial: Any, cand: _Cand, res: dict[str, Any]) -> None:
        """Store the trial's outcome in the DB and tell it to the study."""
        from optuna.trial import TrialState

        ctx, result, key = self.ctx, self.result, self.job.key
        self.measured_here[cand.ident] = res
        with ctx.lock:
            _record_trial(self.db, ctx, self.job, cand, res)
        result.trials_run += 1
        trial.set_user_attr("executed", True)
        trial.set_user_attr("outcome", res["outcome"])
        if res["outcome"] == "ok":
            trial.set_user_attr("spread_us", res["spread_us"])
            trial.set_user_attr("samples", res["samples"])
            self.study.tell(trial, res["median_us"])
        else:
            result.trials_failed += 1
            self.failed.add(cand.ident)
            self.study.tell(trial, state=TrialState.FAIL)
        if ctx.pbar is not None:
            with ctx.lock:
                ctx.pbar.set_postfix_str(
                    f"{self.job.name or key.op} N={key.n} K={key.k} M={self.job.m} trials={result.trials_run}",
                    refresh=False,
                )

    def _abandon(self) -> None:
        """Give up the trials in flight (interrupted)."""
        from optuna.trial import TrialState

        for trial, _, fut in self.inflight:
            if fut is not None:
                fut.cancel()
            try:
                self.study.tell(trial, state=TrialState.FAIL)
            except Exception:
                pass

    # -- the choice (over every process's measurements of this study) --
    def _choose(self) -> JobResult:
        """The fastest correct candidate, where it beats the default beyond the noise (else the
        default); stored, unless a stored winner not measured again keeps its row."""
        ctx, result = self.ctx, self.result
        self._wait_for_peers()
        stats = self._stats()
        by_ident = {c.ident: c for c in self.cands}
        oks = [by_ident[i] for i in stats if i in by_ident and i not in self.failed]
        if not oks:
            result.status = "out_of_time" if _out_of_time(ctx) else "no_valid_config"
            result.note = "no candidate passed the correctness check" if not _out_of_time(ctx) else "stopped before a config was measured"
            return result
        oks.sort(key=lambda c: (stats[c.ident].median_us, c.backend.name, c.config_json))
        d_stats = stats.get(self.default.ident)
        winner, result.note = self._winner(oks[0], stats, d_stats)
        if is_moe(self.job.key.op) and winner is not self.default and d_stats is not None:
            ahead = [c for c in oks if c is not self.default and faster_beyond_noise(stats[c.ident], d_stats, MIN_GAIN)]
            winner = self._skew_checked(ahead[:SKEW_TRIES])
        unmeasured = [i for i in self.current_rows if i not in stats and i not in self.failed]
        if unmeasured and winner.ident not in self.current_rows:
            return self._keep(self.current_rows[unmeasured[0]])
        return self._store(winner, stats[winner.ident], d_stats)

    def _wait_for_peers(self) -> None:
        ctx = self.ctx
        if ctx.storage is not None:  # let live peers finish the points they are measuring
            limit = time.monotonic() + 2 * ctx.compile_timeout_s
            while time.monotonic() < limit and not ctx.stop.is_set():
                if _started(self.study, ctx.compile_timeout_s) <= len(_finished(self.study)):
                    break  # nothing running anywhere (stale trials of dead processes aside)
                time.sleep(0.1)

    def _stats(self) -> dict[str, TimingStats]:
        """The timing of every candidate measured (by any process) in this study."""
        from optuna.trial import TrialState

        stats: dict[str, TimingStats] = {}
        for t in _finished(self.study):
            if t.state == TrialState.COMPLETE and t.user_attrs.get("executed") and t.value is not None:
                ident = t.user_attrs.get("ident")
                if ident and ident not in stats:
                    stats[ident] = TimingStats(
                        float(t.value), float(t.user_attrs.get("spread_us", 0.0)), int(t.user_attrs.get("samples", 1)), float(t.value)
                    )
        return stats

    def _winner(self, best: _Cand, stats: dict[str, TimingStats], d_stats: TimingStats | None) -> tuple[_Cand, str]:
        """The winner (``best`` or the default) and the job's note."""
        default = self.default
        notes = []
        if self.stop_why:
            notes.append(f"stopped at its share of the time budget after {self.result.trials_run} trials: {self.stop_why}")
        elif self.firsts_done:
            notes.append(f"tried its {self.result.trials_run} ranked first candidates (just in time: no search beyond them)")
        if d_stats is None:
            winner = best
            notes.append("default config failed or was not measured")
        elif best is not default and faster_beyond_noise(stats[best.ident], d_stats, MIN_GAIN):
            winner = best
        else:
            winner = default
            if best is not default:
                notes.append("no config beat the default beyond the noise")
        return winner, "; ".join(notes)

    def _skew_checked(self, picks: Sequence[_Cand]) -> _Cand:
        """The first of ``picks`` (fastest first) that is at most ``SKEW_MARGIN`` slower than
        the default on the skewed routing, else the default; why, in the job's note."""
        base = self._skew_us(self.default)
        key = self.job.key
        eg = self.job.experts_global
        where = f"the skewed routing ({hot_experts(key, eg)} of {eg or key.experts} experts hot)"
        if base is None:
            self._add_note(f"the default failed on {where}: the pick is stored unchecked")
            return picks[0]
        slow = []
        for c in picks:
            us = self._skew_us(c)
            if us is not None and us <= base * (1 + SKEW_MARGIN):
                break
            slow.append(f"{c.backend.name} {c.config_json} " + ("failed" if us is None else f"{us:.2f} us"))
        else:
            c = self.default
        if slow:
            stored = "the default" if c is self.default else f"{c.backend.name} {c.config_json}"
            self._add_note(f"on {where} the default took {base:.2f} us and {', '.join(slow)} (more than "
                           f"{SKEW_MARGIN:.0%} slower, or failed): {stored} stored instead")
        return c

    def _skew_us(self, cand: _Cand) -> float | None:
        """``cand`` timed on the skewed routing (a trial row of its own): its median, None if it failed."""
        req = {**_request(self.ctx, self.job, cand, self.seed), "routing": "skewed"}
        res = self.meas.run(req)
        with self.ctx.lock:
            _record_trial(self.db, self.ctx, self.job, cand, res, routing="skewed")
        self.result.trials_run += 1
        if res["outcome"] != "ok":
            self.result.trials_failed += 1
            return None
        return float(res["median_us"])

    def _add_note(self, note: str) -> None:
        self.result.note = "; ".join(n for n in (self.result.note, note) if n)

    def _keep(self, row: TuningRecord) -> JobResult:
        """The stored winner ``row`` was not measured again: it stays (status ``kept``)."""
        result = self.result
        result.status = "kept"
        result.backend, result.config = row.backend, dict(row.config)
        result.median_us, result.spread_us = row.median_us, row.spread_us  # as stored
        result.note = (f"the stored winner was not measured again ({result.trials_run} trials in this job's "
                       "share of the time); its row stays")
        return result

    def _store(self, winner: _Cand, w_stats: TimingStats, d_stats: TimingStats | None) -> JobResult:
        """Report ``winner`` and store it as the job's result."""
        key, result = self.job.key, self.result
        result.backend = winner.backend.name
        result.config = json.loads(winner.config_json)
        result.median_us = w_stats.median_us
        result.spread_us = w_stats.spread_us
        result.default_us = d_stats.median_us if d_stats is not None else None
        rec = TuningRecord(
            op=key.op, fmt=key.fmt, dtype=key.dtype, backend=winner.backend.name, m_bucket=self.job.m,
            n=key.n, k=key.k, experts=key.experts, topk=key.topk, config=result.config,
            median_us=w_stats.median_us, spread_us=w_stats.spread_us, samples=max(1, w_stats.samples),
            default_median_us=result.default_us, backend_source=backend_source_hash(winner.backend, result.config),
            env=self.ctx.env, origin=self.ctx.origin,
        )
        # a forced re-tune replaces the row it measured again, also with a slower measurement;
        # any other write keeps the faster row (of a peer that stored one meanwhile)
        replacing = next((r for r in self.current_rows.values() if r.backend == rec.backend), None)
        with self.ctx.lock:
            written = self.db.upsert_result(rec, replacing=replacing)
            stored = None if written else self.db.get_result(*rec.key_tuple(), rec.env_key)
        if stored is not None:
            self._add_note(f"the row another run stored meanwhile is as fast or faster and stays ({stored.backend} "
                           f"{json.dumps(stored.config, sort_keys=True, separators=(',', ':'))} {stored.median_us:.2f} us)")
        return result
