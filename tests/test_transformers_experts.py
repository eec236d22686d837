"""quantize_model on the fused 3-D experts of real transformers MoE models (tiny, random, CPU)."""
import copy
import sys
import subprocess

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from autofp4.integrations.transformers import FP4Experts, FP4Router  # noqa: E402
from autofp4.nn import FP4FusedLinear, FP4Linear, FP4LinearPart, quantize_model  # noqa: E402

ATTN = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, initializer_range=0.05)


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **ATTN, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    ))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **ATTN, num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
    ))


def _deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **ATTN, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16,
    ))


def _gpt_oss(**kw):
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **ATTN, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, **kw,
    ))


def _gpt_oss_random_experts():
    """gpt-oss with random expert biases (they start at zero) and gate/up projections large enough
    that the clamps of its SwiGLU act on some values."""
    model = _gpt_oss()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "GptOssExperts":
                m.gate_up_proj.normal_(0.0, 0.5)
                m.gate_up_proj_bias.normal_(0.0, 2.0)
                m.down_proj_bias.normal_(0.0, 0.5)
    return model


MODELS = {"qwen3_moe": (_qwen3_moe, 2), "mixtral": (_mixtral, 2), "deepseek_v3": (_deepseek_v3, 1)}


def _build(factory, seed):
    torch.manual_seed(seed)
    return factory().to(torch.bfloat16).eval()


def _experts_modules(model):
    return {n: m for n, m in model.named_modules() if n.endswith(".experts")}


def _gpt_oss_layout(w13, w2):
    """autofp4's ``w13 [E, 2I, H]`` (gate rows, then up) and ``w2 [E, H, I]`` in gpt-oss's layout:
    ``gate_up_proj [E, H, 2I]`` with gate and up columns interleaved, ``down_proj [E, I, H]``."""
    i = w2.shape[-1]
    return torch.stack((w13[:, :i], w13[:, i:]), dim=2).flatten(1, 2).transpose(1, 2), w2.transpose(1, 2)


def _reference_from(model_q, model_ref):
    """``model_ref`` (a copy of the model before conversion) with every converted weight replaced by
    the dequantized FP4 weight of ``model_q`` (its biases stay the original ones)."""
    ref_modules = dict(model_ref.named_modules())
    with torch.no_grad():
        for name, m in model_q.named_modules():
            if isinstance(m, (FP4Linear, FP4LinearPart)) and not isinstance(m, FP4FusedLinear):
                ref_modules[name].weight.copy_(m.fp4_weight().dequantize(torch.float32))
            elif isinstance(m, FP4Experts):
                dense = [m.fp4_weight(p).dequantize(torch.float32) for p in ("gate_up_proj", "down_proj")]
                if type(ref_modules[name]).__name__ == "GptOssExperts":
                    dense = _gpt_oss_layout(*dense)
                for p, w in zip(("gate_up_proj", "down_proj"), dense):
                    getattr(ref_modules[name], p).copy_(w)
    return model_ref


def _compare(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    rel = float((a - b).norm() / b.norm())
    return cos, rel


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_experts_are_converted_and_match_the_dequantized_model(arch, fmt):
    factory, n_moe = MODELS[arch]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = _build(factory, seed)
    original = copy.deepcopy(model)
    routers_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp.gate." in n}
    assert routers_before, "the model has MoE routers"
    experts_before = _experts_modules(model)
    assert len(experts_before) == n_moe
    shapes = {f"{n}.{p}": tuple(getattr(m, p).shape) for n, m in experts_before.items()
              for p in ("gate_up_proj", "down_proj")}

    report = quantize_model(model, fmt)

    # the experts modules are FP4 now, their 3-D parameters are gone from the state dict
    for n in experts_before:
        assert isinstance(model.get_submodule(n), FP4Experts)
    sd = model.state_dict()
    assert not any(k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj") for k in sd)
    assert sum(k.endswith("experts.gate_up_proj_packed") for k in sd) == n_moe
    assert not any(p.dim() == 3 for p in model.parameters())

    # the report lists every expert tensor with its bytes
    recs = {r.name: r for r in report.tensors if r.kind == "experts"}
    assert set(recs) == set(shapes)
    for name, r in recs.items():
        assert r.converted and name in report.converted and r.shape == shapes[name]
        e, n, k = r.shape
        assert r.bytes_before == e * n * k * 2  # bf16
        assert r.bytes_before / 4.5 < r.bytes_after < r.bytes_before / 3  # 4 bits + block scales
    assert report.bytes_before == sum(r.bytes_before for r in report.tensors if r.converted)
    assert f"and {2 * n_moe} expert tensors to {fmt}" in str(report)

    # routers untouched (same parameters, not quantized, not in the report)
    for n, p in model.named_parameters():
        if n in routers_before:
            assert torch.equal(p, routers_before[n]) and p.dtype == routers_before[n].dtype
    assert not any(".mlp.gate" == r.name[-9:] for r in report.tensors)

    ids = torch.randint(0, 128, (2, 10))
    ref_model = _reference_from(model, copy.deepcopy(original))
    with torch.no_grad():
        got = model(ids).logits.float()
        ref = ref_model(ids).logits.float()
        orig = original(ids).logits.float()
    cos, rel = _compare(got, ref)
    # both models run in bf16 with different op orders (the reference backend's expert loop against
    # transformers' own): their logits differ by bf16 rounding through every layer, and where a
    # router's top-k is a near tie the two may pick different experts for a token; measured: about
    # 0.5% typically, up to 3.0% over 74 random models and inputs; a wrong activation or expert
    # gives far more
    assert cos > 0.999 and rel < 6e-2, (cos, rel)
    # and FP4 did change the model (the reference is not the original)
    cos0, _ = _compare(got, orig)
    assert cos0 < 0.99999


@pytest.mark.parametrize("arch", sorted(MODELS) + ["gpt_oss"])
def test_routers_next_to_fp4_experts_score_with_autofp4_route(arch):
    """The block's router becomes an FP4Router with the router's own parameters (the state dict
    keys and values unchanged) that returns what the router returns: the same logits, the same
    experts per token, their weights (within fp32 rounding; gpt-oss's own softmax is in bf16) in
    the router's dtype."""
    factory = _gpt_oss_random_experts if arch == "gpt_oss" else MODELS[arch][0]
    model = _build(factory, int(torch.randint(0, 2**31 - 1, ()).item()))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("router.bias", "gate.weight", "router.weight")):
                p.normal_(0.0, 0.5)  # logits far from ties
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    original = copy.deepcopy(model)
    keys = {k: v.clone() for k, v in model.state_dict().items() if ".gate." in k or ".router." in k}
    assert keys
    quantize_model(model, "nvfp4")
    routers = {n: m for n, m in model.named_modules() if isinstance(m, FP4Router)}
    assert routers and all(n.endswith((".gate", ".router")) for n in routers)
    sd = model.state_dict()
    assert all(k in sd and torch.equal(sd[k], v) for k, v in keys.items())
    for name, r in routers.items():
        theirs = original.get_submodule(name)
        h = torch.randn(9, r.hidden_dim).bfloat16()
        with torch.no_grad():
            got_logits, got_w, got_ids = r(h)
            want_logits, want_w, want_ids = theirs(h)
        assert torch.equal(got_logits, want_logits)
        assert got_w.dtype == want_w.dtype and got_ids.dtype == torch.int32
        tol = 1e-2 if arch == "gpt_oss" else 1e-6
        for t in range(9):
            got = dict(zip(got_ids[t].tolist(), got_w[t].float().tolist()))
            want = dict(zip(want_ids[t].tolist(), want_w[t].float().tolist()))
            assert sorted(got) == sorted(want), (name, t)
            assert all(abs(got[i] - want[i]) <= tol for i in want), (name, t)
    # a skip pattern keeps a router as it was
    model2 = copy.deepcopy(original)
    first = sorted(routers)[0]
    quantize_model(model2, "nvfp4", skip=["lm_head", first])
    assert not isinstance(model2.get_submodule(first), FP4Router)
    assert type(model2.get_submodule(first)) is type(original.get_submodule(first))


def test_shared_experts_and_dense_mlps_are_linear_and_converted():
    model = _build(_deepseek_v3, 0)
    report = quantize_model(model, "nvfp4")
    conv = set(report.converted)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj"} <= conv
    assert isinstance(model.model.layers[1].mlp.shared_experts.up_proj, FP4LinearPart)
    assert [n for n, _ in report.skipped] == ["lm_head"]


def test_skip_patterns_keep_experts():
    model = _build(_qwen3_moe, 1)
    report = quantize_model(model, "nvfp4", skip=["lm_head", "model.layers.0.mlp.experts"])
    skipped = dict(report.skipped)
    for p in ("gate_up_proj", "down_proj"):
        assert skipped[f"model.layers.0.mlp.experts.{p}"] == "matches a skip pattern"
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, nn.Parameter)
    assert isinstance(model.model.layers[1].mlp.experts, FP4Experts)
    rec = next(r for r in report.tensors if r.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert not rec.converted and rec.bytes_after == rec.bytes_before == 8 * 64 * 64 * 2


def test_linear_router_next_to_experts_stays_high_precision():
    model = _build(_mixtral, 2)
    block = model.model.layers[0].mlp
    block.gate = nn.Linear(64, 4, bias=False).to(torch.bfloat16)  # a Linear router
    report = quantize_model(model, "nvfp4")
    assert isinstance(block.gate, nn.Linear)
    assert dict(report.skipped)["model.layers.0.mlp.gate"] == "MoE router stays in high precision"


def _routers(model):
    return [layer.mlp.router for layer in model.model.layers]


def _logits_routed_alike(model, ref_model, ids):
    """The logits of ``model`` and of ``ref_model`` run with the routing (experts and weights) that
    ``model``'s routers chose: a near tie in a router's top-k, broken the other way by bf16
    rounding, sends a token to other experts, which in this tiny model, whose experts' outputs
    dominate, moved the logits by up to 28% in 160 measured cases (0.9% typically)."""
    chosen = []
    hooks = [r.register_forward_hook(lambda m, args, out: chosen.append(out[1:])) for r in _routers(model)]
    with torch.no_grad():
        got = model(ids).logits.float()
    for h in hooks:
        h.remove()
    replay = iter(chosen)
    hooks = [r.register_forward_hook(lambda m, args, out: (out[0], *next(replay))) for r in _routers(ref_model)]
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    for h in hooks:
        h.remove()
    assert next(replay, None) is None
    return got, ref


def _clamped_fractions(model, ids):
    """The fractions of gate values above 7 and of up values outside [-7, 7] that gpt-oss's experts
    see on ``ids`` (every expert on every token)."""
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append((m, args[0])))
             for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    gate, up = [], []
    for m, hs in seen:
        gu = torch.einsum("th,ehn->ten", hs.float(), m.gate_up_proj.float()) + m.gate_up_proj_bias.float()
        gate.append(gu[..., 0::2].flatten())
        up.append(gu[..., 1::2].flatten())
    return float((torch.cat(gate) > 7).float().mean()), float((torch.cat(up).abs() > 7).float().mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpt_oss_experts_are_converted_and_match_the_dequantized_model(fmt, dtype):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = _gpt_oss_random_experts().to(dtype).eval()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 10))
    gate_clamped, up_clamped = _clamped_fractions(original, ids)  # measured: 5-7% and 10-14%
    assert 0.01 < gate_clamped < 0.3 and 0.01 < up_clamped < 0.3, (gate_clamped, up_clamped)

    report = quantize_model(model, fmt)

    inter = 64
    for i in range(2):
        name = f"model.layers.{i}.mlp.experts"
        ex, before = model.get_submodule(name), original.get_submodule(name)
        assert isinstance(ex, FP4Experts) and ex.activation == "swigluoai"
        assert (ex.num_experts, ex.hidden_dim, ex.intermediate_dim) == (4, 64, inter)
        # biases carried in high precision: gate biases (HF's even columns), then up biases (odd)
        b13, b2 = ex.gate_up_proj_bias, ex.down_proj_bias
        assert torch.equal(b13[:, :inter], before.gate_up_proj_bias[:, 0::2])
        assert torch.equal(b13[:, inter:], before.gate_up_proj_bias[:, 1::2])
        assert torch.equal(b2, before.down_proj_bias) and b2.dtype == dtype
        for p, shape in (("gate_up_proj", (4, 64, 2 * inter)), ("down_proj", (4, inter, 64))):
            rec = next(r for r in report.tensors if r.name == f"{name}.{p}")
            assert rec.converted and rec.shape == shape and rec.kind == "experts"
    assert not any(p.dim() == 3 for p in model.parameters())
    sd = model.state_dict()
    assert sum(k.endswith("experts.gate_up_proj_bias") for k in sd) == 2
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP4LinearPart)
    router = model.model.layers[0].mlp.router  # scored by autofp4.route, its weights not quantized
    assert isinstance(router, FP4Router) and router.weight.dtype == original.model.layers[0].mlp.router.weight.dtype
    assert torch.equal(router.weight, original.model.layers[0].mlp.router.weight)

    got, ref = _logits_routed_alike(model, _reference_from(model, copy.deepcopy(original)), ids)
    cos, rel = _compare(got, ref)
    # bf16 rounding of the activations (the FP4 layers compute in bf16 for a float32 model too);
    # measured over 320 random models and inputs: about 0.8% typically, at most 1.0%; a wrong
    # activation (SiLU) gives 40% and more, leaving out the gate/up biases 75%
    assert cos > 0.9995 and rel < 2.5e-2, (cos, rel)
    with torch.no_grad():
        cos0, _ = _compare(got, original(ids).logits.float())
    assert cos0 < 0.999  # FP4 did change the model


def test_gpt_oss_experts_with_another_swiglu_are_skipped_with_the_reason():
    torch.manual_seed(3)
    model = _gpt_oss(swiglu_limit=5.0).to(torch.bfloat16).eval()
    report = quantize_model(model, "mxfp4")
    skipped = dict(report.skipped)
    for i in range(2):
        for p in ("gate_up_proj", "down_proj"):
            why = skipped[f"model.layers.{i}.mlp.experts.{p}"]
            assert "not supported by autofp4.moe" in why and "alpha=1.702, limit=5.0" in why
    assert not any(isinstance(m, FP4Experts) for m in model.modules())
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP4LinearPart)
    with torch.no_grad():
        out = model(torch.randint(0, 128, (1, 8))).logits
    assert out.shape == (1, 8, 128) and torch.isfinite(out).all()


def test_fp4_experts_state_dict_round_trip():
    model = _build(_qwen3_moe, 4)
    quantize_model(model, "nvfp4")
    model2 = _build(_qwen3_moe, 5)
    quantize_model(model2, "nvfp4")
    model2.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)


def test_importing_autofp4_does_not_import_transformers():
    code = "import sys, autofp4, autofp4.nn, autofp4.integrations.transformers; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
