"""The search of one job with optuna: the run's storage, the ask lock of a SQLite storage, the
job's study (a grid of enqueued trials, or TPE over a field space), and its finished and
started trials."""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Sequence

from .candidates import _Cand, _field_texts
from .jobs import Job, _Ctx


def _study_name(ctx: _Ctx, job: Job, cands: Sequence[_Cand]) -> str:
    h = hashlib.sha256("\n".join(c.ident for c in cands).encode()).hexdigest()[:10]
    k = job.key
    return f"autofp4-{ctx.env_key}-{k.op}-{k.fmt}-{k.dtype}-n{k.n}-k{k.k}-e{k.experts}-t{k.topk}-m{job.m}-{h}"


class _FieldSpace:
    """The candidates as one categorical parameter per config field, for TPE.

    TPE learns per field value (tile sizes, stages, ...) instead of per opaque index. A
    sampled combination that is not a candidate maps to the nearest candidate (fewest
    differing fields, then candidate order); the trial keeps the sampled parameters.
    Fields a candidate does not have read ``"-"``; values are JSON text.
    """

    def __init__(self, cands: Sequence[_Cand]) -> None:
        fields = [_field_texts(c.backend, c.config) for c in cands]
        names = sorted({n for f in {tuple(f) for f in fields} for n in f} - {"backend"})
        self.names = ["backend", *names]
        self.rows = [
            (json.dumps(c.backend.name), *(f.get(n, "-") for n in names)) for c, f in zip(cands, fields)
        ]
        self.choices = {n: sorted({r[i] for r in self.rows}) for i, n in enumerate(self.names)}
        self.index: dict[tuple, int] = {}
        for i, r in enumerate(self.rows):
            self.index.setdefault(r, i)

    def params_of(self, i: int) -> dict[str, str]:
        return {f"f:{n}": v for n, v in zip(self.names, self.rows[i])}

    def sample(self, trial: Any) -> int:
        vals = tuple(trial.suggest_categorical(f"f:{n}", self.choices[n]) for n in self.names)
        i = self.index.get(vals)
        if i is not None:
            return i
        return min(range(len(self.rows)), key=lambda j: (sum(a != b for a, b in zip(vals, self.rows[j])), j))


def _open_storage(url: str | None) -> Any:
    """One optuna RDB storage for the whole run (SQLite: waits up to 60 s for peers' locks)."""
    if url is None:
        return None
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    for attempt in range(6):  # peers may create the tables (and schema version) at once
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as e:
            if attempt == 5:
                raise ValueError(f"cannot open the optuna storage {url!r}: {e}") from None
            time.sleep(0.3 * (attempt + 1))
    return None  # not reached


def _ask_lock_path(url: str | None) -> str | None:
    """SQLite ignores optuna's ``SELECT ... FOR UPDATE``, so two processes can pop the same
    waiting trial; a lock file beside the database serializes ``ask`` on its host."""
    if not url or not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else path + ".ask.lock"


def _ask(ctx: _Ctx, study: Any) -> Any:
    if ctx.ask_lock is None:
        return study.ask()
    import fcntl

    # never blocks on opening (a FIFO there raises instead): :func:`.storage.storage_problem`
    # names anything but a file there before a run starts
    fd = os.open(ctx.ask_lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644)
    with os.fdopen(fd, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        return study.ask()


def _make_study(ctx: _Ctx, job: Job, cands: Sequence[_Cand]) -> tuple[Any, _FieldSpace | None]:
    """The job's optuna study and, when TPE samples it, its field space (None: the grid)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    n = len(cands)
    grid = n <= ctx.budget
    if grid:
        # The grid is the queue of enqueued trials, in candidate order (default first); the
        # storage hands each waiting trial to exactly one process.
        sampler: Any = optuna.samplers.RandomSampler(seed=int.from_bytes(os.urandom(4), "little"))
    else:
        sampler = optuna.samplers.TPESampler(
            constant_liar=True, n_startup_trials=max(4, min(16, ctx.budget // 4)), seed=int.from_bytes(os.urandom(4), "little")
        )
    name = _study_name(ctx, job, cands)
    created = False
    for attempt in range(5):  # peers may create the same study (or the tables) at once
        try:
            try:
                study = optuna.create_study(study_name=name, storage=ctx.storage, sampler=sampler, direction="minimize")
                created = True
            except optuna.exceptions.DuplicatedStudyError:
                study = optuna.load_study(study_name=name, storage=ctx.storage, sampler=sampler)
            break
        except Exception:
            if ctx.storage is None or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    if not grid:  # TPE: the default and the seeds go first (peers skip those already queued)
        space = _FieldSpace(cands)
        firsts = [i for i, c in enumerate(cands) if c.first][: max(1, ctx.budget // 2)]
        for i in firsts:
            study.enqueue_trial(space.params_of(i), skip_if_exists=True)
        return study, space
    want = list(range(n))
    if not created:
        # the creator enqueues the grid right after creating the study: give it a moment,
        # then enqueue whatever is still missing (a creator that died half-way)
        limit = time.monotonic() + 10.0
        while time.monotonic() < limit and len(study.get_trials(deepcopy=False)) < len(want):
            time.sleep(0.05)
        have = {t.params.get("cand", t.system_attrs.get("fixed_params", {}).get("cand"))
                for t in study.get_trials(deepcopy=False)}
        want = [i for i in want if i not in have]
    for i in want:
        study.enqueue_trial({"cand": i}, skip_if_exists=True)
    return study, None


def _was_enqueued(study: Any, trial: Any) -> bool:
    """Did ``study.ask()`` hand out an enqueued (grid) trial rather than sample a new one?"""
    for t in study.get_trials(deepcopy=False):
        if t.number == trial.number:
            return "fixed_params" in t.system_attrs
    return False


def _finished(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.FAIL)]


def _started(study: Any, stale_s: float) -> int:
    """Trials finished, plus those running for less than ``stale_s`` (older ones are dead)."""
    import datetime as _dt

    from optuna.trial import TrialState

    now = _dt.datetime.now()
    n = 0
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.FAIL):
            n += 1
        elif t.state == TrialState.RUNNING:
            start = t.datetime_start
            if start is None or (now - start).total_seconds() < 2 * stale_s:
                n += 1
    return n
