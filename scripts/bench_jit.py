#!/usr/bin/env python
"""Just-in-time tuning of a model's linear and MoE layers from an empty DB, against offline-tuned rows.

What it measures, for the shapes of a model config (default Llama-3.1-8B,
``examples/llama-3.1-8b.json``; with ``--device cpu`` a tiny Llama on the reference backend, a
smoke check; ``--model tiny-moe`` a tiny Qwen3-MoE), in three phases, each with a fresh tuning DB
and a kernel cache of its own (see "kernel cache" below), so that the tuning of every phase
compiles what it tries:

* **offline**: ``autofp4.tune`` of the shapes at the M buckets (what ``autofp4 tune --model
  CONFIG --m ...`` runs, with its default budget), its wall time, then the decode time with its
  rows; or, with ``--offline-db`` (e.g. ``tuning_db/nvidia-h200.json``), the decode time with
  the rows an earlier offline run stored (not tuned again);
* **blocking**: the decode time untuned (the defaults), the first forward pass at each M bucket
  inside ``autofp4.autotune(mode="blocking")`` (each one waits for the jobs of its shapes) and
  their sum, the warm-up (and the part of it spent in MoE calls: the time until every MoE job
  was tuned); then the decode time with the rows it stored;
* **background**: a forward pass at each M bucket inside ``autotune(mode="background")`` (each
  queues its jobs and returns), then decode forward passes until every job is tuned: the time
  until then (and until every MoE job was), and the decode throughput meanwhile against idle
  (after, with the same picks: the decode M's jobs are queued first and tuned before the
  throughput is taken).

**Per job, graph-timed** (after the blocking and the background phase; ``--no-compare`` skips
it): for each just-in-time job (``autofp4.autotune.jobs()``: a problem at an M bucket) the
trials it ran, its stored pick, the offline row of the same problem and M bucket (the offline
phase's DB, else ``--offline-db``'s rows of origin ``offline``: those of this environment, else
those of the same GPU, else any; the fastest where several backends have one, as the dispatcher
picks) and the default config, all three timed in this run by the tuner's own trial
(:func:`autofp4.tuning.trial.run_trial` in the tuner's timing process: the correctness check,
then CUDA events over L2-rotated argument copies, CUDA-graph replay for short kernels and every
MoE layer; ``perf_counter`` on the CPU), on the same random data, ``--compare-rounds``
interleaved rounds (identical configs timed once per round; a config's time: the median of its
rounds, its noise the larger of its median spread and half the range of its rounds). A job
without an offline row at its own M bucket is compared with the offline row of the next M
bucket up (a stand-in, marked ``@M``: such a row also serves the job's M), reported apart from
the target. Reported per job: trials, JIT / offline / default us, the JIT row's speed against
the offline row's (offline us / JIT us), whether it is slower than the default beyond the noise
(:func:`autofp4.timing.faster_beyond_noise`), whether it is the offline pick.

**Kernel cache**: every phase gets an empty one (cold: the tuning compiles what it tries), or
with ``--kernel-cache DIR`` the blocking and background phases start from a copy of ``DIR``, a
cache warmed ahead of time (``--keep-kernel-cache``: every phase uses the cache as it is). On a
CPU machine, for the GPU run::

    AUTOFP4_KERNEL_CACHE=out/jitcache-llama autofp4 cache --warm examples/llama-3.1-8b.json \\
        --fmt nvfp4 --ops linear --m 1,2,4,8,16,32,64,128,256,512 --seeds 15 --arch sm_90a --workers 2

**Shipped rows**: every phase sees the repository's exports without the rows of the model's own
problems (``--shipped others``; ``none``: no shipped rows): what a user of a model the DB does
not cover has, the winners of other shapes, which its jobs try first.

What ``--seeds`` covers: a just-in-time job tries its first candidates
(``tuning.candidates._first_candidates``, at most 16: half the 32-trial budget) and searches no
further: the backend's default, the rows this run stored for the same problem at the nearest M
buckets, up to four winners of other problems at its M (this run's rows, the shipped rows of
other shapes, nearest first), then the seeds of ``sm90_w4a16.seeds(key, M)`` (10 to 15 for
Llama-3.1-8B's jobs at M = 1..512, 6 to 14 for Qwen3-30B-A3B's MoE at T = 1..256). ``cache --warm
--seeds 15`` compiles the default, the shipped winners of other shapes and every seed (without
the rows a run stores as it goes); ``--seeds N`` the first N seeds. A blocking job that has
measured a config waits at most 0.25 s for another compile.

A forward pass runs every layer of the model once, eagerly: ``autofp4.linear`` on an [M, K]
input for each linear layer, and for a MoE model ``autofp4.moe`` on an [M, hidden] input with
random FP4 experts (``autofp4.quantize`` of random weights) and a random top-k routing of the
model's top_k (``autofp4.route`` of random logits, drawn once per M), as a decode step of a
server without CUDA graphs does. ``--layers``: copies of the linear layers (default the model's
layer count; 1 on the CPU); ``--moe-layers``: copies of the MoE layers (default 1: one copy of
each distinct MoE shape meets all its problems; Qwen3-30B-A3B's 48 would hold 14 GB), so a
decode pass of a MoE model counts that many MoE layers. ``--ops linear,moe`` (default both)
restricts the layers (``--ops moe``: tune only the MoE jobs). The decode time is the median over
``--rounds`` windows of ``--reps`` passes at M = ``--decode-m``.

Targets (reported, not enforced; issue 45, on an H200): the blocking warm-up of Llama-3.1-8B's
40 jobs (M = 1..512) <= 120 s with a cold kernel cache, <= 45 s with a warmed one; the JIT rows
>= 97% of the offline rows' speed (geomean over the jobs; MoE jobs >= 95%, all of them tuned
within 5 minutes); no JIT row slower than the default beyond the noise; at most 10% of the
decode throughput lost in background mode.

Writes ``jit.json`` and ``jit.md`` (the table; the per-job tables always in ``jit.md``, printed
too where they stay under 50 lines; the summary printed last) to ``--out`` (default
``docs/results/<device>/``).

    python scripts/bench_jit.py                                   # on the GPU (about 25 minutes)
    python scripts/bench_jit.py --phases blocking --offline-db tuning_db/nvidia-h200.json
    python scripts/bench_jit.py --phases blocking --offline-db tuning_db/nvidia-h200.json --kernel-cache out/jitcache-llama
    python scripts/bench_jit.py --phases blocking --offline-db tuning_db/nvidia-h200.json --kernel-cache out/jitcache-llama \\
        --worker-ahead-s 30                                       # the worker started while "the model loads"
    python scripts/bench_jit.py --model examples/qwen3-30b-a3b.json --ops moe --m 1,2,4,8,16,32,64,128,256 \\
        --phases blocking --offline-db tuning_db/nvidia-h200.json
    python scripts/bench_jit.py --device cpu --out /tmp/jit       # the smoke check
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from _common import ROOT, geomean, provenance, provenance_line, results_dir

import autofp4
from autofp4 import dispatch
from autofp4.models import load_config, model_shapes
from autofp4.tuning import jit

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
#: a tiny Qwen3-MoE (``--model tiny-moe``): attention linears and one MoE layer of 8 experts, top-2
TINY_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256,
            "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}
TINY_MODELS = {"tiny": TINY, "tiny-moe": TINY_MOE}
GPU_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CPU_MS = (1, 2, 4)
OPS = ("linear", "moe")
#: issue 45's targets (H200): warm-up of Llama-3.1-8B's 40 jobs by kernel cache, the JIT rows'
#: speed against the offline rows' by op (geomean), JIT rows slower than the default, the time
#: until every MoE job is tuned, the background worker's cost to the decode throughput
TARGETS = {"warmup_s": {"cold": 120.0, "warmed": 45.0}, "speed_vs_offline": {"linear": 0.97, "moe": 0.95},
           "slower_than_default": 0, "moe_tuned_s": 300.0, "background_cost": 0.10}
PHASES = ("offline", "blocking", "background")
#: the per-job tables are printed (not only written to jit.md) while they stay under this many lines
PRINT_JOB_LINES = 50
#: the seed of the comparison's random data (weights, activations, routing)
COMPARE_SEED = 4545
#: what the phases set for themselves (restored when the run ends)
_PHASE_ENV = ("AUTOFP4_KERNEL_CACHE", "AUTOFP4_SHIPPED_DB")


# -----------------------------------------------------------------------------------------
# the model: its linear and MoE layers, a forward pass, its time
# -----------------------------------------------------------------------------------------
class Stack:
    """``copies`` copies of a model's linear layers and ``moe_copies`` of its MoE layers (random
    FP4 weights), and inputs per M (random activations; a MoE layer's random top-k routing)."""

    def __init__(self, shapes, copies: int, fmt: str, dev: torch.device, moe_copies: int = 1) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        self.dev = dev
        self.gen = gen
        lin = [s for s in shapes if s.op == "linear"]
        moe = [s for s in shapes if s.op == "moe"]
        self.layers = [[autofp4.quantize(torch.randn(s.n, s.k, device=dev, generator=gen) * 0.02, fmt)
                        for s in lin] for _ in range(copies if lin else 0)]
        # MoE experts: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; bf16 random values (a
        # Qwen3-30B-A3B layer's are 0.6 G values), quantized by autofp4
        self.moe_layers = [[(self._experts(s.experts, s.n, s.k, fmt), self._experts(s.experts, s.k, s.intermediate, fmt),
                             s.topk) for s in moe] for _ in range(moe_copies if moe else 0)]
        self.ops = tuple(op for op in OPS if any(s.op == op for s in shapes))
        self.ks = sorted({s.k for s in shapes})
        self.routings = sorted({(s.experts, s.topk) for s in moe})
        self.xs: dict[int, dict[int, torch.Tensor]] = {}
        self.routes: dict[int, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}

    def _experts(self, e: int, n: int, k: int, fmt: str):
        w = torch.randn(e, n, k, device=self.dev, generator=self.gen, dtype=torch.bfloat16) * 0.02
        return autofp4.quantize(w, fmt)

    def inputs(self, m: int):
        """The activations (per K) and routings (per (experts, top_k)) of ``m`` tokens, drawn once."""
        xs = self.xs.get(m)
        if xs is None:
            xs = self.xs[m] = {k: torch.randn(m, k, device=self.dev, dtype=torch.bfloat16) for k in self.ks}
            self.routes[m] = {(e, t): autofp4.route(torch.randn(m, e, device=self.dev), t) for e, t in self.routings}
        return xs, self.routes[m]

    def forward(self, m: int, clock: dict | None = None) -> None:
        """One pass at ``m`` tokens: layer by layer, its linear layers then its MoE layer.
        ``clock``: adds the host seconds spent in each op's calls under its name (what a blocking
        call waits for its jobs is host time; the device is not drained)."""
        xs, routes = self.inputs(m)
        now = time.perf_counter
        for i in range(max(len(self.layers), len(self.moe_layers))):
            t0 = now()
            for w in self.layers[i] if i < len(self.layers) else ():
                autofp4.linear(xs[w.k], w)
            t1 = now()
            for w13, w2, topk in self.moe_layers[i] if i < len(self.moe_layers) else ():
                tw, ti = routes[(w13.experts, topk)]
                autofp4.moe(xs[w13.k], w13, w2, tw, ti)
            if clock is not None:
                for op, dt in (("linear", t1 - t0), ("moe", now() - t1)):
                    if op in self.ops:
                        clock[op] = clock.get(op, 0.0) + dt

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def timed(self, m: int, clock: dict | None = None) -> float:
        """Seconds of one forward pass at ``m`` tokens, the device drained after it."""
        self.sync()
        t0 = time.perf_counter()
        self.forward(m, clock)
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
def _cache_files(d: Path) -> tuple[int, int]:
    """``(kernels, bytes)`` of a kernel cache folder (its ``.o`` files; bytes of every file)."""
    files = [p for p in d.iterdir() if p.is_file()]
    return sum(1 for p in files if p.suffix == ".o"), sum(p.stat().st_size for p in files)


def _usable_kernels(d: Path, device: torch.device) -> dict:
    """Of the kernels in the cache folder ``d`` (their ``.json`` records), how many this run can
    load: built by this CuTeDSL, from the current source of their module, for this GPU (a warm
    made with another CuTeDSL or before a kernel's source changed is a cold cache in disguise)."""
    import hashlib

    from autofp4.env import cutlass_dsl_version
    from autofp4.kernel_cache import kernel_source, target_arch

    arch = target_arch() if device.type == "cuda" else None
    sources: dict[str, str | None] = {}
    out = {"usable": 0, "other_cutlass_dsl": 0, "other_source": 0, "other_arch": 0, "unreadable": 0}
    for f in d.glob("*.json"):
        try:
            rec = json.loads(f.read_text())
            mod = rec["module"]
            if mod not in sources:
                try:
                    sources[mod] = hashlib.sha256(kernel_source(mod).encode()).hexdigest()
                except Exception:
                    sources[mod] = None
        except (OSError, ValueError, KeyError, TypeError):
            out["unreadable"] += 1
            continue
        if rec.get("cutlass_dsl") != cutlass_dsl_version():
            out["other_cutlass_dsl"] += 1
        elif rec.get("source") != sources[mod]:
            out["other_source"] += 1
        elif arch is not None and rec.get("arch") != arch:
            out["other_arch"] += 1
        else:
            out["usable"] += 1
    return out


def fresh(work: Path, name: str, args) -> dict:
    """A fresh tuning DB (and kernel cache, where the tuning processes started from now on
    compile) in ``work`` for the phase ``name``; what the kernel cache holds, as reported."""
    os.environ["AUTOFP4_SHIPPED_DB"] = str(_shipped_others(work, args))
    dispatch.set_db(work / f"{name}.db")
    if args.keep_kernel_cache:
        return {"state": "kept", "dir": os.environ.get("AUTOFP4_KERNEL_CACHE")}
    d = work / f"kernels-{name}"
    shutil.rmtree(d, ignore_errors=True)
    os.environ["AUTOFP4_KERNEL_CACHE"] = str(d)
    if args.kernel_cache is None or name == "offline":
        d.mkdir(parents=True)
        return {"state": "cold"}
    shutil.copytree(args.kernel_cache, d)
    kernels, size = _cache_files(d)
    return {"state": "warmed", "from": str(args.kernel_cache), "kernels": kernels, "mib": round(size / 2**20, 2),
            **_usable_kernels(d, torch.device(args.device))}


def _shipped_others(work: Path, args) -> Path:
    """The shipped rows a phase's dispatcher and tuner see: with ``--shipped others`` (the
    default) the repository's exports without the rows of the model's own problems (those would
    be hits), as a user of a model the DB does not cover has them: the winners of other shapes,
    which a just-in-time job tries first; with ``--shipped none``, none."""
    which = getattr(args, "shipped", "others")
    d = work / f"shipped-{which}"
    if d.is_dir():
        return d
    d.mkdir(parents=True)
    if which == "none":
        return d
    for f in sorted((ROOT / "tuning_db").glob("*.json")):
        doc = json.loads(f.read_text())
        own = getattr(args, "own_problems", set())
        doc["records"] = [r for r in doc["records"]
                          if (r["op"], r["n"], r["k"], r.get("experts", 0), r.get("topk", 0)) not in own]
        (d / f.name).write_text(json.dumps(doc))
    return d


def _compiled_since(cache: dict) -> None:
    """Add to a phase's kernel cache report the kernels its tuning added (compiled, not found)."""
    d = os.environ.get("AUTOFP4_KERNEL_CACHE")
    if cache["state"] != "kept" and d and Path(d).is_dir():
        cache["compiled"] = _cache_files(Path(d))[0] - cache.get("kernels", 0)


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
    cache = fresh(work, "offline", args)
    t0 = time.perf_counter()
    report = autofp4.tune(shapes, m_buckets=args.m, fmt=args.fmt, db=dispatch.user_db_path(), device=stack.dev,
                          progress=False)
    out = {"tune_s": time.perf_counter() - t0, "jobs": len(report.results), "tuned": len(report.tuned),
           "db": str(dispatch.user_db_path()), "kernel_cache": cache}
    dispatch.reload()
    return {**out, "decode": decode_all(stack, args), "untuned_calls": _missed(stack.dev)}


def _missed(dev: torch.device) -> int:
    """Calls the dispatcher of ``dev`` ran untuned since it was built (its misses)."""
    return sum(c for _, _, c in dispatch.get_dispatcher(dev).misses())


def blocking(stack: Stack, args, work: Path, offline_src) -> dict:
    cache = fresh(work, "blocking", args)
    before = decode_all(stack, args)
    first, by_op = {}, {}
    with autofp4.autotune(mode="blocking", budget_s=args.budget_s, ops=args.ops):
        if args.worker_ahead_s:  # as a program that starts the worker, then loads its model
            autofp4.autotune.start(stack.dev)
            time.sleep(args.worker_ahead_s)
        for m in args.m:
            clock: dict = {}
            first[str(m)] = stack.timed(m, clock)
            by_op[str(m)] = clock
        after = decode_all(stack, args)  # as a server runs on: its worker idle
        jobs = autofp4.autotune.jobs()
    _compiled_since(cache)
    out = {"kernel_cache": cache, "decode_before": before, "worker_ahead_s": args.worker_ahead_s, "first_forward_s": first,
           "warmup_s": sum(first.values()), "first_forward_s_by_op": by_op,
           "warmup_s_by_op": {op: sum(c.get(op, 0.0) for c in by_op.values()) for op in stack.ops},
           "decode": after, "jobs": jobs, "jobs_summary": jobs_summary(jobs)}
    if args.compare:
        out["compare"] = compare(jobs, offline_src, args, stack.dev)
    return out


TIME_PARTS = ("prepare", "setup", "compile_wait", "measure", "choose", "total")


def jobs_summary(jobs: list[dict]) -> dict:
    """Where the just-in-time jobs' time went: their wall times in the worker (the first job of
    each shape apart: it builds the problem's weights), and how many picked other than the default."""
    if not jobs:
        return {"jobs": 0}
    seen, first, later = set(), [], []
    for j in jobs:
        shape = (j["op"], j["n"], j["k"], j.get("experts", 0), j.get("topk", 0))
        (later if shape in seen else first).append(j["wall_s"])
        seen.add(shape)
    walls = [j["wall_s"] for j in jobs]
    not_default = sum(1 for j in jobs if j["status"] == "tuned"
                      and (j["backend"], j["config"]) != (j["default_backend"], j["default_config"]))
    return {"jobs": len(jobs), "statuses": {s: sum(1 for j in jobs if j["status"] == s) for s in {j["status"] for j in jobs}},
            "wall_s_sum": sum(walls), "wall_s_median": statistics.median(walls), "wall_s_max": max(walls),
            "first_of_shape_s_median": statistics.median(first), "later_s_median": statistics.median(later) if later else None,
            "trials_median": statistics.median(j.get("trials_run", 0) for j in jobs), "not_default": not_default,
            "speedup_geomean": statistics.geometric_mean([j["default_us"] / j["median_us"] for j in jobs
                                                          if j.get("median_us") and j.get("default_us")] or [1.0]),
            # summed over the jobs (autofp4's JobResult.time_s): where a job's share went
            "time_s": {part: sum((j.get("time_s") or {}).get(part, 0.0) for j in jobs) for part in TIME_PARTS}}


def _moe_jobs_expected(args, shapes) -> int:
    """The MoE jobs a pass at every M bucket meets (one per MoE problem and standard M bucket)."""
    from autofp4.problem import standard_bucket

    return len({(s.dedup_key, standard_bucket(m)) for s in shapes if s.op == "moe" for m in args.m})


def background(stack: Stack, args, work: Path, offline_src, shapes) -> dict:
    cache = fresh(work, "background", args)
    idle_before = decode_all(stack, args)
    moe_expected = _moe_jobs_expected(args, shapes)
    moe_tuned_s = None
    with autofp4.autotune(mode="background", budget_s=args.budget_s, duty=args.duty, ops=args.ops):
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
            if moe_tuned_s is None and moe_expected and _moe_done(autofp4.autotune.jobs()) >= moe_expected:
                moe_tuned_s = time.perf_counter() - t0
        all_tuned_s = time.perf_counter() - t0
        done = autofp4.autotune.wait(0 if autofp4.autotune.pending() else None)
        if moe_tuned_s is None and moe_expected and _moe_done(autofp4.autotune.jobs()) >= moe_expected:
            moe_tuned_s = all_tuned_s
        idle = decode_all(stack, args)
        duty = jit.active().duty
        jobs = autofp4.autotune.jobs()
    _compiled_since(cache)
    out = {"kernel_cache": cache, "decode_before": idle_before, "all_tuned_s": all_tuned_s, "all_tuned": done,
           "moe_tuned_s": moe_tuned_s, "moe_jobs_expected": moe_expected, "duty": duty,
           "jobs": jobs, "jobs_summary": jobs_summary(jobs),
           "decode_meanwhile": {m: _summary(v) for m, v in meanwhile.items()}, "decode": idle}
    if args.compare:
        out["compare"] = compare(jobs, offline_src, args, stack.dev)
    return out


def _moe_done(jobs: list[dict]) -> int:
    from autofp4.tuning.jobs import STORED

    return sum(1 for j in jobs if j["op"] == "moe" and j["status"] in STORED)


def _summary(wins: list[float]) -> dict:
    if not wins:
        return {"us": None, "spread_us": None, "windows": []}
    return {"us": statistics.median(wins), "spread_us": (max(wins) - min(wins)) / 2, "windows": wins}


# -----------------------------------------------------------------------------------------
# per job: the JIT row against the offline row and the default, graph-timed
# -----------------------------------------------------------------------------------------
_PROBLEM = ("op", "fmt", "dtype", "n", "k", "experts", "topk")


def _problem(d) -> tuple:
    """The problem fields of a job report (dict) or a row (TuningRecord)."""
    get = d.get if isinstance(d, dict) else lambda f, dflt=0: getattr(d, f, dflt)
    return tuple(get(f, 0) for f in _PROBLEM)


def _cfg_text(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def _canon(pick: tuple[str, dict] | None) -> tuple[str, dict] | None:
    """``(backend, config)`` with the config as its backend writes it (every field, the defaults of
    fields an older row lacks), so that equal configs compare equal; as given where it does not parse."""
    if pick is None:
        return None
    from autofp4.backends import get_backend

    try:
        b = get_backend(pick[0])
        return pick[0], b.config_dict(b.parse_config(pick[1]))
    except Exception:  # an unknown backend or a config it no longer takes: timed (and failing) as stored
        return pick[0], dict(pick[1])


def offline_rows(source, device: torch.device) -> dict:
    """The offline-tuned rows of ``source`` (a tuning DB, its file or an export): those of origin
    ``offline`` measured in this environment, else on the same GPU, else anywhere; ``rows``:
    ``{(problem, M bucket): (backend, config, median_us, spread_us)}`` (the fastest row where
    several backends have one, as the dispatcher picks)."""
    from autofp4.db import read_records
    from autofp4.env import current_environment

    name, recs = read_records(source)
    off = [r for r in recs if r.origin == "offline"]
    env = current_environment(device)
    for which, keep in (("this environment", lambda r: r.env_key == env.key()),
                        (f"the same GPU ({env.gpu_name})", lambda r: r.env.gpu_name == env.gpu_name),
                        ("other GPUs' environments", lambda r: True)):
        chosen = [r for r in off if keep(r)]
        if chosen:
            break
    rows: dict = {}
    for r in chosen:
        k = (_problem(r), r.m_bucket)
        if k not in rows or r.median_us < rows[k][2]:
            rows[k] = (r.backend, dict(r.config), r.median_us, r.spread_us)
    return {"source": name, "rows": rows, "of": which if chosen else "none", "jit_rows_left_out": len(recs) - len(off),
            "environments": len({r.env_key for r in chosen})}


def _offline_pick(rows: dict, problem: tuple, m: int):
    """The offline row of ``(problem, m)``: ``(row, its M bucket)``; without one at ``m``, the
    row of the next M bucket up (it serves ``m`` too), else ``(None, None)``."""
    if (problem, m) in rows:
        return rows[(problem, m)], m
    up = sorted(b for (p, b) in rows if p == problem and b > m)
    return (rows[(problem, up[0])], up[0]) if up else (None, None)


def _default_pick(job: dict, device: torch.device) -> tuple[str, dict] | None:
    """The job's default (as the tuner reported it; else the first backend that runs the problem)."""
    if job.get("default_backend"):
        return job["default_backend"], dict(job.get("default_config") or {})
    from autofp4.backends import available_backends
    from autofp4.problem import ProblemKey

    key = ProblemKey(*_problem(job))
    for b in available_backends(device):
        if b.supports(key) is None:
            return b.name, b.config_dict(b.default(key, job["m"]))
    return None


def _jit_pick(job: dict, stored: dict) -> tuple[tuple[str, dict] | None, str]:
    """The JIT row of a job: the pick it reported, else the row the phase's DB holds for it; None
    where it stored none (the default then runs), and where it came from."""
    from autofp4.tuning.jobs import STORED

    if job["status"] in STORED and job.get("backend") and job.get("config") is not None:
        return (job["backend"], dict(job["config"])), "job"
    row = stored.get((_problem(job), job["m"]))
    if row is not None:
        return (row[0], row[1]), "db"
    return None, "none"


def _time_configs(plan: list[tuple[dict, list[tuple[str, dict]]]], args, device: torch.device) -> list[dict]:
    """Time each job's configs (``plan``: (job, [(backend, config), ...] distinct)) with the
    tuner's trial in the tuner's timing process (a child process on the GPU), ``args.compare_rounds``
    rounds, the problems one after the other (their random data is built once); per job,
    ``{ident: [trial results]}``."""
    from autofp4.backends import get_backend
    from autofp4.problem import ProblemKey
    from autofp4.tuning.compile_pool import _spec
    from autofp4.tuning.jobs import CPU_DEFAULTS, GPU_DEFAULTS
    from autofp4.tuning.measurer import _Measurer

    on_gpu = device.type == "cuda"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    meas = _Measurer(device, on_gpu, defaults.trial_timeout_s)
    results: list[dict] = [{f"{b}:{_cfg_text(c)}": [] for b, c in cfgs} for _, cfgs in plan]
    order = sorted(range(len(plan)), key=lambda i: (_problem(plan[i][0]), plan[i][0]["m"]))
    groups: dict[tuple, list[int]] = {}
    for i in order:
        groups.setdefault(_problem(plan[i][0]), []).append(i)
    try:
        meas.start()
        for members in groups.values():
            for r in range(args.compare_rounds):
                for i in members:
                    job, cfgs = plan[i]
                    key = ProblemKey(*_problem(job))
                    rot = r % len(cfgs) if cfgs else 0
                    for b, cfg in cfgs[rot:] + cfgs[:rot]:  # each round starts with another config
                        req = {"backend": b, "spec": _spec(get_backend(b)), "config": _cfg_text(cfg),
                               "key": asdict(key), "m": job["m"], "seed": COMPARE_SEED, "device": str(device),
                               "warmup": defaults.warmup, "reps": defaults.reps, "graph": True,
                               "experts_global": job.get("experts_global", 0) or 0}
                        results[i][f"{b}:{_cfg_text(cfg)}"].append(meas.run(req))
    finally:
        meas.close()
    return results


def _stats(res: list[dict]) -> dict:
    """A config's time over its rounds: the median of their medians; the noise, the larger of their
    median spread and half their range; None where a round failed (its error kept)."""
    bad = [r for r in res if r.get("outcome") != "ok"]
    if bad or not res:
        return {"us": None, "spread_us": None, "error": (bad[0].get("outcome", "?") + ": " + str(bad[0].get("error", ""))[:300])
                if bad else "not timed"}
    meds = [r["median_us"] for r in res]
    spread = max(statistics.median(r["spread_us"] for r in res), (max(meds) - min(meds)) / 2)
    return {"us": statistics.median(meds), "spread_us": spread, "rounds": meds}


def compare(jobs: list[dict], offline_src, args, device: torch.device) -> dict:
    """Per JIT job: trials, the JIT / offline / default configs and their times in this run (see
    the module's docstring), and the summary against the targets."""
    from autofp4.db import read_records
    from autofp4.timing import TimingStats, faster_beyond_noise

    t0 = time.perf_counter()
    off = offline_rows(offline_src, device) if offline_src is not None else {"source": None, "rows": {}, "of": "none"}
    stored: dict = {}
    db = dispatch.user_db_path()
    if db.exists():
        for r in read_records(db)[1]:
            k = (_problem(r), r.m_bucket)
            if k not in stored or r.median_us < stored[k][2]:
                stored[k] = (r.backend, dict(r.config), r.median_us)
    plan, rows = [], []
    for job in jobs:
        jit_pick, jit_from = _jit_pick(job, stored)
        dflt = _default_pick(job, device)
        off_row, off_m = _offline_pick(off["rows"], _problem(job), job["m"])
        off_pick = None if off_row is None else (off_row[0], off_row[1])
        if jit_pick is None:
            jit_pick = dflt  # no row stored: the default runs
        picks = {"jit": _canon(jit_pick), "offline": _canon(off_pick), "default": _canon(dflt)}
        distinct: list[tuple[str, dict]] = []
        for p in picks.values():
            if p is not None and p not in distinct:
                distinct.append(p)
        plan.append((job, distinct))
        rows.append((job, picks, jit_from, off_m))
    timed = _time_configs(plan, args, device)
    per_job = []
    for (job, picks, jit_from, off_m), res in zip(rows, timed):
        t = {w: (None if p is None else _stats(res[f"{p[0]}:{_cfg_text(p[1])}"])) for w, p in picks.items()}
        e = {
            "op": job["op"], "n": job["n"], "k": job["k"], "experts": job.get("experts", 0), "topk": job.get("topk", 0),
            "m": job["m"], "status": job["status"], "trials": job.get("trials_run", 0),
            "trials_failed": job.get("trials_failed", 0), "wall_s": job.get("wall_s"), "jit_from": jit_from,
            "offline_m": off_m, "picks": {w: None if p is None else {"backend": p[0], "config": p[1]} for w, p in picks.items()},
            "times": t, "same_as_offline": None if picks["offline"] is None else picks["jit"] == picks["offline"],
            "jit_is_default": picks["jit"] == picks["default"],
        }
        ju, ou, du = (None if t[w] is None else t[w]["us"] for w in ("jit", "offline", "default"))
        e["speed_vs_offline"] = ou / ju if ju and ou else None
        e["speed_vs_default"] = du / ju if ju and du else None
        e["slower_than_default"] = None
        if ju and du:
            e["slower_than_default"] = picks["jit"] != picks["default"] and faster_beyond_noise(
                TimingStats(du, t["default"]["spread_us"], 1, du), TimingStats(ju, t["jit"]["spread_us"], 1, ju))
        per_job.append(e)
    return {"offline_source": off["source"], "offline_rows_of": off["of"],
            "offline_jit_rows_left_out": off.get("jit_rows_left_out", 0), "rounds": args.compare_rounds,
            "jobs": per_job, "summary": compare_summary(per_job), "seconds": time.perf_counter() - t0}


def compare_summary(per_job: list[dict]) -> dict:
    """Per op: jobs, those with an offline row at their own M bucket, the geomean speed of the JIT
    rows against those rows (and with the next-bucket stand-ins too) against the target; JIT rows
    slower than the default beyond the noise, picks equal to the offline pick, trials."""
    by_op = {}
    for op in OPS:
        js = [e for e in per_job if e["op"] == op]
        if not js:
            continue
        exact = [e["speed_vs_offline"] for e in js if e["speed_vs_offline"] and e["offline_m"] == e["m"]]
        near = [e["speed_vs_offline"] for e in js if e["speed_vs_offline"]]
        g = geomean(exact) if exact else None
        by_op[op] = {"jobs": len(js), "with_offline_row": len(exact), "with_stand_in": len(near) - len(exact),
                     "speed_vs_offline_geomean": g, "speed_vs_offline_geomean_with_stand_ins": geomean(near) if near else None,
                     "speed_vs_offline_min": min(exact) if exact else None,
                     "speed_vs_default_geomean": geomean([e["speed_vs_default"] for e in js if e["speed_vs_default"]] or [1.0]),
                     "target": TARGETS["speed_vs_offline"][op], "met": None if g is None else g >= TARGETS["speed_vs_offline"][op]}
    slower = [e for e in per_job if e["slower_than_default"]]
    compared = [e for e in per_job if e["same_as_offline"] is not None]
    return {"jobs": len(per_job), "by_op": by_op, "slower_than_default": len(slower),
            "slower_jobs": [_job_label(e) for e in slower],
            "failed_timings": sum(1 for e in per_job for t in e["times"].values() if t is not None and t["us"] is None),
            "same_as_offline": sum(1 for e in compared if e["same_as_offline"]), "with_offline_pick": len(compared),
            "jit_is_default": sum(1 for e in per_job if e["jit_is_default"]),
            "trials_median": statistics.median(e["trials"] for e in per_job) if per_job else None,
            "trials_total": sum(e["trials"] for e in per_job)}


def _job_label(e: dict) -> str:
    s = f"{e['op']} {e['n']}x{e['k']}" + (f" E{e['experts']}/{e['topk']}" if e["op"] == "moe" else "")
    return f"{s} M={e['m']}"


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
            f" (geomean {js['speedup_geomean']:.3f}x)"
            + ("\n  the jobs' time, s: " + ", ".join(f"{k} {v:.1f}" for k, v in js["time_s"].items())
               if js.get("time_s", {}).get("total") else ""))


def cache_line(c: dict | None) -> str:
    if not c:
        return "kernel cache: ?"
    new = "" if c.get("compiled") is None else f"; {c['compiled']} kernels compiled in the phase"
    if c["state"] == "warmed":
        stale = {k: c.get(k, 0) for k in ("other_cutlass_dsl", "other_source", "other_arch", "unreadable") if c.get(k)}
        return (f"kernel cache: warmed (a copy of {c['from']}: {c['kernels']} kernels, {c['mib']:.1f} MiB,"
                f" {c.get('usable', 0)} usable here" + (f", NOT usable: {stale}" if stale else "") + f"){new}")
    if c["state"] == "kept":
        return f"kernel cache: kept as it was ({c.get('dir') or 'the default folder'}){new}"
    return f"kernel cache: cold (empty){new}"


def _fmt_us(t: dict | None) -> str:
    if t is None:
        return "-"
    return "fail" if t["us"] is None else f"{t['us']:.2f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def job_table(cmp: dict) -> list[str]:
    """One line per job (and a header): trials, JIT / offline / default us, speed against the
    offline row, slower than the default, the offline pick."""
    head = ("job", "M", "status", "trials", "jit us", "offline us", "default us", "jit/off", "jit/def", "slower", "same")
    rows = [head]
    for e in cmp["jobs"]:
        off = _fmt_us(e["times"]["offline"])
        if e["offline_m"] is not None and e["offline_m"] != e["m"]:
            off += f"@{e['offline_m']}"
        rows.append((_job_label(e).rsplit(" M=", 1)[0], str(e["m"]), e["status"], str(e["trials"]), _fmt_us(e["times"]["jit"]),
                     off, _fmt_us(e["times"]["default"]), _ratio(e["speed_vs_offline"]), _ratio(e["speed_vs_default"]),
                     "-" if e["slower_than_default"] is None else "SLOWER" if e["slower_than_default"] else "no",
                     "-" if e["same_as_offline"] is None else "yes" if e["same_as_offline"] else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def compare_lines(name: str, cmp: dict, moe_s: float | None) -> list[str]:
    """The summary of one phase's per-job comparison, against the targets."""
    s = cmp["summary"]
    src = Path(cmp["offline_source"]).name if cmp["offline_source"] else None
    lines = [f"{name} JIT rows, timed here as the tuner times ({cmp['rounds']} rounds, {cmp['seconds']:.0f} s), against "
             + (f"the offline rows of {src} ({cmp['offline_rows_of']})" if src else "no offline rows (none given)") + ":"]
    for op, o in s["by_op"].items():
        t = TARGETS["speed_vs_offline"][op]
        g = o["speed_vs_offline_geomean"]
        verdict = "" if o["met"] is None else " [met]" if o["met"] else " [MISSED]"
        near = o["speed_vs_offline_geomean_with_stand_ins"]
        lines.append(f"  {op}: speed vs offline {('-' if g is None else f'{g:.3f}')} geomean over {o['with_offline_row']}"
                     f" of {o['jobs']} jobs with an offline row at their M (target >= {t:.2f}){verdict}"
                     + (f"; with {o['with_stand_in']} next-bucket stand-ins {near:.3f}" if o["with_stand_in"] and near else "")
                     + f"; vs default {o['speed_vs_default_geomean']:.3f}")
    lines.append(f"  JIT rows slower than the default beyond the noise: {s['slower_than_default']} (target 0)"
                 + (f": {', '.join(s['slower_jobs'][:6])}" if s["slower_jobs"] else "")
                 + ("" if not s["failed_timings"] else f"; {s['failed_timings']} timings failed (see jit.json)"))
    lines.append(f"  picks equal to the offline pick: {s['same_as_offline']} of {s['with_offline_pick']};"
                 f" the default: {s['jit_is_default']} of {s['jobs']}; trials per job median {s['trials_median']:g}"
                 f" (total {s['trials_total']})" if s["jobs"] else "  no jobs")
    if moe_s is not None:
        lines.append(f"  MoE jobs all tuned after {moe_s:.1f} s (target <= {TARGETS['moe_tuned_s']:.0f} s)"
                     + (" [met]" if moe_s <= TARGETS["moe_tuned_s"] else " [MISSED]"))
    return lines


def table(doc: dict, per_job: bool = True) -> str:
    """The report: the phases, the decode times, the per-job tables (``per_job``), then the
    per-job comparisons' summaries against the targets (last)."""
    off, blk, bg, der = doc.get("offline"), doc.get("blocking"), doc.get("background"), doc["derived"]
    lines = []
    if off:
        lines.append(f"offline tune: {off['tuned']}/{off['jobs']} jobs in {off['tune_s']:.1f} s" if off["tune_s"] is not None
                     else f"offline: the rows of {Path(off['db']).name} (an offline `autofp4 tune --model` run, not re-run here)")
    if blk:
        state = blk["kernel_cache"]["state"]
        target = TARGETS["warmup_s"].get(state, TARGETS["warmup_s"]["cold"])
        lines += [f"blocking warm-up (first forward at M = {', '.join(blk['first_forward_s'])}): {blk['warmup_s']:.1f} s"
                  f" (target <= {target:.0f} s with a {state if state != 'kept' else 'cold'} kernel cache,"
                  f" Llama-3.1-8B's 40 jobs on an H200)",
                  "  " + cache_line(blk["kernel_cache"]),
                  *([f"  the worker started {blk['worker_ahead_s']:g} s before the first forward "
                     "(autotune.start(), as while a model loads); its start is not in the warm-up"]
                    if blk.get("worker_ahead_s") else []),
                  "  first forward s by M: " + ", ".join(f"{m}: {v:.2f}" for m, v in blk["first_forward_s"].items()),
                  "  in the calls of each op: " + ", ".join(f"{op} {v:.1f} s" for op, v in blk["warmup_s_by_op"].items()),
                  "  " + jobs_line(blk["jobs_summary"])]
    if bg:
        lines.append(f"background: every miss tuned after {bg['all_tuned_s']:.1f} s (duty {bg['duty']})" if bg["all_tuned"]
                     else f"background: jobs still queued at the {bg['all_tuned_s']:.1f} s timeout (duty {bg['duty']})")
        lines.append("  " + cache_line(bg["kernel_cache"]))
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
    lines.append(f"(bg cost: throughput lost while the worker tunes, target <= {100 * TARGETS['background_cost']:.0f}%;"
                 f" a pass: {doc['layers']} copies of the linear layers"
                 + (f", {doc['moe_layers']} of the MoE layers)" if doc.get("moe_layers") else ")"))
    compared = [(n, p) for n, p in (("blocking", blk), ("background", bg)) if p and p.get("compare")]
    if compared:
        job_lines = {n: job_table(p["compare"]) for n, p in compared}
        if per_job:
            for n, jl in job_lines.items():
                lines += ["", f"{n} jobs (us: kernel time as the tuner times it; offline @M: the next M bucket's row):", *jl]
        else:
            lines += ["", f"(per-job tables, {sum(map(len, job_lines.values()))} lines: in jit.md and jit.json)"]
        lines.append("")
        for n, p in compared:
            moe_s = p["warmup_s_by_op"].get("moe") if n == "blocking" else p.get("moe_tuned_s")
            lines += compare_lines(n, p["compare"], moe_s if any(e["op"] == "moe" for e in p["compare"]["jobs"]) else None)
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------------------
def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", help="a Hugging Face config.json, or tiny / tiny-moe (default: Llama-3.1-8B; tiny on the CPU)")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--ops", default=",".join(OPS), help="the layers run (and tuned): linear, moe, comma-separated (default both)")
    p.add_argument("--m", help="M buckets (default 1..512 on the GPU, 1,2,4 on the CPU)")
    p.add_argument("--decode-m", default="1", help="decode token counts (comma-separated)")
    p.add_argument("--layers", type=int, help="copies of the linear layers (default: the model's layers; 1 on the CPU)")
    p.add_argument("--moe-layers", type=int, default=1,
                   help="copies of the MoE layers (default 1: each distinct MoE shape once is enough to tune it)")
    p.add_argument("--budget-s", type=float, help="each just-in-time job's time (default: autotune's)")
    p.add_argument("--worker-ahead-s", type=float, default=0.0, metavar="S",
                   help="blocking phase: start the tuning worker (autotune.start()) S seconds before the first "
                        "forward, as a program does before loading its model (default 0: on the first miss)")
    p.add_argument("--duty", type=float, help="the background worker's share of time measuring (default: autotune's)")
    p.add_argument("--reps", type=int, default=20, help="forward passes per timing window")
    p.add_argument("--rounds", type=int, default=5, help="timing windows per decode time")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="the background phase gives up then")
    p.add_argument("--offline-db", type=Path,
                   help="the offline-tuned rows (a DB or an export, e.g. tuning_db/nvidia-h200.json): the offline phase"
                        " decodes with them instead of tuning, and the JIT rows are compared with them")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="the phases to run, comma-separated (each fits a shorter run; default: all)")
    p.add_argument("--shipped", choices=("others", "none"), default="others",
                   help="shipped rows the phases see: the repository's without the model's own problems "
                        "(default), or none")
    p.add_argument("--kernel-cache", type=Path, metavar="DIR",
                   help="the blocking and background phases start from a copy of this kernel cache (warmed ahead"
                        " by `autofp4 cache --warm`; default: an empty one)")
    p.add_argument("--keep-kernel-cache", action="store_true", help="every phase uses the kernel cache as it is")
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the per-job comparison (JIT / offline / default rows graph-timed)")
    p.add_argument("--compare-rounds", type=int, help="interleaved rounds of the per-job timing (default 3; 1 on the CPU)")
    p.add_argument("--out", help="results directory (default: docs/results/<device>/)")
    args = p.parse_args(argv)
    on_cpu = torch.device(args.device).type == "cpu"
    args.m = [int(v) for v in args.m.split(",")] if args.m else list(CPU_MS if on_cpu else GPU_MS)
    args.decode_m = [int(v) for v in args.decode_m.split(",")]
    args.phases = [v for v in args.phases.split(",") if v]
    if not args.phases or set(args.phases) - set(PHASES):
        p.error(f"--phases: a comma-separated subset of {','.join(PHASES)}, got {args.phases}")
    args.ops = tuple(v for v in OPS if v in {o.strip() for o in args.ops.split(",")})
    if not args.ops:
        p.error(f"--ops: a comma-separated subset of {','.join(OPS)}")
    if args.kernel_cache is not None:
        if args.keep_kernel_cache:
            p.error("--kernel-cache and --keep-kernel-cache: give one")
        if not args.kernel_cache.is_dir():
            p.error(f"--kernel-cache {args.kernel_cache}: no such folder")
        args.kernel_cache = args.kernel_cache.resolve()
    if args.compare_rounds is None:
        args.compare_rounds = 1 if on_cpu else 3
    if args.compare_rounds < 1 or args.moe_layers < 1 or (args.layers is not None and args.layers < 1):
        p.error("--compare-rounds, --layers and --moe-layers must be >= 1")
    if not (0 <= args.worker_ahead_s <= 3600):
        p.error(f"--worker-ahead-s: seconds from 0 to 3600, got {args.worker_ahead_s}")
    return args


def _model(args, dev: torch.device) -> tuple[dict, str]:
    if args.model in TINY_MODELS:
        return TINY_MODELS[args.model], args.model
    if args.model:
        return load_config(args.model), args.model
    if dev.type == "cpu":
        return TINY, "tiny llama"
    return load_config(ROOT / "examples" / "llama-3.1-8b.json"), "llama-3.1-8b"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    config, model_name = _model(args, dev)
    shapes = [s for s in model_shapes(config, fmt=args.fmt) if s.op in args.ops]
    if not shapes:
        raise SystemExit(f"{model_name} has no {' or '.join(args.ops)} layers")
    copies = args.layers or (1 if dev.type == "cpu" else config["num_hidden_layers"])
    has_moe = any(s.op == "moe" for s in shapes)
    args.own_problems = {(k.op, k.n, k.k, k.experts, k.topk) for k in (s.problem_key(f, d) for s in shapes
                                                                     for f in ("nvfp4", "mxfp4")
                                                                     for d in ("bfloat16", "float16"))}
    stack = Stack(shapes, copies, args.fmt, dev, args.moe_layers)
    out = results_dir(args.out, dev)
    doc = {**provenance(dev), "model": model_name, "ops": list(args.ops),
           "shapes": [[s.name, s.n, s.k] + ([s.experts, s.topk] if s.op == "moe" else []) for s in shapes],
           "layers": copies if any(s.op == "linear" for s in shapes) else 0, "moe_layers": args.moe_layers if has_moe else 0,
           "m": args.m, "decode_m": args.decode_m,
           "kernel_cache": str(args.kernel_cache) if args.kernel_cache else ("kept" if args.keep_kernel_cache else "cold")}
    saved = {k: os.environ.get(k) for k in _PHASE_ENV}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-jit-", ignore_cleanup_errors=True) as work:  # compile workers may still write
            work = Path(work)
            # the rows the JIT rows are compared with: the offline phase's, else --offline-db's
            offline_src = args.offline_db.resolve() if args.offline_db else None
            for name in PHASES:
                if name not in args.phases:
                    continue
                print(f"{name} ...", file=sys.stderr)
                if name == "offline":
                    doc[name] = offline(stack, shapes, args, work)
                    offline_src = Path(doc[name]["db"])
                elif name == "blocking":
                    doc[name] = blocking(stack, args, work, offline_src)
                else:
                    doc[name] = background(stack, args, work, offline_src, shapes)
                print(json.dumps({name: doc[name]})[:2000], file=sys.stderr)  # kept if a later phase is cut short
    finally:
        dispatch.set_db(None)
        for k, v in saved.items():  # the caller's DB layers and kernel cache again
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    doc["derived"] = derive(doc)
    full = table(doc)
    jobs_n = sum(len(doc[p]["compare"]["jobs"]) + 4 for p in ("blocking", "background") if doc.get(p, {}).get("compare"))
    short = full if jobs_n <= PRINT_JOB_LINES else table(doc, per_job=False)
    stem = "jit" if args.phases == list(PHASES) else "jit-" + "-".join(args.phases)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / f"{stem}.md").write_text(f"{provenance_line(doc)}\n\n```\n{full}```\n")
    print(short)
    return 0


if __name__ == "__main__":
    sys.exit(main())
