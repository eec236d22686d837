"""How far bf16 tensor-core math lets a W4A16 GEMM go at large M (a benchmark, not a test).

At M >= 2048 an FP4 linear is compute-bound: the weight bytes are read once per tile and the
time is the bf16 wgmma math. This script measures, for every benchmark shape at M = 2048 and
8192 and in interleaved rounds of one run (CUDA graphs, medians over the rounds):

* ``cublas``: bf16 cuBLAS (``F.linear`` on the unquantized bf16 weight), the baseline;
* ``ours``: the GEMM config the dispatcher picks (tuning DB layers, shipped DB included), as is;
* ``no decode``: the same compiled config with its FP4 decode and block-scale multiply removed
  from the source (the MMA's A fragment is the packed word or the scale word itself: wrong
  values, the same loads, MMAs, pipeline and stores), i.e. what this data path does with the
  decode for free;
* ``fp8``: cuBLAS FP8 (``torch._scaled_mm``, E4M3 x E4M3, per-tensor scales, bf16 out), the
  tensor-core rate a kernel with FP8 activations (W4A8) would build on;

The weights are not rotated beyond the L2 (the work is compute-bound; on the 8B shapes every
variant may find part of its weight in L2 alike). Plus bf16 and FP8 cuBLAS on an 8192 x 8192 x 8192 GEMM, the card's rate on its best-fed shape.
Every figure is TFLOP/s (2 M N K per call). ``need`` is 1.1 x cuBLAS: the rate the 1.1x target at
M >= 2048 asks of our kernel. Prints a table last; JSON to ``$OUT/bench_ceiling.json``.

    python scripts/bench_ceiling.py --fmt nvfp4,mxfp4
    CUTE_DSL_ARCH=sm_90a python scripts/bench_ceiling.py --compile-only --db tuning_db/nvidia-h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_linear import SHAPES, geomean  # noqa: E402

MS = (2048, 8192)
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "tuning_db", "nvidia-h200.json")
TARGET = 1.1


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2 * m * n * k / (us * 1e-6) / 1e12


def picked_gemm(records, fmt: str, n: int, k: int, m: int):
    """The stored GEMM winner of ``(fmt, n, k)`` at bucket ``m`` as a kernel config (dependent
    launch off, as cuBLAS runs), or the GEMM default when the DB has none."""
    from autofp4.kernels import sm90_w4a16_gemm as G
    from gpu_probe_decode import gemm_winners

    for _, cfg in gemm_winners(records, fmt, n, k, (m,)):
        return cfg, "tuned"
    return dataclasses.replace(G.default_config(n, k, fmt, "bfloat16", m), pdl=False), "default"


def kernel_pair(records, nodec, fmt: str, n: int, k: int, m: int):
    """The picked config (:func:`picked_gemm`), where it came from, and the compiled runners of
    it and of its decode-free twin built from module ``nodec``."""
    from autofp4.kernels import sm90_w4a16_gemm as G

    cfg, source = picked_gemm(records, fmt, n, k, m)
    twin = nodec.Sm90GemmConfig(**dataclasses.asdict(cfg))
    return cfg, source, G.compile_kernel(cfg, n, k, fmt, "bfloat16"), nodec.compile_kernel(twin, n, k, fmt, "bfloat16")


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


def rounds_median(variants: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median over ``rounds`` interleaved rounds of the CUDA-graph time (us per call) of each
    ``{label: (fn, args_list)}``."""
    from autofp4.timing import time_cuda

    times: dict[str, list[float]] = {t: [] for t in variants}
    for _ in range(rounds):
        for t, (fn, args) in variants.items():
            times[t].append(time_cuda(fn, args, warmup=2, reps=reps, use_graph=True).median_us)
    return {t: statistics.median(v) for t, v in times.items()}


def card_rates(rounds: int, reps: int) -> dict[str, float]:
    """bf16 and FP8 cuBLAS TFLOP/s on 8192^3 (fresh random operands)."""
    s = 8192
    a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    q = fp8_operands(a, b)
    us = rounds_median({"bf16": (F.linear, [(a, b)]), "fp8": (fp8_linear, [q])}, rounds, reps)
    return {t: tflops(s, s, s, v) for t, v in us.items()}


def measure(args) -> dict:
    import autofp4
    from autofp4.db import read_records
    from autofp4.kernels import sm90_w4a16_gemm as G
    from gpu_probe_decode import _GEMM_SCALED, GEMM_VARIANTS, variant

    _, records = read_records(args.db or SHIPPED)
    nodec = variant("noalu", G, _GEMM_SCALED, GEMM_VARIANTS)
    fmts = args.fmt.split(",")
    shapes = [s for s in SHAPES if not args.shapes or s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    if args.compile_only:
        for fmt in fmts:
            for name in shapes:
                for m in ms:
                    kernel_pair(records, nodec, fmt, *SHAPES[name], m)
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
                cfg, source, ours, free = kernel_pair(records, nodec, fmt, n, k, m)
                ref = F.linear(x.float(), dense)
                err = float((ours(x, packed, None).float() - ref).norm() / ref.norm())
                if not err < 2e-2:
                    raise SystemExit(f"{name} {fmt} M={m}: relative error {err:.3g} against the dequantized weight")
                checks[fmt] = dict(config=str(cfg), source=source, rel_err=err)
                variants[f"{fmt} ours"] = (ours, [(x, packed, None)])
                variants[f"{fmt} no decode"] = (free, [(x, packed, None)])
            us = rounds_median(variants, args.rounds, args.reps)
            row = dict(shape=name, n=n, k=k, m=m, us=us, tflops={t: tflops(m, n, k, v) for t, v in us.items()},
                       checks=checks)
            rows.append(row)
            print(f"{name:12s} M={m:5d} " + " ".join(f"{t} {row['tflops'][t]:.0f}" for t in us), flush=True)
            del variants, x
        del w, weights
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "card": card, "fmts": fmts, "rows": rows}


def table(doc: dict) -> str:
    """Markdown: TFLOP/s per shape and M, the rate the 1.1x target needs, and ratios to cuBLAS."""
    fmts = doc["fmts"]
    head = ["shape", "M", "cuBLAS bf16", f"need ({TARGET}x)"]
    for f in fmts:
        head += [f"{f} ours", f"{f} no decode"]
    head += ["cuBLAS fp8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in doc["rows"]:
        t = r["tflops"]
        cells = [r["shape"], str(r["m"]), f"{t['cublas']:.0f}", f"{TARGET * t['cublas']:.0f}"]
        for f in fmts:
            cells += [f"{t[f + ' ours']:.0f} ({t[f + ' ours'] / t['cublas']:.2f}x)",
                      f"{t[f + ' no decode']:.0f} ({t[f + ' no decode'] / t['cublas']:.2f}x)"]
        cells.append(f"{t['fp8']:.0f} ({t['fp8'] / t['cublas']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    gm = ["geomean", "", "", ""]
    for f in fmts:
        for v in ("ours", "no decode"):
            gm.append(f"{geomean([r['tflops'][f'{f} {v}'] / r['tflops']['cublas'] for r in doc['rows']]):.2f}x")
    gm.append(f"{geomean([r['tflops']['fp8'] / r['tflops']['cublas'] for r in doc['rows']]):.2f}x")
    lines.append("| " + " | ".join(gm) + " |")
    card = doc["card"]
    best = geomean([card["bf16"] / r["tflops"]["cublas"] for r in doc["rows"]])
    lines.append("")
    lines.append(f"{doc['gpu']}, {doc['date']}, torch {doc['torch']}; TFLOP/s (2 M N K per call), CUDA-graph medians; "
                 f"8192^3 cuBLAS: bf16 {card['bf16']:.0f}, fp8 {card['fp8']:.0f} TFLOP/s. A kernel running every row "
                 f"at the 8192^3 bf16 rate would be {best:.2f}x cuBLAS (geomean; target {TARGET}x).")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    """Bars of TFLOP/s per (shape, M): cuBLAS bf16, ours and ours without decode per format, with
    the rate the 1.1x target needs marked on each group and the card's 8192^3 bf16 rate as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["cublas"] + [f"{f} {v}" for f in doc["fmts"] for v in ("ours", "no decode")]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="", help="comma-separated names from bench_linear.SHAPES")
    ap.add_argument("--db", help="tuning DB or export (default: the shipped tuning_db/nvidia-h200.json)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel it would time, time nothing")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of an earlier run's JSON and plot it "
                    "next to it (.png)")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            doc = json.load(f)
        print(table(doc))
        plot(doc, os.path.splitext(args.table)[0] + ".png")
        return 0
    if not args.compile_only and not torch.cuda.is_available():
        print("bench_ceiling needs a CUDA GPU (or --compile-only, --table)", file=sys.stderr)
        return 2
    doc = measure(args)
    if not doc:
        return 0
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_ceiling.json"), "w") as f:
            json.dump(doc, f, indent=1)
        plot(doc, os.path.join(os.environ["OUT"], "bench_ceiling.png"))
    print()
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
