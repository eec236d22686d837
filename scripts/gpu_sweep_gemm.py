"""A/B sweep of the Hopper W4A16 GEMM at small and medium M (16..512) on the benchmark shapes
(``--swizzle``: the CTA order at large M).

For every (shape, M): the GEMM's default config, then a small grid around it (weight tile
64/128 rows, the two largest token tiles of 16..256 that fit M, split-K 1/2/4 (and 8 at
M <= 32), the deepest pipeline that fits), all checked against a bf16 matmul of the dequantized
weight and timed in CUDA graphs that rotate weight copies past the L2, next to cuBLAS bf16 and,
where M fits it, the decode kernel's default config (what the dispatcher runs untuned at
M <= 32) in the same run. Every config is compiled first, in parallel processes, into the
kernel cache. Prints a table last; JSON rows go to $OUT/gemm_sweep.json.

    python scripts/gpu_sweep_gemm.py [--fmt nvfp4] [--ms 16,64,128,512] [--shapes "8B o,8B down"]
"""
import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autofp4  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as G  # noqa: E402
from autofp4.kernels import w4a16_decode as D  # noqa: E402
from bench_linear import SHAPES  # noqa: E402
from gpu_check_decode import fp4_bytes, graph_time, rotation  # noqa: E402


def _deepest(n, k, fmt, depths, **tile):
    """The first valid config over (tile_k, stages) pairs, deepest first, or None."""
    for tk, st in depths:
        c = G.Sm90GemmConfig(tile_k=tk, stages=st, **tile)
        if G.validate(c, n, k, fmt, "bfloat16") is None:
            return c
    return None


def sweep_configs(n, k, fmt, m, wide=False, swizzle=False):
    base = G.default_config(n, k, fmt, "bfloat16", m)
    points = []
    if swizzle:  # the CTA order: both rasters, bands of 1..16 tiles, on the large-M tiles
        for tile in (dict(tile_n=128, tile_m=256, tile_k=64, stages=6), dict(tile_n=128, tile_m=128, tile_k=128, stages=5)):
            for r in ("n", "m"):
                for sw in G.SWIZZLES:
                    points.append(G.Sm90GemmConfig(raster=r, swizzle=sw, **tile))
    elif wide:  # two CTAs per SM (ctas_per_sm=2) next to one, 64..256-row weight tiles
        depths = ((256, 4), (128, 6), (128, 5), (128, 4), (128, 3), (64, 6), (64, 4))
        for tn in (64, 128, 256):
            for tm in (t for t in (64, 128) if t <= max(64, m)):
                for sk in (1, 2, 4):
                    for co in (0, 2):
                        points.append(_deepest(n, k, fmt, depths, tile_n=tn, tile_m=tm, split_k=sk, ctas_per_sm=co))
    else:
        tms = [t for t in (16, 32, 64, 128, 256) if t <= max(16, 1 << (m - 1).bit_length())][-2:]
        deep = ((256, 8), (256, 6)) if m <= 32 else ()  # small x tiles leave room for stages
        depths = (*deep, (256, 4), (128, 6), (128, 5), (128, 4), (64, 6), (64, 4))
        for tn in (64, 128):
            for tm in tms:
                for sk in ((1, 2, 4, 8) if m <= 32 else (1, 2, 4)):
                    points.append(_deepest(n, k, fmt, depths, tile_n=tn, tile_m=tm, split_k=sk))
    out = [base]
    for c in points:
        if c is not None and c not in out:
            out.append(c)
    return out


def _compile_one(job):
    cfg, n, k, fmt = job
    try:
        G._compile(cfg, n, k, fmt, "bfloat16")
        return None
    except Exception as e:  # reported again when timed
        return repr(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--ms", default="16,64,128,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--wide", action="store_true",
                    help="two CTAs per SM next to one, 64..256-row tiles, instead of the grid around the default")
    ap.add_argument("--swizzle", action="store_true",
                    help="the CTA order (raster x band width) of the large-M tiles instead")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    fmt = args.fmt
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)

    from autofp4.kernel_cache import target_arch
    from autofp4.tuning.compile_pool import _pool_init

    jobs = sorted({(c, n, k, fmt) for n, k in shapes.values() for m in ms for c in sweep_configs(n, k, fmt, m, args.wide, args.swizzle)},
                  key=str)
    t0 = time.time()
    with cf.ProcessPoolExecutor(max(1, (os.cpu_count() or 2) - 2), mp_context=mp.get_context("spawn"),
                                initializer=_pool_init, initargs=(target_arch(),)) as ex:
        errors = [e for e in ex.map(_compile_one, jobs) if e]
    print(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f}s ({len(errors)} errors)", flush=True)

    rows = []
    for name, (n, k) in shapes.items():
        torch.cuda.empty_cache()
        w = autofp4.quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)
        p0 = G.pack_weight(w)
        wd = w.dequantize(torch.bfloat16)
        packs, dense, calls = rotation(p0, wd, fp4_bytes(n, k, fmt))
        copies, dense_copies = len(packs), len(dense)
        dpacks = None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), wd.float())
            t_blas = graph_time([(lambda i=i: F.linear(x, dense[i % dense_copies])) for i in range(calls)])[0]
            t_dec = None
            if m <= max(D.M_MAX_CHOICES):  # the decode kernel's default, the GEMM's rival here
                if dpacks is None:
                    dpacks = rotation(D.pack_weight(w), None, fp4_bytes(n, k, fmt))[0]
                drun = D.compile_kernel(D.default_config(n, k, fmt, "bfloat16", m), n, k, fmt, "bfloat16")
                t_dec = graph_time([(lambda i=i: drun(x, dpacks[i % len(dpacks)], None)) for i in range(calls)])[0]
                print(f"  {name:12s} M={m:4d} decode default {t_dec:8.2f} us", flush=True)
            for j, cfg in enumerate(sweep_configs(n, k, fmt, m, args.wide, args.swizzle)):
                try:
                    run = G.compile_kernel(cfg, n, k, fmt, "bfloat16")
                    rel = float((run(x, p0, None).float() - ref).norm() / ref.norm())
                    t = graph_time([(lambda i=i: run(x, packs[i % copies], None)) for i in range(calls)])[0]
                except Exception as e:
                    rows.append(dict(shape=name, m=m, cfg=str(cfg), error=repr(e)))
                    print(f"  {name} M={m} {cfg}: ERROR {e!r}", flush=True)
                    continue
                rows.append(dict(shape=name, n=n, k=k, m=m, fmt=fmt, cfg=str(cfg), default=j == 0, us=t,
                                 cublas_us=t_blas, decode_default_us=t_dec, rel_err=rel,
                                 tflops=2 * m * n * k / t / 1e6))
                print(f"  {name:12s} M={m:4d} {t:8.2f} us cublas {t_blas:8.2f} x{t_blas / t:.2f} "
                      f"rel={rel:.1e} {'DEFAULT ' if j == 0 else ''}{cfg}", flush=True)
        del packs, dense, dpacks, w, wd, p0
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gemm_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'shape':12s} {'M':>4s} {'cuBLAS':>8s} {'decode':>8s} {'default':>8s} {'best':>8s} {'x best':>7s} "
          f"{'rel':>8s}  best config")
    for name in shapes:
        for m in ms:
            pts = [r for r in rows if r["shape"] == name and r["m"] == m and "us" in r]
            if not pts:
                continue
            d = next((r for r in pts if r["default"]), None)
            b = min(pts, key=lambda r: r["us"])
            worst = max(r["rel_err"] for r in pts)
            dec = b["decode_default_us"] if b["decode_default_us"] is not None else float("nan")
            print(f"{name:12s} {m:4d} {b['cublas_us']:8.2f} {dec:8.2f} {d['us'] if d else float('nan'):8.2f} {b['us']:8.2f} "
                  f"{b['cublas_us'] / b['us']:6.2f}x {worst:8.1e}  {b['cfg'][15:]}")


if __name__ == "__main__":
    main()
