"""FP4 linear against bf16 cuBLAS on one GPU: the main benchmark.

What it measures, for each Llama-3.1-8B / 70B GEMM shape (``scripts/_common.py``), M and format
(NVFP4, MXFP4), in one run:

* bf16 cuBLAS: ``F.linear`` on the unquantized bf16 weight, the baseline;
* autofp4 with its backend's default config;
* autofp4 as tuned: the dispatcher's pick from the tuning DB layers (the user DB and
  ``tuning_db/*.json``), with and without programmatic dependent launch (PDL);
* the public eager path ``autofp4.linear`` (dispatcher included), for the host overhead;
* the HBM floor: the FP4 bytes (weight values + scales) at the copy bandwidth measured in the
  same run.

How: CUDA events after warm-up, medians; weights and inputs rotated through enough copies to
exceed twice the L2 (cold L2); every variant timed inside a CUDA graph and eagerly. The
CUDA-graph times of one row are taken in ``--rounds`` interleaved rounds (cuBLAS, default,
pick, pick without PDL) and the median over the rounds is kept, so that drift during a row
favours no variant. Five rounds by default: on the H200, bf16 cuBLAS alternates between a fast
and a 10-15% slower mode in short runs of samples, which a median of two or three rounds can
land on. Every output is checked against the dequantized weight (relative error < 2e-2, else
the row is flagged).

Writes ``linear.json``, ``linear.md`` (the tables) and ``linear.png`` (speedup per M) to
``--out`` (default ``docs/results/<gpu>/``, e.g. ``docs/results/nvidia-h200/``).

    python scripts/bench_linear.py                                   # on the GPU
    python scripts/bench_linear.py --fmt nvfp4 --m 1,16 --shapes "8B qkv,8B o" --out /tmp/r
    python scripts/bench_linear.py --plot docs/results/nvidia-h200/linear.json   # anywhere: re-render
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (SHAPES, geomean, measure_copy_bandwidth, provenance, provenance_line, rel_err, require_gpu,
                     results_dir, select_shapes, shape_weights)

MS = (1, 16, 64, 128, 512, 2048, 8192)
TARGETS = [((1, 16), 2.5), ((64, 128, 512), 1.3), ((2048, 8192), 1.1)]


def bench(args) -> dict:
    import autofp4
    from autofp4.backends import available_backends
    from autofp4.problem import ProblemKey
    from autofp4.dispatch import get_dispatcher
    from autofp4.pdl import pdl, pdl_enabled
    from autofp4.timing import l2_cache_bytes, time_cuda

    dev = torch.device("cuda")
    pdl_base = pdl_enabled()  # AUTOFP4_PDL=0 benchmarks everything without it
    l2 = l2_cache_bytes(dev)
    bw = measure_copy_bandwidth()
    backend = available_backends(dev)[0]
    disp = get_dispatcher(dev)
    rows = []
    fmts = args.fmt.split(",")
    ms = sorted(int(v) for v in args.m.split(","))
    # every weight first, then the rows M by M, smallest first, so that a memory-bound row never
    # runs right after the run's largest GEMMs (the 70B rows at M = 8192 keep the GPU at full
    # power for seconds; a small-M row measured right after them ran the same config up to 12%
    # slower than the same config timed on its own)
    problems = []
    for name, (n, k) in select_shapes(args.shapes).items():
        gen, dense, quantized = shape_weights(n, k, fmts, l2, dev)
        for fmt, (ws, fp4_bytes) in quantized.items():
            problems.append((name, n, k, fmt, gen, dense, ws, fp4_bytes))
    for m in ms:
        for name, n, k, fmt, gen, dense, ws, fp4_bytes in problems:
            nd, nq = len(dense), len(ws)
            key = ProblemKey("linear", fmt, "bfloat16", n, k)
            xs = [torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(max(nq, nd))]
            r = {"shape": name, "n": n, "k": k, "m": m, "fmt": fmt, "backend": backend.name}
            cargs = [(xs[i % len(xs)], dense[i % nd]) for i in range(nd)]
            # autofp4: default config, and the dispatcher's (tuned) pick
            dcfg = backend.default(key, m)
            tb, tcfg = disp.pick(key, m)
            r["default_config"] = backend.config_dict(dcfg)
            r["tuned_config"] = backend.config_dict(tcfg) if (tb is backend and tcfg != dcfg) else None
            qargs = [(xs[i % len(xs)], ws[i].packed(backend.name, backend.prepare), None) for i in range(nq)]
            ref = F.linear(xs[0].float(), ws[0].dequantize(torch.float32))
            runs = {"default": disp.runner(backend, dcfg, key)}
            if r["tuned_config"] is not None:
                runs["tuned"] = disp.runner(tb, tcfg, key)
            for label, run in runs.items():
                err = rel_err(run(*qargs[0]), ref)
                r[f"{label}_rel_err"] = err
                if not err < 2e-2:  # recorded, and flagged in the table
                    print(f"WRONG RESULT {name} M={m} {fmt} {label}: relative error {err:.3g}", flush=True)
            pick = runs.get("tuned", runs["default"])
            # CUDA-graph times in interleaved rounds (cuBLAS, default, pick, the pick with
            # programmatic dependent launch off, as cuBLAS runs), medians over the rounds: a
            # GPU that slows down as it heats under long GEMMs favours no variant
            variants = [("cublas", F.linear, cargs, pdl_base), ("default", runs["default"], qargs, pdl_base)]
            if "tuned" in runs:
                variants.append(("tuned", runs["tuned"], qargs, pdl_base))
            variants.append(("tuned_nopdl", pick, qargs, False))
            samples: dict[str, list[float]] = {v[0]: [] for v in variants}
            for _ in range(args.rounds):
                for label, fn, fargs, on in variants:
                    with pdl(on):
                        samples[label].append(
                            time_cuda(fn, fargs, warmup=3, reps=args.reps, use_graph=True).median_us)
            for label, xs_us in samples.items():
                r[f"{label}_graph_us"] = statistics.median(xs_us)
            r["cublas_eager_us"] = time_cuda(F.linear, cargs, warmup=3, reps=args.reps).median_us
            for label, run in runs.items():
                r[f"{label}_eager_us"] = time_cuda(run, qargs, warmup=3, reps=args.reps).median_us
            if "tuned" not in runs:
                for t in ("graph", "eager"):
                    r[f"tuned_{t}_us"] = r[f"default_{t}_us"]
            # the public eager path (dispatcher + runner), for host overhead
            pargs = [(xs[i % len(xs)], ws[i]) for i in range(nq)]
            r["api_eager_us"] = time_cuda(autofp4.linear, pargs, warmup=3, reps=args.reps).median_us
            r["hbm_floor_us"] = fp4_bytes / bw * 1e6
            derive(r)
            rows.append(r)
            print(
                f"{name:12s} {fmt} M={m:5d} cublas {r['cublas_graph_us']:8.1f}us default {r['default_graph_us']:8.1f}us "
                f"tuned {r['tuned_graph_us']:8.1f}us  x{r['speedup_tuned']:.2f}  floor {r['floor_pct']:.0f}%",
                flush=True,
            )
            del xs, cargs, qargs, pargs
            if args.partial:  # keep what was measured if the run is cut short
                (args.out / "linear.json").write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
    del problems
    torch.cuda.empty_cache()
    return {**provenance(dev), "copy_bandwidth_tbs": bw / 1e12, "rows": rows}


def derive(r: dict) -> dict:
    """Speedups and % of the HBM floor from a row's times. "tuned" is what the dispatcher runs
    (its pick with the tuning DB), even where the default config measured faster."""
    r["speedup_default"] = r["cublas_graph_us"] / r["default_graph_us"]
    r["speedup_tuned"] = r["cublas_graph_us"] / r["tuned_graph_us"]
    r["floor_pct"] = 100 * r["hbm_floor_us"] / r["tuned_graph_us"]
    if "tuned_nopdl_graph_us" in r:
        r["speedup_nopdl"] = r["cublas_graph_us"] / r["tuned_nopdl_graph_us"]
    return r


def against_fastest_cublas(rows: list[dict]) -> list[dict]:
    """Each row's pick against the fastest cuBLAS time the run measured for its (shape, M): the
    formats' rows of one (shape, M) time the same bf16 op on the same weights, yet on the H200
    their cuBLAS medians have differed by up to 20% within a run, so the speedup over the faster
    of them is the one no cuBLAS outlier flatters."""
    fastest: dict[tuple, float] = {}
    for r in rows:
        key = (r["shape"], r["m"])
        fastest[key] = min(fastest.get(key, math.inf), r["cublas_graph_us"])
    for r in rows:
        r["cublas_fastest_graph_us"] = fastest[(r["shape"], r["m"])]
        r["speedup_tuned_fastest"] = r["cublas_fastest_graph_us"] / r["tuned_graph_us"]
    return rows


def _table_order(rows: list[dict]) -> list[dict]:
    """Rows by shape (in ``SHAPES`` order), format (as first measured) and M, whatever order they
    were measured in."""
    shapes, fmts = list(SHAPES), list(dict.fromkeys(r["fmt"] for r in rows))
    return sorted(rows, key=lambda r: (shapes.index(r["shape"]) if r["shape"] in shapes else len(shapes),
                                       r["shape"], fmts.index(r["fmt"]), r["m"]))


def markdown(doc: dict) -> str:
    rows = _table_order(doc["rows"])
    out = [
        f"FP4 linear vs bf16 cuBLAS. {provenance_line(doc)} Copy bandwidth "
        f"{doc['copy_bandwidth_tbs']:.2f} TB/s. Times in us, CUDA-graph medians, cold L2; each graph runs "
        "the op back to back on rotating weights and inputs. autofp4 launches with programmatic dependent "
        "launch (PDL), so a call may overlap the end of the one before; \"tuned, PDL off\" is the same pick "
        "without it, as cuBLAS runs.",
        "",
        "| shape | N x K | fmt | M | cuBLAS bf16 | autofp4 default | autofp4 tuned | speedup | tuned, PDL off | speedup | HBM floor | % of floor | eager cuBLAS | eager autofp4 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nopdl = all("speedup_nopdl" in r for r in rows)
    for r in rows:
        np_us = f"{r['tuned_nopdl_graph_us']:.1f}" if "tuned_nopdl_graph_us" in r else "-"
        np_x = f"{r['speedup_nopdl']:.2f}x" if "speedup_nopdl" in r else "-"
        out.append(
            f"| {r['shape']} | {r['n']}x{r['k']} | {r['fmt']} | {r['m']} | {r['cublas_graph_us']:.1f} | "
            f"{r['default_graph_us']:.1f} | {r['tuned_graph_us']:.1f} | {r['speedup_tuned']:.2f}x | {np_us} | {np_x} | "
            f"{r['hbm_floor_us']:.1f} | {r['floor_pct']:.0f}% | {r['cublas_eager_us']:.1f} | {r['api_eager_us']:.1f} |"
            + ("" if max(r.get("default_rel_err", 0), r.get("tuned_rel_err", 0)) < 2e-2 else " WRONG RESULT |")
        )
    against_fastest_cublas(rows)
    out += ["", "Geomean speedup over bf16 cuBLAS (CUDA graph) per format and M group, against the targets "
            "(\"tuned vs fastest cuBLAS\": against the fastest cuBLAS time this run measured for the row's shape "
            "and M, over all its formats' rows):", "",
            "| fmt | M | default | tuned | tuned, PDL off | tuned vs fastest cuBLAS | target |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for fmt in sorted({r["fmt"] for r in rows}):
        for ms, target in TARGETS:
            sel = [r for r in rows if r["fmt"] == fmt and r["m"] in ms]
            if sel:
                off = f"{geomean(r['speedup_nopdl'] for r in sel):.2f}x" if nopdl else "-"
                out.append(
                    f"| {fmt} | {','.join(map(str, ms))} | {geomean(r['speedup_default'] for r in sel):.2f}x | "
                    f"{geomean(r['speedup_tuned'] for r in sel):.2f}x | {off} | "
                    f"{geomean(r['speedup_tuned_fastest'] for r in sel):.2f}x | {target}x |"
                )
    return "\n".join(out) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = sorted({r["fmt"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(fmts), figsize=(6 * len(fmts), 4.5), squeeze=False, sharey=True)
    for ax, fmt in zip(axes[0], fmts):
        for shape in dict.fromkeys(r["shape"] for r in doc["rows"]):
            sel = sorted((r for r in doc["rows"] if r["fmt"] == fmt and r["shape"] == shape), key=lambda r: r["m"])
            ax.plot([r["m"] for r in sel], [r["speedup_tuned"] for r in sel], marker="o", label=shape)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_title(f"{fmt}: autofp4 (dispatcher pick) vs bf16 cuBLAS")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup (CUDA graph)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{doc['gpu']}, {doc['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(doc: dict, json_path: Path) -> str:
    """Write ``doc`` to ``json_path`` and its tables (``.md``) and plot (``.png``, when
    matplotlib is installed) next to it; return the tables."""
    json_path.write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    json_path.with_suffix(".md").write_text(md)
    try:
        plot(doc, json_path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install autofp4[plot])", file=sys.stderr)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    p.add_argument("--fmt", default="nvfp4,mxfp4")
    p.add_argument("--m", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default="", help="comma-separated subset of: " + ", ".join(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the CUDA-graph timings")
    p.add_argument("--partial", action="store_true",
                   help="rewrite linear.json with the rows measured so far after each one")
    p.add_argument("--plot", metavar="JSON", help="only re-render the tables and plot of a saved run, next to it")
    args = p.parse_args(argv)
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        doc["rows"] = against_fastest_cublas([derive(r) for r in doc["rows"]])  # by the current rules
        print(render(doc, Path(args.plot)))
        return 0
    no_gpu = require_gpu("bench_linear", "--plot")
    if no_gpu is not None:
        return no_gpu
    args.out = results_dir(args.out)
    doc = bench(args)
    against_fastest_cublas(doc["rows"])
    print(render(doc, args.out / "linear.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
