"""Sweep the Hopper grouped MoE GEMM's config fields around the stored winners, side by side.

``autofp4 tune`` keeps only each problem's winner; this tool times, in one run, the winner the
shipped tuning DB stores for a model's MoE layer at each token count (or the default where it
stores none) next to the same config with fields changed (``--vary FIELD=V1,V2``, repeatable:
the product of the values; ``--set F=V,F=V``, repeatable: one config each), so that a field's effect is seen on the layers it is meant for.

Each (model, format, T): uniform random top-k routing of fresh random tokens, the experts'
weights rotated in as many copies as read more than twice the L2; every config's output is
checked against the first one's (relative error), then all are timed in CUDA graphs in
``--rounds`` interleaved rounds (median). What is timed is the backend's compiled layer from
given top-k weights and ids (routing metadata, gather, both GEMMs, top-k sum), without the
dispatcher.

    python scripts/sweep_moe.py --models qwen3-30b-a3b --t 1024,4096 --vary persistent=0,1
    python scripts/sweep_moe.py --vary persistent=1 --vary fused_sum=0,1 --vary tile_m=64,128
    python scripts/sweep_moe.py --set persistent=1,tile_n=64,ctas_per_sm=2 --set raster=n
    CUTE_DSL_ARCH=sm_90a python scripts/sweep_moe.py --compile-only ...   # fill the kernel cache, no GPU

Writes ``sweep-moe.json`` and ``sweep-moe.md`` to ``--out`` (default ``docs/results/<gpu>/``).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys

import torch
from _common import ROOT, interleaved_medians, provenance, provenance_line, rel_err, results_dir
from bench_moe import MODELS, expert_fp4_bytes, moe_shape, routing, useful_flops

#: the fields --vary takes, with the parser of their values
FIELDS = {"tile_n": int, "tile_m": int, "tile_k": int, "stages": int, "cluster_n": int, "raster": str,
          "producer": lambda v: bool(int(v)), "scale_select": lambda v: bool(int(v)),
          "persistent": lambda v: bool(int(v)), "fused_sum": lambda v: bool(int(v)), "ctas_per_sm": int}


def _field(spec: str) -> tuple[str, object]:
    name, _, v = spec.partition("=")
    if name not in FIELDS or not v:
        raise SystemExit(f"expected FIELD=VALUE with FIELD one of {', '.join(FIELDS)}; got {spec!r}")
    return name, FIELDS[name](v)


def variants(base, vary: list[str], sets: list[str]) -> list:
    """``base``, ``base`` with every combination of the ``--vary`` values, then ``base`` with each
    ``--set``'s fields (duplicates once). A persistent variant gets the producer warp and
    block-major order it needs."""
    axes = []
    for spec in vary:
        name, _, vals = spec.partition("=")
        axes.append([_field(f"{name}={v}") for v in vals.split(",")])
    combos = [dict(c) for c in itertools.product(*axes)] if axes else []
    combos += [dict(_field(f) for f in spec.split(",")) for spec in sets]
    out = [base]
    for combo in combos:
        cfg = dataclasses.replace(base, **combo)
        if cfg.persistent:
            cfg = dataclasses.replace(cfg, producer=True, raster="n", cluster_n=1)
        if cfg not in out:
            out.append(cfg)
    return out


def label(cfg, base) -> str:
    """The fields of ``cfg`` that differ from ``base`` ("winner" for ``base`` itself)."""
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(base, f.name)]
    return ", ".join(diff) or "winner"


def stored_winner(b, key, t: int, db: str):
    """The config the tuning export ``db`` stores for ``key`` at T's bucket on this backend,
    else the backend's default."""
    from autofp4.dispatch import DEFAULT_M_BUCKETS, bucket_for

    bucket = bucket_for(t, DEFAULT_M_BUCKETS)
    with open(db) as f:
        for r in json.load(f)["records"]:
            if (r["backend"], r["op"], r["fmt"], r["dtype"], r["n"], r["k"], r["experts"], r["topk"], r["m_bucket"]) == (
                    b.name, key.op, key.fmt, key.dtype, key.n, key.k, key.experts, key.topk, bucket):
                return b.parse_config(r["config"])
    return b.default(key, t)


def sweep(model: str, fmt: str, ts: list[int], args) -> list[dict]:
    import autofp4
    from autofp4.backends import get_backend
    from autofp4.problem import ProblemKey
    from autofp4.timing import copies_for_cold_l2

    s = moe_shape(model, MODELS[model])
    e, k, h, i = s["E"], s["top_k"], s["H"], s["I"]
    key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k)
    b = get_backend("sm90_w4a16")
    compile_only = args.compile_only
    dev = torch.device("cpu" if compile_only else "cuda")
    rows = []
    gen = torch.Generator(device=dev).manual_seed(977 + h)
    expert_map = None
    if MODELS[model] > 1 and not compile_only:  # one rank's slice: rank 0 holds experts [0, E)
        from autofp4.routing import rank_expert_map

        expert_map = rank_expert_map(s["E_global"], e, device=dev)
    fp4 = []
    if not compile_only:
        l2 = torch.cuda.get_device_properties(dev).L2_cache_size
        copies = copies_for_cold_l2(e * expert_fp4_bytes(h, i, fmt), l2, max_copies=4)
        for _ in range(copies):
            a = autofp4.quantize(torch.randn(e, 2 * i, h, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02, fmt)
            c = autofp4.quantize(torch.randn(e, h, i, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02, fmt)
            fp4.append((a.packed(b.name, b.prepare), c.packed(b.name, b.prepare)))
    for t in ts:
        base = stored_winner(b, key, t, args.db)
        if type(base).__name__ != "MoEGemmConfig":
            print(f"{model} {fmt} T={t}: the pick is {type(base).__name__}, not the grouped GEMM: skipped")
            continue
        cfgs = [c for c in variants(base, args.vary, args.set) if b.is_valid(c, key) is None]
        if compile_only:  # the kernels timed here: the SiLU up GEMM and the down GEMM, without biases
            from autofp4.kernels import sm90_moe_gemm

            for c in cfgs:
                for part in ("silu", "down"):
                    sm90_moe_gemm._compile(c, key.n, key.k, key.fmt, key.dtype, part, False)
            print(f"{model} {fmt} T={t}: {len(cfgs)} configs compiled")
            continue
        compiled = {label(c, base): b.compile(c, key) for c in cfgs}
        runs = {name: (lambda run: lambda *a: run(*a[:5], a[5], expert_map))(run) for name, run in compiled.items()}
        sets = max(len(fp4), 4)
        inputs = []
        for j in range(sets):
            tw, ti = routing(t, s["E_global"], k, gen, dev)
            inputs.append((torch.randn(t, h, device=dev, generator=gen, dtype=torch.bfloat16), *fp4[j % len(fp4)],
                           tw, ti))
        first = None
        errs = {}
        for name, run in runs.items():
            out = run(*inputs[0], "silu").float()
            first = out if first is None else first
            errs[name] = rel_err(out, first)
        fns = {name: ((lambda run: lambda x, a, c, tw, ti: run(x, a, c, tw, ti, "silu"))(run), inputs)
               for name, run in runs.items()}
        times = interleaved_medians(fns, args.rounds, args.reps)
        pairs = statistics.mean(int(((ti >= 0) & (ti < e)).sum()) for *_, ti in inputs)  # the slice's
        flops = useful_flops(pairs, h, i)
        for name, us in times.items():
            rows.append({"model": model, "fmt": fmt, "T": t, "config": name, "us": us,
                         "vs_winner": times["winner"] / us, "tflops": flops / us * 1e-6, "rel_err": errs[name],
                         "base": dataclasses.asdict(base)})
            print(f"{model:14s} {fmt} T={t:5d} {us:9.1f} us {times['winner'] / us:5.2f}x "
                  f"{flops / us * 1e-6:6.1f} TF/s err {errs[name]:.1e}  {name}", flush=True)
    return rows


def render(doc: dict) -> str:
    lines = ["# Grouped MoE GEMM sweep", "", provenance_line(doc), "",
             "| model | fmt | T | config (change from the winner) | us | speed-up | useful TFLOP/s | rel. err |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['fmt']} | {r['T']} | {r['config']} | {r['us']:.1f} | "
                     f"{r['vs_winner']:.2f}x | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--t", default="1024,4096")
    ap.add_argument("--vary", action="append", default=[], metavar="FIELD=V1,V2")
    ap.add_argument("--set", action="append", default=[], metavar="F=V,F=V", help="one more config: the winner with these fields")
    ap.add_argument("--db", default=str(ROOT / "tuning_db" / "nvidia-h200.json"), help="the tuning export of the winners")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compile-only", action="store_true", help="compile every config into the kernel cache")
    ap.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    args = ap.parse_args()
    if not args.compile_only and not torch.cuda.is_available():
        print("sweep_moe.py times kernels on a CUDA GPU (use --compile-only without one)", file=sys.stderr)
        return 2
    for m in args.models.split(","):
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    rows = []
    for m in args.models.split(","):
        for fmt in args.fmt.split(","):
            rows += sweep(m, fmt, [int(t) for t in args.t.split(",")], args)
    if args.compile_only:
        return 0
    doc = {**provenance(), "rows": rows}
    out = results_dir(args.out)
    (out / "sweep-moe.json").write_text(json.dumps(doc, indent=1))
    (out / "sweep-moe.md").write_text(render(doc))
    print(f"wrote {out / 'sweep-moe.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
