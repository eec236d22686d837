"""Serve FP4 checkpoints in vLLM with the autofp4 plugin, and measure them against vLLM's own paths.

For each model (a config of ``examples/``: Llama-3.1-8B, Qwen3-30B-A3B), on one GPU:

1. **Checkpoints** (random weights, no download): the model built by transformers from its
   config on the GPU (its own initializer), saved in bf16 (``--bf16-checkpoint``; otherwise the
   bf16 variants load vLLM's dummy weights), then quantized by :func:`autofp4.quantize_model`
   and written by :func:`autofp4.save_pretrained` as a ModelOpt NVFP4 checkpoint. A word-level
   tokenizer (``t0 t1 ...``, one word per token id) is saved with both.
2. **Variants**, each in a fresh process with vLLM's ``LLM`` (CUDA graphs and torch.compile on,
   vLLM's defaults; prefix caching off so that repeated prompts are computed again):
   ``bf16`` (unquantized), ``vllm-nvfp4`` (the ModelOpt checkpoint on vLLM's own NVFP4 path for
   this GPU), ``autofp4-nvfp4`` (the same checkpoint with ``quantization="autofp4"``;
   ``autofp4-nvfp4+lm_head``: its bf16 ``lm_head`` quantized at load too, ``AUTOFP4_VLLM_LM_HEAD=1``),
   ``autofp4-mxfp4`` / ``autofp4-online-nvfp4`` (the bf16 weights quantized at load).
3. **Measured in each**: decode tokens/s at batch 1, 8 and 64 (128-token prompts; the time of
   136 generated tokens minus that of 8, so prefill cancels), prefill tokens/s (one 2048-token
   prompt, and eight), and the greedy outputs of 16 prompts (32 tokens, as a batch and one
   prompt at a time) with the log-probabilities of the prompt tokens.
4. ``--serve``: ``vllm serve`` with ``--quantization autofp4`` of the ModelOpt checkpoint and of
   the bf16 one (MXFP4 and NVFP4 at load; ``--serve online-nvfp4`` names which), each answering
   one OpenAI-style ``/v1/completions`` request.

Prints a table last; writes ``vllm.json`` and ``vllm.md`` to ``--out`` (default
``docs/results/<gpu>/``) and each variant's raw results to ``--work`` (reused by a later call unless ``--rerun``).

    python scripts/bench_vllm.py --models llama-3.1-8b --bf16-checkpoint --serve
    python scripts/bench_vllm.py --models qwen3-30b-a3b --variants bf16,vllm-nvfp4,autofp4-nvfp4,autofp4-mxfp4
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:
    from _common import ROOT, provenance, provenance_line, require_gpu, results_dir
except ImportError:  # imported as scripts.bench_vllm
    from scripts._common import ROOT, provenance, provenance_line, require_gpu, results_dir

VARIANTS = ("bf16", "vllm-nvfp4", "autofp4-nvfp4", "autofp4-mxfp4", "autofp4-online-nvfp4", "autofp4-nvfp4+lm_head")
SERVES = ("modelopt-nvfp4", "online-mxfp4", "online-nvfp4")
DECODE_BATCHES = (1, 8, 64)
PROMPT_LEN, SHORT, LONG = 128, 8, 136
PREFILL_LEN, PREFILL_BATCHES = 2048, (1, 8)
QUALITY_PROMPTS, QUALITY_PROMPT_LEN, QUALITY_TOKENS = 16, 64, 32
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]


# -- checkpoints ------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int, bos: int, eos: int):
    """A fast tokenizer with one word ``t<i>`` per token id (random-weight models need no real one)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def word(i):  # a special token matched as a whole word only ("t4" not inside "t4999")
        return AddedToken(f"t{i}", single_word=True, special=True)

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=word(0), bos_token=word(bos), eos_token=word(eos))


def _first(v):
    return v[0] if isinstance(v, list) else v


def make_checkpoints(config: Path, base: Path, bf16_checkpoint: bool, device: str = "cuda") -> dict:
    """Write ``<base>/nvfp4`` and ``<base>/bf16`` (or ``<base>/config``, the config and tokenizer
    alone) for the model of ``config``; returns their paths (and the seconds taken when written)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import autofp4

    dirs = {"nvfp4": base / "nvfp4", "bf16": base / ("bf16" if bf16_checkpoint else "config")}
    if all((d / "config.json").exists() for d in dirs.values()):
        return {k: str(v) for k, v in dirs.items()}
    cfg = AutoConfig.from_pretrained(str(config))
    tok = word_tokenizer(cfg.vocab_size, _first(cfg.bos_token_id) or 0, _first(cfg.eos_token_id) or 1)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.eval()
    times = {"build_s": time.perf_counter() - t0}
    dirs["bf16"].mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if bf16_checkpoint:
        m.save_pretrained(str(dirs["bf16"]))
    else:  # the config alone: vLLM's dummy weights
        m.config.save_pretrained(str(dirs["bf16"]))
    tok.save_pretrained(str(dirs["bf16"]))
    times["bf16_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = autofp4.quantize_model(m, "nvfp4")
    if device == "cuda":
        torch.cuda.synchronize()
    times["quantize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    autofp4.save_pretrained(m, dirs["nvfp4"], layout="modelopt", tokenizer=tok, overwrite=True)
    times["nvfp4_save_s"] = time.perf_counter() - t0
    print(f"{config.stem}: {len(report.converted)} tensors quantized; {times}", flush=True)
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return {k: str(v) for k, v in dirs.items()} | {"times": times}


# -- one variant, in its own process ------------------------------------------------------------
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000) for _ in range(length)]} for _ in range(n)]


def _timed(llm, prompts, params, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_decode(llm, sampling_params, vocab: int, tokens: int = 64) -> dict:
    """One batch-1 generation of ``tokens`` tokens under torch.profiler (the engine runs in this
    process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): wall and GPU kernel time per token and the
    kernels that take it, summed by name."""
    from torch.profiler import ProfilerActivity, profile

    prompts = _prompts(1, PROMPT_LEN, vocab, 1)
    params = sampling_params(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False):
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.device_time_total
            k[1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in kernels.values())
    return {"tokens": tokens, "wall_ms_per_token": wall * 1e3 / tokens, "gpu_ms_per_token": total / 1e3 / tokens,
            "kernels": [{"name": n[:160], "us_per_token": v[0] / tokens, "calls_per_token": v[1] / tokens}
                        for n, v in top[:30]]}


def run_variant(variant: str, model_dir: str, out: Path, dummy: bool, profile: bool = False) -> dict:
    """Build vLLM's ``LLM`` for ``variant`` and measure it (or, ``profile``, profile its batch-1
    decode); writes and returns its results."""
    from vllm import LLM, SamplingParams

    kw = {}
    if variant.startswith("autofp4"):
        kw["quantization"] = "autofp4"
    if variant in ("autofp4-mxfp4", "autofp4-online-nvfp4") or variant == "bf16":
        kw["load_format"] = "dummy" if dummy else "auto"
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.85,
              enable_prefix_caching=False, seed=0, compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES}, **kw)
    res = {"variant": variant, "model_dir": model_dir, "startup_s": time.perf_counter() - t0, **kw}
    cfg = llm.llm_engine.model_config.hf_config
    vocab = cfg.vocab_size
    res["quantization"] = llm.llm_engine.model_config.quantization
    greedy = dict(temperature=0.0, ignore_eos=True)
    if profile:
        res["profile"] = profile_decode(llm, SamplingParams, vocab)
        (out / f"{variant}-profile.json").write_text(json.dumps(res))
        return res
    # warm-up: every batch size once
    for b in DECODE_BATCHES:
        llm.generate(_prompts(b, PROMPT_LEN, vocab, 99), SamplingParams(max_tokens=SHORT, **greedy), use_tqdm=False)
    res["decode_tok_s"] = {}
    for b in DECODE_BATCHES:
        prompts = _prompts(b, PROMPT_LEN, vocab, b)
        ts = _timed(llm, prompts, SamplingParams(max_tokens=SHORT, **greedy), 3)
        tl = _timed(llm, prompts, SamplingParams(max_tokens=LONG, **greedy), 3)
        res["decode_tok_s"][str(b)] = b * (LONG - SHORT) / (tl - ts)
    res["prefill_tok_s"] = {}
    for b in PREFILL_BATCHES:
        prompts = _prompts(b, PREFILL_LEN, vocab, 1000 + b)
        llm.generate(prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        res["prefill_tok_s"][str(b)] = b * PREFILL_LEN / _timed(llm, prompts, SamplingParams(max_tokens=1, **greedy), 5)
    # quality: greedy tokens and the prompt tokens' log-probabilities, as a batch and one by one
    prompts = _prompts(QUALITY_PROMPTS, QUALITY_PROMPT_LEN, vocab, 7)
    params = SamplingParams(max_tokens=QUALITY_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)

    def outputs(outs):
        rows = []
        for o in outs:
            plp = [None if d is None else float(d[t].logprob) for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)]
            rows.append({"tokens": list(o.outputs[0].token_ids), "prompt_logprobs": plp})
        return rows

    res["batch"] = outputs(llm.generate(prompts, params, use_tqdm=False))
    res["single"] = [outputs(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    (out / f"{variant}.json").write_text(json.dumps(res))
    return res


# -- vllm serve ---------------------------------------------------------------------------------
def serve_check(model_dir: str, out: Path, name: str, env: dict | None = None, extra: tuple = (),
                timeout_s: float = 420.0) -> dict:
    """``vllm serve <model_dir> --quantization autofp4`` (in ``env``, with ``extra`` arguments) and
    one ``/v1/completions`` request; its log is ``<out>/serve-<name>.log``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--quantization", "autofp4",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "64",
           "--gpu-memory-utilization", "0.85", "--served-model-name", "fp4", *extra]
    log_path = out / f"serve-{name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    res = {"command": " ".join(cmd[2:])}
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        res["startup_s"] = time.perf_counter() - t0
        body = json.dumps({"model": "fp4", "prompt": " ".join(f"t{i}" for i in range(2000, 2032)),
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        res["reply"] = reply
        res["ok"] = bool(reply["choices"][0]["text"]) and reply["usage"]["completion_tokens"] == 16
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return res


# -- memory, from vLLM's log ------------------------------------------------------------------------
_LOG_FIGURES = {"model_gib": r"Model loading took ([0-9.]+) GiB", "kv_cache_gib": r"Available KV cache memory: ([0-9.]+) GiB",
                "kv_tokens": r"GPU KV cache size: ([0-9,]+) tokens"}


def log_figures(text: str) -> dict:
    """The model's memory after loading, the KV cache's memory and its size in tokens, as vLLM
    logs them while it starts (the last of each; absent where a line is missing)."""
    import re

    out = {}
    for key, pattern in _LOG_FIGURES.items():
        found = re.findall(pattern, text)
        if found:
            value = found[-1].replace(",", "")
            out[key] = int(value) if key == "kv_tokens" else float(value)
    return out


# -- comparison -------------------------------------------------------------------------------
def compare(a: list[dict], b: list[dict]) -> dict:
    """Greedy-token agreement and prompt log-probability differences of two variants' outputs."""
    same = total = full = 0
    diffs = []
    for x, y in zip(a, b):
        n = min(len(x["tokens"]), len(y["tokens"]))
        k = next((i for i in range(n) if x["tokens"][i] != y["tokens"][i]), n)  # first divergence
        same += k
        total += n
        full += k == n
        diffs += [abs(p - q) for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"]) if p is not None and q is not None]
    return {"tokens_identical": same / max(total, 1), "prompts_identical": full / max(len(a), 1),
            "logprob_diff_mean": statistics.fmean(diffs) if diffs else float("nan"),
            "logprob_diff_max": max(diffs) if diffs else float("nan")}


ONLINE = ("autofp4-mxfp4", "autofp4-online-nvfp4")


def reference(variant: str) -> str:
    """The variant whose outputs ``variant``'s are compared with: the same weights on another path
    (vLLM's own NVFP4 for the ModelOpt checkpoint; bf16 for the weights quantized at load)."""
    return "bf16" if variant in ONLINE else "vllm-nvfp4"


def summarize(model: str, runs: dict) -> dict:
    row = {"model": model, "variants": {}}
    for v, r in runs.items():
        row["variants"][v] = {"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"],
                              "startup_s": r["startup_s"], "quantization": r.get("quantization"),
                              **{k: r[k] for k in _LOG_FIGURES if k in r},
                              "batch_vs_single": compare(r["batch"], r["single"])}
        for ref in ("vllm-nvfp4", "bf16"):
            if ref in runs and v != ref:
                row["variants"][v][f"vs_{ref.replace('-', '_')}"] = compare(r["batch"], runs[ref]["batch"])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | variant | decode b=1 | b=8 | b=64 | prefill 1x2048 | 8x2048 | x default b=1 / b=64 / prefill "
             "| x bf16 b=1 | compared with | tokens identical | dlogp mean / max | noise mean / max | model GiB | KV tokens |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|---|---:|---:|"]
    for row in rows:
        variants = row["variants"]
        base, bf16 = variants.get("vllm-nvfp4"), variants.get("bf16")
        for v, r in variants.items():
            d, p = r["decode_tok_s"], r["prefill_tok_s"]
            ratio = "-"
            if base and v != "vllm-nvfp4":
                bd, bp = base["decode_tok_s"], base["prefill_tok_s"]
                ratio = f"{d['1'] / bd['1']:.2f} / {d['64'] / bd['64']:.2f} / {p['1'] / bp['1']:.2f}"
            xb = f"{d['1'] / bf16['decode_tok_s']['1']:.2f}" if bf16 and v != "bf16" else "-"
            ref = reference(v)
            vs = r.get(f"vs_{ref.replace('-', '_')}")
            noise = r["batch_vs_single"]
            agree = f"{ref} | {vs['tokens_identical']:.0%} | {vs['logprob_diff_mean']:.3f} / {vs['logprob_diff_max']:.3f}" \
                if vs else "- | - | -"
            lines.append(f"| {row['model']} | {v} | {d['1']:.0f} | {d['8']:.0f} | {d['64']:.0f} | {p['1']:.0f} | "
                         f"{p['8']:.0f} | {ratio} | {xb} | {agree} | "
                         f"{noise['logprob_diff_mean']:.3f} / {noise['logprob_diff_max']:.3f} | "
                         f"{_fig(r.get('model_gib'), '.1f')} | {_fig(r.get('kv_tokens'), ',')} |")
    return "\n".join(lines)


def _fig(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def profile_table(rows: list[dict]) -> str:
    """Per variant: wall and GPU kernel ms per token, and the five kernels that take the most."""
    lines = ["| model | variant | wall ms/token | GPU kernels ms/token | top kernels (us/token) |", "|---|---|---:|---:|---|"]
    for row in rows:
        for v, p in row["profiles"].items():
            top = "; ".join(f"{k['name'][:60]} {k['us_per_token']:.0f}" for k in p["kernels"][:5])
            lines.append(f"| {row['model']} | {v} | {p['wall_ms_per_token']:.3f} | {p['gpu_ms_per_token']:.3f} | {top} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.1-8b", help="comma-separated configs of examples/ (default llama-3.1-8b)")
    ap.add_argument("--variants", default=",".join(VARIANTS[:4]), help=f"comma-separated of {', '.join(VARIANTS)}")
    ap.add_argument("--bf16-checkpoint", action="store_true",
                    help="write the bf16 checkpoint too (else the bf16 and online variants load dummy weights)")
    ap.add_argument("--serve", nargs="?", const=",".join(SERVES), default="",
                    help=f"also vllm serve and send a request: comma-separated of {', '.join(SERVES)} (default all)")
    ap.add_argument("--work", default="/tmp/bench_vllm", help="checkpoints and raw results (default /tmp/bench_vllm)")
    ap.add_argument("--out", help="folder for vllm.json / vllm.md (default docs/results/<gpu>/)")
    ap.add_argument("--rerun", action="store_true", help="measure variants whose results are in --work again")
    ap.add_argument("--profile", action="store_true",
                    help="instead of measuring, profile each variant's batch-1 decode (kernel times per token)")
    ap.add_argument("--run-variant", nargs=3, metavar=("VARIANT", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_variant:
        v, d, o = args.run_variant
        run_variant(v, d, Path(o), args.dummy, args.profile)
        return 0
    if (rc := require_gpu("bench_vllm.py")) is not None:
        return rc
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"unknown variant(s) {', '.join(bad)}; known: {', '.join(VARIANTS)}")
    serves = [s.strip() for s in args.serve.split(",") if s.strip()]
    if bad := [s for s in serves if s not in SERVES]:
        raise SystemExit(f"unknown --serve name(s) {', '.join(bad)}; known: {', '.join(SERVES)}")
    work = Path(args.work)
    rows, serve = [], {}
    doc = provenance()
    import vllm

    doc["vllm"] = vllm.__version__
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        dirs = make_checkpoints(ROOT / "examples" / f"{model}.json", work / model, args.bf16_checkpoint)
        out = work / model / "results"
        out.mkdir(parents=True, exist_ok=True)
        runs = {}
        for v in variants:
            name = f"{v}-profile" if args.profile else v
            if (out / f"{name}.json").exists() and not args.rerun:  # measured by an earlier call
                runs[v] = json.loads((out / f"{name}.json").read_text())
                continue
            d = dirs["nvfp4"] if v in ("vllm-nvfp4", "autofp4-nvfp4", "autofp4-nvfp4+lm_head") else dirs["bf16"]
            env = dict(os.environ, AUTOFP4_VLLM_LM_HEAD="1" if v.endswith("+lm_head") else "0")
            if v == "autofp4-online-nvfp4":
                env["AUTOFP4_VLLM_FORMAT"] = "nvfp4"
            elif v == "autofp4-mxfp4":
                env["AUTOFP4_VLLM_FORMAT"] = "mxfp4"
            cmd = [sys.executable, __file__, "--run-variant", v, d, str(out)] + ([] if args.bf16_checkpoint else ["--dummy"])
            if args.profile:  # the engine in this process, where the profiler sees its kernels
                cmd.append("--profile")
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            t0 = time.perf_counter()
            with open(out / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"{model} {name}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
            if rc:
                print((out / f"{name}.log").read_text()[-4000:], flush=True)
                continue
            runs[v] = json.loads((out / f"{name}.json").read_text()) | log_figures((out / f"{name}.log").read_text())
            (out / f"{name}.json").write_text(json.dumps(runs[v]))
        if args.profile:
            rows.append({"model": model, "profiles": {v: r["profile"] for v, r in runs.items()}})
            continue
        if serves:  # the ModelOpt checkpoint, and the bf16 one quantized at load
            online = ("--load-format", "dummy") if not args.bf16_checkpoint else ()
            for name in serves:
                fmt = name.rpartition("-")[2]
                d, env, extra = ((dirs["nvfp4"], None, ()) if name == "modelopt-nvfp4"
                                 else (dirs["bf16"], dict(os.environ, AUTOFP4_VLLM_FORMAT=fmt), online))
                try:
                    res = serve_check(d, out, name, env, extra)
                except Exception as e:  # reported, the measurements stand
                    res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    log = out / f"serve-{name}.log"
                    print(log.read_text()[-4000:] if log.exists() else "", flush=True)
                serve[f"{model} {name}"] = res
                print(f"{model} serve {name}: {json.dumps(res)[:600]}", flush=True)
        rows.append(summarize(model, runs))
    dest = results_dir(args.out)
    if args.profile:
        doc.update(profiles=rows)
        (dest / "vllm-profile.json").write_text(json.dumps(doc, indent=1))
        md = profile_table(rows)
        (dest / "vllm-profile.md").write_text(f"# vLLM batch-1 decode, profiled\n\n{provenance_line(doc)} "
                                              f"vLLM {doc['vllm']}.\n\n{md}\n")
        print(md)
        return 0
    doc.update(rows=rows, serve=serve)
    (dest / "vllm.json").write_text(json.dumps(doc, indent=1))
    md = table(rows)
    (dest / "vllm.md").write_text(f"# vLLM serving: autofp4 against vLLM's own paths\n\n{provenance_line(doc)} "
                                  f"vLLM {doc['vllm']}.\n\nTokens/s; decode from 128-token prompts, prefill of "
                                  f"2048-token prompts.\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
