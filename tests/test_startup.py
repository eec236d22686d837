"""What a process reads of the tuning DB before its first call: the dispatcher reads the rows of
the running environment and of the problems it is asked about, each problem once, by an index;
the shipped exports once per process. Real DB files, real exports, no mocks."""
from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import warnings

import pytest
import torch

from autofp4 import dispatch
from autofp4.backends import get_backend
from autofp4.backends.reference import ReferenceConfig
from autofp4.db import EXTRA_INDEXES, TuningDB, load_layers
from autofp4.dispatch import DEFAULT_M_BUCKETS, Dispatcher, backend_source_hash
from autofp4.env import current_environment
from autofp4.problem import ProblemKey
from autofp4.schema import Environment, TuningRecord

CPU = torch.device("cpu")
OTHER_ENV = Environment(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0", driver="570.124.06",
                        cuda="12.8", torch="2.13.0", cutlass_dsl="4.8.1", autofp4="0.1.0")


@pytest.fixture(autouse=True)
def _fresh_dispatchers(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "shipped"))
    dispatch.set_db(None)
    yield
    dispatch.set_db(None)


def _rng() -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return random.Random(seed)


def _rec(key: ProblemKey, m: int, chunk_n: int, env: Environment | None = None, median: float = 10.0) -> TuningRecord:
    return TuningRecord(
        op=key.op, fmt=key.fmt, dtype=key.dtype, backend="reference", m_bucket=m, n=key.n, k=key.k,
        experts=key.experts, topk=key.topk, config={"chunk_n": chunk_n}, median_us=median, spread_us=0.5,
        samples=10, default_median_us=12.0,
        backend_source=backend_source_hash(get_backend("reference"), {"chunk_n": chunk_n}),
        env=env or current_environment(CPU),
    )


def _problems(rng: random.Random, count: int) -> list[ProblemKey]:
    out: set[ProblemKey] = set()
    while len(out) < count:
        if rng.random() < 0.2:
            e = rng.choice([4, 8, 16])
            out.add(ProblemKey("moe", rng.choice(["nvfp4", "mxfp4"]), rng.choice(["bfloat16", "float16"]),
                               64 * rng.randint(20, 80), 64 * rng.randint(2, 64), e, rng.randint(1, e)))
        else:
            out.add(ProblemKey("linear", rng.choice(["nvfp4", "mxfp4"]), rng.choice(["bfloat16", "float16"]),
                               64 * rng.randint(20, 200), 64 * rng.randint(2, 64)))
    return sorted(out, key=str)


def _random_rows(rng: random.Random, keys, env=None) -> list[TuningRecord]:
    return [_rec(k, m, rng.choice([0, 256, 512]), env, median=rng.uniform(1.0, 100.0))
            for k in keys for m in rng.sample(DEFAULT_M_BUCKETS, rng.randint(1, 5))]


def _expected(rows, key) -> dict:
    ref = get_backend("reference")
    return {r.m_bucket: (ref, ReferenceConfig(chunk_n=r.config["chunk_n"])) for r in rows if r.problem_key() == key}


def test_the_dispatcher_reads_only_the_problems_it_is_asked_about(tmp_path):
    """Rows of other problems and other environments are never read: invalid ones there (which
    would warn when read) stay silent, and only the asked problems' rows are in memory."""
    rng = _rng()
    keys = _problems(rng, 40)
    asked, others = keys[:8], keys[8:]
    rows = _random_rows(rng, keys)
    path = tmp_path / "user.db"
    with TuningDB(path) as db:
        db.upsert_results(rows)
        db.upsert_results(_random_rows(rng, keys, OTHER_ENV))
    env_key = current_environment(CPU).key()
    with sqlite3.connect(path) as conn:  # rows that warn when read: of other problems, other environments
        for k in others:  # the whole problem key: an asked problem may share n and k
            conn.execute("UPDATE results SET config = '{\"chunk_n\": 7}' WHERE op = ? AND fmt = ? AND dtype = ? "
                         "AND n = ? AND k = ? AND experts = ? AND topk = ? AND env_key = ?",
                         (k.op, k.fmt, k.dtype, k.n, k.k, k.experts, k.topk, env_key))
        conn.execute("UPDATE environments SET env = 'not json' WHERE env_key = ?", (OTHER_ENV.key(),))
    dispatch.set_db(path)
    d = dispatch.get_dispatcher("cpu")
    assert len(d) == 0  # nothing read before the first question
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for key in rng.sample(asked, len(asked)):
            assert d.tuned(key) == _expected(rows, key)
            for m in rng.sample(range(1, 9000), 5):
                assert d.resolve(key, m) == d.resolve(key, m)
    assert len(d) == sum(len(_expected(rows, k)) for k in asked)
    assert d.other_env_rows == 0 and d.stale_rows == 0 and d.ignored == []
    # asking about a problem of invalid rows reads (and reports) exactly those
    with pytest.warns(Warning, match="chunk_n"):
        assert d.tuned(others[0]) == {}


def test_the_lazy_dispatcher_picks_what_the_eager_one_picks(tmp_path):
    """Per problem from the user DB and the shipped exports (the user DB first) the same rows
    and picks as loading every row of the environment at once."""
    rng = _rng()
    keys = _problems(rng, 30)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in ("a.json", "b.json"):
        with TuningDB(tmp_path / f"{name}.db") as s:
            s.upsert_results(_random_rows(rng, rng.sample(keys, 15)))
            s.upsert_results(_random_rows(rng, rng.sample(keys, 5), OTHER_ENV))
            s.export(shipped / name)
    user = tmp_path / "user.db"
    with TuningDB(user) as db:
        db.upsert_results(_random_rows(rng, rng.sample(keys, 15)))
    env = current_environment(CPU)
    every = load_layers(env, user_path=user)
    eager = Dispatcher(CPU, every, env=env)
    dispatch.set_db(user)
    lazy = dispatch.get_dispatcher("cpu")
    untuned = ProblemKey("linear", "nvfp4", "bfloat16", 64 * 333, 64)
    for key in rng.sample(keys, len(keys)) + [untuned]:
        part = load_layers(env, user_path=user, problem=key)
        assert [r.model_dump() for r in part] == [r.model_dump() for r in every if r.problem_key() == key]
        for m in rng.sample(range(1, 9000), 6) + [1, 8192]:
            assert lazy.pick(key, m) == eager.pick(key, m), (key, m)
    assert len(lazy) == len(eager)


def test_a_problem_is_read_once_even_from_several_threads(tmp_path):
    rng = _rng()
    keys = _problems(rng, 4)
    rows = _random_rows(rng, keys)
    path = tmp_path / "user.db"
    with TuningDB(path) as db:
        db.upsert_results(rows)
    dispatch.set_db(path)
    d = dispatch.get_dispatcher("cpu")
    start = threading.Barrier(4)
    got = []

    def ask(key):
        start.wait(30)
        got.append((key, d.tuned(key)))

    threads = [threading.Thread(target=ask, args=(keys[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(v == _expected(rows, k) for k, v in got) and len(got) == 4
    with TuningDB(path) as db:  # rows stored later are not read again for a problem already read
        db.upsert_result(_rec(keys[0], 3, 0, median=0.5))
    assert d.tuned(keys[0]) == _expected(rows, keys[0])
    assert len(d) == sum(len(_expected(rows, k)) for k in keys[:2])


def test_the_problem_index_serves_the_dispatchers_query(tmp_path):
    rng = _rng()
    path = tmp_path / "user.db"
    keys = _problems(rng, 5)
    with TuningDB(path) as db:
        db.upsert_results(_random_rows(rng, keys))
        k = keys[0]
        for fmt in (k.fmt, ["nvfp4", "mxfp4"]):  # the dispatcher's query, the tuner's (every format)
            seen: list[str] = []
            db._conn.set_trace_callback(seen.append)
            db.results(current_environment(CPU).key(), op=k.op, fmt=fmt, dtype=k.dtype, n=k.n, k=k.k,
                       experts=k.experts, topk=k.topk, backend=["reference"])
            db._conn.set_trace_callback(None)
            (sql,) = [s for s in seen if s.startswith("SELECT * FROM results")]
            plan = [str(r[-1]) for r in db._conn.execute("EXPLAIN QUERY PLAN " + sql)]
            assert len(plan) == 1 and "USING INDEX results_problem" in plan[0], plan
            assert all(f"{c}=?" in plan[0] for c in ("env_key", "op", "fmt", "dtype", "n", "k", "experts", "topk")), plan
    # a file without the index (an older autofp4's) gets it when opened writable, not read-only
    with sqlite3.connect(path) as conn:
        conn.execute("DROP INDEX results_problem")
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()

    def indexes():
        with sqlite3.connect(path) as conn:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}

    TuningDB(path, readonly=True).close()
    assert "results_problem" not in indexes()
    TuningDB(path).close()
    assert set(EXTRA_INDEXES) <= indexes()
    with sqlite3.connect(path) as conn:  # an index only: the schema version stays
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == version


def test_shipped_exports_are_read_once_per_process(tmp_path):
    """A shipped export is parsed once per process; a changed file (size, time) is read again."""
    rng = _rng()
    keys = _problems(rng, 3)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    f = shipped / "a.json"
    with TuningDB(tmp_path / "s.db") as s:
        s.upsert_results([_rec(k, 16, 256) for k in keys])
        s.export(f)
    env = current_environment(CPU)
    assert {r.config["chunk_n"] for r in load_layers(env, problem=keys[0])} == {256}
    st = f.stat()
    doc = json.loads(f.read_text())
    for r in doc["records"]:
        r["config"]["chunk_n"] = 512  # same length: the file keeps its size
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert len(text) == st.st_size
    with open(f, "r+") as fh:  # rewritten in place, its time set back: looks unchanged
        fh.write(text)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert {r.config["chunk_n"] for r in load_layers(env, problem=keys[0])} == {256}
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert {r.config["chunk_n"] for r in load_layers(env, problem=keys[0])} == {512}
    assert load_layers(OTHER_ENV, problem=keys[0]) == []
