#!/usr/bin/env python
"""Just-in-time tuning of a model's linear layers from an empty DB, against an offline tuning run.

What it measures, for the linear shapes of a model config (default Llama-3.1-8B,
``examples/llama-3.1-8b.json``; with ``--device cpu`` a tiny Llama on the reference backend, a
smoke check), in three phases, each with a fresh tuning DB and (unless ``--keep-kernel-cache``)
a fresh kernel cache, so that the tuning of every phase compiles what it tries:

* **offline**: ``autofp4.tune`` of the shapes at the M buckets (what ``autofp4 tune --model
  CONFIG --m ...`` runs, with its default budget), its wall time, then the decode time with its rows;
* **blocking**: the decode time untuned (the defaults), the first forward pass at each M bucket
  inside ``autofp4.autotune(mode="blocking")`` (each one waits for the jobs of its shapes) and
  their sum, the warm-up; then the decode time with the rows it stored;
* **background**: a forward pass at each M bucket inside ``autotune(mode="background")`` (each
  queues its jobs and returns), then decode forward passes until every job is tuned: the time
  until then, and the decode throughput meanwhile against idle (after, with the same picks:
  the decode M's jobs are queued first and tuned before the throughput is taken).

A forward pass runs every linear layer of the model once, eagerly (``autofp4.linear`` on an
[M, K] input; ``--layers`` copies of the layer stack, default the model's layer count), as a
decode step of a server without CUDA graphs does; the decode time is its median over
``--rounds`` windows of ``--reps`` passes at M = ``--decode-m``. Targets (reported, not
enforced): the blocking warm-up of M = 1..512 under 3 minutes on an H200, decode after it within
the noise of the offline rows, at most 10% of the decode throughput lost in background mode.

Writes ``jit.json`` and ``jit.md`` (the table, printed last) to ``--out`` (default
``docs/results/<device>/``).

    python scripts/bench_jit.py                                   # on the GPU (about 25 minutes)
    python scripts/bench_jit.py --phases offline,blocking --offline-db tuning_db/nvidia-h200.json
    python scripts/bench_jit.py --device cpu --out /tmp/jit       # the smoke check
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT, provenance, provenance_line, results_dir

import autofp4
from autofp4 import dispatch
from autofp4.models import load_config, model_shapes
from autofp4.tuning import jit

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
GPU_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CPU_MS = (1, 2, 4)
TARGETS = {"warmup_s": 180.0, "background_cost": 0.10}
PHASES = ("offline", "blocking", "background")
#: what the phases set for themselves (restored when the run ends)
_PHASE_ENV = ("AUTOFP4_KERNEL_CACHE", "AUTOFP4_SHIPPED_DB")


# -----------------------------------------------------------------------------------------
# the model: its linear layers, a forward pass, its time
# -----------------------------------------------------------------------------------------
class Stack:
    """``copies`` copies of a model's linear layers (random FP4 weights) and inputs per M."""

    def __init__(self, shapes, copies: int, fmt: str, dev: torch.device) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        self.dev = dev
        self.layers = [[autofp4.quantize(torch.randn(s.n, s.k, device=dev, generator=gen) * 0.02, fmt)
                        for s in shapes] for _ in range(copies)]
        self.ks = sorted({s.k for s in shapes})
        self.xs: dict[int, dict[int, torch.Tensor]] = {}

    def forward(self, m: int) -> None:
        xs = self.xs.get(m)
        if xs is None:
            xs = self.xs[m] = {k: torch.randn(m, k, device=self.dev, dtype=torch.bfloat16) for k in self.ks}
        for layer in self.layers:
            for w in layer:
                autofp4.linear(xs[w.k], w)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def timed(self, m: int) -> float:
        """Seconds of one forward pass at ``m`` tokens, the device drained after it."""
        self.sync()
        t0 = time.perf_counter()
        self.forward(m)
        self.sync()
        return time.perf_counter() - t0

    def decode_us(self, m: int, reps: int, rounds: int) -> dict:
        """Microseconds per forward pass at ``m``: the median over ``rounds`` windows of ``reps``
        passes, and the spread (half the range of the windows)."""
        self.forward(m)  # warm: compiles and packs
        wins = [self.window(m, reps) for _ in range(rounds)]
        return {"us": statistics.median(wins), "spread_us": (max(wins) - min(wins)) / 2, "windows": wins}

    def window(self, m: int, reps: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            self.forward(m)
        self.sync()
        return (time.perf_counter() - t0) / reps * 1e6


# -----------------------------------------------------------------------------------------
# the phases
# -----------------------------------------------------------------------------------------
def fresh(work: Path, name: str, keep_cache: bool) -> None:
    """A fresh tuning DB (and kernel cache, where the tuning processes started from now on
    compile) in ``work`` for the phase ``name``."""
    if not keep_cache:
        os.environ["AUTOFP4_KERNEL_CACHE"] = str(work / f"kernels-{name}")
    os.environ["AUTOFP4_SHIPPED_DB"] = str(work / "no-shipped")  # the shipped rows would be hits
    dispatch.set_db(work / f"{name}.db")


def decode_all(stack: Stack, args) -> dict:
    return {str(m): stack.decode_us(m, args.reps, args.rounds) for m in args.decode_m}


def offline(stack: Stack, shapes, args, work: Path) -> dict:
    if args.offline_db:  # rows an earlier offline tune stored (the shipped DB): decode with them
        db = args.offline_db.resolve()
        if db.suffix == ".json":  # an export: read as the only shipped layer, the user DB empty
            ship = work / "offline-shipped"
            ship.mkdir(exist_ok=True)
            (ship / db.name).write_bytes(db.read_bytes())
            os.environ["AUTOFP4_SHIPPED_DB"] = str(ship)
            dispatch.set_db(work / "offline-empty.db")
        else:
            os.environ["AUTOFP4_SHIPPED_DB"] = str(work / "no-shipped")
            dispatch.set_db(db)
        dec = decode_all(stack, args)
        return {"tune_s": None, "db": str(db), "decode": dec, "untuned_calls": _missed(stack.dev)}
    fresh(work, "offline", args.keep_kernel_cache)
    t0 = time.perf_counter()
    report = autofp4.tune(shapes, m_buckets=args.m, fmt=args.fmt, db=dispatch.user_db_path(), device=stack.dev,
                          progress=False)
    out = {"tune_s": time.perf_counter() - t0, "jobs": len(report.results), "tuned": len(report.tuned)}
    dispatch.reload()
    return {**out, "decode": decode_all(stack, args), "untuned_calls": _missed(stack.dev)}


def _missed(dev: torch.device) -> int:
    """Calls the dispatcher of ``dev`` ran untuned since it was built (its misses)."""
    return sum(c for _, _, c in dispatch.get_dispatcher(dev).misses())


def blocking(stack: Stack, args, work: Path) -> dict:
    fresh(work, "blocking", args.keep_kernel_cache)
    before = decode_all(stack, args)
    first = {}
    with autofp4.autotune(mode="blocking", budget_s=args.budget_s):
        for m in args.m:
            first[str(m)] = stack.timed(m)
        after = decode_all(stack, args)  # as a server runs on: its worker idle
        jobs = autofp4.autotune.jobs()
    return {"decode_before": before, "first_forward_s": first, "warmup_s": sum(first.values()), "decode": after,
            "jobs": jobs, "jobs_summary": jobs_summary(jobs)}


def jobs_summary(jobs: list[dict]) -> dict:
    """Where the just-in-time jobs' time went: their wall times in the worker (the first job of
    each shape apart: it builds the problem's weights), and how many picked other than the default."""
    if not jobs:
        return {"jobs": 0}
    seen, first, later = set(), [], []
    for j in jobs:
        shape = (j["op"], j["n"], j["k"])
        (later if shape in seen else first).append(j["wall_s"])
        seen.add(shape)
    walls = [j["wall_s"] for j in jobs]
    not_default = sum(1 for j in jobs if j["status"] == "tuned"
                      and (j["backend"], j["config"]) != (j["default_backend"], j["default_config"]))
    return {"jobs": len(jobs), "statuses": {s: sum(1 for j in jobs if j["status"] == s) for s in {j["status"] for j in jobs}},
            "wall_s_sum": sum(walls), "wall_s_median": statistics.median(walls), "wall_s_max": max(walls),
            "first_of_shape_s_median": statistics.median(first), "later_s_median": statistics.median(later) if later else None,
            "trials_median": statistics.median(j["trials_run"] for j in jobs), "not_default": not_default,
            "speedup_geomean": statistics.geometric_mean([j["default_us"] / j["median_us"] for j in jobs
                                                          if j["median_us"] and j["default_us"]] or [1.0])}


def background(stack: Stack, args, work: Path) -> dict:
    fresh(work, "background", args.keep_kernel_cache)
    idle_before = decode_all(stack, args)
    with autofp4.autotune(mode="background", budget_s=args.budget_s, duty=args.duty):
        t0 = time.perf_counter()
        for m in args.decode_m:  # the decode M's jobs first: the throughput compares the same picks
            stack.forward(m)
        autofp4.autotune.wait(args.timeout_s)
        for m in args.m:
            stack.forward(m)  # queues the rest, at once
        meanwhile = {str(m): [] for m in args.decode_m}
        while autofp4.autotune.pending() and time.perf_counter() - t0 < args.timeout_s:
            for m in args.decode_m:
                meanwhile[str(m)].append(stack.window(m, args.reps))
        all_tuned_s = time.perf_counter() - t0
        done = autofp4.autotune.wait(0 if autofp4.autotune.pending() else None)
        idle = decode_all(stack, args)
        duty = jit.active().duty
        jobs = autofp4.autotune.jobs()
    return {"decode_before": idle_before, "all_tuned_s": all_tuned_s, "all_tuned": done, "duty": duty,
            "jobs": jobs, "jobs_summary": jobs_summary(jobs),
            "decode_meanwhile": {m: _summary(v) for m, v in meanwhile.items()}, "decode": idle}


def _summary(wins: list[float]) -> dict:
    if not wins:
        return {"us": None, "spread_us": None, "windows": []}
    return {"us": statistics.median(wins), "spread_us": (max(wins) - min(wins)) / 2, "windows": wins}


# -----------------------------------------------------------------------------------------
# the table
# -----------------------------------------------------------------------------------------
def derive(doc: dict) -> dict:
    """Ratios against the targets (of the phases run): decode after blocking / offline,
    background throughput lost."""
    off, blk, bg = doc.get("offline"), doc.get("blocking"), doc.get("background")
    out = {"warmup_s": blk["warmup_s"] if blk else None, "decode": {}}
    for m in map(str, doc["decode_m"]):
        d = out["decode"][m] = {"blocking_over_offline": None, "within_noise": None, "background_cost": None}
        if off and blk:
            o, b = off["decode"][m], blk["decode"][m]
            d["blocking_over_offline"] = b["us"] / o["us"]
            d["within_noise"] = abs(b["us"] - o["us"]) <= b["spread_us"] + o["spread_us"]
        if bg and bg["decode_meanwhile"][m]["us"] is not None:
            d["background_cost"] = 1 - bg["decode"][m]["us"] / bg["decode_meanwhile"][m]["us"]
    return out


def jobs_line(js: dict) -> str:
    if not js["jobs"]:
        return "jobs: none finished"
    later = "-" if js["later_s_median"] is None else f"{js['later_s_median']:.2f}"
    return (f"jobs: {js['jobs']} {js['statuses']}, wall in the worker {js['wall_s_sum']:.1f} s (median {js['wall_s_median']:.2f},"
            f" max {js['wall_s_max']:.2f}; first of a shape {js['first_of_shape_s_median']:.2f}, later {later}),"
            f" median {js['trials_median']:g} trials, {js['not_default']} picks other than the default"
            f" (geomean {js['speedup_geomean']:.3f}x)")


def table(doc: dict) -> str:
    off, blk, bg, der = doc.get("offline"), doc.get("blocking"), doc.get("background"), doc["derived"]
    lines = []
    if off:
        lines.append(f"offline tune: {off['tuned']}/{off['jobs']} jobs in {off['tune_s']:.1f} s" if off["tune_s"] is not None
                     else f"offline: the rows of {Path(off['db']).name} (an offline `autofp4 tune --model` run, not re-run here)")
    if blk:
        lines += [f"blocking warm-up (first forward at M = {', '.join(blk['first_forward_s'])}): {blk['warmup_s']:.1f} s"
                  f" (target < {TARGETS['warmup_s']:.0f} s on an H200)",
                  "  first forward s by M: " + ", ".join(f"{m}: {v:.2f}" for m, v in blk["first_forward_s"].items()),
                  "  " + jobs_line(blk["jobs_summary"])]
    if bg:
        lines.append(f"background: every miss tuned after {bg['all_tuned_s']:.1f} s (duty {bg['duty']})" if bg["all_tuned"]
                     else f"background: jobs still queued at the {bg['all_tuned_s']:.1f} s timeout (duty {bg['duty']})")
        lines.append("  " + jobs_line(bg["jobs_summary"]))
    lines.append("")

    def us(phase, key, m):
        return "-" if not phase or phase[key][m]["us"] is None else f"{phase[key][m]['us']:.1f}"

    head = ("decode M", "untuned us", "offline us", "blocking us", "blk/off", "in noise", "bg idle us",
            "bg meanwhile us", "bg cost")
    rows = [head]
    for m, d in der["decode"].items():
        rows.append((m, us(blk, "decode_before", m), us(off, "decode", m), us(blk, "decode", m),
                     "-" if d["blocking_over_offline"] is None else f"{d['blocking_over_offline']:.3f}",
                     "-" if d["within_noise"] is None else "yes" if d["within_noise"] else "no",
                     us(bg, "decode", m), us(bg, "decode_meanwhile", m),
                     "-" if d["background_cost"] is None else f"{100 * d['background_cost']:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"(bg cost: throughput lost while the worker tunes, target <= {100 * TARGETS['background_cost']:.0f}%)")
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------------------
def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", help="a Hugging Face config.json (default: Llama-3.1-8B; a tiny Llama on the CPU)")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--m", help="M buckets (default 1..512 on the GPU, 1,2,4 on the CPU)")
    p.add_argument("--decode-m", default="1", help="decode token counts (comma-separated)")
    p.add_argument("--layers", type=int, help="copies of the layer stack (default: the model's layers; 1 on the CPU)")
    p.add_argument("--budget-s", type=float, help="each just-in-time job's time (default: autotune's)")
    p.add_argument("--duty", type=float, help="the background worker's share of time measuring (default: autotune's)")
    p.add_argument("--reps", type=int, default=20, help="forward passes per timing window")
    p.add_argument("--rounds", type=int, default=5, help="timing windows per decode time")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="the background phase gives up then")
    p.add_argument("--offline-db", type=Path,
                   help="decode with this DB's offline-tuned rows instead of tuning offline (e.g. tuning_db/nvidia-h200.json)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="the phases to run, comma-separated (each fits a shorter run; default: all)")
    p.add_argument("--keep-kernel-cache", action="store_true", help="every phase uses the kernel cache as it is")
    p.add_argument("--out", help="results directory (default: docs/results/<device>/)")
    args = p.parse_args(argv)
    on_cpu = torch.device(args.device).type == "cpu"
    args.m = [int(v) for v in args.m.split(",")] if args.m else list(CPU_MS if on_cpu else GPU_MS)
    args.decode_m = [int(v) for v in args.decode_m.split(",")]
    args.phases = [v for v in args.phases.split(",") if v]
    if not args.phases or set(args.phases) - set(PHASES):
        p.error(f"--phases: a comma-separated subset of {','.join(PHASES)}, got {args.phases}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    config = load_config(args.model) if args.model else (TINY if dev.type == "cpu" else
                                                          load_config(ROOT / "examples" / "llama-3.1-8b.json"))
    shapes = [s for s in model_shapes(config, fmt=args.fmt) if s.op == "linear"]
    copies = args.layers or (1 if dev.type == "cpu" else config["num_hidden_layers"])
    stack = Stack(shapes, copies, args.fmt, dev)
    out = results_dir(args.out, dev)
    doc = {**provenance(dev), "model": args.model or ("tiny llama" if dev.type == "cpu" else "llama-3.1-8b"),
           "shapes": [[s.name, s.n, s.k] for s in shapes], "layers": copies, "m": args.m, "decode_m": args.decode_m}
    saved = {k: os.environ.get(k) for k in _PHASE_ENV}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-jit-") as work:
            for name, run in (("offline", lambda: offline(stack, shapes, args, Path(work))),
                              ("blocking", lambda: blocking(stack, args, Path(work))),
                              ("background", lambda: background(stack, args, Path(work)))):
                if name not in args.phases:
                    continue
                print(f"{name} ...", file=sys.stderr)
                doc[name] = run()
                print(json.dumps({name: doc[name]})[:2000], file=sys.stderr)  # kept if a later phase is cut short
    finally:
        dispatch.set_db(None)
        for k, v in saved.items():  # the caller's DB layers and kernel cache again
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    doc["derived"] = derive(doc)
    text = table(doc)
    stem = "jit" if args.phases == list(PHASES) else "jit-" + "-".join(args.phases)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(f"{provenance_line(doc)}\n\n```\n{text}```\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
