"""Run one kernel case inside an NVTX range named ``profile``, for Nsight Compute.

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 scripts/profile_kernels.py --case decode-m16

or ``sh scripts/gpu_profile.sh`` for every case. Cases: the default config of the decode kernel
at M = 1 and 16 and of the GEMM at M = 64 and 128, on a small (8B qkv) and a large (70B gate_up) shape,
with fresh random weights; the output is checked against a bf16 matmul before profiling.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autofp4  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as G  # noqa: E402
from autofp4.kernels import w4a16_decode as D  # noqa: E402

SHAPES = {"small": (6144, 4096), "large": (57344, 8192)}
CASES = {  # name: (kernel module, M)
    "decode-m1": (D, 1),
    "decode-m16": (D, 16),
    "gemm-m64": (G, 64),
    "gemm-m128": (G, 128),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--config", default="", help="JSON fields over the default config, e.g. "
                    '\'{"smem_stages": 2, "warps": 8}\'')
    args = ap.parse_args()
    mod, m = CASES[args.case]
    n, k = SHAPES[args.shape]
    w = autofp4.quantize(torch.randn(n, k, device="cuda") * 0.05, args.fmt)
    cfg = mod.default_config(n, k, args.fmt, "bfloat16", m)
    if args.config:
        cfg = dataclasses.replace(cfg, **json.loads(args.config))
    run = mod.compile_kernel(cfg, n, k, args.fmt, "bfloat16")
    packed = mod.pack_weight(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.dequantize(torch.float32))
    out = run(x, packed, None)
    rel = float((out.float() - ref).norm() / ref.norm())
    print(f"{args.case} {args.shape} {args.fmt} M={m} N={n} K={k} {cfg} rel_err={rel:.1e}", flush=True)
    if rel > 2e-2:
        raise SystemExit(f"wrong result (rel err {rel:.1e}); not profiling")
    for _ in range(3):
        run(x, packed, None)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    run(x, packed, None)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
