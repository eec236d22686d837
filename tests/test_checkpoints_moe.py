"""autofp4.from_pretrained on tiny MoE checkpoints written here: Qwen3-MoE and Mixtral in ModelOpt
NVFP4 (one linear per expert; Mixtral with its stored ``block_sparse_moe`` / ``w1 w3 w2`` names),
Qwen3-MoE in compressed-tensors NVFP4, and gpt-oss in MXFP4 (stacked ``*_blocks`` / ``*_scales``),
each with one layer's experts excluded; checked against the same models built with the stored
weights dequantized."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import autofp4  # noqa: E402
from autofp4 import FP4Linear  # noqa: E402
from autofp4.integrations.transformers import FP4Experts  # noqa: E402

ATTN = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
EXCLUDED_LAYER = 1  # its experts stay dense
SEED = 3


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(**ATTN, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def mixtral_config():
    return transformers.MixtralConfig(**ATTN, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def gpt_oss_config():
    return transformers.GptOssConfig(**ATTN, head_dim=16, intermediate_size=64, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=16)


def _random_state(cfg, seed):
    """Random weights of the tiny model (fp32) by the model's names."""
    g = torch.Generator().manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight"):
            out[k] = 1 + 0.1 * torch.randn(v.shape, generator=g)
        elif k.endswith("_bias") or k.endswith(".sinks"):
            out[k] = 0.3 * torch.randn(v.shape, generator=g)
        else:
            out[k] = torch.randn(v.shape, generator=g) * (0.5 if "embed" in k else 0.1)
    for k in out:
        if k.endswith(("mlp.gate.weight", "mlp.router.weight")):  # clear routing decisions
            out[k] *= 4
    for k in out:  # the up rows larger than the gate rows: another global scale per expert
        if k.endswith("experts.gate_up_proj") and "gpt_oss" not in type(model).__module__:
            out[k][:, out[k].shape[1] // 2:] *= 3
    return out


def _nvfp4_parts(w: torch.Tensor, layout: str):
    q = autofp4.quantize(w, "nvfp4")
    ins = torch.rand((), dtype=torch.float32) + 0.01
    if layout == "modelopt":
        parts = {"weight": q.data, "weight_scale": q.scale, "weight_scale_2": q.global_scale, "input_scale": ins}
    else:
        parts = {"weight_packed": q.data, "weight_scale": q.scale,
                 "weight_global_scale": torch.reciprocal(q.global_scale).reshape(1),
                 "input_global_scale": torch.reciprocal(ins).reshape(1)}
        # the value a loader reads: 1 / (1 / s) is not always s in fp32
        q = autofp4.FP4Weight("nvfp4", q.data, q.scale, torch.reciprocal(parts["weight_global_scale"]).reshape(()))
    return {k: v.contiguous() for k, v in parts.items()}, autofp4.dequantize(q, torch.float32)


def _quant_config(layout: str, model_type: str):
    experts = f"model.layers.{EXCLUDED_LAYER}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}.experts"
    if layout == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ["lm_head", "*.gate", f"{experts}*"]}
    if layout == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                              "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
                "ignore": ["lm_head", "re:.*mlp\\.gate$", f"re:{experts.replace('.', chr(92) + '.')}\\."]}
    return {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head", experts]}


def write_checkpoint(root: Path, cfg, state: dict, layout: str):
    """Writes ``state`` as a checkpoint of ``layout``; returns (the stored values dequantized, by
    the model's names, the gate/up global-scale pairs of the FP4 experts)."""
    root.mkdir(parents=True, exist_ok=True)
    mixtral = cfg.model_type == "mixtral"
    stored, ref, scale_pairs = {}, {}, []
    excluded = f"model.layers.{EXCLUDED_LAYER}.mlp.experts."

    def put(name, t):
        stored[name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name] = t.contiguous()

    for k, v in state.items():
        is_experts = ".experts." in k and k.rpartition(".")[2] in ("gate_up_proj", "down_proj")
        if layout == "mxfp4":
            if is_experts and not k.startswith(excluded):
                q = autofp4.quantize(v.transpose(1, 2).contiguous(), "mxfp4")  # [E, N, K]
                e, n, half = q.data.shape
                put(f"{k}_blocks", q.data.reshape(e, n, half // 16, 16))
                put(f"{k}_scales", q.scale)
                ref[k] = autofp4.dequantize(q, torch.float32).transpose(1, 2)
            else:
                put(k, v.to(torch.bfloat16))
                ref[k] = v.to(torch.bfloat16).float()
            continue
        if is_experts:
            base = k.rpartition(".")[0]
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            rows = []
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    i = v.shape[1] // 2
                    pieces = [(names[0], v[e, :i]), (names[1], v[e, i:])]
                else:
                    pieces = [(names[2], v[e])]
                deq, pair = [], []
                for p, w in pieces:
                    if k.startswith(excluded):
                        put(f"{base}.{e}.{p}.weight", w.to(torch.bfloat16))
                        deq.append(w.to(torch.bfloat16).float())
                        continue
                    parts, d = _nvfp4_parts(w, layout)
                    for pn, t in parts.items():
                        put(f"{base}.{e}.{p}.{pn}", t)
                    deq.append(d)
                    pair.append(parts.get("weight_scale_2", parts.get("weight_global_scale")))
                if len(pair) == 2:
                    scale_pairs.append(pair)
                rows.append(torch.cat(deq))
            ref[k] = torch.stack(rows)
        elif k.endswith("proj.weight") and ".self_attn." in k:
            parts, d = _nvfp4_parts(v, layout)
            for pn, t in parts.items():
                put(f"{k[:-len('.weight')]}.{pn}", t)
            ref[k] = d
        else:
            put(k, v.to(torch.bfloat16))
            ref[k] = v.to(torch.bfloat16).float()
    conf = cfg.to_dict()
    conf["quantization_config"] = _quant_config(layout, cfg.model_type)
    (root / "config.json").write_text(json.dumps(conf))
    safetensors_torch.save_file(stored, str(root / "model.safetensors"))
    return ref, scale_pairs


def reference_logits(cfg, ref, ids):
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.load_state_dict(ref)
    with torch.no_grad():
        return model(ids).logits.double()


CASES = [("qwen3_moe", "modelopt"), ("mixtral", "modelopt"), ("qwen3_moe", "compressed-tensors"),
         ("gpt_oss", "mxfp4")]
CONFIGS = {"qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config, "gpt_oss": gpt_oss_config}


@pytest.mark.parametrize("arch,layout", CASES)
def test_moe_checkpoints_load_against_the_dequantized_model(tmp_path, arch, layout):
    cfg = CONFIGS[arch]()
    ref, pairs = write_checkpoint(tmp_path / "ckpt", cfg, _random_state(cfg, SEED), layout)
    model = autofp4.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)

    experts = {n: m for n, m in model.named_modules() if isinstance(m, FP4Experts)}
    assert list(experts) == ["model.layers.0.mlp.experts"]
    fp4 = experts["model.layers.0.mlp.experts"]
    assert fp4.fmt == ("mxfp4" if layout == "mxfp4" else "nvfp4")
    assert fp4.activation == ("swigluoai" if arch == "gpt_oss" else "silu")
    dense = model.get_submodule(f"model.layers.{EXCLUDED_LAYER}.mlp.experts")
    assert not isinstance(dense, FP4Experts) and dense.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(dense.gate_up_proj.float(), ref[f"model.layers.{EXCLUDED_LAYER}.mlp.experts.gate_up_proj"])
    assert isinstance(model.lm_head, nn.Linear)
    n_linear = sum(isinstance(m, FP4Linear) for m in model.modules())
    assert n_linear == (0 if layout == "mxfp4" else 2 * 4)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))

    # the stacked experts against the stored values: exact for down (and gpt-oss), the gate/up
    # fold to one global scale per expert re-rounds the block scales of the smaller one
    w13 = fp4.fp4_weight("gate_up_proj").dequantize(torch.float32)
    w2 = fp4.fp4_weight("down_proj").dequantize(torch.float32)
    gu, dn = ref["model.layers.0.mlp.experts.gate_up_proj"], ref["model.layers.0.mlp.experts.down_proj"]
    if arch == "gpt_oss":
        gu = gu.transpose(1, 2)
        gu, dn = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1), dn.transpose(1, 2)
        assert torch.equal(fp4.gate_up_proj_bias.float(), torch.cat(
            (ref["model.layers.0.mlp.experts.gate_up_proj_bias"][:, 0::2],
             ref["model.layers.0.mlp.experts.gate_up_proj_bias"][:, 1::2]), dim=1))
    assert torch.equal(w2, dn)
    rel13 = ((w13 - gu).norm() / gu.norm()).item()
    if arch == "gpt_oss":
        assert rel13 == 0
    else:
        assert pairs and all(float(a) != float(b) for a, b in pairs)  # the fold has work to do
        i = gu.shape[1] // 2
        gate_err = ((w13[:, :i] - gu[:, :i]).norm() / gu[:, :i].norm()).item()
        up_err = ((w13[:, i:] - gu[:, i:]).norm() / gu[:, i:].norm()).item()
        # measured 2.8e-2 at these 3x scale ratios (E4M3 re-rounding of the block scales; NVFP4 itself
        # is about 1e-1 off the fp32 weights)
        assert up_err == 0 and 0 < gate_err < 4e-2, (gate_err, up_err)

    # the reference: the stored weights dequantized, the experts as loaded (the fold measured above)
    for name, m in experts.items():
        w13, w2 = (m.fp4_weight(p).dequantize(torch.float32) for p in ("gate_up_proj", "down_proj"))
        if arch == "gpt_oss":  # back to the model's layout: [E, H, 2I] interleaved, [E, I, H]
            i = w13.shape[1] // 2
            w13 = torch.stack((w13[:, :i], w13[:, i:]), dim=2).reshape(w13.shape).transpose(1, 2)
            w2 = w2.transpose(1, 2)
        ref[f"{name}.gate_up_proj"], ref[f"{name}.down_proj"] = w13, w2
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits.double()
    want = reference_logits(cfg, ref, ids)
    rel = ((got - want).norm() / want.norm()).item()
    # measured over 5 seeds: 0.8e-2 to 1.8e-2 (NVFP4), 0.9e-2 to 2.0e-2 (MXFP4): bf16 activations
    assert rel < 3e-2, rel
    assert want.std() > 0.1


def test_experts_stored_quantized_but_excluded_are_an_error(tmp_path):
    cfg = qwen3_moe_config()
    write_checkpoint(tmp_path / "c", cfg, _random_state(cfg, 4), "modelopt")
    conf = json.loads((tmp_path / "c" / "config.json").read_text())
    conf["quantization_config"]["exclude_modules"].append("model.layers.0.mlp.experts")
    (tmp_path / "c" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="experts 'model.layers.0.mlp.experts' are excluded"):
        autofp4.from_pretrained(tmp_path / "c")


def test_a_missing_expert_is_named(tmp_path):
    cfg = qwen3_moe_config()
    write_checkpoint(tmp_path / "c", cfg, _random_state(cfg, 5), "modelopt")
    sd = safetensors_torch.load_file(str(tmp_path / "c" / "model.safetensors"))
    del sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    safetensors_torch.save_file(sd, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(KeyError, match=r"experts\.3\.up_proj"):
        autofp4.from_pretrained(tmp_path / "c")
