"""Just-in-time tuning (autofp4.autotune): the real tuner in its real worker process, real SQLite
files, real subprocesses; on the CPU the reference backend, on a GPU the Hopper kernels."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import autofp4
from autofp4 import backends as registry
from autofp4 import dispatch
from autofp4.backends.reference import ReferenceBackend
from autofp4.db import TuningDB
from autofp4.env import current_environment
from autofp4.problem import ProblemKey
from autofp4.schema import config_json
from autofp4.tuning import jit

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
KEY = ProblemKey("linear", "nvfp4", "bfloat16", 256, 128)


@pytest.fixture(autouse=True)
def _own_db(tmp_path, monkeypatch):
    """A fresh user DB and no shipped rows (the H200's shipped rows would make the GPU tests'
    problems tuned hits)."""
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "no-shipped"))
    dispatch.set_db(tmp_path / "jit.db")
    yield tmp_path / "jit.db"
    dispatch.set_db(None)


class AlwaysWrongBackend(ReferenceBackend):
    """Every config negates output columns 0..31: each candidate fails the correctness check."""

    name = "test_always_wrong"

    def config_space(self, key):
        return {"chunk_n": [0, 64]}

    def compile(self, config, key):
        inner = super().compile(config, key)

        def wrong(x, w, bias):
            out = inner(x, w, bias)
            out[:, :32] = -out[:, :32]
            return out
        return wrong


class SlowCompileBackend(ReferenceBackend):
    """The reference, slow as a cold GPU host: building its configs takes 1 s and each compile
    1.5 s."""

    name = "test_slow_compile"

    def config_space(self, key):
        time.sleep(1.0)
        return {"chunk_n": [0, 64]}

    def compile(self, config, key):
        time.sleep(1.5)
        return super().compile(config, key)


class EPLogBackend(ReferenceBackend):
    """The reference; each MoE call appends its expert map's length (0: none) to the file named
    by ``$AUTOFP4_TEST_EP_LOG``, in whichever process runs it (the worker's trials too)."""

    name = "test_ep_log"

    def compile(self, config, key):
        inner = super().compile(config, key)

        def run(x, w13, w2, tw, ti, act, expert_map=None, **kw):
            with open(os.environ["AUTOFP4_TEST_EP_LOG"], "a") as f:
                f.write(f"{0 if expert_map is None else expert_map.numel()}\n")
            return inner(x, w13, w2, tw, ti, act, expert_map, **kw)
        return run


def _weight(n, k, seed=0):
    return autofp4.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), "nvfp4")


def _act(m, k, seed=1, device=CPU):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)


def _rel_err(y, x, w):
    ref = x.double() @ w.dequantize(torch.float32).double().T
    return float((y.double() - ref).norm() / ref.norm())


def _rows(path, env_key=None):
    with TuningDB(path) as db:
        return db.results(env_key or current_environment(CPU).key())


def _fast_entry(w, x):
    return w.__dict__["_linear_fast"][(x.dtype, x.device, x.shape[0])]


def test_blocking_first_call_stores_a_row_and_the_second_call_is_a_tuned_hit(_own_db):
    w, x = _weight(KEY.n, KEY.k), _act(3, KEY.k)
    with autofp4.autotune(mode="blocking"):
        y = autofp4.linear(x, w)
        (row,) = _rows(_own_db)
        assert (row.problem_key(), row.m_bucket, row.origin, row.backend) == (KEY, 4, "jit", "reference")
        d = dispatch.get_dispatcher(CPU)
        assert d.tuned(KEY) and d.misses() == [(KEY, 4, 1)]
        y2 = autofp4.linear(x, w)
        assert _fast_entry(w, x)[4] is None  # a tuned hit: no miss to count
        assert dispatch.get_dispatcher(CPU).misses() == [(KEY, 4, 1)]
        (rep,) = autofp4.autotune.jobs()  # the job's report: what it picked and what it took
        assert (rep["n"], rep["k"], rep["m"], rep["status"], rep["backend"]) == (KEY.n, KEY.k, 4, "tuned", "reference")
        assert rep["config"] == row.config and rep["median_us"] == pytest.approx(row.median_us)
        assert rep["trials_run"] >= 1 and 0 < rep["wall_s"] < 120
    assert autofp4.autotune.jobs() == [rep]  # after the block: the jobs it finished
    with autofp4.autotune(mode="blocking", ops=()):
        assert autofp4.autotune.jobs() == []  # a new block: none finished yet
    assert autofp4.autotune.jobs() == []
    assert _rel_err(y, x, w) < 1e-2 and torch.equal(y, y2)
    with TuningDB(_own_db) as db:
        trials = db.trials(current_environment(CPU).key())
    assert trials and all(t.m_bucket == 4 for t in trials)


def test_the_worker_can_be_started_before_the_first_call_and_serves_it(_own_db):
    """``autotune.start()`` spawns the device's worker at once (no job yet); the first call that
    misses is tuned by that same process, not by a second one; it refuses to run with no
    autotuning on, names a device this machine lacks, and does nothing when no op is tuned."""
    from autofp4.tuning import jit

    with pytest.raises(RuntimeError, match="no autotuning is on"):
        autofp4.autotune.start()
    w, x = _weight(KEY.n, KEY.k, seed=3), _act(2, KEY.k)
    with autofp4.autotune(mode="blocking"):
        assert autofp4.autotune.start("cpu") and autofp4.autotune.start()  # a second start: the same worker
        (worker,) = jit.active().workers.values()
        pid = worker.pid
        assert pid is not None and worker.proc.poll() is None and not worker.pending
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match=r"autotune.start\(\): device 'cuda': no CUDA GPU is available"):
                autofp4.autotune.start("cuda")
        with pytest.raises(ValueError, match="is not a device"):
            autofp4.autotune.start("gpu7")
        y = autofp4.linear(x, w)
        assert list(jit.active().workers.values()) == [worker] and worker.pid == pid
        (rep,) = autofp4.autotune.jobs()
        assert rep["status"] == "tuned" and rep["m"] == 2
    assert _rel_err(y, x, w) < 1e-2
    with autofp4.autotune(mode="blocking", ops=()):
        assert not autofp4.autotune.start() and not jit.active().workers


def test_background_call_returns_at_once_and_the_row_is_used_without_restart(_own_db):
    w, x = _weight(KEY.n, KEY.k), _act(5, KEY.k)
    with autofp4.autotune(mode="background"):
        t0 = time.perf_counter()
        y = autofp4.linear(x, w)
        first_s = time.perf_counter() - t0
        assert not _rows(_own_db)  # the worker process is still starting
        deadline = time.monotonic() + 120
        while _fast_entry(w, x)[4] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            autofp4.linear(x, w)  # a miss looks for new rows (at most every RELOAD_S)
        assert _fast_entry(w, x)[4] is None, "the tuned row was not picked up"
        assert autofp4.autotune.wait(60) and autofp4.autotune.pending() == 0
    (row,) = _rows(_own_db)
    assert (row.m_bucket, row.origin) == (8, "jit")
    assert first_s < 1.0, f"the first call took {first_s:.2f} s"
    assert _rel_err(y, x, w) < 1e-2


def test_a_worker_that_cannot_open_its_db_says_why_once_and_is_not_started_again(tmp_path):
    """The user DB's path lies under a regular file: the worker cannot open it, tells its parent
    why and exits; the parent warns once (naming the cause), does not start it again, and every
    call runs untuned with correct results, in far less time than restarts would take."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    dispatch.set_db(blocker / "t.db")
    w = _weight(KEY.n, KEY.k)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with autofp4.autotune(mode="blocking", budget_s=1.0):
            ys = [(x, autofp4.linear(x, w)) for x in (_act(m, KEY.k, seed=m) for m in (1, 2, 4, 8, 16))]
            assert not autofp4.autotune.wait(30)  # the jobs were dropped, not tuned
            (worker,) = jit.active().workers.values()
            assert worker.restarts == 0 and worker.fatal is not None
    took = time.perf_counter() - t0
    fatal = [str(m.message) for m in seen if "just-in-time tuning is off" in str(m.message)]
    assert len(fatal) == 1 and "a-file" in fatal[0], [str(m.message) for m in seen]
    assert took < 30, took
    for x, y in ys:
        assert _rel_err(y, x, w) < 1e-2


def test_a_job_whose_candidates_all_fail_stores_the_failures_and_the_default_keeps_running(monkeypatch, _own_db):
    monkeypatch.setitem(registry._REGISTRY, AlwaysWrongBackend.name,
                        f"{AlwaysWrongBackend.__module__}:{AlwaysWrongBackend.__qualname__}")
    monkeypatch.setitem(registry._INSTANCES, AlwaysWrongBackend.name, AlwaysWrongBackend())
    w, x = _weight(KEY.n, KEY.k), _act(2, KEY.k)
    env_key = current_environment(CPU).key()
    with autofp4.autotune(mode="blocking", backends=[AlwaysWrongBackend.name]):
        y = autofp4.linear(x, w)  # tuned (every candidate wrong), then the default ran
        y2 = autofp4.linear(x, w)
    with TuningDB(_own_db) as db:
        trials = db.trials(env_key)
        assert db.results(env_key) == []
    assert {t.outcome for t in trials} == {"wrong_result"} and len(trials) == 2
    assert _rel_err(y, x, w) < 1e-2 and torch.equal(y, y2)
    assert dispatch.get_dispatcher(CPU).misses() == [(KEY, 2, 2)]  # the default: a miss each call
    with autofp4.autotune(mode="blocking", backends=[AlwaysWrongBackend.name]):
        autofp4.linear(x, w)  # a new autotune block meets the job again: the failures are not run again
    with TuningDB(_own_db) as db:
        assert len(db.trials(env_key)) == 2


def test_a_first_compile_longer_than_the_budget_still_stores_a_measured_row(monkeypatch, _own_db):
    """A job's time cannot end before it has measured a config: a budget shorter than one cold
    compile (in a compile process, as on the GPU) still stores a row (the default's, measured),
    and the second call is a tuned hit."""
    monkeypatch.setitem(registry._REGISTRY, SlowCompileBackend.name,
                        f"{SlowCompileBackend.__module__}:{SlowCompileBackend.__qualname__}")
    monkeypatch.setitem(registry._INSTANCES, SlowCompileBackend.name, SlowCompileBackend())
    w, x = _weight(KEY.n, KEY.k), _act(2, KEY.k)
    with autofp4.autotune(mode="blocking", budget_s=0.2, backends=[SlowCompileBackend.name], workers=1):
        y = autofp4.linear(x, w)
        autofp4.linear(x, w)
        assert _fast_entry(w, x)[4] is None
    (row,) = _rows(_own_db)
    assert (row.backend, row.m_bucket, row.origin) == (SlowCompileBackend.name, 2, "jit")
    assert row.median_us > 0 and _rel_err(y, x, w) < 1e-2


def test_killing_the_worker_loses_no_row_and_leaves_the_db_intact(_own_db):
    shapes = [(256, 128), (128, 256), (384, 128)]
    ms = (1, 2, 4, 8, 16, 32, 64, 128)
    ws = [_weight(n, k, seed=i) for i, (n, k) in enumerate(shapes)]
    with autofp4.autotune(mode="background", duty=1.0):
        for m in ms:
            for w in ws:
                autofp4.linear(_act(m, w.k), w)
        assert autofp4.autotune.pending() == len(shapes) * len(ms)
        worker = next(iter(jit.active().workers.values()))
        deadline = time.monotonic() + 120
        while len(_rows(_own_db)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait()
        before = {(r.problem_key(), r.m_bucket): r.model_dump() for r in _rows(_own_db)}
        assert 3 <= len(before) < len(shapes) * len(ms)
        conn = sqlite3.connect(_own_db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
        assert autofp4.autotune.wait(180)  # a new worker finishes the rest
        assert worker.restarts == 1
    after = {(r.problem_key(), r.m_bucket): r.model_dump() for r in _rows(_own_db)}
    assert {k: after[k] for k in before} == before  # every row stored before the kill is there
    assert len(after) == len(shapes) * len(ms)


_FORKS = textwrap.dedent("""
    import json, multiprocessing as mp
    import torch, autofp4
    from autofp4 import dispatch
    from autofp4.tuning import jit

    def call(n, k, m):
        w = autofp4.quantize(torch.randn(n, k), "nvfp4")
        x = torch.randn(m, k).to(torch.bfloat16)
        autofp4.linear(x, w)
        ok = autofp4.autotune.wait(120)
        autofp4.linear(x, w)
        (worker,) = jit.active().workers.values()
        return {"ok": ok, "tuned": w._linear_fast[(x.dtype, x.device, m)][4] is None, "worker": worker.pid,
                "restarts": worker.restarts, "jobs": len(worker.status)}

    def child(conn):
        conn.send(call(128, 256, 2))

    parent = call(256, 128, 1)
    here, there = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=child, args=(there,))
    p.start()
    print(json.dumps({"parent": parent, "child": here.recv() if here.poll(180) else None}))
    p.join(30)
""")


def test_a_forked_child_tunes_with_a_worker_of_its_own(tmp_path, _own_db):
    """A server that forks its workers after autotuning is on (AUTOFP4_AUTOTUNE read at import):
    each child gets its own worker and DB connection and uses the rows it tunes. (One CPU thread:
    the CPU ops of a forked child can hang where its parent has run parallel ones.)"""
    script = tmp_path / "forks.py"
    script.write_text(_FORKS)
    env = {**os.environ, "AUTOFP4_AUTOTUNE": "background", "AUTOFP4_AUTOTUNE_DUTY": "1", "OMP_NUM_THREADS": "1",
           "AUTOFP4_DB": str(_own_db), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["child"] is not None, "the forked child did not answer"
    assert got["parent"]["ok"] and got["parent"]["tuned"] and got["child"]["ok"] and got["child"]["tuned"]
    assert got["child"]["worker"] not in (None, got["parent"]["worker"])
    assert got["child"]["restarts"] == 0 and got["child"]["jobs"] == 1  # a new worker, not the parent's
    assert {(r.n, r.m_bucket) for r in _rows(_own_db)} == {(256, 1), (128, 2)}


_PEER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch, autofp4
    from autofp4 import dispatch
    n, k, m, sync = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    w = autofp4.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), "nvfp4")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    warm = autofp4.quantize(torch.randn(64, 64), "nvfp4")
    autofp4.linear(torch.randn(1, 64).to(torch.bfloat16), warm)  # the worker is up after this job
    (sync / str(os.getpid())).touch()
    while len(list(sync.iterdir())) < 2:  # both peers ready: they meet the shape at one moment
        time.sleep(0.002)
    autofp4.linear(x, w)
    assert autofp4.autotune.wait(300)
    autofp4.linear(x, w)
    key = next(iter(w._problem_keys.values()))
    b, cfg = dispatch.get_dispatcher("cpu").pick(key, m)
    print(json.dumps({"backend": b.name, "config": b.config_dict(cfg), "tuned": bool(dispatch.get_dispatcher("cpu").tuned(key))}))
""")


def test_two_processes_meeting_one_shape_tune_it_once(tmp_path, _own_db):
    """Two processes, autotuning on through the environment (code that is not edited), call the
    same untuned shape at the same moment: the job is measured once, both end with its row."""
    n, k, m = 2048, 1024, 4
    script = tmp_path / "peer.py"
    script.write_text(_PEER)
    env = {**os.environ, "AUTOFP4_AUTOTUNE": "blocking", "AUTOFP4_DB": str(_own_db),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    sync = tmp_path / "ready"
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(n), str(k), str(m), str(sync)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    picks = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    (row,) = [r for r in _rows(_own_db) if r.n == n]
    assert all(p == {"backend": row.backend, "config": row.config, "tuned": True} for p in picks), picks
    with TuningDB(_own_db) as db:
        trials = db.trials(current_environment(CPU).key(), n=n, m_bucket=4)
    configs = [config_json(t.config) for t in trials]
    assert configs and len(configs) == len(set(configs)), configs  # no config measured twice


def test_the_worker_tells_each_job_the_ones_expected_next(_own_db):
    """A blocking warm-up sends one job at a time, in layer order at every M: from the second M
    on, each job is told the problem that followed it last time (at its own M), and every job
    its own problem at the next M bucket, so that their defaults compile while this job is
    measured; a queued job is told first."""
    import queue
    import threading

    from autofp4.tuning.online import OnlineTuner
    from autofp4.tuning.worker import serve

    seen, gate = [], threading.Event()

    class Recording(OnlineTuner):
        def tune(self, job, then=None):
            gate.wait(30)
            seen.append((job.key.n, job.m, [(t.key.n, t.m) for t in then]))
            return super().tune(job, then)

    class Out:  # the status lines, as the parent reads them
        def __init__(self):
            self.lines: queue.Queue = queue.Queue()

        def write(self, text):
            self.lines.put(json.loads(text))

        def flush(self):
            pass

    def send(i, n, m):
        key = ProblemKey("linear", "nvfp4", "bfloat16", n, 128)
        inbox.put(json.dumps({"id": i, "key": dataclasses.asdict(key), "m": m}) + "\n")

    def worker():  # the tuner's DB connection stays on the thread that opened it
        tuner = Recording(CPU, _own_db, workers=0)
        try:
            serve(tuner, inbox, out)
        finally:
            tuner.close()

    inbox, out = queue.Queue(), Out()
    th = threading.Thread(target=worker, daemon=True)
    th.start()
    try:
        gate.set()
        i = 0
        for m in (1, 2):  # a forward pass at M = 1, then at M = 2: one job at a time
            for n in (128, 256, 384):
                if i == 5:
                    gate.clear()  # the last one waits: two jobs queue up behind it
                send(i, n, m)
                if i < 5:
                    assert out.lines.get(timeout=60)["status"] == "tuned"
                i += 1
        send(10, 128, 4)
        send(11, 384, 4)  # queued behind 10: its next, not the guess (256)
        time.sleep(0.3)
        gate.set()
        assert [out.lines.get(timeout=60)["status"] for _ in range(3)] == ["tuned"] * 3
    finally:
        inbox.put(None)
        th.join(60)
    assert seen[:5] == [(128, 1, [(128, 2)]), (256, 1, [(256, 2)]), (384, 1, [(384, 2)]),
                        (128, 2, [(256, 2), (128, 4)]), (256, 2, [(384, 2), (256, 4)])]
    # the guess, or job 10 if it was queued by then
    assert seen[5] in ((384, 2, [(128, 2), (384, 4)]), (384, 2, [(128, 4), (384, 4)]))
    assert seen[6:] == [(128, 4, [(384, 4), (128, 8)]), (384, 4, [(128, 4), (384, 8)])]
    assert len(_rows(_own_db)) == 8


def test_settings_are_checked(monkeypatch):
    for bad in (dict(mode="eager"), dict(duty=0.0), dict(duty=1.5), dict(budget_s=0), dict(ops=("conv",))):
        with pytest.raises(ValueError):
            autofp4.autotune(**bad)
    monkeypatch.setenv("AUTOFP4_AUTOTUNE", "sometimes")
    with pytest.warns(RuntimeWarning, match="ignored"):
        jit.from_env()
    assert jit.active() is None
    assert autofp4.autotune.wait() is True  # nothing on: nothing to wait for


def test_no_ops_only_picks_up_rows_others_store(_own_db):
    """``ops=()`` tunes nothing; a row another process (here: a tuning run) stores is used."""
    w, x = _weight(KEY.n, KEY.k), _act(3, KEY.k)
    with autofp4.autotune(mode="background", ops=()):
        autofp4.linear(x, w)
        assert not jit.active().workers
        autofp4.tune([KEY], m_buckets=[4], db=_own_db, device="cpu", progress=False)
        deadline = time.monotonic() + 10
        while _fast_entry(w, x)[4] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            autofp4.linear(x, w)
        assert _fast_entry(w, x)[4] is None
    (row,) = _rows(_own_db)
    assert row.origin == "offline"


# -----------------------------------------------------------------------------------------
# on the GPU
# -----------------------------------------------------------------------------------------
def _sm90_or_skip():
    dev = torch.device("cuda")
    b = registry.get_backend("sm90_w4a16")
    why = b.unavailable_reason(dev)
    if why:
        pytest.skip(f"sm90_w4a16 does not run here: {why}")
    return dev


@pytest.mark.gpu
def test_gpu_blocking_tunes_the_hopper_kernel_on_the_first_call(_own_db):
    dev = _sm90_or_skip()
    w = _weight(4096, 4096).to(dev)
    x = _act(16, 4096, device=dev)
    with autofp4.autotune(mode="blocking", budget_s=5.0):
        y = autofp4.linear(x, w)  # waits for its job, then runs the winner
        misses = dispatch.get_dispatcher(dev).misses()
        autofp4.linear(x, w)
        assert _fast_entry(w, x)[4] is None  # the second call is a tuned hit
        assert dispatch.get_dispatcher(dev).misses() == misses
    rows = _rows(_own_db, current_environment(dev).key())
    assert [(r.backend, r.m_bucket, r.origin) for r in rows] == [("sm90_w4a16", 16, "jit")]
    assert _rel_err(y, x, w) < 1e-2


@pytest.mark.gpu
def test_gpu_a_graph_captured_after_wait_runs_the_winners(_own_db):
    """Background mode: the warm-up queues the misses, wait() tunes them and picks up the rows,
    and a CUDA graph captured then replays the tuned kernels."""
    dev = _sm90_or_skip()
    w = _weight(4096, 4096).to(dev)
    x = _act(8, 4096, device=dev)
    with autofp4.autotune(mode="background", budget_s=3.0):
        autofp4.linear(x, w)  # warm-up: its job is queued, the default runs
        assert autofp4.autotune.wait(600) and autofp4.autotune.pending() == 0
        autofp4.linear(x, w)  # eager once more: the winner is loaded and its weight layout packed
        key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
        tuned_runner = dispatch.get_dispatcher(dev).resolve(key, 8)[2]
        assert _fast_entry(w, x)[4] is None and _fast_entry(w, x)[1] is tuned_runner
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = autofp4.linear(x, w)
        g.replay()
        torch.cuda.synchronize()
    assert _rel_err(y, x, w) < 1e-2
    rows = _rows(_own_db, current_environment(dev).key())
    assert [(r.n, r.m_bucket, r.origin) for r in rows] == [(4096, 8, "jit")]


@pytest.mark.gpu
def test_gpu_a_miss_under_capture_is_queued_not_tuned(_own_db):
    """Blocking mode tunes eager calls on the spot, but a call met first under CUDA graph capture
    runs (and the graph keeps) its current pick; its job waits for wait() (or the block's end)."""
    dev = _sm90_or_skip()
    w, w2 = _weight(4096, 4096).to(dev), _weight(1024, 4096, seed=2).to(dev)
    x = _act(8, 4096, device=dev)
    autofp4.linear(x, w)
    autofp4.linear(x, w2)  # without autotuning: the defaults compiled and packed, two misses
    with autofp4.autotune(mode="blocking", budget_s=3.0):
        autofp4.linear(x, w)  # tuned on the spot
        autofp4.linear(x, w)
        assert _fast_entry(w, x)[4] is None
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(g):
            y = autofp4.linear(x, w)
            y2 = autofp4.linear(x, w2)  # a miss under capture: queued, the default captured
        capture_s = time.perf_counter() - t0
        assert autofp4.autotune.pending() == 1
        g.replay()
        torch.cuda.synchronize()
        assert _rel_err(y, x, w) < 1e-2 and _rel_err(y2, x, w2) < 1e-2
        assert autofp4.autotune.wait(600) and autofp4.autotune.pending() == 0
        g.replay()  # the graph keeps the kernels it captured
        torch.cuda.synchronize()
        assert _rel_err(y2, x, w2) < 1e-2
        autofp4.linear(x, w2)
        autofp4.linear(x, w2)
        assert _fast_entry(w2, x)[4] is None  # eager calls run the row tuned after the capture
    assert capture_s < 2.0, f"the capture took {capture_s:.1f} s: it waited for tuning"
    rows = _rows(_own_db, current_environment(dev).key())
    assert {(r.n, r.m_bucket, r.origin) for r in rows} == {(4096, 8, "jit"), (1024, 8, "jit")}


def test_blocking_tunes_an_expert_parallel_slice_as_a_slice(monkeypatch, tmp_path, _own_db):
    """A MoE call on one rank's slice (4 of 16 experts) meets no row: the worker's trials run the
    slice with an expert map over all 16 (the share of the pairs the slice gets), not as a
    4-expert layer that every pair reaches; the stored row then serves the call."""
    from moe_cases import ep_slice

    log = tmp_path / "ep.log"
    monkeypatch.setenv("AUTOFP4_TEST_EP_LOG", str(log))
    monkeypatch.setitem(registry._REGISTRY, EPLogBackend.name, f"{EPLogBackend.__module__}:{EPLogBackend.__qualname__}")
    monkeypatch.setitem(registry._INSTANCES, EPLogBackend.name, EPLogBackend())
    e, eg = 4, 16
    x, w13, w2, tw, ti, emap = ep_slice("nvfp4", torch.Generator().manual_seed(3), e, eg, rank=2)
    with autofp4.autotune(mode="blocking", backends=[EPLogBackend.name], ops=("moe",)):
        y = autofp4.moe(x, w13, w2, tw, ti, expert_map=emap)
    (row,) = _rows(_own_db)
    assert (row.op, row.experts, row.m_bucket, row.backend) == ("moe", e, 8, EPLogBackend.name)
    sizes = [int(v) for v in log.read_text().split()]
    assert len(sizes) >= 3 and set(sizes) == {eg}, sizes  # trials and the tuned call: all as a slice
    ref = autofp4.moe(x, w13, w2, tw, ti, expert_map=emap)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("var,value,needle", [
    ("AUTOFP4_AUTOTUNE_WORKERS", "1.5", "AUTOFP4_AUTOTUNE_WORKERS='1.5' is not an integer from 0 to"),
    ("AUTOFP4_AUTOTUNE_WORKERS", "-1", "AUTOFP4_AUTOTUNE_WORKERS='-1' is not an integer from 0 to"),
    ("AUTOFP4_AUTOTUNE_WORKERS", "100000", "AUTOFP4_AUTOTUNE_WORKERS='100000' is not an integer from 0 to"),
    ("AUTOFP4_AUTOTUNE_BUDGET_S", "abc", "AUTOFP4_AUTOTUNE_BUDGET_S='abc' is not a positive number of seconds"),
    ("AUTOFP4_AUTOTUNE_BUDGET_S", "nan", "AUTOFP4_AUTOTUNE_BUDGET_S='nan' is not a positive number"),
    ("AUTOFP4_AUTOTUNE_DUTY", "50%", "AUTOFP4_AUTOTUNE_DUTY='50%' is not a number in [0.01, 1]"),
    ("AUTOFP4_AUTOTUNE_DUTY", "2", "AUTOFP4_AUTOTUNE_DUTY='2' is not a number in [0.01, 1]"),
    ("AUTOFP4_AUTOTUNE_DUTY", "1e-9", "AUTOFP4_AUTOTUNE_DUTY='1e-9' is not a number in [0.01, 1]"),
    ("AUTOFP4_AUTOTUNE_OPS", "linear,conv", "AUTOFP4_AUTOTUNE_OPS='linear,conv' is not a comma-separated subset"),
])
def test_a_bad_autotune_knob_is_named_in_the_warning(monkeypatch, var, value, needle):
    """The warning names the variable at fault and its value (not only AUTOFP4_AUTOTUNE's)."""
    monkeypatch.setenv("AUTOFP4_AUTOTUNE", "blocking")
    monkeypatch.setenv(var, value)
    with pytest.warns(RuntimeWarning) as rec:
        jit.from_env()
    msgs = [str(w.message) for w in rec]
    assert any(needle in m and "AUTOFP4_AUTOTUNE='blocking' ignored" in m for m in msgs), msgs
    assert not any("invalid literal" in m or "could not convert" in m for m in msgs), msgs
    assert jit.active() is None


def test_a_worker_that_cannot_be_spawned_warns_once_and_calls_run_untuned(monkeypatch):
    """Popen itself failing (the interpreter cannot be executed: PermissionError) is a worker that
    cannot start: one warning naming why, the calls run their defaults, nothing raises."""
    from autofp4.tuning import worker

    spawned = []

    def refuse(*a, **kw):
        spawned.append(a)
        raise PermissionError(13, "Permission denied", sys.executable)

    monkeypatch.setattr(worker.subprocess, "Popen", refuse)
    w1, w2 = _weight(KEY.n, KEY.k), _weight(384, 128)
    x = _act(3, KEY.k)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with autofp4.autotune(mode="blocking"):
            y = autofp4.linear(x, w1)
            autofp4.linear(_act(40, KEY.k), w1)
            autofp4.linear(x, w2)
            assert autofp4.autotune.wait(5) is False  # its worker cannot start
    assert _rel_err(y, x, w1) < 0.05
    msgs = [str(w.message) for w in rec if "just-in-time tuning is off" in str(w.message)]
    assert len(msgs) == 1 and "PermissionError" in msgs[0] and "cannot start" in msgs[0], msgs
    assert len(spawned) == 1


# -- the twenty-first adversarial set ----------------------------------------------------------------
def test_a_worker_holds_none_of_its_callers_descriptors_and_stops_resting_when_told(monkeypatch):
    """The worker's standard error is a pipe its parent copies (a caller capturing the parent's
    output gets its end of file when the parent exits, not when a worker still finishing a job
    does), and setting the paced measurer's ``wake`` (the parent has gone) ends its rests."""
    from autofp4.tuning import measurer

    if not Path("/proc/self/fd/2").exists():
        pytest.skip("no /proc here")
    code = ("import os, autofp4\n"
            "with autofp4.autotune(mode='background'):\n"
            "    autofp4.autotune.start('cpu')\n"
            "    w = next(iter(autofp4.tuning.jit.active().workers.values()))\n"
            "    print(os.readlink(f'/proc/{w.proc.pid}/fd/2') == os.readlink('/proc/self/fd/2'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)

    def one_trial(self, req):
        time.sleep(0.05)
        return {"ok": True}

    monkeypatch.setattr(measurer._Measurer, "run", one_trial)
    m = measurer._PacedMeasurer(torch.device("cpu"), False, 10.0, duty=0.01)  # rests 99x each trial
    threading.Timer(0.3, m.wake.set).start()
    t0 = time.perf_counter()
    assert m.run({}) == {"ok": True} and m.run({}) == {"ok": True}
    assert time.perf_counter() - t0 < 2.0  # not 2 x 5 s
    with pytest.raises(ValueError, match=r"duty must be in \[0.01, 1\]"):
        measurer._PacedMeasurer(torch.device("cpu"), False, 10.0, duty=1e-9)



def test_one_autotune_object_entered_twice_nested_leaves_nothing_on(tmp_path):
    """Each block an autotune object is entered in ends its own scope: after both nested blocks
    a call is untuned again (nothing measured, nothing stored)."""
    from autofp4.tuning import jit

    dispatch.set_db(tmp_path / "t.db")
    try:
        a = autofp4.autotune(mode="blocking")
        with a:
            with a:
                assert len(jit._STACK) == 2
            assert len(jit._STACK) == 1
        assert jit.active() is None and jit._STACK == []
        w = autofp4.quantize(torch.randn(128, 64).bfloat16(), "nvfp4")
        autofp4.linear(torch.randn(4, 64).bfloat16(), w)
        assert not (tmp_path / "t.db").exists() or TuningDB(tmp_path / "t.db").results(
            current_environment(torch.device("cpu")).key()) == []
    finally:
        dispatch.set_db(None)


def test_autotune_wait_names_a_timeout_of_the_wrong_type():
    for scope in (False, True):
        ctx = autofp4.autotune(mode="background") if scope else None
        if ctx:
            ctx.__enter__()
        try:
            with pytest.raises(TypeError, match=r"autotune.wait\(timeout\): timeout must be a number of seconds or "
                                                r"None, got str '5'"):
                autofp4.autotune.wait(timeout="5")
            with pytest.raises(ValueError, match="must be >= 0 seconds"):
                autofp4.autotune.wait(timeout=-1)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
