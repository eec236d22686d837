"""`autofp4 db ...` through a real argparse parser (and once as a real subprocess)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofp4.cli_db import add_db_parser, run_db
from autofp4.db import TuningDB
from autofp4.schema import Environment, TrialRecord, TuningRecord

REPO = Path(__file__).resolve().parents[1]
ENV_A = dict(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0", driver="570.124.06",
             cuda="12.8", torch="2.13.0", cutlass_dsl="4.8.1", autofp4="0.1.0")
ENV_B = {**ENV_A, "gpu_name": "NVIDIA H100 80GB HBM3", "sm_count": 132}


def rec(env=ENV_A, **over) -> TuningRecord:
    data = dict(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=16,
                n=4096, k=4096, config={"chunk_n": 1024}, median_us=40.0, spread_us=1.0, samples=20,
                default_median_us=50.0, backend_source="src1", created_at="2025-01-01T00:00:00Z",
                env=env)
    data.update(over)
    return TuningRecord.model_validate(data)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autofp4")
    add_db_parser(p.add_subparsers(dest="command", required=True))
    return p


def cli(*argv: str) -> int:
    args = parser().parse_args(["db", *argv])
    assert args.func is run_db
    return run_db(args)


@pytest.fixture
def dbfile(tmp_path) -> Path:
    path = tmp_path / "cli.db"
    with TuningDB(path) as db:
        db.upsert_result(rec(m_bucket=1, median_us=10.0, default_median_us=25.0))
        db.upsert_result(rec(m_bucket=64, median_us=80.0, default_median_us=None))
        db.upsert_result(rec(ENV_B, op="moe", fmt="mxfp4", experts=8, topk=2, n=2048, k=1024,
                             config={"chunk_n": 0}))
        db.add_trial(TrialRecord(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference",
                                 m_bucket=1, m=1, n=4096, k=4096, config={"chunk_n": 512},
                                 outcome="wrong_result", error="max abs err 3.1 > 0.05",
                                 env_key=Environment(**ENV_A).key()))
    return path


def test_list_table(dbfile, capsys):
    assert cli("list", "--db", str(dbfile)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["op", "fmt", "dtype", "backend", "M", "N", "K", "E", "topk",
                                "median_us", "default_us", "speedup", "env"]
    assert "3 results" in lines[-1]
    row1 = next(line for line in lines if line.split()[:5] == ["linear", "nvfp4", "bfloat16", "reference", "1"])
    assert row1.split()[9:12] == ["10.00", "25.00", "2.50x"]
    row64 = next(line for line in lines if line.split()[4:5] == ["64"])
    assert row64.split()[10:12] == ["-", "-"]
    # filters
    assert cli("list", "--db", str(dbfile), "--op", "moe") == 0
    out = capsys.readouterr().out
    assert "1 results" in out and "mxfp4" in out and "nvfp4" not in out
    key_b = Environment(**ENV_B).key()
    assert cli("list", "--db", str(dbfile), "--env", key_b) == 0
    assert "1 results" in capsys.readouterr().out


def test_show_row_and_trials(dbfile, capsys):
    assert cli("show", "--db", str(dbfile), "--op", "linear", "--m", "1", "--n", "4096", "--k", "4096") == 0
    out = capsys.readouterr().out
    assert '{"chunk_n":1024}' in out and "speedup 2.50x" in out
    assert "wrong_result" in out and "max abs err" in out and '{"chunk_n":512}' in out
    assert cli("show", "--db", str(dbfile), "--n", "12345") == 1


def test_export_import_round_trip(dbfile, tmp_path, capsys):
    out_json = tmp_path / "out.json"
    assert cli("export", "--db", str(dbfile), "--out", str(out_json)) == 0
    doc = json.loads(out_json.read_text())
    assert len(doc["records"]) == 3 and len(doc["environments"]) == 2
    key_a = Environment(**ENV_A).key()
    assert cli("export", "--db", str(dbfile), "--out", str(tmp_path / "a.json"), "--env", key_a) == 0
    assert len(json.loads((tmp_path / "a.json").read_text())["records"]) == 2
    fresh = tmp_path / "fresh.db"
    assert cli("import", "--db", str(fresh), str(out_json)) == 0
    assert "3 added" in capsys.readouterr().out
    with TuningDB(fresh) as a, TuningDB(dbfile) as b:
        assert [r.model_dump() for r in a.results()] == [r.model_dump() for r in b.results()]
    assert cli("diff", "--db", str(fresh), str(out_json)) == 0
    assert "0 differences" in capsys.readouterr().out


def test_bad_input_exits_2(dbfile, tmp_path, capsys):
    assert cli("import", "--db", str(dbfile), str(tmp_path / "missing.json")) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{not json")
    assert cli("import", "--db", str(dbfile), str(tmp_path / "broken.json")) == 2
    assert "invalid JSON" in capsys.readouterr().err
    good = tmp_path / "good.json"
    assert cli("export", "--db", str(dbfile), "--out", str(good)) == 0
    doc = json.loads(good.read_text())
    doc["records"][1]["backend"] = "evil"
    (tmp_path / "evil.json").write_text(json.dumps(doc))
    assert cli("import", "--db", str(dbfile), str(tmp_path / "evil.json")) == 2
    err = capsys.readouterr().err
    assert "record #1" in err and "unknown backend 'evil'" in err
    assert cli("list", "--db", str(tmp_path / "nope.db")) == 2
    assert "no tuning database" in capsys.readouterr().err
    garbage = os.urandom(4096)  # not an export: a file whose first non-blank byte is "{" reads as one
    (tmp_path / "garbage.db").write_bytes(b"\0" + garbage[1:])
    assert cli("list", "--db", str(tmp_path / "garbage.db")) == 2
    assert "not a readable tuning database" in capsys.readouterr().err
    (tmp_path / "brace.db").write_bytes(b"{\xff" + garbage[2:])
    assert cli("list", "--db", str(tmp_path / "brace.db")) == 2
    assert "brace.db: not UTF-8 text near byte 1" in capsys.readouterr().err
    assert cli("list", "--db", str(dbfile), "--env", "xyz") == 2
    assert cli("prune", "--db", str(dbfile)) == 2
    assert "at least one" in capsys.readouterr().err
    assert cli("merge", "--db", str(dbfile), str(tmp_path / "missing.db")) == 2


def test_merge_diff_prune(dbfile, tmp_path, capsys):
    other = tmp_path / "other.db"
    with TuningDB(other) as db:
        db.upsert_result(rec(m_bucket=1, samples=99, config={"chunk_n": 2048}, median_us=9.0))
        db.upsert_result(rec(m_bucket=4))
    assert cli("diff", "--db", str(dbfile), str(other)) == 1
    out = capsys.readouterr().out
    assert "only_theirs" in out and "only_ours" in out and "config" in out
    assert cli("merge", "--db", str(dbfile), str(other)) == 0
    out = capsys.readouterr().out
    assert "1 added, 1 replaced" in out and "conflict" in out and "keep theirs" in out
    with TuningDB(dbfile) as db:
        (r1,) = db.results(m_bucket=1)
        assert r1.config == {"chunk_n": 2048} and r1.samples == 99
    assert cli("prune", "--db", str(dbfile), "--failed-trials") == 0
    assert "deleted 1 rows" in capsys.readouterr().out
    assert cli("prune", "--db", str(dbfile), "--env", Environment(**ENV_B).key()) == 0
    assert "deleted 1 rows" in capsys.readouterr().out
    with TuningDB(dbfile) as db:
        assert db.counts()["results"] == 3 and db.counts()["trials"] == 0


def test_prune_stale(tmp_path, capsys):
    """``prune --stale`` deletes the results measured with an older source of their kernel and
    keeps the current ones."""
    from autofp4.backends import get_backend

    ref = get_backend("reference")
    path = tmp_path / "s.db"
    with TuningDB(path) as db:
        db.upsert_result(rec(m_bucket=1, backend_source=ref.source_hash({"chunk_n": 1024})))
        db.upsert_result(rec(m_bucket=16, backend_source="0123456789abcdef"))
        db.upsert_result(rec(m_bucket=64, backend_source=""))  # no provenance: not judged
    assert cli("prune", "--db", str(path), "--stale", "--failed-trials") == 2
    assert "no other criterion" in capsys.readouterr().err
    assert cli("prune", "--db", str(path), "--stale") == 0
    assert "deleted 1 rows" in capsys.readouterr().out
    with TuningDB(path) as db:
        assert sorted(r.m_bucket for r in db.results()) == [1, 64]


def test_cli_as_subprocess(dbfile, tmp_path):
    out = subprocess.run([sys.executable, "-m", "autofp4.cli_db", "list", "--db", str(dbfile)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "3 results" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 999, "records": []}')
    out = subprocess.run([sys.executable, "-m", "autofp4.cli_db", "import", str(bad), "--db", str(dbfile)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "schema_version 999" in out.stderr


def test_export_to_standard_output_and_never_over_a_database(dbfile, tmp_path, capsys):
    """``--out -`` writes the export to standard output (the summary to standard error); an
    export never replaces its own database or any other SQLite file."""
    assert cli("export", "--db", str(dbfile), "--out", "-") == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert len(doc["records"]) == 3 and "to standard output" in cap.err
    assert not (Path.cwd() / "-").exists()
    before = dbfile.read_bytes()
    assert cli("export", "--db", str(dbfile), "--out", str(dbfile)) == 2
    assert "is the database being exported" in capsys.readouterr().err
    other = tmp_path / "other.db"
    with TuningDB(other) as db:
        db.upsert_result(rec(m_bucket=2))
    other_bytes = other.read_bytes()
    assert cli("export", "--db", str(dbfile), "--out", str(other)) == 2
    assert "is an SQLite database" in capsys.readouterr().err
    assert dbfile.read_bytes() == before and other.read_bytes() == other_bytes
    with TuningDB(dbfile, readonly=True) as db:
        assert len(db.results()) == 3


def test_export_never_replaces_what_is_not_a_regular_file(dbfile, tmp_path, capsys):
    """An export replaces its target: a FIFO (as a device node would be) is refused and left
    as it was; a path under a regular file is named as such."""
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert cli("export", "--db", str(dbfile), "--out", str(fifo)) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    f = tmp_path / "f"
    f.write_text("x")
    assert cli("export", "--db", str(dbfile), "--out", str(f / "sub" / "e.json")) == 2
    assert f"{f} is a file, not a folder" in capsys.readouterr().err
    assert f.read_text() == "x"


def test_db_help_is_plain_text_and_the_command_has_a_version():
    out = subprocess.run([sys.executable, "-m", "autofp4", "db", "--help"], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    assert "Inspect, export, import" in out and "``" not in out
    v = subprocess.run([sys.executable, "-m", "autofp4", "--version"], capture_output=True, text=True, cwd=REPO)
    import autofp4

    assert v.returncode == 0 and v.stdout.strip() == f"autofp4 {autofp4.__version__}"


def test_list_and_show_read_exports_and_every_layer(dbfile, tmp_path, capsys, monkeypatch):
    """``list`` / ``show`` take an export as ``--db`` too; ``list`` without ``--db`` lists every
    layer the dispatcher reads (the user database, then each shipped export), in that order."""
    export = tmp_path / "shipped" / "gpu.json"
    export.parent.mkdir()
    assert cli("export", "--db", str(dbfile), "--out", str(export)) == 0
    capsys.readouterr()
    assert cli("list", "--db", str(export), "--op", "linear") == 0
    out = capsys.readouterr().out
    assert "2 results" in out and "moe" not in out and "10.00" in out
    assert cli("show", "--db", str(export), "--op", "linear", "--m", "1") == 0
    out = capsys.readouterr().out
    assert '{"chunk_n":1024}' in out and "trials" not in out
    user = tmp_path / "user.db"
    with TuningDB(user) as db:
        db.upsert_result(rec(m_bucket=128, median_us=5.0))
    monkeypatch.setenv("AUTOFP4_DB", str(user))
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(export.parent))
    assert cli("list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["layer", "op"]
    layers = [line.split()[0] for line in lines[1:-1]]
    assert layers == ["user"] + ["gpu.json"] * 3
    assert "4 results in 2 layers" in lines[-1] and "user (1), gpu.json (3)" in lines[-1]


# --------------------------------------------------------------------------------------
# hardening
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,option", [
    (["list", "--m", "99999999999999999999999"], "--m/--m-bucket"),
    (["show", "--n", str(2**70), "--k", "64"], "--n"),
    (["list", "--k", "0"], "--k"),
    (["show", "--experts", "-1"], "--experts"),
    (["list", "--topk", "x"], "--topk"),
])
def test_key_filters_out_of_range_exit_2_naming_the_option(dbfile, capsys, argv, option):
    """Integers SQLite cannot even hold (an OverflowError traceback before) are refused up front."""
    from autofp4.cli import main

    assert main(["db", *argv, "--db", str(dbfile)]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "Traceback" not in err, err


def test_merge_and_diff_name_another_programs_sqlite_file(dbfile, tmp_path, capsys):
    """A file with a ``results`` table and no autofp4 schema version is not an autofp4 DB (not
    an old one that needs migrating), for merge and diff as for import; it is left as it is."""
    import sqlite3

    other = tmp_path / "other.db"
    c = sqlite3.connect(other)
    c.execute("create table results (a)")
    c.commit()
    c.close()
    before = other.read_bytes()
    for cmd in ("merge", "diff"):
        assert cli(cmd, str(other), "--db", str(dbfile)) == 2
        err = capsys.readouterr().err
        assert f"{other} is not an autofp4 tuning database" in err and "migrating" not in err, err
    assert cli("list", "--db", str(other)) == 2
    assert "not an autofp4 tuning database" in capsys.readouterr().err
    assert other.read_bytes() == before


def test_a_user_db_that_is_not_a_regular_file_is_named(dbfile, capsys, monkeypatch):
    monkeypatch.setenv("AUTOFP4_DB", os.devnull)
    assert cli("list") == 2
    err = capsys.readouterr().err
    assert f"{os.devnull} is not a regular file" in err and "AUTOFP4_DB" in err, err
    for argv in (("list", "--db", os.devnull), ("import", str(dbfile), "--db", os.devnull)):
        assert cli(*argv) == 2
        assert f"{os.devnull} is not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("over,field,why", [
    (dict(fmt="nvfp4", k=63), "k", "63 is not a multiple of nvfp4's block of 16"),
    (dict(fmt="mxfp4", k=4112), "k", "4112 is not a multiple of mxfp4's block of 32"),
    (dict(op="moe", fmt="nvfp4", experts=8, topk=2, n=2064), "n", "2064 is not twice a multiple of 16"),
])
def test_import_refuses_a_shape_no_fp4_weight_has(dbfile, tmp_path, capsys, over, field, why):
    """DI25: a record whose K (or a MoE key's N/2) is not a block multiple is refused, naming the
    record and field, by the rule the misses file is checked with; the DB is left as it was."""
    good = tmp_path / "good.json"
    assert cli("export", "--db", str(dbfile), "--out", str(good)) == 0
    doc = json.loads(good.read_text())
    doc["records"][0].update(over)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    before = dbfile.read_bytes()
    capsys.readouterr()
    assert cli("import", "--db", str(dbfile), str(bad)) == 2
    err = capsys.readouterr().err
    assert "invalid tuning export: record #0 (" in err and f") field {field}: {why}" in err, err
    assert dbfile.read_bytes() == before
    from autofp4.dispatch import _miss_entry  # the misses file: the same rule, the same words
    miss = {k: v for k, v in doc["records"][0].items() if k in ("op", "fmt", "dtype", "n", "k", "experts", "topk")}
    assert _miss_entry({**miss, "m": 1}) == (None, [f"field {field!r}: " + _shape_why(miss)[field]])


def _shape_why(r):
    from autofp4.problem import shape_errors

    return shape_errors(r["op"], r["fmt"], r["n"], r["k"])
