"""Whole transformers models, bf16 against autofp4's NVFP4 and MXFP4 (``quantize_model``).

For each example config (``examples/*.json``, or ``--configs``), a transformers model with random
bf16 weights (``--layers N`` keeps the first N decoder layers, for MoE models that do not fit whole;
the default keeps all of them for dense models and 8 for MoE ones), and for each variant (bf16,
NVFP4, MXFP4; ``--fmts nvfp4+lm_head`` also quantizes ``lm_head``, which ``--skip`` keeps in bf16
by default; ``--fmts nvfp4+fp8`` runs the FP4 layers with FP8 activations, W4A8, its ``cos_deq``
against the bf16-activation model on the dequantized weights) and mode (``eager``; ``compiled``: a static KV cache and ``torch.compile`` with
torch's CUDA graphs; ``graph``: the whole decode step, greedy sampling included, in one CUDA graph;
see :func:`decoder`):

* decode tokens/s at batch 1, 8 and 64 (``--batches``): one new token per sequence per step on a
  KV cache pre-filled with ``--context`` tokens, median over ``--steps`` steps;
* prefill tokens/s of ``--prefill`` tokens (batch 1);
* output agreement: the cosine of the prefill's last-token logits against the same model with
  the FP4 weights dequantized to bf16 (``deq``: the kernels' own error) and against the bf16
  model (``bf16``: kernels plus quantization).

``--profile`` also splits the batch-1 decode step's time: its wall time and the GPU kernel time in
linear layers, attention and the rest (``torch.profiler``). ``--autotune BUDGET_S`` first tunes
each FP4 model's misses in eager warm-up passes (blocking just-in-time tuning, rows in ``--db``).

The table is printed last and written with the JSON to ``--out`` (default
``docs/results/<gpu>/``: ``model.md``, ``model.json``), both rewritten after every row, so a run
stopped part way keeps what it measured.

    python scripts/bench_model.py                                            # on the GPU
    python scripts/bench_model.py --configs examples/qwen3-30b-a3b.json --layers 12
    python scripts/bench_model.py --device cpu --tiny --out /tmp/r           # a smoke run anywhere
"""
from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import ROOT, kernel_times, provenance, provenance_line, results_dir

FMTS = ("nvfp4", "mxfp4")
#: a variant's activations (``FORMAT+fp8``: quantize_model(..., activations="fp8"), W4A8)
ACTS = ("fp8", "fp8-prefill")
EXTRAS = ("lm_head",) + ACTS
MODES = ("eager", "compiled", "graph")
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
TINY = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, num_hidden_layers=2)


def load_config(path: Path, layers: int | None, tiny: bool):
    from transformers import AutoConfig

    d = json.loads(Path(path).read_text())
    d.pop("quantization_config", None)
    for k in ("torch_dtype", "dtype"):
        d.pop(k, None)
    if tiny:
        d.update({k: v for k, v in TINY.items() if k in d or k in ("head_dim",)})
        for f in MOE_FIELDS:
            if f in d:
                d[f] = min(d[f], 8)
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(d.get(k), int) and d[k] >= d["vocab_size"]:
                d[k] = None
    moe = any(d.get(f) for f in MOE_FIELDS)
    n = layers if layers else (d["num_hidden_layers"] if not moe or tiny else 8)
    d["num_hidden_layers"] = min(n, d["num_hidden_layers"])
    for k in ("first_k_dense_replace",):
        if k in d:
            d[k] = min(d[k], d["num_hidden_layers"] - 1)
    if "layer_types" in d:
        d["layer_types"] = d["layer_types"][: d["num_hidden_layers"]]
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d), moe


def build(config, device, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def dequantized(model):
    """A bf16 copy of an FP4 model with every FP4 weight dequantized into a dense module."""
    from torch import nn

    from autofp4.integrations.transformers import FP4Experts
    from autofp4.nn import FP4FusedLinear, FP4Linear, FP4LinearPart

    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        if isinstance(m, FP4FusedLinear):  # its parts get their rows of it
            delattr(parent, child)
        elif isinstance(m, (FP4Linear, FP4LinearPart)):
            w = m.fp4_weight()
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=w.data.device,
                            dtype=torch.bfloat16)
            lin.weight.data = w.dequantize(torch.bfloat16)
            if m.bias is not None:
                lin.bias.data = m.bias.data.to(torch.bfloat16)
            setattr(parent, child, lin)
        elif isinstance(m, FP4Experts):
            setattr(parent, child, _DenseExperts(m))
    return out


class _DenseExperts(torch.nn.Module):
    """FP4Experts' computation with the dequantized weights, token by token over the experts."""

    def __init__(self, m) -> None:
        super().__init__()
        self.w13 = m.fp4_weight("gate_up_proj").dequantize(torch.bfloat16)
        self.w2 = m.fp4_weight("down_proj").dequantize(torch.bfloat16)
        self.b13, self.b2, self.activation = m.gate_up_proj_bias, m.down_proj_bias, m.activation

    def forward(self, x, top_k_index, top_k_weights):
        from autofp4.kernels._moe_act import SWIGLU_ALPHA, SWIGLU_LIMIT

        out = torch.zeros_like(x, dtype=torch.float32)
        i = self.w13.shape[1] // 2
        for e in top_k_index.unique().tolist():
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)
            gu = x[tok] @ self.w13[e].T
            if self.b13 is not None:
                gu = gu + self.b13[e].to(gu.dtype)
            g, u = gu[:, :i].float(), gu[:, i:].float()
            if self.activation == "swigluoai":
                g, u = g.clamp(max=SWIGLU_LIMIT), u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
                a = g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)
            elif self.activation == "gelu":
                a = torch.nn.functional.gelu(g, approximate="tanh") * u
            else:
                a = torch.nn.functional.silu(g) * u
            y = a.to(x.dtype) @ self.w2[e].T
            if self.b2 is not None:
                y = y + self.b2[e].to(y.dtype)
            out.index_add_(0, tok, y.float() * top_k_weights[tok, slot, None].float())
        return out.to(x.dtype)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_LINEAR = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|w4a16|decode", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa", re.I)


def breakdown(run_step, steps: int, device) -> dict:
    """Where a decode step's time goes (``--profile``): the step's wall time, and the GPU kernel
    time per step split into linear layers (GEMM/GEMV and autofp4's kernels), attention and the
    rest (norms, rotary, residuals, sampling, copies), from ``torch.profiler`` over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
    sums = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    names: dict[str, list] = {}
    count = 0
    for name, (t, c) in kernel_times(prof).items():
        cat = "linear" if _LINEAR.search(name) else "attention" if _ATTENTION.search(name) else "other"
        sums[cat] += t
        count += c
        n = names.setdefault(name[:90], [cat, 0.0, 0])
        n[1] += t
        n[2] += c
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:20]
    return {"step_ms": wall * 1e3, **{f"{k}_ms": v / steps / 1e3 for k, v in sums.items()},
            "kernels_per_step": count / steps,
            "top": [{"name": k, "cat": c, "ms_per_step": t / steps / 1e3, "calls_per_step": n / steps}
                    for k, (c, t, n) in top]}


def decoder(model, config, batch: int, context: int, steps: int, mode: str, device):
    """A greedy decode loop's step for ``mode``, after ``context`` prompt tokens: ``(step, last)``;
    ``step()`` runs one step (one new token per sequence), ``last()`` is ``(tokens, logits)``: the
    last token of each sequence ([batch, 1]) and the logits it was picked from ([batch, vocab]).

    ``eager``: a dynamic cache, the model's forward as it is; ``compiled``: a static cache and
    ``torch.compile(mode="reduce-overhead")`` of the forward (torch's CUDA graphs around the
    compiled parts, the sampling outside them); ``graph``: a static cache, ``torch.compile`` of the
    forward without torch's graphs, and the whole step, forward, greedy sampling and the position
    advance, captured in one CUDA graph that replays on static token and position buffers (on the
    CPU the same step runs uncaptured)."""
    import inspect

    from transformers import DynamicCache, StaticCache

    ids = torch.randint(0, config.vocab_size, (batch, context), device=device)
    static = mode in ("compiled", "graph")
    cache = (StaticCache(config=config, max_cache_len=context + 2 * steps + 16) if static else
             DynamicCache(config=config))
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=True, **{kw: cache})
    nxt = out.logits[:, -1:].argmax(-1)
    held = {"logits": out.logits[:, -1]}
    pos = torch.full((1,), context, device=device, dtype=torch.long)
    fwd = model.forward
    if mode == "compiled":
        fwd = torch.compile(fwd, mode="reduce-overhead" if device.type == "cuda" else "default", dynamic=False)
    elif mode == "graph" and device.type == "cuda":
        fwd = torch.compile(fwd, dynamic=False)

    def step() -> None:
        o = fwd(input_ids=nxt, cache_position=pos, use_cache=True, **{kw: cache})
        nxt.copy_(o.logits[:, -1:].argmax(-1))
        pos.add_(1)
        held["logits"] = o.logits[:, -1]

    if mode != "graph" or device.type != "cuda":
        return step, lambda: (nxt, held["logits"])
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile, pack the weights and build the kernels' state before capture
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, lambda: (nxt, held["logits"])


def decode_rate(model, config, batch: int, context: int, steps: int, mode: str, device,
                profile_into: dict | None = None) -> float:
    """Decode tokens/s of :func:`decoder`'s loop, median over ``steps`` synchronized steps after two
    warm-up steps (``profile_into``: a dict the step's :func:`breakdown` is put in, after them)."""
    with torch.no_grad():
        step, _ = decoder(model, config, batch, context, steps, mode, device)
        times = []
        for s in range(steps + 2):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if s >= 2:
                times.append(time.perf_counter() - t0)
        if profile_into is not None:
            profile_into.update(breakdown(step, min(steps, 5), device))
    return batch / statistics.median(times)


def prefill(model, ids, reps: int, device) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()
        t = _timed(lambda: model(ids), device, reps)
    return ids.numel() / t, logits


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def autotune_warmup(model, config, args, device) -> float:
    """Seconds of eager warm-up passes inside ``autofp4.autotune(mode="blocking")``: one forward
    at each decode batch (``[b, 1]`` tokens) and the prefill, so that every linear shape of the
    model meets its decode and prefill M buckets and the misses are tuned (rows in the user DB)."""
    import autofp4

    t0 = time.perf_counter()
    with torch.no_grad(), autofp4.autotune(mode="blocking", budget_s=args.autotune, ops=("linear",)):
        for b in args.batches:
            model(torch.randint(0, config.vocab_size, (b, 1), device=device))
        model(torch.randint(0, config.vocab_size, (1, args.prefill), device=device))
    _sync(device)
    return time.perf_counter() - t0


def bench_config(path: Path, args, device, on_row) -> None:
    """Measure one config, passing each row to ``on_row`` as soon as it is measured."""
    import autofp4

    config, moe = load_config(path, args.layers, args.tiny)
    base = build(config, device)
    ids = torch.randint(0, config.vocab_size, (1, args.prefill), device=device)
    _, bf16_logits = prefill(base, ids, 1, device)
    variants = [("bf16", base)] + [(fmt, None) for fmt in args.fmts]
    for name, model in variants:
        ref_logits = None
        if model is None:
            model = copy.deepcopy(base)
            fmt, *extras = name.split("+")
            skip = ([s for s in args.skip if not any(fnmatch.fnmatch(n, s) for n in ("lm_head", "model.lm_head"))]
                    if "lm_head" in extras else args.skip)
            act = [e for e in extras if e in ACTS]
            autofp4.quantize_model(model, fmt, skip=skip, fuse=not args.no_fuse,
                                   **({"activations": act[0]} if act else {}))
            ref_logits = prefill(dequantized(model), ids, 1, device)[1]
        warmup_s = autotune_warmup(model, config, args, device) if name != "bf16" and args.autotune else None
        for mode in args.modes:
            row = {"config": path.stem, "layers": config.num_hidden_layers, "moe": moe, "variant": name,
                   "mode": mode, "autotune_warmup_s": warmup_s}
            try:
                for b in (args.batches if mode == "eager" else args.compiled_batches):
                    prof = {} if args.profile and b == 1 else None
                    row[f"decode_b{b}"] = decode_rate(model, config, b, args.context, args.steps, mode, device, prof)
                    if prof:
                        row["profile_b1"] = prof
                row["prefill"], logits = prefill(model, ids, args.reps, device)
                row["cos_bf16"] = cosine(logits, bf16_logits)
                row["cos_deq"] = None if ref_logits is None else cosine(logits, ref_logits)
            except Exception as e:  # the other rows still count: the failure is reported in this one
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                torch._dynamo.reset()
            print(json.dumps(row), file=sys.stderr)
            on_row(row)
        del model


def table(rows: list[dict], batches) -> str:
    cols = ["config", "layers", "variant", "mode"] + [f"decode_b{b}" for b in batches] + ["prefill", "cos_deq",
                                                                                          "cos_bf16", "autotune_warmup_s"]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    lines = [head]
    errors = [f"{r['config']} {r['variant']} {r['mode']}: {r['error']}" for r in rows if r.get("error")]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.4f}" if c.startswith("cos") else f"{v:.1f}" if c.endswith("_s") else
                         f"{v:,.0f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "speedup over bf16 (same config and mode):", ""]
    rate_cols = [c for c in cols if c.startswith("decode_") or c == "prefill"]
    lines += ["| config | variant | mode | " + " | ".join(rate_cols) + " |", "|" + "---|" * (3 + len(rate_cols))]
    base = {(r["config"], r["mode"]): r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        b = base.get((r["config"], r["mode"]))
        if r["variant"] == "bf16" or b is None:
            continue
        cells = ["-" if r.get(c) is None or not b.get(c) else f"{r[c] / b[c]:.2f}x" for c in rate_cols]
        lines.append(f"| {r['config']} | {r['variant']} | {r['mode']} | " + " | ".join(cells) + " |")
    profiled = [r for r in rows if r.get("profile_b1")]
    if profiled:
        lines += ["", "batch-1 decode step, ms (GPU kernel time per step by kind, torch.profiler):", "",
                  "| config | variant | mode | step wall | GPU linear | GPU attention | GPU other | kernels |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in profiled:
            p = r["profile_b1"]
            lines.append(f"| {r['config']} | {r['variant']} | {r['mode']} | {p['step_ms']:.2f} | {p['linear_ms']:.2f} | "
                         f"{p['attention_ms']:.2f} | {p['other_ms']:.2f} | {p['kernels_per_step']:.0f} |")
    lines += [f"FAILED {e}" for e in errors]
    return "\n".join(lines) + "\n\ndecode and prefill in tokens/s; cos: cosine of the last-token logits"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="", help="comma-separated config.json paths (default: examples/*.json)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to keep (default: all; 8 for MoE)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache before decoding")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--compiled-batches", default=None, help="decode batches of the compiled and graph modes (default: --batches)")
    p.add_argument("--autotune", type=float, default=0.0, metavar="BUDGET_S",
                   help="tune each FP4 model's misses first in eager warm-up passes (blocking autotune, "
                        "this budget per job; 0: off)")
    p.add_argument("--profile", action="store_true",
                   help="also profile the batch-1 decode step: GPU time in linear layers, attention and the rest")
    p.add_argument("--db", default=None, help="the user tuning DB (default: autofp4's)")
    p.add_argument("--fmts", default=",".join(FMTS),
                   help="FP4 variants, comma-separated: a format, with +lm_head (lm_head quantized too) and/or "
                        "+fp8 / +fp8-prefill (FP8 activations, W4A8), e.g. nvfp4+fp8")
    p.add_argument("--modes", default="eager,compiled,graph")
    p.add_argument("--skip", default="lm_head,*.lm_head",
                   help="quantize_model's skip patterns, comma-separated ('': quantize lm_head too)")
    p.add_argument("--no-fuse", action="store_true", help="quantize_model(fuse=False): q/k/v and gate/up apart")
    p.add_argument("--tiny", action="store_true", help="shrink each config (a smoke run)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.compiled_batches = (args.batches if args.compiled_batches is None else
                             [int(b) for b in args.compiled_batches.split(",") if b])
    if args.db:
        from autofp4 import dispatch

        dispatch.set_db(args.db)
    args.fmts = [f for f in args.fmts.split(",") if f]
    bad = [f for f in args.fmts if f.split("+")[0] not in FMTS or any(e not in EXTRAS for e in f.split("+")[1:])
           or sum(e in ACTS for e in f.split("+")[1:]) > 1]
    if bad:
        p.error(f"--fmts: {bad} are not a format of {', '.join(FMTS)}, alone or with +lm_head and one of "
                f"{', '.join('+' + a for a in ACTS)}")
    args.skip = [x for x in args.skip.split(",") if x]
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per model, batch and mode
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES):
        p.error(f"--modes: {sorted(set(args.modes) - set(MODES))} not in {', '.join(MODES)}")
    paths = [Path(c) for c in args.configs.split(",") if c] or sorted((ROOT / "examples").glob("*.json"))
    from autofp4.db import write_text_atomic

    rows: list[dict] = []
    out = results_dir(args.out, device)

    def write(row=None) -> str:
        """The results so far, rewritten after every row (a run stopped part way keeps them)."""
        if row is not None:
            rows.append(row)
        doc = {**provenance(device), "rows": rows, "batches": args.batches, "prefill_tokens": args.prefill,
               "context": args.context}
        text = table(rows, args.batches)
        write_text_atomic(out / "model.json", json.dumps(doc, indent=1))
        write_text_atomic(out / "model.md", f"{provenance_line(doc)}\n\n{text}\n")
        return text

    for path in paths:
        bench_config(path, args, device, on_row=write)
    text = write()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
