"""Time ``autofp4.quantize`` for NVFP4 and MXFP4: how long quantizing one weight takes.

The target: a [28672, 4096] bf16 weight (an 8B model's fused gate_up) quantizes in under 0.5 s
on an H200 (exit code 1 when a CUDA median is over ``--limit``). On CUDA every repetition is
timed with CUDA events after warm-up; on the CPU with ``time.perf_counter``. The table shows the
median, min and max, the bytes moved per second (input read + packed values and scales written)
and the peak extra device memory.

Writes ``quantize.json`` and ``quantize.md`` (the table) to ``--out`` (default
``docs/results/<device>/``, e.g. ``docs/results/nvidia-h200/``, ``docs/results/cpu/``).

    python scripts/bench_quantize.py                          # CUDA if present, else CPU
    python scripts/bench_quantize.py --device cpu --reps 3
    python scripts/bench_quantize.py --shape 32 2880 5760 --dtype bfloat16   # stacked experts
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _common import provenance, provenance_line, results_dir

from autofp4.problem import BLOCK_SIZE, FORMATS
from autofp4.weights import quantize

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_once_cuda(fn) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_once_cpu(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_one(w: torch.Tensor, fmt: str, warmup: int, reps: int) -> dict:
    cuda = w.is_cuda
    fn = lambda: quantize(w, fmt)  # noqa: E731
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(w.device)
        torch.cuda.reset_peak_memory_stats(w.device)
        base = torch.cuda.memory_allocated(w.device)
    times = [(time_once_cuda if cuda else time_once_cpu)(fn) for _ in range(reps)]
    peak = (torch.cuda.max_memory_allocated(w.device) - base) if cuda else None
    out = quantize(w, fmt)
    moved = w.numel() * w.element_size() + out.nbytes
    med = statistics.median(times)
    return {
        "fmt": fmt,
        "shape": list(w.shape),
        "dtype": str(w.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(w.device) if cuda else "cpu",
        "reps": reps,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "gb_per_s": moved / med / 1e9,
        "peak_extra_bytes": peak,
    }


def table(rows: list[dict], limit: float | None) -> str:
    head = ["fmt", "shape", "dtype", "device", "median ms", "min ms", "max ms", "GB/s", "peak GiB"]
    if limit:
        head.append(f"< {limit * 1e3:.0f} ms")
    lines = []
    for r in rows:
        line = [
            r["fmt"],
            "x".join(map(str, r["shape"])),
            r["dtype"],
            r["device"],
            f"{r['median_s'] * 1e3:.2f}",
            f"{r['min_s'] * 1e3:.2f}",
            f"{r['max_s'] * 1e3:.2f}",
            f"{r['gb_per_s']:.1f}",
            "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**30:.2f}",
        ]
        if limit:
            line.append("ok" if r["median_s"] < limit else "SLOW")
        lines.append(line)
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt_row(head), fmt_row(["-" * w for w in widths])] + [fmt_row(l) for l in lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", type=int, nargs="+", default=[28672, 4096], help="N K or E N K")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--warmup", type=int, default=None, help="default: 3 on CUDA, 1 on the CPU")
    p.add_argument("--reps", type=int, default=None, help="default: 20 on CUDA, 3 on the CPU")
    p.add_argument("--limit", type=float, default=0.5,
                   help="seconds a CUDA median must stay under (exit code 1 otherwise); 0 disables")
    p.add_argument("--out", help="results directory (default: docs/results/<device>/)")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    reps = args.reps if args.reps is not None else (20 if cuda else 3)
    if len(args.shape) not in (2, 3):
        p.error(f"--shape takes N K or E N K, got {args.shape}")
    for fmt in args.formats:
        if args.shape[-1] % BLOCK_SIZE[fmt]:
            p.error(f"K={args.shape[-1]} is not a multiple of {fmt}'s block size {BLOCK_SIZE[fmt]}")

    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(*args.shape, generator=g, device=dev, dtype=torch.float32).to(DTYPES[args.dtype])
    rows = [bench_one(w, fmt, warmup, reps) for fmt in args.formats]
    limit = args.limit if (cuda and args.limit > 0) else None
    doc = {**provenance(dev), "warmup": warmup, "reps": reps, "limit_s": limit, "rows": rows}
    md = f"autofp4.quantize. {provenance_line(doc)} Warm-up {warmup}, {reps} reps.\n\n```\n{table(rows, limit)}\n```\n"
    out = results_dir(args.out, dev)
    (out / "quantize.json").write_text(json.dumps(doc, indent=2))
    (out / "quantize.md").write_text(md)
    print(md)
    return 1 if limit and any(r["median_s"] >= limit for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
