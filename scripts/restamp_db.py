"""Re-stamp tuning rows after a change that leaves every compiled kernel byte-identical.

A row's ``backend_source`` is the hash of the source of the kernel its config runs, so any edit
of a kernel module retires that kernel's rows, also one that changes no compiled kernel (moving
a constant or a config rule, deleting a helper). This tool proves that a row's kernel did not
change and then gives the row the current hash; every row it cannot prove is left as it is.

For each row of the exports that REV's own code calls current and the working tree does not, it
compiles the row's config twice for the target architecture, without a GPU and with the kernel
cache off: once in REV's tree (unpacked from git) and once in the working tree, each in its own
process, keeping what CuTeDSL writes (``CUTE_DSL_KEEP=ir,cubin``): the device binaries and the
compiled IR without source locations, which holds the host launcher (grid, cluster, shared
memory) too. The row is
re-stamped only when both compiles give the same set of files, byte for byte (SHA-256). What was
compiled is what a row's measurement measured, so such a row's timing is as valid as before
(the Python around the launch, packing and the run wrapper, is not compared: the rows of a
change to it must be re-tuned).

    python scripts/restamp_db.py --rev 0b835f1 tuning_db/nvidia-h200.json
    python scripts/restamp_db.py --rev 0b835f1 --dry-run tuning_db/nvidia-h200.json

It compiles every row twice (about 1-3 s a compile on a CPU core); ``--jobs`` runs that many
compile processes per tree.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autofp4.backends import get_backend  # noqa: E402
from autofp4.db import export_json, read_export  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Runs in one tree (REV's or the working tree's), in a process of its own: for each row on
# stdin, the hash that tree's code gives the row's kernel, and the SHA-256 of every cubin that
# compiling the row's config (every variant the backend's compile_only builds) writes.
_COMPILE = r"""
import hashlib, json, os, shutil, sys, tempfile
from pathlib import Path
from autofp4.backends import get_backend
try:
    from autofp4.problem import ProblemKey
except ImportError:  # a revision from before autofp4.problem
    from autofp4.backends import ProblemKey
rows = json.load(sys.stdin)
dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
out = []
for r in rows:
    b = get_backend(r["backend"])
    key = ProblemKey(r["op"], r["fmt"], r["dtype"], r["n"], r["k"], r["experts"], r["topk"])
    res = {"hash": b.source_hash(r["config"]), "cubins": {}, "error": ""}
    try:
        cfg = b.parse_config(r["config"])
        for p in dump.iterdir():
            p.unlink()
        b.compile_only(cfg, key)
        res["cubins"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dump.iterdir())
                         if p.name.endswith((".cubin", "_clean.mlir"))}
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    out.append(res)
json.dump(out, sys.stdout)
"""


def _compile_in(tree: str, rows: list[dict], arch: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, PYTHONPATH=tree, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ir,cubin", CUTE_DSL_DUMP_DIR=dump,
                   AUTOFP4_KERNEL_CACHE="off")
        res = subprocess.run([sys.executable, "-c", _COMPILE], cwd=tree, env=env, check=True, capture_output=True,
                             text=True, input=json.dumps(rows))
    return json.loads(res.stdout)


def compile_rows(tree: str, rows: list[dict], arch: str, jobs: int) -> list[dict]:
    """What :data:`_COMPILE` says of each row in ``tree``, in ``jobs`` processes."""
    if not rows:
        return []
    chunks = [rows[i::jobs] for i in range(jobs)]
    with ThreadPoolExecutor(jobs) as pool:
        parts = list(pool.map(lambda c: _compile_in(tree, c, arch), chunks))
    out: list[dict] = [{}] * len(rows)
    for i, part in enumerate(parts):
        for j, res in enumerate(part):
            out[i + j * jobs] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the commit whose code measured the rows")
    ap.add_argument("--arch", default="sm_90a", help="the architecture the rows' GPU runs (default sm_90a)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="compile processes per tree")
    ap.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    ap.add_argument("exports", nargs="+", help="tuning export files (rewritten in place)")
    args = ap.parse_args()
    tree = subprocess.run(["git", "-C", str(REPO), "archive", args.rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as rev_tree:
        with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
            tar.extractall(rev_tree, filter="data")
        for path in args.exports:
            doc = read_export(path)
            # a row whose stored hash is the working tree's is current already: nothing to prove
            raw = [r for r in json.loads(Path(path).read_text())["records"]
                   if r.get("backend_source") != get_backend(r["backend"]).source_hash(r["config"])]
            old = compile_rows(rev_tree, raw, args.arch, args.jobs)
            new = compile_rows(str(REPO), raw, args.arch, args.jobs)
            by_key = {}
            restamped, skipped = 0, []
            for r, o, n in zip(raw, old, new):
                why = ""
                if r.get("backend_source") != o["hash"]:
                    why = "not current at REV"
                elif o["error"] or n["error"]:
                    why = f"compile failed: {o['error'] or n['error']}"
                elif not o["cubins"] or o["cubins"] != n["cubins"]:
                    why = "compiled kernels differ"
                ident = (r["backend"], r["op"], r["fmt"], r["dtype"], r["n"], r["k"], r["m_bucket"], r["env_key"])
                if why:
                    skipped.append(f"{ident}: {why}")
                else:
                    by_key[ident] = n["hash"]
            records = []
            for rec in doc.records:
                ident = (rec.backend, rec.op, rec.fmt, rec.dtype, rec.n, rec.k, rec.m_bucket, rec.env_key)
                if ident in by_key:
                    rec = rec.model_copy(update={"backend_source": by_key[ident]})
                    restamped += 1
                records.append(rec)
            print(f"{path}: {restamped} of {len(raw)} rows not current re-stamped (their compiled kernels identical "
                  f"at {args.rev} and now); {len(doc.records) - len(raw)} rows current already")
            for line in skipped:
                print(f"  left as it was: {line}")
            if not args.dry_run:
                Path(path).write_text(export_json(doc.model_copy(update={"records": records})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
