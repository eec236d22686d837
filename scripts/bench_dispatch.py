#!/usr/bin/env python
"""Host-side cost of dispatch: ``Dispatcher.resolve`` and ``autofp4.linear`` vs. the bare runner.

What it measures: microseconds of host time per call of the dispatcher's lookups
(``Dispatcher.resolve`` of an untuned and of a tuned problem, ``pick``, ``get_dispatcher``; an
untuned call with just-in-time tuning on, whose miss goes through the miss hook: the reload time
check and the job already queued), of the eager public path ``autofp4.linear`` and of the runner
it calls directly, with bf16 ``F.linear`` for scale and, where the decode kernel serves the
problem, its bare compiled launch.

How (:func:`per_call_us`): host-only lookups as the median over rounds of the mean of many
calls (``time.perf_counter``); calls that launch GPU work one by one, with the GPU drained every
16 calls so that the launch queue stays short and the GPU's speed does not leak in. On the GPU
the kernels are asynchronous, so the eager numbers are the launch-side overhead the dispatcher
adds, which is what matters for decode.

Writes ``dispatch.json`` and ``dispatch.md`` (the table) to ``--out`` (default
``docs/results/<device>/``).

    python scripts/bench_dispatch.py                      # CUDA if present, else CPU
    python scripts/bench_dispatch.py --device cpu --calls 2000
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _common import provenance, provenance_line, results_dir

import autofp4
from autofp4.problem import ProblemKey
from autofp4.dispatch import Dispatcher, get_dispatcher


def per_call_us(fn, calls: int, rounds: int = 5, sync=None, drain_every: int = 16) -> float:
    """Host time of one call of ``fn``, in microseconds.

    Without ``sync`` (host-only work): the median over ``rounds`` of the mean time of ``calls``
    calls. With ``sync`` (calls that launch GPU work): the median of the individually timed calls,
    with the GPU drained (``sync``, untimed) every ``drain_every`` calls. Timing whole batches
    there measures the GPU instead of the host as soon as the launch queue fills up: a kernel
    that runs as long as its launch takes, as the small decode kernels do, makes every call
    wait for a queue slot."""
    for _ in range(min(calls, 100)):
        fn()
    if sync:
        sync()
    if sync is None:
        res = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            res.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(res)
    one = []
    for i in range(rounds * calls):
        if i % drain_every == 0:
            sync()
        t0 = time.perf_counter()
        fn()
        one.append(time.perf_counter() - t0)
    sync()
    return statistics.median(one) * 1e6


def _decode_layers(w, cfg, x, calls, sync) -> list[tuple[str, float]]:
    """The decode kernel's layers: the bare compiled launch (preallocated tensors), then the
    kernel module's ``run`` (argument checks, output and split-K workspace allocation)."""
    from autofp4.kernels import w4a16_decode as D

    n, k = w.n, w.k
    fn = D._compile(cfg, n, k, w.fmt, "bfloat16", False)
    p = D.pack_weight(w)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = (torch.empty(cfg.k_split, m, -(-n // 16) * 16, dtype=torch.float32, device=x.device)
          if D._needs_workspace(cfg) else torch.empty(1, dtype=torch.float32, device=x.device))
    cnt = torch.zeros(-(-n // 16), dtype=torch.int32, device=x.device)
    dummy = torch.zeros(1, dtype=x.dtype, device=x.device)
    run = D.compile_kernel(cfg, n, k, w.fmt, "bfloat16")
    return [
        (f"bare decode launch {cfg}", per_call_us(lambda: fn(x, p.data, p.scales, p.alpha, out, dummy, ws, cnt, p.scale_add[0], 0), calls, sync=sync)),
        ("decode run(x, packed)", per_call_us(lambda: run(x, p, None), calls, sync=sync)),
    ]


def _module_rows(w, dense, x, calls, sync) -> list[tuple[str, float]]:
    """What a transformers model pays per layer: ``FP4Linear.forward`` on the 3-D activation
    ``[1, M, K]`` it passes, against ``nn.Linear`` with the dequantized weight on the same input."""
    from autofp4.nn import FP4Linear

    lin = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False, device=x.device, dtype=dense.dtype)
    lin.weight.data = dense
    fp4 = FP4Linear.from_linear(lin, w.fmt)
    x3 = x.unsqueeze(0)
    fp4(x3)  # packs the weight once
    nn_us = per_call_us(lambda: lin(x3), calls, sync=sync)
    fp4_us = per_call_us(lambda: fp4(x3), calls, sync=sync)
    return [("nn.Linear bf16 forward, x [1, M, K]", nn_us), ("FP4Linear.forward, x [1, M, K]", fp4_us),
            ("  FP4Linear.forward over nn.Linear (target <= 2 us)", fp4_us - nn_us)]


def _row_of(d: Dispatcher, key: ProblemKey, m: int):
    """A tuned row for ``key`` at ``m``'s bucket: the default config, as the tuner stores it."""
    from autofp4.dispatch import backend_source_hash, bucket_for
    from autofp4.schema import TuningRecord

    b, cfg = d.pick(key, m)
    config = b.config_dict(cfg)
    return TuningRecord(op=key.op, fmt=key.fmt, dtype=key.dtype, backend=b.name, m_bucket=bucket_for(m), n=key.n,
                        k=key.k, config=config, median_us=1.0, spread_us=0.0, samples=1,
                        backend_source=backend_source_hash(b, config), env=d.env)


def _autotuned_resolve_us(dev: torch.device, key: ProblemKey, m: int, calls: int) -> float:
    """An untuned resolve of the process-wide dispatcher inside ``autofp4.autotune``: the miss
    goes through the miss hook (the reload time check, the job found queued already; no worker
    is started: the job is marked as met before the first call)."""
    from autofp4.dispatch import bucket_for
    from autofp4.tuning import jit

    gd = get_dispatcher(dev)
    with autofp4.autotune(mode="background"):
        jit.active().seen.add((gd.device, (key, bucket_for(m))))
        return per_call_us(lambda: get_dispatcher(dev).resolve(key, m), calls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=20000, help="calls per round for the lookups")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--out", help="results directory (default: docs/results/<device>/)")
    args = p.parse_args()
    dev = torch.device(args.device)
    key = ProblemKey("linear", "nvfp4", "bfloat16", args.n, args.k)
    rows: list[tuple[str, float]] = []

    d = Dispatcher(dev, [])
    d.resolve(key, args.m)
    rows.append(("Dispatcher.resolve (memo hit, untuned)", per_call_us(lambda: d.resolve(key, args.m), args.calls)))
    dt = Dispatcher(dev, [_row_of(d, key, args.m)])
    dt.resolve(key, args.m)
    rows.append(("Dispatcher.resolve (memo hit, tuned)", per_call_us(lambda: dt.resolve(key, args.m), args.calls)))
    rows.append(("Dispatcher.pick (no memo)", per_call_us(lambda: d.pick(key, args.m), args.calls)))
    gd = get_dispatcher(dev)
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16)
    rows.append(("get_dispatcher(x.device)", per_call_us(lambda: get_dispatcher(x.device), args.calls)))
    rows.append(("get_dispatcher(x.device).resolve", per_call_us(lambda: gd.resolve(key, args.m), args.calls)))
    rows.append(("  the same with autotune on (job queued)", _autotuned_resolve_us(dev, key, args.m, args.calls)))

    if hasattr(autofp4, "linear"):
        w = autofp4.quantize(torch.randn(args.n, args.k, device=dev), "nvfp4")
        backend, cfg, runner = gd.resolve(key, args.m)
        prepared = w.packed(backend.name, backend.prepare)
        sync = torch.cuda.synchronize if dev.type == "cuda" else None
        calls = max(10, args.calls // 100) if dev.type == "cpu" else max(100, args.calls // 10)
        direct = per_call_us(lambda: runner(x, prepared, None), calls, sync=sync)
        full = per_call_us(lambda: autofp4.linear(x, w), calls, sync=sync)
        dense = w.dequantize(torch.bfloat16)
        rows.append(("F.linear bf16 eager (cuBLAS, for scale)",
                     per_call_us(lambda: torch.nn.functional.linear(x, dense), calls, sync=sync)))
        if backend.name == "sm90_w4a16" and cfg.kernel == "decode":
            rows += _decode_layers(w, cfg, x, calls, sync)
        rows.append((f"runner(x, w) direct [{backend.name}]", direct))
        rows.append(("autofp4.linear(x, w) eager", full))
        rows.append(("  overhead of autofp4.linear", full - direct))
        rows += _module_rows(w, dense, x, calls, sync)
        bare = next((us for name, us in rows if name.startswith("bare decode launch")), None)
        if bare is not None:  # the same config launched bare: the "added per eager call"
            rows.append(("  autofp4.linear over the bare launch (same config)", full - bare))

    doc = {**provenance(dev), "n": args.n, "k": args.k, "m": args.m,
           "rows": [{"measurement": name, "host_us_per_call": us} for name, us in rows]}
    width = max(len(r[0]) for r in rows)
    lines = [f"{'measurement'.ljust(width)}  host us/call", f"{'-' * width}  ------------"]
    lines += [f"{name.ljust(width)}  {us:12.3f}" for name, us in rows]
    md = (f"Host time per call, N={args.n} K={args.k} M={args.m}. {provenance_line(doc)}\n\n```\n"
          + "\n".join(lines) + "\n```\n")
    out = results_dir(args.out, dev)
    (out / "dispatch.json").write_text(json.dumps(doc, indent=1))
    (out / "dispatch.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
