"""Why bf16 cuBLAS times vary inside ``scripts/bench_linear.py`` (a diagnostic, not a test).

Alone in a process, ``F.linear`` on 70B gate_up at M = 16 takes 216-223 us on the H200; inside
the benchmark, the NVFP4 and MXFP4 rows of one run timed the same op at 218 and 262 us. This
script times cuBLAS on one shape and M the way the benchmark does (CUDA graph, 3 warm-up, the
same rotation) under several conditions, each ``--rounds`` times:

- ``alone``: cuBLAS only;
- ``<fmt> bench order``: rounds as the benchmark runs them: cuBLAS, the backend's default
  config, the dispatcher's pick, the pick with programmatic dependent launch (PDL) off;
- ``<fmt> after pick, pdl`` / ``nopdl``: each cuBLAS timing right after timing the pick with PDL
  on / off;
- ``<fmt> bench order, one stream``: as ``<fmt> bench order``, every timing on one stream
  instead of a new one from torch's pool per timing.

With ``--hold-all`` it first allocates every benchmark shape's bf16 and FP4 weight copies, as the
benchmark holds them all through its run.

    python scripts/gpu_cublas_variance.py --shape "70B gate_up" --m 16 --rounds 6

Prints one line per condition: the cuBLAS medians in us, then their min, median and max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_linear import SHAPES, shape_weights  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="70B gate_up", choices=list(SHAPES))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hold-all", action="store_true",
                    help="hold every benchmark shape's weights, as the benchmark does")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_cublas_variance needs a CUDA GPU", file=sys.stderr)
        return 2

    from autofp4.backends import ProblemKey, available_backends
    from autofp4.dispatch import get_dispatcher
    from autofp4.pdl import pdl
    from autofp4.timing import l2_cache_bytes, time_cuda

    dev = torch.device("cuda")
    n, k = SHAPES[args.shape]
    m = args.m
    l2 = l2_cache_bytes(dev)
    backend = available_backends(dev)[0]
    disp = get_dispatcher(dev)
    fmts = args.fmt.split(",")
    held = []
    if args.hold_all:
        for other, (n2, k2) in SHAPES.items():
            if other != args.shape:
                _, d2, q2 = shape_weights(n2, k2, fmts, l2, dev)
                held += d2 + [w for ws, _ in q2.values() for w in ws]
        print(f"holding {sum(t.nbytes for t in held) / 2**30:.1f} GiB of other shapes' weights", flush=True)
    gen, dense, quantized = shape_weights(n, k, fmts, l2, dev)
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    cargs = [(x, d) for d in dense]

    ours = {}
    for fmt, (ws, _) in quantized.items():
        key = ProblemKey("linear", fmt, "bfloat16", n, k)
        tb, tcfg = disp.pick(key, m)
        qargs = [(x, w.packed(backend.name, backend.prepare), None) for w in ws]
        ours[fmt] = (disp.runner(backend, backend.default(key, m), key), disp.runner(tb, tcfg, key), qargs)
        print(f"{fmt} pick: {tb.name} {tcfg.model_dump(mode='json', exclude_none=True)}", flush=True)

    def cublas(stream=None) -> float:
        return time_cuda(F.linear, cargs, warmup=3, reps=args.reps, use_graph=True, stream=stream).median_us

    def ours_us(run, qargs, on: bool, stream=None) -> float:
        with pdl(on):
            return time_cuda(run, qargs, warmup=3, reps=args.reps, use_graph=True, stream=stream).median_us

    results: dict[str, list[float]] = {"alone": [cublas() for _ in range(args.rounds)]}
    one = torch.cuda.Stream()
    for fmt, (default, pick, qargs) in ours.items():
        for label, stream in ((f"{fmt} bench order", None), (f"{fmt} bench order, one stream", one)):
            xs = []
            for _ in range(args.rounds):
                xs.append(cublas(stream))
                for run, on in ((default, True), (pick, True), (pick, False)):
                    ours_us(run, qargs, on, stream)
            results[label] = xs
        for label, on in ((f"{fmt} after pick, pdl", True), (f"{fmt} after pick, nopdl", False)):
            xs = []
            for _ in range(args.rounds):
                ours_us(pick, qargs, on)
                xs.append(cublas())
            results[label] = xs
    results["alone, again"] = [cublas() for _ in range(args.rounds)]

    print(f"\n{torch.cuda.get_device_name(dev)}, torch {torch.__version__}: bf16 cuBLAS on {args.shape} "
          f"({n}x{k}), M = {m}, CUDA-graph medians in us")
    for label, xs in results.items():
        print(f"{label:32s} " + " ".join(f"{v:7.1f}" for v in xs)
              + f"   min {min(xs):7.1f}  median {statistics.median(xs):7.1f}  max {max(xs):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
