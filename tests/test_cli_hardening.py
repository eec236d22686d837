"""Hostile arguments and files for the CLI's tune / explain / db commands and the path variables:
each ends in one clear line naming the option, variable or file (exit 2), or is handled."""
from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from autofp4 import dispatch, kernel_cache
from autofp4.cli import main
from autofp4.db import TuningDB, TuningDBError, TuningDBWarning, default_db_path, load_layers
from autofp4.env import current_environment

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "tuning_db" / "nvidia-h200.json"
MISS = {"version": 1, "misses": [{"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 64, "k": 64, "m": 1,
                                  "count": 1}]}


@pytest.fixture(autouse=True)
def _reset_db():
    dispatch.set_db(None)
    yield
    dispatch.set_db(None)


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def _export(path: Path, n: int = 3, **change) -> Path:
    """The first ``n`` records of the shipped export (one of them changed by ``change``)."""
    doc = json.loads(SHIPPED.read_text())
    doc["records"] = doc["records"][:n]
    doc["records"][1].update(change)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("option", [["--m", "1024"], ["--ops", "moe"], ["--fmt", "mxfp4"], ["--dtype", "float16"],
                                    ["--tp", "2"], ["--layout", "transformers"], ["--lm-head"]])
def test_tune_from_misses_refuses_the_options_of_a_model(tmp_path, option):
    """A miss is tuned as it was called: an option that would change what is tuned is named, not ignored."""
    misses = tmp_path / "m.json"
    misses.write_text(json.dumps(MISS))
    rc, out, err = run(["tune", "--from-misses", misses, "--db", tmp_path / "t.db", "--device", "cpu", "--dry-run",
                        *option])
    assert rc == 2 and f"{option[0]} goes with --model" in err and out == ""
    rc, out, err = run(["tune", "--from-misses", misses, "--db", tmp_path / "t.db", "--device", "cpu", "--dry-run"])
    assert rc == 0 and "linear nvfp4 bfloat16 N=64 K=64 M=1: 1 calls" in out, err


def test_explain_refuses_a_shape_no_fp4_weight_has_and_a_device_not_here(tmp_path):
    rc, out, err = run(["explain", "--op", "linear", "--n", "64", "--k", "63", "--db", tmp_path / "t.db"])
    assert rc == 2 and "--k: 63 is not a multiple of nvfp4's block of 16" in err and out == ""
    rc, _, err = run(["explain", "--op", "linear", "--n", "64", "--k", "64", "--device", "cuda:99", "--db",
                      tmp_path / "t.db"])
    assert rc == 2 and err.startswith("error: --device cuda:99: ") and "Traceback" not in err
    if not torch.cuda.is_available():
        assert "no CUDA GPU is available" in err
    rc, _, err = run(["explain", "--op", "linear", "--n", "64", "--k", "64", "--device", "meta", "--db", tmp_path / "t.db"])
    assert rc == 2 and "--device meta: autofp4 runs on cuda or cpu" in err
    rc, out, _ = run(["explain", "--op", "linear", "--n", "64", "--k", "64", "--device", "cpu", "--db", tmp_path / "t.db"])
    assert rc == 0 and "N=64 K=64 M=1" in out


def test_explain_explains_a_repeated_m_once_and_each_command_says_what_act_does(tmp_path):
    rc, out, err = run(["explain", "--op", "linear", "--n", "64", "--k", "64", "--m", "16,16,3,16", "--device", "cpu",
                        "--db", tmp_path / "t.db"])
    assert rc == 0 and out.count("M=16 ") == 1 and out.count("M=3 ") == 1, out + err
    for command, verb in (("tune", "tune"), ("explain", "explain"), ("cache", "compile")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _, out, _ = run([command, "--help"])
        text = " ".join((buf.getvalue() + out).split())
        assert f"{verb} the shapes as run with FP8 activations" in text, (command, text)


def test_sqlites_in_memory_name_is_not_a_tuning_db(tmp_path, monkeypatch):
    """':memory:' would take the rows and lose them at exit ("3 added", exit 0)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOFP4_DB", ":memory:")
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json")])
    assert rc == 2 and "AUTOFP4_DB=':memory:': it names SQLite's in-memory database" in err and "added" not in out
    monkeypatch.delenv("AUTOFP4_DB")
    rc, _, err = run(["db", "list", "--db", ":memory:"])
    assert rc == 2 and "--db=':memory:'" in err
    with pytest.raises(TuningDBError, match="in-memory database"):
        TuningDB(":memory:")
    # the URL form tune --storage takes: read as a relative path, it made a folder 'sqlite:'
    monkeypatch.setenv("AUTOFP4_DB", "sqlite:///x.db")
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json")])
    assert rc == 2 and "AUTOFP4_DB='sqlite:///x.db': it is a URL, and a tuning DB is a file path" in err
    assert not (tmp_path / "sqlite:").exists()


def test_a_db_path_ending_in_a_separator_names_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOFP4_DB", "nodir/")
    rc, _, err = run(["db", "import", _export(tmp_path / "e.json")])
    assert rc == 2 and "AUTOFP4_DB='nodir/': it ends in '/', so it names a folder" in err
    assert not (tmp_path / "nodir").exists()
    monkeypatch.delenv("AUTOFP4_DB")
    rc, _, err = run(["db", "list", "--db", "nodir/"])
    assert rc == 2 and "--db='nodir/'" in err and not (tmp_path / "nodir").exists()
    for folder in ("x.db/.", "x.db/.."):
        rc, _, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", folder])
        assert rc == 2 and f"--db={folder!r}: it ends in" in err and not (tmp_path / "x.db").exists()
    with pytest.raises(TuningDBError, match="the tuning DB path='nodir/': it ends in '/', so it names a folder"):
        dispatch.set_db("nodir/")
    monkeypatch.setenv("AUTOFP4_DB", str(tmp_path / "ok" / "t.db"))
    assert default_db_path() == tmp_path / "ok" / "t.db"


def test_the_kernel_cache_variable_expands_a_leading_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "~/kc")
    assert kernel_cache.cache_dir() == tmp_path / "kc"
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "~no_such_user_autofp4/kc")
    with pytest.raises(ValueError, match="AUTOFP4_KERNEL_CACHE='~no_such_user_autofp4/kc': cannot expand"):
        kernel_cache.cache_dir()


def test_a_db_that_is_a_symlink_loop_is_named(tmp_path, monkeypatch):
    loop = tmp_path / "loop.db"
    loop.symlink_to(loop)
    rc, _, err = run(["db", "list", "--db", loop])
    assert rc == 2 and "loop.db is a symbolic link to nothing reachable" in err
    rc, _, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", loop])
    assert rc == 2 and "symbolic link to nothing reachable" in err
    env = current_environment(torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_layers(env, loop)  # what the dispatcher reads: the layer skipped, and said why
    assert any(issubclass(w.category, TuningDBWarning) and "symbolic link to nothing reachable" in str(w.message)
               for w in caught)


def test_an_import_dated_in_the_future_is_refused(tmp_path):
    db = tmp_path / "t.db"
    rc, _, err = run(["db", "import", _export(tmp_path / "e.json", created_at="2099-01-01T00:00:00.000000Z"), "--db", db])
    assert rc == 2 and "record #1" in err and "created_at: 2099-01-01T00:00:00.000000Z is in the future" in err
    with TuningDB(db, readonly=True) as t:
        assert t.results() == []  # nothing of the file written
    rc, out, err = run(["db", "import", _export(tmp_path / "ok.json"), "--db", db])
    assert rc == 0 and "3 added" in out, err


def test_a_db_left_mid_transaction_is_not_read_half_written(tmp_path):
    """A writer that died mid-transaction leaves a rollback journal; a read-only open must not show
    its half-written state as the database: it says so, and a write open rolls it back."""
    db = tmp_path / "j.db"
    rc, _, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", db])
    assert rc == 0, err
    crash = ("import sqlite3, os, sys\n"
             "c = sqlite3.connect(sys.argv[1]); c.execute('pragma journal_mode=delete'); c.execute('pragma cache_size=1')\n"
             "c.execute('begin'); c.execute('delete from results'); c.execute('create table junk(x)')\n"
             "c.executemany('insert into junk values (?)', [(b'x' * 4000,) for _ in range(50)]); os._exit(0)\n")
    subprocess.run([sys.executable, "-c", crash, str(db)], check=True)
    assert (tmp_path / "j.db-journal").stat().st_size > 0
    rc, out, err = run(["db", "list", "--db", db])
    assert rc == 2 and "unfinished transaction" in err and "j.db-journal" in err and "0 results" not in out
    with sqlite3.connect(db) as conn:  # a write open: SQLite rolls the transaction back
        assert conn.execute("select count(*) from results").fetchone()[0] == 3
    rc, out, err = run(["db", "list", "--db", db])
    assert rc == 0 and "3 results" in out, err


@pytest.mark.parametrize("option", [["--seeds", "3"], ["--lm-head"], ["--arch", "sm_90a"], ["--db", "t.db"],
                                    ["--fmt", "mxfp4"], ["--backend", "sm90_w4a16"], ["--workers", "2"]])
def test_cache_refuses_the_options_of_warm_without_it(option):
    rc, out, err = run(["cache", *option])
    assert rc == 2 and f"{option[0]} goes with --warm CONFIG" in err and out == ""


@pytest.mark.parametrize("command", [["tune", "--dry-run", "--device", "cpu"], ["cache", "--arch", "sm_90a"]])
def test_more_compile_workers_than_the_machine_takes_are_refused_by_the_cli(tmp_path, monkeypatch, capsys, command):
    """``--workers 100000`` would start a compiler per process: refused naming the limit (4 per
    CPU core), before any process starts."""
    from autofp4.tuning.args import max_workers

    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    where = ["--model", cfg, "--db", tmp_path / "t.db"] if command[0] == "tune" else ["--warm", cfg]
    rc, out, _ = run([command[0], *where, *command[1:], "--workers", "100000"])
    err = capsys.readouterr().err  # argparse's usage error
    assert rc == 2 and f"--workers=100000 is more compile processes than this machine takes: at most {max_workers()}" \
        in err and out == ""
    rc, out, _ = run([command[0], *where, *command[1:], "--workers", max_workers() + 1])
    assert rc == 2 and f"--workers={max_workers() + 1} is more" in capsys.readouterr().err
    assert not (tmp_path / "kc").exists() or not list((tmp_path / "kc").glob("*.o"))


@pytest.mark.parametrize("dry", [True, False])
def test_tune_refuses_a_backend_that_cannot_run_on_its_device(tmp_path, dry):
    """``--backend sm100_blockscaled --device cpu``: the dry run says what the run would (before
    any job is listed)."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    argv = ["tune", "--model", cfg, "--backend", "sm100_blockscaled", "--db", tmp_path / "t.db", "--device", "cpu"]
    rc, out, err = run(argv + (["--dry-run"] if dry else ["--no-progress"]))
    assert rc == 2 and "--backend sm100_blockscaled cannot run on the CPU: needs a CUDA device" in err and out == ""
    assert not (tmp_path / "t.db").exists()
    rc, out, err = run(["tune", "--model", cfg, "--backend", "reference", "--db", tmp_path / "t.db", "--device", "cpu",
                        "--dry-run"])
    assert rc == 0 and "(shape, M) jobs" in out, err


def test_cache_warm_refuses_a_backend_of_another_gpu_than_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    rc, out, err = run(["cache", "--warm", cfg, "--arch", "sm_90a", "--backend", "sm100_blockscaled"])
    assert rc == 2 and "--backend sm100_blockscaled builds kernels for sm_100a, not for --arch sm_90a" in err
    assert not (tmp_path / "kc").exists() or not list((tmp_path / "kc").glob("*.o"))


def test_explain_refuses_options_of_the_other_mode(tmp_path):
    db = tmp_path / "t.db"
    for option in (["--ops", "moe"], ["--tp", "2"], ["--layout", "transformers"]):
        rc, _, err = run(["explain", "--n", "64", "--k", "64", "--db", db, *option])
        assert rc == 2 and f"{option[0]} goes with --model (one shape is explained as given)" in err
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    rc, _, err = run(["explain", "--model", cfg, "--experts", "4", "--db", db])
    assert rc == 2 and "--experts goes with one shape (--n, --k)" in err
    rc, out, err = run(["explain", "--model", cfg, "--tp", "2", "--m", "1", "--device", "cpu", "--db", db])
    assert rc == 0 and "N=64" in out, err


def test_an_export_with_control_characters_in_its_environment_is_refused(tmp_path):
    """Environment texts reach terminals (db show): an escape sequence or a newline in one is
    refused on import, naming the field."""
    doc = json.loads(_export(tmp_path / "e.json").read_text())
    env = next(iter(doc["environments"]))
    doc["environments"][env]["gpu_name"] += "\x1b[2J\nresult  forged"
    (tmp_path / "e.json").write_text(json.dumps(doc))
    rc, out, err = run(["db", "import", tmp_path / "e.json", "--db", tmp_path / "t.db"])
    assert rc == 2 and f"environments.{env}.gpu_name: holds control characters" in err and "\\x1b" in err


def test_a_db_whose_unique_index_was_dropped_gets_it_back_or_is_refused(tmp_path):
    db = tmp_path / "t.db"
    assert run(["db", "import", _export(tmp_path / "e.json"), "--db", db])[0] == 0
    con = sqlite3.connect(db)
    con.execute("DROP INDEX results_unique_key")
    con.commit()
    con.close()
    faster = json.loads(SHIPPED.read_text())["records"][1]
    faster["median_us"] *= 0.5
    rc, out, err = run(["db", "import", "--replace", _export(tmp_path / "f.json", median_us=faster["median_us"]),
                        "--db", db])
    assert rc == 0 and "1 replaced" in out, err
    with TuningDB(db, readonly=True) as t:
        assert len(t.results()) == 3  # replaced, not added beside
    con = sqlite3.connect(db)
    con.execute("DROP INDEX results_unique_key")
    cols = [r[1] for r in con.execute("PRAGMA table_info(results)") if r[1] != "id"]
    con.execute(f"INSERT INTO results ({', '.join(cols)}) SELECT {', '.join(cols)} FROM results LIMIT 1")
    con.commit()
    con.close()
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", db])
    assert rc == 2 and "lacks its unique index" in err and "share a key" in err


@pytest.mark.parametrize("same", [True, False])
def test_tune_refuses_an_optuna_storage_on_a_tuning_db(tmp_path, same):
    db = tmp_path / "t.db"
    other = tmp_path / "o.db"
    for d in (db, other):
        assert run(["db", "import", _export(tmp_path / "e.json"), "--db", d])[0] == 0
    url = f"sqlite:///{db if same else other}"
    rc, out, err = run(["tune", "--model", REPO / "examples" / "llama-3.1-8b.json", "--device", "cpu", "--db", db,
                        "--storage", url, "--m", "1", "--budget", "1"])
    assert rc == 2 and f"--storage {url} is " in err and ("the tuning DB" if same else "an autofp4 tuning DB") in err
    for d in (db, other):
        con = sqlite3.connect(d)
        assert "studies" not in {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
        con.close()


def test_a_closed_or_full_standard_output_is_an_error(tmp_path):
    import os

    cfg = REPO / "examples" / "llama-3.1-8b.json"
    cmd = [sys.executable, "-m", "autofp4", "explain", "--model", str(cfg), "--device", "cpu", "--m", "1"]
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            res = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert res.returncode == 1 and "cannot write to standard output" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(1))
    assert res.returncode == 2 and "standard output is closed" in res.stderr


def test_misses_of_processes_that_exit_together_add_up(tmp_path):
    """Each process merges its misses into the file under a lock of its folder: two writers that
    overlap (a second one waits for the first) both keep theirs."""
    import threading
    import time

    path = tmp_path / "t.misses.json"
    order = []
    with dispatch._folder_lock(tmp_path):
        t = threading.Thread(target=lambda: (dispatch._folder_lock(tmp_path).__enter__(), order.append("second")))
        t.start()
        time.sleep(0.2)
        order.append("first")
    t.join(5)
    assert order == ["first", "second"]
    code = ("import torch, autofp4, sys; autofp4.set_db(sys.argv[1]); w = autofp4.quantize(torch.randn(int(sys.argv[2]),"
            " 64), 'nvfp4'); autofp4.linear(torch.randn(2, 64, dtype=torch.bfloat16), w)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.db"), str(n)]) for n in (64, 128, 192)]
    assert all(p.wait(120) == 0 for p in procs)
    got = {(m["n"], m["m"]) for m in json.loads(path.read_text())["misses"]}
    assert got == {(64, 2), (128, 2), (192, 2)}


def test_a_kernel_cache_name_too_long_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / ("k" * 300)))
    rc, out, err = run(["cache"])
    assert rc == 2 and "AUTOFP4_KERNEL_CACHE=" in err and "is 300 bytes long, more than the 255" in err, err


def test_a_file_size_limit_names_the_file_being_written(tmp_path):
    import resource

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "bf16")
    limit = 32 * 1024

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    res = subprocess.run([sys.executable, "-m", "autofp4", "quantize", "--fmt", "nvfp4", "--no-progress", "--out",
                          str(tmp_path / "o"), str(tmp_path / "bf16")], capture_output=True, text=True, timeout=300,
                         preexec_fn=small_files)
    assert res.returncode == 2 and "File too large" in res.stderr and "model.safetensors'" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


# -- the eighteenth adversarial set ----------------------------------------------------------------
def test_cache_clear_with_an_export_or_import_is_refused_and_clears_nothing(tmp_path, one_kernel_cache):
    before = sorted(p.name for p in one_kernel_cache.iterdir())
    for flag in ("--export", "--import"):
        rc, out, err = run(["cache", flag, tmp_path / "k.tar.gz", "--clear"])
        assert rc == 2 and f"--clear with {flag}" in err and "removed" not in out, err
    assert sorted(p.name for p in one_kernel_cache.iterdir()) == before


def test_tune_and_explain_take_an_mxfp4_checkpoints_format(tmp_path):
    import autofp4
    from tiny_models import tiny_model

    m = tiny_model("llama", 7)
    autofp4.quantize_model(m, "mxfp4")
    autofp4.save_pretrained(m, tmp_path / "ck", layout="compressed-tensors")
    for target in (tmp_path / "ck", tmp_path / "ck" / "config.json"):
        rc, out, err = run(["tune", "--model", target, "--dry-run", "--device", "cpu", "--db", tmp_path / "t.db"])
        assert rc == 0 and "[mxfp4," in out, (out, err)
        rc, out, err = run(["explain", "--model", target, "--m", "1", "--device", "cpu", "--db", tmp_path / "t.db"])
        assert rc == 0 and "mxfp4" in out and "nvfp4" not in out, (out, err)
    rc, out, err = run(["tune", "--model", tmp_path / "ck", "--fmt", "nvfp4", "--dry-run", "--device", "cpu",
                        "--db", tmp_path / "t.db"])
    assert rc == 0 and "[nvfp4," in out  # --fmt given: as given


def test_db_paths_with_surrounding_whitespace_and_far_prune_ages_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_DB", str(tmp_path / "u.db") + " ")
    rc, out, err = run(["db", "list"])
    assert rc == 2 and "begins or ends with whitespace" in err, err
    monkeypatch.delenv("AUTOFP4_DB")
    db = tmp_path / "t.db"
    TuningDB(db).close()
    rc, out, err = run(["db", "prune", "--db", db, "--older-than-days", "1000000"])
    assert rc == 2 and "between 0 and 100000" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("u.db")) == []


# -- the twentieth adversarial set -----------------------------------------------------------------
def test_paths_that_name_a_folder_or_nothing_are_refused_before_any_work(tmp_path, monkeypatch, one_kernel_cache,
                                                                        capsys):
    """An output file named with a trailing '/', an empty path (an unset shell variable) and a
    variable holding a pasted line break are refused naming the option or variable; nothing is
    written, and no config.json of the working folder is tuned in place of an empty --model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    db = tmp_path / "t.db"
    TuningDB(db).close()
    cases = [(["cache", "--export", "kdir/"], "argument --export: it ends in '/', so it names a folder"),
             (["db", "export", "--db", db, "--out", "x/"], "argument --out: it ends in '/', so it names a folder"),
             (["tune", "--model", "", "--dry-run", "--device", "cpu"], "argument --model: the path is empty"),
             (["explain", "--model", " ", "--device", "cpu"], "argument --model: the path is empty"),
             (["quantize", "", "--out", "o"], "argument HF_MODEL_DIR: the path is empty"),
             (["db", "import", "--db", db, ""], "argument FILE: the path is empty"),
             (["db", "list", "--db", db, "--backend", ""], "argument --backend: expected a backend name, got ''")]
    for argv, said in cases:
        rc, out, err = run(argv)
        err += capsys.readouterr().err  # argparse's usage errors go to the process's stderr
        assert rc == 2 and said in err and out == "", (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "kc", "t.db"]
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(one_kernel_cache) + "\n")
    rc, out, err = run(["cache"])
    assert rc == 2 and "AUTOFP4_KERNEL_CACHE=" in err and "control character ('\\n'" in err, err


def test_db_export_replaces_only_an_earlier_export(tmp_path):
    """An export replaces its target: a misses file (or any file that is not an export) is refused
    and left byte for byte; an earlier export is replaced."""
    db = tmp_path / "t.db"
    rc, out, err = run(["db", "import", "--db", db, _export(tmp_path / "e.json")])
    assert rc == 0, err
    misses = tmp_path / "t.misses.json"
    misses.write_text(json.dumps(MISS))
    notes = tmp_path / "notes.json"
    notes.write_text("{}")
    for target in (misses, notes):
        before = target.read_bytes()
        rc, out, err = run(["db", "export", "--db", db, "--out", target])
        assert rc == 2 and f"--out {target} exists and is not a tuning export" in err, err
        assert target.read_bytes() == before
    rc, out, err = run(["db", "export", "--db", db, "--out", tmp_path / "e.json"])
    assert rc == 0 and "wrote 3 records" in out, err


def test_a_json_object_that_is_no_export_is_named_as_such(tmp_path):
    db = tmp_path / "t.db"
    TuningDB(db).close()
    other = tmp_path / "o.json"
    for text, keys in (("{}", "none"), (json.dumps(MISS), "misses, version")):
        other.write_text(text)
        for cmd in ("merge", "import", "diff"):
            rc, out, err = run(["db", cmd, "--db", db, other])
            assert rc == 2 and f"{other}: not a tuning export (it has no schema_version; its keys: {keys})" in err, err


def test_an_environment_without_a_gpu_name_is_refused(tmp_path):
    import hashlib

    doc = json.loads(_export(tmp_path / "e.json").read_text())
    key, env = next(iter(doc["environments"].items()))
    env = dict(env, gpu_name=" ")
    new = hashlib.sha256(json.dumps(env, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    doc["environments"] = {new: env}
    for r in doc["records"]:
        r["env_key"] = new
    (tmp_path / "e.json").write_text(json.dumps(doc))
    rc, out, err = run(["db", "import", "--db", tmp_path / "t.db", tmp_path / "e.json"])
    assert rc == 2 and f"environments.{new}.gpu_name: is empty" in err, err


def test_two_shipped_exports_that_disagree_are_warned_about(tmp_path, monkeypatch):
    """Two shipped exports holding a row of one key for this machine: the first by file name is
    used, and a warning names both files and the key."""
    from autofp4.backends import get_backend
    from autofp4.dispatch import backend_source_hash

    env = current_environment(torch.device("cpu"))
    base = json.loads(SHIPPED.read_text())["records"][0]
    ship = tmp_path / "ship"
    ship.mkdir()
    for name, chunk, med in (("a", 0, 10.0), ("b", 32, 5.0)):
        cfg = {"chunk_n": chunk}
        rec = dict(base, env_key=env.key(), op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", n=64,
                   k=64, experts=0, topk=0, m_bucket=1, config=cfg, median_us=med, default_median_us=20.0,
                   backend_source=backend_source_hash(get_backend("reference"), cfg))
        (ship / f"{name}.json").write_text(json.dumps({**json.loads(SHIPPED.read_text()),
                                                       "environments": {env.key(): env.model_dump(mode="json")},
                                                       "records": [rec]}))
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(ship))
    with pytest.warns(TuningDBWarning, match="both hold a row") as rec:
        rows = load_layers(env, tmp_path / "none.db")
    said = [str(r.message) for r in rec if "both hold a row" in str(r.message)]
    assert len(said) == 1 and str(ship / "a.json") in said[0] and str(ship / "b.json") in said[0], said
    assert "linear nvfp4 bfloat16 reference M=1 N=64 K=64" in said[0] and "10.00 us vs 5.00 us" in said[0]
    assert [r.config for r in rows] == [{"chunk_n": 0}]


def test_cache_checks_everything_before_it_acts_and_exports_what_it_warmed(tmp_path, monkeypatch, one_kernel_cache):
    """``cache --clear --warm ...`` with an argument error clears nothing; ``--warm ... --export``
    with one writes no archive; with none, the export comes after the warm-up and holds its
    kernels (the compile itself is replaced by a stand-in that writes one more cached kernel:
    what is tested is the command's order)."""
    from autofp4 import tuning
    from autofp4.tuning.warm import WarmReport

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                  "vocab_size": 256}))
    before = sorted(p.name for p in one_kernel_cache.iterdir())
    rc, out, err = run(["cache", "--clear", "--warm", config, "--arch", "sm_90a", "--backend", "reference"])
    assert rc == 2 and "--backend reference" in err and "removed" not in out, (out, err)
    rc, out, err = run(["cache", "--warm", config, "--arch", "sm_90a", "--backend", "reference", "--export",
                        tmp_path / "k.tar.gz"])
    assert rc == 2 and not (tmp_path / "k.tar.gz").exists()
    assert sorted(p.name for p in one_kernel_cache.iterdir()) == before

    def compile_one(jobs, backends, **kw):
        mod = "autofp4.kernels.sm90_w4a16_gemm"
        rec = {"name": "gemm", "module": mod, "source": kernel_cache._module_source_hash(mod),
               "cutlass_dsl": kernel_cache.cutlass_dsl_version(), "arch": "sm_90a", "params": "p"}
        f = one_kernel_cache / f"gemm-{kernel_cache._digest(rec)}.o"
        f.write_bytes(b"\x7fELF" + bytes(range(100)))
        f.with_suffix(".json").write_text(json.dumps(rec))
        return WarmReport(compiled=1)

    monkeypatch.setattr(tuning, "warm_kernel_cache", compile_one)
    rc, out, err = run(["cache", "--warm", config, "--arch", "sm_90a", "--export", tmp_path / "k.tar.gz",
                        "--no-progress"])
    assert rc == 0 and out.index("compiled 1 kernel configs") < out.index("exported 1 kernels"), (out, err)


# -- the twenty-first adversarial set --------------------------------------------------------------
def test_empty_arch_and_misses_file_are_named_and_a_format_against_the_checkpoint_is_noted(tmp_path, capsys):
    import autofp4
    from tiny_models import tiny_model

    rc, out, err = run(["cache", "--warm", REPO / "examples" / "llama-3.1-8b.json", "--arch", ""])
    assert rc == 2 and "--arch '' is empty: name the target (sm_90a, sm_100a)" in err, err
    rc, out, err = run(["tune", "--from-misses", "", "--db", tmp_path / "t.db", "--dry-run"])
    err += capsys.readouterr().err
    assert rc == 2 and "argument --from-misses: the path is empty" in err, err
    m = tiny_model("llama", 3)
    autofp4.quantize_model(m, "nvfp4")
    autofp4.save_pretrained(m, tmp_path / "ck", layout="modelopt")
    rc, out, err = run(["explain", "--model", tmp_path / "ck", "--fmt", "mxfp4", "--m", "1", "--device", "cpu",
                        "--db", tmp_path / "t.db"])
    assert rc == 0 and f"note: {tmp_path / 'ck'} is an NVFP4 checkpoint; its shapes are taken as MXFP4" in err, err
    rc, out, err = run(["explain", "--model", tmp_path / "ck", "--m", "1", "--device", "cpu", "--db", tmp_path / "t.db"])
    assert rc == 0 and "note:" not in err and "nvfp4" in out


def test_a_cached_kernel_that_is_a_symbolic_link_is_not_exported(tmp_path, one_kernel_cache):
    """The cache writes regular files: a link named like a kernel (to someone's file) is left out of
    an export, named, and its target's bytes are not in the archive."""
    import tarfile

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a kernel: someone's data")
    _kernel(one_kernel_cache, "good")
    link = _kernel(one_kernel_cache, "p")
    link.unlink()
    link.symlink_to(secret)
    rc, out, err = run(["cache", "--export", tmp_path / "k.tar.gz"])
    assert rc == 0 and "exported 1 kernels" in out and f"left out {link.name}: a symbolic link" in err, (out, err)
    with tarfile.open(tmp_path / "k.tar.gz") as tar:
        data = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    assert b"someone's data" not in data


# -- the twenty-second adversarial set -------------------------------------------------------------
def test_db_diff_names_the_fields_that_differ(tmp_path):
    db = tmp_path / "t.db"
    rc, _, err = run(["db", "import", "--db", db, _export(tmp_path / "e.json")])
    assert rc == 0, err
    doc = json.loads((tmp_path / "e.json").read_text())
    for r in doc["records"]:
        r["created_at"] = "2020-01-01T00:00:00Z"
    (tmp_path / "o.json").write_text(json.dumps(doc))
    rc, out, err = run(["db", "diff", "--db", db, tmp_path / "o.json"])
    lines = [ln for ln in out.splitlines() if ln.startswith("timing")]
    assert rc == 1 and len(lines) == 3 and all("(differs: created_at " in ln for ln in lines), out


def test_dsl_options_that_cannot_serve_the_command_are_named_before_any_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_CUTE_DSL_OPTIONS", "--keep-ptx")
    rc, out, err = run(["cache", "--warm", REPO / "examples" / "llama-3.1-8b.json", "--arch", "sm_90a"])
    assert rc == 2 and "AUTOFP4_CUTE_DSL_OPTIONS is set: kernels compiled with extra CuTeDSL options bypass the " \
                      "kernel cache" in err and "compiled" not in out, (out, err)
    monkeypatch.setenv("AUTOFP4_CUTE_DSL_OPTIONS", "--dump-dir '/tmp/x")
    rc, out, err = run(["tune", "--model", REPO / "examples" / "llama-3.1-8b.json", "--dry-run", "--device", "cpu",
                        "--db", tmp_path / "t.db"])
    assert rc == 2 and "No closing quotation (CuTeDSL reads it as shell words)" in err, err


def test_a_config_setting_the_number_of_experts_twice_differently_is_refused(tmp_path):
    c = json.loads((REPO / "examples" / "qwen3-30b-a3b.json").read_text())
    (tmp_path / "m.json").write_text(json.dumps(dict(c, num_local_experts=4)))
    rc, out, err = run(["tune", "--model", tmp_path / "m.json", "--dry-run", "--device", "cpu", "--db", tmp_path / "t.db"])
    assert rc == 2 and "the number of experts is set twice, differently: num_local_experts = 4, num_experts = 128" in err, err


# -- the twenty-third adversarial set --------------------------------------------------------------
def _kernel(cache: Path, params: str, data: bytes = b"\x7fELF" + bytes(range(64)), record: object = None) -> Path:
    """A kernel file of the cache with its record, as compile_cached names them (``record``:
    another record's text)."""
    mod = "autofp4.kernels.sm90_w4a16_gemm"
    rec = {"name": "gemm", "module": mod, "source": kernel_cache._module_source_hash(mod),
           "cutlass_dsl": kernel_cache.cutlass_dsl_version(), "arch": "sm_90a", "params": params}
    f = cache / f"gemm-{kernel_cache._digest(rec)}.o"
    f.write_bytes(data)
    f.with_suffix(".json").write_text(json.dumps(rec if record is None else record))
    return f


def test_an_export_leaves_out_what_its_import_would_refuse(tmp_path, one_kernel_cache):
    """A kernel whose record is no JSON object, or whose file is empty, is left out of an export
    (named), so the archive imports with the good kernels; none is refused whole."""
    good = _kernel(one_kernel_cache, "good")
    listed = _kernel(one_kernel_cache, "list", record=[1])
    empty = _kernel(one_kernel_cache, "empty", data=b"")
    rc, out, err = run(["cache", "--export", tmp_path / "k.tar.gz"])
    assert rc == 0 and "exported 1 kernels" in out, (out, err)
    assert f"left out {listed.name}: its record {listed.with_suffix('.json').name} is a JSON list" in err, err
    assert f"left out {empty.name}: {empty.name}: size 0 is not a positive byte count" in err, err
    kept = good.read_bytes()
    for f in list(one_kernel_cache.iterdir()):
        f.unlink()
    rc, out, err = run(["cache", "--import", tmp_path / "k.tar.gz"])
    assert rc == 0 and "imported 1 kernels" in out, (out, err)
    assert (one_kernel_cache / good.name).read_bytes() == kept


def test_a_checkpoint_config_refused_gets_its_error_alone(tmp_path):
    """``--fmt`` other than a checkpoint's own format is noted, but only once the config has passed
    its checks: a refused config gets its one-line error and no note before it."""
    import json

    import autofp4
    from tiny_models import tiny_model

    m = tiny_model("llama", 3)
    autofp4.quantize_model(m, "nvfp4")
    autofp4.save_pretrained(m, tmp_path / "ck", layout="modelopt")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    for argv in (["tune", "--model", tmp_path / "ck", "--fmt", "mxfp4", "--dry-run", "--db", tmp_path / "t.db"],
                 ["explain", "--model", tmp_path / "ck", "--fmt", "mxfp4", "--m", "1", "--device", "cpu",
                  "--db", tmp_path / "t.db"]):
        rc, out, err = run(argv)
        assert rc == 2 and "hidden_size" in err and "note:" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_storage_checks_hold_for_the_python_api_too(tmp_path):
    """``autofp4.tune(storage=...)`` is checked as ``--storage`` is: the tuning DB itself, a folder,
    another database's rollback journal (SQLite removes it); nothing written to any of them."""
    import autofp4
    from autofp4.problem import ProblemKey
    from autofp4.tuning.storage import storage_problem

    db = tmp_path / "t.db"
    other = tmp_path / "o.db"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.commit()
    (tmp_path / "dir").mkdir()
    key = ProblemKey("linear", "nvfp4", "bfloat16", 64, 64)
    for url, why in ((f"sqlite:///{db}", "is the tuning DB"), (f"sqlite:///{tmp_path / 'dir'}", "is a directory"),
                     (f"sqlite:///{other}-journal", "rollback journal of the database")):
        with pytest.raises(ValueError, match=why):
            autofp4.tune([key], m_buckets=[1], device="cpu", db=db, storage=url, progress=False)
    assert not (tmp_path / "o.db-journal").exists()
    assert "studies" not in {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
    # a URL with credentials (SQLCipher's form) has no percent-escapes
    why = storage_problem("sqlite+pysqlcipher://:pw@/" + str(tmp_path / "s.db"), db, "--storage")
    assert why is None or "percent" not in why


def test_an_empty_file_owns_its_side_file_names(tmp_path):
    """SQLite opens an empty file as an empty database and removes a 'hot journal' named after it:
    a DB named like the -journal of an empty file is refused as one beside an SQLite file is."""
    (tmp_path / "t.db").write_bytes(b"")
    rc, out, err = run(["db", "list", "--db", tmp_path / "t.db-journal"])
    assert rc == 2 and "rollback journal of the database" in err, err
    assert not (tmp_path / "t.db-journal").exists()


def test_paths_longer_than_sqlite_or_the_system_takes_are_refused(tmp_path, monkeypatch):
    from autofp4.db import SQLITE_PATH_MAX

    monkeypatch.chdir(tmp_path)
    deep = tmp_path / ("d" * 200) / ("e" * 200)
    deep.mkdir(parents=True)
    name = deep / ("f" * (SQLITE_PATH_MAX - len(str(deep)) - 1 + 10))  # 10 bytes past SQLite's limit
    rc, out, err = run(["db", "list", "--db", name])
    assert rc == 2 and f"SQLite opens a database only by a path of at most {SQLITE_PATH_MAX} bytes" in err, err
    ok = deep / ("f" * (SQLITE_PATH_MAX - len(str(deep)) - 1))
    assert run(["db", "import", _export(tmp_path / "e.json"), "--db", ok])[0] == 0
    rc, out, err = run(["db", "list", "--db", "a/../" * 1000 + "x.db"])
    assert rc == 2 and "bytes long as written" in err, err


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    from autofp4.db import default_db_path
    from autofp4.kernel_cache import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "rel/cache")
    monkeypatch.delenv("AUTOFP4_DB", raising=False)
    monkeypatch.delenv("AUTOFP4_KERNEL_CACHE", raising=False)
    assert default_db_path() == tmp_path / "home" / ".cache" / "autofp4" / "tuning.db"
    assert cache_dir() == tmp_path / "home" / ".cache" / "autofp4" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "autofp4" / "tuning.db"


def test_a_checkpoint_whose_quantization_config_does_not_load_is_not_tuned_as_nvfp4(tmp_path):
    import json

    import autofp4
    from tiny_models import tiny_model

    m = tiny_model("llama", 3)
    autofp4.quantize_model(m, "mxfp4")
    autofp4.save_pretrained(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "mxfp5"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run(["tune", "--model", tmp_path / "ck", "--dry-run", "--db", tmp_path / "t.db"])
    assert rc == 2 and "says it is a quantized checkpoint, but its quantization config does not load" in err, err
    assert "mxfp5" in err
    rc, out, err = run(["tune", "--model", tmp_path / "ck", "--dry-run", "--fmt", "mxfp4", "--db", tmp_path / "t.db"])
    assert rc == 0, err


def test_a_file_that_is_no_database_is_not_opened_by_sqlite(tmp_path):
    """SQLite takes a -journal beside any file it opens for its own (and deletes it), and a file
    shorter than its header for an empty database (and writes over it): a file that is no SQLite
    database is refused before SQLite opens it, the DB written beside it and the file kept."""
    (tmp_path / "t.db").write_bytes(b"not a database, 50 bytes long....................")
    assert run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "t.db-journal"])[0] == 0
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "t.db"])
    assert rc == 2 and "is not a readable tuning database: it is not an SQLite file" in err, err
    assert (tmp_path / "t.db-journal").stat().st_size > 0
    assert run(["db", "list", "--db", tmp_path / "t.db-journal"])[0] == 0
    (tmp_path / "u.db").write_bytes(b"x")
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "u.db"])
    assert rc == 2 and "it is not an SQLite file (it does not begin as one)" in err, err
    assert (tmp_path / "u.db").read_bytes() == b"x"


def test_storage_lock_file_that_is_a_fifo_and_storage_of_another_type(tmp_path):
    import os

    import autofp4
    from autofp4.problem import ProblemKey

    os.mkfifo(tmp_path / "s.db.ask.lock")
    key = ProblemKey("linear", "nvfp4", "bfloat16", 64, 64)
    with pytest.raises(ValueError, match=r"s.db.ask.lock \(the lock file autofp4 keeps beside the study\) is a FIFO"):
        autofp4.tune([key], m_buckets=[1], device="cpu", db=tmp_path / "t.db", storage=f"sqlite:///{tmp_path}/s.db",
                     progress=False)
    with pytest.raises(ValueError, match="storage must be a storage URL string .* got PosixPath"):
        autofp4.tune([key], m_buckets=[1], device="cpu", db=tmp_path / "t.db", storage=tmp_path / "s2.db",
                     progress=False)


def test_a_quantization_config_of_the_wrong_type_is_not_tuned_as_nvfp4(tmp_path):
    import json

    import autofp4
    from tiny_models import tiny_model

    m = tiny_model("llama", 3)
    autofp4.quantize_model(m, "mxfp4")
    autofp4.save_pretrained(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["quantization_config"] = "mxfp4"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run(["tune", "--model", tmp_path / "ck", "--dry-run", "--db", tmp_path / "t.db"])
    assert rc == 2 and "quantization_config must be an object, got str" in err, err


def test_a_db_reached_through_links_is_measured_as_sqlite_opens_it(tmp_path):
    import os

    deep = tmp_path / ("d" * 250) / ("e" * 250)
    deep.mkdir(parents=True)
    os.symlink(deep, tmp_path / "lk")
    rc, out, err = run(["db", "list", "--db", tmp_path / "lk" / "x.db"])
    assert rc == 2 and "leads through symbolic links to" in err and "resolved path, of at most 504" in err, err


def test_an_sqlite_database_named_like_a_journal_is_never_taken_for_one(tmp_path):
    """A tuning DB written at t.db-journal before t.db existed: opening t.db (a tuning DB or an
    optuna storage) later would make SQLite take the DB for t.db's rollback journal and delete
    it. Refused, the DB kept; a storage file that is no SQLite database is refused too."""
    import autofp4
    from autofp4.problem import ProblemKey

    assert run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "t.db-journal"])[0] == 0
    (tmp_path / "t.db").write_bytes(b"")
    before = (tmp_path / "t.db-journal").read_bytes()
    rc, out, err = run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "t.db"])
    assert rc == 2 and "t.db-journal is an SQLite database (a tuning DB?)" in err, err
    key = ProblemKey("linear", "nvfp4", "bfloat16", 64, 64)
    with pytest.raises(ValueError, match=r"t.db-journal is an SQLite database"):
        autofp4.tune([key], m_buckets=[1], device="cpu", db=tmp_path / "u.db", storage=f"sqlite:///{tmp_path}/t.db",
                     progress=False)
    assert (tmp_path / "t.db-journal").read_bytes() == before
    (tmp_path / "s.db").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"s.db is not a readable study storage: it is not an SQLite file"):
        autofp4.tune([key], m_buckets=[1], device="cpu", db=tmp_path / "u.db", storage=f"sqlite:///{tmp_path}/s.db",
                     progress=False)
    assert (tmp_path / "s.db").read_bytes() == b"x"


def test_a_database_at_a_shm_name_or_beside_a_linked_file_is_never_taken_for_a_side_file(tmp_path):
    """SQLite keeps its side files beside the file a link leads to, and autofp4's DBs run in WAL
    mode (an -shm rewritten on every open): a tuning DB at either place is refused, not lost."""
    import os

    (tmp_path / "d").mkdir()
    assert run(["db", "import", _export(tmp_path / "e.json"), "--db", tmp_path / "d" / "real.db-journal"])[0] == 0
    (tmp_path / "d" / "real.db").write_bytes(b"")
    os.symlink(tmp_path / "d" / "real.db", tmp_path / "t.db")
    before = (tmp_path / "d" / "real.db-journal").read_bytes()
    rc, out, err = run(["db", "list", "--db", tmp_path / "t.db"])
    assert rc == 2 and "real.db-journal is an SQLite database" in err, err
    assert (tmp_path / "d" / "real.db-journal").read_bytes() == before
    assert run(["db", "import", _export(tmp_path / "e2.json"), "--db", tmp_path / "u.db-shm"])[0] == 0
    shm = (tmp_path / "u.db-shm").read_bytes()
    rc, out, err = run(["db", "import", _export(tmp_path / "e3.json"), "--db", tmp_path / "u.db"])
    assert rc == 2 and "u.db-shm is an SQLite database" in err and "shared-memory index" in err, err
    assert (tmp_path / "u.db-shm").read_bytes() == shm
