"""A/B of two versions of a kernel module at the same configs, on the GPU.

Loads an older copy of ``autofp4/kernels/w4a16_decode.py`` (``--old PATH``, e.g. written with
``git show REV:autofp4/kernels/w4a16_decode.py``; with ``--kernel gemm`` of
``sm90_w4a16_gemm.py``) next to the current one, and for every benchmark shape, M and config
(the default, and the winners of that kernel a tuning DB or export holds for that shape and M)
checks that both give the same output on fresh random data, then times both in CUDA graphs
(cold L2, rotating weight copies) in interleaved rounds. Dependent launch is off for both.
Prints a table last; writes JSON to ``$OUT/ab_<kernel>.json`` when ``$OUT`` is set.

    python scripts/gpu_ab_decode.py --old /tmp/w4a16_decode_old.py --db tuning_db/nvidia-h200.json
    python scripts/gpu_ab_decode.py --kernel gemm --old /tmp/gemm_old.py --db ... --m 64,128,512

``--compile-only`` (with ``CUTE_DSL_ARCH=sm_90a`` and ``AUTOFP4_KERNEL_CACHE``) compiles both
versions' kernels ahead of time on a machine without a GPU.
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autofp4  # noqa: E402
from autofp4.backends.sm90_w4a16 import SM90Config, _to_kernel_config  # noqa: E402
from autofp4.db import read_records  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as GEMM  # noqa: E402
from autofp4.kernels import w4a16_decode as DECODE  # noqa: E402
from bench_linear import SHAPES  # noqa: E402
from gpu_check_decode import fp4_bytes, graph_time, rotation  # noqa: E402


def import_as(path, name):
    """The module at ``path``, imported under ``name`` (the kernel cache keys a kernel module's
    kernels by its name and source, so a copy must not pass for the real one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# kernel (the DB's "kernel" value): (current module, its config class name)
KERNELS = {"decode": (DECODE, "DecodeConfig"), "gemm": (GEMM, "Sm90GemmConfig")}
KIND = "decode"
NEW, CONFIG_CLASS = KERNELS[KIND]


def use_kernel(kernel):
    """Time ``kernel``'s module (``decode`` or ``gemm``) from here on."""
    global KIND, NEW, CONFIG_CLASS
    KIND = kernel
    NEW, CONFIG_CLASS = KERNELS[kernel]
    return kernel


def load_old(path):
    """The older module, importable by name."""
    stem = NEW.__name__.rsplit(".", 1)[1]
    return import_as(path, f"autofp4.kernels.{stem}_ab_old")


def compile_launcher(mod, cfg, n, k, fmt):
    """The compiled kernel of ``cfg`` (dependent launch off, no repack) of module ``mod``."""
    if KIND == "decode":
        return mod._compile(as_config(mod, cfg), n, k, fmt, "bfloat16", False)
    return mod._compile(as_config(mod, cfg), n, k, fmt, "bfloat16")


def configs(records, fmt, n, k, m):
    """The default at ``m``, then the winners of the kernel stored for (fmt, bf16, n, k) at bucket ``m``."""
    out = [dataclasses.replace(NEW.default_config(n, k, fmt, "bfloat16", m), pdl=False)]
    for r in records:
        if (r.fmt, r.dtype, r.n, r.k, r.m_bucket, r.config.get("kernel")) == (fmt, "bfloat16", n, k, m, KIND):
            cfg = dataclasses.replace(_to_kernel_config(SM90Config(**r.config)), pdl=False)
            if cfg not in out:
                out.append(cfg)
    return out


def as_config(mod, cfg):
    """``cfg`` as the config class of ``mod`` (each module version has its own)."""
    return getattr(mod, CONFIG_CLASS)(**dataclasses.asdict(cfg))


def compile_all(old, records, fmts, shapes, ms):
    """Compile every timed kernel of both versions into the kernel cache, without a GPU
    (``CUTE_DSL_ARCH=sm_90a``), so that the GPU run only loads them."""
    done = 0
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            for m in ms:
                for cfg in configs(records, fmt, n, k, m):
                    for mod in (old, NEW):
                        compile_launcher(mod, cfg, n, k, fmt)
                        done += 1
    print(f"compiled {done} kernels")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="decode")
    ap.add_argument("--old", required=True, help="path of the older kernel module")
    ap.add_argument("--db", help="tuning DB or export whose winners of that kernel are timed too")
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true",
                    help="only compile both versions' kernels into the kernel cache (no GPU needed)")
    args = ap.parse_args()
    kernel = use_kernel(args.kernel)
    old = load_old(args.old)
    records = read_records(args.db)[1] if args.db else []
    if args.compile_only:
        compile_all(old, records, args.fmt.split(","), args.shapes.split(","), [int(v) for v in args.m.split(",")])
        return
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for fmt in args.fmt.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            torch.cuda.empty_cache()
            w = autofp4.quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)
            packs = {}
            for tag, mod in (("old", old), ("new", NEW)):
                packs[tag], _, calls = rotation(mod.pack_weight(w), None, fp4_bytes(n, k, fmt))
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for cfg in configs(records, fmt, n, k, m):
                    runs = {tag: mod.compile_kernel(as_config(mod, cfg), n, k, fmt, "bfloat16")
                            for tag, mod in (("old", old), ("new", NEW))}
                    outs = {tag: runs[tag](x, packs[tag][0], None) for tag in runs}
                    same = torch.equal(outs["old"], outs["new"])
                    times = {"old": [], "new": []}
                    for _ in range(args.rounds):
                        for tag in ("old", "new"):
                            ps, run = packs[tag], runs[tag]
                            times[tag].append(graph_time([(lambda i=i: run(x, ps[i % len(ps)], None))
                                                          for i in range(calls)])[0])
                    r = dict(fmt=fmt, shape=name, n=n, k=k, m=m, cfg=str(cfg), same_output=same,
                             old_us=statistics.median(times["old"]), new_us=statistics.median(times["new"]),
                             old_rounds=times["old"], new_rounds=times["new"])
                    rows.append(r)
                    print(f"{fmt} {name:12s} M={m:2d} old {r['old_us']:7.2f} new {r['new_us']:7.2f} "
                          f"same={same} {cfg}", flush=True)
            del packs, w
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"ab_{kernel}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'fmt':6s} {'shape':12s} {'M':>3s} {'old us':>8s} {'new us':>8s} {'new/old':>8s}  same  config")
    for r in rows:
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['m']:3d} {r['old_us']:8.2f} {r['new_us']:8.2f} "
              f"{r['new_us'] / r['old_us']:8.3f}  {'yes' if r['same_output'] else 'NO '}  {r['cfg']}")
    for fmt in args.fmt.split(","):
        for m in map(int, args.m.split(",")):
            sel = [r for r in rows if r["fmt"] == fmt and r["m"] == m]
            best = {}
            for r in sel:  # per shape: the best config of each version
                b = best.setdefault(r["shape"], [math.inf, math.inf])
                b[0], b[1] = min(b[0], r["old_us"]), min(b[1], r["new_us"])
            if best:
                g = math.exp(sum(math.log(b[1] / b[0]) for b in best.values()) / len(best))
                print(f"{fmt} M={m}: geomean best new / best old = {g:.3f} over {len(best)} shapes")
    bad = [r for r in rows if not r["same_output"]]
    print(f"outputs identical in {len(rows) - len(bad)} of {len(rows)} cases")


if __name__ == "__main__":
    main()
