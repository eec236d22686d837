#!/usr/bin/env python
"""Start-up cost of a large tuning DB: the time to the first ``autofp4.linear`` call.

What it measures: a fresh Python process (``python -c``) that imports autofp4, quantizes one
weight and makes the first ``autofp4.linear`` call on the CPU (the reference backend), with
``$AUTOFP4_DB`` pointing at a large DB (``--rows``, default 1,000,000 rows across ``--envs``
environments) and at a small one (``--small-rows``). Both DBs hold a tuned row of the timed
problem. Reported per DB: the wall time of the whole process, the time from the start of the
import to the end of the first call, and the first call alone (where the dispatcher meets the
DB); medians over ``--repeats`` fresh processes, the two DBs interleaved. After the call, the
process asks its dispatcher about one more tuned problem (``next problem``: the cost of meeting
a new problem later on).

How the DB is built: in a child process of the checkout being timed (its own schema), the
environments and the ``results`` rows written with ``executemany`` in a few large transactions
(not one validated upsert per row). ``--current-share`` of the rows belong to the running
environment (CPU, reference backend, valid rows over many problems and every M bucket), the
others to GPU environments with Hopper configs. The DBs live in a temporary folder (``--tmp``)
and are deleted at the end.

Writes a JSON document to ``--out`` (default ``docs/results/cpu/startup.json``) and prints a
table.

    python scripts/bench_startup.py
    python scripts/bench_startup.py --rows 100000 --repeats 5
    python scripts/bench_startup.py --autofp4-root /path/to/other/checkout --rows 100000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, provenance

#: the timed problem: N, K, M (a tuned row at M bucket 16 is stored for it in both DBs)
TIMED_N, TIMED_K, TIMED_M = 4096, 4096, 16

BUILD = r"""
import json, random, sqlite3, sys, time
from autofp4.backends import get_backend
from autofp4.db import TuningDB
from autofp4.dispatch import backend_source_hash
from autofp4.env import Environment, current_environment
from autofp4.problem import DEFAULT_M_BUCKETS
from autofp4.backends.reference import ReferenceConfig

path, rows, n_envs, share, tn, tk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rng = random.Random(1234)
cur = current_environment("cpu")
envs = [cur]
for i in range(1, n_envs):
    envs.append(Environment(gpu_name="NVIDIA H200", sm_count=132, compute_capability="9.0",
                            driver=f"5{70 + i % 30}.{i // 30}.0{i % 7}", cuda="13.0", torch=f"2.{i % 13}.0",
                            cutlass_dsl="4.8.1", autofp4="0.1.0"))
TuningDB(path).close()  # the schema of the timed checkout
conn = sqlite3.connect(path)
conn.execute("PRAGMA journal_mode = WAL")
conn.execute("PRAGMA synchronous = OFF")
with conn:
    conn.executemany("INSERT INTO environments (env_key, env) VALUES (?, ?)",
                     [(e.key(), json.dumps(e.model_dump(mode="json"), sort_keys=True)) for e in envs])
ref = get_backend("reference")
ref_src = {c: backend_source_hash(ref, {"chunk_n": c}) for c in (0, 1024, 2048)}
hopper = json.dumps({"ctas_per_sm": 6, "k_split": 8, "kernel": "decode", "m_max": 8, "pdl": True,
                     "pdl_early": True, "prefetch": False, "smem_stages": 0, "split_reduce": "kernel",
                     "tiles_per_warp": 1, "warps": 4, "x_smem": True}, sort_keys=True, separators=(",", ":"))
buckets = list(DEFAULT_M_BUCKETS)
cols = ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k", "experts", "topk", "env_key", "config",
        "median_us", "spread_us", "samples", "default_median_us", "backend_source", "created_at")
sql = f"INSERT OR IGNORE INTO results ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
n_cur = max(1, int(rows * share))
def problems():
    # every (fmt, dtype, n, k) once, n and k multiples of 256 (at least 4096 of them)
    for n in range(4352, 4352 + 256 * 4096, 256):
        for k in (1024, 2048, 3072, 4096):
            for fmt in ("nvfp4", "mxfp4"):
                for dtype in ("bfloat16", "float16"):
                    yield fmt, dtype, n, k
def gen():
    # the timed problem first (a tuned row at bucket 16), then rows of the current env over many
    # problems and every bucket, then the other environments' rows
    yield ("linear", "nvfp4", "bfloat16", "reference", 16, tn, tk, 0, 0, cur.key(), '{"chunk_n":1024}',
           900.0, 5.0, 20, 1000.0, ref_src[1024], "2026-12-01T00:00:00.000000Z")
    made = 1
    for fmt, dtype, n, k in problems():
        for m in buckets:
            if made >= n_cur:
                break
            c = rng.choice((0, 1024, 2048))
            yield ("linear", fmt, dtype, "reference", m, n, k, 0, 0, cur.key(), json.dumps({"chunk_n": c}, separators=(",", ":")),
                   100.0 + rng.random(), 1.0, 20, 120.0, ref_src[c], "2026-12-01T00:00:00.000000Z")
            made += 1
        if made >= n_cur:
            break
    others = [e.key() for e in envs[1:]] or [cur.key()]
    left = rows - made
    for fmt, dtype, n, k in problems():
        for m in buckets:
            for ek in others:
                if left <= 0:
                    return
                yield ("linear", fmt, dtype, "sm90_w4a16", m, n, k, 0, 0, ek, hopper,
                       5.0 + rng.random(), 0.02, 30, 6.0, "f5fd19b79c5ef51b", "2026-12-01T00:00:00.000000Z")
                left -= 1
it = gen()
while True:
    batch = [r for _, r in zip(range(50_000), it)]
    if not batch:
        break
    with conn:
        conn.executemany(sql, batch)
got = conn.execute("SELECT count(*) FROM results").fetchone()[0]
mine = conn.execute("SELECT count(*) FROM results WHERE env_key = ?", (cur.key(),)).fetchone()[0]
conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
conn.close()
print(json.dumps({"rows": got, "current_env_rows": mine, "environments": len(envs)}))
"""

TIMED = r"""
import time
t0 = time.perf_counter()
import json, sys
import torch
import autofp4
t1 = time.perf_counter()
n, k, m = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
w = autofp4.quantize(torch.randn(n, k), "nvfp4")
x = torch.randn(m, k).to(torch.bfloat16)
t2 = time.perf_counter()
y = autofp4.linear(x, w)
t3 = time.perf_counter()
d = autofp4.get_dispatcher("cpu")
cfg = d.pick(autofp4.dispatch.ProblemKey("linear", "nvfp4", "bfloat16", n, k), m)[1]
t4 = time.perf_counter()
other = d.tuned(autofp4.dispatch.ProblemKey("linear", "nvfp4", "bfloat16", 4352, 1024))
t5 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_linear_s": t3 - t2, "to_first_linear_s": (t1 - t0) + (t3 - t2),
                  "next_problem_s": t5 - t4, "next_problem_rows": len(other),
                  "config": repr(cfg), "autofp4": autofp4.__file__}))
"""


def _env(root: Path, db: Path) -> dict:
    """The child's environment: ``root`` first on its path (it also runs in ``root``: ``python -c``
    puts the working directory first), ``db`` its user DB."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AUTOFP4_DB"] = str(db)
    env.pop("AUTOFP4_SHIPPED_DB", None)  # the shipped exports of the timed checkout
    return env


def build(root: Path, path: Path, rows: int, envs: int, share: float) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", BUILD, str(path), str(rows), str(envs), str(share),
                          str(TIMED_N), str(TIMED_K)], env=_env(root, path), cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"building {path} failed:\n{out.stderr}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    info["build_s"] = time.perf_counter() - t0
    info["file_mb"] = sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20
    return info


def timed(root: Path, db: Path) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", TIMED, str(TIMED_N), str(TIMED_K), str(TIMED_M)],
                         env=_env(root, db), cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"the timed process failed:\n{out.stderr}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    where = Path(res.pop("autofp4")).resolve()
    if root not in where.parents:
        raise SystemExit(f"the timed process imported autofp4 from {where}, not from {root}")
    res["process_s"] = wall
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the large DB")
    ap.add_argument("--small-rows", type=int, default=200, help="rows of the small DB")
    ap.add_argument("--envs", type=int, default=200, help="environments of the large DB (the running one included)")
    ap.add_argument("--small-envs", type=int, default=2, help="environments of the small DB")
    ap.add_argument("--current-share", type=float, default=0.1,
                    help="share of the rows that belong to the running environment")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per DB")
    ap.add_argument("--autofp4-root", type=Path, default=ROOT, help="the checkout whose autofp4 is timed")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the DBs (default: a new temporary one)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "cpu" / "startup.json")
    args = ap.parse_args()
    if min(args.rows, args.small_rows, args.envs, args.small_envs, args.repeats) < 1 or not 0 < args.current_share <= 1:
        ap.error("--rows, --small-rows, --envs, --small-envs and --repeats must be >= 1, --current-share in (0, 1]")
    root = args.autofp4_root.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="autofp4-startup-", dir=args.tmp))
    try:
        dbs = {}
        for label, rows, envs in (("small", args.small_rows, args.small_envs), ("large", args.rows, args.envs)):
            path = tmp / f"{label}.db"
            dbs[label] = (path, build(root, path, rows, min(envs, rows), args.current_share))
            print(f"built {label}: {dbs[label][1]}", file=sys.stderr)
        runs: dict[str, list[dict]] = {label: [] for label in dbs}
        for _ in range(args.repeats):
            for label, (path, _) in dbs.items():
                runs[label].append(timed(root, path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fields = ("process_s", "to_first_linear_s", "first_linear_s", "import_s", "next_problem_s")
    doc = {
        **provenance("cpu"),
        "timed_problem": {"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": TIMED_N, "k": TIMED_K, "m": TIMED_M},
        "repeats": args.repeats,
        "dbs": {
            label: {**info, **{f: statistics.median(r[f] for r in runs[label]) for f in fields},
                    "config": runs[label][0]["config"], "runs": runs[label]}
            for label, (_, info) in dbs.items()
        },
    }
    doc["large_minus_small_s"] = {f: doc["dbs"]["large"][f] - doc["dbs"]["small"][f] for f in fields}
    head = ("DB", "rows", "this env", "envs", "MiB", "process s", "to 1st linear s", "1st linear s", "import s",
            "next problem s")
    table = [head]
    for label, d in doc["dbs"].items():
        table.append((label, f"{d['rows']:,}", f"{d['current_env_rows']:,}", str(d["environments"]), f"{d['file_mb']:.0f}",
                      *(f"{d[f]:.3f}" for f in fields)))
    table.append(("large - small", "", "", "", "", *(f"{doc['large_minus_small_s'][f]:+.3f}" for f in fields)))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for j, r in enumerate(table):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
