"""Writing FP4 checkpoints: autofp4.save_pretrained (a model in memory) and autofp4 quantize (a bf16
checkpoint, streamed), in the ModelOpt, compressed-tensors and gpt-oss layouts, for tiny Llama,
Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss models made here with random weights.

Checked: the round trip through autofp4.from_pretrained (FP4 tensors bit for bit, logits), the
streamed CLI output against save_pretrained's tensor for tensor, the stored values against the
source weights without autofp4's reader (dequantized independently), transformers' and vLLM's
config parsers, transformers' own save_pretrained refusing, bad input, and what an error leaves."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

import autofp4  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402
from autofp4.integrations import quantize_checkpoint as qc_mod  # noqa: E402
from autofp4.integrations.transformers import FP4Experts  # noqa: E402

from tiny_models import ATTN, tiny_config as _config  # noqa: E402

BF16 = torch.bfloat16
KINDS = ("llama", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
#: (kind, fmt, layout): every layout each model kind supports
CASES = [(k, f, lay) for k in KINDS if k != "gpt_oss"
         for f, lay in (("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"))]
CASES.append(("gpt_oss", "mxfp4", "gpt-oss"))
_IDS = [f"{k}-{f}-{lay}" for k, f, lay in CASES]


def _model(kind: str, seed: int = 0):
    """A tiny bf16 model with random weights (the up rows of the experts larger than the gate rows,
    so their NVFP4 global scales differ)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=BF16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if "embed" in n or "lm_head" in n else 0.05))
            if n.endswith("norm.weight"):
                p.add_(1)
            if n.endswith("experts.gate_up_proj") and kind != "gpt_oss":
                p[:, p.shape[1] // 2:] *= 3
    return model


def _skip(layout: str) -> list[str]:
    return ["lm_head", "*.self_attn.*"] if layout == "gpt-oss" else ["lm_head"]


def _quantized(kind: str, fmt: str, layout: str, seed: int = 0):
    model = _model(kind, seed)
    autofp4.quantize_model(model, fmt, skip=_skip(layout))
    return model


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _fp4_tensors(model) -> dict[str, tuple]:
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, autofp4.FP4Linear):
            w = m.fp4_weight()
            out[n] = (w.fmt, w.data, _bits(w.scale), w.global_scale)
        elif isinstance(m, FP4Experts):
            for p in ("gate_up_proj", "down_proj"):
                w = m.fp4_weight(p)
                out[f"{n}.{p}"] = (w.fmt, w.data, _bits(w.scale), w.global_scale)
    return out


# -- the round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,fmt,layout", CASES, ids=_IDS)
def test_save_then_from_pretrained_gives_the_same_fp4_tensors_and_logits(tmp_path, kind, fmt, layout):
    model = _quantized(kind, fmt, layout)
    autofp4.save_pretrained(model, tmp_path / "ckpt", layout=layout)
    back = autofp4.from_pretrained(tmp_path / "ckpt")
    a, b = _fp4_tensors(model), _fp4_tensors(back)
    assert a and sorted(a) == sorted(b)
    ct_nvfp4 = layout == "compressed-tensors" and fmt == "nvfp4"
    for name in a:
        (fa, da, sa, ga), (fb, db, sb, gb) = a[name], b[name]
        assert fa == fb == fmt and torch.equal(da, db) and torch.equal(sa, sb), name
        if ga is None:
            assert gb is None
        elif ct_nvfp4:  # compressed-tensors stores the reciprocal: 1 / (1 / g) is g, or one ulp from it
            assert torch.equal(gb, torch.reciprocal(torch.reciprocal(ga))), name
        else:
            assert torch.equal(ga, gb), name
    ids = torch.randint(0, ATTN["vocab_size"], (2, 7))
    with torch.no_grad():
        la, lb = model(ids).logits, back(ids).logits
    if ct_nvfp4:
        torch.testing.assert_close(lb, la, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(la, lb)


def test_compressed_tensors_global_scales_round_trip_where_fp32_can(tmp_path):
    # most global scales survive 1 / (1 / g) in fp32; the test above holds the others to one ulp
    g = torch.rand(100_000) + 1e-3
    exact = (torch.reciprocal(torch.reciprocal(g)) == g).float().mean().item()
    assert 0.8 < exact < 1.0
    ulps = (torch.reciprocal(torch.reciprocal(g)).view(torch.int32) - g.view(torch.int32)).abs().max().item()
    assert ulps == 1


# -- the streamed CLI against save_pretrained ----------------------------------------------------
def _bf16_checkpoint(root: Path, kind: str, seed: int = 0) -> None:
    _model(kind, seed).save_pretrained(root)
    (root / "tokenizer.json").write_text('{"model": "tiny"}')
    (root / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    torch.save({"x": 1}, root / "training_args.bin")  # not a file of the quantized checkpoint


@pytest.mark.parametrize("kind,fmt,layout", CASES, ids=_IDS)
def test_quantize_cli_writes_what_save_pretrained_writes(tmp_path, kind, fmt, layout, monkeypatch):
    src = tmp_path / "src"
    _bf16_checkpoint(src, kind)
    model = _quantized(kind, fmt, layout)
    autofp4.save_pretrained(model, tmp_path / "mem", layout=layout)
    monkeypatch.setattr(qc_mod, "_CHUNK_BYTES", 1024)  # several row blocks a tensor
    args = ["quantize", str(src), "--fmt", fmt, "--layout", layout, "--out", str(tmp_path / "cli"), "--no-progress",
            "--max-shard-size", "20kB"]
    if layout == "gpt-oss":
        args += ["--skip", "*.self_attn.*"]
    assert cli_main(args) == 0
    cli, mem = _tensors(tmp_path / "cli"), _tensors(tmp_path / "mem")
    assert sorted(cli) == sorted(mem)
    for k in mem:
        assert cli[k].dtype == mem[k].dtype and torch.equal(_bits(cli[k]), _bits(mem[k])), k
    files = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "quantization_report.json"} <= set(files)
    assert "training_args.bin" not in files and not any(f.startswith(".") for f in files)
    q_cli = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    q_mem = json.loads((tmp_path / "mem" / "config.json").read_text())["quantization_config"]
    assert q_cli == q_mem
    if layout == "modelopt":
        hf = json.loads((tmp_path / "cli" / "hf_quant_config.json").read_text())["quantization"]
        assert hf["quant_algo"] == "W4A16_NVFP4" and hf["exclude_modules"] == q_cli["ignore"]
        assert "lm_head" in hf["exclude_modules"]
    # and it loads: the same model as the one quantized in memory
    back = autofp4.from_pretrained(tmp_path / "cli")
    ids = torch.randint(0, ATTN["vocab_size"], (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-2, atol=1e-2)


# -- the stored values, read without autofp4's reader ---------------------------------------------
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _deq(packed: torch.Tensor, scale: torch.Tensor, bs: int) -> torch.Tensor:
    """Dequantize packed E2M1 (low nibble first) with per-block scales already as float64."""
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(*packed.shape[:-1], -1).long()
    v = _E2M1[codes]
    return (v.reshape(*v.shape[:-1], -1, bs) * scale.unsqueeze(-1)).reshape(v.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_stored_nvfp4_values_dequantize_to_the_source_weights(tmp_path, layout):
    model = _model("qwen3_moe")
    src = {k: v.double() for k, v in model.state_dict().items()}
    autofp4.quantize_model(model, "nvfp4")
    autofp4.save_pretrained(model, tmp_path / "c", layout=layout)
    t = _tensors(tmp_path / "c")
    packed_key, gs_key = ("weight", "weight_scale_2") if layout == "modelopt" else ("weight_packed", "weight_global_scale")
    for name, w in (("model.layers.0.self_attn.k_proj", src["model.layers.0.self_attn.k_proj.weight"]),
                    ("model.layers.1.mlp.experts.2.up_proj", src["model.layers.1.mlp.experts.gate_up_proj"][2, 32:]),
                    ("model.layers.1.mlp.experts.3.down_proj", src["model.layers.1.mlp.experts.down_proj"][3])):
        g = t[f"{name}.{gs_key}"].double().reshape(())
        if layout == "compressed-tensors":
            g = 1 / g
        deq = _deq(t[f"{name}.{packed_key}"], t[f"{name}.weight_scale"].double() * g, 16)
        assert t[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
        assert _rel(deq, w) < 0.12, name  # FP4's error, nothing structural
    # q, k, v share one global scale (the largest amax / (6 * 448)); gate and up of an expert too
    gs = [t[f"model.layers.0.self_attn.{p}_proj.{gs_key}"] for p in "qkv"]
    assert all(torch.equal(g, gs[0]) for g in gs)
    amax = max(src[f"model.layers.0.self_attn.{p}_proj.weight"].abs().max() for p in "qkv")
    want = amax / 2688 if layout == "modelopt" else 2688 / amax
    assert gs[0].double().item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.equal(t["model.layers.0.mlp.experts.1.gate_proj." + gs_key], t["model.layers.0.mlp.experts.1.up_proj." + gs_key])


def test_stored_gpt_oss_blocks_are_interleaved_as_gpt_oss_stores_them(tmp_path):
    model = _model("gpt_oss")
    src = {k: v.double() for k, v in model.state_dict().items()}
    autofp4.quantize_model(model, "mxfp4", skip=_skip("gpt-oss"))
    autofp4.save_pretrained(model, tmp_path / "c")  # the default layout of a gpt-oss MXFP4 model
    t = _tensors(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    name = "model.layers.1.mlp.experts"
    blocks, scales = t[f"{name}.gate_up_proj_blocks"], t[f"{name}.gate_up_proj_scales"]
    e, two_i, h = src[f"{name}.gate_up_proj"].shape[0], src[f"{name}.gate_up_proj"].shape[2], src[f"{name}.gate_up_proj"].shape[1]
    assert blocks.shape == (e, two_i, h // 32, 16) and scales.shape == (e, two_i, h // 32)
    deq = _deq(blocks.reshape(e, two_i, h // 2), torch.pow(2.0, scales.double() - 127), 32)
    assert _rel(deq, src[f"{name}.gate_up_proj"].transpose(1, 2)) < 0.12  # rows in the stored (interleaved) order
    assert torch.equal(t[f"{name}.gate_up_proj_bias"].double(), src[f"{name}.gate_up_proj_bias"])
    down = _deq(t[f"{name}.down_proj_blocks"].reshape(e, h, -1), torch.pow(2.0, t[f"{name}.down_proj_scales"].double() - 127), 32)
    assert _rel(down, src[f"{name}.down_proj"].transpose(1, 2)) < 0.12
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == BF16  # attention stays bf16


# -- other loaders -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,layout", [("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
                                        ("mxfp4", "gpt-oss"), ("nvfp4", "modelopt")])
def test_transformers_parses_the_quantization_configs(tmp_path, fmt, layout):
    kind = "gpt_oss" if layout == "gpt-oss" else "qwen3_moe"
    autofp4.save_pretrained(_quantized(kind, fmt, layout), tmp_path / "c", layout=layout)
    from transformers.quantizers.auto import AutoQuantizationConfig

    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    if layout == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.quantization import QuantizationConfig

        parsed = QuantizationConfig.model_validate(qc)
        args = parsed.config_groups["group_0"].weights
        assert (args.num_bits, args.type, args.group_size) == (4, "float", 16 if fmt == "nvfp4" else 32)
        assert parsed.config_groups["group_0"].input_activations is None and "lm_head" in parsed.ignore
    conf = AutoQuantizationConfig.from_dict(qc)
    assert conf.quant_method in ("compressed-tensors", "mxfp4", "autofp4")


def test_transformers_loads_the_modelopt_output_through_autofp4s_quantizer(tmp_path):
    model = _quantized("mixtral", "nvfp4", "modelopt")
    autofp4.save_pretrained(model, tmp_path / "c")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=BF16)
    ids = torch.randint(0, ATTN["vocab_size"], (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("how", ["quantize_model", "from_pretrained", "transformers"])
def test_transformers_save_pretrained_refuses_and_names_autofp4s(tmp_path, how):
    model = _quantized("llama", "nvfp4", "modelopt")
    if how != "quantize_model":
        autofp4.save_pretrained(model, tmp_path / "c")
        model = (autofp4.from_pretrained(tmp_path / "c") if how == "from_pretrained"
                 else transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=BF16))
    with pytest.raises(ValueError, match=r"autofp4\.save_pretrained"):
        model.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # nothing written, not even the directory


def test_a_model_that_is_not_converted_saves_as_transformers_does(tmp_path):
    model = _model("llama")
    autofp4.quantize_model(model, "nvfp4", skip=["*"])  # nothing converted: not marked
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# -- bad input and what an error leaves ----------------------------------------------------------
def test_bad_input_is_refused_clearly(tmp_path):
    model = _quantized("llama", "nvfp4", "modelopt")
    with pytest.raises(ValueError, match="modelopt layout stores NVFP4"):
        autofp4.save_pretrained(_quantized("llama", "mxfp4", "compressed-tensors"), tmp_path / "a", layout="modelopt")
    with pytest.raises(ValueError, match="gpt-oss layout is gpt-oss's own"):
        autofp4.save_pretrained(_quantized("llama", "mxfp4", "compressed-tensors"), tmp_path / "a", layout="gpt-oss")
    with pytest.raises(ValueError, match="layout must be one of"):
        autofp4.save_pretrained(model, tmp_path / "a", layout="gguf")
    with pytest.raises(ValueError, match="only the routed experts"):
        autofp4.save_pretrained(_quantized("gpt_oss", "mxfp4", "compressed-tensors"), tmp_path / "a", layout="gpt-oss")
    with pytest.raises(ValueError, match="no FP4 layers"):
        autofp4.save_pretrained(_model("llama"), tmp_path / "a")
    with pytest.raises(TypeError, match="transformers model"):
        autofp4.save_pretrained(torch.nn.Linear(16, 16), tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        autofp4.save_pretrained(model, tmp_path / "full")
    # overwrite replaces a previous output only, never a directory of other files
    with pytest.raises(FileExistsError, match="is not a quantized checkpoint"):
        autofp4.save_pretrained(model, tmp_path / "full", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]
    (tmp_path / "full" / "keep.txt").unlink()
    autofp4.save_pretrained(model, tmp_path / "full")
    (tmp_path / "full" / "notes.txt").write_text("mine")  # a previous output holding a file of the user's: kept
    with pytest.raises(FileExistsError, match=r"holds 1 file that is not part of a checkpoint \('notes.txt'\)"):
        autofp4.save_pretrained(model, tmp_path / "full", overwrite=True)
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    (tmp_path / "full" / "notes.txt").unlink()
    autofp4.save_pretrained(model, tmp_path / "full", overwrite=True)
    assert (tmp_path / "full" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temporary directory left


def test_an_error_while_writing_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "qwen3_moe")
    calls = {"n": 0}
    original = qc_mod._run_experts

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full (simulated)")
        return original(*a, **k)

    monkeypatch.setattr(qc_mod, "_run_experts", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_the_cli_refuses_bad_sources_and_outputs(tmp_path, capsys):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "llama")
    assert cli_main(["quantize", str(tmp_path / "nope"), "--fmt", "nvfp4", "--out", str(tmp_path / "o")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(src), "--overwrite"]) == 2
    assert "would replace the source" in capsys.readouterr().err
    assert cli_main(["quantize", str(src), "--fmt", "mxfp4", "--layout", "modelopt", "--out", str(tmp_path / "o")]) == 2
    assert "modelopt layout stores NVFP4" in capsys.readouterr().err
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(tmp_path / "o"), "--max-shard-size", "big"]) == 2
    assert "--max-shard-size" in capsys.readouterr().err
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(tmp_path / "q"), "--no-progress"]) == 0
    assert cli_main(["quantize", str(tmp_path / "q"), "--fmt", "nvfp4", "--out", str(tmp_path / "o")]) == 2  # already FP4
    assert "already quantized" in capsys.readouterr().err
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text((src / "config.json").read_text())
    assert cli_main(["quantize", str(tmp_path / "e"), "--fmt", "nvfp4", "--out", str(tmp_path / "o")]) == 2
    assert "no *.safetensors" in capsys.readouterr().err
    bad = tmp_path / "nan"
    _bf16_checkpoint(bad, "llama")
    sd = safetensors_torch.load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.self_attn.v_proj.weight"][3, 5] = float("nan")
    safetensors_torch.save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert cli_main(["quantize", str(bad), "--fmt", "nvfp4", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "NaN or inf" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_the_quality_report_is_the_quantization_error(tmp_path):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "llama", seed=4)
    summary = autofp4.quantize_checkpoint(src, tmp_path / "out", "mxfp4", progress=False)
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    assert report["layout"] == "compressed-tensors" and report["tensors_quantized"] == 14
    by_name = {r["name"]: r for r in report["tensors"]}
    w = _tensors(src)["model.layers.1.mlp.down_proj.weight"].double()
    q = autofp4.quantize(w.to(BF16), "mxfp4")
    err = _rel(q.dequantize(torch.float64), w)
    r = by_name["model.layers.1.mlp.down_proj"]
    assert r["rel_error"] == pytest.approx(err, rel=1e-4)
    assert r["sqnr_db"] == pytest.approx(-20 * math.log10(err), rel=1e-4)
    assert report["worst"][0] == max(by_name.values(), key=lambda r: r["rel_error"])["name"]
    assert report["bytes_after"] < report["bytes_before"] and summary.peak_rss_bytes > 0
    assert "lm_head" in report["kept_in_high_precision"]


# -- a checkpoint larger than the memory the conversion may use ----------------------------------
@pytest.mark.slow
def test_a_30_gb_checkpoint_quantizes_in_bounded_memory(tmp_path):
    """30 GB of bf16 Llama-3.1-70B layers (written here by scripts/bench_quantize_checkpoint.py,
    random rows) quantized to NVFP4 by the CLI in a fresh process: peak RSS under 6 GB; the time is
    printed. Skipped where the disk lacks the 42 GB it needs."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    if free < 42e9:
        pytest.skip(f"needs 42 GB of free disk in {tmp_path}, has {free / 1e9:.0f} GB")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_quantize_checkpoint import make_checkpoint

    info = make_checkpoint(tmp_path / "src", 30)  # Llama-3.1-70B layer shapes, random rows
    assert info["bytes"] > 29e9
    run = subprocess.run([sys.executable, "-m", "autofp4", "quantize", str(tmp_path / "src"), "--fmt", "nvfp4",
                          "--out", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    print(f"\n30 GB checkpoint ({info['layers']} layers): {report['seconds']:.0f} s, peak RSS "
          f"{report['peak_rss_bytes'] / 1e9:.2f} GB, {report['bytes_before'] / 1e9:.1f} -> {report['bytes_after'] / 1e9:.1f} GB")
    assert report["peak_rss_bytes"] < 6e9
    assert report["tensors_quantized"] == 7 * info["layers"]
    # spot checks against autofp4.quantize of the same source tensors (q/k/v share one global scale)
    from autofp4.integrations.safetensors_io import SafetensorsReader

    src, out = SafetensorsReader(tmp_path / "src"), SafetensorsReader(tmp_path / "out")
    last = info["layers"] - 1
    for name in (f"model.layers.{last}.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        q = autofp4.quantize(src.read(f"{name}.weight"), "nvfp4")
        assert torch.equal(out.read(f"{name}.weight"), q.data)
        assert torch.equal(_bits(out.read(f"{name}.weight_scale")), _bits(q.scale))
        assert torch.equal(out.read(f"{name}.weight_scale_2"), q.global_scale)
    assert torch.equal(out.read("lm_head.weight", (0, 8)), src.read("lm_head.weight", (0, 8)))


# -- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind,fmt,layout", [("qwen3_moe", "nvfp4", "modelopt"), ("gpt_oss", "mxfp4", "gpt-oss"),
                                             ("deepseek_v3", "mxfp4", "compressed-tensors")])
def test_quantizing_on_the_gpu_writes_the_cpu_bytes_and_the_checkpoint_runs_there(tmp_path, kind, fmt, layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src = tmp_path / "src"
    _bf16_checkpoint(src, kind)
    skip = _skip(layout)
    autofp4.quantize_checkpoint(src, tmp_path / "cpu", fmt, layout, skip=skip, progress=False)
    autofp4.quantize_checkpoint(src, tmp_path / "gpu", fmt, layout, skip=skip, device="cuda", progress=False)
    a, b = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "gpu")
    assert sorted(a) == sorted(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
    # the checkpoint on the GPU (the FP4 kernels) against the same model quantized in memory there
    model = _quantized(kind, fmt, layout).cuda()
    back = autofp4.from_pretrained(tmp_path / "gpu", device_map="cuda")
    ids = torch.randint(0, ATTN["vocab_size"], (2, 9), device="cuda")
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


# -- a broken source is named, never written through ------------------------------------------------
def _edit_source(root: Path, fn) -> None:
    sd = safetensors_torch.load_file(str(root / "model.safetensors"))
    fn(sd)
    safetensors_torch.save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})


def test_a_non_finite_copied_tensor_is_warned_about(tmp_path):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "llama")
    _edit_source(src, lambda sd: sd["model.norm.weight"].__setitem__(2, float("inf")))
    with pytest.warns(UserWarning, match=r"'model.norm.weight' holds 1 non-finite value"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)


@pytest.mark.parametrize("case,match", [
    ("int8", r"stored as torch.int8, a linear weight must be floating point"),
    ("float64", r"stored as torch.float64; a weight to quantize must be bfloat16, float16 or float32"),
    ("shape", r"'model.layers.0.self_attn.q_proj.weight' is \[64, 48\], config.json wants \[64, 64\]"),
    ("missing", r"lacks 1 tensors .*model.layers.1.mlp.up_proj.weight"),
    ("nan-nvfp4", r"'model.layers.0.self_attn.k_proj.weight'.* holds NaN or inf"),
    ("nan-mxfp4", r"model.layers.0.self_attn.k_proj holds NaN or inf"),
    ("overlap", r"the bytes of tensor .* overlaps"),
    ("int-norm", r"'model.norm.weight' is stored as torch.int64, the model's parameter must be floating point"),
    ("nan-config", r"config.json: rms_norm_eps is NaN"),
])
def test_a_broken_source_is_refused_naming_the_tensor(tmp_path, case, match):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "llama")
    q = "model.layers.0.self_attn.q_proj.weight"
    if case == "int8":
        _edit_source(src, lambda sd: sd.__setitem__(q, (sd[q].float() * 100).to(torch.int8)))
    elif case == "float64":
        _edit_source(src, lambda sd: sd.__setitem__(q, sd[q].double()))
    elif case == "shape":
        _edit_source(src, lambda sd: sd.__setitem__(q, sd[q][:, :48].contiguous()))
    elif case == "missing":
        _edit_source(src, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    elif case == "int-norm":
        _edit_source(src, lambda sd: sd.__setitem__("model.norm.weight", torch.randint(1, 5, sd["model.norm.weight"].shape)))
    elif case == "nan-config":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": float("nan")}))
    elif case.startswith("nan"):
        k = "model.layers.0.self_attn.k_proj.weight"
        _edit_source(src, lambda sd: sd[k].__setitem__((3, 5), float("nan")))
    else:  # up_proj's header entry pointing at gate_proj's bytes
        f = src / "model.safetensors"
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header["model.layers.0.mlp.up_proj.weight"]["data_offsets"] = header["model.layers.0.mlp.gate_proj.weight"]["data_offsets"]
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        f.write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])
    fmt = "mxfp4" if case == "nan-mxfp4" else "nvfp4"
    with pytest.raises(ValueError, match=match):
        autofp4.quantize_checkpoint(src, tmp_path / "out", fmt, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_odd_outputs_and_devices(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    _bf16_checkpoint(src, "llama")
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", ".", "--no-progress"]) == 2  # not empty
    # --overwrite never replaces the working directory, nor a directory of other files
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", ".", "--overwrite", "--no-progress"]) == 2
    assert "is the current working directory" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]
    (work / "keep.txt").unlink()  # an empty working directory is written into
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", ".", "--no-progress"]) == 0
    assert (work / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "work"]
    capsys.readouterr()
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", "/proc/autofp4-x", "--no-progress"]) == 2
    assert "cannot write the checkpoint /proc/autofp4-x" in capsys.readouterr().err
    for dev in ("meta", "tpu"):
        assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(tmp_path / "o"), "--device", dev]) == 2
        assert "device must be cpu or cuda" in capsys.readouterr().err
    model = _quantized("llama", "nvfp4", "modelopt")
    with pytest.raises(TypeError, match="tokenizer must have a save_pretrained"):
        autofp4.save_pretrained(model, tmp_path / "o", tokenizer="abc")
    with pytest.raises(FileNotFoundError, match="copy_files_from"):
        autofp4.save_pretrained(model, tmp_path / "o", copy_files_from=tmp_path / "nope")
    with pytest.raises(ValueError, match="meta device"):
        autofp4.save_pretrained(model.to("meta"), tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_sigterm_while_writing_leaves_nothing(tmp_path):
    import signal
    import time

    src = tmp_path / "src"
    cfg = transformers.LlamaConfig(**{**ATTN, "hidden_size": 1024, "num_hidden_layers": 4}, intermediate_size=2048)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=BF16).save_pretrained(src)
    proc = subprocess.Popen([sys.executable, "-m", "autofp4", "quantize", str(src), "--fmt", "nvfp4", "--out",
                             str(tmp_path / "out"), "--no-progress"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()) and time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"finished before it could be stopped: {proc.stderr.read()[-500:]}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 130, proc.stderr.read()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _round_trip_logits(model, tmp_path, name, wrap=lambda m: m):
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
        out = autofp4.save_pretrained(wrap(model), tmp_path / name)
        back = autofp4.from_pretrained(out)
        got = back(ids).logits.float()
    return back, float((got - ref).norm() / ref.norm())


def test_a_torch_compiled_model_is_saved_as_the_model(tmp_path):
    """save_pretrained(torch.compile(model)) wrote every name with compile's '_orig_mod.' prefix,
    a checkpoint nothing could load; it is the model's checkpoint."""
    model = _model("llama")
    autofp4.quantize_model(model, "nvfp4")
    _, rel = _round_trip_logits(model, tmp_path, "compiled", torch.compile)
    assert rel < 1e-2, rel
    with safe_open(str(tmp_path / "compiled" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "_orig_mod" in k]


def test_tied_embeddings_with_an_fp4_lm_head_load_back(tmp_path):
    """A tied model quantized with skip=() has an FP4 lm_head apart from its embeddings: the
    checkpoint says it is untied (the loader tied them again and failed inside)."""
    torch.manual_seed(0)
    config = _config("llama")
    config.tie_word_embeddings = True
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=BF16)
    autofp4.quantize_model(model, "nvfp4", skip=())
    back, rel = _round_trip_logits(model, tmp_path, "tied")
    assert rel < 1e-2, rel
    assert isinstance(back.lm_head, autofp4.nn.FP4Linear) and back.config.tie_word_embeddings is False
