"""The tuner: for each problem and M bucket, find the fastest correct config and store it.

Pipeline of one job ``(ProblemKey, M bucket)``
----------------------------------------------
1. **Candidates**: the union over the applicable backends (registry order) of
   ``backend.candidates(key)`` (``candidates(key, m)`` where a backend narrows its grid by
   M); the job's *default* (what the dispatcher runs untuned: the
   first applicable backend's ``default(key, M)``) comes first, then the stored winners of
   the job (a re-tune) and of its neighbours (the other formats at this M, this format at the
   nearest stored M buckets), then each backend's ``seeds`` (configs that won measurements
   near this shape). Configs already recorded as
   failed for this environment and kernel source are skipped without running.
2. **Search**: an optuna study. When the candidate list fits in the trial budget it is a
   grid: every candidate is enqueued in order (default first) and the storage hands each
   queued trial to exactly one process. Otherwise ``TPESampler`` (constant liar, the default
   and the seeds enqueued first, at most half the budget) samples one categorical parameter
   per config field (so it learns which
   tile sizes, stages, ... are fast); a sampled combination that is not a valid candidate
   runs its nearest candidate. The study may live in an RDB storage
   (``storage="sqlite:///study.db"``, a PostgreSQL URL, ...) shared by several processes or
   hosts: its name is derived from the environment key, the problem, the bucket and the
   candidate list; the first process creates and fills it, the others load it. With a
   persistent storage, a re-run (also with ``force``) reuses the measurements stored there.
3. **Trial**: compile (in a pool of spawned worker processes when ``workers > 0``, so
   compilation overlaps the serial GPU timing; the timing process re-creates the runner from
   the backend's warm cache), **check** against the reference backend on fresh random data
   (random weights quantized with :func:`autofp4.quantize`, random activations; relative
   Frobenius error ``||out - ref|| / ||ref||`` at most ``TOLERANCE[dtype]``: 1e-2 for
   bfloat16, 5e-3 for float16, non-finite outputs fail), then **time** it
   (:mod:`autofp4.timing`: CUDA events with cold-L2 argument rotation, a CUDA graph for
   kernels shorter than ``GRAPH_BELOW_US``; ``perf_counter`` on the CPU). Every trial is
   recorded (``ok``, ``compile_error``, ``runtime_fault``, ``wrong_result``, ``timeout``,
   ``invalid``). On the GPU each trial's check and timing run in one persistent worker
   process per GPU, restarted when it dies, hangs past ``trial_timeout_s`` or reports a CUDA
   fault, so a dead CUDA context only costs that worker.
4. **Choice**: the fastest correct candidate (ties: backend name, then config JSON) replaces
   the default only when :func:`~autofp4.timing.faster_beyond_noise` says so; otherwise the
   default is stored. When the default itself failed, the fastest correct candidate wins.

Runs are resumable (jobs that already have a result for this environment are skipped unless
``force``; every trial and result is written as soon as it is known, so Ctrl-C loses only
the trial in flight) and refine: a forced re-run tries the stored winner right after the
default, so it keeps it unless another config measures faster in the same run (and a job
whose share ends before the stored winner was measured again keeps its row: status ``kept``). A result
measured with an older source of its kernel is re-tuned, and its winner is tried right
after the default too (re-measured: a changed kernel usually keeps its best configs). They scale
out: ``gpus=[0, 1, ...]`` runs one job stream per GPU, and
several hosts can run the same command against one optuna storage and one shared DB.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import importlib
import inspect
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .backends import available_backends, get_backend
from .backends.base import Backend, BackendConfig, ProblemKey
from .dispatch import DEFAULT_M_BUCKETS, backend_source_hash, backend_source_hashes, is_stale, load_misses
from .schema import TuningRecord
from .timing import TimingStats, copies_for_cold_l2, faster_beyond_noise, l2_cache_bytes, time_cpu, time_cuda

__all__ = [
    "TOLERANCE",
    "CPU_M_BUCKETS",
    "Job",
    "JobResult",
    "TuneReport",
    "tune",
    "tune_jobs",
    "tune_from_misses",
    "jobs_for",
    "run_trial",
]

#: relative Frobenius error bound of a candidate's output vs. the reference backend's.
TOLERANCE: dict[str, float] = {"bfloat16": 1e-2, "float16": 5e-3}
#: M buckets tuned on the CPU (the reference backend; the CPU is a fallback, not a target).
CPU_M_BUCKETS: tuple[int, ...] = (1, 16, 128)
#: kernels faster than this (eager estimate) are timed by CUDA-graph replay.
GRAPH_BELOW_US = 200.0
#: calls slower than this are timed on two argument copies only (no cold-L2 rotation).
SLOW_CALL_US = 1000.0
#: the timed samples of one trial aim at this much GPU time (fewer reps for slow kernels).
TRIAL_TARGET_S = 2.0
#: but never fewer samples than this.
MIN_REPS = 5
#: relative gain a tuned config needs over the default, on top of the noise rule.
MIN_GAIN = 0.0


@dataclass(frozen=True)
class _Defaults:
    budget: int
    warmup: int
    reps: int
    trial_timeout_s: float
    time_budget_s: float | None  # wall clock of a whole run, shared fairly by its jobs


# 32 trials per job and 15 minutes per run: Llama-3.1-8B (4 shapes x 14 M buckets) fits
GPU_DEFAULTS = _Defaults(budget=32, warmup=10, reps=30, trial_timeout_s=300.0, time_budget_s=900.0)
# on the CPU the correctness check's call is the warm-up
CPU_DEFAULTS = _Defaults(budget=3, warmup=0, reps=3, trial_timeout_s=600.0, time_budget_s=None)


# -----------------------------------------------------------------------------------------
# public data
# -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One unit of tuning: a problem at one M bucket (``name``: the model's layer names)."""

    key: ProblemKey
    m: int
    name: str = ""


@dataclass
class JobResult:
    """What tuning one job found (``status``: tuned | skipped | kept | no_valid_config |
    interrupted | out_of_time; ``kept``: a forced re-tune that did not get to measure the
    stored winner again, whose row therefore stays)."""

    job: Job
    status: str
    backend: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    median_us: float | None = None
    spread_us: float | None = None
    default_backend: str = ""
    default_config: dict[str, Any] = field(default_factory=dict)
    default_us: float | None = None
    trials_run: int = 0
    trials_failed: int = 0
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.median_us and self.default_us:
            return self.default_us / self.median_us
        return None


@dataclass
class TuneReport:
    """Everything a tuning run did, one :class:`JobResult` per job, in job order."""

    device: str
    env_key: str
    results: list[JobResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def tuned(self) -> list[JobResult]:
        return [r for r in self.results if r.status == "tuned"]

    @property
    def trials_run(self) -> int:
        return sum(r.trials_run for r in self.results)

    @property
    def trials_failed(self) -> int:
        return sum(r.trials_failed for r in self.results)

    def table(self) -> str:
        """A fixed-width summary table (shape, N, K, E, topk, M, winner, times, speedup), then the
        note of every job that has one (what cut it short, why the default stayed, ...; the
        already tuned jobs aside)."""
        head = ("shape", "op", "N", "K", "E", "topk", "M", "status", "winner", "us", "default us", "speedup", "trials", "failed")
        rows = [head]
        for r in self.results:
            k = r.job.key
            cfg = json.dumps(r.config, sort_keys=True, separators=(",", ":")) if r.config else ""
            winner = f"{r.backend} {cfg}".strip()
            rows.append((
                r.job.name or "-", k.op, str(k.n), str(k.k),
                str(k.experts) if k.op == "moe" else "-", str(k.topk) if k.op == "moe" else "-",
                str(r.job.m), r.status, winner or "-",
                _fmt_us(r.median_us), _fmt_us(r.default_us),
                f"{r.speedup:.2f}x" if r.speedup else "-", str(r.trials_run), str(r.trials_failed),
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = []
        for j, row in enumerate(rows):
            cells = [c.ljust(w) if i in (0, 1, 7, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        notes = [f"  {r.job.name or r.job.key.op} N={r.job.key.n} K={r.job.key.k} M={r.job.m}: {r.note}"
                 for r in self.results if r.note and r.status != "skipped"]
        if notes:
            lines += ["", "notes:", *notes]
        return "\n".join(lines) + "\n"


def _fmt_us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


# -----------------------------------------------------------------------------------------
# backends by specification (so spawned processes can rebuild test or plug-in backends)
# -----------------------------------------------------------------------------------------
def _spec(b: Backend) -> str:
    return f"{type(b).__module__}:{type(b).__qualname__}"


_SPEC_CACHE: dict[tuple[str, str], Backend] = {}


def _backend_from(name: str, spec: str) -> Backend:
    b = _SPEC_CACHE.get((name, spec))
    if b is not None:
        return b
    try:
        b = get_backend(name)
        if _spec(b) != spec:
            b = None
    except (KeyError, ImportError):
        b = None
    if b is None:
        mod, qual = spec.split(":")
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        b = obj()
    _SPEC_CACHE[(name, spec)] = b
    return b


def _key_from(d: dict[str, Any]) -> ProblemKey:
    return ProblemKey(**d)


def _cfg_json(cfg: BackendConfig | dict[str, Any]) -> str:
    from .schema import config_json

    return _model_json(cfg) if isinstance(cfg, BackendConfig) else config_json(cfg)


@functools.lru_cache(maxsize=1 << 15)
def _model_json(cfg: BackendConfig) -> str:
    """The canonical JSON of a (frozen, hashable) config, remembered: every M bucket of a shape
    lists the same 10-18 thousand Hopper configs."""
    from .schema import config_json

    return config_json(cfg)


# -----------------------------------------------------------------------------------------
# one trial: data, check, time (runs in the timing process: in-process or a worker)
# -----------------------------------------------------------------------------------------
class _TrialData:
    """Random weights / activations / reference outputs of the job being tuned (one at a time)."""

    def __init__(self) -> None:
        self.ident: tuple | None = None
        self.weights: list[Any] = []  # per copy: FP4Weight (linear) or (w13, w2) (moe)
        self.prepared: dict[tuple[str, int], Any] = {}
        self.acts: dict[int, list[tuple]] = {}  # m -> per copy: (x, bias) or (x, tw, ti)
        self.refs: dict[int, torch.Tensor] = {}


_DATA = _TrialData()


def _random_fp4(shape: tuple[int, ...], fmt: str, device: torch.device, gen: torch.Generator) -> Any:
    """A random FP4 weight of ``shape`` (quantized in expert chunks to bound fp32 memory)."""
    from .formats import quantize
    from .weights import FP4Weight

    if len(shape) == 2:
        w = torch.randn(shape, generator=gen, device="cpu").to(device)
        return quantize(w, fmt)
    e, n, k = shape
    per = max(1, (1 << 27) // max(1, n * k))
    parts = []
    for s in range(0, e, per):
        c = min(per, e - s)
        w = torch.randn((c, n, k), generator=gen, device="cpu").to(device)
        parts.append(quantize(w, fmt))
        del w
    if len(parts) == 1:
        return parts[0]
    gs = None if parts[0].global_scale is None else torch.cat([p.global_scale for p in parts])
    return FP4Weight(
        fmt, torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), gs, check_values=False
    )


def _weights_for(key: ProblemKey, device: torch.device, gen: torch.Generator) -> Any:
    if key.op == "linear":
        return _random_fp4((key.n, key.k), key.fmt, device, gen)
    inter = key.n // 2
    return (
        _random_fp4((key.experts, key.n, key.k), key.fmt, device, gen),
        _random_fp4((key.experts, key.k, inter), key.fmt, device, gen),
    )


def _weight_bytes(w: Any) -> int:
    ws = w if isinstance(w, tuple) else (w,)
    return sum(x.nbytes for x in ws)


def _acts_for(key: ProblemKey, m: int, device: torch.device, gen: torch.Generator) -> tuple:
    dt = key.torch_dtype
    x = torch.randn((m, key.k), generator=gen).to(device=device, dtype=dt)
    if key.op == "linear":
        bias = torch.randn((key.n,), generator=gen).to(device=device, dtype=dt)
        return (x, bias)
    logits = torch.randn((m, key.experts), generator=gen)
    tw, ti = torch.topk(torch.softmax(logits, dim=-1), key.topk, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).float().to(device)
    return (x, tw, ti.to(torch.int32).to(device))


def _call(key: ProblemKey, runner: Callable, prepared: Any, act: tuple, with_bias: bool = True) -> torch.Tensor:
    if key.op == "linear":
        x, bias = act
        return runner(x, prepared, bias if with_bias else None)
    x, tw, ti = act
    p13, p2 = prepared
    return runner(x, p13, p2, tw, ti, "silu")


def _prepare(b: Backend, w: Any) -> Any:
    if isinstance(w, tuple):
        return tuple(wi.packed(b.name, b.prepare) for wi in w)
    return w.packed(b.name, b.prepare)


#: the rotated weight copies of one job never take more device memory than this.
ROTATION_MAX_BYTES = 16 * 2**30


def _copies(key: ProblemKey, m: int, weight_bytes: int, device: torch.device) -> int:
    """Argument copies that make one rotation read more than twice the L2 (cold-L2 timing).

    A MoE call reads only the experts its tokens are routed to: about
    ``min(E, m * topk) / E`` of the weights.
    """
    touched = weight_bytes
    if key.op == "moe":
        touched = max(1, weight_bytes * min(key.experts, m * key.topk) // key.experts)
    per = touched + 2 * m * key.k
    n = copies_for_cold_l2(per, l2_cache_bytes(device))
    return max(1, min(n, ROTATION_MAX_BYTES // max(1, weight_bytes)))


def _setup_data(key: ProblemKey, m: int, seed: int, device: torch.device, copies_hint: bool) -> _TrialData:
    d = _DATA
    ident = (key, seed, str(device))
    if d.ident != ident:
        d.ident = None
        d.weights, d.prepared, d.acts, d.refs = [], {}, {}, {}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        gen = torch.Generator().manual_seed(seed)
        d.weights.append(_weights_for(key, device, gen))
        if device.type == "cuda" and copies_hint:
            for _ in range(_copies(key, m, _weight_bytes(d.weights[0]), device) - 1):
                d.weights.append(_weights_for(key, device, gen))
        d.ident = ident
    if m not in d.acts:
        gen = torch.Generator().manual_seed(seed * 7919 + m)
        d.acts[m] = [_acts_for(key, m, device, gen) for _ in d.weights]
        ref = get_backend("reference")
        runner = ref.compile(ref.default(key, m), key)
        d.refs[m] = _call(key, runner, _prepare(ref, d.weights[0]), d.acts[m][0])
    return d


def _timing_plan(pass_us: float, warmup: int, reps: int) -> tuple[int, int]:
    """``(warmup, reps)`` so that the samples take about ``TRIAL_TARGET_S`` (``pass_us``: one
    pass over the argument copies), between ``MIN_REPS`` and the requested ``reps``."""
    fit = int(TRIAL_TARGET_S * 1e6 / max(pass_us, 1e-3))
    r = max(min(MIN_REPS, reps), min(reps, fit))
    return min(warmup, max(1, r // 3)), r


def _check(out: Any, ref: torch.Tensor, dtype: str) -> str | None:
    """``None`` when ``out`` matches ``ref`` within ``TOLERANCE[dtype]``, else why not."""
    if not isinstance(out, torch.Tensor):
        return f"runner returned {type(out).__name__}, expected a tensor"
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        return f"output is {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    if not torch.isfinite(o).all():
        return f"output has {int((~torch.isfinite(o)).sum())} non-finite values"
    denom = float(torch.linalg.vector_norm(r)) or 1.0
    err = float(torch.linalg.vector_norm(o - r)) / denom
    tol = TOLERANCE[dtype]
    if not err <= tol:
        return f"relative Frobenius error {err:.3e} exceeds {tol:.0e} ({dtype})"
    return None


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        f = tb[-1]
        text += f" [{Path(f.filename).name}:{f.lineno}]"
    return text[:1900]


def _is_cuda_fault(e: BaseException) -> bool:
    s = str(e)
    return any(t in s for t in ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure", "CUBLAS_STATUS"))


def run_trial(req: dict[str, Any]) -> dict[str, Any]:
    """Compile, check and time one candidate; never raises (the outcome says what happened).

    ``req``: ``backend``, ``spec``, ``config`` (JSON), ``key`` (dict), ``m``, ``seed``,
    ``device``, ``warmup``, ``reps``, ``graph`` (allow CUDA graphs). Returns ``outcome``,
    ``median_us``, ``spread_us``, ``samples``, ``error`` and ``fatal`` (the CUDA context
    may be dead: restart the process).
    """
    res: dict[str, Any] = {"outcome": "ok", "median_us": None, "spread_us": None, "samples": 0, "error": "", "fatal": False}
    device = torch.device(req["device"])
    try:
        key = _key_from(req["key"])
        b = _backend_from(req["backend"], req["spec"])
        cfg = b.parse_config(json.loads(req["config"]))
        reason = b.is_valid(cfg, key)
    except Exception as e:
        return {**res, "outcome": "invalid", "error": _short_error(e)}
    if reason:
        return {**res, "outcome": "invalid", "error": reason}
    m = int(req["m"])
    try:
        runner = b.compile(cfg, key)
    except Exception as e:
        return {**res, "outcome": "compile_error", "error": _short_error(e)}
    stage = "preparing data"
    try:
        t_setup = time.perf_counter()
        d = _setup_data(key, m, int(req["seed"]), device, copies_hint=True)
        stage = "preparing the weight"
        prepared = [_prepare(b, w) for w in d.weights]
        # one-off work (random weights for a new problem, a layout packed for a new kernel):
        # the job's time share must not take it for the cost of every trial
        res["setup_s"] = time.perf_counter() - t_setup
        stage = "running"
        out = _call(key, runner, prepared[0], d.acts[m][0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        why = _check(out, d.refs[m], key.dtype)
        if why:
            return {**res, "outcome": "wrong_result", "error": why}
        stage = "timing"
        args = [(p, a) for p, a in zip(prepared, d.acts[m])]

        def fn(p: Any, a: tuple) -> Any:
            return _call(key, runner, p, a, with_bias=False)

        if device.type == "cuda":
            est = time_cuda(fn, args[:1], warmup=1, reps=3, use_graph=False)
            if est.median_us > SLOW_CALL_US:  # L2 reuse is noise next to such a call
                args = args[:2]
            warmup, reps = _timing_plan(est.median_us * len(args), req["warmup"], req["reps"])
            st: TimingStats | None = None
            if req.get("graph", True) and est.median_us < GRAPH_BELOW_US:
                try:
                    with warnings.catch_warnings():  # a failed capture warns "graph is empty"
                        warnings.simplefilter("ignore", UserWarning)
                        st = time_cuda(fn, args, warmup=warmup, reps=reps, use_graph=True)
                except Exception as ge:  # not capturable (host syncs): time eagerly
                    if _is_cuda_fault(ge):
                        raise
                    torch.cuda.synchronize(device)
                    st = None
            if st is None:
                st = time_cuda(fn, args, warmup=warmup, reps=reps, use_graph=False)
        else:
            st = time_cpu(fn, args, warmup=req["warmup"], reps=req["reps"])
    except Exception as e:
        fatal = device.type == "cuda" and _is_cuda_fault(e)
        return {**res, "outcome": "runtime_fault", "error": f"{stage}: {_short_error(e)}", "fatal": fatal}
    if not (st.median_us > 0 and math.isfinite(st.median_us)):
        return {**res, "outcome": "runtime_fault", "error": f"timing returned {st.median_us} us"}
    return {**res, "median_us": st.median_us, "spread_us": st.spread_us, "samples": st.samples}


def _preload_compiler() -> None:
    """Import the GPU backends' kernel compiler (seconds) before a process's first request."""
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        pass


def _pool_init(arch: str) -> None:
    """Compile workers target the tuned GPU without opening a CUDA context of their own."""
    if arch and arch != "unknown":
        os.environ.setdefault("CUTE_DSL_ARCH", arch)
        _preload_compiler()


def _pool_ready(_: int) -> int:
    time.sleep(0.5)  # held a moment: the other requests go to the processes starting meanwhile
    return os.getpid()


def _start_pool(pool: cf.ProcessPoolExecutor, workers: int) -> int:
    """Start every compile worker (spawn, imports) now, before the first job's clock starts:
    otherwise the first job's share of the time budget pays for it (its first compile waited
    for the pool, and it ended after one trial). Returns the number of worker processes."""
    return len(set(pool.map(_pool_ready, range(workers))))


def _compile_only(req: dict[str, Any]) -> str | None:
    """Compile a candidate in a pool process; the error or None. The compiled kernels land in
    the disk kernel cache (``autofp4.kernel_cache``), where the timing process loads them."""
    try:
        b = _backend_from(req["backend"], req["spec"])
        key = _key_from(req["key"])
        cfg = b.parse_config(json.loads(req["config"]))
        reason = b.is_valid(cfg, key)
        if reason:
            return f"invalid: {reason}"
        compile_all = getattr(b, "compile_only", None)  # every variant a trial runs (bias too)
        if compile_all is not None:
            compile_all(cfg, key)
        else:
            b.compile(cfg, key)
        return None
    except Exception as e:
        return _short_error(e)


# -----------------------------------------------------------------------------------------
# the timing process: in-process, or a persistent child per device
# -----------------------------------------------------------------------------------------
def _worker_main(conn: Any, device: str, sys_path: list[str]) -> None:  # pragma: no cover - child
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
    from . import formats, weights  # noqa: F401  (imported before the first trial's clock starts)
    from .backends import reference  # noqa: F401

    if dev.type == "cuda":
        _preload_compiler()

    conn.send("ready")
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        if req is None:
            return
        conn.send(run_trial(req))


class _Measurer:
    """Runs trials; ``isolate`` puts them in a child process restarted after a fault or hang."""

    def __init__(self, device: torch.device, isolate: bool, timeout_s: float) -> None:
        self.device = device
        self.isolate = isolate
        self.timeout_s = timeout_s
        self.proc: Any = None
        self.conn: Any = None
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(child, str(self.device), list(sys.path)), daemon=True)
        p.start()
        child.close()
        if not parent.poll(max(120.0, self.timeout_s)):
            p.kill()
            raise RuntimeError(f"the timing worker for {self.device} did not start")
        try:
            if parent.recv() != "ready":
                raise RuntimeError("unexpected handshake")
        except EOFError:
            raise RuntimeError(f"the timing worker for {self.device} died while starting (exit code {p.exitcode})") from None
        self.proc, self.conn = p, parent

    def _stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        finally:
            try:
                self.conn.close()
            except OSError:
                pass
            self.proc, self.conn = None, None

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        if not self.isolate:
            return run_trial(req)
        start_s = 0.0
        if self.proc is None or not self.proc.is_alive():
            self._stop()
            t0 = time.perf_counter()
            self._start()
            start_s = time.perf_counter() - t0  # a one-off: the trial reports it as setup
        try:
            self.conn.send(req)
            if not self.conn.poll(self.timeout_s):
                self._stop()
                self.restarts += 1
                return {"outcome": "timeout", "error": f"no answer within {self.timeout_s:.0f} s; worker restarted"}
            res = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.exitcode if self.proc is not None else None
            if self.proc is not None:
                self.proc.join(5)
                code = self.proc.exitcode
            self._stop()
            self.restarts += 1
            return {"outcome": "runtime_fault", "error": f"the timing worker process died (exit code {code}); restarted"}
        if res.get("fatal"):
            self._stop()
            self.restarts += 1
        if start_s:
            res["setup_s"] = res.get("setup_s", 0.0) + start_s
        return res

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (OSError, BrokenPipeError):
                pass
        self._stop()


# -----------------------------------------------------------------------------------------
# jobs and candidates
# -----------------------------------------------------------------------------------------
def jobs_for(
    shapes: Iterable[Any], m_buckets: Sequence[int], fmt: str = "nvfp4", dtype: str = "bfloat16"
) -> list[Job]:
    """One :class:`Job` per (shape, M bucket); shapes are ModelShapes or ProblemKeys."""
    out: list[Job] = []
    seen: set[tuple[ProblemKey, int]] = set()
    for s in shapes:
        if isinstance(s, ProblemKey):
            key, name = s, ""
        elif hasattr(s, "problem_key"):
            key, name = s.problem_key(fmt, dtype), getattr(s, "name", "")
        else:
            raise TypeError(f"expected a ModelShape or a ProblemKey, got {type(s).__name__}")
        for m in m_buckets:
            if (key, m) not in seen:
                seen.add((key, m))
                out.append(Job(key, int(m), name))
    return out


@dataclass(frozen=True)
class _Cand:
    backend: Backend
    config: BackendConfig
    config_json: str
    first: bool = False  # the job's default or a backend's seed: tried before sampling
    prior: bool = False  # a winner stored by an earlier run: measured even past the job's time share

    @property
    def ident(self) -> str:
        return f"{self.backend.name}:{self.config_json}"


def _valid_defaults(key: ProblemKey, m: int, backends: Sequence[Backend]) -> Iterator[_Cand]:
    """Each backend's default config for ``(key, m)`` where valid, in backend order: the first
    is every job's first trial."""
    for b in backends:
        cfg = b.default(key, m)
        if b.is_valid(cfg, key) is None:
            yield _Cand(b, cfg, _cfg_json(cfg), first=True)


def _sibling_records(recs: Iterable[TuningRecord], key: ProblemKey, m: int) -> list[TuningRecord]:
    """Among ``recs`` (one environment's rows), the winners of the jobs nearest to ``(key, m)``:
    the same problem in the other formats at the same M bucket, then in the same format at the
    nearest stored M buckets below and above. Configs do not name the format or M, and the
    winner of a neighbour is a better first guess than a random sample."""
    same = [r for r in recs if (r.op, r.dtype, r.n, r.k, r.experts, r.topk)
            == (key.op, key.dtype, key.n, key.k, key.experts, key.topk)]
    out = [r for r in same if r.fmt != key.fmt and r.m_bucket == m]
    mine = {r.m_bucket for r in same if r.fmt == key.fmt}
    near = [max((b for b in mine if b < m), default=None), min((b for b in mine if b > m), default=None)]
    out += [r for b in near if b is not None for r in same if r.fmt == key.fmt and r.m_bucket == b]
    return out


def _first_candidates(
    key: ProblemKey, m: int, backends: Sequence[Backend], stored: Sequence[tuple[Backend, BackendConfig]] = (),
    seeds: int | None = None, siblings: Sequence[tuple[Backend, BackendConfig]] = (),
) -> Iterator[_Cand]:
    """The configs a job tries before any search, in order, valid ones only (repeats possible):
    the first backend's default, the ``stored`` winners of an earlier run (a re-tune starts from
    them), each followed by its backend's ``variants`` of it, the winners of neighbouring jobs
    (``siblings``: :func:`_sibling_records`), the other backends' defaults, then each backend's
    seeds (its first ``seeds``)."""
    defaults = list(_valid_defaults(key, m, backends))
    yield from defaults[:1]
    for b, cfg in stored:
        for c in (cfg, *b.variants(cfg, key, m)):
            if b.is_valid(c, key) is None:
                yield _Cand(b, c, _cfg_json(c), first=True, prior=c is cfg)
    for b, cfg in siblings:
        if b.is_valid(cfg, key) is None:
            yield _Cand(b, cfg, _cfg_json(cfg), first=True)
    yield from defaults[1:]
    for b in backends:
        for cfg in list(b.seeds(key, m))[:seeds]:
            if b.is_valid(cfg, key) is None:
                yield _Cand(b, cfg, _cfg_json(cfg), first=True)


def _candidates(
    key: ProblemKey, m: int, backends: Sequence[Backend], stored: Sequence[tuple[Backend, BackendConfig]] = (),
    siblings: Sequence[tuple[Backend, BackendConfig]] = (),
) -> list[_Cand]:
    """:func:`_first_candidates` (marked ``first``: tried before the search samples), then
    every backend's candidates (valid ones: ``Backend.candidates`` checks them, so they are not
    checked twice)."""
    out: list[_Cand] = []
    seen: set[str] = set()

    def add(c: _Cand) -> None:
        if c.ident not in seen:
            seen.add(c.ident)
            out.append(c)

    for c in _first_candidates(key, m, backends, stored, siblings=siblings):
        add(c)
    for b in backends:
        for cfg in _backend_candidates(b, key, m):
            add(_Cand(b, cfg, _cfg_json(cfg)))
    return out


def _backend_candidates(b: Backend, key: ProblemKey, m: int) -> list[BackendConfig]:
    """``b.candidates(key, m)`` where the backend narrows its grid by M, else ``candidates(key)``."""
    try:
        takes_m = "m" in inspect.signature(b.candidates).parameters
    except (TypeError, ValueError):
        takes_m = False
    return list(b.candidates(key, m=m) if takes_m else b.candidates(key))


def _applicable(key: ProblemKey, backends: Sequence[Backend], reference_as_fallback: bool = False) -> list[Backend]:
    """The backends that support ``key``. With ``reference_as_fallback`` (backends chosen
    automatically) the reference backend, the correctness oracle, is only a candidate where
    no other backend supports the key: it would cost a trial per job and never win."""
    out = [b for b in backends if b.supports(key) is None]
    if reference_as_fallback and any(b.name != "reference" for b in out):
        out = [b for b in out if b.name != "reference"]
    return out


# -----------------------------------------------------------------------------------------
# the driver
# -----------------------------------------------------------------------------------------
@dataclass
class _Ctx:
    device: torch.device
    env: Any
    env_key: str
    backends: list[Backend]
    budget: int
    warmup: int
    reps: int
    deadline: float | None
    force: bool
    storage: Any  # None (in memory) or one optuna RDBStorage shared by the run's job streams
    ask_lock: str | None  # SQLite storage: a lock file that serializes study.ask() across processes
    window: int
    pool: cf.ProcessPoolExecutor | None
    compile_timeout_s: float
    stop: threading.Event
    pbar: Any
    lock: threading.Lock
    seed: int
    streams: int = 1  # job streams (devices) sharing the run's time budget
    reference_as_fallback: bool = False  # backends chosen automatically: see _applicable
    job_deadline: float | None = None  # this stream's current job stops asking for trials here
    jobs_after: int = 0  # jobs queued behind the current one when it started
    trial_s: list[float] = field(default_factory=list)  # this stream's trials: wall time, setup excluded


def _study_name(ctx: _Ctx, job: Job, cands: Sequence[_Cand]) -> str:
    h = hashlib.sha256("\n".join(c.ident for c in cands).encode()).hexdigest()[:10]
    k = job.key
    return f"autofp4-{ctx.env_key}-{k.op}-{k.fmt}-{k.dtype}-n{k.n}-k{k.k}-e{k.experts}-t{k.topk}-m{job.m}-{h}"


def _stored_results(db: Any, ctx: _Ctx, key: ProblemKey, m: int, backends: list[Backend]
                    ) -> tuple[list[TuningRecord], list[TuningRecord], list[TuningRecord]]:
    """This environment's results for the job: those measured with the current source of their
    config's kernel, the stale ones (an older source: the job runs again, but their winners
    are still the best first guesses of the new run), and the rows of the same problem in every
    format and M bucket (for :func:`_sibling_records`). One query."""
    by_name = {b.name: b for b in backends}
    problem = db.results(ctx.env_key, op=key.op, dtype=key.dtype, backend=list(by_name), n=key.n, k=key.k,
                         experts=key.experts, topk=key.topk)
    recs = [r for r in problem if r.fmt == key.fmt and r.m_bucket == m]
    stale = [is_stale(r, by_name[r.backend]) for r in recs]
    return [r for r, s in zip(recs, stale) if not s], [r for r, s in zip(recs, stale) if s], problem


def _parsed(recs: Iterable[TuningRecord], backends: Sequence[Backend]) -> list[tuple[Backend, BackendConfig]]:
    """The records' configs, parsed by their backends (among ``backends``; records of other
    backends and configs that no longer parse are left out)."""
    by_name = {b.name: b for b in backends}
    out = []
    for r in recs:
        try:
            out.append((by_name[r.backend], by_name[r.backend].parse_config(r.config)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _record_trial(db: Any, ctx: _Ctx, job: Job, cand: _Cand, res: dict[str, Any]) -> None:
    from .schema import TrialRecord

    k = job.key
    ok = res["outcome"] == "ok"
    config = json.loads(cand.config_json)
    tr = TrialRecord(
        op=k.op, fmt=k.fmt, dtype=k.dtype, backend=cand.backend.name, m_bucket=job.m,
        n=k.n, k=k.k, experts=k.experts, topk=k.topk, m=job.m,
        config=config, outcome=res["outcome"],
        median_us=res.get("median_us") if ok else None,
        spread_us=res.get("spread_us") if ok else None,
        error=str(res.get("error") or ""), env_key=ctx.env_key,
        backend_source=backend_source_hash(cand.backend, config),
    )
    db.add_trial(tr)


def _request(ctx: _Ctx, job: Job, cand: _Cand, seed: int) -> dict[str, Any]:
    return {
        "backend": cand.backend.name, "spec": _spec(cand.backend), "config": cand.config_json,
        "key": asdict(job.key), "m": job.m, "seed": seed, "device": str(ctx.device),
        "warmup": ctx.warmup, "reps": ctx.reps, "graph": True,
    }


def _prefetch_default(ctx: _Ctx, job: Job) -> None:
    """Queue the compile of ``job``'s default config (its first trial) in the compile pool, so
    that it is in the kernel cache when the job starts instead of the GPU waiting for it."""
    if ctx.pool is None:
        return
    backends = _applicable(job.key, ctx.backends, ctx.reference_as_fallback)
    first = next(_valid_defaults(job.key, job.m, backends), None)
    if first is not None:
        ctx.pool.submit(_compile_only, _request(ctx, job, first, ctx.seed))


def _now() -> float:
    """The clock of time budgets and shares (monotonic seconds)."""
    return time.monotonic()


def job_share_deadline(now: float, deadline: float | None, jobs_left: int, streams: int = 1) -> float | None:
    """When a job that starts ``now`` should stop asking for trials: an equal share of the time
    left among the ``jobs_left`` jobs (this one included) that ``streams`` streams still run.
    Time a job does not use (it ran out of candidates) goes to the jobs after it."""
    if deadline is None:
        return None
    left = max(0.0, deadline - now)
    return now + left * max(1, streams) / max(1, jobs_left)


def setup_cap(deadline: float | None, jobs_after: int, trial_s: Sequence[float], streams: int = 1) -> float | None:
    """The latest a job may stretch its share to for one-off setup (a problem's random weights,
    a layout packed for a new kernel): the run's deadline less one mean trial for every job
    queued behind it (per stream), so that those still get their first measurement (uncapped
    setup is the likely reason why the last two jobs of one 70B tuning run got no trial)."""
    if deadline is None:
        return None
    mean = sum(trial_s) / len(trial_s) if trial_s else 0.0
    return deadline - mean * jobs_after / max(1, streams)


def trial_estimate(run_s: Sequence[float], wait_s: Sequence[float], compiled: bool) -> float:
    """Expected wall time of a job's next trial: the mean time of measuring one, plus the mean
    wait for a compile worker when its kernel is not compiled yet.

    ``run_s`` leaves out the one-off setup a trial reports as ``setup_s`` (the first job of every
    problem builds its random weights, which ended every M = 1 job of the Llama shapes after one
    trial on the H200); the job's share is extended by that time instead. The workers compile a
    job's first candidates together, so the first trial's wait (a cold compile) is usually the
    only one; counting it in every estimate stopped jobs after one trial."""
    est = sum(run_s) / len(run_s)
    if not compiled and wait_s:
        est += sum(wait_s) / len(wait_s)
    return est


def _out_of_time(ctx: _Ctx) -> bool:
    return ctx.stop.is_set() or (ctx.deadline is not None and _now() >= ctx.deadline)


class _FieldSpace:
    """The candidates as one categorical parameter per config field, for TPE.

    TPE learns per field value (tile sizes, stages, ...) instead of per opaque index. A
    sampled combination that is not a candidate maps to the nearest candidate (fewest
    differing fields, then candidate order); the trial keeps the sampled parameters.
    Fields a candidate does not have read ``"-"``; values are JSON text.
    """

    def __init__(self, cands: Sequence[_Cand]) -> None:
        dicts = [{"backend": c.backend.name, **json.loads(c.config_json)} for c in cands]
        names = sorted({n for d in dicts for n in d} - {"backend"})
        self.names = ["backend", *names]
        self.rows = [
            tuple(json.dumps(d[n], sort_keys=True) if n in d else "-" for n in self.names) for d in dicts
        ]
        self.choices = {n: sorted({r[i] for r in self.rows}) for i, n in enumerate(self.names)}
        self.index: dict[tuple, int] = {}
        for i, r in enumerate(self.rows):
            self.index.setdefault(r, i)

    def params_of(self, i: int) -> dict[str, str]:
        return {f"f:{n}": v for n, v in zip(self.names, self.rows[i])}

    def sample(self, trial: Any) -> int:
        vals = tuple(trial.suggest_categorical(f"f:{n}", self.choices[n]) for n in self.names)
        i = self.index.get(vals)
        if i is not None:
            return i
        return min(range(len(self.rows)), key=lambda j: (sum(a != b for a, b in zip(vals, self.rows[j])), j))


def _open_storage(url: str | None) -> Any:
    """One optuna RDB storage for the whole run (SQLite: waits up to 60 s for peers' locks)."""
    if url is None:
        return None
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    for attempt in range(6):  # peers may create the tables (and schema version) at once
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as e:
            if attempt == 5:
                raise ValueError(f"cannot open the optuna storage {url!r}: {e}") from None
            time.sleep(0.3 * (attempt + 1))
    return None  # not reached


def _ask_lock_path(url: str | None) -> str | None:
    """SQLite ignores optuna's ``SELECT ... FOR UPDATE``, so two processes can pop the same
    waiting trial; a lock file beside the database serializes ``ask`` on its host."""
    if not url or not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else path + ".ask.lock"


def _ask(ctx: _Ctx, study: Any) -> Any:
    if ctx.ask_lock is None:
        return study.ask()
    import fcntl

    with open(ctx.ask_lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        return study.ask()


def _make_study(ctx: _Ctx, job: Job, cands: Sequence[_Cand]) -> tuple[Any, _FieldSpace | None]:
    """The job's optuna study and, when TPE samples it, its field space (None: the grid)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    n = len(cands)
    grid = n <= ctx.budget
    if grid:
        # The grid is the queue of enqueued trials, in candidate order (default first); the
        # storage hands each waiting trial to exactly one process.
        sampler: Any = optuna.samplers.RandomSampler(seed=int.from_bytes(os.urandom(4), "little"))
    else:
        sampler = optuna.samplers.TPESampler(
            constant_liar=True, n_startup_trials=max(4, min(16, ctx.budget // 4)), seed=int.from_bytes(os.urandom(4), "little")
        )
    name = _study_name(ctx, job, cands)
    created = False
    for attempt in range(5):  # peers may create the same study (or the tables) at once
        try:
            try:
                study = optuna.create_study(study_name=name, storage=ctx.storage, sampler=sampler, direction="minimize")
                created = True
            except optuna.exceptions.DuplicatedStudyError:
                study = optuna.load_study(study_name=name, storage=ctx.storage, sampler=sampler)
            break
        except Exception:
            if ctx.storage is None or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    if not grid:  # TPE: the default and the seeds go first (peers skip those already queued)
        space = _FieldSpace(cands)
        firsts = [i for i, c in enumerate(cands) if c.first][: max(1, ctx.budget // 2)]
        for i in firsts:
            study.enqueue_trial(space.params_of(i), skip_if_exists=True)
        return study, space
    want = list(range(n))
    if not created:
        # the creator enqueues the grid right after creating the study: give it a moment,
        # then enqueue whatever is still missing (a creator that died half-way)
        limit = time.monotonic() + 10.0
        while time.monotonic() < limit and len(study.get_trials(deepcopy=False)) < len(want):
            time.sleep(0.05)
        have = {t.params.get("cand", t.system_attrs.get("fixed_params", {}).get("cand"))
                for t in study.get_trials(deepcopy=False)}
        want = [i for i in want if i not in have]
    for i in want:
        study.enqueue_trial({"cand": i}, skip_if_exists=True)
    return study, None


def _was_enqueued(study: Any, trial: Any) -> bool:
    """Did ``study.ask()`` hand out an enqueued (grid) trial rather than sample a new one?"""
    for t in study.get_trials(deepcopy=False):
        if t.number == trial.number:
            return "fixed_params" in t.system_attrs
    return False


def _finished(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.FAIL)]


def _started(study: Any, stale_s: float) -> int:
    """Trials finished, plus those running for less than ``stale_s`` (older ones are dead)."""
    import datetime as _dt

    from optuna.trial import TrialState

    now = _dt.datetime.now()
    n = 0
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.FAIL):
            n += 1
        elif t.state == TrialState.RUNNING:
            start = t.datetime_start
            if start is None or (now - start).total_seconds() < 2 * stale_s:
                n += 1
    return n


def _tune_job(job: Job, ctx: _Ctx, db: Any, meas: _Measurer, then: Job | None = None) -> JobResult:
    """Tune one (key, M bucket). ``then``: the job that follows on this stream; its default
    config is sent to the compile workers right after this job's first candidates."""
    from optuna.trial import TrialState

    key = job.key
    backends = _applicable(key, ctx.backends, ctx.reference_as_fallback)
    if not backends:
        why = "; ".join(f"{b.name}: {b.supports(key)}" for b in ctx.backends)
        return JobResult(job, "no_valid_config", note=f"no selected backend supports it ({why})")
    current, stale, problem = _stored_results(db, ctx, key, job.m, backends)
    if current and not ctx.force:
        return JobResult(job, "skipped", note="already tuned for this environment")
    cands = _candidates(key, job.m, backends, _parsed(current + stale, backends),
                        _parsed(_sibling_records(problem, key, job.m), backends))
    if not cands:
        return JobResult(job, "no_valid_config", note="no valid candidate config")
    default = cands[0]
    failed: set[str] = set()
    for b in backends:
        for cj in db.failed_configs(
            key.op, key.fmt, key.dtype, b.name, None, key.n, key.k, key.experts, key.topk,
            ctx.env_key, backend_source=backend_source_hashes(b),
        ):
            failed.add(f"{b.name}:{cj}")
    study, space = _make_study(ctx, job, cands)
    grid = space is None
    choices = list(range(len(cands)))
    seed = ctx.seed  # one per run: the M buckets of a problem share its random weights
    result = JobResult(
        job, "tuned", default_backend=default.backend.name, default_config=json.loads(default.config_json)
    )
    inflight: deque[tuple[Any, _Cand, cf.Future | None]] = deque()
    asked = 0
    max_asks = 4 * ctx.budget + len(cands)
    measured_here: dict[str, dict[str, Any]] = {}

    run_s: list[float] = []  # per trial measured here: the time spent measuring it
    wait_s: list[float] = []  # and the time spent waiting for its compile worker
    stop_why = ""  # what ended the job at its share of the time (empty: it was not): said in its note

    def has_result() -> bool:
        return any(r["outcome"] == "ok" for r in measured_here.values())

    priors = [c.ident for c in cands if c.prior]
    # the winners stored for this environment and kernel source (only a forced re-tune gets here
    # with some): a pick that was not measured against them in this run does not replace them
    current_rows = {_Cand(b, cfg, _cfg_json(cfg)).ident: r for r in current for b, cfg in _parsed([r], backends)}

    def priors_left() -> bool:
        """Is a stored winner (the best evidence an earlier run left) not measured yet?"""
        return any(i not in measured_here and i not in failed for i in priors)

    def share_used(compiled: bool = False) -> bool:
        """With a result in hand, would one more trial (its kernel ``compiled`` already or not)
        end past this job's share of the time? A stored winner not measured yet (it comes right
        after the default) may take longer, as far as the run's deadline still leaves one trial
        for every job after this one: a short share must not reduce a re-tune to the default."""
        if ctx.job_deadline is None or not run_s or not has_result():
            return False
        end = _now() + trial_estimate(run_s, wait_s, compiled)
        if priors_left():
            cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams)
            return cap is not None and end > max(ctx.job_deadline, cap)
        return end > ctx.job_deadline

    def executed() -> int:
        return sum(1 for t in _finished(study) if t.user_attrs.get("executed"))

    def exhausted() -> bool:
        if grid:  # no grid point left waiting (all finished or being measured somewhere)
            return not study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return executed() + len(inflight) >= ctx.budget or asked >= max_asks

    def why_share(compiled: bool) -> str:
        est = trial_estimate(run_s, wait_s, compiled)
        return (f"the next trial, about {est:.2f} s by this job's mean of {len(run_s)} measured"
                + (f" and {len(wait_s)} compile waits" if wait_s and not compiled else "")
                + ", would have ended past it")

    def refill() -> None:
        nonlocal asked
        nonlocal stop_why
        while len(inflight) < ctx.window and not exhausted() and not _out_of_time(ctx):
            if share_used():
                stop_why = stop_why or why_share(False)
                break
            trial = _ask(ctx, study)
            asked += 1
            if grid and not _was_enqueued(study, trial):  # a peer took the last point
                trial.set_user_attr("outcome", "unused")
                study.tell(trial, state=TrialState.FAIL)
                break
            if space is None:
                cand = cands[trial.suggest_categorical("cand", choices)]
            else:
                cand = cands[space.sample(trial)]
            trial.set_user_attr("ident", cand.ident)
            if cand.ident in failed:
                trial.set_user_attr("outcome", "known_failed")
                study.tell(trial, state=TrialState.FAIL)
                continue
            prev = measured_here.get(cand.ident)
            if prev is not None:  # TPE asked for a point it already has
                if prev["outcome"] == "ok":
                    study.tell(trial, prev["median_us"])
                else:
                    study.tell(trial, state=TrialState.FAIL)
                continue
            fut = None
            if ctx.pool is not None:
                fut = ctx.pool.submit(_compile_only, _request(ctx, job, cand, seed))
            inflight.append((trial, cand, fut))

    try:
        refill()
        if then is not None:
            _prefetch_default(ctx, then)
        while inflight:
            trial, cand, fut = inflight.popleft()
            ready = fut is None or fut.done()
            late = _out_of_time(ctx)
            if late or share_used(compiled=ready):
                if not late:
                    stop_why = stop_why or why_share(ready)
                if fut is not None:
                    fut.cancel()
                study.tell(trial, state=TrialState.FAIL)
                continue
            t_trial = _now()
            res: dict[str, Any] | None = None
            if fut is not None:
                # with a result in hand, wait for a compile only as long as the job's share
                # lasts (a cold compile can take longer than a whole share; it still lands in
                # the kernel cache for a later run)
                wait = ctx.compile_timeout_s
                if ctx.job_deadline is not None and has_result() and not cand.prior:
                    wait = min(wait, max(0.0, ctx.job_deadline - t_trial))
                try:
                    err = fut.result(timeout=wait)
                except cf.TimeoutError:
                    if wait < ctx.compile_timeout_s:
                        stop_why = stop_why or f"a kernel compile outlasted the {wait:.2f} s left of it"
                        study.tell(trial, state=TrialState.FAIL)
                        continue
                    err = None
                    res = {"outcome": "timeout", "error": f"compilation took more than {ctx.compile_timeout_s:.0f} s"}
                except Exception as e:  # the pool process died
                    err = f"compile worker failed: {_short_error(e)}"
                if err is not None:
                    res = {"outcome": "invalid" if err.startswith("invalid: ") else "compile_error", "error": err}
            t_ready = _now()
            if fut is not None:
                wait_s.append(t_ready - t_trial)
            if res is None:
                res = meas.run(_request(ctx, job, cand, seed))
            setup = res.get("setup_s", 0.0)
            run_s.append(max(0.0, _now() - t_ready - setup))
            ctx.trial_s.append(max(0.0, _now() - t_trial - setup))
            if ctx.job_deadline is not None and setup > 0:
                # a problem's random weights serve all its M buckets: building them does not
                # use up the share of the job that happens to come first (as far as the jobs
                # after it keep time for one trial each)
                cap = setup_cap(ctx.deadline, ctx.jobs_after, ctx.trial_s, ctx.streams)
                ctx.job_deadline = max(ctx.job_deadline, min(ctx.job_deadline + setup, cap))
            measured_here[cand.ident] = res
            with ctx.lock:
                _record_trial(db, ctx, job, cand, res)
            result.trials_run += 1
            trial.set_user_attr("executed", True)
            trial.set_user_attr("outcome", res["outcome"])
            if res["outcome"] == "ok":
                trial.set_user_attr("spread_us", res["spread_us"])
                trial.set_user_attr("samples", res["samples"])
                study.tell(trial, res["median_us"])
            else:
                result.trials_failed += 1
                failed.add(cand.ident)
                study.tell(trial, state=TrialState.FAIL)
            if ctx.pbar is not None:
                with ctx.lock:
                    ctx.pbar.set_postfix_str(
                        f"{job.name or key.op} N={key.n} K={key.k} M={job.m} trials={result.trials_run}", refresh=False
                    )
            refill()
    except KeyboardInterrupt:
        for trial, _, fut in inflight:
            if fut is not None:
                fut.cancel()
            try:
                study.tell(trial, state=TrialState.FAIL)
            except Exception:
                pass
        result.status = "interrupted"
        raise _Interrupted(result) from None

    # -- the choice (over every process's measurements of this study) --
    if ctx.storage is not None:  # let live peers finish the points they are measuring
        limit = time.monotonic() + 2 * ctx.compile_timeout_s
        while time.monotonic() < limit and not ctx.stop.is_set():
            if _started(study, ctx.compile_timeout_s) <= len(_finished(study)):
                break  # nothing running anywhere (stale trials of dead processes aside)
            time.sleep(0.1)
    stats: dict[str, TimingStats] = {}
    for t in _finished(study):
        if t.state == TrialState.COMPLETE and t.user_attrs.get("executed") and t.value is not None:
            ident = t.user_attrs.get("ident")
            if ident and ident not in stats:
                stats[ident] = TimingStats(
                    float(t.value), float(t.user_attrs.get("spread_us", 0.0)), int(t.user_attrs.get("samples", 1)), float(t.value)
                )
    by_ident = {c.ident: c for c in cands}
    oks = [by_ident[i] for i in stats if i in by_ident and i not in failed]
    if not oks:
        result.status = "out_of_time" if _out_of_time(ctx) else "no_valid_config"
        result.note = "no candidate passed the correctness check" if not _out_of_time(ctx) else "stopped before a config was measured"
        return result
    best = min(oks, key=lambda c: (stats[c.ident].median_us, c.backend.name, c.config_json))
    d_stats = stats.get(default.ident)
    notes = []
    if stop_why:
        notes.append(f"stopped at its share of the time budget after {result.trials_run} trials: {stop_why}")
    if d_stats is None:
        winner = best
        notes.append("default config failed or was not measured")
    elif best is not default and faster_beyond_noise(stats[best.ident], d_stats, MIN_GAIN):
        winner = best
    else:
        winner = default
        if best is not default:
            notes.append("no config beat the default beyond the noise")
    result.note = "; ".join(notes)
    unmeasured = [i for i in current_rows if i not in stats and i not in failed]
    if unmeasured and winner.ident not in current_rows:
        row = current_rows[unmeasured[0]]
        result.status = "kept"
        result.backend, result.config = row.backend, dict(row.config)
        result.median_us, result.spread_us = row.median_us, row.spread_us  # as stored
        result.note = (f"the stored winner was not measured again ({result.trials_run} trials in this job's "
                       "share of the time); its row stays")
        return result
    w_stats = stats[winner.ident]
    result.backend = winner.backend.name
    result.config = json.loads(winner.config_json)
    result.median_us = w_stats.median_us
    result.spread_us = w_stats.spread_us
    result.default_us = d_stats.median_us if d_stats is not None else None
    rec = TuningRecord(
        op=key.op, fmt=key.fmt, dtype=key.dtype, backend=winner.backend.name, m_bucket=job.m,
        n=key.n, k=key.k, experts=key.experts, topk=key.topk, config=result.config,
        median_us=w_stats.median_us, spread_us=w_stats.spread_us, samples=max(1, w_stats.samples),
        default_median_us=result.default_us, backend_source=backend_source_hash(winner.backend, result.config), env=ctx.env,
    )
    with ctx.lock:
        db.upsert_result(rec)
    return result


class _Interrupted(Exception):
    def __init__(self, result: JobResult) -> None:
        super().__init__("interrupted")
        self.result = result


def _open_db(db: Any) -> tuple[Any, bool, Path]:
    """``(TuningDB, owned, path)`` for a TuningDB, a path or None (the user DB)."""
    from .db import TuningDB
    from .dispatch import user_db_path

    if db is None:
        t = TuningDB(user_db_path())
        return t, True, t.path
    if isinstance(db, (str, os.PathLike)):
        t = TuningDB(db)
        return t, True, t.path
    return db, False, Path(db.path)


def _stream(
    jobs: "queue.Queue[tuple[int, Job]]", ctx: _Ctx, db: Any, meas: _Measurer, out: dict[int, JobResult]
) -> None:
    """Work through the job queue on one device (one thread per device)."""
    try:
        while True:
            try:
                i, job = jobs.get_nowait()
            except queue.Empty:
                return
            if ctx.stop.is_set():
                out[i] = JobResult(job, "interrupted", note="not started")
            elif _out_of_time(ctx):
                out[i] = JobResult(job, "out_of_time", note="time budget used up")
            else:
                with jobs.mutex:  # peek: the next job's first compile overlaps this job
                    nxt = jobs.queue[0][1] if jobs.queue else None
                ctx.jobs_after = jobs.qsize()
                ctx.job_deadline = job_share_deadline(_now(), ctx.deadline, ctx.jobs_after + 1, ctx.streams)
                try:
                    out[i] = _tune_job(job, ctx, db, meas, then=nxt)
                except _Interrupted as e:
                    out[i] = e.result
                    ctx.stop.set()
                except Exception as e:  # a DB or optuna failure ends this job, not the run
                    out[i] = JobResult(job, "error", note=_short_error(e))
            if ctx.pbar is not None:
                with ctx.lock:
                    ctx.pbar.update(1)
    finally:
        meas.close()


def tune_jobs(
    jobs: Sequence[Job],
    backends: Sequence[str] | None = None,
    db: Any = None,
    device: torch.device | str | None = None,
    budget_per_shape: int | None = None,
    budget_total_s: float | None = None,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
    *,
    gpus: Sequence[int] | None = None,
    storage: str | None = None,
    isolate: bool | None = None,
    trial_timeout_s: float | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
) -> TuneReport:
    """Tune explicit :class:`Job` s (see :func:`tune` for the parameters).

    ``devices`` generalizes ``gpus``: one job stream (a thread driving its own timing
    worker process and DB connection) per entry; entries may repeat (``["cpu", "cpu"]``).
    """
    from .env import current_environment

    if gpus and devices:
        raise ValueError("give gpus or devices, not both")
    if gpus:
        if not torch.cuda.is_available():
            raise RuntimeError(f"gpus={list(gpus)} given, but no CUDA GPU is available")
        devices = [torch.device("cuda", int(g)) for g in gpus]
    elif devices:
        devices = [torch.device(d) for d in devices]
        if len({d.type for d in devices}) != 1:
            raise ValueError(f"devices must all be of one type, got {[str(d) for d in devices]}")
    else:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        devices = [dev]
    on_gpu = devices[0].type == "cuda"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    budget = int(budget_per_shape or defaults.budget)
    if budget < 1:
        raise ValueError(f"budget_per_shape must be >= 1, got {budget}")
    if budget_total_s is None:
        budget_total_s = defaults.time_budget_s
    elif not budget_total_s > 0:
        raise ValueError(f"budget_total_s must be > 0 (math.inf: no limit), got {budget_total_s}")
    if budget_total_s is not None and math.isinf(budget_total_s):
        budget_total_s = None
    if backends:
        chosen = [get_backend(n) for n in backends]
        for b in chosen:
            why = b.unavailable_reason(devices[0])
            if why:
                raise RuntimeError(f"backend {b.name!r} cannot run on {devices[0]}: {why}")
    else:
        chosen = available_backends(devices[0])
    if workers is None:
        workers = max(1, min(16, (os.cpu_count() or 2) - 2)) if on_gpu else 0
    if isolate is None:
        isolate = on_gpu
    timeout = float(trial_timeout_s or defaults.trial_timeout_s)
    env = current_environment(devices[0])
    t0 = _now()
    report = TuneReport(device=", ".join(str(d) for d in devices), env_key=env.key())
    storage_obj = _open_storage(storage)
    main_db, owned, db_path = _open_db(db)
    main_db.add_environment(env)
    pool = None
    if workers > 0:
        from .kernel_cache import target_arch

        arch = target_arch() if on_gpu else ""
        pool = cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_pool_init, initargs=(arch,)
        )
        _start_pool(pool, workers)
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(jobs), desc="tuning", unit="job", dynamic_ncols=True, file=sys.stderr)
    lock = threading.Lock()
    stop = threading.Event()
    seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    out: dict[int, JobResult] = {}
    q: queue.Queue[tuple[int, Job]] = queue.Queue()
    for i, j in enumerate(jobs):
        q.put((i, j))

    def ctx_for(dev: torch.device) -> _Ctx:
        return _Ctx(
            device=dev, env=current_environment(dev), env_key=env.key(), backends=chosen, budget=budget,
            warmup=int(warmup if warmup is not None else defaults.warmup),
            reps=int(reps if reps is not None else defaults.reps),
            deadline=None if budget_total_s is None else t0 + float(budget_total_s),
            force=force, storage=storage_obj, ask_lock=_ask_lock_path(storage), window=max(1, workers), pool=pool,
            compile_timeout_s=timeout, stop=stop, pbar=pbar, lock=lock, seed=seed, streams=len(devices),
            reference_as_fallback=not backends,
        )

    try:
        if len(devices) == 1:
            _stream(q, ctx_for(devices[0]), main_db, _Measurer(devices[0], isolate, timeout), out)
        else:
            threads = []
            for dev in devices:
                ctx = ctx_for(dev)
                th = threading.Thread(
                    target=_stream_owned_db, args=(q, ctx, db_path, _Measurer(dev, True, timeout), out), daemon=True
                )
                th.start()
                threads.append(th)
            try:
                for th in threads:
                    while th.is_alive():
                        th.join(0.5)
            except KeyboardInterrupt:
                stop.set()
                for th in threads:
                    th.join()
    except KeyboardInterrupt:
        stop.set()
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if pbar is not None:
            pbar.close()
        if owned:
            main_db.close()
    report.interrupted = stop.is_set()
    for i, j in enumerate(jobs):
        report.results.append(out.get(i) or JobResult(j, "interrupted" if report.interrupted else "out_of_time"))
    report.elapsed_s = _now() - t0
    return report


def _stream_owned_db(q: Any, ctx: _Ctx, db_path: Path, meas: _Measurer, out: dict[int, JobResult]) -> None:
    """A job stream on its own thread, with its own DB connection (SQLite connections stay
    on the thread that opened them)."""
    from .db import TuningDB

    try:
        db = TuningDB(db_path)
    except Exception:
        meas.close()
        raise
    try:
        _stream(q, ctx, db, meas, out)
    finally:
        db.close()


def tune(
    shapes: Sequence[Any],
    m_buckets: Sequence[int] | None = None,
    backends: Sequence[str] | None = None,
    db: Any = None,
    device: torch.device | str | None = None,
    budget_per_shape: int | None = None,
    budget_total_s: float | None = None,
    force: bool = False,
    workers: int | None = None,
    progress: bool = True,
    *,
    fmt: str = "nvfp4",
    dtype: str = "bfloat16",
    gpus: Sequence[int] | None = None,
    storage: str | None = None,
    isolate: bool | None = None,
    trial_timeout_s: float | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
) -> TuneReport:
    """Tune every (shape, M bucket) and store the winners in the tuning DB.

    ``shapes``: :class:`~autofp4.models.ModelShape` s (with ``fmt``/``dtype``) or
    :class:`ProblemKey` s. ``m_buckets``: default ``DEFAULT_M_BUCKETS`` on the GPU,
    ``CPU_M_BUCKETS`` on the CPU. ``backends``: backend names (default: every backend that
    applies to the device). ``db``: a TuningDB, a path, or None for the user DB.
    ``budget_per_shape``: trials per (shape, bucket) (default 32 GPU / 3 CPU);
    ``budget_total_s``: wall-clock budget of the whole run (default 900 s on the GPU, none on
    the CPU; ``math.inf``: none). Each job gets an equal share of the time left when it starts
    and stops asking for trials at the end of it once it has a measured result; jobs that
    cannot start in time are reported as ``out_of_time``. ``force``: re-tune jobs that already
    have a result, starting from the stored winner. ``workers``: compile worker processes
    (default: CPU count based on the GPU, 0 on the CPU = compile in-process). ``gpus``: CUDA
    device indices, one job stream each (``devices``: the same with explicit devices, e.g.
    ``["cpu", "cpu"]``). ``storage``: an optuna RDB URL shared by cooperating processes.
    ``isolate``: run trials in a restartable child process (default: on the GPU).
    ``trial_timeout_s``: per-trial limit in the child.
    """
    first = devices[0] if devices else (device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = bool(gpus) or torch.device(first).type == "cuda"
    if m_buckets is None:
        m_buckets = DEFAULT_M_BUCKETS if on_gpu else CPU_M_BUCKETS
    ms = sorted({int(m) for m in m_buckets})
    if not ms or ms[0] < 1:
        raise ValueError(f"m_buckets must be positive integers, got {list(m_buckets)}")
    return tune_jobs(
        jobs_for(shapes, ms, fmt, dtype), backends, db, device, budget_per_shape, budget_total_s, force,
        workers, progress, gpus=gpus, storage=storage, isolate=isolate, trial_timeout_s=trial_timeout_s,
        warmup=warmup, reps=reps, devices=devices,
    )


def tune_from_misses(misses_path: str | os.PathLike | None = None, **kwargs: Any) -> TuneReport:
    """Tune exactly the ``(key, M bucket)`` pairs a workload missed (see :mod:`autofp4.dispatch`).

    ``misses_path`` defaults to the misses file next to the user DB; ``kwargs`` go to
    :func:`tune_jobs`. Jobs are ordered by how many calls missed them (most first).
    """
    misses = load_misses(misses_path)
    counts: dict[tuple[ProblemKey, int], int] = {}
    for key, m, c in misses:
        counts[(key, m)] = counts.get((key, m), 0) + c
    jobs = [Job(k, m, f"{c} calls") for (k, m), c in sorted(counts.items(), key=lambda kv: -kv[1])]
    return tune_jobs(jobs, **kwargs)


# -----------------------------------------------------------------------------------------
# compiling ahead of time
# -----------------------------------------------------------------------------------------
@dataclass
class WarmReport:
    """What :func:`warm_kernel_cache` compiled: ``compiled`` configs, ``failed`` (config, error)."""

    compiled: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0


def warm_kernel_cache(
    jobs: Sequence[Job], backends: Sequence[str], seeds: int = 0, workers: int = 1, arch: str = "",
    progress: bool = True, stored: Iterable[TuningRecord] = (),
) -> WarmReport:
    """Compile each job's default config, the winners ``stored`` for it (rows of a tuning DB,
    from any machine; also those of an older kernel source, which a re-tune tries again) and its
    first ``seeds`` seeds of the named backends into the disk kernel cache, in ``workers``
    processes, without a GPU when ``arch`` names the target (``sm_90a``): what a re-tune tries
    first, and with the shipped DB, what the dispatcher runs. An inference server or a tuning run on that GPU then
    loads the kernels instead of compiling them. Configs shared by several jobs compile once."""
    chosen = [get_backend(n) for n in backends]
    by_name = {b.name: b for b in chosen}
    by_job: dict[tuple, list[TuningRecord]] = {}
    by_env: dict[str, list[TuningRecord]] = {}  # neighbours are looked up within one environment
    for r in stored:
        if r.backend in by_name:
            by_job.setdefault((r.op, r.fmt, r.dtype, r.n, r.k, r.experts, r.topk, r.m_bucket), []).append(r)
            by_env.setdefault(r.env_key, []).append(r)
    reqs: dict[str, dict[str, Any]] = {}
    for job in jobs:
        k = job.key
        usable = [b for b in chosen if b.supports(k) is None]
        recs = by_job.get((k.op, k.fmt, k.dtype, k.n, k.k, k.experts, k.topk, job.m), [])
        near = [r for rs in by_env.values() for r in _sibling_records(rs, k, job.m)]
        for c in _first_candidates(k, job.m, usable, _parsed(recs, usable), seeds, _parsed(near, usable)):
            ident = f"{c.ident}:{sorted(asdict(k).items())}"
            reqs.setdefault(ident, {"backend": c.backend.name, "spec": _spec(c.backend), "config": c.config_json,
                                    "key": asdict(k)})
    report = WarmReport()
    t0 = _now()
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(reqs), desc="compiling", unit="kernel", dynamic_ncols=True, file=sys.stderr)

    def done(req: dict[str, Any], err: str | None) -> None:
        if err is None:
            report.compiled += 1
        else:
            report.failed.append((req["config"], err))
        if pbar is not None:
            pbar.update(1)

    try:
        if workers <= 1:
            from .kernel_cache import target_arch

            _pool_init(arch)
            target_arch.cache_clear()  # the cache keys name the architecture just set
            for req in reqs.values():
                done(req, _compile_only(req))
        else:
            with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                        initializer=_pool_init, initargs=(arch,)) as pool:
                futs = {pool.submit(_compile_only, req): req for req in reqs.values()}
                for fut in cf.as_completed(futs):
                    done(futs[fut], fut.result())
    finally:
        if pbar is not None:
            pbar.close()
    report.seconds = _now() - t0
    return report
