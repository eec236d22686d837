"""FP4 mixture-of-experts layers against a bf16 MoE in plain torch, on one GPU.

For each model's MoE layer (Qwen3-30B-A3B, gpt-oss-120b, Mixtral-8x7B, DeepSeek-V3 with its
experts split over 8 ranks: one rank's slice), each format and each token count T, in one run:

* **bf16**: the MoE in plain torch with no host synchronization: the routing metadata of
  :mod:`autofp4.routing`, the tokens gathered in expert order, ``torch._grouped_mm`` for the
  gate/up and the down projection (per-expert offsets on the device), SiLU-gated, the router
  weights applied and the top-k summed with ``index_add_``; CUDA-graph timing;
* **autofp4**: ``autofp4.moe`` on the FP4 weights (what the dispatcher runs: its tuned pick, else
  the backend's default). Where ``autofp4.moe`` cannot be captured in a CUDA graph (the
  reference backend reads the expert counts on the host) it is timed eagerly, which the table
  says (up to ``--max-t-eager`` tokens); a slice for expert parallelism runs with the
  ``expert_map`` of rank 0;
* **HBM floor**: the FP4 bytes (values + block scales) of the experts the batch hits, at the
  device-copy bandwidth measured in the same run; useful TFLOP/s = 2 x T x top-k x 3 x H x I /
  time (the pairs routed to the rank's experts, for a slice).

Each layer is timed twice: from given top-k weights and ids, and as a model runs it, from the
router's logits (``autofp4.moe(..., router_logits=, top_k=)``: the routing kernel and the
experts; the bf16 MoE after the same routing in torch ops, :func:`autofp4.router.route_torch`).
The routing alone is timed too: ``autofp4.route`` against those torch ops.

Routing: fixed-seed random router logits (normal), scored as the model does (softmax top-k,
renormalized; DeepSeek-V3: sigmoid with a random correction bias, group-limited top-8 of 8
groups, routed scaling 2.5), a different routing per rotated input set; the weights too are rotated, in as many copies as make one rotation read
more than twice the L2 (at most 4). Times are medians of interleaved rounds.

    python scripts/bench_moe.py                       # the four models, both formats, T = 1 .. 4096
    python scripts/bench_moe.py --models mixtral-8x7b --fmt nvfp4 --t 1,16
    python scripts/bench_moe.py --plot docs/results/nvidia-h200/moe.json   # tables and plot again

Writes ``moe.json``, ``moe.md`` and ``moe.png`` to ``--out`` (default ``docs/results/<gpu>/``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (ROOT, geomean, kernel_times, measure_copy_bandwidth, provenance, provenance_line,
                     require_gpu, results_dir)

#: model name (examples/<name>.json) -> expert-parallel ranks of the layer measured
MODELS: dict[str, int] = {"qwen3-30b-a3b": 1, "gpt-oss-120b": 1, "mixtral-8x7b": 1, "deepseek-v3": 8}
T_DEFAULT = "1,4,16,64,256,1024,4096"


def moe_shape(model: str, ep: int) -> dict:
    """``E`` (experts of the slice), ``E_global``, ``top_k``, ``H``, ``I`` of the model's MoE layer."""
    from autofp4.models import load_config, model_shapes

    cfg = load_config(ROOT / "examples" / f"{model}.json")
    whole = [s for s in model_shapes(cfg) if s.op == "moe"]
    part = [s for s in model_shapes(cfg, ep=ep) if s.op == "moe"]
    if not whole:
        raise SystemExit(f"{model} has no MoE layer")
    return {"E": part[0].experts, "E_global": whole[0].experts, "top_k": whole[0].topk,
            "H": whole[0].hidden, "I": whole[0].intermediate}


#: each model's router (autofp4.route's keyword arguments; softmax top-k, renormalized, elsewhere)
ROUTERS: dict[str, dict] = {"deepseek-v3": dict(scoring="sigmoid", n_group=8, topk_group=4,
                                                routed_scaling_factor=2.5)}


def router_of(model: str, e_global: int, gen: torch.Generator, dev: torch.device) -> dict:
    """``autofp4.route``'s keyword arguments for the model's router (with its correction bias)."""
    kw = dict(ROUTERS.get(model, {}))
    if kw.get("scoring") == "sigmoid":
        kw["correction_bias"] = torch.rand(e_global, generator=gen, device=dev) * 0.1
    return kw


def torch_route(logits: torch.Tensor, top_k: int, kw: dict):
    """The routing of ``logits`` in torch ops (``autofp4.route``'s arguments ``kw``)."""
    from autofp4.router import RouterSpec, route_torch

    spec = RouterSpec.checked(logits.shape[1], top_k, kw.get("scoring", "softmax"), True, kw.get("n_group", 1),
                              kw.get("topk_group", 1), kw.get("routed_scaling_factor", 1.0))
    return route_torch(logits, spec, kw.get("correction_bias"))


def routing(t: int, e_global: int, top_k: int, gen: torch.Generator, dev: torch.device):
    """Uniform random top-k routing of ``t`` tokens: (weights fp32 [t, k], ids int32 [t, k])."""
    logits = torch.randn(t, e_global, generator=gen, device=dev)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def hit_experts(ids: torch.Tensor, lo: int, e: int) -> int:
    """Distinct experts of the slice ``[lo, lo + e)`` that ``ids`` routes to."""
    u = torch.unique(ids)
    return int(((u >= lo) & (u < lo + e)).sum())


def expert_fp4_bytes(h: int, i: int, fmt: str) -> int:
    """FP4 bytes (values + block scales) of one expert's w13 [2I, H] and w2 [H, I]."""
    from autofp4.problem import BLOCK_SIZE

    scale_bytes = 1  # E4M3 or E8M0: one byte per block
    per_value = 0.5 + scale_bytes / BLOCK_SIZE[fmt]
    return int(round((2 * i * h + h * i) * per_value))


def useful_flops(pairs: int, h: int, i: int) -> float:
    return 2.0 * pairs * 3 * h * i


def bf16_moe(x, w13t, w2t, tw, ti, e: int, expert_map=None):
    """The bf16 MoE in plain torch (see the module docstring): ``w13t [E, H, 2I]``, ``w2t [E, I, H]``
    (the transposed weights ``torch._grouped_mm`` multiplies by)."""
    from autofp4.routing import moe_routing

    r = moe_routing(ti, e, 1, expert_map=expert_map)
    top_k = ti.shape[1]
    rows = r.sorted_rows.long()
    valid = rows >= 0
    rows_c = rows.clamp(min=0)
    tok = rows_c // top_k
    offs = torch.cumsum(r.counts, 0).to(torch.int32)
    xs = x[tok]
    gu = torch._grouped_mm(xs, w13t, offs=offs)
    inter = w13t.shape[-1] // 2
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(act, w2t, offs=offs)
    # rows past the last expert's (pairs routed to other ranks) are not computed: masked, not weighted
    contrib = torch.where(valid[:, None], y.float() * tw.reshape(-1)[rows_c, None].float(), 0.0)
    out = torch.zeros(x.shape[0], w2t.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, contrib)
    return out.to(x.dtype)


def _time(fn, args, rounds: int, reps: int, graph: bool) -> float:
    """Median over ``rounds`` of the median time per call (CUDA graph or eager)."""
    from autofp4.timing import time_cuda

    return statistics.median(time_cuda(fn, args, warmup=2 if graph else 1, reps=reps, use_graph=graph).median_us
                             for _ in range(rounds))


def bench_model(model: str, ep: int, fmts: list[str], ts: list[int], args, bw: float, l2: int) -> list[dict]:
    import autofp4
    from autofp4.dispatch import get_dispatcher
    from autofp4.problem import ProblemKey
    from autofp4.routing import rank_expert_map
    from autofp4.timing import copies_for_cold_l2

    dev = torch.device("cuda")
    s = moe_shape(model, ep)
    e, eg, k, h, i = s["E"], s["E_global"], s["top_k"], s["H"], s["I"]
    gen = torch.Generator(device=dev).manual_seed(4321 + eg + h)
    expert_map = None
    if ep > 1:  # rank 0 holds experts [0, e)
        expert_map = rank_expert_map(eg, e, device=dev)
    rkw = router_of(model, eg, gen, dev)
    rows = []
    for fmt in fmts:
        per_expert = expert_fp4_bytes(h, i, fmt)
        copies = copies_for_cold_l2(e * per_expert, l2, max_copies=4)
        dense = [(torch.randn(e, 2 * i, h, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02,
                  torch.randn(e, h, i, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        fp4 = [(autofp4.quantize(a, fmt), autofp4.quantize(b, fmt)) for a, b in dense]
        dense_t = [(a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()) for a, b in dense]
        del dense
        for t in ts:
            picked = get_dispatcher(dev).pick(ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k), t)[0].name
            sets = max(copies, 4)
            logits = [torch.randn(t, eg, generator=gen, device=dev) for _ in range(sets)]
            inputs = [(torch.randn(t, h, device=dev, generator=gen, dtype=torch.bfloat16), *torch_route(lg, k, rkw))
                      for lg in logits]
            hits = statistics.mean(hit_experts(ti, 0, e) for _, _, ti in inputs)
            pairs = statistics.mean(int(((ti >= 0) & (ti < e)).sum()) for _, _, ti in inputs)
            floor_us = hits * per_expert / bw * 1e6
            b_args = [(x, *dense_t[j % copies], tw, ti) for j, (x, tw, ti) in enumerate(inputs)]
            bf16_us = _time(lambda x, a, b, tw, ti: bf16_moe(x, a, b, tw, ti, e, expert_map), b_args,
                            args.rounds, args.reps, graph=True)
            bl_args = [(x, *dense_t[j % copies], lg) for j, ((x, _, _), lg) in enumerate(zip(inputs, logits))]
            bf16_logits_us = _time(lambda x, a, b, lg: bf16_moe(x, a, b, *torch_route(lg, k, rkw), e, expert_map),
                                   bl_args, args.rounds, args.reps, graph=True)
            row = {"model": model, "ep": ep, "fmt": fmt, "T": t, "E": e, "top_k": k, "H": h, "I": i,
                   "hit_experts": hits, "pairs": pairs, "floor_us": floor_us, "bf16_us": bf16_us,
                   "bf16_logits_us": bf16_logits_us, "autofp4_us": None, "autofp4_timing": None}
            graph = picked != "reference"  # the reference backend syncs with the host: not capturable
            if graph:
                row["route_us"] = _time(lambda lg: autofp4.route(lg, k, **rkw), [(lg,) for lg in logits],
                                        args.rounds, args.reps, graph=True)
                row["torch_route_us"] = _time(lambda lg: torch_route(lg, k, rkw), [(lg,) for lg in logits],
                                              args.rounds, args.reps, graph=True)
            if graph or t <= args.max_t_eager:
                q_args = [(x, *fp4[j % copies], tw, ti) for j, (x, tw, ti) in enumerate(inputs)]
                fn = lambda x, a, b, tw, ti: autofp4.moe(x, a, b, tw, ti, activation="silu",  # noqa: E731
                                                         expert_map=expert_map)
                reps = args.reps if graph else max(1, args.reps // 5)
                row["autofp4_us"] = _time(fn, q_args, args.rounds, reps, graph=graph)
                ql_args = [(x, *fp4[j % copies], lg) for j, ((x, _, _), lg) in enumerate(zip(inputs, logits))]
                fl = lambda x, a, b, lg: autofp4.moe(x, a, b, activation="silu", expert_map=expert_map,  # noqa: E731
                                                     router_logits=lg, top_k=k, **rkw)
                row["autofp4_logits_us"] = _time(fl, ql_args, args.rounds, reps, graph=graph)
                row["autofp4_timing"] = "graph" if graph else "eager"
                if args.fp8 and graph:  # FP8 activations (W4A8, opt-in numerics)
                    f8 = lambda x, a, b, tw, ti: autofp4.moe(x, a, b, tw, ti, activation="silu",  # noqa: E731
                                                             expert_map=expert_map, act_dtype="fp8")
                    row["w4a8_us"] = _time(f8, q_args, args.rounds, reps, graph=True)
                row["autofp4_backend"] = picked
                row["autofp4_config"] = repr(get_dispatcher(dev).pick(ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k), t)[1])
                if t in args.profile_t:
                    try:
                        row["profile"] = kernel_profile(fn, q_args)
                        row["profile_logits"] = kernel_profile(fl, ql_args)
                    except Exception as e:  # the timings stand without it
                        row["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                if args.kernels and graph:
                    row.update(each_kernel(ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k), t, q_args, args,
                                           expert_map))
            rows.append(row)
            print(_row_line(row), flush=True)
        del fp4, dense_t
        torch.cuda.empty_cache()
    return rows


def kernel_profile(fn, q_args: list, calls: int = 20) -> dict:
    """The GPU kernels of one layer call (``--profile-t``), from ``torch.profiler`` over ``calls``
    eager calls after a warm-up: kernels per call, their summed GPU time per call (the graph
    time less this is launch gaps), and each kernel's time and count per call."""
    from torch.profiler import ProfilerActivity, profile

    for a in q_args[:2]:
        fn(*a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for j in range(calls):
            fn(*q_args[j % len(q_args)])
        torch.cuda.synchronize()
    names: dict[str, list] = {}
    for name, (t, c) in kernel_times(prof).items():
        n = names.setdefault(name[:100], [0.0, 0])
        n[0] += t
        n[1] += c
    return {"kernels_per_call": sum(c for _, c in names.values()) / calls,
            "gpu_us_per_call": sum(t for t, _ in names.values()) / calls,
            "kernels": [{"name": k, "us_per_call": t / calls, "per_call": c / calls}
                        for k, (t, c) in sorted(names.items(), key=lambda kv: -kv[1][0])]}


def each_kernel(key, t: int, q_args: list, args, expert_map) -> dict:
    """The Hopper backend's default config of each MoE kernel, forced, timed like autofp4.moe:
    ``{"<kernel>_us": time}`` (where the config can run the layer)."""
    from autofp4.backends import get_backend, sm90_heuristics as H

    b = get_backend("sm90_w4a16")
    out = {}
    for tag, default in (("moe_decode", H.moe_decode_default), ("moe_gemm", H.moe_gemm_default)):
        cfg = default(key.n, key.k, key.fmt, key.dtype, key.experts, key.topk, t)
        if b.is_valid(cfg, key) is not None:
            continue
        run = b.compile(cfg, key)
        fn = lambda x, a, c, tw, ti: run(x, a.packed(b.name, b.prepare), c.packed(b.name, b.prepare),  # noqa: E731
                                         tw, ti, "silu", expert_map)
        out[f"{tag}_us"] = _time(fn, q_args, args.rounds, args.reps, graph=True)
    return out


def _row_line(r: dict) -> str:
    f = f"{r['model']} ep{r['ep']} {r['fmt']} T={r['T']}: bf16 {r['bf16_us']:.1f} us"
    if r["autofp4_us"] is not None:
        f += f", autofp4 {r['autofp4_us']:.1f} us ({r['autofp4_timing']}, {r.get('autofp4_config', '')})"
    for tag in ("moe_decode", "moe_gemm"):
        if f"{tag}_us" in r:
            f += f", {tag} {r[tag + '_us']:.1f} us"
    f += f", floor {r['floor_us']:.1f} us; from logits: bf16 {r['bf16_logits_us']:.1f} us"
    if r.get("autofp4_logits_us") is not None:
        f += f", autofp4 {r['autofp4_logits_us']:.1f} us"
    if r.get("route_us") is not None:
        f += f"; routing {r['route_us']:.1f} us (torch ops {r['torch_route_us']:.1f})"
    return f


def derive(r: dict) -> dict:
    """The row's speedup over bf16, percent of the HBM floor and useful TFLOP/s (of autofp4 where
    timed, and of the bf16 MoE)."""
    out = dict(r)
    flops = useful_flops(r["pairs"], r["H"], r["I"])
    out["bf16_tflops"] = flops / (r["bf16_us"] * 1e-6) / 1e12
    a = r.get("autofp4_us")
    out["speedup"] = r["bf16_us"] / a if a else None
    out["floor_pct"] = 100.0 * r["floor_us"] / a if a else None
    out["autofp4_tflops"] = flops / (a * 1e-6) / 1e12 if a else None
    al = r.get("autofp4_logits_us")
    out["logits_speedup"] = r["bf16_logits_us"] / al if al and r.get("bf16_logits_us") else None
    return out


def render(doc: dict) -> str:
    rows = [derive(r) for r in doc["rows"]]
    lines = [f"FP4 MoE layers against a bf16 MoE in plain torch. {provenance_line(doc)} Copy bandwidth "
             f"{doc['copy_bandwidth_tbs']:.2f} TB/s. Times in us (bf16: CUDA graph; autofp4: as marked)."
             + ("" if not doc.get("runs") else " Rows of more than one run (a row's `run` in the JSON): "
                + "; ".join(doc["runs"]) + "."), "",
             "| model | EP | fmt | T | hit experts | bf16 | autofp4 | timing | speedup | HBM floor | % of floor | "
             "autofp4 TFLOP/s | bf16 TFLOP/s |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    kernels = [tag for tag in ("moe_decode", "moe_gemm") if any(f"{tag}_us" in r for r in rows)]
    if kernels:  # the forced default of each kernel
        lines[2] += "".join(f" {tag} |" for tag in kernels)
        lines[3] += "---:|" * len(kernels)
    for r in rows:
        a = r["autofp4_us"]
        lines.append(f"| {r['model']} | {r['ep']} | {r['fmt']} | {r['T']} | {r['hit_experts']:.1f} | {r['bf16_us']:.1f} | "
                     + (f"{a:.1f} | {r['autofp4_timing']} | {r['speedup']:.2f}x | " if a else "- | - | - | ")
                     + f"{r['floor_us']:.1f} | " + (f"{r['floor_pct']:.0f}% | {r['autofp4_tflops']:.1f} | " if a else "- | - | ")
                     + f"{r['bf16_tflops']:.1f} |"
                     + "".join(f" {r[t + '_us']:.1f} |" if f"{t}_us" in r else " - |" for t in kernels))
    if any(r.get("logits_speedup") for r in rows):
        lines += ["", "The layer from router logits (routing included; bf16: the same routing in torch ops), and "
                  "the routing alone (`autofp4.route` against those torch ops), CUDA graphs, us:", "",
                  "| model | EP | fmt | T | bf16 | autofp4 | speedup | autofp4.route | torch ops |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r.get("logits_speedup"):
                lines.append(f"| {r['model']} | {r['ep']} | {r['fmt']} | {r['T']} | {r['bf16_logits_us']:.1f} | "
                             f"{r['autofp4_logits_us']:.1f} | {r['logits_speedup']:.2f}x | "
                             + (f"{r['route_us']:.1f} | {r['torch_route_us']:.1f} |" if r.get("route_us") else "- | - |"))
    if any(r.get("w4a8_us") for r in rows):
        lines += ["", "FP8 activations (`act_dtype=\"fp8\"`, W4A8: other numerics, opt-in) against the bf16 MoE and "
                  "the bf16-activation layer (W4A16), from given routing, CUDA graphs, us:", "",
                  "| model | EP | fmt | T | bf16 | W4A16 | W4A8 | W4A8 x bf16 | W4A8 x W4A16 | W4A8 TFLOP/s |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            w8 = r.get("w4a8_us")
            if w8 and r["autofp4_us"]:
                tf = useful_flops(r["pairs"], r["H"], r["I"]) / (w8 * 1e-6) / 1e12
                lines.append(f"| {r['model']} | {r['ep']} | {r['fmt']} | {r['T']} | {r['bf16_us']:.1f} | "
                             f"{r['autofp4_us']:.1f} | {w8:.1f} | {r['bf16_us'] / w8:.2f}x | "
                             f"{r['autofp4_us'] / w8:.2f}x | {tf:.0f} |")
    timed = [r for r in rows if r["speedup"]]
    if timed:
        lines += ["", "Geomean speedup of autofp4 over bf16, per format (timed rows):", ""]
        for fmt in sorted({r["fmt"] for r in timed}):
            sel = [r for r in timed if r["fmt"] == fmt]
            lines.append(f"- {fmt}: {geomean(r['speedup'] for r in sel):.3f}x over {len(sel)} rows")
        lines += ["", "Geomean percent of the HBM floor, per format and T range (the issue's targets: "
                  "T = 1 at least 50%, T = 16-256 at least 70%):", ""]
        for fmt in sorted({r["fmt"] for r in timed}):
            for what, ts in (("T = 1", (1,)), ("T = 16-256", (16, 64, 256))):
                sel = [r for r in timed if r["fmt"] == fmt and r["T"] in ts]
                if sel:
                    lines.append(f"- {fmt}, {what}: {geomean(r['floor_pct'] for r in sel):.0f}% over {len(sel)} rows")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'autofp4[plot]')", file=sys.stderr)
        return
    rows = [derive(r) for r in doc["rows"]]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for fmt in sorted({r["fmt"] for r in rows}):
            sel = [r for r in rows if r["model"] == model and r["fmt"] == fmt]
            ax.plot([r["T"] for r in sel], [r["bf16_us"] / r["floor_us"] for r in sel], "k--", alpha=0.4,
                    label="bf16 / FP4 floor" if fmt == "nvfp4" else None)
            pts = [(r["T"], r["speedup"]) for r in sel if r["speedup"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"autofp4 {fmt}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("tokens T")
    axes[0][0].set_ylabel("speedup over bf16 MoE")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"MoE layer, {doc.get('gpu', '')}, {doc.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def write(doc: dict, out: Path) -> None:
    (out / "moe.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "moe.md").write_text(render(doc))
    plot(doc, out / "moe.png")
    print(render(doc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--fmt", default="nvfp4,mxfp4")
    ap.add_argument("--t", default=T_DEFAULT, help="token counts")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per timing")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-t-eager", type=int, default=1024,
                    help="largest T at which a backend that cannot be captured in a CUDA graph is timed "
                         "(eagerly, slow)")
    ap.add_argument("--kernels", action="store_true",
                    help="also time the default config of each Hopper MoE kernel, forced (where the two cross)")
    ap.add_argument("--profile-t", default="", help="token counts whose tuned layer call is also profiled "
                    "(its GPU kernels: count, time; in the JSON)")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the layer with FP8 activations (act_dtype='fp8', W4A8)")
    ap.add_argument("--out", help="results directory (default: docs/results/<gpu>/)")
    ap.add_argument("--plot", metavar="JSON", help="only re-render the tables and plot of a saved run, next to it")
    args = ap.parse_args()
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        write(doc, Path(args.plot).parent)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    code = require_gpu("bench_moe.py", "--plot JSON to render a saved run")
    if code is not None:
        return code
    from autofp4.timing import l2_cache_bytes

    out = results_dir(args.out)
    bw = measure_copy_bandwidth()
    l2 = l2_cache_bytes(torch.device("cuda"))
    doc = {**provenance(), "copy_bandwidth_tbs": bw / 1e12, "rows": []}
    ts = sorted(int(v) for v in args.t.split(","))
    args.profile_t = {int(v) for v in args.profile_t.split(",") if v.strip()}
    for m in models:
        doc["rows"] += bench_model(m, MODELS[m], args.fmt.split(","), ts, args, bw, l2)
        (out / "moe.json").write_text(json.dumps(doc, indent=1) + "\n")
    write(doc, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
