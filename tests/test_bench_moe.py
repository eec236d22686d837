"""scripts/bench_moe.py on the CPU: its bf16 MoE baseline against a float64 per-token reference
(whole layer and an expert-parallel slice), the FP4 byte count of its HBM floor, the model
shapes it measures, and its tables from a saved run."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_moe as B  # noqa: E402

import autofp4  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")


def float64_moe(x, w13, w2, tw, ti, experts_here=None):
    """Per token and slot: silu(gate) * up, down, times the router weight, summed over slots."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t, h, dtype=torch.float64)
    for n in range(t):
        for j in range(ti.shape[1]):
            e = int(ti[n, j])
            if experts_here is not None and e not in experts_here:
                continue
            le = e if experts_here is None else experts_here.index(e)
            gu = w13[le].double() @ x[n].double()
            a = F.silu(gu[:inter]) * gu[inter:]
            out[n] += float(tw[n, j]) * (w2[le].double() @ a)
    return out


@pytest.mark.parametrize("t,e,k,h,i", [(1, 4, 2, 64, 32), (7, 8, 2, 128, 64), (33, 16, 4, 64, 96)])
def test_the_bf16_baseline_matches_a_float64_reference(t, e, k, h, i):
    g = torch.Generator().manual_seed(SEED + t)
    x = torch.randn(t, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.1).bfloat16()
    tw, ti = B.routing(t, e, k, g, torch.device("cpu"))
    got = B.bf16_moe(x, w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), tw, ti, e)
    want = float64_moe(x, w13, w2, tw, ti)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    assert float((got.double() - want).norm() / want.norm()) < 2e-2
    # and the reference backend's FP4 MoE on the same (quantized) weights agrees with it
    q13, q2 = autofp4.quantize(w13, "mxfp4"), autofp4.quantize(w2, "mxfp4")
    ours = autofp4.moe(x, q13, q2, tw, ti, activation="silu")
    base = B.bf16_moe(x, q13.dequantize(torch.bfloat16).transpose(1, 2).contiguous(),
                      q2.dequantize(torch.bfloat16).transpose(1, 2).contiguous(), tw, ti, e)
    assert float((ours.double() - base.double()).norm() / base.double().norm()) < 2e-2


def test_an_expert_parallel_slice_sums_only_its_experts():
    g = torch.Generator().manual_seed(SEED)
    t, eg, k, h, i, ranks = 9, 16, 4, 64, 32, 4
    x = torch.randn(t, h, generator=g).bfloat16()
    tw, ti = B.routing(t, eg, k, g, torch.device("cpu"))
    total = torch.zeros(t, h, dtype=torch.float64)
    w13 = (torch.randn(eg, 2 * i, h, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(eg, h, i, generator=g) * 0.1).bfloat16()
    per = eg // ranks
    for r in range(ranks):
        here = list(range(r * per, (r + 1) * per))
        emap = torch.full((eg,), -1, dtype=torch.int32)
        emap[r * per:(r + 1) * per] = torch.arange(per, dtype=torch.int32)
        part = B.bf16_moe(x, w13[here].transpose(1, 2).contiguous(), w2[here].transpose(1, 2).contiguous(),
                          tw, ti, per, expert_map=emap)
        want = float64_moe(x, w13[here], w2[here], tw, ti, experts_here=here)
        assert float((part.double() - want).norm() / want.norm()) < 2e-2
        total += part.double()
    whole = float64_moe(x, w13, w2, tw, ti)
    assert float((total - whole).norm() / whole.norm()) < 2e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_floor_counts_the_fp4_bytes_of_one_expert(fmt):
    h, i = 256, 128
    w13 = autofp4.quantize(torch.randn(1, 2 * i, h), fmt)
    w2 = autofp4.quantize(torch.randn(1, h, i), fmt)
    stored = sum(w.data.numel() + w.scale.numel() * w.scale.element_size() for w in (w13, w2))
    assert B.expert_fp4_bytes(h, i, fmt) == stored
    ti = torch.tensor([[0, 3], [3, 5], [9, 1]])
    assert B.hit_experts(ti, 0, 8) == 4 and B.hit_experts(ti, 4, 8) == 2


def test_the_models_measured_are_the_issue_s_four():
    shapes = {m: B.moe_shape(m, ep) for m, ep in B.MODELS.items()}
    assert shapes["qwen3-30b-a3b"] == {"E": 128, "E_global": 128, "top_k": 8, "H": 2048, "I": 768}
    assert shapes["gpt-oss-120b"] == {"E": 128, "E_global": 128, "top_k": 4, "H": 2880, "I": 2880}
    assert shapes["mixtral-8x7b"] == {"E": 8, "E_global": 8, "top_k": 2, "H": 4096, "I": 14336}
    assert shapes["deepseek-v3"] == {"E": 32, "E_global": 256, "top_k": 8, "H": 7168, "I": 2048}


def test_tables_from_a_saved_run(tmp_path, monkeypatch):
    row = {"model": "mixtral-8x7b", "ep": 1, "fmt": "nvfp4", "T": 16, "E": 8, "top_k": 2, "H": 4096, "I": 14336,
           "hit_experts": 7.5, "pairs": 32, "floor_us": 160.0, "bf16_us": 800.0, "autofp4_us": 400.0,
           "autofp4_timing": "graph"}
    bare = dict(row, model="deepseek-v3", ep=8, autofp4_us=None, autofp4_timing=None)
    doc = {"date": "2026-12-01", "gpu": "NVIDIA H200", "copy_bandwidth_tbs": 4.27, "rows": [row, bare]}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(sys, "argv", ["bench_moe.py", "--plot", str(path)])
    assert B.main() == 0
    md = (tmp_path / "moe.md").read_text()
    d = B.derive(row)
    assert d["speedup"] == 2.0 and d["floor_pct"] == 40.0
    assert d["autofp4_tflops"] == pytest.approx(2 * 32 * 3 * 4096 * 14336 / 400e-6 / 1e12)
    assert "| mixtral-8x7b | 1 | nvfp4 | 16 | 7.5 | 800.0 | 400.0 | graph | 2.00x | 160.0 | 40% |" in md
    assert "| deepseek-v3 | 8 | nvfp4 | 16 | 7.5 | 800.0 | - | - | - | 160.0 | - | - |" in md
    assert "nvfp4: 2.000x over 1 rows" in md
    assert "- nvfp4, T = 16-256: 40% over 1 rows" in md and "T = 1:" not in md


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setattr(sys, "argv", ["bench_moe.py", "--models", "mixtral-8x7b"])
    assert B.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_baselines_routing_is_the_models(model):
    """The bf16 baseline's torch-op routing is autofp4.route's with the model's router (DeepSeek-V3:
    grouped sigmoid with its correction bias and scaling), and is not a plain softmax top-k."""
    g = torch.Generator().manual_seed(SEED)
    eg, k = (256, 8) if model == "deepseek-v3" else (128, 8)
    kw = B.router_of(model, eg, g, torch.device("cpu"))
    logits = torch.randn(20, eg, generator=g)
    tw, ti = B.torch_route(logits, k, kw)
    w, ids = autofp4.route(logits, k, **kw)
    assert torch.equal(ti, ids) and torch.allclose(tw, w)
    if model == "deepseek-v3":
        assert abs(float(tw.sum(-1).mean()) - 2.5) < 1e-4  # routed scaling
        plain = torch.topk(torch.softmax(logits, -1), k, -1).indices
        assert not torch.equal(plain.sort(-1).values, ti.long().sort(-1).values)


def test_the_fp8_table_ratios():
    row = {"model": "Qwen3-30B-A3B", "ep": 1, "fmt": "nvfp4", "T": 4096, "E": 128, "top_k": 8, "H": 2048, "I": 768,
           "hit_experts": 128.0, "pairs": 32768, "floor_us": 100.0, "bf16_us": 2000.0, "bf16_logits_us": 2100.0,
           "autofp4_us": 1000.0, "autofp4_timing": "graph", "w4a8_us": 800.0}
    doc = {"gpu": "GPU", "date": "d", "torch": "t", "copy_bandwidth_tbs": 4.0, "rows": [row]}
    text = B.render(doc)
    tf = B.useful_flops(32768, 2048, 768) / 800e-6 / 1e12
    assert f"| Qwen3-30B-A3B | 1 | nvfp4 | 4096 | 2000.0 | 1000.0 | 800.0 | 2.50x | 1.25x | {tf:.0f} |" in text
    row.pop("w4a8_us")
    assert "W4A8 x bf16" not in B.render(doc)
