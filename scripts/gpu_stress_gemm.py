"""Stress one GEMM config the way the tuner's timing and a served model run it: a CUDA graph of
back-to-back launches (dependent launch on or off) replayed many times, each run in its own
process so a fault ends only that run. A diagnostic, not a test: an intermittent fault (a race
at the end of the kernel) shows as some runs reporting ``FAULT``.

    python scripts/gpu_stress_gemm.py --n 57344 --k 8192 --runs 4 --replays 500 \\
        --config '{"tile_n": 64, "tile_m": 16, "tile_k": 256, "stages": 4, "split_k": 4,
                   "cluster_n": 2, "ctas_per_sm": 2}'

Prints one line per run: ``ok`` (the last output equals the first call's bit for bit), ``DIFF``
or ``FAULT``; then the counts.
"""
import argparse
import json
import subprocess
import sys


def one_run(n: int, k: int, fmt: str, cfg: dict, pdl: bool, graph_calls: int, replays: int) -> None:
    import torch

    from autofp4.formats import quantize
    from autofp4.kernels import sm90_w4a16_gemm as g

    c = g.Sm90GemmConfig(**cfg, pdl=pdl)
    err = g.validate(c, n, k, fmt, "bfloat16")
    if err:
        raise SystemExit(f"invalid config: {err}")
    w = quantize(torch.randn(n, k, device="cuda") * 0.05, fmt)
    packed = g.pack_weight(w)
    run = g.compile_kernel(c, n, k, fmt, "bfloat16")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    first = run(x, packed, None).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            out = run(x, packed, None)
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    print("ok" if torch.equal(out, first) else "DIFF")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--config", required=True, help="Sm90GemmConfig fields as JSON")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=500)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return one_run(a.n, a.k, a.fmt, json.loads(a.config), not a.no_pdl, a.graph_calls, a.replays)
    counts: dict[str, int] = {}
    for i in range(a.runs):
        r = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True, text=True,
                           timeout=300)
        lines = r.stdout.strip().splitlines()
        if r.returncode == 0 and lines:
            status = lines[-1]
        else:
            why = [ln for ln in r.stderr.splitlines() if "Error" in ln or "invalid config" in ln]
            status = "FAULT " + (why[-1] if why else f"exit {r.returncode}")[:160]
        counts[status.split()[0]] = counts.get(status.split()[0], 0) + 1
        print(f"run {i}: {status}", flush=True)
    print(" ".join(f"{s} {c}" for s, c in sorted(counts.items())))


if __name__ == "__main__":
    main()
