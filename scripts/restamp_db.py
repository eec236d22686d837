"""Re-stamp the rows of tuning exports after a change of what the provenance hash covers (not of
the kernels themselves).

A row's ``backend_source`` is the hash of the source of the kernel its config runs. When the
hashing scheme changes (which modules it covers), rows measured with kernels that did not
change would be retired for nothing. This script gives such a row the hash that the current
scheme computes for the *same* code it was measured with:

* ``--rev`` names the commit whose code measured the rows. Its tree is unpacked to a temporary
  directory and, in a subprocess, its own hashing code says what each kernel's hash was there
  (the old scheme) and hands over the source texts of the modules the current scheme covers.
* A row whose stored hash equals its kernel's hash at REV gets the current scheme's hash of
  REV's sources. Every other row is left as it is and reported.
* A re-stamped row is current only if its kernel's code is unchanged since REV; the script
  reports how many are, and the others stay stale, as they should.

    python scripts/restamp_db.py --rev 9c609b0 tuning_db/nvidia-h200.json
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
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autofp4.backends import backend_names, get_backend  # noqa: E402
from autofp4.backends.base import source_digest  # noqa: E402
from autofp4.db import export_json, read_export  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# runs inside REV's tree: its hash of every part of every backend, and the source text (by REV's
# kernel_source) of the modules named on stdin
_AT_REV = """
import json, sys
from autofp4.backends import get_backend
from autofp4.kernel_cache import kernel_source
want = json.load(sys.stdin)
out = {"old": {}, "texts": {}}
for name in want["backends"]:
    b = get_backend(name)
    parts = getattr(b, "source_parts", (None,))
    if hasattr(b, "part_source_hash"):
        out["old"][name] = {str(p): b.part_source_hash(p) for p in parts}
    else:  # one hash per backend
        out["old"][name] = {"None": b.source_hash()}
for mod in want["modules"]:
    out["texts"][mod] = kernel_source(mod)
json.dump(out, sys.stdout)
"""


def at_rev(rev: str, backends: list[str], modules: list[str]) -> dict:
    """What REV's own code says (see ``_AT_REV``)."""
    tree = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
            tar.extractall(tmp, filter="data")
        env = dict(os.environ, PYTHONPATH=tmp)
        res = subprocess.run([sys.executable, "-c", _AT_REV], cwd=tmp, env=env, check=True, capture_output=True,
                             text=True, input=json.dumps({"backends": backends, "modules": modules}))
    return json.loads(res.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the commit whose code measured the rows")
    ap.add_argument("exports", nargs="+", help="tuning export files (rewritten in place)")
    args = ap.parse_args()
    backends = {n: get_backend(n) for n in backend_names()}
    parts = {n: list(b.source_parts) for n, b in backends.items()}
    modules = sorted({m.__name__ for n, b in backends.items() for p in parts[n] for m in b.source_modules(p)})
    rev = at_rev(args.rev, list(backends), modules)
    new_at_rev = {n: {p: source_digest(rev["texts"][m.__name__] for m in b.source_modules(p)) for p in parts[n]}
                  for n, b in backends.items()}
    for path in args.exports:
        doc = read_export(path)
        records, restamped, current, kept = [], 0, 0, 0
        for r in doc.records:
            b = backends[r.backend]
            part = b.source_part(r.config)
            old = rev["old"].get(r.backend, {})
            was = old.get(str(part), old.get("None"))
            if part in new_at_rev[r.backend] and r.backend_source and r.backend_source == was:
                new = new_at_rev[r.backend][part]
                records.append(r.model_copy(update={"backend_source": new}))
                restamped += 1
                current += new == b.part_source_hash(part)
            else:
                records.append(r)
                kept += 1
        Path(path).write_text(export_json(doc.model_copy(update={"records": records})))
        print(f"{path}: {restamped} rows re-stamped ({current} of them current), "
              f"{kept} left as they were (not measured with {args.rev}'s code)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
