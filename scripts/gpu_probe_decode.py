"""Where the FP4 kernels' time goes: a probe, not a benchmark.

By default, for every benchmark shape it takes the decode configs a tuning DB (or export) stores for M = 1
and M = 16 and times, in CUDA graphs with cold L2 (dependent launch off), the kernel module as
it is and two variants of it built here by editing its source in memory:

* ``noscale``: the weights are decoded but not multiplied by their block scales;
* ``noalu``: no decode and no scale: the MMA's A fragment is the packed word and the scale
  pattern themselves (wrong values, the same loads, MMAs and stores).

Each variant runs at M = 1, 8 and 16 (M <= m_max of the config). If the kernel were bound by
its instruction issue, ``noalu`` would be much faster; if by memory latency or bandwidth, all
three would take about the same time. Prints a table last; JSON to ``$OUT/probe_decode.json``.

``--vary FIELD=V1,V2,..``: instead, each stored decode winner (M = 1 and M = 16 buckets) with that
config field set to each value, at the M of its bucket.

``--gemm 64,128,512``: instead, the GEMM kernel's stored winners at those M buckets, as is and
with the same two variants of its decode (``--gemm-variants``). (The variant ``hsel`` of the
eleventh session became the GEMM's ``scale_select`` config field.)

``--gemm 64,128,512 --vary FIELD=V1,V2,..``: the GEMM kernel's stored winners at those M
buckets, each with that config field set to each value (e.g. ``producer=0,1``), at the M of its
bucket; the outputs of the variants are compared bit for bit with the first. Several ``--vary``
give every combination of their values (those not valid for a winner are left out), e.g.
``--vary producer=0,1 --vary producer_regs=0,40``.

``--tpw2``: instead, at M = 16, the stored decode winner (or the default) against variants of
it with two 16-row tiles per warp (each x fragment read from shared memory then feeds four MMAs
instead of two), 4 or 8 warps, a 2- or 3-deep ring, the same or twice the split.

    python scripts/gpu_probe_decode.py --db tuning_db/nvidia-h200.json
    CUTE_DSL_ARCH=sm_90a python scripts/gpu_probe_decode.py --db ... --compile-only
"""
import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autofp4  # noqa: E402
from autofp4.backends.sm90_w4a16 import SM90Config, _to_kernel_config  # noqa: E402
from autofp4.db import read_records  # noqa: E402
from autofp4.kernels import w4a16_decode as BASE  # noqa: E402
from bench_linear import SHAPES  # noqa: E402
from gpu_ab_decode import import_as  # noqa: E402
from gpu_check_decode import fp4_bytes, graph_time, rotation  # noqa: E402

_SCALED = ("a = [mul_x2(decode(wd, 0), s_g, BF16), mul_x2(decode(wd, 1), s_g8, BF16),\n"
           "                         mul_x2(decode(wd, 2), s_g, BF16), mul_x2(decode(wd, 3), s_g8, BF16)]")
VARIANTS = {
    "noscale": "a = [decode(wd, 0), decode(wd, 1), decode(wd, 2), decode(wd, 3)]",
    "noalu": "a = [wd, s_g, wd, s_g8]",
}
# the GEMM kernel's decode of one k16 step of a 64-row block (A fragment, 4 registers)
_GEMM_SCALED = ("v = decode_pair(word, terms[j])\n"
                "                                            # pairs 0, 2: row r; 1, 3: row r + 8\n"
                "                                            if cutlass.const_expr(scale_select):\n"
                "                                                rA32[j, r, kb] = mul_half(v, sw, j % 2)\n"
                "                                            else:\n"
                "                                                rA32[j, r, kb] = mul_x2(v, s_pair[j % 2], is_bf16)")
GEMM_VARIANTS = {
    "noscale": "rA32[j, r, kb] = decode_pair(word, terms[j])",
    "noalu": "rA32[j, r, kb] = word if j % 2 == 0 else sw",
}


def edited_module(base, suffix, src):
    """Kernel module source ``src`` (an edit of ``base``'s), imported as
    ``autofp4.kernels.<base stem>_<suffix>`` so that the kernel cache keys its kernels apart
    from the real ones."""
    stem = base.__name__.rsplit(".", 1)[1]
    path = os.path.join(tempfile.gettempdir(), f"{stem}_{suffix}.py")
    with open(path, "w") as f:
        f.write(src)
    return import_as(path, f"autofp4.kernels.{stem}_{suffix}")


def variant(tag, base=BASE, line=_SCALED, variants=VARIANTS):
    """``base`` (a kernel module) with its A-fragment line replaced (:func:`edited_module`)."""
    src = open(base.__file__).read()
    if line not in src:
        raise SystemExit(f"{base.__name__}: the A-fragment line changed; update this probe")
    return edited_module(base, f"probe_{tag}", src.replace(line, variants[tag]))


def finished(rows, compile_only, fname):
    """After a sweep: True (having said so) if it only compiled, else write ``rows`` as JSON to
    ``$OUT/fname`` when ``$OUT`` is set and return False (the caller prints its table)."""
    if compile_only:
        print("compiled")
        return True
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], fname), "w") as f:
            json.dump(rows, f, indent=1)
    return False


def rotated_weight(mod, fmt, n, k):
    """A fresh random N x K weight packed by kernel module ``mod``, in enough copies to rotate
    past the L2, and the number of calls a timing graph makes to cycle them twice."""
    torch.cuda.empty_cache()
    w = autofp4.quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)
    packs, _, calls = rotation(mod.pack_weight(w), None, fp4_bytes(n, k, fmt))
    return packs, calls


def interleaved_medians(runs, x, packs, calls, rounds):
    """Median CUDA-graph microseconds per call of each ``runs`` value (a dict of runners), timed
    in ``rounds`` interleaved rounds; every graph cycles through the rotated weights ``packs``."""
    times = {t: [] for t in runs}
    for _ in range(rounds):
        for t, run in runs.items():
            times[t].append(graph_time([(lambda j=j, run=run: run(x, packs[j % len(packs)], None))
                                        for j in range(calls)])[0])
    return {t: statistics.median(v) for t, v in times.items()}


def decode_configs(records, fmt, n, k, with_m=False):
    """The decode winners stored for M = 1 and 16 (dependent launch off); with ``with_m``,
    ``(m_bucket, config)`` pairs."""
    out = []
    for r in records:
        if (r.fmt, r.dtype, r.n, r.k, r.config.get("kernel")) == (fmt, "bfloat16", n, k, "decode") \
                and r.m_bucket in (1, 16):
            cfg = dataclasses.replace(_to_kernel_config(SM90Config(**r.config)), pdl=False)
            item = (r.m_bucket, cfg) if with_m else cfg
            if item not in out:
                out.append(item)
    return out


def vary_cases(records, fmt, n, k, field, values):
    """``(m, [config with field = v for v in values])`` per stored decode winner."""
    out = []
    for m, cfg in decode_configs(records, fmt, n, k, with_m=True):
        cfgs = [dataclasses.replace(cfg, **{field: v}) for v in values]
        cfgs = [c for c in cfgs if BASE.validate(c, n, k, fmt, "bfloat16") is None]
        if len(cfgs) > 1:
            out.append((m, cfgs))
    return out


def sweep_vary(records, fmts, shapes, field, values, rounds, compile_only):
    rows = []
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            cases = vary_cases(records, fmt, n, k, field, values)
            if compile_only:
                for _, cfgs in cases:
                    for cfg in cfgs:
                        BASE._compile(cfg, n, k, fmt, "bfloat16", False)
                continue
            if not cases:
                continue
            packs, calls = rotated_weight(BASE, fmt, n, k)
            for m, cfgs in cases:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                runs = [BASE.compile_kernel(c, n, k, fmt, "bfloat16") for c in cfgs]
                outs = [run(x, packs[0], None).float() for run in runs]
                err = max(((o - outs[0]).abs().max() / outs[0].abs().max()).item() for o in outs)
                us = list(interleaved_medians(dict(enumerate(runs)), x, packs, calls, rounds).values())
                rows.append(dict(fmt=fmt, shape=name, m=m, cfg=str(cfgs[0]), field=field,
                                 values=[getattr(c, field) for c in cfgs], us=us, max_rel_diff=err))
                print(f"{fmt} {name:12s} M={m:2d} " + " ".join(f"{v}: {u:7.2f}" for v, u in
                                                               zip(rows[-1]["values"], us))
                      + f"  diff {err:.1e}  {cfgs[0]}", flush=True)
            del packs
    if finished(rows, compile_only, f"probe_{field}.json"):
        return
    print(f"\n{'fmt':6s} {'shape':12s} {'M':>3s} " + f"{field} = value: us (ratio to the first)")
    for r in rows:
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['m']:3d} " + "  ".join(
            f"{v}: {u:7.2f} ({u / r['us'][0]:.3f})" for v, u in zip(r["values"], r["us"])))


def tpw2_configs(records, fmt, n, k):
    """At M = 16: the stored decode winner (else the default), then its two-tiles-per-warp variants."""
    base = next((c for c in decode_configs(records, fmt, n, k) if c.m_max == 16), None)
    if base is None:
        base = dataclasses.replace(BASE.default_config(n, k, fmt, "bfloat16", 16), pdl=False)
    out = [base]
    for warps in (4, 8):
        for stages in (2, 3):
            for ks in sorted({base.k_split, 2 * base.k_split}):
                for red in (("kernel", "cluster") if ks > 1 else ("kernel",)):
                    c = dataclasses.replace(base, warps=warps, smem_stages=stages, k_split=ks, split_reduce=red,
                                            tiles_per_warp=2, x_smem=True, prefetch=False, ctas_per_sm=0)
                    if c not in out and BASE.validate(c, n, k, fmt, "bfloat16") is None:
                        out.append(c)
    return out


def sweep_family(records, fmts, shapes, rounds, compile_only, family, tag, m=16):
    """Time ``family(records, fmt, n, k)`` (its first config is the reference) at ``m``."""
    rows = []
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            cfgs = family(records, fmt, n, k)
            if compile_only:
                for cfg in cfgs:
                    BASE._compile(cfg, n, k, fmt, "bfloat16", False)
                continue
            packs, calls = rotated_weight(BASE, fmt, n, k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = [BASE.compile_kernel(c, n, k, fmt, "bfloat16") for c in cfgs]
            us = interleaved_medians(dict(enumerate(runs)), x, packs, calls, rounds)
            for i, cfg in enumerate(cfgs):
                rows.append(dict(fmt=fmt, shape=name, m=m, cfg=str(cfg), us=us[i]))
                print(f"{fmt} {name:12s} {rows[-1]['us']:8.2f}  {cfg}", flush=True)
            del packs
    if finished(rows, compile_only, f"probe_{tag}_m{m}.json"):
        return
    print(f"\nM = {m}\n{'fmt':6s} {'shape':12s} {'stored us':>9s} {'best new':>9s} {'ratio':>6s}  best new config")
    for fmt in fmts:
        for name in shapes:
            sel = [r for r in rows if (r["fmt"], r["shape"]) == (fmt, name)]
            best = min(sel[1:], key=lambda r: r["us"], default=None)
            if best:
                print(f"{fmt:6s} {name:12s} {sel[0]['us']:9.2f} {best['us']:9.2f} {best['us'] / sel[0]['us']:6.3f}  "
                      f"{best['cfg']}")


def gemm_winners(records, fmt, n, k, ms):
    """``(m_bucket, config)`` of the GEMM winners stored for ``(fmt, n, k)`` at ``ms`` (bf16,
    dependent launch off)."""
    return [(r.m_bucket, dataclasses.replace(_to_kernel_config(SM90Config(**r.config)), pdl=False))
            for r in records
            if (r.fmt, r.dtype, r.n, r.k, r.config.get("kernel")) == (fmt, "bfloat16", n, k, "gemm")
            and r.m_bucket in ms]


def gemm_sweep(fmts, shapes, cases_for, rounds, compile_only, packer=None):
    """For every format and shape, the cases ``cases_for(fmt, n, k)`` gives: ``(m, kernels)``
    with ``kernels`` ``{label: (kernel module, config)}``, the first label the reference. Yields
    ``(fmt, shape, m, kernels, us, same)`` per case, M ascending: CUDA-graph microseconds per
    label (interleaved rounds over rotated weights, packed by ``packer``'s ``pack_weight``: the
    GEMM module unless named) and whether its output equals the reference's bit for bit. With
    ``compile_only`` it compiles them and yields nothing."""
    from autofp4.kernels import sm90_w4a16_gemm as G

    packer = packer or G
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            cases = cases_for(fmt, n, k)
            if compile_only:
                for _, kernels in cases:
                    for mod, cfg in kernels.values():
                        mod.compile_kernel(cfg, n, k, fmt, "bfloat16")
                continue
            if not cases:
                continue
            packs, calls = rotated_weight(packer, fmt, n, k)
            for m, kernels in sorted(cases, key=lambda c: c[0]):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                runs = {t: mod.compile_kernel(cfg, n, k, fmt, "bfloat16") for t, (mod, cfg) in kernels.items()}
                ref = next(iter(runs.values()))(x, packs[0], None)
                same = {t: torch.equal(run(x, packs[0], None), ref) for t, run in runs.items()}
                yield fmt, name, m, kernels, interleaved_medians(runs, x, packs, calls, rounds), same
            del packs


def gemm_probe(records, fmts, shapes, ms, rounds, compile_only, tags):
    """The GEMM kernel's stored winners at ``ms``: as is and as each variant in ``tags``."""
    from autofp4.kernels import sm90_w4a16_gemm as G

    mods = {"as is": G, **{t: variant(t, G, _GEMM_SCALED, GEMM_VARIANTS) for t in tags}}

    def cases(fmt, n, k):
        return [(m, {t: (mod, mod.Sm90GemmConfig(**dataclasses.asdict(cfg))) for t, mod in mods.items()})
                for m, cfg in gemm_winners(records, fmt, n, k, ms)]

    rows = []
    for fmt, name, m, kernels, us, same in gemm_sweep(fmts, shapes, cases, rounds, compile_only):
        cfg = kernels["as is"][1]
        rows.append(dict(fmt=fmt, shape=name, m=m, cfg=str(cfg), same_output=same, us=us))
        print(f"{fmt} {name:12s} M={m:3d} " + " ".join(f"{t} {v:7.2f}" for t, v in us.items()) + f"  {cfg}",
              flush=True)
    if finished(rows, compile_only, "probe_gemm.json"):
        return
    print(f"\n{'fmt':6s} {'shape':12s} {'M':>4s} " + " ".join(f"{t:>9s}" for t in mods)
          + "".join(f"  {t + '/as is':>13s}" for t in tags) + "  same output as 'as is'")
    for r in rows:
        us = r["us"]
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['m']:4d} " + " ".join(f"{us[t]:9.2f}" for t in mods)
              + "".join(f"  {us[t] / us['as is']:13.3f}" for t in tags)
              + "  " + ",".join(t for t in tags if r["same_output"][t]))


def gemm_vary(records, fmts, shapes, ms, grid, rounds, compile_only):
    """The GEMM kernel's stored winners at ``ms``, each with every setting of ``grid`` (a list of
    ``{field: value}``: the product of the ``--vary`` options) applied; settings that are not
    valid for the shape are left out, the first valid one is the baseline of the ratios."""
    from autofp4.kernels import sm90_w4a16_gemm as G

    def label(setting):
        return "+".join(f"{f}={int(v)}" for f, v in setting.items())

    def cases(fmt, n, k):
        out = []
        for m, cfg in gemm_winners(records, fmt, n, k, ms):
            cfgs = [dataclasses.replace(cfg, **{f: type(getattr(cfg, f))(v) for f, v in st.items()}) for st in grid]
            valid = {label(st): (G, c) for st, c in zip(grid, cfgs) if G.validate(c, n, k, fmt, "bfloat16") is None}
            if len(valid) > 1:
                out.append((m, valid))
        return out

    rows = []
    for fmt, name, m, kernels, us, same in gemm_sweep(fmts, shapes, cases, rounds, compile_only):
        base = next(iter(kernels.values()))[1]
        rows.append(dict(fmt=fmt, shape=name, m=m, cfg=str(base), settings=list(kernels), us=list(us.values()),
                         same_output=list(same.values())))
        print(f"{fmt} {name:12s} M={m:4d} " + " ".join(f"{t}: {u:8.2f}" for t, u in us.items())
              + f"  same {all(same.values())}  {base}", flush=True)
    tag = "_".join(dict.fromkeys(f for st in grid for f in st))
    if finished(rows, compile_only, f"probe_gemm_{tag}.json"):
        return
    print(f"\n{'fmt':6s} {'shape':12s} {'M':>4s} setting: us (ratio to the first), same bits")
    for r in rows:
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['m']:4d} " + "  ".join(
            f"{t}: {u:8.2f} ({u / r['us'][0]:.3f})" for t, u in zip(r["settings"], r["us"]))
            + f"  {all(r['same_output'])}")
    ratios = [r["us"][-1] / r["us"][0] for r in rows]
    if ratios:
        print(f"geomean last/first: {statistics.geometric_mean(ratios):.3f} over {len(ratios)}")


def vary_grid(specs):
    """``["a=0,1", "b=0,40"]`` -> the settings ``[{a: 0, b: 0}, {a: 0, b: 40}, {a: 1, b: 0}, ...]``."""
    axes = []
    for spec in specs:
        field, vals = spec.split("=")
        axes.append([(field, int(v)) for v in vals.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tpw2", action="store_true", help="the two-tiles-per-warp sweep at M = 16")
    ap.add_argument("--vary", action="append",
                    help="FIELD=V1,V2,...: the stored winners with that field set to each value; with --gemm, "
                         "several --vary give every combination")
    ap.add_argument("--gemm", help="M buckets (e.g. 64,128,512): probe the GEMM kernel's winners there instead")
    ap.add_argument("--gemm-variants", default="noscale,noalu",
                    help=f"of {', '.join(GEMM_VARIANTS)} (empty: the winners as they are only)")
    args = ap.parse_args()
    if args.gemm and args.vary:
        if not args.compile_only:
            print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        return gemm_vary(read_records(args.db)[1], args.fmt.split(","), args.shapes.split(","),
                         [int(v) for v in args.gemm.split(",")], vary_grid(args.vary), args.rounds,
                         args.compile_only)
    if args.gemm:
        if not args.compile_only:
            print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        return gemm_probe(read_records(args.db)[1], args.fmt.split(","), args.shapes.split(","),
                          [int(v) for v in args.gemm.split(",")], args.rounds, args.compile_only,
                          [t for t in args.gemm_variants.split(",") if t])
    if args.vary:
        if len(args.vary) > 1:
            ap.error("the decode sweep varies one field (several --vary need --gemm)")
        field, vals = args.vary[0].split("=")
        if not args.compile_only:
            print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        return sweep_vary(read_records(args.db)[1], args.fmt.split(","), args.shapes.split(","), field,
                          [int(v) for v in vals.split(",")], args.rounds, args.compile_only)
    if args.tpw2:
        if not args.compile_only:
            print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        return sweep_family(read_records(args.db)[1], args.fmt.split(","), args.shapes.split(","), args.rounds,
                            args.compile_only, tpw2_configs, "tpw2")

    mods = {"as is": BASE, **{t: variant(t) for t in VARIANTS}}
    records = read_records(args.db)[1]
    fmts, shapes = args.fmt.split(","), args.shapes.split(",")
    if args.compile_only:
        for fmt in fmts:
            for name in shapes:
                n, k = SHAPES[name]
                for cfg in decode_configs(records, fmt, n, k):
                    for mod in mods.values():
                        mod._compile(mod.DecodeConfig(**dataclasses.asdict(cfg)), n, k, fmt, "bfloat16", False)
        print("compiled")
        return
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            packs, calls = rotated_weight(BASE, fmt, n, k)
            for cfg in decode_configs(records, fmt, n, k):
                runs = {t: mod.compile_kernel(mod.DecodeConfig(**dataclasses.asdict(cfg)), n, k, fmt, "bfloat16")
                        for t, mod in mods.items()}
                for m in (1, 8, 16):
                    if m > cfg.m_max:
                        continue
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    r = dict(fmt=fmt, shape=name, m=m, cfg=str(cfg),
                             us=interleaved_medians(runs, x, packs, calls, args.rounds))
                    rows.append(r)
                    print(f"{fmt} {name:12s} M={m:2d} " + " ".join(f"{t} {v:7.2f}" for t, v in r["us"].items())
                          + f"  {cfg}", flush=True)
            del packs
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_decode.json"), "w") as f:
            json.dump(rows, f, indent=1)
    tags = list(mods)
    print(f"\n{'fmt':6s} {'shape':12s} {'M':>3s} {'m_max':>5s} " + " ".join(f"{t:>9s}" for t in tags)
          + "  noscale/as is  noalu/as is")
    for r in rows:
        us = r["us"]
        print(f"{r['fmt']:6s} {r['shape']:12s} {r['m']:3d} {r['cfg'].split('m_max=')[1].split(',')[0]:>5s} "
              + " ".join(f"{us[t]:9.2f}" for t in tags)
              + f"  {us['noscale'] / us['as is']:13.3f}  {us['noalu'] / us['as is']:11.3f}")


if __name__ == "__main__":
    main()
