"""quantize_model on module structures beyond plain transformers decoders: Linear subclasses,
layers whose owner reads ``.weight``, one layer under two names, hooks, GPT-2's Conv1D, a root
that is itself a Linear, converter hooks; and from_pretrained of checkpoints that are not causal
LMs. Each case either converts correctly (outputs checked against the unconverted model's math)
or keeps the layer in high precision with a reason in the report, or raises an error naming the
cause."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autofp4
from autofp4.nn import FP4Linear, _MODULE_CONVERTERS


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _skipped(report) -> dict[str, str]:
    return dict(report.skipped)


def test_a_linear_subclass_with_its_own_forward_is_kept_and_named():
    torch.manual_seed(0)

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 10

    class Plain(nn.Linear):  # no forward of its own: converted
        pass

    m = nn.Sequential(Scaled(64, 64), Plain(64, 64)).bfloat16()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y0 = m(x)
    r = autofp4.quantize_model(m, "nvfp4")
    assert "own forward" in _skipped(r)["0"] and "Scaled" in _skipped(r)["0"]
    assert type(m[0]) is Scaled and isinstance(m[1], FP4Linear) and r.converted == ["1"]
    assert 1e-3 < _rel(m(x), y0) < 0.2  # only the FP4 rounding of layer 1


def test_torch_attention_and_transformer_layers_keep_the_layers_they_read():
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).bfloat16().eval()
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    y0 = layer(x)
    r = autofp4.quantize_model(layer, "nvfp4")
    assert r.converted == [] and set(_skipped(r)) == {"self_attn.out_proj", "linear1", "linear2"}
    assert torch.equal(layer(x), y0)
    mha = nn.Sequential(nn.Linear(64, 64), nn.MultiheadAttention(64, 4, batch_first=True)).bfloat16()
    r = autofp4.quantize_model(mha, "nvfp4")
    assert r.converted == ["0"] and "reads" in _skipped(r)["1.out_proj"]


def test_a_layer_under_two_names_is_converted_once_under_both():
    torch.manual_seed(2)
    lin = nn.Linear(64, 64).bfloat16()
    m = nn.Module()
    m.a, m.b = lin, lin
    m.q_proj, m.k_proj, m.v_proj = (nn.Linear(64, 32).bfloat16() for _ in range(3))
    m.o = m.k_proj  # a projection that is also shared: not fused with its siblings
    w = lin.weight.detach().clone()
    r = autofp4.quantize_model(m, "nvfp4")
    assert m.a is m.b and isinstance(m.a, FP4Linear)
    assert sorted(r.converted) == ["a", "b", "k_proj", "o", "q_proj", "v_proj"]
    assert m.o is m.k_proj and isinstance(m.k_proj, FP4Linear)
    assert r.bytes_before == sum(n * 64 * 2 for n in (64, 32, 32, 32))  # each weight counted once
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert _rel(m.b(x), x.float() @ w.float().T) < 0.2
    skip = nn.Module()
    skip.a = skip.b = nn.Linear(64, 64).bfloat16()
    r = autofp4.quantize_model(skip, "nvfp4", skip=["b"])
    assert r.converted == [] and "other name b" in _skipped(r)["a"] and type(skip.a) is nn.Linear


def test_hooks_of_a_converted_layer_still_run():
    torch.manual_seed(3)
    seen = []
    for fuse in (False, True):
        m = nn.Module()
        m.q_proj, m.k_proj, m.v_proj = (nn.Linear(64, 64).bfloat16() for _ in range(3))
        m.q_proj.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        m.q_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        y0 = m.q_proj(x)
        autofp4.quantize_model(m, "nvfp4", fuse=fuse)
        assert isinstance(m.q_proj, autofp4.nn.FP4LinearPart if fuse else FP4Linear)
        assert _rel(m.q_proj(x), y0) < 0.2  # the pre-hook's doubling kept (else 0.5)
    assert len(seen) == 4


def test_gpt2_conv1d_layers_are_named_as_not_converted():
    from transformers import GPT2Config, GPT2LMHeadModel

    g = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=96, bos_token_id=0, eos_token_id=0))
    r = autofp4.quantize_model(g, "nvfp4")
    why = _skipped(r)
    assert r.converted == [] and {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"} <= set(why)
    assert "Conv1D" in why["transformer.h.0.attn.c_attn"] and "skipped 5" in str(r)


def test_t5_keeps_what_transformers_keeps_in_float32_and_runs():
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(4)
    c = AutoConfig.for_model("t5", vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                             decoder_start_token_id=0)
    m = AutoModelForSeq2SeqLM.from_config(c).bfloat16()
    r = autofp4.quantize_model(m, "nvfp4")
    wo = {n: w for n, w in _skipped(r).items() if n.endswith(".wo")}
    assert len(wo) == 2 and all("_keep_in_fp32_modules" in w for w in wo.values())
    assert "encoder.block.0.layer.0.SelfAttention.q" in r.converted
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(m(input_ids=ids, decoder_input_ids=ids).logits).all()


def test_an_fp4_layer_read_for_its_weight_says_why():
    lin = FP4Linear.from_linear(nn.Linear(64, 32), "nvfp4")
    assert not hasattr(lin, "weight")
    with pytest.raises(AttributeError, match="keeps its weight packed .*skip="):
        lin.weight
    with pytest.raises(AttributeError, match="no attribute 'nothing'$"):
        lin.nothing
    with pytest.raises(RuntimeError, match="torch.jit.script"):
        torch.jit.script(lin)


def test_bad_roots_and_converter_hooks_are_named():
    with pytest.raises(TypeError, match="itself is Linear .*from_linear"):
        autofp4.quantize_model(nn.Linear(64, 64), "nvfp4")
    with pytest.raises(TypeError, match="hook must be callable"):
        autofp4.nn.register_module_converter(5)
    with pytest.raises(TypeError, match="fuse_projections: model must be a torch.nn.Module, got str"):
        autofp4.nn.fuse_projections("model")

    def returns_none(model, fmt, patterns, report):
        return None

    autofp4.nn.register_module_converter(returns_none)
    try:
        with pytest.raises(TypeError, match="converter .*returns_none.* returned None"):
            autofp4.quantize_model(nn.Sequential(nn.Linear(64, 64)), "nvfp4")
    finally:
        _MODULE_CONVERTERS.remove(returns_none)


@pytest.mark.parametrize("arch", ["LlamaForSequenceClassification", "LlamaModel"])
def test_from_pretrained_builds_the_saved_architecture(tmp_path, arch):
    import transformers

    torch.manual_seed(5)
    c = transformers.AutoConfig.for_model(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, num_labels=3, pad_token_id=0)
    m = getattr(transformers, arch)(c).bfloat16().eval()
    autofp4.quantize_model(m, "nvfp4")
    autofp4.save_pretrained(m, tmp_path / "ck")
    back = autofp4.from_pretrained(tmp_path / "ck")
    assert type(back).__name__ == arch
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(back(input_ids=ids)[0], m(input_ids=ids)[0])
