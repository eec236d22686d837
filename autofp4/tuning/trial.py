"""One trial, in the timing process (in-process or a worker): random data for the job, the
check against the reference backend, the timing plan, and :func:`run_trial`."""
from __future__ import annotations

import json
import math
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch

from ..backends.base import Backend
from ..backends.reference import reference_runner
from ..problem import ProblemKey, is_moe
from ..routing import rank_expert_map
from ..timing import TimingStats, copies_for_cold_l2, l2_cache_bytes, time_cpu, time_cuda
from .compile_pool import _backend_from, _key_from, _short_error

#: relative Frobenius error bound of a candidate's output vs. the reference backend's.
TOLERANCE: dict[str, float] = {"bfloat16": 1e-2, "float16": 5e-3}
#: a looser bound where the numerics themselves differ by more: the W4A8 MoE layer re-quantizes
#: its intermediate activations to E4M3, and a product rounded on the other side of an E4M3 tie
#: than in the reference moves that element by an E4M3 step (1/8): 0.8-1.2% of the layer's norm
#: on the GPU, where a wrong kernel is off by far more
OP_TOLERANCE: dict[str, float] = {"moe_fp8": 3e-2}
#: kernels faster than this (eager estimate) are timed by CUDA-graph replay; a MoE layer always
#: is (where it can be captured): it is a chain of small ops (routing, two GEMMs, the top-k sum)
#: whose eager launch cost (about 0.7 ms at T = 256 on an H200 host) would decide the pick, and
#: serving engines capture it
GRAPH_BELOW_US = 200.0
#: calls slower than this are timed on two argument copies only (no cold-L2 rotation).
SLOW_CALL_US = 1000.0
#: the timed samples of one trial aim at this much GPU time (fewer reps for slow kernels).
TRIAL_TARGET_S = 2.0
#: but never fewer samples than this.
MIN_REPS = 5
#: the routings a MoE trial runs on (the request's ``routing``): ``uniform``, the search's (random
#: router logits), and ``skewed``, the one the tuner checks its pick on (job.py): a share
#: ``SKEW_HOT_FRACTION`` of the experts (at least top-k of them, drawn from the seed) get
#: ``SKEW_LOGIT_BIAS`` added to their router logits, so that most (token, slot) pairs go to them
#: (the logits are standard normal: with a bias of 2 the hot experts take about 80% of the pairs at
#: 8 experts and top-2, 95% at 128 and top-8)
ROUTINGS = ("uniform", "skewed")
SKEW_HOT_FRACTION = 0.25
SKEW_LOGIT_BIAS = 2.0
#: how a trial row on the skewed routing starts its ``error`` text (an ``ok`` one: just this)
SKEWED_TRIAL = "skewed routing"


# -----------------------------------------------------------------------------------------
# one trial: data, check, time (runs in the timing process: in-process or a worker)
# -----------------------------------------------------------------------------------------
class _TrialData:
    """Random weights / activations / reference outputs of one problem (its M buckets share them)."""

    def __init__(self) -> None:
        self.ident: tuple | None = None
        self.weights: list[Any] = []  # per copy: FP4Weight (linear) or (w13, w2) (moe)
        self.prepared: dict[tuple[str, int], Any] = {}
        self.acts: dict[tuple[int, str], list[tuple]] = {}  # (m, routing) -> per copy: (x, bias) or (x, tw, ti)
        self.refs: dict[tuple[int, str, str], torch.Tensor] = {}  # (m, routing, numerics) -> reference output


_DATA = _TrialData()  # the problem of the latest trial
#: the data of earlier problems, least recently used first: a just-in-time worker meets a model's
#: shapes one after the other at each M, and rebuilding a problem's weight copies (and their packed
#: layouts) at every switch cost a job its share of the time
_KEPT: "OrderedDict[tuple, _TrialData]" = OrderedDict()
#: the weight bytes the kept problems and the latest may hold on a device (their packed layouts
#: come on top); the latest is held whatever its size
KEEP_BYTES = 2 * 2**30


def _data_bytes(d: _TrialData) -> int:
    return sum(_weight_bytes(w) for w in d.weights)


def _make_room(new_bytes: int) -> None:
    """Drop the least recently used kept problems while they and ``new_bytes`` would exceed
    :data:`KEEP_BYTES`."""
    dropped = False
    while _KEPT and sum(map(_data_bytes, _KEPT.values())) + new_bytes > KEEP_BYTES:
        _KEPT.popitem(last=False)
        dropped = True
    if dropped and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _switch_data(ident: tuple) -> _TrialData:
    """The data of ``ident`` as ``_DATA``: the kept one, else a fresh empty one; the problem
    before it kept."""
    global _DATA
    if _DATA.ident == ident:
        return _DATA
    if _DATA.ident is not None:
        _KEPT[_DATA.ident] = _DATA
    _DATA = _KEPT.pop(ident, None) or _TrialData()
    return _DATA


def _randn(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Normal values of ``shape`` on ``device``, determined by the CPU generator ``gen``. On a
    GPU they are drawn there, from a device generator seeded by ``gen``: the CPU draws some
    10^8 values a second, and a MoE problem's rotated weight copies are 10^9-10^10 values."""
    if device.type != "cuda":
        return torch.randn(shape, generator=gen, device="cpu").to(device)
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 1 << 62, (1,), generator=gen)))
    return torch.randn(shape, generator=g, device=device)


def _random_fp4(shape: tuple[int, ...], fmt: str, device: torch.device, gen: torch.Generator) -> Any:
    """A random FP4 weight of ``shape`` (quantized in expert chunks to bound fp32 memory)."""
    from ..weights import FP4Weight, quantize

    if len(shape) == 2:
        return quantize(_randn(shape, device, gen), fmt)
    e, n, k = shape
    per = max(1, (1 << 27) // max(1, n * k))
    parts = []
    for s in range(0, e, per):
        c = min(per, e - s)
        w = _randn((c, n, k), device, gen)
        parts.append(quantize(w, fmt))
        del w
    if len(parts) == 1:
        return parts[0]
    gs = None if parts[0].global_scale is None else torch.cat([p.global_scale for p in parts])
    return FP4Weight(
        fmt, torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), gs, check_values=False
    )


def _weights_for(key: ProblemKey, device: torch.device, gen: torch.Generator) -> Any:
    if not is_moe(key.op):
        return _random_fp4((key.n, key.k), key.fmt, device, gen)
    inter = key.n // 2
    return (
        _random_fp4((key.experts, key.n, key.k), key.fmt, device, gen),
        _random_fp4((key.experts, key.k, inter), key.fmt, device, gen),
    )


def _weight_bytes(w: Any) -> int:
    ws = w if isinstance(w, tuple) else (w,)
    return sum(x.nbytes for x in ws)


def hot_experts(key: ProblemKey, experts_global: int = 0) -> int:
    """How many experts the skewed routing favours (see ``ROUTINGS``), among the layer's
    ``experts_global`` for a slice of an expert-parallel layer."""
    e = experts_global or key.experts
    return min(e, max(key.topk, round(SKEW_HOT_FRACTION * e)))


def _acts_for(key: ProblemKey, m: int, device: torch.device, gen: torch.Generator,
              routing: str = "uniform", experts_global: int = 0) -> tuple:
    """The activations of a trial; a MoE's routing ``uniform`` or ``skewed`` (the same ``x``
    and logit noise for the same ``gen``). With ``experts_global`` (a slice of an
    expert-parallel layer) the top-k are chosen among that many experts and a fourth element,
    the expert map of the rank that holds experts ``0 .. key.experts - 1``, goes with them."""
    dt = key.torch_dtype
    x = torch.randn((m, key.k), generator=gen).to(device=device, dtype=dt)
    if not is_moe(key.op):
        bias = torch.randn((key.n,), generator=gen).to(device=device, dtype=dt)
        return (x, bias)
    e = experts_global or key.experts
    logits = torch.randn((m, e), generator=gen)
    if routing == "skewed":
        hot = torch.randperm(e, generator=gen)[: hot_experts(key, experts_global)]
        logits[:, hot] += SKEW_LOGIT_BIAS
    tw, ti = torch.topk(torch.softmax(logits, dim=-1), key.topk, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).float().to(device)
    act = (x, tw, ti.to(torch.int32).to(device))
    if not experts_global:
        return act
    return (*act, rank_expert_map(e, key.experts, device=device))


def _call(key: ProblemKey, runner: Callable, prepared: Any, act: tuple, with_bias: bool = True) -> torch.Tensor:
    if not is_moe(key.op):
        x, bias = act
        return runner(x, prepared, bias if with_bias else None)
    x, tw, ti, *emap = act
    p13, p2 = prepared
    return runner(x, p13, p2, tw, ti, "silu", *emap)


def _prepare(b: Backend, w: Any) -> Any:
    if isinstance(w, tuple):
        return tuple(wi.packed(b.name, b.prepare) for wi in w)
    return w.packed(b.name, b.prepare)


#: the rotated weight copies of one job never take more device memory than this.
ROTATION_MAX_BYTES = 16 * 2**30


def _copies(key: ProblemKey, m: int, weight_bytes: int, device: torch.device, experts_global: int = 0) -> int:
    """Argument copies that make one rotation read more than twice the L2 (cold-L2 timing).

    A MoE call reads only the experts its tokens are routed to: about
    ``min(E, pairs) / E`` of the weights, ``pairs = m * topk`` (a slice of an expert-parallel
    layer gets ``E / experts_global`` of them).
    """
    touched = weight_bytes
    if is_moe(key.op):
        pairs = m * key.topk * key.experts // (experts_global or key.experts)
        touched = max(1, weight_bytes * min(key.experts, max(1, pairs)) // key.experts)
    per = touched + 2 * m * key.k
    n = copies_for_cold_l2(per, l2_cache_bytes(device))
    return max(1, min(n, ROTATION_MAX_BYTES // max(1, weight_bytes)))


def _setup_data(key: ProblemKey, m: int, seed: int, device: torch.device, copies_hint: bool,
                numerics: str = "w4a16", routing: str = "uniform", experts_global: int = 0) -> _TrialData:
    ident = (key, seed, str(device), experts_global)
    d = _switch_data(ident)
    if d.ident != ident:
        d.weights, d.prepared, d.acts, d.refs = [], {}, {}, {}
        gen = torch.Generator().manual_seed(seed)
        d.weights.append(_weights_for(key, device, gen))
        one = _weight_bytes(d.weights[0])
        n = _copies(key, m, one, device, experts_global) if device.type == "cuda" and copies_hint else 1
        _make_room(n * one)
        for _ in range(n - 1):
            d.weights.append(_weights_for(key, device, gen))
        d.ident = ident
    if (m, routing) not in d.acts:
        gen = torch.Generator().manual_seed(seed * 7919 + m)
        d.acts[m, routing] = [_acts_for(key, m, device, gen, routing, experts_global) for _ in d.weights]
    if (m, routing, numerics) not in d.refs:  # the oracle of the candidate's numerics (W4A16 or W4A4)
        d.refs[m, routing, numerics] = _call(key, reference_runner(numerics, key), d.weights[0], d.acts[m, routing][0])
    return d


def _timing_plan(pass_us: float, warmup: int, reps: int) -> tuple[int, int]:
    """``(warmup, reps)`` so that the samples take about ``TRIAL_TARGET_S`` (``pass_us``: one
    pass over the argument copies), between ``MIN_REPS`` and the requested ``reps``."""
    fit = int(TRIAL_TARGET_S * 1e6 / max(pass_us, 1e-3))
    r = max(min(MIN_REPS, reps), min(reps, fit))
    return min(warmup, max(1, r // 3)), r


def _check(out: Any, ref: torch.Tensor, dtype: str, op: str = "") -> str | None:
    """``None`` when ``out`` matches ``ref`` within ``TOLERANCE[dtype]`` (or ``OP_TOLERANCE[op]``
    where looser), else why not."""
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
    tol = max(TOLERANCE[dtype], OP_TOLERANCE.get(op, 0.0))
    if not err <= tol:
        return f"relative Frobenius error {err:.3e} exceeds {tol:.0e} ({dtype}{', ' + op if op in OP_TOLERANCE else ''})"
    return None


def _is_cuda_fault(e: BaseException) -> bool:
    s = str(e)
    return any(t in s for t in ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure", "CUBLAS_STATUS"))


def run_trial(req: dict[str, Any]) -> dict[str, Any]:
    """Compile, check and time one candidate; never raises (the outcome says what happened).

    ``req``: ``backend``, ``spec``, ``config`` (JSON), ``key`` (dict), ``m``, ``seed``,
    ``device``, ``warmup``, ``reps``, ``graph`` (allow CUDA graphs), optionally ``routing``
    (a MoE's, one of ``ROUTINGS``; default ``uniform``) and ``experts_global`` (a MoE slice of
    an expert-parallel layer, see :class:`~.jobs.Job`; default 0). Returns ``outcome``,
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
        routing = req.get("routing", "uniform")
        if routing not in ROUTINGS or (routing != "uniform" and not is_moe(key.op)):
            reason = reason or f"no routing {routing!r} for {key.op}"
        eg = req.get("experts_global", 0)
        if eg and not (is_moe(key.op) and isinstance(eg, int) and eg > key.experts):
            reason = reason or (f"experts_global={eg!r} needs a MoE job with fewer experts "
                                f"(this one: {key.op}, {key.experts} experts)")
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
        d = _setup_data(key, m, int(req["seed"]), device, copies_hint=True, numerics=b.numerics,
                        routing=routing, experts_global=eg)
        stage = "preparing the weight"
        prepared = [_prepare(b, w) for w in d.weights]
        # one-off work (random weights for a new problem, a layout packed for a new kernel):
        # the job's time share must not take it for the cost of every trial
        res["setup_s"] = time.perf_counter() - t_setup
        stage = "running"
        acts = d.acts[m, routing]
        out = _call(key, runner, prepared[0], acts[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        why = _check(out, d.refs[m, routing, b.numerics], key.dtype, key.op)
        if why:
            return {**res, "outcome": "wrong_result", "error": why}
        stage = "timing"
        args = [(p, a) for p, a in zip(prepared, acts)]

        def fn(p: Any, a: tuple) -> Any:
            return _call(key, runner, p, a, with_bias=False)

        if device.type == "cuda":
            est = time_cuda(fn, args[:1], warmup=1, reps=3, use_graph=False)
            if est.median_us > SLOW_CALL_US:  # L2 reuse is noise next to such a call
                args = args[:2]
            warmup, reps = _timing_plan(est.median_us * len(args), req["warmup"], req["reps"])
            st: TimingStats | None = None
            if req.get("graph", True) and (est.median_us < GRAPH_BELOW_US or is_moe(key.op)):
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
