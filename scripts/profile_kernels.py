"""Nsight Compute profiles of the FP4 kernels: speed of light, occupancy, launch statistics,
memory workload and warp stall reasons of one call.

A case is a kernel and an M, ``decode-m16``, ``gemm-m128`` or ``w4a8-m8192`` (FP8 activations: the
activation quantizer and the W4A8 GEMM, both profiled), on a benchmark shape
(``scripts/_common.py``) with a fresh random weight, the kernel's default config for that M
(``--config`` JSON fields over it, e.g. ``'{"smem_stages": 2, "warps": 8}'``) and dependent
launch off. The output is checked against a bf16 matmul of the dequantized weight first
(relative error < 2e-2, 6e-2 with FP8 activations; else nothing is profiled); after three warm-up calls, one call runs inside
an NVTX range named ``profile``, which is the one Nsight Compute profiles.

``--ncu`` runs Nsight Compute (``ncu`` on the PATH, or ``--ncu-bin``) on every case of ``--cases``
and shape of ``--shapes``, one process each, and writes one text report per case to ``--out``
(default ``docs/results/<gpu>/ncu/``), printing its key lines. With ``--full`` it collects the
full section set instead, saves the report (``.ncu-rep``), its details page, the per-instruction
SASS view as CSV and the opcode mix of the kernel (``scripts/sass_mix.py``).

    python scripts/profile_kernels.py --ncu                            # default cases and shapes
    python scripts/profile_kernels.py --ncu --full --cases gemm-m128 --shapes "70B gate_up"
    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        python scripts/profile_kernels.py --cases decode-m16 --shapes "8B qkv"   # one case, by hand
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import SHAPES, rel_err, require_gpu, results_dir, without_pdl

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
KEY_LINES = re.compile(r"^\s+(Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per Thread|"
                       r"Theoretical Occupancy|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy)")


def parse_case(case: str) -> tuple[str, int]:
    """``"gemm-m128"`` -> ``("gemm", 128)``."""
    m = re.fullmatch(r"(decode|gemm|w4a8)-m(\d+)", case)
    if not m:
        raise SystemExit(f"a case is decode-m<M>, gemm-m<M> or w4a8-m<M>, got {case!r}")
    return m.group(1), int(m.group(2))


def run_case(case: str, shape: str, fmt: str, config: str) -> int:
    """Check one case, then run it once inside the NVTX range ``profile``."""
    from autofp4 import quantize
    from autofp4.kernels import sm90_w4a16_gemm as G
    from autofp4.kernels import sm90_w4a8_gemm as G8
    from autofp4.kernels import w4a16_decode as D
    from autofp4.backends import sm90_heuristics as H
    from autofp4.w4a8 import default_config

    kernel, m = parse_case(case)
    mod = {"decode": D, "gemm": G, "w4a8": G8}[kernel]
    defaults = {"decode": H.decode_default, "gemm": H.gemm_default, "w4a8": default_config}
    n, k = SHAPES[shape]
    w = quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)
    cfg = without_pdl(defaults[kernel](n, k, fmt, "bfloat16", m))
    if config:
        cfg = dataclasses.replace(cfg, **json.loads(config))
    run = mod.compile_kernel(cfg, n, k, fmt, "bfloat16")
    packed = (G if kernel == "w4a8" else mod).pack_weight(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    err = rel_err(run(x, packed, None), F.linear(x.float(), w.dequantize(torch.float32)))
    print(f"{case} {shape} {fmt} M={m} N={n} K={k} {cfg} rel_err={err:.1e}", flush=True)
    if not err < (6e-2 if kernel == "w4a8" else 2e-2):  # W4A8: x rounded to E4M3 (about 3e-2)
        print(f"wrong result (relative error {err:.1e}); not profiling", file=sys.stderr)
        return 1
    for _ in range(3):
        run(x, packed, None)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    run(x, packed, None)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


def profile(args, case: str, shape: str, out: Path) -> None:
    """Nsight Compute on one case in its own process; the reports under ``out``."""
    name = f"{case}-{re.sub(r'[^A-Za-z0-9]+', '_', shape)}"
    me = [sys.executable, str(Path(__file__).resolve()), "--cases", case, "--shapes", shape, "--fmt", args.fmt]
    if args.config:
        me += ["--config", args.config]
    ncu = [args.ncu_bin, "--nvtx", "--nvtx-include", "profile/"]
    report = out / f"ncu-{name}.txt"
    if args.full:
        rep = out / f"ncu-{name}"
        cmd = ncu + ["--set", "full", "--import-source", "no", "-f", "-o", str(rep)] + me
    else:
        cmd = ncu + [a for s in SECTIONS for a in ("--section", s)] + me
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        log, rc = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.timeout}s", 124
    first = next((ln for ln in log.splitlines() if "rel_err" in ln or "ERR_" in ln), "")
    print(f"{name}: rc={rc} {first[:100]}", flush=True)
    if args.full:
        (out / f"ncu-{name}.log").write_text(log)
        rep_file = f"{rep}.ncu-rep"
        details = subprocess.run([args.ncu_bin, "-i", rep_file, "--page", "details"], capture_output=True, text=True)
        report.write_text(details.stdout + details.stderr)
        sass = out / f"sass-{name}.csv"
        with open(sass, "w") as f:
            subprocess.run([args.ncu_bin, "-i", rep_file, "--page", "source", "--print-source", "sass", "--csv"],
                           stdout=f, stderr=subprocess.STDOUT)
        nk = re.search(r"N=(\d+) K=(\d+)", log)
        mix = subprocess.run([sys.executable, str(Path(__file__).with_name("sass_mix.py")), str(sass), "--hot", "400"]
                             + (["--nk", f"{nk.group(1)},{nk.group(2)}"] if nk else []), capture_output=True, text=True)
        (out / f"mix-{name}.txt").write_text(mix.stdout + mix.stderr)
        print("\n".join(mix.stdout.splitlines()[:14]))
    else:
        report.write_text(log)
    keys = [ln for ln in report.read_text().splitlines() if KEY_LINES.match(ln)]
    print("\n".join(" ".join(ln.split()) for ln in keys[:16]), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="decode-m1,decode-m16,gemm-m128",
                    help="comma-separated decode-m<M> / gemm-m<M> / w4a8-m<M> (without --ncu: exactly one)")
    ap.add_argument("--shapes", default="8B qkv,70B gate_up",
                    help="comma-separated names of: " + ", ".join(SHAPES) + " (without --ncu: exactly one)")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--config", default="", help="JSON fields over the default config")
    ap.add_argument("--ncu", action="store_true", help="run Nsight Compute on every case and shape")
    ap.add_argument("--full", action="store_true", help="with --ncu: the full section set, the SASS view, the opcode mix")
    ap.add_argument("--ncu-bin", default="ncu")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per profiled case")
    ap.add_argument("--out", help="with --ncu: reports directory (default: docs/results/<gpu>/ncu/)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for c in cases:
        parse_case(c)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}")
    no_gpu = require_gpu("profile_kernels")
    if no_gpu is not None:
        return no_gpu
    if not args.ncu:
        if len(cases) != 1 or len(shapes) != 1:
            ap.error("without --ncu, name exactly one case (--cases) and one shape (--shapes)")
        return run_case(cases[0], shapes[0], args.fmt, args.config)
    out = Path(args.out) if args.out else results_dir(None) / "ncu"
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        for shape in shapes:
            profile(args, case, shape, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
