"""Checkpoint loaders: ModelOpt NVFP4, fused projections, gpt-oss MXFP4 blocks, state dicts."""
from __future__ import annotations

import pytest
import torch

from autofp4.weights import quantize
from autofp4.loaders import from_modelopt, from_mxfp4_blocks, fuse_modelopt, load_state_dict_weight
from autofp4.weights import FP4Weight


def same(a: FP4Weight, b: FP4Weight) -> bool:
    ok = a.fmt == b.fmt and torch.equal(a.data, b.data)
    ok = ok and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    if a.global_scale is not None or b.global_scale is not None:
        ok = ok and torch.equal(a.global_scale, b.global_scale)
    return ok and torch.equal(a.dequantize(), b.dequantize())


def modelopt_parts(w: FP4Weight):
    return w.data.clone(), w.scale.clone(), w.global_scale.clone()


# ------------------------------------------------------------------ ModelOpt NVFP4
def test_from_modelopt_hand_built():
    # codes 1..15, 0 (even K in the low nibble); block scale 2.0 (E4M3 0x40); weight_scale_2 0.25
    weight = torch.tensor([[0x21, 0x43, 0x65, 0x87, 0xA9, 0xCB, 0xED, 0x0F]], dtype=torch.uint8)
    scale = torch.tensor([[0x40]], dtype=torch.uint8)
    w = from_modelopt(weight, scale, torch.tensor(0.25), input_scale=torch.tensor([0.125]))
    want = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, -0.0, -0.25, -0.5, -0.75, -1, -1.5, -2, -3, 0]
    assert w.fmt == "nvfp4" and w.shape == (1, 16)
    assert w.dequantize().tolist() == [want]
    assert w.input_scale.shape == () and w.input_scale.item() == 0.125


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_modelopt_state_dict_round_trip(gen, dtype):
    q = quantize(torch.randn(48, 128, generator=gen).to(dtype), "nvfp4")
    ins = torch.tensor([0.0123])
    sd = {
        "model.layers.0.mlp.down_proj.weight": q.data.clone(),
        "model.layers.0.mlp.down_proj.weight_scale": q.scale.clone(),
        "model.layers.0.mlp.down_proj.weight_scale_2": q.global_scale.reshape(1).clone(),
        "model.layers.0.mlp.down_proj.input_scale": ins,
        "model.layers.0.mlp.up_proj.weight": torch.zeros(1, dtype=torch.uint8),
    }
    w = load_state_dict_weight(sd, "model.layers.0.mlp.down_proj")
    assert same(w, q)
    assert w.global_scale.shape == () and w.input_scale.item() == pytest.approx(0.0123)
    # a trailing dot in the prefix and scales stored as raw uint8 bytes work too
    sd["model.layers.0.mlp.down_proj.weight_scale"] = q.scale.view(torch.uint8).clone()
    assert same(load_state_dict_weight(sd, "model.layers.0.mlp.down_proj."), q)


def test_from_modelopt_stacked_experts(gen):
    q = quantize(torch.randn(3, 16, 64, generator=gen) * torch.tensor([1.0, 5.0, 0.2]).reshape(3, 1, 1), "nvfp4")
    w = from_modelopt(q.data, q.scale, q.global_scale.reshape(3, 1), torch.tensor(0.5))
    assert same(w, q) and w.global_scale.shape == (3,) and w.input_scale.shape == ()


def test_from_modelopt_errors(gen):
    q = quantize(torch.randn(8, 64, generator=gen), "nvfp4")
    d, s, g = modelopt_parts(q)
    cases = [
        (TypeError, r"weight must be uint8 packed E2M1 codes \[N, K/2\], got torch.int8", lambda: from_modelopt(d.view(torch.int8), s, g)),
        (TypeError, r"weight_scale must be float8_e4m3fn \(or its bytes as uint8\), got torch.float32", lambda: from_modelopt(d, s.float(), g)),
        (TypeError, r"weight_scale_2 must be a float32 \(or bf16/fp16\) tensor, got torch.int64", lambda: from_modelopt(d, s, torch.tensor(1))),
        (ValueError, r"weight_scale_2 must be a scalar \(shape \(\) or \(1,\)\), got shape \(2,\)", lambda: from_modelopt(d, s, g.repeat(2))),
        (ValueError, r"weight_scale_2 that is not finite and positive: nan", lambda: from_modelopt(d, s, torch.tensor(float("nan")))),
        (ValueError, r"weight_scale_2 that is not finite and positive: 0.0", lambda: from_modelopt(d, s, torch.tensor(0.0))),
        (ValueError, r"weight_scale must have shape \(8, 4\) .*got \(8, 2\)", lambda: from_modelopt(d, s[:, :2], g)),
        (ValueError, r"multiple of its block size 16, got K=40", lambda: from_modelopt(d[:, :20], s[:, :3], g)),
        (ValueError, r"weight must be \[N, K/2\] or \[E, N, K/2\], got 1-D", lambda: from_modelopt(d[0], s, g)),
        (ValueError, r"weight is empty", lambda: from_modelopt(d[:0], s[:0], g)),
        (ValueError, r"input_scale that is not finite and positive", lambda: from_modelopt(d, s, g, torch.tensor(float("inf")))),
    ]
    for exc, match, make in cases:
        with pytest.raises(exc, match=match):
            make()


# ------------------------------------------------------------------ fused projections
def test_fuse_modelopt_rescales_block_scales_within_bound(gen):
    mags = (1.0, 0.07, 4.0, 0.3)  # q, k, v, extra part: different weight_scale_2 each
    rows = (32, 16, 16, 8)
    qs = [quantize(torch.randn(n, 128, generator=gen) * m, "nvfp4") for n, m in zip(rows, mags)]
    fused = fuse_modelopt([modelopt_parts(q) for q in qs], input_scale=torch.tensor(0.02))
    gmax = max(q.global_scale.item() for q in qs)
    assert fused.global_scale.item() == gmax and fused.shape == (72, 128)
    assert fused.input_scale.item() == pytest.approx(0.02)
    assert torch.equal(fused.data, torch.cat([q.data for q in qs]))
    changed = 0
    off = 0
    for q, n in zip(qs, rows):
        new = fused.scale[off : off + n].float().double()
        old = q.scale.float().double()
        exact = old * (q.global_scale.double() / gmax)
        if q.global_scale.item() == gmax:
            assert torch.equal(fused.scale[off : off + n].view(torch.uint8), q.scale.view(torch.uint8))
        else:
            changed += 1
            err = (new - exact).abs()
            normal = exact >= 2.0**-6
            assert bool((err[normal] <= exact[normal] * 2.0**-4 * (1 + 1e-6)).all())
            assert bool((err[~normal] <= 2.0**-10 * (1 + 1e-6)).all())
            # the rounding is to nearest: the other E4M3 neighbour is never closer
            step = torch.where(new >= 2.0**-6, torch.exp2(torch.floor(torch.log2(new.clamp(min=2.0**-6))) - 3), torch.full_like(new, 2.0**-9))
            assert bool((err <= step / 2 * (1 + 1e-6) + 1e-12).all())
            # dequantized values move by the same relative amount at most
            fd = fused.slice_rows(off, off + n).dequantize().double()
            pd = q.dequantize().double()
            assert bool(((fd - pd).abs() <= pd.abs() * 2.0**-4 * 1.0001 + 6 * 2.0**-10 * gmax).all())
        off += n
    assert changed == 3


def test_fuse_modelopt_equal_scales_is_exact(gen):
    q = quantize(torch.randn(64, 64, generator=gen), "nvfp4")
    parts = [modelopt_parts(q.slice_rows(0, 40)), modelopt_parts(q.slice_rows(40, 64))]
    assert same(fuse_modelopt(parts), q)


def test_fuse_modelopt_tiny_ratio_flushes_to_zero(gen):
    big = quantize(torch.randn(16, 64, generator=gen), "nvfp4")
    tiny = quantize(torch.randn(16, 64, generator=gen) * 1e-6, "nvfp4")
    fused = fuse_modelopt([modelopt_parts(big), modelopt_parts(tiny)])
    # 448 * (weight_scale_2 ratio ~1e-6) is far below E4M3's smallest subnormal/2 (2**-10)
    assert bool((fused.scale[16:].float() == 0).all())
    assert bool((fused.dequantize()[16:] == 0).all())
    assert torch.equal(fused.dequantize()[:16], big.dequantize())


def test_fuse_modelopt_stacked_experts_equals_per_expert(gen):
    gate = quantize(torch.randn(3, 16, 64, generator=gen) * torch.tensor([1.0, 0.1, 3.0]).reshape(3, 1, 1), "nvfp4")
    up = quantize(torch.randn(3, 8, 64, generator=gen) * torch.tensor([0.5, 2.0, 3.0]).reshape(3, 1, 1), "nvfp4")
    fused = fuse_modelopt([modelopt_parts(gate), modelopt_parts(up)])
    assert fused.shape == (3, 24, 64) and fused.global_scale.shape == (3,)
    for e in range(3):
        one = fuse_modelopt([modelopt_parts(gate.expert(e)), modelopt_parts(up.expert(e))])
        assert same(fused.expert(e), one)


def test_fuse_modelopt_errors(gen):
    a = modelopt_parts(quantize(torch.randn(8, 64, generator=gen), "nvfp4"))
    b = modelopt_parts(quantize(torch.randn(8, 128, generator=gen), "nvfp4"))
    with pytest.raises(ValueError, match=r"non-empty list of \(weight, weight_scale, weight_scale_2\), got \[\]"):
        fuse_modelopt([])
    with pytest.raises(ValueError, match=r"same K, experts and device as part 0 \(K=64, .*part 1 has K=128"):
        fuse_modelopt([a, b])
    with pytest.raises(ValueError, match=r"part 1 must be \(weight, weight_scale, weight_scale_2\), got tuple of length 2"):
        fuse_modelopt([a, a[:2]])
    with pytest.raises(TypeError, match=r"weight_scale must be float8_e4m3fn"):
        fuse_modelopt([a, (a[0], a[1].float(), a[2])])


# ------------------------------------------------------------------ gpt-oss MXFP4
def test_from_mxfp4_blocks_hand_built():
    blocks = torch.tensor([[[[16 * i + (15 - i) for i in range(16)]]]], dtype=torch.uint8)  # [1, 1, 1, 16]
    scales = torch.tensor([[[128]]], dtype=torch.uint8)  # 2**1
    w = from_mxfp4_blocks(blocks, scales)
    want = [-12, 0, -8, 1, -6, 2, -4, 3, -3, 4, -2, 6, -1, 8, -0.0, 12,
            12, -0.0, 8, -1, 6, -2, 4, -3, 3, -4, 2, -6, 1, -8, 0, -12]
    assert w.fmt == "mxfp4" and w.shape == (1, 1, 32) and w.experts == 1
    assert w.dequantize().tolist() == [[want]]


@pytest.mark.parametrize("lead", [(), (4,)])
def test_gpt_oss_state_dict_round_trip(gen, lead):
    q = quantize(torch.randn(*lead, 24, 96, generator=gen, dtype=torch.bfloat16), "mxfp4")
    prefix = "model.layers.3.mlp.experts.gate_up_proj"
    sd = {
        f"{prefix}_blocks": q.data.reshape(*lead, 24, 3, 16).clone(),
        f"{prefix}_scales": q.scale.clone(),
        f"{prefix}_bias": torch.randn(*lead, 24, generator=gen),
    }
    w = load_state_dict_weight(sd, prefix)
    assert same(w, q)
    # the flat [..., N, K/2] layout is accepted as well
    assert same(from_mxfp4_blocks(q.data, q.scale), q)


def test_mxfp4_with_modelopt_style_names(gen):
    q = quantize(torch.randn(16, 64, generator=gen), "mxfp4")
    sd = {"lin.weight": q.data, "lin.weight_scale": q.scale}
    assert same(load_state_dict_weight(sd, "lin"), q)


def test_from_mxfp4_blocks_errors(gen):
    q = quantize(torch.randn(2, 8, 64, generator=gen), "mxfp4")
    b4 = q.data.reshape(2, 8, 2, 16)
    cases = [
        (TypeError, r"blocks must be uint8, got torch.int8", lambda: from_mxfp4_blocks(b4.view(torch.int8), q.scale)),
        (TypeError, r"scales must be uint8 E8M0 exponents, got torch.float32", lambda: from_mxfp4_blocks(b4, q.scale.float())),
        (ValueError, r"gpt-oss blocks \(2, 8, 2, 8\) and scales \(2, 8, 2\) do not match: blocks \[..., N, K/32, 16\] take",
         lambda: from_mxfp4_blocks(b4[..., :8], q.scale)),
        (ValueError, r"blocks \(2, 8, 3, 16\) and scales \(2, 8, 2\) do not match", lambda: from_mxfp4_blocks(torch.cat([b4, b4[:, :, :1]], 2), q.scale)),
        (ValueError, r"scales must have shape \(2, 8, 2\) .*got \(2, 8, 1\)", lambda: from_mxfp4_blocks(q.data, q.scale[..., :1])),
        (ValueError, r"blocks must be \[..., N, K/2\] or \[..., N, K/32, 16\] .*got \(2, 8, 2, 16, 1\)",
         lambda: from_mxfp4_blocks(b4[..., None], q.scale)),
        (ValueError, r"scales must be \[N, K/32\] or \[E, N, K/32\], got shape \(32,\)", lambda: from_mxfp4_blocks(b4, q.scale.reshape(-1))),
        (ValueError, r"E8M0 scale of 255 \(NaN\)", lambda: from_mxfp4_blocks(b4, torch.full_like(q.scale, 255))),
    ]
    for exc, match, make in cases:
        with pytest.raises(exc, match=match):
            make()


# ------------------------------------------------------------------ state-dict detection errors
def test_load_state_dict_weight_errors(gen):
    q = quantize(torch.randn(8, 64, generator=gen), "nvfp4")
    m = quantize(torch.randn(8, 64, generator=gen), "mxfp4")
    with pytest.raises(KeyError, match=r"no FP4 weight under 'a.b': expected 'a.b.weight' \(ModelOpt\) or 'a.b_blocks' \(gpt-oss\); keys starting with the prefix: \['a.bias'\]"):
        load_state_dict_weight({"a.bias": torch.ones(1)}, "a.b")
    with pytest.raises(TypeError, match=r"'x.weight' must be uint8 packed FP4 values, got torch.bfloat16 \(8, 64\)"):
        load_state_dict_weight({"x.weight": torch.randn(8, 64).bfloat16()}, "x")
    with pytest.raises(KeyError, match=r"found 'x.weight' but not 'x.weight_scale'"):
        load_state_dict_weight({"x.weight": q.data}, "x")
    with pytest.raises(KeyError, match=r"found 'x_blocks' but not 'x_scales'"):
        load_state_dict_weight({"x_blocks": m.data}, "x")
    with pytest.raises(ValueError, match=r"both 'x.weight' and 'x_blocks' exist"):
        load_state_dict_weight({"x.weight": q.data, "x_blocks": m.data}, "x")
    with pytest.raises(KeyError, match=r"no 'x.weight_scale_2' \(needed for NVFP4\)"):
        load_state_dict_weight({"x.weight": q.data, "x.weight_scale": q.scale}, "x")
