"""Sweep a grid of one Hopper kernel's configs on the benchmark shapes: the measurements the
default heuristics in ``autofp4/backends/sm90_heuristics.py`` are fitted to.

``autofp4 tune`` searches every config for the best one of each problem and stores only the
winner; this tool times a fixed, readable grid side by side, so that a maintainer sees how each
field moves the time around the default (or around the stored winners) before changing a
heuristic. The grids (``--grid``):

* ``decode`` kernel, ``default``: the decode default for M, then weights through registers or a
  2-, 3- or 4-deep ring in shared memory, 2, 4 or 8 warps, half / the same / twice the default
  split with the kernel or the cluster reduction, one or two tiles per warp (two only with the
  ring); x staged in shared memory. M <= 64 (the decode kernel's largest ``m_max``).
* ``gemm`` kernel, ``default``: the GEMM default for M, then weight tiles of 64 / 128 rows, the
  two largest token tiles of 16..256 that fit M, split-K 1 / 2 / 4 (and 8 at M <= 32), each with
  the deepest pipeline that fits.
* ``gemm`` kernel, ``wide``: two CTAs per SM (``ctas_per_sm=2``) next to one, 64..256-row
  weight tiles, token tiles 64 / 128, split-K 1 / 2 / 4.
* ``gemm`` kernel, ``swizzle``: the CTA order of the large-M tiles (128 x 256 x 64 and
  128 x 128 x 128): both rasters, bands of 1..16 tiles.
* ``--vary FIELD=V1,V2,...`` (either kernel; repeat it for the product of several fields):
  instead of a grid, each winner a tuning DB stores (``--db``, default the shipped
  ``tuning_db/nvidia-h200.json``) at the ``--m`` buckets, with the fields set to every
  combination of the values (``producer=0,1``; ``split_reduce=kernel,cluster``); combinations
  not valid for the shape are left out.

Per (shape, M) it also times bf16 cuBLAS (``F.linear`` on the bf16 weight) and, in a
GEMM sweep at M <= 64, the decode kernel's default config (what the dispatcher runs untuned
there).

How: every config is first compiled in parallel processes into the kernel cache; then, per
(shape, M), each config's output is checked against the dequantized weight (relative error,
and whether its bits equal the first config's), and all of them are timed in CUDA graphs over
weight copies rotated beyond the L2 (cold L2), CUDA events, in ``--rounds`` interleaved rounds,
the median kept. Dependent launch is off for every config (as cuBLAS runs).

Writes ``sweep-<kernel>-<grid>.json`` (every config's time) and ``.md`` (per shape and M: the
default, the best, their ratio) to ``--out`` (default ``docs/results/<gpu>/``).

    python scripts/sweep_configs.py --kernel decode --m 1,16
    python scripts/sweep_configs.py --kernel gemm --m 16,64,128,512
    python scripts/sweep_configs.py --kernel gemm --grid swizzle --m 512,2048,8192 --shapes "8B gate_up,70B down"
    python scripts/sweep_configs.py --kernel gemm --m 64,128,512 --vary producer=0,1
    CUTE_DSL_ARCH=sm_90a python scripts/sweep_configs.py --kernel gemm --m 64 --compile-only   # no GPU
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F
from _common import (SHAPES, SHIPPED_DB, geomean, interleaved_medians, provenance, provenance_line, rel_err,
                     require_gpu, results_dir, select_shapes, shape_weights, stored_winners, without_pdl)

from autofp4.backends import sm90_heuristics as H  # noqa: E402  (the defaults the grids start from)

GRIDS = {"decode": ("default",), "gemm": ("default", "wide", "swizzle")}
DTYPE = "bfloat16"


def _kernels():
    from autofp4.kernels import sm90_w4a16_gemm as G
    from autofp4.kernels import w4a16_decode as D

    return {"decode": D, "gemm": G}


def decode_grid(n: int, k: int, fmt: str, m: int) -> list:
    """The decode default at ``m``, then the grid around it (module docstring)."""
    D = _kernels()["decode"]
    base = without_pdl(H.decode_default(n, k, fmt, DTYPE, m))
    out = [base]
    for stages in (0, 2, 3, 4):
        for warps in (2, 4, 8):
            for ks in sorted({max(1, base.k_split // 2), base.k_split, 2 * base.k_split}):
                for red in ("kernel", "cluster") if ks > 1 else ("kernel",):
                    for tpw in (1, 2) if stages else (1,):
                        out.append(D.DecodeConfig(warps=warps, k_split=ks, m_max=base.m_max, split_reduce=red,
                                                  tiles_per_warp=tpw, x_smem=True, smem_stages=stages))
    return out


def _deepest(n: int, k: int, fmt: str, depths, **tile):
    """The first valid GEMM config over ``(tile_k, stages)`` pairs, deepest first, or None."""
    G = _kernels()["gemm"]
    for tk, st in depths:
        c = G.Sm90GemmConfig(tile_k=tk, stages=st, **tile)
        if G.validate(c, n, k, fmt, DTYPE) is None:
            return c
    return None


def gemm_grid(n: int, k: int, fmt: str, m: int, grid: str = "default") -> list:
    """The GEMM default at ``m``, then the points of ``grid`` (module docstring)."""
    G = _kernels()["gemm"]
    points = []
    if grid == "swizzle":
        for tile in (dict(tile_n=128, tile_m=256, tile_k=64, stages=6), dict(tile_n=128, tile_m=128, tile_k=128, stages=5)):
            for raster in ("n", "m"):
                points += [G.Sm90GemmConfig(raster=raster, swizzle=sw, **tile) for sw in G.SWIZZLES]
    elif grid == "wide":
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
                for sk in (1, 2, 4, 8) if m <= 32 else (1, 2, 4):
                    points.append(_deepest(n, k, fmt, depths, tile_n=tn, tile_m=tm, split_k=sk))
    return [without_pdl(H.gemm_default(n, k, fmt, DTYPE, m))] + [c for c in points if c is not None]


def parse_vary(specs: list[str]) -> list[dict]:
    """``["a=0,1", "b=x,y"]`` -> ``[{a: 0, b: "x"}, {a: 0, b: "y"}, {a: 1, b: "x"}, ...]`` (integers
    where a value reads as one)."""
    def value(v: str):
        try:
            return int(v)
        except ValueError:
            return v

    axes = []
    for spec in specs:
        field, sep, vals = spec.partition("=")
        if not sep or not vals:
            raise SystemExit(f"--vary takes FIELD=V1,V2,...; got {spec!r}")
        axes.append([(field.strip(), value(v.strip())) for v in vals.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def varied(cfg, setting: dict):
    """``cfg`` with the fields of ``setting`` replaced, each value cast to the field's type."""
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = set(setting) - names
    if unknown:
        raise SystemExit(f"{type(cfg).__name__} has no field {', '.join(sorted(unknown))}")
    def cast(field: str, v):
        kind = type(getattr(cfg, field))
        if kind is bool and isinstance(v, str):
            return v.lower() in ("1", "true", "yes", "on")
        return kind(v)

    return dataclasses.replace(cfg, **{f: cast(f, v) for f, v in setting.items()})


def cases(kernel: str, grid: str, fmt: str, n: int, k: int, ms, records=None, vary=None) -> list[tuple[int, list]]:
    """``(m, configs)`` per M of one shape: the valid, distinct configs to time, the first the
    baseline (the default, or with ``vary`` the stored winner with the first setting)."""
    mod = _kernels()[kernel]
    out = []
    if vary:
        for m, cfg in stored_winners(records, kernel, fmt, n, k, ms):
            out.append((m, [varied(cfg, st) for st in vary]))
    else:
        for m in ms:
            if kernel == "decode" and m > max(mod.M_MAX_CHOICES):
                continue
            out.append((m, decode_grid(n, k, fmt, m) if kernel == "decode" else gemm_grid(n, k, fmt, m, grid)))
    kept = []
    for m, cfgs in sorted(out, key=lambda c: c[0]):
        valid = list(dict.fromkeys(c for c in cfgs if mod.validate(c, n, k, fmt, DTYPE) is None))
        if len(valid) > (1 if vary else 0):
            kept.append((m, valid))
    return kept


def _pool_init(arch: str) -> None:
    if arch and arch != "unknown":
        os.environ.setdefault("CUTE_DSL_ARCH", arch)


def _compile_one(job) -> str | None:
    kernel, cfg, n, k, fmt = job
    try:
        _kernels()[kernel].compile_kernel(cfg, n, k, fmt, DTYPE)
        return None
    except Exception as e:  # reported again when the config is timed
        return f"{cfg}: {e!r}"


def precompile(jobs: set, workers: int) -> list[str]:
    """Compile every ``(kernel, config, n, k, fmt)`` into the kernel cache in ``workers``
    processes; the errors."""
    from autofp4.kernel_cache import target_arch

    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_pool_init,
                                initargs=(target_arch(),)) as ex:
        errors = [e for e in ex.map(_compile_one, sorted(jobs, key=str)) if e]
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f}s ({len(errors)} errors)", flush=True)
    for e in errors[:10]:
        print("  " + e, flush=True)
    return errors


def measure_point(kernel, name, n, k, fmt, m, cfgs, weights, args) -> list[dict]:
    """One (shape, M): the rows of cuBLAS, the decode default (GEMM sweeps at M <= 64) and every
    config of ``cfgs``."""
    mods = _kernels()
    gen, dense, ws, packs = weights
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].dequantize(torch.float32))
    variants = {"cublas": (F.linear, [(x, d) for d in dense])}
    rows = {"cublas": dict(label="cuBLAS bf16")}
    if kernel == "gemm" and m <= max(mods["decode"].M_MAX_CHOICES) and not args.vary:
        dcfg = without_pdl(H.decode_default(n, k, fmt, DTYPE, m))
        dpacks = packs.setdefault("decode", [mods["decode"].pack_weight(w) for w in ws])
        run = mods["decode"].compile_kernel(dcfg, n, k, fmt, DTYPE)
        variants["decode default"] = (run, [(x, p, None) for p in dpacks])
        rows["decode default"] = dict(label="decode default", config=str(dcfg), rel_err=rel_err(run(x, dpacks[0]), ref))
    kpacks = packs.setdefault(kernel, [mods[kernel].pack_weight(w) for w in ws])
    first = None
    for i, cfg in enumerate(cfgs):
        try:
            run = mods[kernel].compile_kernel(cfg, n, k, fmt, DTYPE)
            out = run(x, kpacks[0], None)
        except Exception as e:
            print(f"  {name} M={m} {cfg}: ERROR {e!r}", flush=True)
            continue
        first = out if first is None else first
        variants[i] = (run, [(x, p, None) for p in kpacks])
        rows[i] = dict(label="baseline" if i == 0 else "", config=str(cfg),
                       fields={f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                       rel_err=rel_err(out, ref), same_bits=bool(torch.equal(out, first)))
    us = interleaved_medians(variants, args.rounds, args.reps)
    out = []
    for key, row in rows.items():
        if key in us:
            out.append(dict(shape=name, n=n, k=k, m=m, fmt=fmt, index=key if isinstance(key, int) else None,
                            us=us[key], tflops=2 * m * n * k / us[key] / 1e6, **row))
    cub = us["cublas"]
    for r in out:
        r["speedup_vs_cublas"] = cub / r["us"]
        print(f"  {name:12s} M={m:5d} {r['us']:9.2f} us x{r['speedup_vs_cublas']:5.2f} "
              f"{'rel %.1e ' % r['rel_err'] if 'rel_err' in r else ''}{r.get('label') or ''} {r.get('config', '')}",
              flush=True)
    return out


def summary(doc: dict) -> str:
    """Markdown: per shape and M, cuBLAS, the decode default (where timed), the baseline, the
    best config and its gain over the baseline."""
    lines = [f"{doc['kernel']} kernel, grid {doc['grid']}, {doc['fmt']}. {provenance_line(doc)} "
             "Times in us, CUDA-graph medians over interleaved rounds, cold L2, dependent launch off.", "",
             "| shape | M | cuBLAS bf16 | decode default | baseline | best | best / baseline | best vs cuBLAS "
             "| worst rel err | best config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    gains = []
    for key in dict.fromkeys((r["shape"], r["m"]) for r in doc["rows"]):
        pts = [r for r in doc["rows"] if (r["shape"], r["m"]) == key]
        cfgs = [r for r in pts if r["index"] is not None]
        if not cfgs:
            continue
        cub = next(r["us"] for r in pts if r["label"] == "cuBLAS bf16")
        dec = next((f"{r['us']:.2f}" for r in pts if r["label"] == "decode default"), "-")
        base = next((r for r in cfgs if r["index"] == 0), None)
        best = min(cfgs, key=lambda r: r["us"])
        ratio = best["us"] / base["us"] if base else float("nan")
        if base:
            gains.append(ratio)
        lines.append(f"| {key[0]} | {key[1]} | {cub:.2f} | {dec} | {base['us'] if base else float('nan'):.2f} | "
                     f"{best['us']:.2f} | {ratio:.3f} | {cub / best['us']:.2f}x | "
                     f"{max(r['rel_err'] for r in cfgs):.1e} | `{best['config']}` |")
    if gains:
        lines += ["", f"Geomean best / baseline: {geomean(gains):.3f} over {len(gains)} points."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=sorted(GRIDS), default="gemm")
    ap.add_argument("--grid", default="default", help="decode: default; gemm: default, wide, swizzle")
    ap.add_argument("--vary", action="append", metavar="FIELD=V1,V2",
                    help="the stored winners (--db) with this field set to each value, instead of a grid; "
                         "repeat for every combination of several fields")
    ap.add_argument("--db", help="tuning DB or export for --vary (default: the shipped tuning_db/nvidia-h200.json)")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--m", default="16,64,128,512", help="M values (with --vary: the stored M buckets)")
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the CUDA-graph timings")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="compile processes")
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel it would time, time nothing")
    ap.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    args = ap.parse_args(argv)
    if args.grid not in GRIDS[args.kernel]:
        ap.error(f"--kernel {args.kernel} has the grids {', '.join(GRIDS[args.kernel])}")
    if not args.compile_only:
        no_gpu = require_gpu("sweep_configs", "--compile-only")
        if no_gpu is not None:
            return no_gpu
    vary = parse_vary(args.vary) if args.vary else None
    records = None
    if vary:
        from autofp4.db import read_records

        records = read_records(args.db or SHIPPED_DB)[1]
    ms = [int(v) for v in args.m.split(",")]
    shapes = select_shapes(args.shapes)
    plan = {name: cases(args.kernel, args.grid, args.fmt, n, k, ms, records, vary) for name, (n, k) in shapes.items()}
    jobs = {(args.kernel, c, *shapes[name], args.fmt) for name, cs in plan.items() for _, cfgs in cs for c in cfgs}
    precompile(jobs, args.jobs)
    if args.compile_only:
        return 0
    from autofp4.timing import l2_cache_bytes

    grid = "vary-" + "-".join(dict.fromkeys(f for st in vary for f in st)) if vary else args.grid
    rows = []
    for name, cs in plan.items():
        if not cs:
            continue
        n, k = shapes[name]
        torch.cuda.empty_cache()
        gen, dense, quantized = shape_weights(n, k, [args.fmt], l2_cache_bytes(), torch.device("cuda"))
        weights = (gen, dense, quantized[args.fmt][0], {})
        for m, cfgs in cs:
            rows += measure_point(args.kernel, name, n, k, args.fmt, m, cfgs, weights, args)
        del weights, dense, quantized
    doc = {**provenance(), "kernel": args.kernel, "grid": grid, "fmt": args.fmt,
           "db": str(args.db or SHIPPED_DB) if vary else None, "rows": rows}
    path = results_dir(args.out) / f"sweep-{args.kernel}-{grid}.json"
    path.write_text(json.dumps(doc, indent=1))
    md = summary(doc)
    path.with_suffix(".md").write_text(md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
