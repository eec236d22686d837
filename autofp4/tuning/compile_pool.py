"""The compile worker processes (spawned, so that compilation overlaps the serial GPU timing),
trial requests and the backend specifications in them: a spawned process rebuilds a test or
plug-in backend from its spec."""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import json
import os
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..backends import get_backend
from ..backends.base import Backend
from ..problem import ProblemKey
from .candidates import _Cand, _applicable, _valid_defaults
from .jobs import Job, _Ctx


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


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        f = tb[-1]
        text += f" [{Path(f.filename).name}:{f.lineno}]"
    return text[:1900]


def _preload_compiler() -> None:
    """Import the GPU backends' kernel compiler (seconds) before a process's first request."""
    try:
        import cutlass.cute  # noqa: F401
    except ImportError:
        pass


def _exit_with_parent() -> None:
    """End this process once its parent has gone (it is then adopted by another): a compile
    worker whose tuning run was killed would otherwise live on, holding its memory."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="autofp4-parent-watch", daemon=True).start()


def _pool_init(arch: str, in_pool: bool = False) -> None:
    """Compile workers target the tuned GPU (``arch`` over any ``$CUTE_DSL_ARCH`` they inherit:
    the cache keys name ``arch``) without opening a CUDA context of their own. ``in_pool``: this
    is a pool's worker process, which ends with its parent."""
    if in_pool:
        _exit_with_parent()
    if arch and arch != "unknown":
        os.environ["CUTE_DSL_ARCH"] = arch
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


def _request(ctx: _Ctx, job: Job, cand: _Cand, seed: int) -> dict[str, Any]:
    return {
        "backend": cand.backend.name, "spec": _spec(cand.backend), "config": cand.config_json,
        "key": asdict(job.key), "m": job.m, "seed": seed, "device": str(ctx.device),
        "warmup": ctx.warmup, "reps": ctx.reps, "graph": True, "experts_global": job.experts_global,
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
