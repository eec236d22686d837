"""What a call costs in the CUDA-graph timing harness before any weight byte moves.

For N x K FP4 weights of the benchmark shapes: a 1-element add (the cost of one graph kernel
node), and a streaming read of exactly the FP4 bytes (value bytes + block scales) with a torch
sum of it as int32, rotated past the L2 like the benchmark. The read is what a perfect
memory-bound kernel of one launch could reach in this harness; compare the decode kernel's M = 1
time with it, not only with bytes / copy bandwidth.

    python scripts/gpu_probe_floor.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_linear import SHAPES  # noqa: E402
from gpu_check_decode import L2_BYTES, fp4_bytes, graph_time  # noqa: E402


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t = torch.randn(1, device="cuda")
    empty = graph_time([lambda: t.add_(1.0) for _ in range(200)])[0]
    print(f"one graph kernel node (1-element add): {empty:.2f} us", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = fp4_bytes(n, k, "nvfp4")
        copies = max(2, int(-(-3 * L2_BYTES // nbytes)))
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        outs = [torch.empty((), dtype=torch.int64, device="cuda") for _ in range(copies)]
        fns = [(lambda i=i: torch.sum(bufs[i], dim=0, out=outs[i])) for i in range(copies)] * 2
        us = graph_time(fns)[0]
        rows.append((name, nbytes, us))
        del bufs
    print(f"\n{'shape':12s} {'MB':>7s} {'read us':>8s} {'TB/s':>6s}")
    for name, nbytes, us in rows:
        print(f"{name:12s} {nbytes / 1e6:7.2f} {us:8.2f} {nbytes / us / 1e6:6.2f}")


if __name__ == "__main__":
    main()
