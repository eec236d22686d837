"""quantize_model's fused projections (``fuse``): q/k/v and gate/up stored as one stacked FP4
weight, each original layer a part of it. Checked against the parts' own rows dequantized, on
fresh random data, on the CPU (the reference backend)."""
import copy

import pytest
import torch
from torch import nn

import autofp4
from autofp4 import ops
from autofp4.nn import FP4FusedLinear, FP4Linear, FP4LinearPart, quantize_model


class Block(nn.Module):
    """An attention-and-MLP block with transformers' projection names, each used once per input."""

    def __init__(self, h: int = 128, kv: int = 64, i: int = 192, bias: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h, bias), nn.Linear(h, kv, bias), nn.Linear(h, kv, bias)
        self.o_proj = nn.Linear(h + 2 * kv, h, bias)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias), nn.Linear(h, i, bias), nn.Linear(i, h, bias)

    def forward(self, x):
        a = self.o_proj(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)) + x
        return self.down_proj(nn.functional.silu(self.gate_proj(a)) * self.up_proj(a)) + a


def _model(gen, bias=False, dtype=torch.bfloat16):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    m = nn.Sequential(Block(bias=bias), Block(bias=bias)).to(dtype)
    if bias:
        with torch.no_grad():
            for p in m.parameters():
                if p.ndim == 1:
                    p.normal_()
    return m


def _dense_copy(model):
    """``model`` with every converted layer an nn.Linear of its own dequantized FP4 weight (a
    part's: its rows of the fused weight), computed in float64."""
    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        parent_name, _, child = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        if isinstance(m, FP4FusedLinear):
            delattr(parent, child)
        elif isinstance(m, (FP4Linear, FP4LinearPart)):
            w = m.fp4_weight()
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.float64,
                            device=w.data.device)
            with torch.no_grad():
                lin.weight.copy_(w.dequantize(torch.float64))
                if m.bias is not None:
                    lin.bias.copy_(m.bias.double())
            setattr(parent, child, lin)
    return out.double()


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_matches_its_parts_dequantized_and_runs_one_call_per_group(fmt, bias, gen, monkeypatch):
    model = _model(gen, bias)
    original = copy.deepcopy(model)
    report = quantize_model(model, fmt, skip=[])
    assert report.fused == {f"{b}.{f}": [f"{b}.{p}" for p in parts] for b in ("0", "1")
                            for f, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                             ("gate_up_proj", ("gate_proj", "up_proj")))}
    assert len(report.converted) == 14 and not report.skipped  # every original layer is in the report
    assert "fused q_proj/k_proj/v_proj -> qkv_proj in 2 modules" in str(report)
    blk = model[0]
    assert isinstance(blk.qkv_proj, FP4FusedLinear) and blk.qkv_proj.out_features == 128 + 64 + 64
    assert [type(blk.get_submodule(p)) for p in ("q_proj", "k_proj", "v_proj")] == [FP4LinearPart] * 3
    assert (blk.k_proj.in_features, blk.k_proj.out_features, blk.k_proj.rows) == (128, 64, slice(128, 192))
    assert isinstance(blk.o_proj, FP4Linear) and not isinstance(blk.o_proj, FP4FusedLinear)
    # the part's weight is its rows of the stacked one, which quantized the original rows
    for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        w = blk.get_submodule(p).fp4_weight().dequantize(torch.float32)
        orig = original[0].get_submodule(p).weight.float()
        assert w.shape == orig.shape and _rel(w, orig) < 0.15, p

    calls = []
    real = ops.linear
    monkeypatch.setattr(ops, "linear", lambda x, w, b=None: calls.append(w.n) or real(x, w, b))
    x = torch.randn(3, 5, 128, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        out = model(x)
        ref = _dense_copy(model)(x.double())
    assert calls == [256, 128, 384, 128] * 2  # qkv, o, gate/up, down: one kernel call per group
    assert _rel(out, ref) < 1e-2
    assert all(m._held is None for m in model.modules() if isinstance(m, FP4FusedLinear))  # nothing kept


def test_a_part_called_with_another_or_a_changed_input_computes_its_own_output(gen):
    model = _model(gen)
    quantize_model(model, "nvfp4", skip=[])
    blk = model[0]
    x1, x2 = (torch.randn(4, 128, generator=gen).to(torch.bfloat16) for _ in range(2))

    def want(part, x):
        return x.double() @ part.fp4_weight().dequantize(torch.float64).T

    with torch.no_grad():
        q = blk.q_proj(x1)
        k = blk.k_proj(x2)  # another tensor: computed for x2, not sliced from x1's output
        assert _rel(q, want(blk.q_proj, x1)) < 1e-2 and _rel(k, want(blk.k_proj, x2)) < 1e-2
        assert _rel(k, want(blk.k_proj, x1)) > 0.5
        blk.gate_proj(x1)
        x1.mul_(-2)  # changed in place after the first part took its slice
        assert _rel(blk.up_proj(x1), want(blk.up_proj, x1)) < 1e-2
        v = blk.v_proj(x1)  # the same part twice in a row computes again too
        assert _rel(blk.v_proj(x1), v) == 0


def test_unfusable_siblings_stay_separate_layers(gen):
    model = _model(gen)
    report = quantize_model(model, "mxfp4", skip=["*.k_proj"])
    blk = model[0]
    assert isinstance(blk.k_proj, nn.Linear) and not hasattr(blk, "qkv_proj")
    assert type(blk.q_proj) is FP4Linear and type(blk.v_proj) is FP4Linear
    assert isinstance(blk.gate_up_proj, FP4FusedLinear)  # the MLP's pair still fuses
    assert ("0.k_proj", "matches a skip pattern") in report.skipped
    plain = _model(gen)
    assert quantize_model(plain, "mxfp4", skip=[], fuse=False).fused == {}
    assert all(type(plain[0].get_submodule(p)) is FP4Linear for p in ("q_proj", "k_proj", "gate_proj"))


def test_state_dict_deepcopy_and_device_moves_keep_one_copy_of_the_stacked_weight(gen):
    model = _model(gen)
    quantize_model(model, "nvfp4", skip=[])
    keys = [k for k in model.state_dict() if k.startswith("0.")]
    assert "0.qkv_proj.weight_packed" in keys and not any(k.startswith(("0.q_proj", "0.k_proj")) for k in keys)
    twin = _model(gen)
    quantize_model(twin, "nvfp4", skip=[])
    twin.load_state_dict(model.state_dict())
    clone = copy.deepcopy(model)
    assert clone[0].k_proj.fused is clone[0].qkv_proj  # the copy's part uses the copy's weight
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(twin(x), want) and torch.equal(clone(x), want)
        assert torch.equal(model.to(torch.float16).to(torch.bfloat16)(x), want)  # FP4 buffers keep their dtypes


def test_fused_layers_trace_into_one_graph_with_one_op_per_group(gen):
    model = _model(gen)
    quantize_model(model, "mxfp4", skip=[])
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    seen = []

    def backend(gm, example_inputs):
        seen.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and "autofp4" in str(n.target)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert seen == [8] and torch.equal(got, want)
    assert autofp4.FP4FusedLinear is FP4FusedLinear


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_fused_layers_under_compile_and_graph_replay_match_the_parts(fmt, gen):
    """On the GPU (the Hopper kernels): eager, ``torch.compile`` and a CUDA graph of the compiled
    model replayed on new inputs agree with the parts' dequantized rows."""
    model = _model(gen, bias=True).cuda()
    quantize_model(model, fmt, skip=[])
    dense = _dense_copy(model)
    compiled = torch.compile(model, dynamic=False)
    static = torch.randn(2, 128, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        assert _rel(model(static), dense(static.double())) < 1e-2
        for _ in range(2):
            compiled(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        for _ in range(3):
            static.copy_(torch.randn(2, 128, generator=gen).to("cuda", torch.bfloat16))
            graph.replay()
            assert _rel(out, dense(static.double())) < 1e-2


def test_fuse_projections_stacks_fp4_layers_exactly_where_it_can(gen):
    """``fuse_projections`` on an FP4 model: MXFP4 siblings stack exactly (the parts' tensors are
    the layers' own); NVFP4 siblings with their own global scales are left separate."""
    from autofp4.nn import fuse_projections

    model = _model(gen, bias=True)
    quantize_model(model, "mxfp4", skip=[], fuse=False)
    before = {n: m.fp4_weight() for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        assert sorted(fuse_projections(model)) == ["0.gate_up_proj", "0.qkv_proj", "1.gate_up_proj", "1.qkv_proj"]
        got = model(x)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    for n in ("0.q_proj", "0.v_proj", "1.up_proj"):
        part = model.get_submodule(n)
        assert isinstance(part, FP4LinearPart) and torch.equal(part.fp4_weight().data, before[n].data)
        assert torch.equal(part.fp4_weight().scale, before[n].scale)
    assert fuse_projections(model) == {}  # nothing left to fuse
    nv = _model(gen)
    with torch.no_grad():
        for blk in nv:
            blk.k_proj.weight.mul_(3)
            blk.up_proj.weight.mul_(3)
    quantize_model(nv, "nvfp4", skip=[], fuse=False)
    assert not torch.equal(nv[0].k_proj.fp4_weight().global_scale, nv[0].q_proj.fp4_weight().global_scale)
    assert fuse_projections(nv) == {} and type(nv[0].q_proj) is FP4Linear
