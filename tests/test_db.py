"""The SQLite tuning database: real files in tmp_path, real processes, no mocks."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import time
import warnings
from pathlib import Path

import pytest
import sqlite_utils

from autofp4.db import (
    MIGRATIONS,
    ChangeMonitor,
    SCHEMA_VERSION,
    TuningDB,
    TuningDBError,
    TuningDBWarning,
    TuningFileError,
    better_evidenced,
    default_db_path,
    load_layers,
    shipped_db_dir,
)
from autofp4.env import current_environment
from autofp4.schema import Environment, TrialRecord, TuningRecord, config_json

ENV_A = dict(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0", driver="570.124.06",
             cuda="12.8", torch="2.13.0", cutlass_dsl="4.8.1", autofp4="0.1.0")
ENV_B = {**ENV_A, "driver": "575.51.03"}


def env_a() -> Environment:
    return Environment(**ENV_A)


def env_b() -> Environment:
    return Environment(**ENV_B)


def rec(env: Environment | None = None, **over) -> TuningRecord:
    data = dict(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=16,
                n=4096, k=4096, config={"chunk_n": 1024}, median_us=40.0, spread_us=1.0, samples=20,
                default_median_us=50.0, backend_source="src1", created_at="2025-01-01T00:00:00Z",
                env=env or env_a())
    data.update(over)
    return TuningRecord.model_validate(data)


def trial(env: Environment | None = None, **over) -> TrialRecord:
    data = dict(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=16, m=13,
                n=4096, k=4096, config={"chunk_n": 1024}, outcome="ok", median_us=40.0,
                spread_us=1.0, env_key=(env or env_a()).key(), backend_source="src1")
    data.update(over)
    return TrialRecord.model_validate(data)


def dump(recs) -> list[dict]:
    return [r.model_dump() for r in recs]


# ---------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------
def test_default_paths(tmp_path, monkeypatch):
    assert default_db_path() == Path(os.environ["AUTOFP4_DB"])  # set per test by conftest
    monkeypatch.delenv("AUTOFP4_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "autofp4" / "tuning.db"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_db_path() == Path.home() / ".cache" / "autofp4" / "tuning.db"
    monkeypatch.delenv("AUTOFP4_SHIPPED_DB", raising=False)
    assert shipped_db_dir().name == "tuning_db" and (shipped_db_dir().parent / "autofp4").is_dir()
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "ship"))
    assert shipped_db_dir() == tmp_path / "ship"


def test_default_db_is_created_at_default_path():
    with TuningDB() as db:
        db.upsert_result(rec())
    assert default_db_path().is_file()
    with TuningDB(default_db_path(), readonly=True) as db:
        assert db.counts()["results"] == 1


# ---------------------------------------------------------------------------------------
# basic reads and writes
# ---------------------------------------------------------------------------------------
def test_upsert_replaces_same_key_and_keeps_others(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.upsert_result(rec())
        db.upsert_result(rec(m_bucket=32))
        db.upsert_result(rec(config={"chunk_n": 2048}, median_us=35.0))
        got = db.results()
        assert len(got) == 2
        by_m = {r.m_bucket: r for r in got}
        assert by_m[16].config == {"chunk_n": 2048} and by_m[16].median_us == 35.0
        assert by_m[32].config == {"chunk_n": 1024}
        assert db.counts()["results"] == 2 and db.counts()["environments"] == 1
        assert db.schema_version == SCHEMA_VERSION


def test_db_file_is_wal_with_busy_timeout(tmp_path):
    TuningDB(tmp_path / "t.db").close()
    conn = sqlite3.connect(tmp_path / "t.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_results_are_isolated_per_environment(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.upsert_result(rec(env_a(), config={"chunk_n": 1024}))
        db.upsert_result(rec(env_b(), config={"chunk_n": 2048}))  # same key, other driver
        a = db.results(env_key=env_a().key())
        b = db.results(env_key=env_b().key())
        assert [r.config for r in a] == [{"chunk_n": 1024}] and a[0].env == env_a()
        assert [r.config for r in b] == [{"chunk_n": 2048}] and b[0].env == env_b()
        assert db.results(env_key="f" * 16) == []
        assert len(db.results()) == 2
        assert set(db.environments()) == {env_a().key(), env_b().key()}


def test_result_filters(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.upsert_results([rec(m_bucket=m, n=n) for m in (1, 8, 64) for n in (2048, 4096)])
        db.upsert_result(rec(op="moe", experts=8, topk=2, n=1024, k=2048, config={"chunk_n": 0}))
        assert len(db.results(n=2048)) == 3
        assert [r.m_bucket for r in db.results(n=4096, m_bucket=[1, 64])] == [1, 64]
        assert len(db.results(op="moe", experts=8)) == 1
        assert db.results(fmt="mxfp4") == []
        with pytest.raises(TypeError, match="unknown filter"):
            db.results(colour="red")


def test_has_result_and_failed_configs(tmp_path):
    e = env_a().key()
    key = ("linear", "nvfp4", "bfloat16", "reference", 16, 4096, 4096, 0, 0)
    with TuningDB(tmp_path / "t.db") as db:
        assert not db.has_result(*key, e)
        db.upsert_result(rec())
        assert db.has_result(*key, e)
        assert not db.has_result(*key, env_b().key())
        db.add_environment(env_a())
        db.add_trial(trial(config={"chunk_n": 512}, outcome="compile_error", median_us=None, error="ptxas"))
        db.add_trial(trial(config={"chunk_n": 256}, outcome="wrong_result", m_bucket=32, m=20))
        db.add_trial(trial(config={"chunk_n": 1024}, outcome="ok"))
        db.add_trials([trial(config={"chunk_n": 16, "x": 1}, outcome="invalid", backend_source="old")])
        db.add_trial(trial(config={"chunk_n": 128}, outcome="timeout", env_key=env_b().key()))
        assert db.failed_configs(*key, e) == {'{"chunk_n":512}', '{"chunk_n":16,"x":1}'}
        assert db.failed_configs(*key[:4], None, *key[5:], e) == {
            '{"chunk_n":512}', '{"chunk_n":256}', '{"chunk_n":16,"x":1}'}
        assert db.failed_configs(*key, e, backend_source="src1") == {'{"chunk_n":512}'}
        assert db.failed_configs(*key, e, backend_source={"src1", "old"}) == {
            '{"chunk_n":512}', '{"chunk_n":16,"x":1}'}
        assert db.failed_configs(*key, e, backend_source=set()) == set()
        assert db.failed_configs(*key, env_b().key()) == {config_json({"chunk_n": 128})}
        trials = db.trials(e, m_bucket=16)
        assert [t.outcome for t in trials] == ["compile_error", "ok", "invalid"]
        assert trials[0].error == "ptxas"
        assert db.counts()["failed_trials"] == 4


def test_readonly_refuses_writes(tmp_path):
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        db.upsert_result(rec())
    with TuningDB(path, readonly=True) as db:
        assert len(db.results()) == 1
        with pytest.raises(TuningDBError, match="read-only"):
            db.upsert_result(rec(m_bucket=1))
    with pytest.raises(TuningDBError, match="no tuning database"):
        TuningDB(tmp_path / "missing.db", readonly=True)


def test_failed_write_leaves_nothing(tmp_path):
    """A batch that fails half-way is rolled back as a whole."""
    with TuningDB(tmp_path / "t.db") as db:
        def gen():
            yield rec(m_bucket=1)
            yield rec(m_bucket=2)
            raise RuntimeError("interrupted")

        with pytest.raises(RuntimeError):
            db.upsert_results(gen())
        assert db.results() == []
        db.upsert_result(rec(m_bucket=4))  # the connection is still usable
        assert len(db.results()) == 1


# ---------------------------------------------------------------------------------------
# concurrency and crashes (real processes)
# ---------------------------------------------------------------------------------------
def _writer(path: str, worker: int, count: int, start) -> None:
    with TuningDB(path) as db:
        start.wait(60)  # a barrier: both processes start writing together
        for i in range(count):
            db.upsert_result(rec(m_bucket=1 + worker, n=2048 + 16 * i, median_us=10.0 + i))
            db.add_trial(trial(m_bucket=1 + worker, m=1 + worker, n=2048 + 16 * i, median_us=10.0 + i))
            time.sleep(0.002)  # spread the writes so that the two processes surely interleave


def test_two_processes_write_concurrently_without_loss(tmp_path):
    path = str(tmp_path / "shared.db")
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, w, 200, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with TuningDB(path) as db:
        got = db.results()
        assert len(got) == 400
        assert db.counts()["trials"] == 400
        for w in range(2):
            rows = sorted((r for r in got if r.m_bucket == 1 + w), key=lambda r: r.n)
            assert [r.n for r in rows] == [2048 + 16 * i for i in range(200)]
            assert [r.median_us for r in rows] == [10.0 + i for i in range(200)]
        # the two writers really ran at the same time: their trial time spans overlap
        spans = []
        for w in range(2):
            ts = sorted(t.created_at for t in db.trials(m_bucket=1 + w))
            assert len(ts) == 200
            spans.append((ts[0], ts[-1]))
        assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


BATCH = 25


def _batch_writer(path: str, started) -> None:
    with TuningDB(path) as db:
        i = 0
        while True:
            db.upsert_results(rec(m_bucket=1 + (i % 1000), n=2048 + 16 * j, samples=1 + i % 7)
                              for j in range(BATCH))
            i += 1
            started.set()


def test_killed_writer_leaves_only_complete_batches(tmp_path):
    path = str(tmp_path / "killed.db")
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    p = ctx.Process(target=_batch_writer, args=(path, started))
    p.start()
    try:
        assert started.wait(120), "writer never committed"
        time.sleep(0.3)  # let it get well into its stream of transactions
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    assert p.exitcode == -signal.SIGKILL
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw = conn.execute("SELECT count(*) FROM results").fetchone()[0]
    conn.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any invalid row would warn
        with TuningDB(path) as db:
            got = db.results()
    assert raw >= BATCH and raw % BATCH == 0
    assert len(got) == raw
    per_bucket: dict[int, int] = {}
    for r in got:
        per_bucket[r.m_bucket] = per_bucket.get(r.m_bucket, 0) + 1
    assert set(per_bucket.values()) == {BATCH}


# ---------------------------------------------------------------------------------------
# migrations
# ---------------------------------------------------------------------------------------
def _indexes(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    conn.close()
    return names


def test_migrate_from_version_0(tmp_path):
    path = tmp_path / "v0.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")  # version row missing
    conn.commit()
    conn.close()
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        db.upsert_result(rec())
        assert len(db.results()) == 1
    assert {"results_unique_key", "trials_problem", "results_env"} <= _indexes(path)


def test_migrate_from_version_1_keeps_rows(tmp_path):
    path = tmp_path / "v1.db"
    old = sqlite_utils.Database(path)
    old["meta"].create({"key": str, "value": str}, pk="key")
    MIGRATIONS[0](old)
    old["meta"].insert({"key": "schema_version", "value": "1"})
    r = rec()
    row = r.model_dump(exclude={"env", "origin"})
    row.update(config=json.dumps(r.config), env_key=r.env_key)
    old["results"].insert(row)
    old["environments"].insert({"env_key": r.env_key, "env": r.env.model_dump_json()})
    old.close()
    assert "trials_problem" not in _indexes(path)
    with pytest.raises(TuningDBError, match="needs migrating"):
        TuningDB(path, readonly=True)
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION == 3
        assert dump(db.results()) == dump([r])
    assert {"trials_problem", "results_env"} <= _indexes(path)


def _version_2_db(path: Path, recs: list[TuningRecord]) -> None:
    """A file as autofp4 wrote it at schema version 2 (no ``origin`` column), holding ``recs``."""
    old = sqlite_utils.Database(path)
    old["meta"].create({"key": str, "value": str}, pk="key")
    MIGRATIONS[0](old)
    MIGRATIONS[1](old)
    old["meta"].insert({"key": "schema_version", "value": "2"})
    for r in recs:
        row = r.model_dump(exclude={"env", "origin"})
        row.update(config=json.dumps(r.config), env_key=r.env_key)
        old["results"].insert(row)
        old["environments"].insert({"env_key": r.env_key, "env": r.env.model_dump_json()}, ignore=True)
    old.close()


def test_a_version_2_file_is_read_as_it_is_and_migrated_to_origin(tmp_path):
    path = tmp_path / "v2.db"
    r = rec()
    _version_2_db(path, [r])
    with TuningDB(path, readonly=True) as db:  # read without migrating: the rows are offline ones
        assert db.schema_version == 2 and dump(db.results()) == dump([r]) and r.origin == "offline"
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION == 3
        assert dump(db.results()) == dump([r])
        db.upsert_result(rec(m_bucket=1, origin="jit"))
        assert {x.m_bucket: x.origin for x in db.results()} == {16: "offline", 1: "jit"}


def test_origin_survives_export_import_and_merge_and_offline_rows_leave_it_out(tmp_path):
    with TuningDB(tmp_path / "a.db") as a:
        a.upsert_results([rec(m_bucket=1, origin="jit"), rec(m_bucket=16)])
        a.export(tmp_path / "a.json")
    raw = json.loads((tmp_path / "a.json").read_text())["records"]
    assert [(r["m_bucket"], r.get("origin")) for r in raw] == [(1, "jit"), (16, None)]
    with TuningDB(tmp_path / "b.db") as b:
        assert b.import_file(tmp_path / "a.json").added == 2
        assert {x.m_bucket: x.origin for x in b.results()} == {1: "jit", 16: "offline"}
    _version_2_db(tmp_path / "old.db", [rec(m_bucket=4)])
    with TuningDB(tmp_path / "c.db") as c:
        assert c.merge(tmp_path / "b.db").added == 2 and c.merge(tmp_path / "old.db").added == 1
        assert {x.m_bucket: x.origin for x in c.results()} == {1: "jit", 4: "offline", 16: "offline"}


def test_change_monitor_sees_commits_of_other_connections(tmp_path):
    path = tmp_path / "w.db"
    mon = ChangeMonitor(path)
    assert not mon.changed()  # no file yet
    with TuningDB(path) as db:
        assert mon.changed() and not mon.changed()  # the file appeared, then nothing new
        db.upsert_result(rec())
        assert mon.changed() and not mon.changed()
        db.results()  # reads are no change
        assert not mon.changed()
    mon.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "new.db"
    TuningDB(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(TuningDBError, match="newer than this autofp4"):
        TuningDB(path)


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE results (x INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(TuningDBError, match="not an autofp4 tuning database"):
        TuningDB(path)


# ---------------------------------------------------------------------------------------
# export / import
# ---------------------------------------------------------------------------------------
def _sample_db(path: Path) -> TuningDB:
    db = TuningDB(path)
    db.upsert_results([rec(m_bucket=m, n=n, median_us=10.0 + m + n / 1000) for m in (1, 16) for n in (2048, 4096)])
    db.upsert_result(rec(env_b(), op="moe", fmt="mxfp4", dtype="float16", experts=16, topk=4,
                         n=2048, k=1024, config={"chunk_n": 0}, default_median_us=None))
    return db


def test_export_import_round_trip(tmp_path):
    with _sample_db(tmp_path / "a.db") as a:
        doc = a.export(tmp_path / "all.json")
        original = a.results()
        assert len(doc.records) == 5 and len(doc.environments) == 2
        only_a = a.export(tmp_path / "a.json", env_key=env_a().key())
        assert len(only_a.records) == 4 and list(only_a.environments) == [env_a().key()]
        a.export(tmp_path / "all2.json")
    text = json.loads((tmp_path / "all.json").read_text())
    text2 = json.loads((tmp_path / "all2.json").read_text())
    text.pop("exported_at"), text2.pop("exported_at")
    assert text == text2  # stable output
    assert (tmp_path / "all.json").read_text().startswith("{\n  \"autofp4\"")  # pretty, sorted keys
    with TuningDB(tmp_path / "fresh.db") as fresh:
        rep = fresh.import_file(tmp_path / "all.json")
        assert (rep.added, rep.replaced, rep.kept, rep.conflicts) == (5, 0, 0, [])
        assert dump(fresh.results()) == dump(original)
        again = fresh.import_file(tmp_path / "all.json")
        assert again.identical == 5 and again.added == 0


def _write_doc(path: Path, mutate) -> Path:
    with _sample_db(path.with_suffix(".db")) as db:
        db.export(path)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(schema_version=7), "unsupported schema_version 7"),
    (lambda d: d["records"][2].update(backend="evil"), "record #2 (op='linear'"),
    (lambda d: d["records"][1].update(n=2**40), "record #1"),
    (lambda d: d["records"][0]["config"].update(tile=128), "takes no tile"),
    (lambda d: d["records"][3].update(median_us=-1.0), "median_us must be > 0"),
    (lambda d: d["records"][0].update(env_key="0123456789abcdef"), "not in environments"),
    (lambda d: d.update(code="__import__('os').system('true')"), "code"),
])
def test_import_rejects_invalid_and_writes_nothing(tmp_path, mutate, needle):
    path = _write_doc(tmp_path / "bad.json", mutate)
    with TuningDB(tmp_path / "target.db") as db:
        with pytest.raises(TuningFileError) as ei:
            db.import_file(path)
        assert str(path) in str(ei.value) and needle in str(ei.value)
        assert db.counts()["results"] == 0


def test_import_rejects_bad_json(tmp_path):
    with TuningDB(tmp_path / "target.db") as db:
        (tmp_path / "trunc.json").write_text('{"schema_version": 1, "records": [')
        with pytest.raises(TuningFileError, match="invalid JSON"):
            db.import_file(tmp_path / "trunc.json")
        (tmp_path / "nan.json").write_text('{"schema_version": 1, "x": NaN}')
        with pytest.raises(TuningFileError, match="NaN"):
            db.import_file(tmp_path / "nan.json")
        (tmp_path / "list.json").write_text("[1, 2]")
        with pytest.raises(TuningFileError, match="expected a JSON object"):
            db.import_file(tmp_path / "list.json")
        with pytest.raises(TuningFileError, match="no such file"):
            db.import_file(tmp_path / "absent.json")


# ---------------------------------------------------------------------------------------
# merge / diff
# ---------------------------------------------------------------------------------------
def test_better_evidenced_order():
    base = rec(samples=20, spread_us=1.0, median_us=40.0, created_at="2025-01-01T00:00:00Z")
    assert better_evidenced(rec(samples=21, spread_us=9.0), base)
    assert not better_evidenced(rec(samples=19, spread_us=0.0), base)
    assert better_evidenced(rec(samples=20, spread_us=0.5, median_us=40.0), base)  # tighter ratio
    assert not better_evidenced(rec(samples=20, spread_us=2.0, median_us=60.0), base)  # 3.3% > 2.5%
    assert better_evidenced(rec(created_at="2025-01-02T00:00:00Z"), base)  # tie -> newer
    assert not better_evidenced(base, rec(created_at="2025-01-02T00:00:00Z"))
    # another kernel source: the newer measurement, whatever its evidence
    retuned = rec(samples=5, spread_us=9.0, backend_source="src2", created_at="2025-01-03T00:00:00Z")
    assert better_evidenced(retuned, base) and not better_evidenced(base, retuned)
    assert not better_evidenced(rec(samples=99, backend_source="src0", created_at="2024-12-01T00:00:00Z"), base)


def test_merge_keeps_better_evidenced_rows_and_reports_conflicts(tmp_path):
    ours = TuningDB(tmp_path / "ours.db")
    theirs = TuningDB(tmp_path / "theirs.db")
    # m=1: they have more samples and another config -> theirs wins, conflict
    ours.upsert_result(rec(m_bucket=1, samples=10, config={"chunk_n": 1024}))
    theirs.upsert_result(rec(m_bucket=1, samples=50, config={"chunk_n": 2048}))
    # m=2: we have more samples -> ours kept, conflict
    ours.upsert_result(rec(m_bucket=2, samples=50, config={"chunk_n": 1024}))
    theirs.upsert_result(rec(m_bucket=2, samples=10, config={"chunk_n": 512}))
    # m=4: same config, same samples, they have a tighter spread -> replaced, no conflict
    ours.upsert_result(rec(m_bucket=4, spread_us=4.0))
    theirs.upsert_result(rec(m_bucket=4, spread_us=0.5))
    # m=8: identical; m=16: only theirs; m=32: only ours; other env: only theirs
    ours.upsert_result(rec(m_bucket=8))
    theirs.upsert_result(rec(m_bucket=8))
    theirs.upsert_result(rec(m_bucket=16))
    ours.upsert_result(rec(m_bucket=32))
    theirs.upsert_result(rec(env_b(), m_bucket=1))

    diffs = ours.diff(theirs)
    kinds = {(d.kind, d.key["m_bucket"], d.key["env_key"] == env_b().key()) for d in diffs}
    assert kinds == {("config", 1, False), ("config", 2, False), ("timing", 4, False),
                     ("only_theirs", 16, False), ("only_ours", 32, False), ("only_theirs", 1, True)}

    rep = ours.merge(tmp_path / "theirs.db")
    assert (rep.added, rep.replaced, rep.kept, rep.identical) == (2, 2, 1, 1)
    assert rep.environments_added == 1
    assert sorted((c.key["m_bucket"], c.winner) for c in rep.conflicts) == [(1, "theirs"), (2, "ours")]
    got = {(r.m_bucket, r.env_key): r for r in ours.results()}
    a = env_a().key()
    assert got[(1, a)].config == {"chunk_n": 2048} and got[(1, a)].samples == 50
    assert got[(2, a)].config == {"chunk_n": 1024} and got[(2, a)].samples == 50
    assert got[(4, a)].spread_us == 0.5
    assert (16, a) in got and (32, a) in got and (1, env_b().key()) in got
    assert len(got) == 7
    # merging again changes nothing; the remaining difference is what only we have or keep
    assert ours.merge(theirs).replaced == 0
    assert {(d.kind, d.key["m_bucket"]) for d in ours.diff(theirs)} == {("config", 2), ("only_ours", 32)}
    ours.close()
    theirs.close()


def test_merge_from_json_export(tmp_path):
    with _sample_db(tmp_path / "src.db") as src:
        src.export(tmp_path / "src.json")
        expected = dump(src.results())
    with TuningDB(tmp_path / "dst.db") as dst:
        rep = dst.merge(tmp_path / "src.json")
        assert rep.added == 5
        assert dump(dst.results()) == expected
        assert dst.diff(tmp_path / "src.json") == []


# ---------------------------------------------------------------------------------------
# prune
# ---------------------------------------------------------------------------------------
def test_prune(tmp_path):
    cur = current_environment()
    with TuningDB(tmp_path / "t.db") as db:
        db.upsert_result(rec(m_bucket=1, created_at="2001-01-01T00:00:00Z"))  # old
        db.upsert_result(rec(m_bucket=2))  # 2025, recent relative to the 2001 cutoff below
        db.upsert_result(rec(env_b(), m_bucket=1))
        db.upsert_result(rec(cur, m_bucket=1))
        db.add_trial(trial(outcome="compile_error", median_us=None, created_at="2001-01-01T00:00:00Z"))
        db.add_trial(trial(outcome="ok"))
        db.add_trial(trial(outcome="timeout"))
        with pytest.raises(ValueError, match="at least one criterion"):
            db.prune()
        days = (time.time() - time.mktime((2010, 1, 1, 0, 0, 0, 0, 0, 0))) / 86400
        assert db.prune(older_than_days=days) == 2  # the 2001 result and the 2001 trial
        assert {r.m_bucket for r in db.results(env_a().key())} == {2}
        assert db.prune(failed_trials=True) == 1  # the timeout; the ok trial stays
        assert [t.outcome for t in db.trials()] == ["ok"]
        assert db.prune(env_key=env_b().key()) == 1
        assert env_b().key() not in db.environments()
        assert db.prune(keep_current_env_only=True) == 2  # env A's result and trial
        assert [r.env_key for r in db.results()] == [cur.key()]
        assert set(db.environments()) == {cur.key()}


# ---------------------------------------------------------------------------------------
# layered lookup
# ---------------------------------------------------------------------------------------
def test_load_layers_order_and_env_filter(tmp_path, monkeypatch):
    ship = tmp_path / "ship"
    ship.mkdir()
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(ship))
    with TuningDB(tmp_path / "s1.db") as s:
        s.upsert_result(rec(m_bucket=1, config={"chunk_n": 512}))  # shadowed by the user DB
        s.upsert_result(rec(m_bucket=2, config={"chunk_n": 512}))  # only shipped
        s.upsert_result(rec(env_b(), m_bucket=4))  # other environment: never returned
        s.export(ship / "a_h200.json")
    with TuningDB(tmp_path / "s2.db") as s:
        s.upsert_result(rec(m_bucket=2, config={"chunk_n": 256}))  # shadowed by a_h200.json
        s.upsert_result(rec(m_bucket=8, config={"chunk_n": 256}))
        s.export(ship / "b_h200.json")
    user = tmp_path / "user.db"
    with TuningDB(user) as u:
        u.upsert_result(rec(m_bucket=1, config={"chunk_n": 2048}))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = load_layers(env_a(), user_path=user)
    assert [(r.m_bucket, r.config["chunk_n"]) for r in got] == [(1, 2048), (2, 512), (8, 256)]
    # the two shipped exports disagree on M bucket 2: the first by name is used, and said so (the
    # user DB shadowing a shipped row is what it is for: no warning)
    assert [str(w.message).split(" both hold")[0] for w in said] == [
        f"shipped tuning exports {ship / 'a_h200.json'} and {ship / 'b_h200.json'}"]
    assert all(r.env == env_a() for r in got)
    assert [r.m_bucket for r in load_layers(env_b(), user_path=user)] == [4]
    # the default user path is $AUTOFP4_DB; absent file -> just the shipped layers
    assert [r.m_bucket for r in load_layers(env_a())] == [1, 2, 8]


def test_load_layers_skips_corrupt_files_with_a_warning(tmp_path, monkeypatch):
    ship = tmp_path / "ship"
    ship.mkdir()
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(ship))
    with TuningDB(tmp_path / "good.db") as s:
        s.upsert_result(rec(m_bucket=2))
        s.upsert_result(rec(m_bucket=4, config={"chunk_n": 0}))
        s.export(ship / "good.json")
    full = (ship / "good.json").read_text()
    (ship / "truncated.json").write_text(full[: len(full) // 2])
    (ship / "badversion.json").write_text(json.dumps({**json.loads(full), "schema_version": 42}))
    bad_rec = json.loads(full)
    bad_rec["records"][1]["backend"] = "evil"
    (ship / "onebad.json").write_text(json.dumps(bad_rec))
    user = tmp_path / "user.db"
    user.write_bytes(os.urandom(1 << 14))  # garbage bytes
    with pytest.warns(TuningDBWarning) as record:
        got = load_layers(env_a(), user_path=user)
    messages = [str(w.message) for w in record]
    assert any(str(user) in m for m in messages)
    assert any("truncated.json" in m for m in messages)
    assert any("badversion.json" in m and "schema_version" in m for m in messages)
    assert any("onebad.json" in m and "record #1" in m and "evil" in m for m in messages)
    assert sorted(r.m_bucket for r in got) == [2, 4]


def test_load_layers_skips_truncated_db(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "none"))
    user = tmp_path / "user.db"
    with TuningDB(user) as db:
        db.upsert_results(rec(m_bucket=m, n=16 * i, config={}) for m in (1, 2, 4, 8) for i in range(1, 400))
    data = user.read_bytes()
    user.write_bytes(data[: len(data) // 2])
    with pytest.warns(TuningDBWarning, match="user.db"):
        assert load_layers(env_a(), user_path=user) == []


def test_every_shipped_row_is_current_for_the_kernels_shipped_with_it():
    """A kernel edit that changes its source hash retires its rows; the shipped DBs must then be
    re-tuned (or re-stamped, where the change cannot alter a measurement) in the same change, or
    the GPUs they were tuned on silently fall back to default configs."""
    from autofp4.db import read_records
    from autofp4.dispatch import row_is_stale

    files = sorted(shipped_db_dir().glob("*.json"))
    assert files
    for f in files:
        recs = read_records(f)[1]
        assert recs, f"{f.name}: no rows"
        stale = [(r.fmt, r.n, r.k, r.m_bucket, r.config.get("kernel")) for r in recs if row_is_stale(r)]
        assert not stale, f"{f.name}: {len(stale)} of {len(recs)} rows are stale, e.g. {stale[:3]}"
