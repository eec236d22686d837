"""Kernel timing with noise statistics: CUDA events / CUDA graphs on the GPU, perf_counter on CPU.

Rules
-----
- Every measurement is a list of per-call times in microseconds. Its summary is
  :class:`TimingStats`: the **median** and the **spread**, defined as half the inter-quartile
  range, ``(p75 - p25) / 2``. The interval ``median +- spread`` holds the middle half of the
  samples, so it stays meaningful with a handful of outliers (a preemption, a clock change).
- **Cold L2.** On the GPU, ``args_list`` holds several copies of the call's arguments (inputs
  and weights in separate memory) and every sample runs one pass over all of them, so a
  weight is evicted before it is read again. :func:`copies_for_cold_l2` says how many copies
  make the rotated bytes exceed twice the L2 size.
- **CUDA graphs.** For short kernels launch overhead dominates eager timing; with
  ``use_graph`` one graph holding one call per argument set is captured and replayed, and a
  sample is one replay divided by the number of calls in it.
- :func:`faster_beyond_noise` is the decision rule of the tuner: ``a`` beats ``b`` only when
  ``a.median + a.spread < b.median - b.spread`` (the two middle-half intervals do not overlap)
  and, in addition, ``a`` is at least ``min_gain`` (relative) faster.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "TimingStats",
    "stats_from_samples",
    "time_cpu",
    "time_cuda",
    "copies_for_cold_l2",
    "l2_cache_bytes",
    "faster_beyond_noise",
]


@dataclass(frozen=True)
class TimingStats:
    """Summary of one measurement; times in microseconds per call.

    ``spread_us`` is half the inter-quartile range, ``(p75 - p25) / 2``.
    """

    median_us: float
    spread_us: float
    samples: int
    min_us: float
    raw: tuple[float, ...] = field(default=(), repr=False)

    @property
    def low_us(self) -> float:
        return self.median_us - self.spread_us

    @property
    def high_us(self) -> float:
        return self.median_us + self.spread_us


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (``0 <= q <= 1``)."""
    if not sorted_xs:
        raise ValueError("no samples")
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def stats_from_samples(samples_us: Sequence[float]) -> TimingStats:
    """:class:`TimingStats` of per-call times in microseconds (at least one sample)."""
    xs = sorted(float(s) for s in samples_us)
    if not xs:
        raise ValueError("stats_from_samples needs at least one sample, got none")
    if any(not math.isfinite(x) or x < 0 for x in xs):
        raise ValueError(f"samples must be finite and >= 0, got {xs}")
    spread = (_quantile(xs, 0.75) - _quantile(xs, 0.25)) / 2.0
    return TimingStats(
        median_us=statistics.median(xs),
        spread_us=spread,
        samples=len(xs),
        min_us=xs[0],
        raw=tuple(float(s) for s in samples_us),
    )


def faster_beyond_noise(a: TimingStats, b: TimingStats, min_gain: float = 0.0) -> bool:
    """True when ``a`` is faster than ``b`` beyond the measured noise.

    The middle-half intervals must not overlap (``a.median + a.spread < b.median - b.spread``)
    and ``a.median`` must be at most ``(1 - min_gain) * b.median``.
    """
    if a.median_us + a.spread_us >= b.median_us - b.spread_us:
        return False
    return a.median_us <= (1.0 - min_gain) * b.median_us


def _check_args(args_list: Sequence[Sequence[Any]], warmup: int, reps: int) -> None:
    if not args_list:
        raise ValueError("args_list must hold at least one argument tuple")
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")


def time_cpu(
    fn: Callable[..., Any],
    args_list: Sequence[Sequence[Any]],
    warmup: int = 1,
    reps: int = 5,
) -> TimingStats:
    """Time ``fn(*args)`` on the host with ``time.perf_counter``, rotating through ``args_list``.

    One sample is one call; ``warmup`` calls are made (and discarded) first.
    """
    _check_args(args_list, warmup, reps)
    n = len(args_list)
    for i in range(warmup):
        fn(*args_list[i % n])
    samples = []
    for i in range(reps):
        args = args_list[i % n]
        t0 = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - t0) * 1e6)
    return stats_from_samples(samples)


def l2_cache_bytes(device: torch.device | int | str | None = None) -> int:
    """The L2 size of a CUDA device in bytes (0 on the CPU)."""
    dev = torch.device(device) if device is not None and not isinstance(device, int) else device
    if isinstance(dev, torch.device) and dev.type != "cuda":
        return 0
    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(dev if dev is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 0)


def copies_for_cold_l2(bytes_per_set: int, l2_bytes: int, max_copies: int = 64) -> int:
    """How many argument copies make ``copies * bytes_per_set > 2 * l2_bytes`` (at least 1)."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    if l2_bytes <= 0:
        return 1
    return max(1, min(max_copies, 2 * l2_bytes // bytes_per_set + 1))


def time_cuda(
    fn: Callable[..., Any],
    args_list: Sequence[Sequence[Any]],
    warmup: int = 10,
    reps: int = 30,
    use_graph: bool = False,
    stream: torch.cuda.Stream | None = None,
) -> TimingStats:
    """Time ``fn(*args)`` on the GPU with CUDA events.

    One sample is one pass over every argument set of ``args_list`` (eagerly, or as one replay
    of a captured CUDA graph with ``use_graph``) divided by ``len(args_list)``. ``warmup``
    passes run first. Raises what ``fn`` raises; graph capture errors propagate (callers fall
    back to eager timing).
    """
    _check_args(args_list, warmup, reps)
    n = len(args_list)
    stream = stream or torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        # eager warm-up (also loads modules / fills caches before a capture)
        for _ in range(max(1, warmup if not use_graph else 2)):
            for args in args_list:
                fn(*args)
        torch.cuda.synchronize()
        step: Callable[[], Any]
        if use_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for args in args_list:
                    fn(*args)
            torch.cuda.synchronize()
            step = graph.replay
            for _ in range(warmup):
                step()
        else:

            def step() -> None:
                for args in args_list:
                    fn(*args)

        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record(stream)
            step()
            ends[i].record(stream)
        torch.cuda.synchronize()
    cur.wait_stream(stream)
    samples = [s.elapsed_time(e) * 1e3 / n for s, e in zip(starts, ends)]
    return stats_from_samples(samples)
