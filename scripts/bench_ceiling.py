"""How far bf16 tensor-core math lets a W4A16 GEMM go at large M.

At M >= 2048 an FP4 linear is compute-bound: the weight bytes are read once per tile and the
time is the bf16 wgmma math. For every Llama-3.1-8B / 70B shape (``scripts/_common.py``) at
M = 2048 and 8192 this measures, in interleaved rounds of one run:

* ``cublas``: bf16 cuBLAS (``F.linear`` on the unquantized bf16 weight), the baseline;
* ``<fmt> ours``: the GEMM config a tuning DB stores for the shape and M bucket (``--db``,
  default the shipped ``tuning_db/nvidia-h200.json``), else the GEMM's default config; dependent
  launch off, as cuBLAS runs;
* ``fp8``: cuBLAS FP8 (``torch._scaled_mm``, E4M3 x E4M3, per-tensor scales, bf16 out), the
  tensor-core rate a kernel with FP8 activations (W4A8) would build on;

plus bf16 and FP8 cuBLAS on an 8192 x 8192 x 8192 GEMM, the card's rate on its best-fed shape.

How: CUDA graphs, CUDA events, the median over ``--rounds`` interleaved rounds of each
variant's median; our output is checked against the dequantized weight first (relative error
< 2e-2). The weights are not rotated beyond the L2 (the work is compute-bound; on the 8B shapes
every variant may find part of its weight in L2 alike). Every figure is TFLOP/s (2 M N K per
call). ``need`` is 1.1 x cuBLAS: the rate the 1.1x target at M >= 2048 asks of our kernel.

Writes ``ceiling.json``, ``ceiling.md`` (the table) and ``ceiling.png`` to ``--out`` (default
``docs/results/<gpu>/``).

    python scripts/bench_ceiling.py --fmt nvfp4,mxfp4
    python scripts/bench_ceiling.py --table docs/results/nvidia-h200/ceiling.json   # anywhere: re-render
    CUTE_DSL_ARCH=sm_90a python scripts/bench_ceiling.py --compile-only   # no GPU: compile what it would time
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (SHAPES, SHIPPED_DB, geomean, interleaved_medians, provenance, provenance_line, rel_err,
                     require_gpu, results_dir, select_shapes, stored_winners, without_pdl)

MS = (2048, 8192)
SHIPPED = SHIPPED_DB
TARGET = 1.1


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2 * m * n * k / (us * 1e-6) / 1e12


def picked_gemm(records, fmt: str, n: int, k: int, m: int):
    """The stored GEMM winner of ``(fmt, n, k)`` at bucket ``m`` as a kernel config (dependent
    launch off, as cuBLAS runs), or the GEMM default when the DB has none."""
    from autofp4.backends import sm90_heuristics as H

    for _, cfg in stored_winners(records, "gemm", fmt, n, k, (m,)):
        return cfg, "tuned"
    return without_pdl(H.gemm_default(n, k, fmt, "bfloat16", m)), "default"


def fp8_operands(x: torch.Tensor, w: torch.Tensor):
    """``x`` and ``w`` in E4M3 with per-tensor scales (amax / 448), laid out as ``_scaled_mm``
    wants them (x row-major, w^T column-major)."""
    def q(t):
        s = (t.abs().amax().float() / 448.0).clamp(min=1e-12)
        return (t.float() / s).to(torch.float8_e4m3fn), s.reshape(())
    xq, sx = q(x)
    wq, sw = q(w)
    return xq, wq.t(), sx, sw


def fp8_linear(xq, wqt, sx, sw):
    return torch._scaled_mm(xq, wqt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def card_rates(rounds: int, reps: int) -> dict[str, float]:
    """bf16 and FP8 cuBLAS TFLOP/s on 8192^3 (fresh random operands)."""
    s = 8192
    a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    q = fp8_operands(a, b)
    us = interleaved_medians({"bf16": (F.linear, [(a, b)]), "fp8": (fp8_linear, [q])}, rounds, reps)
    return {t: tflops(s, s, s, v) for t, v in us.items()}


def measure(args) -> dict:
    import autofp4
    from autofp4.db import read_records
    from autofp4.kernels import sm90_w4a16_gemm as G

    _, records = read_records(args.db or SHIPPED)
    fmts = args.fmt.split(",")
    shapes = list(select_shapes(args.shapes))
    ms = [int(v) for v in args.m.split(",")]
    if args.compile_only:
        for fmt in fmts:
            for name in shapes:
                for m in ms:
                    n, k = SHAPES[name]
                    G.compile_only(picked_gemm(records, fmt, n, k, m)[0], n, k, fmt, "bfloat16")
        print("compiled")
        return {}
    card = card_rates(args.rounds, args.reps)
    print(f"8192^3 cuBLAS: bf16 {card['bf16']:.0f} TFLOP/s, fp8 {card['fp8']:.0f} TFLOP/s", flush=True)
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        torch.cuda.empty_cache()
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        # per format: the packed weight and the dequantized one the check compares against
        weights = {}
        for fmt in fmts:
            fw = autofp4.quantize(w, fmt)
            weights[fmt] = (G.pack_weight(fw), fw.dequantize(torch.float32))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            variants = {"cublas": (F.linear, [(x, w)]), "fp8": (fp8_linear, [fp8_operands(x, w)])}
            checks = {}
            for fmt, (packed, dense) in weights.items():
                cfg, source = picked_gemm(records, fmt, n, k, m)
                ours = G.compile_kernel(cfg, n, k, fmt, "bfloat16")
                err = rel_err(ours(x, packed, None), F.linear(x.float(), dense))
                if not err < 2e-2:
                    raise SystemExit(f"{name} {fmt} M={m}: relative error {err:.3g} against the dequantized weight")
                checks[fmt] = dict(config=str(cfg), source=source, rel_err=err)
                variants[f"{fmt} ours"] = (ours, [(x, packed, None)])
            us = interleaved_medians(variants, args.rounds, args.reps)
            row = dict(shape=name, n=n, k=k, m=m, us=us, tflops={t: tflops(m, n, k, v) for t, v in us.items()},
                       checks=checks)
            rows.append(row)
            print(f"{name:12s} M={m:5d} " + " ".join(f"{t} {row['tflops'][t]:.0f}" for t in us), flush=True)
            del variants, x
        del w, weights
    return {**provenance(), "db": str(args.db or SHIPPED), "card": card, "fmts": fmts, "rows": rows}


def table(doc: dict) -> str:
    """Markdown: TFLOP/s per shape and M, the rate the 1.1x target needs, and ratios to cuBLAS."""
    fmts = doc["fmts"]
    head = ["shape", "M", "cuBLAS bf16", f"need ({TARGET}x)"]
    head += [f"{f} ours" for f in fmts]
    head += ["cuBLAS fp8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in doc["rows"]:
        t = r["tflops"]
        cells = [r["shape"], str(r["m"]), f"{t['cublas']:.0f}", f"{TARGET * t['cublas']:.0f}"]
        cells += [f"{t[f + ' ours']:.0f} ({t[f + ' ours'] / t['cublas']:.2f}x)" for f in fmts]
        cells.append(f"{t['fp8']:.0f} ({t['fp8'] / t['cublas']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    gm = ["geomean", "", "", ""]
    for f in fmts:
        gm.append(f"{geomean([r['tflops'][f'{f} ours'] / r['tflops']['cublas'] for r in doc['rows']]):.2f}x")
    gm.append(f"{geomean([r['tflops']['fp8'] / r['tflops']['cublas'] for r in doc['rows']]):.2f}x")
    lines.append("| " + " | ".join(gm) + " |")
    card = doc["card"]
    best = geomean([card["bf16"] / r["tflops"]["cublas"] for r in doc["rows"]])
    lines.append("")
    lines.append(f"{provenance_line(doc)} TFLOP/s (2 M N K per call), CUDA-graph medians; "
                 f"8192^3 cuBLAS: bf16 {card['bf16']:.0f}, fp8 {card['fp8']:.0f} TFLOP/s. A kernel running every row "
                 f"at the 8192^3 bf16 rate would be {best:.2f}x cuBLAS (geomean; target {TARGET}x).")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    """Bars of TFLOP/s per (shape, M): cuBLAS bf16 and ours per format (FP8 is in the table), with
    the rate the 1.1x target needs marked on each group and the card's 8192^3 bf16 rate as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["cublas"] + [f"{f} ours" for f in doc["fmts"]]
    rows = doc["rows"]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.8))
    for i, t in enumerate(labels):
        ax.bar([j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))],
               [r["tflops"][t] for r in rows], width, label=t)
    ax.scatter(range(len(rows)), [TARGET * r["tflops"]["cublas"] for r in rows], marker="_", s=900, color="k",
               zorder=3, label=f"needed for {TARGET}x cuBLAS")
    ax.axhline(doc["card"]["bf16"], color="r", lw=1, ls="--", label="cuBLAS bf16 on 8192^3")
    ax.set_xticks(range(len(rows)), [f"{r['shape']}\nM={r['m']}" for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (CUDA graph)")
    ax.set_ylim(0.6 * min(r["tflops"]["cublas"] for r in rows), 1.2 * max(TARGET * r["tflops"]["cublas"] for r in rows))
    ax.set_title(f"bf16 tensor-core rate at M >= 2048: {doc['gpu']}, {doc['date']}")
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(doc: dict, json_path: Path) -> str:
    """Write ``doc`` to ``json_path`` and its table (``.md``) and plot (``.png``, when matplotlib
    is installed) next to it; return the table."""
    json_path.write_text(json.dumps(doc, indent=1))
    md = table(doc) + "\n"
    json_path.with_suffix(".md").write_text(md)
    try:
        plot(doc, str(json_path.with_suffix(".png")))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install autofp4[plot])", file=sys.stderr)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--db", help="tuning DB or export (default: the shipped tuning_db/nvidia-h200.json)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel it would time, time nothing")
    ap.add_argument("--table", metavar="JSON", help="only re-render the table and plot of a saved run, next to it")
    args = ap.parse_args(argv)
    if args.table:
        print(render(json.loads(Path(args.table).read_text()), Path(args.table)))
        return 0
    if not args.compile_only:
        no_gpu = require_gpu("bench_ceiling", "--compile-only, --table")
        if no_gpu is not None:
            return no_gpu
    doc = measure(args)
    if not doc:
        return 0
    print()
    print(render(doc, results_dir(args.out) / "ceiling.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
