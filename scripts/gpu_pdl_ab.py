"""Dependent launch on / off, interleaved (a benchmark, not a test).

``bench_linear.py`` times a config with programmatic dependent launch and then without it, so a
GPU that slows down as it heats under long GEMMs favours the first. Here cuBLAS, the default
config with PDL and the same config without it are timed in turns (C, on, off, C, on, off, ...),
each a CUDA graph of back-to-back calls on rotating weights, and the medians over the rounds are
compared.

    python scripts/gpu_pdl_ab.py --rounds 4 [--points "8B gate_up:2048,70B down:1"]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from bench_linear import SHAPES

POINTS = "8B qkv:1,70B down:1,8B gate_up:16,8B qkv:64,8B o:128,8B gate_up:512,8B gate_up:2048,70B gate_up:2048"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default=POINTS, help="shape:M pairs, comma-separated")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import autofp4
    from autofp4.backends import ProblemKey, get_backend
    from autofp4.pdl import pdl
    from autofp4.timing import copies_for_cold_l2, l2_cache_bytes, time_cuda

    dev = torch.device("cuda")
    l2 = l2_cache_bytes(dev)
    b = get_backend("sm90_w4a16")
    print(f"{'shape':12s} {'M':>5s} {'kernel':6s} {'cuBLAS':>8s} {'PDL on':>8s} {'PDL off':>8s} {'off/on':>7s}  (us, medians of "
          f"{args.rounds} interleaved rounds)")
    for point in args.points.split(","):
        name, m = point.rsplit(":", 1)
        m = int(m)
        n, k = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(n + k + m)
        nd = copies_for_cold_l2(n * k * 2, l2, max_copies=8)
        dense = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(nd)]
        ws = [autofp4.quantize(d, args.fmt) for d in dense]
        fp4_bytes = ws[0].data.numel() + ws[0].scale.numel() * ws[0].scale.element_size()
        nq = copies_for_cold_l2(fp4_bytes, l2, max_copies=32)
        while len(ws) < nq:
            ws.append(autofp4.quantize(torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02, args.fmt))
        xs = [torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(max(nq, nd))]
        key = ProblemKey("linear", args.fmt, "bfloat16", n, k)
        cfg = b.default(key, m).model_copy(update={"pdl": True})
        run = b.compile(cfg, key)
        qargs = [(xs[i % len(xs)], ws[i].packed(b.name, b.prepare), None) for i in range(nq)]
        cargs = [(xs[i % len(xs)], dense[i % nd]) for i in range(nd)]
        t = {"c": [], "on": [], "off": []}
        for _ in range(args.rounds):
            t["c"].append(time_cuda(F.linear, cargs, warmup=3, reps=args.reps, use_graph=True).median_us)
            t["on"].append(time_cuda(run, qargs, warmup=3, reps=args.reps, use_graph=True).median_us)
            with pdl(False):
                t["off"].append(time_cuda(run, qargs, warmup=3, reps=args.reps, use_graph=True).median_us)
        c, on, off = (statistics.median(t[x]) for x in ("c", "on", "off"))
        print(f"{name:12s} {m:5d} {cfg.kernel:6s} {c:8.1f} {on:8.1f} {off:8.1f} {off / on:7.3f}", flush=True)
        del dense, ws, xs, qargs, cargs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
