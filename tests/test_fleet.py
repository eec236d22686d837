"""Tuning with one process per device (``autofp4 tune --devices``), on the CPU: processes on the
reference backend stand in for GPUs and share one job queue through the claims beside the DB.
Each job is tuned by exactly one process and stored once; a process killed mid-job loses only
that job's progress, which another process takes up again."""
import json
import os
import signal
import time

import pytest
import torch

from autofp4 import backends as registry
from autofp4.backends.reference import ReferenceBackend
from autofp4.cli import main as cli
from autofp4.db import TuningDB
from autofp4.env import current_environment
from autofp4.problem import ProblemKey
from autofp4.tuning import Job, tune_on_devices
from autofp4.tuning.fleet import _merge, compile_workers_per_device
from autofp4.tuning.jobs import JobResult

# tuning processes and servers: not in the quick subset
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(256, 128), (128, 256), (384, 128)]
MS = (1, 2, 4)


class SlowReference(ReferenceBackend):
    """The reference backend, each trial's compile taking 0.4 s (so that jobs overlap in time)."""

    name = "test_fleet_slow"

    def config_space(self, key):
        return {"chunk_n": [0, 64]}

    def compile(self, config, key):
        time.sleep(0.4)
        return super().compile(config, key)


@pytest.fixture
def slow_backend(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, SlowReference.name, f"{__name__}:{SlowReference.__qualname__}")
    monkeypatch.setitem(registry._INSTANCES, SlowReference.name, SlowReference())
    return SlowReference.name


def _jobs():
    return [Job(ProblemKey("linear", "nvfp4", "bfloat16", n, k), m) for n, k in SHAPES for m in MS]


def _rows(db):
    with TuningDB(db) as d:
        return d.results(current_environment(torch.device("cpu")).key())


def _tuned_by(events):
    """job index -> the processes whose report says they tuned it."""
    out: dict[int, list[int]] = {}
    for kind, i, _pid, *data in events:
        if kind == "report":
            for j, r in enumerate(data[0]):
                if r.status == "tuned":
                    out.setdefault(j, []).append(i)
    return out


def test_two_processes_tune_every_job_once(tmp_path, slow_backend):
    db = tmp_path / "t.db"
    events = []
    report = tune_on_devices(_jobs(), ["cpu", "cpu"], db=db, backends=[slow_backend], progress=False,
                             on_event=lambda *e: events.append(e))
    jobs = _jobs()
    assert [r.status for r in report.results] == ["tuned"] * len(jobs), report.table()
    tuned_by = _tuned_by(events)
    assert sorted(tuned_by) == list(range(len(jobs))) and all(len(v) == 1 for v in tuned_by.values())
    assert {i for v in tuned_by.values() for i in v} == {0, 1}  # both processes did work
    rows = _rows(db)
    assert sorted((r.n, r.k, r.m_bucket) for r in rows) == sorted((n, k, m) for n, k in SHAPES for m in MS)
    assert all(r.backend == slow_backend and r.median_us > 0 for r in rows)
    assert not report.failed_devices and report.device == "cpu, cpu"
    assert all(r.note.startswith("on cpu") for r in report.results)


def test_a_process_killed_mid_job_loses_only_that_job_to_the_other(tmp_path, slow_backend):
    db = tmp_path / "t.db"
    events, killed = [], []

    def on_event(kind, i, pid, *data):
        events.append((kind, i, pid, *data))
        if kind == "trial" and i == 1 and not killed:  # process 1 is inside a job: kill it
            os.kill(pid, signal.SIGKILL)
            killed.append(data[0])

    report = tune_on_devices(_jobs(), ["cpu", "cpu"], db=db, backends=[slow_backend], progress=False,
                             on_event=on_event)
    assert killed, "process 1 never measured a trial"
    assert report.failed_devices == {"cpu": -signal.SIGKILL}
    assert [r.status for r in report.results] == ["tuned"] * len(_jobs()), report.table()
    assert len(_rows(db)) == len(_jobs())  # every job stored once, the killed one's job included
    with TuningDB(db) as d:  # the DB is intact after the kill
        assert d.path.exists() and len(d.results(current_environment(torch.device("cpu")).key())) == 9
    assert [i for kind, i, *_ in events if kind == "exited" and i == 1]


def test_the_cli_runs_one_process_per_device(tmp_path):
    cfg = tmp_path / "llama.json"
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                               "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 1000}))
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        rc = cli(["tune", "--model", str(cfg), "--devices", "cpu,cpu", "--m", "1,2", "--db", str(tmp_path / "t.db"),
                  "--no-progress"], out=f)
    text = out.read_text()
    assert rc == 0, text
    assert "8 tuned" in text and "on cpu, cpu" in text


def test_bad_device_lists_are_refused(tmp_path, capsys):
    for bad in ("0,0", "cpu,1", "x", "-1"):
        assert cli(["tune", "--model", "examples/llama-3.1-8b.json", "--devices", bad]) == 2
        assert "argument --devices: expected 'all', distinct CUDA indices" in capsys.readouterr().err
    assert cli(["tune", "--model", "examples/llama-3.1-8b.json", "--devices", "0"]) == 2  # no GPU here
    assert "no CUDA GPU is available" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must all be CUDA devices or all .cpu."):
        tune_on_devices(_jobs(), ["cpu", "cuda:0"])


def test_the_merge_prefers_the_process_that_tuned_a_job():
    job = _jobs()[0]
    reports = {0: [JobResult(job, "skipped", note="tuned by another run since this one started")],
               1: [JobResult(job, "tuned", backend="reference")]}
    (r,) = _merge([job], reports, ["cuda:0", "cuda:1"])
    assert (r.status, r.note) == ("tuned", "on cuda:1")
    (r,) = _merge([job], {}, ["cuda:0"])
    assert r.status == "error"
    assert compile_workers_per_device(8, cores=128) == 15 and compile_workers_per_device(4, cores=4) == 1


# -----------------------------------------------------------------------------------------
# several hosts: one optuna RDB storage, claims in its database
# -----------------------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request, tmp_path):
    """A fresh shared storage: an SQLite file, and a database on the PostgreSQL server whose URL
    ``AUTOFP4_TEST_PG_URL`` gives (``.ci/run`` starts one on the loopback)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'study.db'}"
        return
    base = os.environ.get("AUTOFP4_TEST_PG_URL")
    if not base:
        pytest.skip("needs a PostgreSQL server: set AUTOFP4_TEST_PG_URL=postgresql+psycopg2://USER@HOST:PORT/DB")
    import uuid

    import sqlalchemy as sa

    name = f"autofp4_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    yield base.rsplit("/", 1)[0] + "/" + name
    with admin.connect() as c:
        c.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


def test_rdb_claims_one_holder_done_elsewhere_and_a_dead_holder_taken_over(storage_url):
    from autofp4.tuning.claims import RDBClaims

    a, b = RDBClaims(storage_url, ttl_s=0.6), RDBClaims(storage_url, ttl_s=0.6)
    j1, j2 = _jobs()[:2]
    try:
        c1 = a.take("env", j1)
        assert c1 is not None and not c1.elsewhere
        assert b.take("env", j1) is None  # held, and renewed
        time.sleep(1.0)
        assert b.take("env", j1) is None  # still renewed past the TTL
        c1.release(done=True)
        assert b.take("env", j1).elsewhere  # stored by a: skipped
        assert a.take("env", j2) is not None  # a holds j2
        a._stop.set()  # a stops renewing, as a dead process
        assert b.take("env", j2) is None
        time.sleep(1.0)
        c2b = b.take("env", j2)
        assert c2b is not None and not c2b.elsewhere  # taken over
        assert a.take("env", j2) is None
        c2b.release(done=False)  # not stored: the job is free again
        assert a.take("env", j2) is not None
    finally:
        a.close()
        b.close()


def test_two_hosts_share_the_jobs_through_the_storage_and_merge_their_dbs(tmp_path, slow_backend, storage_url,
                                                                           monkeypatch):
    """Two fleets (as on two hosts: each its own DB, one storage) tune each job once between them;
    one process is killed mid-job and its job taken over when its claim expires; the two DBs
    merged hold every job's row."""
    import threading

    monkeypatch.setenv("AUTOFP4_CLAIM_TTL_S", "2")
    dbs = [tmp_path / "host0.db", tmp_path / "host1.db"]
    events: list = [[], []]
    reports: list = [None, None]
    killed = []

    def on_event(h):
        def cb(kind, i, pid, *data):
            events[h].append((kind, i, pid, *data))
            if h == 1 and kind == "trial" and not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return cb

    def host(h):
        reports[h] = tune_on_devices(_jobs(), ["cpu"], db=dbs[h], backends=[slow_backend], storage=storage_url,
                                     progress=False, on_event=on_event(h))

    threads = [threading.Thread(target=host, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert killed and reports[1].failed_devices == {"cpu": -signal.SIGKILL}
    tuned = [sum(1 for kind, *_ in events[h] if kind == "report") for h in (0, 1)]
    assert tuned == [1, 0]
    assert [r.status for r in reports[0].results].count("tuned") >= 1
    merged = tmp_path / "merged.db"
    for db in dbs:
        if db.exists():
            assert cli(["db", "merge", str(db), "--db", str(merged)]) == 0
    rows = _rows(merged)
    assert sorted((r.n, r.k, r.m_bucket) for r in rows) == sorted((n, k, m) for n, k in SHAPES for m in MS)
    # no job tuned twice: host 0's rows and host 1's (before its kill) are disjoint
    per_host = [{(r.n, r.k, r.m_bucket) for r in _rows(db)} if db.exists() else set() for db in dbs]
    assert not (per_host[0] & per_host[1])


def test_the_misses_of_a_workload_on_two_processes(tmp_path, capsys):
    from autofp4 import dispatch
    from autofp4.dispatch import Dispatcher

    db = tmp_path / "t.db"
    dispatch.set_db(db)
    try:
        d = Dispatcher(torch.device("cpu"), [], misses_file=dispatch.misses_path())
        for n, k in SHAPES:
            d.resolve(ProblemKey("linear", "nvfp4", "bfloat16", n, k), 3)
        d.flush_misses()
        rc = cli(["tune", "--from-misses", "--db", str(db), "--devices", "cpu,cpu", "--no-progress"])
    finally:
        dispatch.set_db(None)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "3 tuned" in out and "on cpu, cpu" in out
    assert sorted((r.n, r.k, r.m_bucket) for r in _rows(db)) == sorted((n, k, 4) for n, k in SHAPES)
