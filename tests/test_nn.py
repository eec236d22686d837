"""FP4Linear and quantize_model on real torch modules."""
import pytest
import torch
from torch import nn

import autofp4
from autofp4.nn import FP4Linear, quantize_model


def test_from_linear_matches_dequantized_weight(gen):
    lin = nn.Linear(256, 80, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 256, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
    q = FP4Linear.from_linear(lin, "nvfp4")
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    ref = x.double() @ q.fp4_weight().dequantize(torch.float32).double().T + lin.bias.double()
    y = q(x)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
    # and it is close to the original layer (FP4 quantization error, ~10% relative)
    assert float((y.double() - lin(x).double()).norm() / lin(x).double().norm()) < 0.2


def test_state_dict_round_trip(gen):
    q = FP4Linear(autofp4.quantize(torch.randn(32, 64, generator=gen), "mxfp4"))
    q2 = FP4Linear(autofp4.quantize(torch.randn(32, 64, generator=gen), "mxfp4"))
    q2.load_state_dict(q.state_dict())
    x = torch.randn(3, 64, generator=gen).to(torch.float16)
    assert torch.equal(q(x), q2(x))
    assert set(q.state_dict()) == {"weight_packed", "weight_scale", "weight_global_scale"} or set(
        q.state_dict()
    ) == {"weight_packed", "weight_scale"}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"q": nn.Linear(64, 64), "odd": nn.Linear(40, 64), "mlp": nn.Linear(64, 128)}) for _ in range(2)
        )
        self.lm_head = nn.Linear(128, 50)


def test_quantize_model_report():
    m = Tiny()
    report = quantize_model(m, "nvfp4")
    assert sorted(report.converted) == sorted(f"layers.{i}.{n}" for i in range(2) for n in ("q", "mlp"))
    skipped = dict(report.skipped)
    assert skipped["lm_head"] == "matches a skip pattern"
    assert "in_features=40 is not a multiple of nvfp4's block size 16" in skipped["layers.0.odd"]
    assert isinstance(m.layers[1]["mlp"], FP4Linear) and isinstance(m.lm_head, nn.Linear)
    assert report.bytes_after < report.bytes_before / 5
    assert "converted 4 Linear layers to nvfp4, skipped 3" in str(report)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_model(Tiny(), "int4")


def test_quantize_hf_llama_model(gen):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(gen.initial_seed())
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 12), generator=gen)
    with torch.no_grad():
        before = model(ids).logits.float()
    report = quantize_model(model, "nvfp4")
    assert len(report.converted) == 2 * 7  # q k v o gate up down per layer
    assert [n for n, _ in report.skipped] == ["lm_head"]
    with torch.no_grad():
        after = model(ids).logits.float()
    # FP4 weights perturb the logits but keep them strongly correlated with the original
    cos = torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0)
    assert 0.9 < float(cos) < 0.99999
