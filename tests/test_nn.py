"""FP4Linear and quantize_model on real torch modules."""
import os
import pytest
import torch
from torch import nn

import autofp4
from autofp4.nn import FP4FusedLinear, FP4Linear, FP4LinearPart, quantize_model


def test_from_linear_matches_dequantized_weight(gen):
    lin = nn.Linear(256, 80, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 256, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
    q = FP4Linear.from_linear(lin, "nvfp4")
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    ref = x.double() @ q.fp4_weight().dequantize(torch.float32).double().T + lin.bias.detach().double()
    y = q(x)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
    # and it is close to the original layer (FP4 quantization error, ~10% relative)
    with torch.no_grad():
        dense = lin(x).double()
    assert float((y.double() - dense).norm() / dense.norm()) < 0.2


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


def _tiny_llama(gen, dtype):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, mlp_bias=True,
    )
    torch.manual_seed(gen.initial_seed())
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-zero biases, so the bias path is exercised
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * 0.1)
    return model


def _dequantized_copy(quantized, original):
    """``original`` with each layer that ``quantized`` converted replaced by a float32 nn.Linear of
    the dequantized FP4 weight: the same model computed without FP4 kernels."""
    import copy

    ref = copy.deepcopy(original)
    for name, mod in quantized.named_modules():
        if isinstance(mod, (FP4Linear, FP4LinearPart)) and not isinstance(mod, FP4FusedLinear):
            lin = ref.get_submodule(name)
            with torch.no_grad():
                lin.weight.copy_(mod.fp4_weight().dequantize(torch.float32))
    return ref


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_quantize_float32_hf_llama_model(dtype, gen):
    import copy

    model = _tiny_llama(gen, torch.float32)
    original = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 12), generator=gen)
    report = quantize_model(model, "nvfp4", dtype=dtype)
    assert len(report.converted) == 2 * 7
    expected = dtype or torch.bfloat16
    assert report.compute_dtypes == {name: expected for name in report.converted}
    assert f"14 converted layers compute in {str(expected)[6:]}" in str(report)
    assert all(model.get_submodule(n).compute_dtype == expected for n in report.converted)
    ref_model = _dequantized_copy(model, original)
    with torch.no_grad():
        out = model(ids).logits
        ref = ref_model(ids).logits
        orig = original(ids).logits
    assert out.dtype == torch.float32 and out.shape == (2, 12, 128)
    # the same model with the dequantized weights, up to the activations' rounding to 16 bits
    assert rel(out, ref) < 3e-3
    # the bound tells the FP4 weights apart: the original float32 weights are much further off
    assert rel(orig, ref) > 5 * rel(out, ref)


def test_float32_layer_casts_back_and_adds_the_bias_in_float32(gen):
    lin = nn.Linear(64, 48, bias=True)  # float32
    with torch.no_grad():
        lin.bias.copy_(torch.randn(48, generator=gen))
    m = nn.Sequential(lin)
    report = quantize_model(m, "mxfp4", skip=[])
    q = m[0]
    assert isinstance(q, FP4Linear) and q.compute_dtype == torch.bfloat16 and q.bias.dtype == torch.float32
    assert "compute_dtype=torch.bfloat16" in repr(q)
    for shape in [(64,), (5, 64), (2, 3, 64)]:
        x = torch.randn(*shape, generator=gen)
        y = q(x)
        assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 48)
        w = q.fp4_weight().dequantize(torch.float32).double()
        expected = x.to(torch.bfloat16).double() @ w.T  # computed from the bf16-rounded input
        assert rel(y - lin.bias, expected) < 1e-2
        assert torch.equal(y, autofp4.linear(x.to(torch.bfloat16), q.fp4_weight()).float() + lin.bias)
        # bf16 inputs to the same layer: bf16 out
        assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_16_bit_model_is_unchanged_without_dtype(gen):
    m = Tiny().to(torch.bfloat16)
    report = quantize_model(m, "nvfp4")
    assert report.compute_dtypes == {} and "compute in" not in str(report)
    assert m.layers[0]["q"].compute_dtype is None
    report = quantize_model(Tiny().to(torch.float16), "nvfp4", dtype=torch.bfloat16)
    assert set(report.compute_dtypes) == set(report.converted)
    # a plain FP4Linear keeps refusing float32 input, naming the dtype
    q = FP4Linear(autofp4.quantize(torch.randn(32, 64, generator=gen), "nvfp4"))
    with pytest.raises(TypeError, match="bfloat16 or float16, got torch.float32"):
        q(torch.randn(2, 64))


@pytest.mark.parametrize("bad,err", [(torch.float32, ValueError), (torch.int8, ValueError),
                                     ("bfloat16", TypeError), (16, TypeError)])
def test_bad_compute_dtype(bad, err):
    with pytest.raises(err, match="dtype must be torch.bfloat16, torch.float16 or None"):
        quantize_model(Tiny(), "nvfp4", dtype=bad)
    with pytest.raises(err, match="compute_dtype must be"):
        FP4Linear(autofp4.quantize(torch.randn(32, 64), "nvfp4"), compute_dtype=bad)


def test_float32_model_under_torch_compile(gen):
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False))
    quantize_model(m, "nvfp4", skip=[])
    x = torch.randn(2, 5, 64, generator=gen)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = m(x)
        out = compiled(x)
    assert out.dtype == torch.float32 and torch.equal(out, eager)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dtype_conversions_keep_the_fp4_buffers(fmt):
    """``model.to(torch.float16)`` after quantize_model converts the biases and the rest of the
    model, not the FP4 values, block scales or global scales (an E4M3 scale turned into fp16, or
    an fp32 global scale rounded to fp16, would break or change the layer)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    model = model.to(torch.bfloat16)
    autofp4.quantize_model(model, fmt)
    before = {n: (b.dtype, b.clone()) for n, b in model.named_buffers()}
    model = model.to(torch.float16)
    for n, b in model.named_buffers():
        assert b.dtype == before[n][0] and torch.equal(b, before[n][1]), n
    assert model[0].bias.dtype == torch.float16
    x = torch.randn(5, 64, generator=gen).half()
    ref = x.double()
    for layer in (model[0], torch.relu, model[2]):  # (MXFP4 keeps the 48-wide layer dense: 48 % 32)
        if isinstance(layer, autofp4.FP4Linear):
            ref = ref @ layer.fp4_weight().dequantize(torch.float64).T + layer.bias.double()
        elif isinstance(layer, torch.nn.Linear):
            ref = ref @ layer.weight.double().T + layer.bias.double()
        else:
            ref = layer(ref)
    out = model(x)
    assert out.dtype == torch.float16
    assert rel(out, ref) < 2e-2


def test_a_used_fp4_layer_deep_copies_and_pickles(gen, tmp_path):
    """After a forward (the weight holds its prepacked forms and cached runners) the module still
    copies and saves: the copy has the tensors and builds its caches again."""
    import copy

    m = nn.Sequential(nn.Linear(64, 96, bias=True)).to(torch.bfloat16)
    quantize_model(m, "nvfp4", skip=[])
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = m(x)
        twin = copy.deepcopy(m)
        torch.save(m, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        for other in (twin, loaded):
            assert other[0].fp4_weight() is not m[0].fp4_weight()
            assert other[0].fp4_weight().data.data_ptr() != m[0].weight_packed.data_ptr()
            assert torch.equal(other(x), want)


@pytest.mark.parametrize("fmt,key,value", [("nvfp4", "weight_global_scale", float("nan")),
                                           ("nvfp4", "weight_global_scale", -0.5),
                                           ("nvfp4", "weight_scale", 0x7F), ("mxfp4", "weight_scale", 0xFF)])
def test_load_state_dict_checks_the_values_as_fp4weight_does(fmt, key, value):
    """load_state_dict copies into the buffers in place: a NaN or negative scale is an error of
    the load (as FP4Weight(...) refuses it), not NaN outputs later."""
    torch.manual_seed(3)
    src = FP4Linear(autofp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), fmt))
    dst = FP4Linear(autofp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), fmt))
    sd = src.state_dict()
    if key == "weight_global_scale":
        sd[key] = torch.full_like(sd[key], value)
    else:
        raw = sd[key].view(torch.uint8).clone()
        raw[3, 0] = value
        sd[key] = raw.view(sd[key].dtype)
    with pytest.raises(RuntimeError, match=r"weight: FP4Weight: .*(not finite and positive|NaN)"):
        dst.load_state_dict(sd)
    src2 = FP4Linear(autofp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), fmt))
    dst.load_state_dict(src2.state_dict())  # a valid one loads
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(dst(x), src2(x), rtol=0, atol=0)


def test_load_state_dict_checks_a_partial_dict_and_refuses_tensors_of_another_dtype():
    """strict=False with only a scale in the dict is checked too; a scale of another dtype (which
    torch would convert by value into the FP8 / E8M0 buffer) is an error, the buffer untouched."""
    torch.manual_seed(4)
    dst = FP4Linear(autofp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), "nvfp4"))
    with pytest.raises(RuntimeError, match="global_scale that is not finite and positive"):
        dst.load_state_dict({"weight_global_scale": torch.tensor(float("nan"))}, strict=False)
    dst = FP4Linear(autofp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), "nvfp4"))
    before = dst.weight_scale.clone()
    sd = dst.state_dict()
    sd["weight_scale"] = sd["weight_scale"].view(torch.uint8).clone()
    with pytest.raises(RuntimeError, match=r"weight_scale: stored as torch.uint8, but the layer's buffer is "
                                           r"torch.float8_e4m3fn"):
        dst.load_state_dict(sd)
    assert torch.equal(dst.weight_scale.view(torch.uint8), before.view(torch.uint8))
