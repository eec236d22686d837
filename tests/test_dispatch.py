import dataclasses
import json
import os
from typing import Optional

import pytest
import torch

import autofp4
from autofp4 import backends as registry
from autofp4 import dispatch
from autofp4.problem import ProblemKey
from autofp4.backends.reference import ReferenceBackend, ReferenceConfig
from autofp4.db import TuningDB, load_layers
from autofp4.dispatch import DEFAULT_M_BUCKETS, Dispatcher, bucket_for, load_misses
from autofp4.env import current_environment
from autofp4.schema import Environment, TuningRecord

CPU = torch.device("cpu")
KEY = ProblemKey("linear", "nvfp4", "bfloat16", 512, 256)
KEY2 = ProblemKey("linear", "mxfp4", "float16", 256, 512)


@pytest.fixture(autouse=True)
def _fresh_dispatchers():
    dispatch.set_db(None)
    yield
    dispatch.set_db(None)


def _rec(key, m_bucket, chunk_n, backend="reference", env=None, median=10.0, source=None):
    """A row measured with ``source`` (default: the backend's current kernel source)."""
    if source is None:
        source = dispatch.backend_source_hash(registry.get_backend(backend), {"chunk_n": chunk_n})
    return TuningRecord(
        op=key.op, fmt=key.fmt, dtype=key.dtype, backend=backend, m_bucket=m_bucket, n=key.n, k=key.k,
        experts=key.experts, topk=key.topk, config={"chunk_n": chunk_n}, median_us=median,
        spread_us=0.5, samples=10, default_median_us=12.0, backend_source=source,
        env=env or current_environment(CPU),
    )


class CountingBackend(ReferenceBackend):
    name = "test_counting"
    compiles = 0

    def compile(self, config, key):
        type(self).compiles += 1
        return super().compile(config, key)


class OfflineBackend(ReferenceBackend):
    name = "test_offline"

    def applies_to(self, device):
        return False


def _register(monkeypatch, cls):
    monkeypatch.setitem(registry._REGISTRY, cls.name, f"{cls.__module__}:{cls.__qualname__}")
    inst = cls()
    monkeypatch.setitem(registry._INSTANCES, cls.name, inst)
    return inst


def test_bucket_for_edges():
    assert bucket_for(1) == 1
    assert bucket_for(3) == 4
    assert bucket_for(4) == 4
    assert bucket_for(5) == 8
    assert bucket_for(8192) == 8192
    assert bucket_for(8193) == 8192 and bucket_for(10**6) == 8192
    assert bucket_for(1, (16, 128)) == 16
    assert bucket_for(16, (16, 128)) == 16
    assert bucket_for(17, (16, 128)) == 128
    assert bucket_for(500, (16, 128)) == 128
    assert bucket_for(7, (7,)) == 7 and bucket_for(1, (7,)) == 7
    assert list(DEFAULT_M_BUCKETS) == sorted(DEFAULT_M_BUCKETS)
    with pytest.raises(ValueError):
        bucket_for(0)
    with pytest.raises(ValueError):
        bucket_for(5, ())


def test_pick_stored_rows_and_default():
    d = Dispatcher(CPU, [_rec(KEY, 16, 128), _rec(KEY, 128, 256)])
    assert len(d) == 2
    ref = registry.get_backend("reference")
    assert d.pick(KEY, 9) == (ref, ReferenceConfig(chunk_n=128))
    assert d.pick(KEY, 16) == (ref, ReferenceConfig(chunk_n=128))
    assert d.pick(KEY, 65) == (ref, ReferenceConfig(chunk_n=256))
    assert d.pick(KEY, 128) == (ref, ReferenceConfig(chunk_n=256))
    # M whose bucket was not tuned: the default for that M
    for m in (1, 8, 17, 64, 129, 100000):
        assert d.pick(KEY, m) == (ref, ref.default(KEY, m))
    # untuned key: the first available backend's default
    b, cfg = d.pick(KEY2, 3)
    assert b.name == "reference" and cfg == ref.default(KEY2, 3)


def test_fastest_row_wins_a_bucket(monkeypatch):
    _register(monkeypatch, CountingBackend)
    d = Dispatcher(CPU, [_rec(KEY, 16, 128, median=20.0), _rec(KEY, 16, 64, backend="test_counting", median=5.0)])
    b, cfg = d.pick(KEY, 16)
    assert b.name == "test_counting" and cfg == ReferenceConfig(chunk_n=64)


def test_rows_of_other_environments_are_ignored():
    here = current_environment(CPU)
    other = Environment(**{**here.model_dump(), "gpu_name": "Some Other GPU"})
    assert other.key() != here.key()
    d = Dispatcher(CPU, [_rec(KEY, 16, 128, env=other)])
    assert d.other_env_rows == 1 and len(d) == 0
    assert d.pick(KEY, 16)[1] == ReferenceConfig()


def test_rows_from_an_older_kernel_source_are_not_used():
    ref = registry.get_backend("reference")
    current = ref.source_hash()
    assert current and dispatch.backend_source_hash(ref) == current
    stale = _rec(KEY, 16, 128, source="0123456789abcdef")
    d = Dispatcher(CPU, [stale, _rec(KEY, 128, 256)])
    assert d.stale_rows == 1 and d.tuned(KEY).keys() == {128}
    assert d.pick(KEY, 128) == (ref, ReferenceConfig(chunk_n=256))
    assert d.pick(KEY, 16) == (ref, ReferenceConfig())  # bucket 16 has no current row: the default
    # a faster stale row does not beat a current one in the same bucket
    d = Dispatcher(CPU, [_rec(KEY, 16, 64, source="0123456789abcdef", median=1.0), _rec(KEY, 16, 128)])
    assert d.stale_rows == 1 and d.pick(KEY, 16)[1] == ReferenceConfig(chunk_n=128)
    # a row without a recorded source cannot be checked and is used
    d = Dispatcher(CPU, [_rec(KEY, 16, 64, source="")])
    assert d.stale_rows == 0 and d.pick(KEY, 16)[1] == ReferenceConfig(chunk_n=64)


def test_rows_that_cannot_run_are_ignored_with_one_warning(monkeypatch):
    _register(monkeypatch, OfflineBackend)
    recs = [_rec(KEY, 16, 128, backend="test_offline"), _rec(KEY, 128, 128, backend="test_offline")]
    with pytest.warns(RuntimeWarning, match="ignored 2 tuning row") as w:
        d = Dispatcher(CPU, recs)
    assert len([x for x in w if issubclass(x.category, RuntimeWarning)]) == 1
    assert len(d) == 0
    assert d.pick(KEY, 16) == (registry.get_backend("reference"), ReferenceConfig())


def test_runner_compiled_once_for_every_m(monkeypatch, gen):
    inst = _register(monkeypatch, CountingBackend)
    CountingBackend.compiles = 0
    d = Dispatcher(CPU, [_rec(KEY, 16, 64, backend="test_counting"), _rec(KEY, 8192, 64, backend="test_counting")])
    runners = {id(d.resolve(KEY, m)[2]) for m in (9, 15, 16, 4097, 8192, 9000)}  # the tuned buckets
    assert len(runners) == 1 and CountingBackend.compiles == 1
    assert d.runner(inst, ReferenceConfig(chunk_n=64), KEY) is d.resolve(KEY, 12)[2]
    assert CountingBackend.compiles == 1
    # the runner computes x @ W^T (checked against float64 math)
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    x = torch.randn(12, KEY.k, generator=gen).to(torch.bfloat16)
    backend, cfg, runner = d.resolve(KEY, 12)
    out = runner(x, backend.prepare(w), None)
    ref = x.double() @ w.dequantize().double().T
    err = (out.double() - ref).norm() / ref.norm()
    assert out.shape == (12, KEY.n) and err < 1e-2


@dataclasses.dataclass(frozen=True)
class SmallMConfig(ReferenceConfig):
    m_max: Optional[int] = None  # the largest M this config serves (None: any)


class SmallMBackend(ReferenceBackend):
    """A backend whose configs may declare the largest M they serve; its default never does."""

    name = "test_small_m"
    config_types = {None: SmallMConfig}

    def default(self, key, m=None):
        return SmallMConfig(chunk_n=32)


def test_rows_serve_their_own_bucket_only(monkeypatch):
    """A tuned row runs the calls of its M bucket (the largest bucket also every larger M),
    within its config's m_max; every other call runs the backend's default for that M (a miss)."""
    inst = _register(monkeypatch, SmallMBackend)
    rec = _rec(KEY, 16, 64, backend="test_small_m")
    rec = rec.model_copy(update={"config": {"chunk_n": 64, "m_max": 12}})
    d = Dispatcher(CPU, [rec, _rec(KEY2, 100, 16, backend="test_small_m"), _rec(KEY2, 8192, 48, backend="test_small_m")])
    for m in (9, 12):
        assert d.pick(KEY, m) == (inst, SmallMConfig(chunk_n=64, m_max=12))
    for m in (1, 8, 13, 16, 17, 200):  # other buckets, or past m_max
        assert d.pick(KEY, m) == (inst, SmallMConfig(chunk_n=32))
    d.resolve(KEY, 16)
    d.resolve(KEY, 12)
    assert d.misses() == [(KEY, 16, 1)]
    # a non-standard bucket (100) serves the M of its standard bucket (128) up to 100
    assert [d.pick(KEY2, m)[1].chunk_n for m in (64, 65, 100, 101, 128)] == [32, 16, 16, 32, 32]
    assert [d.pick(KEY2, m)[1].chunk_n for m in (4096, 4097, 8192, 10**6)] == [32, 48, 48, 48]


def test_misses_counted_flushed_and_merged(tmp_path):
    d = Dispatcher(CPU, [_rec(KEY, 16, 128)])
    for _ in range(3):
        d.resolve(KEY2, 3)  # untuned key -> standard bucket 4
    d.resolve(KEY, 10)  # served by its own bucket (16): a hit
    d.resolve(KEY, 16)
    d.resolve(KEY, 1)  # bucket 16 is coarser than the standard bucket 1: a miss
    d.resolve(KEY, 200)  # beyond the largest tuned bucket: a miss at 256
    assert sorted(d.misses(), key=str) == sorted([(KEY2, 4, 3), (KEY, 1, 1), (KEY, 256, 1)], key=str)
    path = tmp_path / "sub" / "w.misses.json"
    assert d.flush_misses(path) == path
    assert d.misses() == [] and d.flush_misses(path) is None
    assert sorted(load_misses(path), key=str) == sorted([(KEY2, 4, 3), (KEY, 1, 1), (KEY, 256, 1)], key=str)
    d.resolve(KEY2, 4)
    d.flush_misses(path)
    got = {(k, m): c for k, m, c in load_misses(path)}
    assert got[(KEY2, 4)] == 4 and got[(KEY, 1)] == 1 and len(got) == 3
    assert sorted(os.listdir(path.parent)) == ["w.misses.json"]  # no temp files left behind
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["misses"][0]["count"] == 4
    with pytest.raises(FileNotFoundError):
        load_misses(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "misses": [{"op": "conv"}]}')
    with pytest.raises(ValueError, match="invalid misses file"):
        load_misses(bad)


def test_get_dispatcher_reads_the_user_db(tmp_path):
    path = tmp_path / "user.db"
    with TuningDB(path) as db:
        db.upsert_result(_rec(KEY, 32, 64))
    dispatch.set_db(path)
    assert dispatch.user_db_path() == path
    assert dispatch.misses_path() == tmp_path / "user.misses.json"
    d = dispatch.get_dispatcher("cpu")
    assert d is dispatch.get_dispatcher(torch.device("cpu"))
    assert d.pick(KEY, 20)[1] == ReferenceConfig(chunk_n=64)
    # rows added later are seen after reload()
    with TuningDB(path) as db:
        db.upsert_result(_rec(KEY, 64, 128))
    assert dispatch.get_dispatcher("cpu").pick(KEY, 40)[1] == ReferenceConfig()  # bucket 64: not yet
    dispatch.reload()
    d2 = dispatch.get_dispatcher("cpu")
    assert d2 is not d and d2.pick(KEY, 40)[1] == ReferenceConfig(chunk_n=128)
    # the same rows through load_layers directly
    d3 = Dispatcher(CPU, load_layers(current_environment(CPU), user_path=path))
    assert d3.tuned(KEY) == d2.tuned(KEY)
    dispatch.set_db(None)
    assert dispatch.get_dispatcher("cpu").tuned(KEY) == {}


@pytest.mark.gpu
def test_dispatch_on_gpu(gen):
    dev = torch.device("cuda")
    d = dispatch.get_dispatcher(dev)
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4").to(dev)
    x = torch.randn(7, KEY.k, generator=gen).to(dev, torch.bfloat16)
    backend, cfg, runner = d.resolve(KEY, 7)
    out = runner(x, w.packed(backend.name, backend.prepare), None)
    ref = x.double() @ w.dequantize().double().T
    assert out.is_cuda and (out.double() - ref).norm() / ref.norm() < 1e-2


def _fast_entries(w):
    return w.__dict__.get("_linear_fast", {})


def test_linear_fast_path_follows_set_db_and_counts_misses(tmp_path, gen):
    """autofp4.linear keeps (runner, prepacked weight) per (dtype, device, M) on the weight;
    a new DB replaces the dispatcher and with it every kept entry; misses are still counted."""
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    x = torch.randn(3, KEY.k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ w.dequantize(torch.float32).double().T
    y0 = autofp4.linear(x, w)
    ((ck, ent),) = _fast_entries(w).items()
    assert ck == (torch.bfloat16, CPU, 3) and ent[0] is dispatch.get_dispatcher(CPU) and ent[4] is not None
    for _ in range(4):  # fast path: same result, one miss per call
        assert torch.equal(autofp4.linear(x, w), y0)
    assert dispatch.get_dispatcher(CPU).misses() == [(KEY, bucket_for(3, DEFAULT_M_BUCKETS), 5)]
    assert float((y0.double() - ref).norm() / ref.norm()) < 1e-2
    # a tuned row for this key in a new user DB: the next call takes the tuned config
    path = tmp_path / "user.db"
    with TuningDB(path) as db:
        db.upsert_result(_rec(KEY, 4, 128))
    dispatch.set_db(path)
    y1 = autofp4.linear(x, w)
    d = dispatch.get_dispatcher(CPU)
    ent = _fast_entries(w)[ck]
    assert ent[0] is d and ent[4] is None  # tuned: no miss to count
    assert d.resolve(KEY, 3)[1] == ReferenceConfig(chunk_n=128) and ent[1] is d.resolve(KEY, 3)[2]
    assert float((y1.double() - ref).norm() / ref.norm()) < 1e-2
    assert d.misses() == []
    w.clear_packed()
    assert _fast_entries(w) == {}


def test_linear_fast_path_checks_every_call(gen):
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    x = torch.randn(2, KEY.k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(KEY.n, generator=gen).to(torch.bfloat16)
    ref = x.double() @ w.dequantize(torch.float32).double().T
    autofp4.linear(x, w)
    y = autofp4.linear(x, w, bias)  # same entry, with a bias
    assert float((y.double() - ref - bias.double()).norm() / ref.norm()) < 1e-2
    with pytest.raises(ValueError, match="bias must be"):
        autofp4.linear(x, w, bias[:-1])
    with pytest.raises(ValueError, match="bias must be"):
        autofp4.linear(x, w, bias.half())
    with pytest.raises(ValueError, match="last dimension"):
        autofp4.linear(torch.randn(2, KEY.k + 16, generator=gen).to(torch.bfloat16), w)
    # a non-contiguous x of the same shape takes the full path and the same math
    xt = torch.randn(KEY.k, 2, generator=gen).to(torch.bfloat16).T
    yt = autofp4.linear(xt, w)
    reft = xt.double() @ w.dequantize(torch.float32).double().T
    assert float((yt.double() - reft).norm() / reft.norm()) < 1e-2
    # another M gets its own entry; 3-D x [1, 2, K] shares the entry of M = 2
    autofp4.linear(x[:1], w)
    autofp4.linear(x.view(1, 2, KEY.k), w)
    assert sorted(k[2] for k in _fast_entries(w)) == [1, 2]


def test_refresh_picks_up_new_rows_keeping_runners_and_misses(tmp_path, gen):
    """refresh() renews the process-wide dispatchers: rows stored since are used by the next
    call (also on autofp4.linear's fast path), compiled runners and counted misses carry over."""
    path = tmp_path / "user.db"
    dispatch.set_db(path)
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    x = torch.randn(3, KEY.k, generator=gen).to(torch.bfloat16)
    autofp4.linear(x, w)
    d = dispatch.get_dispatcher(CPU)
    default = d.pick(KEY, 3)
    runner = d.runner(*default, KEY)
    with TuningDB(path) as db:
        db.upsert_result(_rec(KEY, 4, 128))
    autofp4.linear(x, w)
    assert d.misses() == [(KEY, 4, 2)]  # not read again until refreshed
    dispatch.refresh()
    d2 = dispatch.get_dispatcher(CPU)
    assert d2 is not d and dispatch.get_dispatcher("cpu") is d2
    autofp4.linear(x, w)
    assert _fast_entries(w)[(torch.bfloat16, CPU, 3)][0] is d2
    assert d2.pick(KEY, 3)[1] == ReferenceConfig(chunk_n=128) and d2.runner(*default, KEY) is runner
    assert d2.misses() == [(KEY, 4, 2)] == d.misses()  # one counter: the tuned call added none


def test_the_miss_hook_sees_misses_only_and_can_resolve_the_call_again(tmp_path, gen):
    """set_miss_hook: called on untuned calls only (after counting them); where it returns a
    dispatcher (it stored a row), the call runs that dispatcher's pick at once."""
    path = tmp_path / "user.db"
    dispatch.set_db(path)
    seen = []

    def hook(disp, mk):
        seen.append(mk)
        with TuningDB(path) as db:
            db.upsert_result(_rec(mk[0], mk[1], 128))
        dispatch.refresh()
        return dispatch.get_dispatcher(disp.device)

    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    x = torch.randn(3, KEY.k, generator=gen).to(torch.bfloat16)
    dispatch.set_miss_hook(hook)
    try:
        autofp4.linear(x, w)
        assert seen == [(KEY, 4)] and _fast_entries(w) == {}  # renewed during the call: not kept
        for _ in range(3):
            autofp4.linear(x, w)  # tuned: the hook is not called again
        ent = _fast_entries(w)[(torch.bfloat16, CPU, 3)]
        assert ent[4] is None and ent[0] is dispatch.get_dispatcher(CPU)
        assert dispatch.get_dispatcher(CPU).resolve(KEY, 33)[1] == ReferenceConfig(chunk_n=128)
        assert seen == [(KEY, 4), (KEY, 64)]  # resolve() goes through the hook as well
        assert dispatch.get_dispatcher(CPU).misses() == [(KEY, 4, 1), (KEY, 64, 1)]
    finally:
        dispatch.set_miss_hook(None)
    autofp4.linear(x[:1], w)
    assert seen == [(KEY, 4), (KEY, 64)]


def test_a_moe_slices_misses_carry_the_layers_expert_count_to_tune_from_misses(tmp_path, gen):
    """``autofp4.moe`` on one rank's slice (an ``expert_map`` over 16 experts, 4 local): its miss
    records the 16, the misses file keeps it, and ``tune --from-misses`` makes a slice job of it;
    a call without a map stays an all-local miss."""
    from moe_cases import ep_slice

    from autofp4 import dispatch as D
    from autofp4.tuning.run import misses_jobs

    e, eg = 4, 16
    x, w13, w2, tw, ti, emap = ep_slice("mxfp4", gen, e, eg, t=3)
    D.set_db(tmp_path / "u.db")
    try:
        d = D.get_dispatcher(CPU)
        autofp4.moe(x, w13, w2, tw, ti, expert_map=emap)
        ((key, m, c),) = d.misses()
        assert (key.op, key.experts, key.topk, m, c) == ("moe", e, 2, 4, 1)
        assert d.miss_experts_global((key, m)) == eg
        autofp4.moe(x, w13, w2, tw, ti % e)  # the same local shape as a whole layer elsewhere
        path = d.flush_misses(tmp_path / "m.json")
        assert load_misses(path) == [(key, m, 2)]
        assert load_misses(path, experts_global=True) == [(key, m, 2, eg)]
        (job,) = misses_jobs(path)
        assert (job.key, job.m, job.experts_global) == (key, m, eg)
    finally:
        D.set_db(None)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "misses": [{**dataclasses.asdict(key), "m": 4, "experts_global": 2}]}))
    with pytest.raises(ValueError, match="experts_global=2"):
        load_misses(bad)


def test_reading_a_db_never_changes_the_file(tmp_path, monkeypatch, gen):
    """$AUTOFP4_DB pointing at another program's SQLite file: the dispatcher reads it read-only,
    warns that it is not a tuning database, and leaves it byte for byte as it was (no tables
    added, no journal-mode switch)."""
    import sqlite3
    import warnings

    import autofp4

    foreign = tmp_path / "app.sqlite"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users (name) VALUES ('ada')")
    con.commit()
    con.close()
    before = foreign.read_bytes()
    dispatch.set_db(foreign)
    try:
        w = autofp4.quantize(torch.randn(32, 64, generator=gen), "nvfp4")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autofp4.linear(torch.randn(2, 64, generator=gen).bfloat16(), w)
        assert any("not an autofp4 tuning database" in str(c.message) and str(foreign) in str(c.message)
                   for c in caught), [str(c.message) for c in caught]
    finally:
        dispatch.set_db(None)
    assert foreign.read_bytes() == before
    assert not (tmp_path / "app.sqlite-wal").exists()
    con = sqlite3.connect(foreign)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["users"]
    con.close()


@pytest.mark.parametrize("bad", ["", "   ", "a\0b"])
def test_set_db_refuses_an_empty_or_whitespace_path(bad):
    """AP65: set_db('') was accepted (the path '.') and the next call failed in pathlib."""
    dispatch.set_db(None)
    before = dispatch.user_db_path()
    with pytest.raises(ValueError, match=r"set_db\(" + repr(bad).replace("\\", "\\\\") + r"\): the path "):
        dispatch.set_db(bad)
    with pytest.raises(ValueError, match=r"^set_db\(PosixPath\('\.'\)\)|set_db"):
        dispatch.set_db(type("P", (), {"__fspath__": lambda self: bad})())
    assert dispatch.user_db_path() == before  # the DB in use is unchanged
    w = autofp4.quantize(torch.randn(64, 64), "nvfp4")
    assert autofp4.linear(torch.randn(2, 64, dtype=torch.bfloat16), w).shape == (2, 64)
