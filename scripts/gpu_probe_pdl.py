"""Where a kernel should let the next one launch (programmatic dependent launch): a probe.

Both FP4 kernels launch with PDL when their config asks for it. A kernel of a stream may then
start as soon as every CTA of the kernel before it has executed ``griddepcontrol.launch_dependents``
(or exited); until its own ``griddepcontrol.wait`` returns it only pulls its first weight bytes
into L2. Where the trigger sits decides how much of one call overlaps the next:

* ``late`` (the kernels as they are): after the main loop, so the next kernel launches for this
  one's reduction and epilogue;
* ``post``: right after this kernel's own ``griddepcontrol.wait``, so the next kernel launches
  (and prefetches its weights) while this one streams its own; it cannot launch before this one
  has passed its wait, so at most one kernel runs ahead;
* ``pre``: before this kernel's wait (the next kernel may launch while this one still waits).

For every benchmark shape and format it times, in CUDA graphs over weights rotated past the L2
(``scripts/gpu_probe_decode.py``'s harness), the stored decode winners at M = 1 (and 16 where the
decode kernel won) and the stored GEMM winners at ``--gemm`` M buckets: without PDL, and with
PDL and each trigger placement (modules built here by editing the kernel source in memory). The
outputs of every variant are compared bit for bit with the kernel's as it is.

    python scripts/gpu_probe_pdl.py --db tuning_db/nvidia-h200.json
    CUTE_DSL_ARCH=sm_90a python scripts/gpu_probe_pdl.py --db ... --compile-only
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autofp4.backends.sm90_w4a16 import SM90Config, _to_kernel_config  # noqa: E402
from autofp4.db import read_records  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as GEMM  # noqa: E402
from autofp4.kernels import w4a16_decode as DECODE  # noqa: E402
from bench_linear import SHAPES  # noqa: E402
from gpu_ab_decode import import_as  # noqa: E402
from gpu_probe_decode import finished, interleaved_medians, rotated_weight  # noqa: E402

# (module, the main kernel's wait, its trigger): the exact source lines, with what follows them
SITES = {
    DECODE: ("        griddep_wait()\n        smem = cutlass.memory.SmemAllocator()",
             "            griddep_launch_dependents()\n            # accumulator c0,c1"),
    GEMM: ("            griddep_wait()\n            if warp_idx == load_warp:",
           "            griddep_launch_dependents()\n            if cutlass.const_expr(cl > 1):"),
}
PLACEMENTS = ("late", "post", "pre")


def placed(mod, where):
    """``mod`` with the main kernel's trigger moved ``where`` (``late``: ``mod`` itself)."""
    if where == "late":
        return mod
    src = open(mod.__file__).read()
    wait, trig = SITES[mod]
    if src.count(wait) != 1 or src.count(trig) != 1:
        raise SystemExit(f"{mod.__name__}: the wait or trigger line changed; update this probe")
    indent = wait[:len(wait) - len(wait.lstrip())]
    call = indent + "griddep_launch_dependents()\n"
    src = src.replace(trig, trig.replace("griddep_launch_dependents()", "pass  # moved"))
    first, rest = wait.split("\n", 1)
    src = src.replace(wait, call + wait if where == "pre" else first + "\n" + call + rest)
    stem = mod.__name__.rsplit(".", 1)[1]
    path = os.path.join(tempfile.gettempdir(), f"{stem}_pdl_{where}.py")
    with open(path, "w") as f:
        f.write(src)
    return import_as(path, f"autofp4.kernels.{stem}_pdl_{where}")


def winners(records, fmt, n, k, kernel, ms):
    """``(m_bucket, kernel config)`` of the stored bf16 winners of ``kernel`` at ``ms``."""
    out = []
    for r in records:
        if (r.fmt, r.dtype, r.n, r.k, r.config.get("kernel")) == (fmt, "bfloat16", n, k, kernel) \
                and r.m_bucket in ms:
            out.append((r.m_bucket, _to_kernel_config(SM90Config(**r.config))))
    return sorted(out, key=lambda c: c[0])


def compile_one(mod, cfg, n, k, fmt):
    if mod.__name__.split(".")[-1].startswith("w4a16_decode"):
        return mod._compile(cfg, n, k, fmt, "bfloat16", False)
    return mod._compile(cfg, n, k, fmt, "bfloat16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--decode-m", default="1,16", help="M buckets of the decode winners")
    ap.add_argument("--gemm", default="16", help="M buckets of the GEMM winners (empty: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    records = read_records(args.db)[1]
    mods = {base: {w: placed(base, w) for w in PLACEMENTS} for base in (DECODE, GEMM)}
    ms = {DECODE: [int(v) for v in args.decode_m.split(",") if v],
          GEMM: [int(v) for v in args.gemm.split(",") if v]}
    if not args.compile_only:
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for fmt in args.fmt.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            for base, kernel in ((DECODE, "decode"), (GEMM, "gemm")):
                cases = winners(records, fmt, n, k, kernel, ms[base])
                if args.compile_only:
                    for _, cfg in cases:
                        for mod in mods[base].values():
                            compile_one(mod, mod.__dict__[type(cfg).__name__](
                                **dataclasses.asdict(dataclasses.replace(cfg, pdl=False))), n, k, fmt)
                    continue
                if not cases:
                    continue
                packs, calls = rotated_weight(base, fmt, n, k)
                for m, cfg in cases:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    runs = {"no pdl": base.compile_kernel(dataclasses.replace(cfg, pdl=False), n, k, fmt,
                                                          "bfloat16")}
                    for w, mod in mods[base].items():
                        c = mod.__dict__[type(cfg).__name__](**dataclasses.asdict(dataclasses.replace(cfg, pdl=True)))
                        runs[w] = mod.compile_kernel(c, n, k, fmt, "bfloat16")
                    ref = runs["no pdl"](x, packs[0], None)
                    same = all(torch.equal(run(x, packs[0], None), ref) for run in runs.values())
                    us = interleaved_medians(runs, x, packs, calls, args.rounds)
                    rows.append(dict(fmt=fmt, shape=name, kernel=kernel, m=m, stored_pdl=cfg.pdl, cfg=str(cfg),
                                     us=us, same_output=same))
                    print(f"{fmt} {name:12s} {kernel:6s} M={m:3d} " + " ".join(f"{t} {v:7.2f}" for t, v in us.items())
                          + f"  same {same}", flush=True)
                del packs
    if finished(rows, args.compile_only, "probe_pdl.json"):
        return
    cols = ["no pdl", *PLACEMENTS]
    print(f"\n{'fmt':6s} {'shape':12s} {'kernel':6s} {'M':>3s} {'stored':>6s} " + " ".join(f"{c:>7s}" for c in cols)
          + "  post/late  pre/late  best/stored  same")
    ratios = {w: [] for w in cols}
    for r in rows:
        us = r["us"]
        stored = us["late"] if r["stored_pdl"] else us["no pdl"]
        best = min(us.values())
        for w in cols:
            ratios[w].append(us[w] / stored)
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['kernel']:6s} {r['m']:3d} {str(r['stored_pdl']):>6s} "
              + " ".join(f"{us[c]:7.2f}" for c in cols)
              + f"  {us['post'] / us['late']:9.3f} {us['pre'] / us['late']:9.3f} {best / stored:11.3f}  {r['same_output']}")
    if rows:
        print("geomean time / stored: " + "  ".join(f"{w} {statistics.geometric_mean(v):.3f}"
                                                   for w, v in ratios.items()))


if __name__ == "__main__":
    main()
