"""Hostile input for the tuning database and its exports.

Every case is generated (random records, random mutations, random truncations): files that are
not exports (random bytes, SQLite databases, directories, symbolic link loops), exports of the
wrong shape, records with each field mutated to a wrong type, an out-of-range or a huge value,
databases that cannot be written, and size bombs. Each must end in one clear error that names the
file (and the record and field), or be imported exactly; the target database stays intact
(``PRAGMA integrity_check`` is ``ok``) and a rejected import writes nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from autofp4.cli_db import add_db_parser, run_db
from autofp4.db import MAX_IMPORT_BYTES, SQLITE_SIDE_FILES, TuningDB, TuningDBError, TuningDBWarning, TuningFileError, load_layers
from autofp4.problem import DEFAULT_M_BUCKETS, bucket_for
from autofp4.schema import Environment, ExportedRecord, TuningRecord

REPO = Path(__file__).resolve().parents[1]
ENV = dict(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0", driver="570.124.06",
           cuda="12.8", torch="2.13.0", cutlass_dsl="4.8.1", autofp4="0.1.0")
ENV_KEY = Environment(**ENV).key()
OTHER_ENV = {**ENV, "driver": "575.51.03"}
TOP_BUCKET = DEFAULT_M_BUCKETS[-1]
#: what a rejected size bomb may allocate (tracemalloc peak)
MEMORY_BOUND = 48 * 2**20
SQLITE_MAGIC = b"SQLite format 3\x00"


# --------------------------------------------------------------------------------------
# valid input
# --------------------------------------------------------------------------------------
def _timestamp(rng: random.Random) -> str:
    return (f"20{rng.randint(20, 25)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}.{rng.randint(0, 999999):06d}Z")


def valid_record(rng: random.Random, n: int, env_key: str = ENV_KEY) -> dict[str, Any]:
    """A random exported record that validates (reference backend; ``n``, a multiple of 16, makes the
    key unique; a MoE record has N = 4n, so that N/2 is a multiple of both blocks)."""
    moe = rng.random() < 0.3
    experts = rng.randint(1, 256) if moe else 0
    chunk = rng.choice([0, 16 * rng.randint(1, max(1, n // 16 - 1))]) if n > 16 else 0
    median = rng.uniform(0.5, 5e4)
    return {
        "op": "moe" if moe else "linear", "fmt": rng.choice(["nvfp4", "mxfp4"]),
        "dtype": rng.choice(["bfloat16", "float16"]), "backend": "reference",
        # a bucket the dispatcher serves: a standard one or any M up to the largest
        "m_bucket": rng.choice([rng.choice(DEFAULT_M_BUCKETS), rng.randint(1, TOP_BUCKET)]),
        # a shape an FP4 weight can have: K a multiple of both blocks, a MoE key's N/2 too
        "n": 4 * n if moe else n, "k": 32 * rng.randint(1, 4096), "experts": experts,
        "topk": rng.randint(1, experts) if moe else 0, "config": {"chunk_n": chunk},
        "median_us": median, "spread_us": rng.uniform(0.0, median), "samples": rng.randint(1, 10**6),
        "default_median_us": rng.choice([None, rng.uniform(0.5, 5e4)]),
        "backend_source": "%016x" % rng.getrandbits(64), "created_at": _timestamp(rng), "env_key": env_key,
    }


def valid_doc(rng: random.Random, n_records: int | None = None) -> dict[str, Any]:
    n_records = rng.randint(1, 12) if n_records is None else n_records
    ns = rng.sample(range(1, 4096), n_records)
    return {
        "autofp4": "0.1.0", "environments": {ENV_KEY: dict(ENV)}, "exported_at": _timestamp(rng),
        "records": [valid_record(rng, 16 * n) for n in ns], "schema_version": 1,
    }


def dumps(doc: Any) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------
# hostile input: cases
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """``write(dir)`` makes the input and returns its path; ``expect``: "reject" or "accept";
    ``needles``: what the error must name besides the file."""

    name: str
    write: Callable[[Path], Path]
    expect: str = "reject"
    needles: tuple[str, ...] = ()


def _text_case(name: str, text: str | bytes, expect: str = "reject", needles: tuple[str, ...] = (),
               filename: str = "in.json") -> Case:
    def write(d: Path) -> Path:
        p = d / filename
        p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        return p
    return Case(name, write, expect, needles)


def _doc_case(name: str, doc: dict, needles: tuple[str, ...] = (), expect: str = "reject") -> Case:
    return _text_case(name, dumps(doc), expect, needles)


def _wrong_types(field: str) -> list[Any]:
    if field in ("op", "fmt", "dtype", "backend", "backend_source", "created_at", "env_key"):
        return [None, True, 0, 1.5, [], {}, ["reference"]]
    if field in ("m_bucket", "n", "k", "experts", "topk", "samples"):
        return [None, True, False, "16", 16.0, 1.5, [], {}, [16]]
    if field in ("median_us", "spread_us"):
        return [None, True, False, "40", "1e1", [], {}, [40.0]]
    if field == "default_median_us":
        return [True, "50", [], {}]
    if field == "config":
        return [None, True, 1, "chunk_n", [], [["chunk_n", 0]]]
    raise AssertionError(field)


def _bad_values(field: str, rng: random.Random, rec: dict) -> list[Any]:
    """Out-of-range and huge values of ``field`` (each one invalid)."""
    huge_text = "x" * rng.randint(10**5, 10**6)
    unknown = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(1, 20)))
    table: dict[str, list[Any]] = {
        "op": ["conv", "", "LINEAR", huge_text],
        "fmt": ["fp8", "nvfp4 ", "", huge_text],
        "dtype": ["float32", "bf16", huge_text],
        "backend": [f"no_{unknown}", "evil", "", "x" * 65, "../reference", "reference\x00", huge_text],
        "m_bucket": [0, -1, -2**63, rng.randint(TOP_BUCKET + 1, 2**20), 2**20 + 1, 2**64, 10**100],
        "n": [0, -16, 2**20 + 16, 2**64, 10**100],
        "k": [0, -32, 2**20 + 32, 2**64, 10**100],
        "samples": [0, -1, 10**7 + 1, 2**64, 10**100],
        "median_us": [0.0, -1.0, -0.0, 1.5e9, 1e308],
        "spread_us": [-1.0, -1e-9, 1e10, 1e308],
        "default_median_us": [0.0, -1.0, 1e10, 1e308],
        "created_at": ["", "2025-13-01T00:00:00Z", "2025-01-01T00:00:00+02:00", "2025-01-01T00:00:00",
                       "yesterday", "9999-99-99", "2025-01-01T00:00:00Z" + "x" * 50, huge_text],
        "backend_source": ["has space", "x" * 65, "../etc/passwd", "\u00e9", huge_text],
        "env_key": ["%016x" % rng.getrandbits(64), "XYZ", "0" * 15, "0" * 17, ENV_KEY.upper() + "A", huge_text],
        "config": [
            {"chunk_n": 0, unknown: 1}, {"chunk_n": -16}, {"chunk_n": 17}, {"chunk_n": rec["n"]},
            {"chunk_n": 2**31 + 16}, {"chunk_n": 10**100}, {"chunk_n": {"a": 1}}, {"chunk_n": [0]},
            {"kernel": "decode", "chunk_n": 0}, {f"k{i}": i for i in range(65)}, {"x" * 65: 0},
            {"chunk_n": huge_text}, {"chunk_n": 1e300},
        ],
    }
    if rec["op"] == "linear":
        table["experts"] = [1, 7, -1, 2**16 + 1, 10**100]
        table["topk"] = [1, -1, 2**16 + 1]
    else:
        table["experts"] = [0, -1, 2**16 + 1, 10**100]
        table["topk"] = [0, rec["experts"] + 1, -1]
    return table[field]


RECORD_FIELDS = ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k", "experts", "topk", "config",
                 "median_us", "spread_us", "samples", "default_median_us", "backend_source", "created_at",
                 "env_key")
REQUIRED_FIELDS = ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k", "config", "median_us", "spread_us",
                   "samples", "env_key")
ENV_FIELDS = tuple(ENV)


def record_cases(rng: random.Random) -> list[Case]:
    """Each field of a record mutated: wrong types, out-of-range and huge values, removed."""
    cases = []
    for field in RECORD_FIELDS:
        doc = valid_doc(rng)
        i = rng.randrange(len(doc["records"]))
        bad = _wrong_types(field) + _bad_values(field, rng, doc["records"][i])
        for j, value in enumerate(bad):
            d = json.loads(json.dumps(doc))
            d["records"][i][field] = value
            cases.append(_doc_case(f"record.{field}={type(value).__name__}#{j}", d, (f"record #{i}", field)))
        if field in REQUIRED_FIELDS:
            d = json.loads(json.dumps(doc))
            del d["records"][i][field]
            cases.append(_doc_case(f"record.{field} missing", d, (f"record #{i}", field)))
    for j in range(4):  # a whole record of the wrong shape
        doc = valid_doc(rng)
        i = rng.randrange(len(doc["records"]))
        doc["records"][i] = [None, 5, "record", [doc["records"][i]]][j]
        cases.append(_doc_case(f"record is a {type(doc['records'][i]).__name__}", doc, (f"record #{i}",)))
    doc = valid_doc(rng)
    i = rng.randrange(len(doc["records"]))
    doc["records"][i]["extra"] = 1
    cases.append(_doc_case("record with an extra key", doc, (f"record #{i}", "extra")))
    return cases


def environment_cases(rng: random.Random) -> list[Case]:
    cases = []
    for field in ENV_FIELDS:
        wrong = [None, "132", True, 1.5, [], {}] if field == "sm_count" else [None, 5, True, [], {}]
        for value in wrong + ["x" * rng.randint(257, 10**5)]:
            doc = valid_doc(rng)
            doc["environments"][ENV_KEY][field] = value
            cases.append(_doc_case(f"env.{field}={type(value).__name__}", doc, (field,)))
        doc = valid_doc(rng)
        del doc["environments"][ENV_KEY][field]
        if field != "cutlass_dsl":  # has a default: the key then no longer matches
            cases.append(_doc_case(f"env.{field} missing", doc, (field,)))
    for value in (0, 2**16 + 1, -1):
        doc = valid_doc(rng)
        doc["environments"][ENV_KEY]["sm_count"] = value
        cases.append(_doc_case(f"env.sm_count={value}", doc, ("sm_count",)))
    doc = valid_doc(rng)
    doc["environments"][ENV_KEY]["compute_capability"] = "9"
    cases.append(_doc_case("env.compute_capability=9", doc, ("compute_capability",)))
    doc = valid_doc(rng)
    doc["environments"][ENV_KEY]["extra"] = "x"
    cases.append(_doc_case("env with an extra key", doc, ("extra",)))
    doc = valid_doc(rng)
    doc["environments"][ENV_KEY]["driver"] = "999.1"  # the key no longer matches the fields
    cases.append(_doc_case("env key mismatch", doc, ("does not match",)))
    doc = valid_doc(rng)
    doc["environments"] = {"NOTHEX": doc["environments"][ENV_KEY]}
    cases.append(_doc_case("env key not hex", doc, ("environments",)))
    return cases


def header_cases(rng: random.Random) -> list[Case]:
    cases = []
    for value in (0, 2, 99, "1", 1.0, True, None, [1]):
        doc = valid_doc(rng)
        doc["schema_version"] = value
        cases.append(_doc_case(f"schema_version={value!r}", doc, ("schema_version",)))
    for field, values in {
        "exported_at": [5, "", "nope", "2025-01-01T00:00:00", None],
        "autofp4": [5, None, "x" * 257, []],
        "records": [5, "x", None, {}],
        "environments": [[], "x", None, 5],
    }.items():
        for value in values:
            doc = valid_doc(rng)
            doc[field] = value
            cases.append(_doc_case(f"{field}={type(value).__name__}", doc, (field,)))
    for field in ("exported_at", "autofp4", "records", "environments", "schema_version"):
        doc = valid_doc(rng)
        del doc[field]
        cases.append(_doc_case(f"{field} missing", doc, (field,)))
    doc = valid_doc(rng)
    doc["code"] = "__import__('os').system('true')"
    cases.append(_doc_case("extra top-level key", doc, ("code",)))
    return cases


def _sqlite_db(path: Path, rng: random.Random) -> Path:
    with TuningDB(path) as db:
        db.import_file(_write(path.with_suffix(".src.json"), dumps(valid_doc(rng))))
    return path


def _big_db(path: Path, rng: random.Random, n: int = 1500) -> Path:
    """A database of ``n`` rows (many pages, so a cut or damage lands in the rows)."""
    doc = valid_doc(rng, 0)
    doc["records"] = [valid_record(rng, 16 * i) for i in range(1, n + 1)]
    with TuningDB(path) as db:
        db.import_file(_write(path.with_suffix(".src.json"), dumps(doc)))
    return path


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def file_cases(rng: random.Random) -> list[Case]:
    """Files that are not exports, broken JSON, and exports that are valid in unusual ways."""
    good = dumps(valid_doc(rng))
    cases = []
    for j in range(12):
        cut = rng.randrange(1, len(good) - 1)
        cases.append(_text_case(f"truncated at {cut}", good[:cut]))
    cases.append(_text_case("truncated before the final newline", good[:-1], expect="accept"))
    for j in range(6):
        cases.append(_text_case(f"random bytes #{j}", rng.randbytes(rng.randint(1, 1 << 16))))
    cases.append(_text_case("random printable text",
                            "".join(rng.choice("{}[]\":,0123456789abcdefnulltrue \n") for _ in range(4096))))
    for shape in ([], [json.loads(good)], 1, -2.5, "export", None, True, {}, {"records": []}):
        cases.append(_text_case(f"JSON {type(shape).__name__} {str(shape)[:20]}", json.dumps(shape)))
    cases += [
        _text_case("empty file", ""),
        _text_case("whitespace only", " \n\t " * 100),
        _text_case("byte order mark", "\ufeff" + good),
        _text_case("UTF-16", good.encode("utf-16")),
        _text_case("latin-1 byte in a string", good.replace('"0.1.0"', '"0.1.\xe9"', 1).encode("latin-1")),
        _text_case("NaN literal", good.replace('"median_us": ', '"median_us": NaN, "_": ', 1), needles=("NaN",)),
        _text_case("Infinity literal", good.replace('"spread_us": ', '"spread_us": Infinity, "_": ', 1),
                   needles=("Infinity",)),
        _text_case("5000-digit integer", good.replace('"samples": ', '"samples": ' + "9" * 5000 + ', "_": ', 1)),
        _text_case("trailing garbage", good + "garbage"),
        _text_case("two documents", good + good),
        _text_case("trailing comma", good.rstrip().rstrip("}").rstrip() + ",}"),
        _text_case("a comment", "// export\n" + good),
        _text_case("single quotes", good.replace('"', "'")),
        _text_case("control character in a string", good.replace('"0.1.0"', '"0.1\x01.0"', 1)),
        _text_case("deep nesting in a config", good.replace('"config": {', '"config": {"a": ' + "[" * 5000 + "]" * 5000 + ", ", 1)),
        _text_case("valid with whitespace padding", good.replace(",", "," + " " * 2000), expect="accept"),
        _text_case("valid, compact", json.dumps(json.loads(good), separators=(",", ":")), expect="accept"),
        _text_case("valid, records first, version first",
                   json.dumps(dict(sorted(json.loads(good).items(), key=lambda kv: (kv[0] != "schema_version",
                                                                                  kv[0] != "records")))),
                   expect="accept"),
        _text_case("valid, duplicate records key (the last wins)",
                   good.rstrip()[:-1] + ', "records": ' + json.dumps(valid_doc(rng)["records"]) + "}",
                   expect="accept"),
        _text_case("valid, no optional fields",
                   dumps({**json.loads(good), "records": [
                       {k: v for k, v in r.items() if k not in ("default_median_us", "backend_source")}
                       for r in json.loads(good)["records"]]}), expect="accept"),
    ]
    cases += [_doc_case(f"valid doc #{j}", valid_doc(rng, rng.randint(0, 40)), expect="accept") for j in range(6)]

    def sqlite_named(name: str) -> Callable[[Path], Path]:
        return lambda d: _sqlite_db(d / name, rng)

    def truncated_sqlite(d: Path) -> Path:
        p = _sqlite_db(d / "t.db", rng)
        data = p.read_bytes()
        return _write(d / "cut.db", data[: rng.randrange(100, len(data))])

    def empty_sqlite(d: Path) -> Path:
        sqlite3.connect(d / "e.db").execute("CREATE TABLE x (a)").connection.close()
        return d / "e.db"

    def directory(d: Path) -> Path:
        (d / "adir.json").mkdir()
        return d / "adir.json"

    def symlink_loop(d: Path) -> Path:
        os.symlink(d / "loop-b.json", d / "loop-a.json")
        os.symlink(d / "loop-a.json", d / "loop-b.json")
        return d / "loop-a.json"

    def dangling(d: Path) -> Path:
        os.symlink(d / "nowhere.json", d / "dangling.json")
        return d / "dangling.json"

    def link_to_dir(d: Path) -> Path:
        (d / "realdir").mkdir()
        os.symlink(d / "realdir", d / "linkdir.json")
        return d / "linkdir.json"

    def link_to_good(d: Path) -> Path:
        _write(d / "real.json", good)
        os.symlink(d / "real.json", d / "link.json")
        return d / "link.json"

    cases += [
        Case("SQLite tuning database (.db)", sqlite_named("tuning.db"), needles=("SQLite", "autofp4 db merge")),
        Case("SQLite tuning database named .json", sqlite_named("tuning.json"), needles=("SQLite", "autofp4 db merge")),
        Case("truncated SQLite file", truncated_sqlite, needles=("SQLite",)),
        Case("SQLite database of another program", empty_sqlite, needles=("SQLite",)),
        Case("a directory", directory, needles=("directory",)),
        Case("a symlink to a directory", link_to_dir, needles=("directory",)),
        Case("a missing file", lambda d: d / "missing.json", needles=("no such file",)),
        Case("a dangling symlink", dangling),
        Case("a symlink loop", symlink_loop),
        Case("a symlink to a valid export", link_to_good, expect="accept"),
        Case("/dev/null", lambda d: Path("/dev/null")),
    ]
    return cases


def import_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    return file_cases(rng) + header_cases(rng) + environment_cases(rng) + record_cases(rng)


# --------------------------------------------------------------------------------------
# running one case: the library and the command line
# --------------------------------------------------------------------------------------
def _snapshot(path: Path) -> list:
    with contextlib.closing(sqlite3.connect(path)) as c:
        return [c.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("results", "environments", "trials")]


def _integrity(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as c:
        return c.execute("PRAGMA integrity_check").fetchone()[0]


def _target(d: Path) -> Path:
    """A database holding rows of another environment (which an import must leave alone)."""
    d.mkdir(parents=True, exist_ok=True)
    p = d / "target.db"
    rng = random.Random(7)
    doc = valid_doc(rng, 3)
    okey = Environment(**OTHER_ENV).key()
    doc["environments"] = {okey: OTHER_ENV}
    for r in doc["records"]:
        r["env_key"] = okey
    with TuningDB(p) as db:
        db.import_file(_write(d / "seed.json", dumps(doc)))
    return p


def _expected_rows(path: Path) -> list[dict]:
    """The rows an accepted file must leave in the DB: its records, the last of a repeated key
    (the test documents hold no repeated key)."""
    raw = json.loads(path.read_text())
    return sorted((_canon(ExportedRecord.model_validate(r).model_dump()) for r in raw["records"]), key=repr)


def _canon(d: dict) -> dict:
    d = dict(d)
    d.pop("env", None)
    d.pop("env_key", None)
    return d


@dataclasses.dataclass
class Outcome:
    kind: str  # clear | imported | crashed | silent | unclear | wrong
    detail: str = ""


def classify_library(case: Case, d: Path) -> Outcome:
    target = _target(d)
    before = _snapshot(target)
    path = case.write(d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TuningDBWarning)
            with TuningDB(target) as db:
                db.import_file(path)
    except (TuningFileError, TuningDBError) as e:
        out = _judge_error(case, path, str(e))
    except (Exception, RecursionError, MemoryError) as e:
        out = Outcome("crashed", f"{type(e).__name__}: {str(e)[:200]}")
    else:
        if case.expect == "reject":
            out = Outcome("silent", "imported")
        else:
            with TuningDB(target) as db:
                got = sorted((_canon(r.model_dump()) for r in db.results(ENV_KEY)), key=repr)
            out = Outcome("imported") if got == _expected_rows(path) else Outcome("wrong", "rows differ")
    if _integrity(target) != "ok":
        return Outcome("crashed", "integrity_check failed")
    if out.kind == "clear" and _snapshot(target) != before:
        return Outcome("crashed", "a rejected import wrote rows")
    return out


def _judge_error(case: Case, path: Path, msg: str) -> Outcome:
    if case.expect == "accept":
        return Outcome("wrong", f"rejected a valid file: {msg[:300]}")
    first = msg.splitlines()[0] if msg else ""
    named = re.sub(r"records\[(\d+)\]", r"record #\1", msg)  # either way of naming a record
    missing = [n for n in (str(path), *case.needles) if n not in named]
    if missing or str(path) not in first:
        return Outcome("unclear", f"{first[:300]!r} does not name {missing or ['the file on its first line']}")
    return Outcome("clear", first[:200])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autofp4")
    add_db_parser(p.add_subparsers(dest="command", required=True))
    return p


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningDBWarning)
        rc = run_db(_parser().parse_args(["db", *map(str, argv)]), out, err)
    return rc, out.getvalue(), err.getvalue()


def judge_cli(rc: int, err: str, names: tuple[str, ...]) -> Outcome:
    """Exit code 2 and one ``error:`` message whose first line names ``names``."""
    lines = err.splitlines()
    if rc != 2:
        return Outcome("silent" if rc == 0 else "unclear", f"exit code {rc}: {err[:200]!r}")
    if not lines or not lines[0].startswith("error: ") or err.count("error:") != 1 or "Traceback" in err:
        return Outcome("unclear", f"not one error message: {err[:300]!r}")
    missing = [n for n in names if n not in lines[0]]
    if missing:
        return Outcome("unclear", f"{lines[0][:300]!r} does not name {missing}")
    return Outcome("clear", lines[0][:200])


def classify_cli(case: Case, d: Path) -> Outcome:
    target = _target(d)
    before = _snapshot(target)
    path = case.write(d)
    try:
        rc, _, err = cli("import", path, "--db", target)
    except (Exception, RecursionError, MemoryError) as e:
        return Outcome("crashed", f"{type(e).__name__}: {str(e)[:200]}")
    if case.expect == "accept":
        out = Outcome("imported") if rc == 0 else Outcome("wrong", err[:300])
    else:
        out = judge_cli(rc, err, (str(path),))
    if _integrity(target) != "ok" or (rc != 0 and _snapshot(target) != before):
        return Outcome("crashed", "the target database changed or is damaged")
    return out


# --------------------------------------------------------------------------------------
# the import fuzz
# --------------------------------------------------------------------------------------
#: the cases are drawn from this seed (printed by a failing test; AUTOFP4_FUZZ_SEED replays it)
SEED = int(os.environ.get("AUTOFP4_FUZZ_SEED") or int.from_bytes(os.urandom(4), "little"))
CASES = import_cases(SEED)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_import_hostile_file(case, tmp_path):
    print(f"random seed: {SEED}")
    lib = classify_library(case, tmp_path / "lib")
    assert lib.kind in ("clear", "imported"), f"{case.name}: library: {lib.kind}: {lib.detail}"
    assert lib.kind == ("imported" if case.expect == "accept" else "clear")
    got = classify_cli(case, tmp_path / "cli")
    assert got.kind in ("clear", "imported"), f"{case.name}: command line: {got.kind}: {got.detail}"


# --------------------------------------------------------------------------------------
# M buckets: a row the dispatcher would never use is refused
# --------------------------------------------------------------------------------------
def _served(m_bucket: int) -> bool:
    """Does the dispatcher run a row tuned at ``m_bucket`` (config chunk_n=1024) for some M?"""
    from autofp4.dispatch import Dispatcher
    from autofp4.problem import ProblemKey

    data = {**valid_record(random.Random(1), 4096), "op": "linear", "experts": 0, "topk": 0,
            "m_bucket": m_bucket, "config": {"chunk_n": 1024}, "backend_source": ""}  # not judged stale
    data.pop("env_key")
    rec = TuningRecord.model_validate({**data, "env": ENV})
    d = Dispatcher("cpu", [rec], env=rec.env, misses_file=os.devnull)
    key = ProblemKey(rec.op, rec.fmt, rec.dtype, rec.n, rec.k)
    assert d.pick(ProblemKey(rec.op, rec.fmt, rec.dtype, 2 * rec.n, rec.k), 1)[1].chunk_n != 1024  # the default
    ms = {1, m_bucket, max(1, m_bucket - 1), m_bucket + 1, 2 * TOP_BUCKET, *DEFAULT_M_BUCKETS}
    return any(d.pick(key, m)[1].chunk_n == 1024 for m in ms)


def test_import_refuses_dead_m_buckets(tmp_path):
    """A bucket is refused exactly when the dispatcher would never run its row."""
    rng = random.Random(SEED)
    buckets = [rng.randint(1, 2**20) for _ in range(12)] + [rng.randint(1, TOP_BUCKET) for _ in range(4)]
    for j, b in enumerate(buckets + [TOP_BUCKET, TOP_BUCKET + 1, 1, 100]):
        doc = valid_doc(rng, 3)
        i = rng.randrange(3)
        doc["records"][i].update(m_bucket=b)
        path = _write(tmp_path / f"b{b}.json", dumps(doc))
        target = _target(tmp_path / f"lib{j}")
        before = _snapshot(target)
        served = _served(b)
        try:
            with TuningDB(target) as db:
                db.import_file(path)
        except TuningFileError as e:
            assert not served, f"m_bucket={b} is served by the dispatcher but was refused: {e}"
            msg = str(e).splitlines()[0]
            assert str(path) in msg and f"record #{i}" in msg and "m_bucket" in msg and str(TOP_BUCKET) in msg
            assert _snapshot(target) == before
        else:
            assert served, f"m_bucket={b}: imported a row the dispatcher never uses"
        rc, _, err = cli("import", path, "--db", _target(tmp_path / f"cli{j}"))
        assert (rc == 0) == served, err


def test_rows_of_unused_buckets_in_an_older_db_are_named_and_pruned(tmp_path):
    """A database an older autofp4 tuned with ``--m 10000`` holds a row of a bucket the
    dispatcher never looks up: merging it (or importing its export) is refused with the way out
    named; ``db prune --unused-buckets`` deletes exactly those rows, after which the merge takes
    every other row."""
    rng = random.Random(SEED)
    doc = valid_doc(rng, 6)
    src = tmp_path / "old.db"
    assert cli("import", _write(tmp_path / "good.json", dumps(doc)), "--db", src)[0] == 0
    dead = rng.randrange(6)
    with contextlib.closing(sqlite3.connect(src)) as c, c:
        c.execute("UPDATE results SET m_bucket = 10000 WHERE n = ?", (doc["records"][dead]["n"],))
    target = _target(tmp_path / "t")
    before = _snapshot(target)
    rc, _, err = cli("merge", src, "--db", target)
    assert rc == 2 and "10000" in err and "prune --unused-buckets" in err, err
    assert _snapshot(target) == before
    rc, out, err = cli("prune", "--unused-buckets", "--db", src)
    assert rc == 0 and "deleted 1 rows" in out, (out, err)
    with contextlib.closing(sqlite3.connect(src)) as c:
        left = {n for (n,) in c.execute("SELECT n FROM results")}
    assert left == {r["n"] for i, r in enumerate(doc["records"]) if i != dead}
    rc, out, err = cli("merge", src, "--db", target)
    assert rc == 0, err
    with contextlib.closing(sqlite3.connect(target)) as c:
        assert left <= {n for (n,) in c.execute("SELECT n FROM results")}
    assert cli("prune", "--unused-buckets", "--stale", "--db", src)[0] == 2  # one criterion alone


# --------------------------------------------------------------------------------------
# size bombs: rejected before they allocate much
# --------------------------------------------------------------------------------------
BOMB_MB = 64


def _bomb_cases() -> list[tuple[str, Callable[[Path], Path], str]]:
    """(name, write(dir) -> path, expect)."""
    big = BOMB_MB * 2**20

    def sparse_gb(d: Path) -> Path:
        p = d / "sparse.json"
        with open(p, "wb") as f:
            f.truncate(2**30)
        return p

    def stream(name: str, head: str, body: str, tail: str) -> Callable[[Path], Path]:
        def write(d: Path) -> Path:
            p = d / name
            with open(p, "w") as f:
                f.write(head)
                reps = max(1, big // len(body))
                chunk = body * min(reps, 1 << 16)
                for _ in range(reps // (1 << 16) or 1):
                    f.write(chunk)
                f.write(tail)
            return p
        return write

    def padded(d: Path) -> Path:
        """Whitespace between the top-level members and between the records."""
        text = dumps(valid_doc(random.Random(3), 5))
        pad = " " * (big // 8)
        text = text.replace(',\n  "', "," + pad + '\n  "').replace("},\n    {", "}," + pad + "\n    {")
        assert len(text) > big
        return _write(d / "padded.json", text)

    return [
        ("1 GiB sparse file", sparse_gb, "reject"),
        ("nested arrays at the top", stream("nest.json", "", "[", ""), "reject"),
        ("nested arrays in records", stream("nest2.json", '{"records": ', "[", ""), "reject"),
        ("nested objects in a config", stream("nest3.json", '{"schema_version": 1, "records": [{"config": ',
                                              '{"a":', ""), "reject"),
        ("10 million records", stream("many.json", '{"schema_version": 1, "records": [', "{},", "{}]}"), "reject"),
        ("10 million numbers", stream("nums.json", '{"schema_version": 1, "records": [', "1,", "1]}"), "reject"),
        ("huge string in the header", stream("str.json", '{"autofp4": "', "x", '"}'), "reject"),
        ("huge string in a record", stream("str2.json", '{"records": [{"backend": "', "x", '"}]}'), "reject"),
        ("huge key", stream("key.json", '{"', "k", '": 1}'), "reject"),
        ("huge number", stream("num.json", '{"schema_version": 1', "0", "}"), "reject"),
        ("many environments", stream("envs.json", '{"environments": {', '"%016x": {},' % 0, '"x": 1}}'), "reject"),
        ("valid, padded with whitespace", padded, "accept"),
    ]


BOMBS = _bomb_cases()


@pytest.fixture(scope="module")
def bomb_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bombs")


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        try:
            result: Any = fn()
        except (Exception, RecursionError, MemoryError) as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name,write,expect", BOMBS, ids=[b[0] for b in BOMBS])
def test_size_bomb_bounded_memory(name, write, expect, bomb_dir, tmp_path):
    from autofp4.db import read_export

    path = write(bomb_dir)
    result, peak = _peak(lambda: read_export(path))
    assert peak < MEMORY_BOUND, f"{name}: {peak / 2**20:.0f} MiB allocated"
    if expect == "reject":
        assert isinstance(result, TuningFileError), f"{name}: {type(result).__name__}: {str(result)[:200]}"
        assert str(path) in str(result).splitlines()[0]
    else:
        assert not isinstance(result, BaseException), result
        assert len(result.records) == 5
    # the dispatcher's loading of a shipped export is bounded too (the layer is skipped with a warning)
    ship = tmp_path / "ship"
    ship.mkdir()
    os.symlink(path, ship / "bomb.json")
    os.environ["AUTOFP4_SHIPPED_DB"] = str(ship)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TuningDBWarning)
            result, peak = _peak(lambda: load_layers(Environment(**ENV), tmp_path / "none.db"))
    finally:
        del os.environ["AUTOFP4_SHIPPED_DB"]
    assert peak < MEMORY_BOUND, f"{name} as a shipped layer: {peak / 2**20:.0f} MiB allocated"
    assert not isinstance(result, BaseException), result


def test_a_fifo_in_the_shipped_db_folder_is_skipped_not_waited_on(tmp_path, monkeypatch):
    """A FIFO named like an export in $AUTOFP4_SHIPPED_DB: open() would wait for a writer forever;
    the layer is skipped with a warning naming it."""
    ship = tmp_path / "ship"
    ship.mkdir()
    os.mkfifo(ship / "x.json")
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(ship))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_layers(Environment(**ENV), tmp_path / "none.db")
    said = [str(w.message) for w in caught if issubclass(w.category, TuningDBWarning)]
    assert any("x.json" in m and "not a regular file" in m for m in said), said
    from autofp4.db import read_export

    with pytest.raises(TuningFileError, match="not a regular file"):
        read_export(ship / "x.json")


def test_endless_device_file_is_bounded():
    """A file whose size is not known up front (a character device that never ends)."""
    from autofp4.db import read_export

    result, peak = _peak(lambda: read_export("/dev/zero"))
    assert peak < MEMORY_BOUND
    assert isinstance(result, TuningFileError) and "/dev/zero" in str(result)


def test_import_limit_is_checked_while_reading(tmp_path, monkeypatch):
    """The byte limit holds for what is read, not only for what ``stat`` says."""
    import autofp4.db as dbmod
    from autofp4.db import read_export

    text = dumps(valid_doc(random.Random(SEED), 30))
    path = _write(tmp_path / "x.json", text)
    monkeypatch.setattr(dbmod, "MAX_IMPORT_BYTES", len(text) - 1)
    with pytest.raises(TuningFileError, match="limit") as ei:
        read_export(path)
    assert str(path) in str(ei.value)
    monkeypatch.setattr(dbmod, "MAX_IMPORT_BYTES", len(text))
    assert len(read_export(path).records) == 30
    assert MAX_IMPORT_BYTES == 256 * 2**20


# --------------------------------------------------------------------------------------
# databases that cannot be written
# --------------------------------------------------------------------------------------
def _writable(path: Path) -> bool:
    try:
        with open(path, "r+b"):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def read_only(db: Path, how: str) -> Iterator[None]:
    """Make ``db`` (and its folder) unwritable for this process.

    ``how``: "file" (the file and its WAL files), "folder" (the folder too). A normal user gets
    ``chmod``; root, whom ``chmod`` does not stop, gets the immutable attribute (``chattr +i``).
    Skips when neither stops this process from writing.
    """
    targets = [p for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")) if p.exists()]
    if how == "folder":
        targets.append(db.parent)
    root = os.geteuid() == 0
    undo: list[Callable[[], None]] = []
    try:
        for p in targets:
            if root:
                r = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
                if r.returncode != 0:
                    pytest.skip(f"running as root, where chmod does not stop writes, and chattr +i fails: "
                                f"{r.stderr.strip()}")
                undo.append(lambda p=p: subprocess.run(["chattr", "-i", str(p)], check=True))
            else:
                mode = p.stat().st_mode
                p.chmod(0o555 if p.is_dir() else 0o444)
                undo.append(lambda p=p, mode=mode: p.chmod(mode))
        if _writable(db):
            pytest.skip("this process can write the file whatever its permissions")
        yield
    finally:
        for u in reversed(undo):
            u()


def _ro_db(d: Path) -> Path:
    p = d / "ro" / "t.db"
    p.parent.mkdir(parents=True)
    rng = random.Random(SEED)
    with TuningDB(p) as db:
        db.import_file(_write(d / "seed.json", dumps(valid_doc(rng, 4))))
    return p


def _other_export(d: Path) -> Path:
    return _write(d / "other.json", dumps(valid_doc(random.Random(SEED + 1), 3)))


@pytest.mark.parametrize("how", ["file", "folder"])
def test_read_only_database_library(tmp_path, how):
    db_path = _ro_db(tmp_path)
    export = _other_export(tmp_path)
    before = _snapshot(db_path)
    with read_only(db_path, how):
        with TuningDB(db_path, readonly=True) as db:
            rec = db.results()[0]
        try:
            db = TuningDB(db_path)
        except TuningDBError as e:  # in a read-only folder SQLite cannot even set up a writer
            assert how == "folder" and str(db_path) in str(e) and "read-only" in str(e), e
            db = None
        with contextlib.closing(db) if db is not None else contextlib.nullcontext():
            writes = {} if db is None else {
                "import_file": lambda: db.import_file(export),
                "merge": lambda: db.merge(export),
                "prune": lambda: db.prune(failed_trials=True),
                "upsert_result": lambda: db.upsert_result(rec),
                "delete_results": lambda: db.delete_results([rec]),
                "add_environment": lambda: db.add_environment(rec.env),
            }
            for name, fn in writes.items():
                with pytest.raises(TuningDBError) as ei:
                    fn()
                msg = str(ei.value)
                assert str(db_path) in msg and "read-only" in msg, (name, msg)
            assert db is None or len(db.results()) == 4  # reading still works
        with TuningDB(db_path, readonly=True) as db:
            assert len(db.results()) == 4
    assert _snapshot(db_path) == before and _integrity(db_path) == "ok"


def test_query_only_connection_is_read_only(tmp_path):
    """The same errors where SQLite itself refuses writes (a read-only connection), which needs no
    file permissions to set up."""
    db_path = _ro_db(tmp_path)
    export = _other_export(tmp_path)
    with TuningDB(db_path) as db:
        db._conn.execute("PRAGMA query_only = 1")
        for fn in (lambda: db.import_file(export), lambda: db.prune(failed_trials=True),
                   lambda: db.upsert_result(db.results()[0])):
            with pytest.raises(TuningDBError, match="read-only") as ei:
                fn()
            assert str(db_path) in str(ei.value)
    assert _integrity(db_path) == "ok"


@pytest.mark.parametrize("how", ["file", "folder"])
def test_read_only_database_cli(tmp_path, how):
    db_path = _ro_db(tmp_path)
    export = _other_export(tmp_path)
    before = _snapshot(db_path)
    with read_only(db_path, how):
        for argv in (("import", export), ("import", export, "--replace"), ("merge", export),
                     ("prune", "--failed-trials"), ("prune", "--older-than-days", "0"), ("prune", "--stale")):
            rc, _, err = cli(*argv, "--db", db_path)
            got = judge_cli(rc, err, (str(db_path), "read-only"))
            assert got.kind == "clear", (argv, got)
        for argv in (("list",), ("show",), ("export", "--out", tmp_path / "out.json"), ("diff", export)):
            rc, out, err = cli(*argv, "--db", db_path)
            assert rc in (0, 1), (argv, err)
    assert _snapshot(db_path) == before and _integrity(db_path) == "ok"


@pytest.mark.parametrize("left", ["db-alone", "crashed-writer"])
def test_the_dispatcher_uses_the_rows_of_a_db_in_a_read_only_folder(tmp_path, left):
    """``$AUTOFP4_DB`` in a folder this process cannot write to: the dispatcher's lookups use its
    rows, also those still in the WAL file of a writer that died before a checkpoint, and the
    files stay as they were."""
    import shutil

    import torch

    from autofp4 import backends as registry
    from autofp4 import dispatch
    from autofp4.backends.reference import ReferenceConfig
    from autofp4.env import current_environment
    from autofp4.problem import ProblemKey

    key = ProblemKey("linear", "nvfp4", "bfloat16", 512, 256)
    cpu = torch.device("cpu")

    def rec(m_bucket: int, chunk_n: int) -> TuningRecord:
        return TuningRecord(
            op=key.op, fmt=key.fmt, dtype=key.dtype, backend="reference", m_bucket=m_bucket, n=key.n, k=key.k,
            config={"chunk_n": chunk_n}, median_us=10.0, spread_us=0.5, samples=10, default_median_us=12.0,
            backend_source=dispatch.backend_source_hash(registry.get_backend("reference"), {"chunk_n": chunk_n}),
            env=current_environment(cpu))

    work, ro = tmp_path / "work", tmp_path / "ro"
    work.mkdir()
    ro.mkdir()
    db = TuningDB(work / "u.db")
    db.upsert_result(rec(16, 64))
    if left == "db-alone":
        db.close()
    else:  # a second row committed to the WAL, then the files copied as a killed writer leaves them
        db.upsert_result(rec(128, 32))
        assert (work / "u.db-wal").stat().st_size > 0
    for f in work.iterdir():
        shutil.copy(f, ro / f.name)
    if left != "db-alone":
        db.close()
    path = ro / "u.db"
    files = {f.name: f.read_bytes() for f in ro.iterdir()}
    with read_only(path, "folder"):
        dispatch.set_db(path)
        try:
            d = dispatch.get_dispatcher(cpu)
            assert d.pick(key, 16)[1] == ReferenceConfig(chunk_n=64)
            if left != "db-alone":
                assert d.pick(key, 128)[1] == ReferenceConfig(chunk_n=32)
        finally:
            dispatch.set_db(None)
    assert {f.name: f.read_bytes() for f in ro.iterdir()} == files


TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000}


def _tune(argv: list) -> tuple[int, str, str]:
    from autofp4 import dispatch
    from autofp4.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        rc = main([str(a) for a in argv], out=out, err=err)
    finally:
        dispatch.set_db(None)
    return rc, out.getvalue(), err.getvalue()


def test_tune_into_read_only_database(tmp_path):
    db_path = _ro_db(tmp_path)
    model = _write(tmp_path / "tiny.json", json.dumps(TINY))
    before = _snapshot(db_path)
    with read_only(db_path, "folder"):
        rc, out, err = _tune(["tune", "--model", model, "--db", db_path, "--no-progress", "--device", "cpu",
                              "--m", "1"])
    got = judge_cli(rc, err, (str(db_path), "read-only"))
    assert got.kind == "clear", got
    assert _snapshot(db_path) == before and _integrity(db_path) == "ok"


def test_read_only_cli_as_subprocess(tmp_path):
    """The real command: one line on stderr, no traceback."""
    db_path = _ro_db(tmp_path)
    export = _other_export(tmp_path)
    with read_only(db_path, "folder"):
        r = subprocess.run([sys.executable, "-m", "autofp4", "db", "import", str(export), "--db", str(db_path)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(db_path) in lines[0] and "read-only" in lines[0], r.stderr


# --------------------------------------------------------------------------------------
# hostile database files: each command says what is wrong with which file
# --------------------------------------------------------------------------------------
def db_file_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)

    def good(d: Path, name: str = "g.db") -> Path:
        return _sqlite_db(d / name, rng)

    def garbage(d: Path) -> Path:
        return _write(d / "garbage.db", rng.randbytes(rng.randint(1, 1 << 15)))

    def magic_then_garbage(d: Path) -> Path:
        return _write(d / "magic.db", SQLITE_MAGIC + rng.randbytes(rng.randint(100, 1 << 15)))

    def truncated(d: Path) -> Path:
        data = _big_db(d / "big.db", rng).read_bytes()
        return _write(d / "cut.db", data[: rng.randrange(16, len(data))])

    def damaged(d: Path) -> Path:
        p = _big_db(d / "big.db", rng)
        data = bytearray(p.read_bytes())
        page = 4096
        for _ in range(4):
            at = rng.randrange(page, len(data))
            data[at: at + 64] = rng.randbytes(64)
        return _write(d / "damaged.db", bytes(data))

    def newer(d: Path) -> Path:
        p = good(d)
        with contextlib.closing(sqlite3.connect(p)) as c:
            c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
            c.commit()
        return p

    def corrupt_version(d: Path) -> Path:
        p = good(d)
        with contextlib.closing(sqlite3.connect(p)) as c:
            c.execute("UPDATE meta SET value = 'abc' WHERE key = 'schema_version'")
            c.commit()
        return p

    def foreign(d: Path) -> Path:
        with contextlib.closing(sqlite3.connect(d / "foreign.db")) as c:
            c.execute("CREATE TABLE results (a)")
            c.commit()
        return d / "foreign.db"

    def json_named_db(d: Path) -> Path:
        return _write(d / "export.db", dumps(valid_doc(rng)))

    def empty(d: Path) -> Path:
        return _write(d / "empty.db", b"")

    def directory(d: Path) -> Path:
        (d / "dir.db").mkdir()
        return d / "dir.db"

    def loop(d: Path) -> Path:
        os.symlink(d / "b.db", d / "a.db")
        os.symlink(d / "a.db", d / "b.db")
        return d / "a.db"

    return [
        Case("random bytes", garbage), Case("SQLite magic then garbage", magic_then_garbage),
        *[Case(f"truncated database #{j}", truncated) for j in range(4)],
        # SQLite has no checksums: damage it does not notice leaves rows that are each validated
        Case("damaged pages", damaged, expect="either"),
        Case("newer schema", newer, needles=("newer",)), Case("corrupt schema version", corrupt_version),
        Case("database of another program", foreign), Case("an export named .db", json_named_db),
        Case("empty file", empty), Case("a directory", directory, needles=("directory",)),
        Case("a symlink loop", loop), Case("missing", lambda d: d / "missing.db"),
    ]


DB_CASES = db_file_cases(SEED)


@pytest.mark.parametrize("case", DB_CASES, ids=[c.name for c in DB_CASES])
def test_hostile_database_file(case, tmp_path):
    """As ``--db`` of the reading commands, and as the other side of merge and diff."""
    for outcome in classify_db_case(case, tmp_path):
        assert outcome.kind in ("clear", "imported"), outcome


def classify_db_case(case: Case, d: Path) -> list[Outcome]:
    path = case.write(d)
    target = _target(d / "t")
    before = _snapshot(target)
    outcomes = []
    for argv in (("list", "--db", path), ("show", "--db", path), ("export", "--db", path, "--out", d / "o.json"),
                 ("merge", path, "--db", target), ("diff", path, "--db", target)):
        try:
            rc, out, err = cli(*argv)
        except (Exception, RecursionError, MemoryError) as e:
            outcomes.append(Outcome("crashed", f"{argv[0]}: {type(e).__name__}: {str(e)[:200]}"))
            continue
        if rc in (0, 1) and (case.expect == "either" or case.name == "an export named .db"
                             and argv[0] in ("list", "show", "merge", "diff")):
            outcomes.append(Outcome("imported"))  # an export is valid input there, whatever its name
            continue
        o = judge_cli(rc, err, (str(path), *case.needles))
        outcomes.append(dataclasses.replace(o, detail=f"{argv[0]}: {o.detail}"))
    changed = _snapshot(target) != before and case.expect != "either" and case.name != "an export named .db"
    if _integrity(target) != "ok" or changed:
        outcomes.append(Outcome("crashed", "the target database changed or is damaged"))
    return outcomes


def test_tune_into_damaged_database(tmp_path):
    """A database cut short: ``tune`` ends with one error naming it (or tunes, where the damage
    does not touch what it reads and writes); never a traceback."""
    rng = random.Random(SEED)
    data = _big_db(tmp_path / "big.db", rng).read_bytes()
    model = _write(tmp_path / "tiny.json", json.dumps(TINY))
    for j in range(3):
        db_path = _write(tmp_path / f"cut{j}.db", data[: rng.randrange(len(data) // 8, len(data))])
        rc, out, err = _tune(["tune", "--model", model, "--db", db_path, "--no-progress", "--device", "cpu",
                              "--m", "1"])
        assert "Traceback" not in err
        if rc == 2:
            got = judge_cli(rc, err, (str(db_path),))
            assert got.kind == "clear", got
        else:
            assert rc in (0, 1), (rc, err)


def test_directory_as_database(tmp_path):
    """A ``--db`` that is a directory is named as one, by every command and by ``info``."""
    d = tmp_path / "isdir.db"
    d.mkdir()
    for argv in (("list",), ("prune", "--failed-trials"), ("import", _other_export(tmp_path))):
        rc, _, err = cli(*argv, "--db", d)
        got = judge_cli(rc, err, (str(d), "directory"))
        assert got.kind == "clear", (argv, got)
    rc, out, err = _tune(["info", "--db", d, "--device", "cpu"])
    line = next(l for l in out.splitlines() if l.strip().startswith("user"))
    assert rc == 0 and str(d) in line and "directory" in line and "not created yet" not in line, line
    rc, out, err = _tune(["tune", "--model", _write(tmp_path / "tiny.json", json.dumps(TINY)), "--db", d,
                          "--no-progress", "--device", "cpu", "--m", "1"])
    got = judge_cli(rc, err, (str(d), "directory"))
    assert got.kind == "clear", got


@pytest.mark.parametrize("what", ["foreign", "newer"])
def test_writing_commands_leave_a_foreign_or_newer_db_byte_for_byte(tmp_path, what):
    """``db import`` / ``merge`` / ``prune`` into another program's SQLite file (tables, no schema
    version) or into a DB of a newer schema: refused naming the file and why, before anything is
    written (the journal mode too: no switch to WAL, no -wal file)."""
    from autofp4.db import TuningDB

    path = tmp_path / f"{what}.db"
    if what == "foreign":
        with contextlib.closing(sqlite3.connect(path)) as c, c:
            c.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
            c.execute("INSERT INTO notes (text) VALUES ('keep me')")
    else:
        TuningDB(path).close()
        with contextlib.closing(sqlite3.connect(path)) as c:
            c.execute("PRAGMA journal_mode = DELETE")
            with c:
                c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    before = path.read_bytes()
    good = _write(tmp_path / "good.json", dumps(valid_doc(random.Random(SEED), 2)))
    expect = "not an autofp4 tuning database" if what == "foreign" else "newer than this autofp4"
    for argv in (("import", good), ("merge", good), ("prune", "--failed-trials")):
        rc, _, err = cli(*argv, "--db", path)
        assert rc == 2 and str(path) in err and expect in err, (argv, rc, err)
        assert path.read_bytes() == before, argv
        assert not Path(f"{path}-wal").exists(), argv


def test_a_user_db_under_another_connections_exclusive_lock_is_skipped_within_seconds(tmp_path):
    """Another connection holds the user DB under an exclusive lock: the dispatcher's lookup waits
    ``READ_BUSY_TIMEOUT_S`` (not the writers' 30 s), then skips the layer with a warning that
    says it is locked and names it; the call runs its default."""
    import time

    import torch

    from autofp4 import dispatch
    from autofp4.db import READ_BUSY_TIMEOUT_S, TuningDB
    from autofp4.problem import ProblemKey

    path = tmp_path / "held.db"
    TuningDB(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        dispatch.set_db(path)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            backend, _ = dispatch.get_dispatcher(torch.device("cpu")).pick(
                ProblemKey("linear", "nvfp4", "bfloat16", 256, 128), 4)
        took = time.perf_counter() - t0
    finally:
        holder.close()
        dispatch.set_db(None)
    msgs = [str(w.message) for w in seen if "locked" in str(w.message)]
    assert msgs and str(path) in msgs[0] and "locked by another connection" in msgs[0], [str(w.message) for w in seen]
    assert READ_BUSY_TIMEOUT_S <= took < READ_BUSY_TIMEOUT_S + 5, took
    assert backend.name == "reference"


def test_a_user_db_under_a_regular_file_is_warned_about_once(tmp_path):
    """``AUTOFP4_DB`` under a regular file (``/etc/hostname/t.db``) cannot exist: the first
    dispatcher says so, naming the file in the way; a second one does not repeat it; a DB path in
    a directory that does not exist yet is not warned about (tuning creates it)."""
    import torch

    from autofp4 import dispatch

    blocker = tmp_path / "hostname"
    blocker.write_text("myhost\n")
    try:
        for path, warned in ((blocker / "t.db", True), (blocker / "t.db", False),
                             (tmp_path / "new" / "dir" / "t.db", False)):
            dispatch.set_db(path)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                dispatch.get_dispatcher(torch.device("cpu"))
            msgs = [str(w.message) for w in seen if "cannot exist" in str(w.message)]
            assert len(msgs) == (1 if warned else 0), (path, msgs)
            if warned:
                assert str(blocker) in msgs[0] and "not a directory" in msgs[0]
    finally:
        dispatch.set_db(None)


# --------------------------------------------------------------------------------------
# the chunked reader reads what json.loads reads
# --------------------------------------------------------------------------------------
def _unicode_text(rng: random.Random, n: int) -> str:
    alphabet = "aZ09 -_.\u00e9\u00fc\u4e2d\u6587\U0001f680\u0301\"\\/\t"
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64, 333, 4096])
def test_chunked_reading_matches_json_loads(chunk, tmp_path, monkeypatch):
    """Values cut at every kind of chunk boundary (inside numbers such as 1.5e-05, escapes and
    multi-byte UTF-8) are read whole: the same document as from ``json.loads``."""
    import autofp4.db as dbmod
    from autofp4.db import read_export
    from autofp4.schema import ExportDoc

    monkeypatch.setattr(dbmod, "READ_CHUNK_BYTES", chunk)
    rng = random.Random(SEED + chunk)
    for j in range(3):
        env = {**ENV, "gpu_name": "g" + _unicode_text(rng, rng.randint(0, 59)), "driver": _unicode_text(rng, 8)}
        key = Environment(**env).key()
        doc = valid_doc(rng, rng.randint(1, 6))
        doc["environments"] = {key: env}
        for r in doc["records"]:
            r.update(env_key=key, median_us=rng.choice([1.5e-05, 12345.678, 3, 1e-300 * 1e300]) or 1.0)
            r["spread_us"] = min(r["spread_us"], r["median_us"])
        text = json.dumps(doc, indent=rng.choice([None, 0, 2]), ensure_ascii=rng.random() < 0.5)
        path = _write(tmp_path / f"d{j}.json", text + " " * rng.randint(0, 3))
        assert read_export(path).model_dump() == ExportDoc.model_validate(json.loads(text)).model_dump()
        with pytest.raises(TuningFileError) as ei:  # and a cut anywhere is refused
            read_export(_write(tmp_path / f"cut{j}.json", text.encode()[: rng.randrange(1, len(text.encode()))]))
        assert str(tmp_path / f"cut{j}.json") in str(ei.value).splitlines()[0]


# --------------------------------------------------------------------------------------
# hostile inputs of further kinds, each class with a test
# --------------------------------------------------------------------------------------
def test_a_record_with_a_key_given_twice_is_refused(tmp_path):
    """JSON keeps the last of a repeated key, where a reader of the file sees the first."""
    doc = valid_doc(random.Random(SEED), 1)
    twice = json.dumps(doc["records"][0])[:-1] + ', "n": 999}'
    assert twice.count('"n":') == 2
    head = json.dumps({k: v for k, v in doc.items() if k != "records"})
    path = _write(tmp_path / "dup.json", head[:-1] + ', "records": [' + twice + "]}")
    target = _target(tmp_path / "t")
    before = _snapshot(target)
    rc, _, err = cli("import", path, "--db", target)
    got = judge_cli(rc, err, (str(path), "'n' appears twice"))
    assert got.kind == "clear", got
    assert _snapshot(target) == before


def test_a_negative_schema_version_is_named_as_corrupt(tmp_path):
    path = _ro_db(tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("UPDATE meta SET value = '-1' WHERE key = 'schema_version'")
        c.commit()
    before = _snapshot(path)
    for argv in (("list",), ("prune", "--failed-trials")):
        rc, _, err = cli(*argv, "--db", path)
        got = judge_cli(rc, err, (str(path), "corrupt schema_version '-1'"))
        assert got.kind == "clear", (argv, got)
    assert _snapshot(path) == before


def test_prune_older_than_an_absurd_number_of_days_is_refused(tmp_path):
    path = _ro_db(tmp_path)
    rc, _, err = cli("prune", "--older-than-days", "1e12", "--db", path)
    assert judge_cli(rc, err, ("--older-than-days", "1000000000000")).kind == "clear", err


@pytest.mark.parametrize("config,why", [
    ("[1, 2]", "config: Input should be a valid dictionary"),
    ('{"chunk_n": -5}', "chunk_n must be >= 0, got -5"),
    ('{"chunk_n": 1000000000000000000000000000000}', "less than or equal to"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "its config is nested too deeply to be a kernel config"),
])
def test_the_dispatcher_names_a_bad_row_in_one_line(tmp_path, config, why):
    """A row the dispatcher skips is named with the field and the reason, without pydantic's
    input dumps and links (and, for a value that fails a union, without its type mismatches)."""
    path = _ro_db(tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("UPDATE results SET config = ? WHERE id = (SELECT MIN(id) FROM results)", [config])
        c.commit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TuningDB(path, readonly=True) as db:
            assert len(db.results()) == 3
    (w,) = [str(c.message) for c in caught if issubclass(c.category, TuningDBWarning)]
    assert str(path) in w and "skipping invalid result row" in w and why in w, w
    assert "pydantic.dev" not in w and "input_value" not in w and "\n" not in w and "valid boolean" not in w, w


@pytest.mark.parametrize("ddl,named", [
    ("create trigger t after insert on results begin delete from results where rowid = new.rowid; end",
     "trigger 't'"),
    ("create view v as select * from results", "view 'v'"),
])
def test_a_database_with_triggers_or_views_is_refused_naming_them(tmp_path, ddl, named):
    """autofp4 creates no triggers or views; a file holding one (a trigger could delete every row an
    import reports as added) is refused, read or written, by the API, the CLI and the dispatcher."""
    rng = random.Random(7)
    path = tmp_path / "t.db"
    with TuningDB(path):
        pass
    c = sqlite3.connect(path)
    c.execute(ddl)
    c.commit()
    c.close()
    before = _snapshot(path)
    for readonly in (False, True):
        with pytest.raises(TuningDBError, match=f"{re.escape(str(path))} holds {named}, which autofp4 never creates"):
            TuningDB(path, readonly=readonly)
    export = tmp_path / "in.json"
    export.write_text(dumps(valid_doc(rng, 1)))
    for argv in (("import", export), ("list",), ("show", "--n", "64")):
        rc, out, err = cli(*argv, "--db", path)
        assert rc == 2 and named in err and str(path) in err and "added" not in out, (argv, out, err)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert load_layers(Environment(**ENV), user_path=path) is not None
    assert any(named in str(x.message) for x in w)
    assert _snapshot(path) == before


@pytest.mark.parametrize("suffix,what", [("-wal", "write-ahead log"), ("-shm", "shared-memory index"),
                                         ("-journal", "rollback journal")])
def test_an_export_never_goes_to_the_files_sqlite_keeps_beside_a_database(tmp_path, suffix, what):
    """``db export --out x.db-wal`` (or -shm, -journal) would replace a file SQLite owns: a WAL
    holding another connection's committed rows, which were lost with it. Refused, naming the
    database, for the exported one and for any other SQLite file; nothing is written and the
    database reads the same."""
    rng = random.Random(11)
    src = _ro_db(tmp_path)
    other = _sqlite_db(tmp_path / "other.db", rng)
    before = _snapshot(src)
    for base in (src, other):
        target = base.with_name(base.name + suffix)
        existed = target.exists()
        rc, out, err = cli("export", "--db", src, "--out", target)
        assert rc == 2 and f"is the {what} of the SQLite database {base}" in err and "wrote" not in out, err
        assert target.exists() == existed
    rc, _, err = cli("export", "--db", src, "--out", tmp_path / ("plain" + suffix))  # no database beside it
    assert rc == 0, err
    assert _snapshot(src) == before and _integrity(src) == "ok"


@pytest.mark.parametrize("given", ["file:t.db", "FILE:t.db?mode=memory", "t.db\n", "t\r.db", "t.db\x1b[0m"])
def test_a_db_path_that_is_an_sqlite_uri_or_holds_a_control_character_is_refused(tmp_path, monkeypatch, given):
    """SQLite reads ``file:`` names as URIs (``mode=memory`` rows vanish, ``file:y.db`` writes
    ./y.db that ``db list --db file:y.db`` then does not find); a line break pasted into
    ``AUTOFP4_DB`` named a file nobody meant. Both refused by name, from --db, the variable and
    the API, and no file is created."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "in.json"
    export.write_text(dumps(valid_doc(random.Random(5), 2)))
    rc, out, err = cli("import", export, "--db", given)
    assert rc == 2 and "--db=" in err and ("SQLite URI" in err or "control character" in err), err
    with pytest.raises(TuningDBError, match="SQLite URI|control character"):
        TuningDB(given)
    monkeypatch.setenv("AUTOFP4_DB", given)
    rc, out, err = cli("list")
    assert rc == 2 and "AUTOFP4_DB=" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


def test_a_device_named_as_the_tuning_db_is_refused(tmp_path):
    """``--db /dev/null`` is a device, not a full disk: said so before anything is opened."""
    for readonly in (False, True):
        with pytest.raises(TuningDBError, match="/dev/null is not a regular file"):
            TuningDB("/dev/null", readonly=readonly)
    rc, out, err = _tune(["tune", "--model", str(REPO / "examples" / "llama-3.1-8b.json"), "--db", "/dev/null", "--m", "1",
                          "--device", "cpu", "--no-progress"])
    assert rc == 2 and "/dev/null is not a regular file" in err and "full disk" not in err, err


def test_a_config_value_that_is_an_object_is_one_error_line(tmp_path):
    """A config value must be a scalar; an object there fails every branch of the scalar union,
    and the error says so in one line naming the record and field, not one line per branch."""
    rng = random.Random(3)
    doc = valid_doc(rng, 2)
    doc["records"][1]["config"] = dict(doc["records"][1]["config"], extra={"a": {"b": 1}})
    bad = tmp_path / "bad.json"
    bad.write_text(dumps(doc))
    target = _ro_db(tmp_path)
    before = _snapshot(target)
    rc, out, err = cli("import", bad, "--db", target)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "record #1" in err and "field config.extra" in err and "(got a dict)" in err, err
    assert "valid boolean" in err and "integer" in err and "string" in err
    assert _snapshot(target) == before


def test_a_database_whose_stored_version_was_set_back_migrates_again(tmp_path):
    """The stored schema version edited back by hand (the columns and indexes of the newest
    version present): opening it writable runs the migrations again without error, keeps every
    row and stores the current version."""
    path = _ro_db(tmp_path)
    rows = _snapshot(path)
    for version in ("1", "2"):
        c = sqlite3.connect(path)
        c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [version])
        c.commit()
        c.close()
        with TuningDB(path) as db:
            assert db.schema_version == 3
        assert _snapshot(path) == rows and _integrity(path) == "ok"
    export = tmp_path / "more.json"
    export.write_text(dumps(valid_doc(random.Random(9), 2)))
    c = sqlite3.connect(path)
    c.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    c.commit()
    c.close()
    rc, out, err = cli("import", export, "--db", path)
    assert rc == 0 and "2 added" in out, (out, err)


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
def test_a_folder_where_sqlite_keeps_a_file_beside_the_db_is_named(tmp_path, suffix):
    path = _ro_db(tmp_path)
    side = path.with_name(path.name + suffix)
    if side.exists():
        side.unlink()
    side.mkdir()
    export = tmp_path / "in.json"
    export.write_text(dumps(valid_doc(random.Random(21), 1)))
    rc, out, err = cli("import", export, "--db", path)  # a WAL database needs both: the folder is named
    assert rc == 2 and f"{side} (SQLite's {suffix[1:]} file beside it) is not a regular file" in err, err
    side.rmdir()
    assert _integrity(path) == "ok"


def test_a_fifo_where_sqlite_keeps_its_journal_is_named_without_blocking(tmp_path):
    """SQLite opening a FIFO as the database's journal blocks for ever (`db list` and every linear
    call with AUTOFP4_DB there hung): the side files are checked before SQLite opens anything."""
    path = _ro_db(tmp_path)
    os.mkfifo(path.with_name(path.name + "-journal"))
    code = ("import sys, autofp4.cli; sys.exit(autofp4.cli.main(['db', 'list', '--db', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "-journal (SQLite's journal file beside it) is not a regular file: it is a FIFO" \
        in r.stderr, r.stderr


def test_names_longer_than_a_file_system_allows_and_a_looping_db_link_are_named(tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    long = tmp_path / ("L" * 300 + ".db")
    monkeypatch.setenv("AUTOFP4_DB", str(long))
    with pytest.raises(TuningDBError, match=r"AUTOFP4_DB=.*is 303 bytes long, more than the 255 a file or folder name"):
        TuningDB(None)
    rc = main(["info"])
    assert rc == 2 and "is 303 bytes long" in capsys.readouterr().err
    monkeypatch.delenv("AUTOFP4_DB")
    assert main(["cache", "--export", str(tmp_path / ("K" * 300 + ".tar.gz"))]) == 2
    assert "is 307 bytes long" in capsys.readouterr().err
    loop = tmp_path / "t.db"
    loop.symlink_to("t.db")
    assert main(["info", "--db", str(loop)]) == 0
    out = capsys.readouterr().out
    assert "symbolic link to nothing reachable" in out and "not created yet" not in out, out


def test_side_files_of_a_linked_db_and_of_a_cached_kernels_record_do_not_block(tmp_path):
    """SQLite keeps a database's journal beside the file a symbolic link leads to; a FIFO there
    blocked `db list` through the link, and a FIFO kernel record blocked `cache --export`."""
    path = _ro_db(tmp_path)
    link = tmp_path / "link.db"
    link.symlink_to(path)
    os.mkfifo(path.with_name(path.name + "-journal"))
    code = "import sys, autofp4.cli; sys.exit(autofp4.cli.main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "db", "list", "--db", str(link)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "t.db-journal (SQLite's journal file beside it) is not a regular file: it is a FIFO" \
        in r.stderr, r.stderr
    cache = tmp_path / "kc"
    cache.mkdir()
    name = "gemm-" + "0" * 32
    (cache / f"{name}.o").write_bytes(b"\x7fELF" + bytes(60))
    os.mkfifo(cache / f"{name}.json")
    r = subprocess.run([sys.executable, "-c", code, "cache", "--export", str(tmp_path / "k.tar.gz")],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "AUTOFP4_KERNEL_CACHE": str(cache)})
    assert r.returncode == 2 and f"its record {name}.json is a FIFO (named pipe), not a file" in r.stderr, r.stderr


@pytest.mark.parametrize("suffix", ["-journal", "-wal", "-shm"])
def test_a_db_named_like_another_dbs_side_file_is_refused(tmp_path, suffix):
    path = _ro_db(tmp_path)
    rows = _snapshot(path)
    rc, _, err = cli("import", _other_export(tmp_path), "--db", f"{path}{suffix}")
    assert rc == 2 and f"it is where SQLite keeps the {SQLITE_SIDE_FILES[suffix]} of the database {path}" in err, err
    assert not Path(f"{path}{suffix}").exists() and _snapshot(path) == rows


def test_derived_names_and_paths_past_the_limits_are_refused(tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    path = _ro_db(tmp_path)
    name = "n" * 240
    assert main(["db", "export", "--db", str(path), "--out", str(tmp_path / f"{name}.json")]) == 2
    assert "bytes long; autofp4 (and SQLite) write files named after it, up to 24 bytes longer" in capsys.readouterr().err
    assert main(["cache", "--export", str(tmp_path / f"{name}.tgz")]) == 2
    assert "give a name of at most 231 bytes" in capsys.readouterr().err
    deep = "/".join(["d" * 200] * 22)
    monkeypatch.setenv("AUTOFP4_DB", f"{tmp_path}/{deep}/t.db")
    with pytest.raises(TuningDBError, match=r"AUTOFP4_DB=.*bytes long as an absolute path, more than the 3968 autofp4 takes"):
        TuningDB(None)
    monkeypatch.setenv("AUTOFP4_DB", f"{tmp_path}/{'d' * 250}/{'e' * 250}/t.db")  # past SQLite's own limit
    with pytest.raises(TuningDBError, match=r"AUTOFP4_DB=.*SQLite opens a database only by a path of at most 504"):
        TuningDB(None)
    monkeypatch.delenv("AUTOFP4_DB")
    fifo_storage = tmp_path / "study.db"
    fifo_storage.touch()
    os.mkfifo(tmp_path / "study.db-journal")
    argv = ["tune", "--device", "cpu", "--model", str(Path(__file__).parents[1] / "examples" / "llama-3.1-8b.json"),
            "--m", "1", "--ops", "linear", "--no-progress", "--db", str(tmp_path / "t2.db")]
    assert main(argv + ["--storage", f"sqlite:///{fifo_storage}"]) == 2
    assert "study.db-journal (SQLite's journal file beside it) is not a regular file: it is a FIFO" in \
        capsys.readouterr().err
    assert main(argv + ["--storage", f"sqlite:///{tmp_path}/{'s' * 300}.db"]) == 2
    assert "is 303 bytes long, more than the 255" in capsys.readouterr().err


def test_storage_urls_are_read_as_sqlalchemy_reads_them(tmp_path, monkeypatch, capsys):
    """``--storage`` as SQLAlchemy opens it: any sqlite dialect, percent-escapes decoded, no '~'
    expanded; and not another database's side file (SQLite removed the study written there), a
    folder or a FIFO."""
    from autofp4.cli import main

    monkeypatch.chdir(tmp_path)
    db = _ro_db(tmp_path)
    other = tmp_path / "o.db"
    other.write_bytes(db.read_bytes())
    argv = ["tune", "--device", "cpu", "--model", str(Path(__file__).parents[1] / "examples" / "llama-3.1-8b.json"),
            "--m", "1", "--ops", "linear", "--no-progress", "--db", str(db)]
    (tmp_path / "sdir").mkdir()
    os.mkfifo(tmp_path / "s.db")
    for storage, said in ((f"sqlite+pysqlite:///{db}", "is the tuning DB"),
                          ("sqlite:///o.db-journal", "it is where SQLite keeps the rollback journal of the database o.db"),
                          ("sqlite:///s%2Edb", "its path has percent-escapes, which SQLAlchemy decodes"),
                          ("sqlite:///~/x.db", "SQLAlchemy does not expand a leading '~'"),
                          ("sqlite:///sdir", "sdir is a directory, not an SQLite file"),
                          ("sqlite:///s.db", "s.db is a FIFO (named pipe), not an SQLite file")):
        assert main(argv + ["--storage", storage]) == 2, storage
        assert said in capsys.readouterr().err, storage
    assert not (tmp_path / "o.db-journal").exists()


def test_side_file_names_and_links_and_lengths_as_the_system_sees_them(tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes"
    notes.write_text("not a database")
    rc, _, err = cli("import", _other_export(tmp_path), "--db", "notes-journal")  # notes is no database
    assert rc == 0 and notes.read_text() == "not a database", err
    db = _ro_db(tmp_path)
    wal = db.with_name(db.name + "-wal")
    wal.unlink(missing_ok=True)
    wal.symlink_to(db.name)
    rc, _, err = cli("list", "--db", db)
    assert rc == 2 and "t.db-wal (SQLite's wal file beside it) is not a regular file: it is a symbolic link" in err, err
    wal.unlink()
    deep = tmp_path.joinpath(*["d" * 200] * 19)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)  # a relative name, long as an absolute path
    assert main(["db", "export", "--db", str(db), "--out", "x" * 200 + ".json"]) == 2
    assert "bytes long as an absolute path, more than the 3968 autofp4 takes" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", str(tmp_path), "--fmt", "nvfp4", "--out", "q" * 240 + "/."]) == 2
    assert "is 240 bytes long; autofp4 (and SQLite) write files named after it" in capsys.readouterr().err
    long_db = tmp_path / ("r" * 240 + ".db")
    long_db.write_bytes(db.read_bytes())
    rc, out, err = cli("diff", long_db, "--db", db)  # only read: its name leaves room for nothing
    assert rc == 0 and "0 differences" in out, err


def test_a_kernel_record_nested_past_the_recursion_limit_is_left_out(tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    cache = tmp_path / "kc"
    cache.mkdir()
    name = "gemm-" + "1" * 32
    (cache / f"{name}.o").write_bytes(b"\x7fELF" + bytes(60))
    (cache / f"{name}.json").write_text("[" * 100_000 + "]" * 100_000)
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(cache))
    assert main(["cache", "--export", str(tmp_path / "k.tar.gz")]) == 2
    assert f"{name}.o: no record of what it was built from (RecursionError)" in capsys.readouterr().err
