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

The GEMM also as ``pfall``: before its wait it prefetches every K tile of its share of the
weight into L2, not only its first ``stages`` (with the trigger late, or post: ``post+pfall``).

For every benchmark shape and format it times, in CUDA graphs over weights rotated past the L2
(``scripts/gpu_probe_decode.py``'s harness), the stored decode winners at M = 1 (and 16 where the
decode kernel won) and the stored GEMM winners at ``--gemm`` M buckets: without PDL, and with
PDL and each variant (modules built here by editing the kernel source in memory). The outputs of
every variant are compared bit for bit with the kernel's as it is.

    python scripts/gpu_probe_pdl.py --db tuning_db/nvidia-h200.json
    CUTE_DSL_ARCH=sm_90a python scripts/gpu_probe_pdl.py --db ... --compile-only
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autofp4.backends.sm90_w4a16 import SM90Config, _to_kernel_config  # noqa: E402
from autofp4.db import read_records  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as GEMM  # noqa: E402
from autofp4.kernels import w4a16_decode as DECODE  # noqa: E402
from bench_linear import SHAPES  # noqa: E402
from gpu_probe_decode import edited_module, finished, gemm_sweep  # noqa: E402

# the GEMM's wait and its trigger: the exact source lines, with what follows them
GEMM_WAIT = "            griddep_wait()\n            if warp_idx == load_warp:"
GEMM_TRIGGER = "            griddep_launch_dependents()\n            if cutlass.const_expr(cl > 1):"
# the GEMM's L2 prefetch before its wait: its first ``stages`` K tiles, or (``pfall``) all of them
GEMM_PREFETCH = ("prefetch_l2(mW.iterator.toint() + cutlass.Int64(goff), n_pre * w_copy_bytes)",
                 "prefetch_l2(mW.iterator.toint() + cutlass.Int64(goff), k_tiles_split * w_copy_bytes)")
# the decode kernel's ``post`` is its config field ``pdl_early``
PLACEMENTS = {DECODE: ("late", "post"), GEMM: ("late", "post", "pre", "pfall", "post+pfall")}


def _edit(src, old, new, what):
    if src.count(old) != 1:
        raise SystemExit(f"{what}: the source changed; update this probe")
    return src.replace(old, new)


def placed(mod, where):
    """``mod`` as the probe runs it ``where``: the module itself for ``late`` and for the decode
    kernel (whose ``post`` is a config field); for the GEMM, its source edited in memory with the
    trigger moved (``post``, ``pre``) and/or (``pfall``) all its K tiles prefetched into L2
    before its wait."""
    if where == "late" or mod is DECODE:
        return mod
    src = open(mod.__file__).read()
    parts = where.split("+")
    if "pfall" in parts:
        src = _edit(src, *GEMM_PREFETCH, mod.__name__)
    if "post" in parts or "pre" in parts:
        indent = GEMM_WAIT[:len(GEMM_WAIT) - len(GEMM_WAIT.lstrip())]
        call = indent + "griddep_launch_dependents()\n"
        src = _edit(src, GEMM_TRIGGER, GEMM_TRIGGER.replace("griddep_launch_dependents()", "pass  # moved"),
                    mod.__name__)
        first, rest = GEMM_WAIT.split("\n", 1)
        src = _edit(src, GEMM_WAIT, call + GEMM_WAIT if "pre" in parts else first + "\n" + call + rest,
                    mod.__name__)
    return edited_module(mod, "pdl_" + where.replace("+", "_"), src)


def winners(records, fmt, n, k, kernel, ms):
    """``(m_bucket, kernel config)`` of the stored bf16 winners of ``kernel`` at ``ms``."""
    out = []
    for r in records:
        if (r.fmt, r.dtype, r.n, r.k, r.config.get("kernel")) == (fmt, "bfloat16", n, k, kernel) \
                and r.m_bucket in ms:
            out.append((r.m_bucket, _to_kernel_config(SM90Config(**r.config))))
    return sorted(out, key=lambda c: c[0])


def variant_config(base, mod, cfg, where):
    """``cfg`` as ``mod``'s config class, launched as ``where`` says (``no pdl``: without PDL)."""
    on = where != "no pdl"
    cfg = dataclasses.replace(cfg, pdl=on)
    if base is DECODE:
        cfg = dataclasses.replace(cfg, pdl_early=where == "post")
    return mod.__dict__[type(cfg).__name__](**dataclasses.asdict(cfg))


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
    mods = {base: {w: placed(base, w) for w in PLACEMENTS[base]} for base in (DECODE, GEMM)}
    ms = {DECODE: [int(v) for v in args.decode_m.split(",") if v],
          GEMM: [int(v) for v in args.gemm.split(",") if v]}
    if not args.compile_only:
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    fmts, shapes = args.fmt.split(","), args.shapes.split(",")
    stored_as = {}  # (fmt, n, k, kernel, m) -> the variant that launches as the stored winner does
    for base, kernel in ((DECODE, "decode"), (GEMM, "gemm")):
        def cases(fmt, n, k, base=base, kernel=kernel):
            out = []
            for m, cfg in winners(records, fmt, n, k, kernel, ms[base]):
                stored_as[(fmt, n, k, kernel, m)] = ("no pdl" if not cfg.pdl else
                                                     "post" if getattr(cfg, "pdl_early", False) else "late")
                out.append((m, {w: (mod, variant_config(base, mod, cfg, w))
                                for w, mod in (("no pdl", base), *mods[base].items())}))
            return out

        for fmt, name, m, kernels, us, same in gemm_sweep(fmts, shapes, cases, args.rounds, args.compile_only,
                                                          packer=base):
            cfg = kernels["late"][1]
            stored = stored_as[(fmt, *SHAPES[name], kernel, m)]
            rows.append(dict(fmt=fmt, shape=name, kernel=kernel, m=m, stored=stored, cfg=str(cfg), us=us,
                             same_output=all(same.values())))
            print(f"{fmt} {name:12s} {kernel:6s} M={m:3d} " + " ".join(f"{t} {v:7.2f}" for t, v in us.items())
                  + f"  same {all(same.values())}", flush=True)
    if finished(rows, args.compile_only, "probe_pdl.json"):
        return
    cols = ["no pdl", *PLACEMENTS[GEMM]]
    print(f"\n{'fmt':6s} {'shape':12s} {'kernel':6s} {'M':>3s} {'stored':>6s} " + " ".join(f"{c:>10s}" for c in cols)
          + "  best/stored  same   (us; late, post, pre: where the kernel lets the next one launch; "
          "pfall: the GEMM prefetches all its K tiles before its wait)")
    ratios = {w: [] for w in cols}
    for r in rows:
        us = r["us"]
        stored = us[r["stored"]]
        for w in us:
            ratios[w].append(us[w] / stored)
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['kernel']:6s} {r['m']:3d} {r['stored']:>6s} "
              + " ".join(f"{us[c]:10.2f}" if c in us else f"{'-':>10s}" for c in cols)
              + f"  {min(us.values()) / stored:11.3f}  {r['same_output']}")
    print("geomean time / stored: " + "  ".join(f"{w} {statistics.geometric_mean(v):.3f} ({len(v)})"
                                               for w, v in ratios.items() if v))


if __name__ == "__main__":
    main()
