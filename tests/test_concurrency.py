"""Concurrent writers of one tuning DB: the keep-the-faster upsert, and two real tuning processes
(spawned, the reference backend on the CPU) on one DB file, with and without a shared optuna
storage."""
from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
import multiprocessing as mp
import os
import random
import sqlite3
from collections import Counter, defaultdict

import pytest
import torch

from autofp4.db import TuningDB
from autofp4.env import current_environment
from autofp4.problem import ProblemKey
from autofp4.schema import Environment, TuningRecord, config_json
from autofp4.timing import TimingStats, faster_beyond_noise
from autofp4.tuning import Job, tune_jobs

ENV_A = dict(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0", driver="570.124.06",
             cuda="12.8", torch="2.13.0", cutlass_dsl="4.8.1", autofp4="0.1.0")


def _rng() -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return random.Random(seed)


def _rec(env: Environment, **over) -> TuningRecord:
    data = dict(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=16, n=4096, k=4096,
                config={"chunk_n": 1024}, median_us=40.0, spread_us=1.0, samples=20, default_median_us=50.0,
                backend_source="src1", env=env)
    data.update(over)
    return TuningRecord.model_validate(data)


def _stored(db: TuningDB, rec: TuningRecord) -> TuningRecord:
    got = db.get_result(*rec.key_tuple(), rec.env_key)
    assert got is not None
    return got


# ---------------------------------------------------------------------------------------
# the keep-the-faster upsert
# ---------------------------------------------------------------------------------------
def test_upsert_keeps_the_faster_row_per_environment(tmp_path):
    rng = _rng()
    env_a, env_b = Environment(**ENV_A), Environment(**{**ENV_A, "driver": "575.51.03"})
    with TuningDB(tmp_path / "t.db") as db:
        for case in range(60):
            key = dict(m_bucket=1 + case, n=16 * rng.randint(65, 4096), k=16 * rng.randint(2, 4096))
            fast, slow = sorted(rng.uniform(1.0, 1e5) for _ in range(2))
            if fast == slow:
                slow = fast * 1.5
            cfg_a, cfg_b = {"chunk_n": 0}, {"chunk_n": 16}
            first, second = rng.choice([(fast, slow), (slow, fast)])
            assert db.upsert_result(_rec(env_a, **key, median_us=first, config=cfg_a))
            # the other environment's row of the same key is its own, whatever its time
            other = rng.uniform(1.0, 1e5)
            assert db.upsert_result(_rec(env_b, **key, median_us=other, config=cfg_b))
            wrote = db.upsert_result(_rec(env_a, **key, median_us=second, config=cfg_b))
            got = _stored(db, _rec(env_a, **key))
            assert wrote == (second < first)
            assert got.median_us == fast and got.config == (cfg_b if second < first else cfg_a)
            # an equally fast measurement leaves the stored row
            assert not db.upsert_result(_rec(env_a, **key, median_us=fast, config={"chunk_n": 32}))
            assert _stored(db, _rec(env_a, **key)).config == got.config
            b = _stored(db, _rec(env_b, **key))
            assert b.median_us == other and b.config == cfg_b
        assert db.counts()["results"] == 120


def test_upsert_replaces_rows_of_another_kernel_source_and_deliberate_replacements(tmp_path):
    rng = _rng()
    env = Environment(**ENV_A)
    with TuningDB(tmp_path / "t.db") as db:
        for case in range(40):
            key = dict(m_bucket=1 + case, n=16 * rng.randint(65, 4096))
            t = rng.uniform(10.0, 1e4)
            db.upsert_result(_rec(env, **key, median_us=t, backend_source="src1"))
            # measured with another kernel source: replaced, also when slower
            assert db.upsert_result(_rec(env, **key, median_us=2 * t, backend_source="src2"))
            row = _stored(db, _rec(env, **key))
            assert (row.median_us, row.backend_source) == (2 * t, "src2")
            # a re-tune that measured the stored row again replaces it with the slower measurement
            assert db.upsert_result(_rec(env, **key, median_us=3 * t, backend_source="src2",
                                         config={"chunk_n": 16}), replacing=row)
            fresh = _stored(db, _rec(env, **key))
            assert (fresh.median_us, fresh.config) == (3 * t, {"chunk_n": 16})
            # ... but not once another writer replaced that row: then the faster row wins again
            assert not db.upsert_result(_rec(env, **key, median_us=4 * t, backend_source="src2"), replacing=row)
            assert _stored(db, _rec(env, **key)).median_us == 3 * t
            assert db.upsert_result(_rec(env, **key, median_us=2.5 * t, backend_source="src2"), replacing=row)
            assert _stored(db, _rec(env, **key)).median_us == 2.5 * t
            # replace=True: unconditional
            assert db.upsert_result(_rec(env, **key, median_us=9 * t, backend_source="src2"), replace=True)
            assert _stored(db, _rec(env, **key)).median_us == 9 * t
        # a batch keeps the faster row per key (and counts what it wrote)
        recs = db.results(env.key())
        mixed = [r.model_copy(update={"median_us": r.median_us * rng.choice([0.5, 2.0])}) for r in recs]
        faster = sum(m.median_us < r.median_us for m, r in zip(mixed, recs))
        assert db.upsert_results(mixed) == faster
        after = {r.key_tuple(): r.median_us for r in db.results(env.key())}
        assert after == {r.key_tuple(): min(r.median_us, m.median_us) for r, m in zip(recs, mixed)}


# ---------------------------------------------------------------------------------------
# two tuning processes
# ---------------------------------------------------------------------------------------
KEYS = [ProblemKey("linear", "nvfp4", "bfloat16", 4352, 128), ProblemKey("linear", "mxfp4", "bfloat16", 4608, 256),
        ProblemKey("linear", "nvfp4", "float16", 4224, 128)]
BUCKETS = (1, 16)
JOBS = [(k, m) for k in KEYS for m in BUCKETS]  # 3 reference candidates each (chunk_n 0, 1024, 4096)


def _tuner(db: str, storage: str | None, budget: int | None, force: bool, start, out: str) -> None:
    jobs = [Job(k, m) for k, m in JOBS]
    start.wait(120)  # a barrier: both processes start their runs together
    rep = tune_jobs(jobs, db=db, device="cpu", progress=False, storage=storage, budget_per_shape=budget, force=force)
    with open(out, "w") as f:
        json.dump([dict(key=list(dataclasses.astuple(r.job.key)), m=r.job.m, status=r.status, median_us=r.median_us,
                        config=r.config, trials=r.trials_run, note=r.note) for r in rep.results], f)


def _run_two(tmp_path, storage: str | None, budget: int | None = None, force: bool = False) -> list[list[dict]]:
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    outs = [str(tmp_path / f"report{i}.json") for i in range(2)]
    procs = [ctx.Process(target=_tuner, args=(str(tmp_path / "t.db"), storage, budget, force, start, o)) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    reports = []
    for o in outs:
        with open(o) as f:
            reports.append(json.load(f))
    return reports


def _job_of(row) -> tuple:
    return (row.op, row.fmt, row.dtype, row.n, row.k, row.experts, row.topk, row.m_bucket)


def _check_db(tmp_path, reports: list[list[dict]]) -> tuple[dict, dict]:
    """The DB is intact; every job's stored row is the tuner's choice over every ok trial of that
    job (both processes'), and no process reported a faster result than the stored one."""
    path = tmp_path / "t.db"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    env_key = current_environment(torch.device("cpu")).key()
    with TuningDB(path) as db:
        rows = {_job_of(r): r for r in db.results(env_key)}
        trials = db.trials(env_key)
    assert set(rows) == {(*dataclasses.astuple(k), m) for k, m in JOBS}
    by_job = defaultdict(list)
    for t in trials:
        by_job[_job_of(t)].append(t)
    for job, row in rows.items():
        measured = defaultdict(list)
        for t in by_job[job]:
            if t.outcome == "ok":
                measured[config_json(t.config)].append(TimingStats(t.median_us, t.spread_us, 1, t.median_us))
        # one measurement per config counts (a config measured twice: either one)
        choices = {_choice(dict(zip(measured, pick))) for pick in itertools.product(*measured.values())}
        assert (config_json(row.config), row.median_us) in choices, (job, row, measured)
        for rp in reports:
            for r in rp:
                if (*r["key"], r["m"]) == job and r["median_us"] is not None and r["status"] == "tuned":
                    assert row.median_us <= r["median_us"], (job, row.median_us, r)
    return rows, by_job


def _choice(stats: dict[str, TimingStats]) -> tuple[str, float]:
    """The tuner's choice: the fastest config where it beats the default beyond the noise."""
    best = min(stats, key=lambda c: (stats[c].median_us, "reference", c))
    default = config_json({"chunk_n": 0})
    win = best if default not in stats or faster_beyond_noise(stats[best], stats[default]) else default
    return win, stats[win].median_us


def _executed_trials(storage: str) -> dict[tuple, list]:
    """``(study, ident) -> [optuna trials that measured it]`` of every study in the storage."""
    import optuna

    out = defaultdict(list)
    st = optuna.storages.RDBStorage(storage)
    for name in optuna.get_all_study_names(st):
        for t in optuna.load_study(study_name=name, storage=st).get_trials(deepcopy=False):
            if t.user_attrs.get("executed"):
                out[(name, t.user_attrs["ident"])].append(t)
    return out


@pytest.mark.parametrize("budget", [None, 2], ids=["grid", "tpe"])
def test_two_tuners_with_a_shared_storage_share_the_trials(tmp_path, budget):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    reports = _run_two(tmp_path, storage, budget)
    assert all(r["status"] in ("tuned", "skipped") for rep in reports for r in rep), reports
    rows, by_job = _check_db(tmp_path, reports)
    executed = _executed_trials(storage)
    counts = Counter((job, config_json(t.config)) for job, ts in by_job.items() for t in ts)
    assert sum(counts.values()) == sum(len(v) for v in executed.values())  # every trial recorded once
    if budget is None:  # the grid: each config measured by exactly one process
        assert set(counts.values()) == {1}, counts
        assert len(counts) == 3 * len(JOBS)
    for (study, ident), ts in executed.items():
        # a config measured twice was measured at the same time (in flight in both processes)
        for a in ts:
            for b in ts:
                if a.number < b.number:
                    assert a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete, (study, ident)


@pytest.mark.parametrize("force", [False, True], ids=["fresh", "force"])
def test_two_tuners_without_a_storage_split_the_jobs(tmp_path, force):
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if force:  # stored winners of an earlier run, measured far slower than anything here
        env = current_environment(torch.device("cpu"))
        from autofp4.dispatch import backend_source_hash
        from autofp4.backends import get_backend

        src = backend_source_hash(get_backend("reference"), {"chunk_n": 1024})
        with TuningDB(tmp_path / "t.db") as db:
            db.upsert_results(_rec(env, op=k.op, fmt=k.fmt, dtype=k.dtype, n=k.n, k=k.k, m_bucket=m, median_us=9e8,
                                   backend_source=src, created_at="2025-01-01T00:00:00Z") for k, m in JOBS)
    reports = _run_two(tmp_path, None, force=force)
    rows, by_job = _check_db(tmp_path, reports)
    for job in rows:
        statuses = sorted(r["status"] for rp in reports for r in rp if (*r["key"], r["m"]) == job)
        assert statuses == ["skipped", "tuned"], (job, statuses, reports)
        # one process measured the job's three configs, each once
        assert sorted(Counter(config_json(t.config) for t in by_job[job]).values()) == [1, 1, 1], by_job[job]
        assert rows[job].created_at >= started
    assert not (tmp_path / "t.db.claims").exists() or not list((tmp_path / "t.db.claims").iterdir())


def test_a_forced_retune_replaces_the_winner_it_measured_again_also_when_slower(tmp_path):
    path = tmp_path / "t.db"
    key = KEYS[0]
    rep = tune_jobs([Job(key, 1)], db=path, device="cpu", progress=False)
    assert rep.results[0].status == "tuned"
    with sqlite3.connect(path) as conn:  # the stored winner looks faster than any run can measure
        conn.execute("UPDATE results SET median_us = 0.001, spread_us = 0.0")
    rep = tune_jobs([Job(key, 1)], db=path, device="cpu", progress=False, force=True)
    r = rep.results[0]
    assert r.status == "tuned", r.note
    with TuningDB(path) as db:
        (row,) = db.results(current_environment(torch.device("cpu")).key())
    assert row.median_us == r.median_us > 0.001 and row.config == r.config
