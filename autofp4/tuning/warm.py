"""Compiling ahead of time: :func:`warm_kernel_cache` fills the disk kernel cache with what a
tuning run tries first and what the dispatcher runs."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from ..backends import get_backend
from ..schema import TuningRecord
from . import args as A
from . import budget
from .candidates import _first_candidates, _other_problem_winners, _parsed, _sibling_records
from .compile_pool import _compile_only, _pool_init, _spec
from .jobs import Job


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
    from any machine; also those of an older kernel source, which a re-tune tries again) and, with
    ``seeds``, the winners of other shapes at its M (``stored`` and shipped) and its first ``seeds``
    seeds of the named backends into the disk kernel cache, in ``workers``
    processes, without a GPU when ``arch`` names the target (``sm_90a``): what a re-tune tries
    first, and with the shipped DB, what the dispatcher runs. An inference server or a tuning run on that GPU then
    loads the kernels instead of compiling them. Configs shared by several jobs compile once."""
    A.workers(workers, "workers")
    here = workers <= 1 and _compiles_here_for(arch)
    if here:  # the target set before anything below imports the compiler
        from ..kernel_cache import target_arch

        _pool_init(arch)
        target_arch.cache_clear()  # the cache keys name the architecture just set
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
        near = _parsed([r for rs in by_env.values() for r in _sibling_records(rs, k, job.m)], usable)
        if seeds:  # what a job tries before its seeds, beside its own rows: other shapes' winners
            near += _other_problem_winners([r for rs in by_env.values() for r in rs], k, job.m, usable)
        for c in _first_candidates(k, job.m, usable, _parsed(recs, usable), seeds, near):
            ident = f"{c.ident}:{sorted(asdict(k).items())}"
            reqs.setdefault(ident, {"backend": c.backend.name, "spec": _spec(c.backend), "config": c.config_json,
                                    "key": asdict(k)})
    report = WarmReport()
    t0 = budget._now()
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
        if here:
            for req in reqs.values():
                done(req, _compile_only(req))
        else:
            with _target_for_children(arch), cf.ProcessPoolExecutor(
                    max_workers=max(1, workers), mp_context=mp.get_context("spawn"), initializer=_pool_init,
                    initargs=(arch, True)) as pool:
                futs = {pool.submit(_compile_only, req): req for req in reqs.values()}
                for fut in cf.as_completed(futs):
                    done(futs[fut], fut.result())
    finally:
        if pbar is not None:
            pbar.close()
    report.seconds = budget._now() - t0
    return report


def _compiles_here_for(arch: str) -> bool:
    """Whether this process can compile for ``arch``: CuTeDSL reads its target
    (``$CUTE_DSL_ARCH``, else the GPU it finds, else sm_100a) once, when it is imported, and a
    kernel without an explicit ``--gpu-arch`` follows it; once it is imported with another target,
    a kernel compiled here would be stored under ``arch``'s cache key for the wrong GPU, so the
    compile goes to a fresh process instead."""
    if not arch or arch == "unknown":
        return True
    return "cutlass" not in sys.modules or os.environ.get("CUTE_DSL_ARCH") == arch


@contextlib.contextmanager
def _target_for_children(arch: str):
    """``$CUTE_DSL_ARCH`` = ``arch`` while the compile processes start: a spawned process imports
    the caller's main module again before its initializer runs, and that may import CuTeDSL."""
    if not arch or arch == "unknown":
        yield
        return
    before = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = arch
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = before
