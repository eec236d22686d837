"""``autofp4`` command line on the CPU: tune a tiny model end to end into real SQLite files."""
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autofp4 import cli, dispatch
from autofp4.backends import get_backend
from autofp4.cli import build_parser, main
from autofp4.db import TuningDB, load_layers
from autofp4.dispatch import Dispatcher
from autofp4.env import current_environment

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}
# qkv (512 x 256), o (256 x 256), gate_up (1024 x 256), down (256 x 512); M = 1, 16, 128
N_JOBS = 12


@pytest.fixture(autouse=True)
def _reset_db():
    dispatch.set_db(None)
    yield
    dispatch.set_db(None)


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny-llama.json"
    p.write_text(json.dumps(TINY))
    return p


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def _env_key():
    return current_environment(CPU).key()


def _picks(d, recs):
    return {(r.problem_key(), r.m_bucket): d.pick(r.problem_key(), r.m_bucket) for r in recs}


def test_dry_run(tiny, tmp_path):
    db = tmp_path / "t.db"
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--db", db, "--device", "cpu"])
    assert rc == 0, err
    assert "gate_up_proj" in out and "down_proj" in out and "qkv_proj" in out
    assert "4 shapes x 3 M buckets (1,16,128) = 12 (shape, M) jobs" in out
    rc, out, _ = run(["tune", "--model", tiny, "--dry-run", "--m", "1,2,4,8", "--tp", "2", "--device", "cpu"])
    assert rc == 0 and "x 4 M buckets (1,2,4,8)" in out and "tp=2" in out
    assert not db.exists()


def test_lm_head_is_tuned_when_asked(tiny):
    """--lm-head adds the output projection (vocab x hidden, split by --tp) to tune's shapes."""
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--lm-head", "--tp", "2", "--device", "cpu"])
    assert rc == 0, err
    rows = {line.split()[1]: line.split()[2:4] for line in out.splitlines() if line.startswith("linear")}
    assert rows["lm_head"] == ["500", "256"] and len(rows) == 4  # qkv and down merge at tp 2
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--device", "cpu"])
    assert rc == 0 and "lm_head" not in out


def test_m_values_round_up_to_the_buckets_their_calls_use(tiny, tmp_path):
    """``--m 3`` tunes bucket 4, the bucket the dispatcher files a call at M = 3 or 4 under:
    the row then serves both (no misses); beyond 8192, the 8192 bucket (it serves every larger M)."""
    from autofp4.problem import ProblemKey

    rc, out, _ = run(["tune", "--model", tiny, "--dry-run", "--m", "3,5,4,10000", "--device", "cpu"])
    assert rc == 0 and "x 3 M buckets (4,8,8192)" in out
    db = tmp_path / "t.db"
    rc, out, err = run(["tune", "--model", tiny, "--db", db, "--no-progress", "--device", "cpu", "--m", "3",
                        "--time-budget", "60"])
    assert rc == 0, out + err
    with TuningDB(db) as t:
        recs = t.results(_env_key())
    assert recs and {r.m_bucket for r in recs} == {4}
    key = recs[0].problem_key()
    assert isinstance(key, ProblemKey)
    env = current_environment(CPU)
    d = Dispatcher(CPU, load_layers(env, user_path=db), env=env)
    for m in (3, 4):
        assert d.resolve_entry(key, m)[3] is None, m  # a tuned pick: no miss
    assert d.resolve_entry(key, 5)[3] is not None  # bucket 8: untuned


def test_bad_inputs_exit_2(tmp_path, tiny):
    bad_arch = tmp_path / "c.json"
    bad_arch.write_text(json.dumps({**TINY, "model_type": "not-a-model"}))
    rc, out, err = run(["tune", "--model", bad_arch, "--dry-run"])
    assert rc == 2 and "not-a-model" in err and "Traceback" not in err
    rc, _, err = run(["tune", "--model", tmp_path / "missing.json"])
    assert rc == 2 and "missing.json" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    rc, _, err = run(["tune", "--model", broken])
    assert rc == 2 and "JSON" in err
    rc, _, err = run(["tune"])
    assert rc == 2 and "--model" in err
    rc, _, err = run(["tune", "--model", tiny, "--backend", "nope"])
    assert rc == 2 and "unknown backend" in err
    rc, _, err = run(["tune", "--model", tiny, "--m", "0,4"])
    assert rc == 2
    rc, _, err = run(["tune", "--from-misses", tmp_path / "none.misses.json"])
    assert rc == 2 and "no misses file" in err


def test_tune_end_to_end_export_import(tiny, tmp_path):
    db = tmp_path / "t.db"
    rc, out, err = run(["tune", "--model", tiny, "--db", db, "--no-progress", "--device", "cpu"])
    assert rc == 0, out + err
    assert "tuning the reference backend on the CPU" in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU found: tuning the reference backend on the CPU" in out
    assert "12 tuned" in out and "gate_up_proj" in out and "speedup" in out
    env = current_environment(CPU)
    ref = get_backend("reference")
    with TuningDB(db) as t:
        recs = t.results(env.key())
        trials = t.trials(env.key())
        assert len(recs) == N_JOBS
        assert {(r.n, r.k) for r in recs} == {(512, 256), (256, 256), (1024, 256), (256, 512)}
        assert {r.m_bucket for r in recs} == {1, 16, 128}
        for r in recs:  # provenance
            assert r.backend == "reference" and r.env == env and r.backend_source == ref.source_hash()
            assert r.median_us > 0 and r.spread_us >= 0 and r.samples >= 1 and r.default_median_us > 0
            assert r.created_at.endswith("Z")
        assert len(trials) >= N_JOBS and all(t.outcome == "ok" for t in trials)
        export = tmp_path / "export.json"
        t.export(export, env.key())
    # a new dispatcher picks exactly the stored rows and counts no misses for them
    d = Dispatcher(CPU, load_layers(env, user_path=db), env=env)
    picks = _picks(d, recs)
    for r in recs:
        b, cfg = picks[(r.problem_key(), r.m_bucket)]
        assert b.name == r.backend and cfg == b.parse_config(r.config)
        d.resolve(r.problem_key(), r.m_bucket)
    assert d.misses() == []
    # export -> import into a fresh DB -> the same picks
    fresh = tmp_path / "fresh.db"
    with TuningDB(fresh) as f:
        f.import_file(export)
        assert len(f.results(env.key())) == N_JOBS
    d2 = Dispatcher(CPU, load_layers(env, user_path=fresh), env=env)
    assert _picks(d2, recs) == picks
    # `autofp4 db list` and `autofp4 info` see the DB
    rc, out, err = run(["db", "list", "--db", db])
    assert rc == 0, err
    rc, out, err = run(["info", "--db", db, "--device", "cpu"])
    assert rc == 0, err
    assert env.key() in out and "reference" in out and f"{N_JOBS} / {N_JOBS}" in out
    user_line = next(line for line in out.splitlines() if line.strip().startswith(f"user     {db}"))
    assert "older kernel source" not in user_line  # (shipped files are judged on their own line)
    # rows from an older kernel source are counted, and the dispatcher does not use them
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE results SET backend_source = 'fedcba9876543210' WHERE m_bucket = 1")
    stale = sum(r.m_bucket == 1 for r in recs)
    assert stale > 0
    rc, out, err = run(["info", "--db", db, "--device", "cpu"])
    assert rc == 0, err
    assert f"{N_JOBS} / {N_JOBS}, {stale} measured with an older kernel source" in out
    d3 = Dispatcher(CPU, load_layers(env, user_path=db), env=env)
    assert d3.stale_rows == stale and len(d3) == N_JOBS - stale


def test_info_counts_the_rows_tuned_just_in_time(tmp_path):
    from autofp4.schema import TuningRecord

    db = tmp_path / "t.db"
    ref = get_backend("reference")
    with TuningDB(db) as t:
        t.upsert_results([
            TuningRecord(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=m, n=256, k=128,
                         config={"chunk_n": 0}, median_us=10.0, spread_us=0.1, samples=5, origin=origin,
                         backend_source=dispatch.backend_source_hash(ref, {"chunk_n": 0}),
                         env=current_environment(CPU))
            for m, origin in ((1, "jit"), (2, "offline"), (4, "jit"))
        ])
    rc, out, err = run(["info", "--db", db, "--device", "cpu"])
    assert rc == 0, err
    user_line = next(line for line in out.splitlines() if line.strip().startswith(f"user     {db}"))
    assert user_line.endswith(": 3 / 3, 2 tuned just-in-time"), user_line


def test_resume_skips_and_force_retunes(tiny, tmp_path):
    db = tmp_path / "t.db"
    args = ["tune", "--model", tiny, "--db", db, "--no-progress", "--device", "cpu", "--m", "1,16"]
    assert run(args)[0] == 0
    with TuningDB(db) as t:
        n_trials = len(t.trials())
        first = {r.unique_key(): r.created_at for r in t.results()}
    rc, out, _ = run(args)
    assert rc == 0 and "0 tuned, 8 already tuned" in out
    with TuningDB(db) as t:
        assert len(t.trials()) == n_trials
    rc, out, _ = run([*args, "--force"])
    assert rc == 0 and "8 tuned" in out
    with TuningDB(db) as t:
        assert len(t.trials()) == 2 * n_trials
        again = {r.unique_key(): r.created_at for r in t.results()}
    assert set(again) == set(first) and all(again[k] > first[k] for k in first)


def test_from_misses_cli(tmp_path):
    db = tmp_path / "t.db"
    dispatch.set_db(db)
    from autofp4.problem import ProblemKey

    k = ProblemKey("linear", "nvfp4", "bfloat16", 256, 128)
    d = Dispatcher(CPU, [], misses_file=dispatch.misses_path())
    d.resolve(k, 5)
    d.flush_misses()
    rc, out, _ = run(["tune", "--from-misses", "--db", db, "--dry-run"])
    assert rc == 0 and "N=256 K=128 M=8: 1 calls" in out
    rc, out, err = run(["tune", "--from-misses", "--db", db, "--no-progress", "--device", "cpu"])
    assert rc == 0, out + err
    with TuningDB(db) as t:
        assert [(r.n, r.k, r.m_bucket) for r in t.results(_env_key())] == [(256, 128, 8)]
    # the table names each job's problem in full: format and dtype columns, the misses in the name
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:4] == ["name", "op", "fmt", "dtype"])
    row = lines[head + 2].split()
    assert row[:7] == ["1", "missed", "calls", "linear", "nvfp4", "bfloat16", "256"], lines[head:head + 3]


@pytest.mark.parametrize("content,match", [
    ("[]", "expected a JSON object"),
    ("[" * 100000 + "]" * 100000, "nested too deep"),
    ('{"version": 1, "misses": [{"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 1099511627776, '
     '"k": 128, "m": 8}]}', "misses[0] field 'n': 1099511627776 is not from 1 to 1048576"),
    ('{"version": 1, "misses": [{"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 256, "k": 128, '
     '"m": 1000000000000}]}', "misses[0] field 'm': 1000000000000 is not an M bucket the dispatcher looks up"),
    ('{"version": 1, "misses": [{"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 256, "k": 130, '
     '"m": 8}]}', "misses[0] field 'k': 130 is not a multiple of nvfp4's block of 16"),
    ('{"version": 1, "misses": [{"op": "moe", "fmt": "mxfp4", "dtype": "bfloat16", "n": 80, "k": 256, '
     '"experts": 8, "topk": 2, "m": 8}]}', "misses[0] field 'n': 80 is not twice a multiple of 32"),
])
def test_from_misses_refuses_a_bad_file_with_exit_2(tmp_path, content, match):
    bad = tmp_path / "bad.misses.json"
    bad.write_text(content)
    for extra in ([], ["--dry-run"]):
        rc, out, err = run(["tune", "--from-misses", bad, "--db", tmp_path / "t.db", "--device", "cpu", *extra])
        assert rc == 2 and match in err and "Traceback" not in err, err


def test_from_misses_refuses_a_fifo_instead_of_blocking_on_it(tmp_path):
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    rc, out, err = run(["tune", "--from-misses", fifo, "--db", tmp_path / "t.db", "--device", "cpu", "--dry-run"])
    assert rc == 2 and "not a regular file" in err and str(fifo) in err, err


def test_cache_refuses_a_cache_path_that_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "kc"
    f.write_text("x")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(f))
    for argv in (["cache"], ["cache", "--clear"]):
        rc, out, err = run(argv)
        assert rc == 2 and f"the kernel cache {f} ($AUTOFP4_KERNEL_CACHE) is not a directory" in err, (argv, err)
    assert f.read_text() == "x"


def test_two_processes_tune_one_db(tmp_path):
    # intermediate 1024: gate_up is 2048 x 256, where the reference backend has 2 configs
    tiny = tmp_path / "tiny2.json"
    tiny.write_text(json.dumps({**TINY, "intermediate_size": 1024}))
    db = tmp_path / "shared.db"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cmd = [sys.executable, "-m", "autofp4", "tune", "--model", str(tiny), "--db", str(db),
           "--storage", storage, "--no-progress", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with TuningDB(db) as t:
        recs = t.results(_env_key())
        trials = t.trials(_env_key())
    keys = [r.unique_key() for r in recs]
    assert len(keys) == len(set(keys)) == N_JOBS  # every job once, none twice
    assert all(t.outcome == "ok" for t in trials)
    assert len(trials) == N_JOBS + 3  # gate_up has a second config in each of the 3 buckets
    measured = {(t.n, t.k, t.m, json.dumps(t.config, sort_keys=True)) for t in trials}
    assert len(measured) == len(trials)  # the shared study handed out each point once
    for r in recs:  # every stored winner is backed by a trial of its config
        assert (r.n, r.k, r.m_bucket, json.dumps(r.config, sort_keys=True)) in measured


def test_ctrl_c_keeps_what_was_measured(tmp_path):
    cfg = tmp_path / "mid.json"
    cfg.write_text(json.dumps({**TINY, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8}))
    db = tmp_path / "t.db"
    cmd = [sys.executable, "-m", "autofp4", "tune", "--model", str(cfg), "--db", str(db), "--no-progress", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # a test run started in the background of a non-interactive shell ignores SIGINT, and so would
    # the child: give it the default disposition, so Python turns SIGINT into KeyboardInterrupt
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    stored = 0
    while time.monotonic() < deadline and p.poll() is None and stored < 2:
        time.sleep(0.2)
        if db.exists():
            try:
                with TuningDB(db, readonly=True) as t:
                    stored = len(t.results())
            except Exception:
                pass
    assert p.poll() is None, "the run finished before it could be interrupted"
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    with TuningDB(db) as t:
        kept = {r.unique_key() for r in t.results()}
    assert len(kept) >= 2
    # a second run resumes: what was stored is skipped
    rc, out, _ = run(["tune", "--model", cfg, "--db", db, "--no-progress", "--device", "cpu", "--m", "1"])
    assert rc == 0 and f"{sum(1 for k in kept if k[4] == 1)} already tuned" in out


def test_time_budget_argument():
    import math

    from autofp4.cli import build_parser

    p = build_parser()
    assert p.parse_args(["tune", "--model", "x.json", "--time-budget", "none"]).time_budget == math.inf
    assert p.parse_args(["tune", "--model", "x.json", "--time-budget", "90"]).time_budget == 90.0
    assert p.parse_args(["tune", "--model", "x.json"]).time_budget is None  # the tuner's default
    with pytest.raises(SystemExit):
        p.parse_args(["tune", "--model", "x.json", "--time-budget", "0"])


def test_dry_run_layouts(tiny, capsys):
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--layout", "transformers", "--device", "cpu"])
    assert rc == 0, err
    rows = {line.split()[1]: line.split()[2:4] for line in out.splitlines() if line.startswith("linear")}
    # q and o (256 x 256) merge, k and v (128 x 256) merge, gate and up (512 x 256) merge
    assert rows == {"q_proj+o_proj": ["256", "256"], "k_proj+v_proj": ["128", "256"],
                    "gate_proj+up_proj": ["512", "256"], "down_proj": ["256", "512"]}
    assert "4 shapes x 3 M buckets (1,16,128) = 12 (shape, M) jobs" in out and "layout=transformers" in out
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--layout", "both", "--device", "cpu"])
    assert rc == 0, err
    rows = {line.split()[1]: line.split()[2:4] for line in out.splitlines() if line.startswith("linear")}
    # the union: qkv (512 x 256) is also the shape of gate and up, o that of q
    assert rows == {"qkv_proj+gate_proj+up_proj": ["512", "256"], "o_proj+q_proj": ["256", "256"],
                    "gate_up_proj": ["1024", "256"], "down_proj": ["256", "512"],
                    "k_proj+v_proj": ["128", "256"]}
    assert "5 shapes x 3 M buckets" in out and "layout=both" in out
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--layout", "transformers", "--tp", "2",
                        "--device", "cpu"])
    assert rc == 0, err
    rows = {line.split()[1]: line.split()[2:4] for line in out.splitlines() if line.startswith("linear")}
    assert rows == {"q_proj": ["128", "256"], "k_proj+v_proj": ["64", "256"], "o_proj": ["256", "128"],
                    "gate_proj+up_proj+down_proj": ["256", "256"]}
    rc, out, _ = run(["tune", "--model", tiny, "--dry-run", "--device", "cpu"])
    assert rc == 0 and "qkv_proj" in out and "q_proj " not in out and "layout=vllm" in out
    capsys.readouterr()
    rc, _, _ = run(["tune", "--model", tiny, "--dry-run", "--layout", "fused"])
    assert rc == 2 and "--layout" in capsys.readouterr().err


def test_cache_warm_takes_layout():
    args = build_parser().parse_args(["cache", "--warm", "x.json", "--layout", "transformers"])
    assert args.layout == "transformers"
    args = build_parser().parse_args(["cache", "--warm", "x.json"])
    cli._options_for(args, cli._WARM_OPTIONS, True, "--warm CONFIG")  # what the cache command does first
    assert args.layout == "vllm" and args.seeds == 0 and args.fmt == "nvfp4"


def test_ops_limits_the_shapes_tuned(capsys):
    moe_model = str(Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b.json")
    rc, out, _ = run(["tune", "--model", moe_model, "--ops", "moe", "--dry-run", "--m", "1,64", "--device", "cpu"])
    assert rc == 0 and "1 shapes x 2 M buckets" in out and "experts" in out and "qkv_proj" not in out
    rc, out, _ = run(["tune", "--model", moe_model, "--ops", "linear", "--dry-run", "--m", "1", "--device", "cpu"])
    assert rc == 0 and "qkv_proj" in out and "moe " not in out
    rc, _, _ = run(["tune", "--model", moe_model, "--ops", "conv", "--dry-run"])
    assert rc == 2 and "subset of linear, moe" in capsys.readouterr().err  # (argparse writes to sys.stderr)
    dense = str(Path(__file__).resolve().parents[1] / "examples" / "llama-3.1-8b.json")
    rc, _, err = run(["tune", "--model", dense, "--ops", "moe", "--dry-run", "--device", "cpu"])
    assert rc == 2 and "has no moe shapes" in err


# --------------------------------------------------------------------------------------------
# hardening: misses files, list options, env variables, the kernel cache
# --------------------------------------------------------------------------------------------
_MISS = {"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 64, "k": 64, "m": 1, "count": 1}


@pytest.mark.parametrize("change,needle", [
    ({"count": 1.5}, "misses[0] field 'count': 1.5 is not an integer"),
    ({"n": "64"}, "misses[0] field 'n': \"64\" is not an integer"),
    ({"n": True}, "misses[0] field 'n': true is not an integer"),
    ({"n": 64.5}, "misses[0] field 'n': 64.5 is not an integer"),
    ({"m": 1000000}, "misses[0] field 'm': 1000000 is not an M bucket the dispatcher looks up (1 to 8192"),
    ({"count": float("nan")}, "misses[0] field 'count': NaN is not an integer"),
    ({"m": None}, "misses[0]: missing field 'm'"),
    ({"extra": 1}, "misses[0]: unknown field 'extra'"),
    ({"op": 3}, "misses[0] field 'op': 3 is not a string"),
])
def test_from_misses_checks_each_field_strictly(tmp_path, change, needle):
    """A misses file's numbers are ints (not floats, strings or booleans, never coerced), its M a
    bucket the dispatcher looks up; every problem is named with its entry and field (exit 2)."""
    entry = {**_MISS, **change}
    if change.get("m", 1) is None:
        del entry["m"]
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"version": 1, "misses": [entry, dict(_MISS, n=128)]}))
    rc, out, err = run(["tune", "--from-misses", bad, "--db", tmp_path / "t.db", "--device", "cpu", "--dry-run"])
    assert rc == 2 and needle in err and str(bad) in err and "Traceback" not in err, err
    assert "missed (problem, M) pairs" not in out


def test_from_misses_lists_every_bad_entry_one_line_each(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"version": 1, "misses": [{**_MISS, "count": 1.5}, dict(_MISS), 7,
                                                        {k: v for k, v in _MISS.items() if k != "k"}]}))
    rc, _, err = run(["tune", "--from-misses", bad, "--db", tmp_path / "t.db", "--dry-run"])
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 3, err
    assert "misses[0] field 'count'" in lines[0] and "misses[2]: 7 is not an object" in lines[1]
    assert "misses[3]: missing field 'k'" in lines[2]


@pytest.mark.parametrize("argv,option", [
    (["--m", "1,,2"], "--m"), (["--m", "1,2,"], "--m"), (["--ops", "linear,"], "--ops"),
    (["--devices", "cpu,,cpu"], "--devices"),
])
def test_list_options_refuse_empty_items(tiny, capsys, argv, option):
    rc, out, _ = run(["tune", "--model", tiny, "--dry-run", "--device", "cpu", *argv])
    err = capsys.readouterr().err  # argparse's own message
    assert rc == 2 and f"{option} has an empty item" in err and "jobs" not in out, err


def test_cpu_devices_and_device_cuda_contradict_each_other(tiny, tmp_path):
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--devices", "cpu,cpu", "--device", "cuda",
                        "--db", tmp_path / "t.db"])
    assert rc == 2 and "--devices cpu,cpu and --device cuda contradict each other" in err and "jobs" not in out, err


@pytest.mark.parametrize("value", ["", ",", "reference,", " , reference"])
def test_backend_refuses_an_empty_name(tiny, value):
    rc, out, err = run(["tune", "--model", tiny, "--dry-run", "--device", "cpu", "--backend", value])
    assert rc == 2 and "--backend has an empty name" in err and "jobs" not in out, err


def test_claim_ttl_variable_is_checked_before_any_tuning_process_starts(tiny, tmp_path, monkeypatch):
    from autofp4.tuning.claims import RDB_CLAIM_TTL_S, claim_ttl_s

    for bad in ("abc", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("AUTOFP4_CLAIM_TTL_S", bad)
        with pytest.raises(ValueError, match=f"AUTOFP4_CLAIM_TTL_S={bad!r}"):
            claim_ttl_s()
    monkeypatch.setenv("AUTOFP4_CLAIM_TTL_S", "abc")
    rc, out, err = run(["tune", "--model", tiny, "--device", "cpu", "--m", "1", "--budget", "1", "--no-progress",
                        "--storage", f"sqlite:///{tmp_path / 's.db'}", "--devices", "cpu,cpu", "--db", tmp_path / "t.db"])
    assert rc == 2 and "AUTOFP4_CLAIM_TTL_S='abc'" in err and "Traceback" not in err, err
    assert not (tmp_path / "t.db").exists() and not (tmp_path / "s.db").exists()
    monkeypatch.setenv("AUTOFP4_CLAIM_TTL_S", " 12.5 ")
    assert claim_ttl_s() == 12.5
    monkeypatch.delenv("AUTOFP4_CLAIM_TTL_S")
    assert claim_ttl_s() == RDB_CLAIM_TTL_S


def test_an_unexpandable_db_path_is_named(tiny, tmp_path, monkeypatch):
    """``~nosuchuser/...`` in $AUTOFP4_DB or --db: exit 2 naming the variable or option."""
    monkeypatch.setenv("AUTOFP4_DB", "~nouser_autofp4_xyz/x.db")
    for argv in (["info", "--device", "cpu"], ["tune", "--model", tiny, "--device", "cpu", "--dry-run"],
                 ["db", "list"], ["db", "import", REPO / "tuning_db" / "nvidia-h200.json"]):
        rc, out, err = run(argv)
        assert rc == 2 and "AUTOFP4_DB='~nouser_autofp4_xyz/x.db'" in err and "Traceback" not in err, (argv, err)
    monkeypatch.delenv("AUTOFP4_DB")
    for argv in (["info", "--device", "cpu"], ["db", "list"], ["explain", "--n", "64", "--k", "64"]):
        rc, out, err = run([*argv, "--db", "~nouser_autofp4_xyz/y.db"])
        assert rc == 2 and "--db='~nouser_autofp4_xyz/y.db'" in err, (argv, err)


def test_a_shipped_export_named_as_a_file_is_read(tmp_path, monkeypatch):
    shipped = REPO / "tuning_db" / "nvidia-h200.json"
    monkeypatch.setenv("AUTOFP4_DB", str(tmp_path / "none.db"))
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(shipped))
    rc, out, err = run(["info", "--device", "cpu"])
    line = next(x for x in out.splitlines() if x.strip().startswith("shipped"))
    assert rc == 0 and f"{shipped}: 0 / " in line, line
    rc, out, err = run(["db", "list"])
    assert rc == 0 and "nvidia-h200.json (0)" not in out.splitlines()[-1] and "in 1 layers" in out, out
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "nowhere"))
    rc, out, err = run(["info", "--device", "cpu"])
    assert rc == 0 and f"{tmp_path / 'nowhere'}: no such file or folder" in out


def _own_kernel(d: Path, name: str = "w4a16_decode") -> Path:
    o = d / f"{name}-{'0123456789abcdef' * 2}.o"
    o.write_bytes(b"kernel")
    o.with_suffix(".json").write_text("{}")
    return o


def test_cache_clear_deletes_only_the_caches_own_files(tmp_path, monkeypatch):
    """``cache --clear`` on a folder that also holds someone's build files: only the files named
    as autofp4 names its kernels (``<name>-<32 hex>.o`` and the ``.json`` beside it) go."""
    kc = tmp_path / "build"
    kc.mkdir()
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(kc))
    own = _own_kernel(kc)
    orphan = kc / f"other-{'f' * 32}.json"  # a record whose kernel is gone
    orphan.write_text("{}")
    theirs = {"foo.o": "obj", "foo.json": "{}", "foo.c": "int x;", f"x-{'0' * 31}.o": "short key"}
    for name, text in theirs.items():
        (kc / name).write_text(text)
    rc, out, err = run(["cache"])
    assert rc == 0 and "1 compiled kernel," in out, out
    rc, out, err = run(["cache", "--clear"])
    assert rc == 0 and "removed 1 compiled kernels" in out, out
    assert "left 4 other files" in out and "not autofp4 kernels" in out and "foo.c" in out, out
    assert not own.exists() and not own.with_suffix(".json").exists() and not orphan.exists()
    assert {p.name: p.read_text() for p in kc.iterdir()} == theirs


def test_cache_warm_refuses_the_reference_backend(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    rc, out, err = run(["cache", "--warm", tiny, "--arch", "sm_90a", "--backend", "reference", "--no-progress"])
    assert rc == 2 and "--backend reference" in err and "compiles no kernels" in err, err
    assert "compiled" not in out and not (tmp_path / "kc").exists()


def test_cache_import_checks_every_kernel_before_writing_any(tmp_path, monkeypatch):
    """An archive whose second kernel fails its sha256 is refused and the first is not written."""
    pytest.importorskip("cutlass")
    import hashlib
    import tarfile

    from autofp4 import kernel_cache as kc_

    kc = tmp_path / "kc"
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(kc))
    mod = "autofp4.kernels.w4a16_decode"

    def entry(name, data, sha_of):
        r = {"name": name, "module": mod, "source": kc_._module_source_hash(mod),
             "cutlass_dsl": kc_.cutlass_dsl_version(), "arch": "sm_90a", "params": "{}"}
        return {**r, "file": f"{name}-{kc_._digest(r)}.o", "sha256": hashlib.sha256(sha_of).hexdigest(),
                "size": len(data)}

    def write(archive, kernels):  # kernels: (manifest entry, bytes)
        with tarfile.open(archive, "w:gz") as t:
            manifest = json.dumps({"format": "autofp4-kernel-cache", "version": 1, "kernels": [e for e, _ in kernels]})
            for name, data in [("manifest.json", manifest.encode())] + [(e["file"], d) for e, d in kernels]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))

    a, b = b"A" * 100, b"B" * 100
    ea, eb = entry("ka", a, a), entry("kb", b, b"other")
    archive = tmp_path / "a.tgz"
    write(archive, [(ea, a), (eb, b)])
    rc, out, err = run(["cache", "--import", archive])
    assert rc == 2 and f"{eb['file']} does not match its sha256" in err and "nothing imported" in err, err
    assert not kc.exists() or list(kc.iterdir()) == [], list(kc.iterdir())
    kc.mkdir(exist_ok=True)
    rc, out, err = run(["cache", "--import", archive])
    assert rc == 2 and list(kc.iterdir()) == []  # an existing cache: no kernel, no staging folder left
    eb = entry("kb", b, b)
    write(archive, [(ea, a), (eb, b)])  # both good: both written
    rc, out, err = run(["cache", "--import", archive])
    assert rc == 0 and "imported 2 kernels" in out, out + err
    assert sorted(p.name for p in kc.iterdir()) == sorted(
        [ea["file"], eb["file"], ea["file"][:-2] + ".json", eb["file"][:-2] + ".json"])


def test_cache_export_under_a_file_is_one_line_exit_2(tmp_path, one_kernel_cache):
    """CA04: ``cache --export f/x.tgz`` where f is a regular file: no traceback, the file named."""
    f = tmp_path / "f"
    f.write_text("x")
    rc, out, err = run(["cache", "--export", f / "x.tgz"])
    assert rc == 2 and "Traceback" not in err, err
    assert f"cannot write {f / 'x.tgz'}: {f} is a file, not a directory" in err, err
    assert f.read_text() == "x"


def test_cache_import_names_a_dangling_cache_symlink(tmp_path, monkeypatch):
    """EV08: the cache path is a dangling symlink: it is named, not the (readable) archive."""
    dang = tmp_path / "dang"
    dang.symlink_to(tmp_path / "nonexistent" / "kc")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(dang))
    archive = tmp_path / "a.tgz"
    archive.write_bytes(b"not read")
    for argv in (["cache", "--import", archive], ["cache"]):
        rc, out, err = run(argv)
        assert rc == 2 and f"the kernel cache {dang} ($AUTOFP4_KERNEL_CACHE) is a dangling symlink" in err, err
        assert "a.tgz" not in err, err
    assert not (tmp_path / "nonexistent").exists()


def test_cache_empty_variable_is_unset_and_off_shows_the_value(tmp_path, monkeypatch):
    """EV05: an empty AUTOFP4_KERNEL_CACHE is the default folder (as for AUTOFP4_DB); a disabled
    cache is reported with the value that disabled it; whitespace-only is refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "")
    rc, out, err = run(["cache"])
    assert rc == 0 and f"kernel cache: {tmp_path / 'xdg' / 'autofp4' / 'kernels'}: 0 compiled kernels" in out, out + err
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "0")
    rc, out, err = run(["cache"])
    assert rc == 0 and "disabled (AUTOFP4_KERNEL_CACHE='0')" in out, out + err
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "   ")
    rc, out, err = run(["cache"])
    assert rc == 2 and "AUTOFP4_KERNEL_CACHE='   ': the path is empty or only whitespace" in err and "Traceback" not in err, err


@pytest.mark.parametrize("value,why", [("   ", "is empty or only whitespace"), ("a\0b", "holds a NUL byte")])
def test_db_variable_or_option_of_whitespace_or_nul_is_refused(tmp_path, monkeypatch, value, why):
    """EV02: AUTOFP4_DB='   ' used to create a file named three spaces in the working folder."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "x.json"
    TuningDB(tmp_path / "src.db").close()
    assert run(["db", "export", "--db", tmp_path / "src.db", "--out", export])[0] == 0
    if "\0" not in value:  # an environment variable cannot hold a NUL byte; an argument can
        monkeypatch.setenv("AUTOFP4_DB", value)
        rc, out, err = run(["db", "import", export])
        assert rc == 2 and f"AUTOFP4_DB={value!r}: the path {why}" in err and "Traceback" not in err, err
        monkeypatch.delenv("AUTOFP4_DB")
    for argv in (["db", "import", export, "--db", value], ["db", "list", "--db", value]):
        rc, out, err = run(argv)
        assert rc == 2 and f"--db={value!r}: the path {why}" in err, (argv, err)
    assert all(p.name.strip() and p.name != "a" for p in tmp_path.iterdir()), list(tmp_path.iterdir())
    monkeypatch.setenv("AUTOFP4_DB", "")  # empty: unset, the default file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    rc, out, err = run(["db", "import", export])
    assert rc == 0 and (tmp_path / "xdg" / "autofp4" / "tuning.db").is_file(), err
