"""What a call costs in the CUDA-graph timing harness before any weight byte moves.

For N x K FP4 weights of the benchmark shapes: a 1-element add (the cost of one graph kernel
node), and a device copy that moves as many bytes as the FP4 weight holds (value bytes + block
scales; half read, half written), rotated past the L2 like the benchmark. The copy is what one
well-tuned memory-bound launch moves in this harness; compare the decode kernel's M = 1 time
with it, not only with bytes / copy bandwidth.

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
        half = nbytes // 2 // 16 * 16
        bufs = [torch.randint(0, 255, (half,), dtype=torch.uint8, device="cuda") for _ in range(copies)]
        outs = [torch.empty_like(b) for b in bufs]
        fns = [(lambda i=i: outs[i].copy_(bufs[i])) for i in range(copies)] * 2
        us = graph_time(fns)[0]
        rows.append((name, nbytes, us))
        del bufs, outs
    print(f"\n{'shape':12s} {'MB':>7s} {'copy us':>8s} {'TB/s':>6s}")
    for name, nbytes, us in rows:
        print(f"{name:12s} {nbytes / 1e6:7.2f} {us:8.2f} {nbytes / us / 1e6:6.2f}")


if __name__ == "__main__":
    main()
