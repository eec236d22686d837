"""FP8 activations with FP4 weights (W4A8) on Hopper: speed against bf16 and FP8 cuBLAS, and error.

For every Llama-3.1-8B / 70B shape (``scripts/_common.py``) at M = 512, 2048 and 8192, in
interleaved rounds of one run (TFLOP/s, 2 M N K per call, CUDA-graph medians):

* ``cublas``: bf16 cuBLAS (``F.linear`` on the unquantized bf16 weight), the baseline;
* ``w4a16``: our bf16-activation GEMM, the config the shipped DB stores (else its default);
* ``w4a8``: ``autofp4.linear(x, w, act_dtype="fp8")``'s in-kernel path: the activation quantizer
  and the W4A8 GEMM, the fastest of ``--configs`` candidates around
  :func:`autofp4.w4a8.default_config` (each candidate's time is in the JSON); ``w4a8 gemm``: its
  GEMM alone on pre-quantized activations;
* ``w4a8 cublas``: the cuBLAS path (:mod:`autofp4.kernels.w4a8_cublas`): the activation quantizer,
  the FP4 -> E4M3 conversion of the weight and cuBLAS's FP8 GEMM, whole call, the fastest of its
  ``chunk_n`` configs (each one's time in the JSON);
* ``fp8``: cuBLAS FP8 (``torch._scaled_mm``, E4M3 x E4M3 with per-token and per-channel scales,
  bf16 out, fast accumulation), which reads twice the weight bytes of an FP4 weight.

Every W4A8 output is checked against float64 math on the same E4M3 operands first. Then the
error of each path, against float64 math on the dequantized FP4 weight and on the original bf16
weight, for random activations and for activations with outlier channels (8 channels 100x
the rest), on the 8B gate_up shape, M = 512.

Writes ``w4a8.json`` and ``w4a8.md`` to ``--out`` (default ``docs/results/<gpu>/``).

    python scripts/bench_w4a8.py --fmt nvfp4,mxfp4
    CUTE_DSL_ARCH=sm_90a python scripts/bench_w4a8.py --compile-only   # no GPU: compile the candidates
    python scripts/bench_w4a8.py --table docs/results/nvidia-h100-80gb-hbm3/w4a8.json   # re-render a saved run
    python scripts/bench_w4a8.py --errors-only --device cpu --error-m 64     # the numerics' error, no GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (SHAPES, SHIPPED_DB, geomean, interleaved_medians, provenance, provenance_line, rel_err,
                     require_gpu, results_dir, select_shapes, stored_winners, without_pdl)

MS = (512, 2048, 8192)


def tflops(m: int, n: int, k: int, us: float) -> float:
    return 2 * m * n * k / (us * 1e-6) / 1e12


def candidates(n: int, k: int, fmt: str, m: int, count: int) -> list:
    """The default W4A8 config for M = ``m`` and valid neighbours (token tile, swizzle, raster),
    the first ``count``."""
    from autofp4.kernels import sm90_w4a8_gemm as g8
    from autofp4.w4a8 import default_config

    base = default_config(n, k, fmt, "bfloat16", m)
    out = [base]
    for change in (dict(swizzle=4), dict(tile_m=192), dict(tile_m=128), dict(raster="m", swizzle=4),
                   dict(tile_n=256, tile_m=128), dict(stages=base.stages - 1), dict(tile_k=256, tile_m=128)):
        for stages in range(base.stages, 1, -1):
            cfg = dataclasses.replace(base, **{"stages": stages, **change})
            if g8.validate(cfg, n, k, fmt, "bfloat16") is None:
                if cfg not in out:
                    out.append(cfg)
                break
    return out[:count]


def picked_w4a16(records, fmt: str, n: int, k: int, m: int):
    from autofp4.backends import sm90_heuristics as H

    for _, cfg in stored_winners(records, "gemm", fmt, n, k, (m,)):
        return cfg
    return without_pdl(H.gemm_default(n, k, fmt, "bfloat16", m))


def fp8_rowwise(x: torch.Tensor, w: torch.Tensor):
    """``x`` and ``w`` in E4M3 with per-row scales (amax / 448), as ``_scaled_mm`` takes them."""
    def q(t):
        s = (t.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
        return (t.float() / s).to(torch.float8_e4m3fn), s
    xq, sx = q(x)
    wq, sw = q(w)
    return xq, wq.t(), sx, sw.t().contiguous()


def fp8_linear(xq, wqt, sx, sw):
    # fast accumulation (the MMA's partial sums not promoted), as the W4A8 kernel and vLLM's FP8
    # GEMMs on Hopper run: the faster of cuBLAS's two modes
    return torch._scaled_mm(xq, wqt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)


def exact_on_operands(x, fw):
    from autofp4.kernels import fp8_act_quant as aq
    from autofp4.kernels import sm90_w4a8_gemm as g8

    xq, sx = aq.reference_quantize(x, permute=False)
    xv = xq[:, :x.shape[1]].view(torch.float8_e4m3fn).double() * sx.double()[:, None]
    q, f = g8.reference_weight(fw)
    return (xv @ q.double().T) * f


def checked_error(out: torch.Tensor, exact: torch.Tensor, what: str) -> float:
    """The relative error of ``out`` against float64 math on the same E4M3 operands; the run
    stops where it is not below 1e-2 (a wrong kernel is not timed)."""
    err = rel_err(out, exact)
    if not err < 1e-2:
        raise SystemExit(f"{what}: relative error {err:.3g} against float64 on the same E4M3 operands")
    return err


def cublas_configs(n: int, k: int, fmt: str) -> list:
    from autofp4.kernels import w4a8_cublas as cb

    return [c for c in (cb.W4A8CublasConfig(chunk_n=v) for v in cb.CHUNKS)
            if cb.validate(c, n, k, fmt, "bfloat16") is None]


def measure(args) -> dict:
    import types

    import autofp4
    from autofp4.db import read_records
    from autofp4.kernels import fp8_act_quant as aq
    from autofp4.kernels import sm90_w4a16_gemm as g16
    from autofp4.kernels import sm90_w4a8_gemm as g8
    from autofp4.kernels import w4a8_cublas as cb

    _, records = read_records(SHIPPED_DB)
    fmts = args.fmt
    shapes = list(select_shapes(args.shapes))
    ms = args.m
    if args.compile_only:
        for name in shapes:
            n, k = SHAPES[name]
            aq.compile_only(k, "bfloat16")
            for fmt in fmts:
                for m in ms:
                    for cfg in candidates(n, k, fmt, m, args.configs):
                        g8.compile_only(cfg, n, k, fmt, "bfloat16")
                    for cfg in cublas_configs(n, k, fmt):
                        cb.compile_only(cfg, n, k, fmt, "bfloat16")
                    g16.compile_only(picked_w4a16(records, fmt, n, k, m), n, k, fmt, "bfloat16")
        print("compiled")
        return {}
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        torch.cuda.empty_cache()
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        quant = aq.compile_quantizer(k, "bfloat16")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, sx = quant(x)
            variants = {"cublas": (F.linear, [(x, w)]), "fp8": (fp8_linear, [fp8_rowwise(x, w)])}
            detail = {}
            for fmt in fmts:
                fw = autofp4.quantize(w, fmt)
                packed = g16.pack_weight(fw)
                variants[f"{fmt} w4a16"] = (g16.compile_kernel(picked_w4a16(records, fmt, n, k, m), n, k, fmt,
                                                               "bfloat16"), [(x, packed, None)])
                exact = exact_on_operands(x, fw)
                cand, cand_err = {}, {}
                for cfg in candidates(n, k, fmt, m, args.configs):
                    run = g8.compile_kernel(cfg, n, k, fmt, "bfloat16")
                    cand_err[str(cfg)] = checked_error(run(x, packed, None), exact, f"{name} {fmt} M={m} {cfg}")
                    gemm = g8._compile(cfg, n, k, fmt, "bfloat16")
                    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    zeros = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
                    cand[cfg] = interleaved_medians(
                        {"gemm": (lambda a, b, c: gemm(a, packed.data.view(-1), packed.alpha, b, zeros, c, 0),
                                  [(xq, sx, out)])}, 1, args.reps)["gemm"]
                best = min(cand, key=cand.get)
                gemm = g8._compile(best, n, k, fmt, "bfloat16")
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                zeros = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
                variants[f"{fmt} w4a8"] = (g8.compile_kernel(best, n, k, fmt, "bfloat16"), [(x, packed, None)])
                variants[f"{fmt} w4a8 gemm"] = (
                    lambda a, b, c, p=packed, g=gemm, z=zeros: g(a, p.data.view(-1), p.alpha, b, z, c, 0),
                    [(xq, sx, out)])
                prep = types.SimpleNamespace(weight=fw)
                cb_t, cb_err = {}, {}
                for cfg in cublas_configs(n, k, fmt):
                    run = cb.compile_kernel(cfg, n, k, fmt, "bfloat16")
                    cb_err[str(cfg)] = checked_error(run(x, prep, None), exact, f"{name} {fmt} M={m} {cfg}")
                    cb_t[cfg] = interleaved_medians({"c": (run, [(x, prep, None)])}, 1, args.reps)["c"]
                cb_best = min(cb_t, key=cb_t.get)
                variants[f"{fmt} w4a8 cublas"] = (cb.compile_kernel(cb_best, n, k, fmt, "bfloat16"),
                                                  [(x, prep, None)])
                detail[fmt] = dict(best=str(best), candidates={str(c): t for c, t in cand.items()},
                                   # the MMA's accumulation: relative error against float64 on the same E4M3 operands
                                   error_on_operands=cand_err, cublas_best=str(cb_best),
                                   cublas_candidates={str(c): t for c, t in cb_t.items()}, cublas_error=cb_err)
            us = interleaved_medians(variants, args.rounds, args.reps)
            row = dict(shape=name, n=n, k=k, m=m, us=us, tflops={t: tflops(m, n, k, v) for t, v in us.items()},
                       w4a8=detail)
            rows.append(row)
            print(f"{name:12s} M={m:5d} " + " ".join(f"{t} {row['tflops'][t]:.0f}" for t in us), flush=True)
            del variants, x
        del w
    return {**provenance(), "fmts": fmts, "rows": rows, "errors": errors(fmts)}


def blocks128(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to E4M3 with one scale per 1 x 128 block along K (DeepGEMM's activation
    scheme; not what the kernels do), dequantized to float64: the design alternative's error."""
    xb = x.float().view(x.shape[0], -1, 128)
    s = xb.abs().amax(2, keepdim=True).clamp_min(1e-30) / 448
    return ((xb / s).to(torch.float8_e4m3fn).double() * s.double()).view(x.shape)


def errors(fmts: list[str], device: str = "cuda", m: int = 512) -> list[dict]:
    """Relative error (Frobenius) of each path on the 8B gate_up shape at ``m`` rows; on the CPU the
    reference backend's paths, which are the numerics the kernels are checked against. Also the
    error of activations in 1 x 128 E4M3 blocks (float64 math, no kernel) for comparison."""
    import autofp4

    n, k = SHAPES["8B gate_up"]
    gen = torch.Generator(device=device).manual_seed(7)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    out = []
    for kind in ("random", "outliers"):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        if kind == "outliers":
            x[:, torch.randperm(k, device=device, generator=gen)[:8]] *= 100
        orig = x.double() @ w.double().T
        for fmt in fmts:
            fw = autofp4.quantize(w, fmt)
            wd = fw.dequantize(torch.float32).double()
            deq = x.double() @ wd.T
            r16 = autofp4.linear(x, fw)
            r8 = autofp4.linear(x, fw, act_dtype="fp8")
            out.append(dict(x=kind, fmt=fmt, m=m, device=str(device), w4a16_vs_dequant=rel_err(r16, deq),
                            w4a8_vs_dequant=rel_err(r8, deq), blocks128_vs_dequant=rel_err(blocks128(x) @ wd.T, deq),
                            w4a16_vs_bf16_weight=rel_err(r16, orig), w4a8_vs_bf16_weight=rel_err(r8, orig)))
    return out


def error_table(errs: list[dict]) -> list[str]:
    lines = ["| activations | fmt | W4A16 vs dequantized W | W4A8 vs dequantized W | (E4M3 in 1x128 blocks) | "
             "W4A16 vs bf16 W | W4A8 vs bf16 W |", "|---|---|---:|---:|---:|---:|---:|"]
    for e in errs:
        blk = f"{e['blocks128_vs_dequant']:.2e}" if "blocks128_vs_dequant" in e else "-"
        lines.append(f"| {e['x']} | {e['fmt']} | {e['w4a16_vs_dequant']:.2e} | {e['w4a8_vs_dequant']:.2e} | {blk} | "
                     f"{e['w4a16_vs_bf16_weight']:.2e} | {e['w4a8_vs_bf16_weight']:.2e} |")
    return lines


VARIANTS = ("w4a16", "w4a8", "w4a8 gemm", "w4a8 cublas")


def table(doc: dict) -> str:
    fmts = doc["fmts"]
    head = ["shape", "M", "cuBLAS bf16", "cuBLAS FP8 (rowwise, fast accum.)"]
    for f in fmts:
        head += [f"{f} W4A16", f"{f} W4A8", f"{f} W4A8 GEMM only", f"{f} W4A8 cuBLAS path"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in doc["rows"]:
        t, c = r["tflops"], r["tflops"]["cublas"]
        cells = [r["shape"], str(r["m"]), f"{c:.0f}", f"{t['fp8']:.0f} ({t['fp8'] / c:.2f}x)"]
        for f in fmts:
            cells += [f"{t[f'{f} {v}']:.0f} ({t[f'{f} {v}'] / c:.2f}x)" if f"{f} {v}" in t else "-"
                      for v in VARIANTS]
        lines.append("| " + " | ".join(cells) + " |")
    for m in sorted({r["m"] for r in doc["rows"]}):
        rs = [r for r in doc["rows"] if r["m"] == m]
        cells = ["geomean x bf16 / x FP8", str(m), "", f"{geomean(r['tflops']['fp8'] / r['tflops']['cublas'] for r in rs):.2f}x"]
        for f in fmts:
            for v in VARIANTS:
                if any(f"{f} {v}" not in r["tflops"] for r in rs):
                    cells.append("-")
                    continue
                gb = geomean(r["tflops"][f"{f} {v}"] / r["tflops"]["cublas"] for r in rs)
                gf = geomean(r["tflops"][f"{f} {v}"] / r["tflops"]["fp8"] for r in rs)
                cells.append(f"{gb:.2f}x / {gf:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"{provenance_line(doc)} TFLOP/s (2 M N K per call), CUDA-graph medians."]
    acc = [e for r in doc["rows"] for d in r.get("w4a8", {}).values() for e in d.get("error_on_operands", {}).values()]
    if acc:
        lines.append(f"W4A8 GEMM against float64 math on its own E4M3 operands (the MMA's accumulation and the "
                     f"bf16 output): relative error {min(acc):.2e} to {max(acc):.2e}.")
    lines.append("")
    lines += error_table(doc["errors"])
    return "\n".join(lines)


def errors_md(doc: dict) -> str:
    """The table of an ``--errors-only`` run."""
    rows = doc["errors"][0]["m"] if doc.get("errors") else doc.get("m", "?")
    return "\n".join(error_table(doc["errors"]) + ["", f"{provenance_line(doc)} {rows} rows of the 8B gate_up shape."])


def _fmts(text: str) -> list[str]:
    fmts = [f.strip() for f in text.split(",")]
    if not all(f in ("nvfp4", "mxfp4") for f in fmts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of nvfp4, mxfp4; got {text!r}")
    return fmts


def _ms(text: str) -> list[int]:
    try:
        ms = [int(v) for v in text.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    ap.add_argument("--fmt", type=_fmts, default="nvfp4,mxfp4", help="comma-separated: nvfp4, mxfp4")
    ap.add_argument("--m", type=_ms, default=",".join(map(str, MS)), help="comma-separated row counts")
    ap.add_argument("--shapes", default="", help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--configs", type=int, default=4, help="W4A8 config candidates timed per point")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel it would time, time nothing")
    ap.add_argument("--table", metavar="JSON", help="only re-render the table of a saved run")
    ap.add_argument("--errors-only", action="store_true",
                    help="only the error table, on --device (the CPU computes the reference numerics)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of --errors-only (default: cuda if present)")
    ap.add_argument("--error-m", type=int, default=512, help="rows of the error table's activations")
    args = ap.parse_args(argv)
    if args.error_m < 1:
        ap.error(f"--error-m must be positive, got {args.error_m}")
    if args.table:
        doc = json.loads(Path(args.table).read_text())
        print(table(doc) if "rows" in doc else errors_md(doc))
        return 0
    if args.errors_only:
        if args.device == "cuda":
            no_gpu = require_gpu("bench_w4a8 --errors-only --device cuda", "--device cpu")
            if no_gpu is not None:
                return no_gpu
        doc = {**provenance(args.device), "fmts": args.fmt, "m": args.error_m,
               "errors": errors(args.fmt, args.device, args.error_m)}
        path = results_dir(args.out, args.device) / "w4a8-errors.json"
        path.write_text(json.dumps(doc, indent=1))
        md = errors_md(doc)
        path.with_suffix(".md").write_text(md + "\n")
        print(md)
        return 0
    if not args.compile_only:
        no_gpu = require_gpu("bench_w4a8", "--compile-only, --table")
        if no_gpu is not None:
            return no_gpu
    doc = measure(args)
    if not doc:
        return 0
    path = results_dir(args.out) / "w4a8.json"
    path.write_text(json.dumps(doc, indent=1))
    md = table(doc)
    path.with_suffix(".md").write_text(md + "\n")
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
