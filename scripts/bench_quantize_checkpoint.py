"""Time ``autofp4 quantize`` on a synthetic bf16 checkpoint: seconds, throughput, peak memory.

The checkpoint has Llama-3.1-70B's layer shapes (and its 128k x 8192 embeddings and lm_head), as
many layers as make ``--gb`` GB, random rows (written here, or reused from ``--dir``). Each
``--devices`` entry quantizes it in a fresh process (``python -m autofp4 quantize``), so the peak
resident memory of the report is that run's own. Prints a table last; writes
``quantize_checkpoint.json`` and ``.md`` to ``--out``.

    python scripts/bench_quantize_checkpoint.py --gb 30 --devices cpu --dir /tmp/ckpt30
    python scripts/bench_quantize_checkpoint.py --gb 16 --devices cpu,cuda --out docs/results/nvidia-h200
    python scripts/bench_quantize_checkpoint.py --make-only --gb 30 --dir /tmp/ckpt30   # the source only
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

H, I, V, NKV, HEAD = 8192, 28672, 128256, 8, 128
LAYER = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (NKV * HEAD, H), "self_attn.v_proj": (NKV * HEAD, H),
         "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}


def make_checkpoint(root: Path, gb: float, seed: int = 0) -> dict:
    """Write the synthetic bf16 checkpoint (see the module's docstring); returns its layers and bytes."""
    from autofp4.integrations.safetensors_io import ShardedWriter

    per_layer = sum(n * k for n, k in LAYER.values()) * 2
    layers = max(1, round((gb * 1e9 - 2 * V * H * 2) / per_layer))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": NKV, "vocab_size": V,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    decl = [("model.embed_tokens.weight", torch.bfloat16, (V, H))]
    for i in range(layers):
        p = f"model.layers.{i}."
        decl += [(p + n + ".weight", torch.bfloat16, s) for n, s in LAYER.items()]
        decl += [(p + "input_layernorm.weight", torch.bfloat16, (H,)),
                 (p + "post_attention_layernorm.weight", torch.bfloat16, (H,))]
    decl += [("model.norm.weight", torch.bfloat16, (H,)), ("lm_head.weight", torch.bfloat16, (V, H))]
    writer = ShardedWriter(root, decl, "5GB")
    g = torch.Generator().manual_seed(seed)
    # random rows from a pool, each tensor scaled differently (fresh values per tensor, fast to write)
    pool = [torch.randn(4096 * H, generator=g).mul_(0.02) for _ in range(7)]
    for j, (name, _, shape) in enumerate(decl):
        if len(shape) == 1:
            writer.write(name, (1 + 0.01 * torch.randn(shape, generator=g)).to(torch.bfloat16))
            continue
        n, k = shape
        step = 4096 * H // k
        for r in range(0, n, step):
            rows = min(step, n - r)
            blk = pool[(j + r) % 7][: rows * k].reshape(rows, k) * (1 + 0.01 * (j % 50))
            writer.write(name, blk.to(torch.bfloat16), r * k * 2)
    writer.close()
    return {"layers": layers, "bytes": sum(f.stat().st_size for f in root.glob("*.safetensors"))}


def quantize(src: Path, out: Path, device: str, fmt: str, layout: str) -> dict:
    cmd = [sys.executable, "-m", "autofp4", "quantize", str(src), "--fmt", fmt, "--layout", layout,
           "--out", str(out), "--device", device, "--no-progress", "--overwrite"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    report = json.loads((out / "quantization_report.json").read_text())
    report["wall_s"] = wall
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=30.0, help="size of the bf16 checkpoint (default 30)")
    ap.add_argument("--dir", help="where the source checkpoint is (made there if missing; default: a temporary dir)")
    ap.add_argument("--devices", default="cpu", help="comma-separated: cpu, cuda (default cpu)")
    ap.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--layout", default=None)
    ap.add_argument("--make-only", action="store_true", help="write the source checkpoint and stop")
    ap.add_argument("--out", help="folder for quantize_checkpoint.json / .md")
    args = ap.parse_args()
    layout = args.layout or ("modelopt" if args.fmt == "nvfp4" else "compressed-tensors")
    tmp = None
    if args.dir:
        src = Path(args.dir)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="autofp4-bench-"))
        src = tmp / "src"
    try:
        made = None
        if not (src / "config.json").is_file():
            t0 = time.perf_counter()
            made = make_checkpoint(src, args.gb)
            made["seconds"] = time.perf_counter() - t0
            print(f"wrote {src}: {made['layers']} layers, {made['bytes'] / 1e9:.1f} GB in {made['seconds']:.0f} s",
                  flush=True)
        if args.make_only:
            print(json.dumps(made))
            return 0
        rows = []
        for dev in [d.strip() for d in args.devices.split(",") if d.strip()]:
            out = src.parent / f"{src.name}-{args.fmt}-{dev.replace(':', '')}"
            r = quantize(src, out, dev, args.fmt, layout)
            rows.append({"device": dev, "fmt": args.fmt, "layout": layout, "gb_in": r["bytes_before"] / 1e9,
                         "gb_out": r["bytes_after"] / 1e9, "seconds": r["seconds"],
                         "gb_per_s": r["bytes_before"] / 1e9 / r["seconds"], "peak_rss_gb": r["peak_rss_bytes"] / 1e9,
                         "tensors": r["tensors_quantized"]})
            shutil.rmtree(out, ignore_errors=True)
        lines = ["| device | fmt / layout | bf16 in | FP4 out | seconds | GB/s | peak RSS |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['device']} | {r['fmt']} / {r['layout']} | {r['gb_in']:.1f} GB | {r['gb_out']:.1f} GB | "
                         f"{r['seconds']:.0f} | {r['gb_per_s']:.2f} | {r['peak_rss_gb']:.2f} GB |")
        table = "\n".join(lines)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            info = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
            (Path(args.out) / "quantize_checkpoint.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
            (Path(args.out) / "quantize_checkpoint.md").write_text(table + "\n")
        print(table)
        return 0
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
