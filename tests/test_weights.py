"""FP4Weight: validation, shape properties, views, device moves and the prepacked cache."""
from __future__ import annotations

import weakref

import pytest
import torch

from autofp4.weights import quantize
from autofp4.weights import FP4Weight

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode64(w: FP4Weight) -> torch.Tensor:
    """Independent float64 dequantization from the raw tensors."""
    b = w.data.long()
    codes = torch.stack((b & 0xF, b >> 4), -1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    mag = torch.tensor(GRID, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    bs = w.block_size
    if w.fmt == "nvfp4":
        s = w.scale.float().double() * w.global_scale.double().reshape(w.global_scale.shape + (1, 1))
    else:
        s = torch.exp2(w.scale.double() - 127)
    return vals * s.repeat_interleave(bs, -1)


def nv_tensors(gen, lead=(), n=8, k=64):
    data = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(*lead, n, k // 16, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    gs = torch.rand(lead, generator=gen) + 0.01
    return data, scale, gs


def mx_tensors(gen, lead=(), n=8, k=64):
    data = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(100, 150, (*lead, n, k // 32), generator=gen, dtype=torch.uint8)
    return data, scale


# ------------------------------------------------------------------ construction + properties
@pytest.mark.parametrize("lead", [(), (3,)])
def test_properties_nvfp4(gen, lead):
    data, scale, gs = nv_tensors(gen, lead, n=8, k=64)
    w = FP4Weight("nvfp4", data, scale, gs)
    assert w.shape == torch.Size((*lead, 8, 64))
    assert (w.n, w.k, w.block_size) == (8, 64, 16)
    assert w.experts == (lead[0] if lead else 0)
    assert w.device == torch.device("cpu")
    assert w.data is data and w.scale is scale and w.global_scale is gs  # no copies
    assert w.input_scale is None
    assert w.nbytes == data.numel() + scale.numel() + 4 * gs.numel()
    assert "nvfp4" in repr(w)
    assert torch.equal(w.dequantize(), decode64(w).float())


@pytest.mark.parametrize("lead", [(), (2,)])
def test_properties_mxfp4(gen, lead):
    data, scale = mx_tensors(gen, lead, n=4, k=96)
    w = FP4Weight("mxfp4", data, scale)
    assert w.shape == torch.Size((*lead, 4, 96)) and w.block_size == 32 and w.global_scale is None
    assert torch.equal(w.dequantize(), decode64(w).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_dtypes(gen, fmt, dtype):
    w = quantize(torch.randn(2, 16, 64, generator=gen), fmt)
    d = w.dequantize(dtype)
    assert d.dtype == dtype and d.shape == (2, 16, 64)
    assert torch.equal(d, decode64(w).float().to(dtype))


def test_weakref_and_identity(gen):
    w = quantize(torch.randn(16, 32, generator=gen), "nvfp4")
    r = weakref.ref(w)
    assert r() is w


# ------------------------------------------------------------------ validation errors
def test_construction_errors(gen):
    data, scale, gs = nv_tensors(gen)
    mdata, mscale = mx_tensors(gen)
    cases = [
        (ValueError, r"fmt must be one of \('nvfp4', 'mxfp4'\), got 'int4'", lambda: FP4Weight("int4", data, scale, gs)),
        (TypeError, r"data must be a uint8 tensor .*got torch.int8", lambda: FP4Weight("nvfp4", data.view(torch.int8), scale, gs)),
        (TypeError, r"data must be a uint8 tensor .*got list", lambda: FP4Weight("nvfp4", [1, 2], scale, gs)),
        (ValueError, r"data must be \[N, K/2\] or \[E, N, K/2\], got 1-D", lambda: FP4Weight("nvfp4", data[0], scale, gs)),
        (ValueError, r"got 4-D", lambda: FP4Weight("nvfp4", data[None, None], scale, gs)),
        (ValueError, r"data is empty \(shape \(0, 32\)\)", lambda: FP4Weight("nvfp4", data[:0], scale[:0], gs)),
        (ValueError, r"multiple of its block size 16, got K=56", lambda: FP4Weight("nvfp4", data[:, :28], scale, gs)),
        (ValueError, r"multiple of its block size 32, got K=48", lambda: FP4Weight("mxfp4", mdata[:, :24], mscale)),
        (TypeError, r"nvfp4 scale must be torch.float8_e4m3fn, got torch.uint8 .*view\(torch.float8_e4m3fn\)",
         lambda: FP4Weight("nvfp4", data, scale.view(torch.uint8), gs)),
        (TypeError, r"mxfp4 scale must be torch.uint8, got torch.float8_e4m3fn", lambda: FP4Weight("mxfp4", mdata, scale[:, :2])),
        (ValueError, r"nvfp4 scale must have shape \(8, 4\) .*got \(8, 3\)", lambda: FP4Weight("nvfp4", data, scale[:, :3], gs)),
        (ValueError, r"mxfp4 scale must have shape \(8, 2\) .*got \(7, 2\)", lambda: FP4Weight("mxfp4", mdata, mscale[:7])),
        (TypeError, r"nvfp4 needs a float32 global_scale tensor, got NoneType", lambda: FP4Weight("nvfp4", data, scale)),
        (TypeError, r"float32 global_scale tensor, got torch.bfloat16", lambda: FP4Weight("nvfp4", data, scale, gs.bfloat16())),
        (ValueError, r"global_scale must be a scalar tensor \(shape \(\)\), got shape \(1,\)", lambda: FP4Weight("nvfp4", data, scale, gs.reshape(1))),
        (ValueError, r"mxfp4 has no global scale", lambda: FP4Weight("mxfp4", mdata, mscale, gs)),
        (ValueError, r"scale is on meta but data is on cpu", lambda: FP4Weight("nvfp4", data, scale.to("meta"), gs)),
        (ValueError, r"global_scale is on meta but data is on cpu", lambda: FP4Weight("nvfp4", data, scale, gs.to("meta"))),
        (TypeError, r"input_scale must be a float32 tensor or None, got float", lambda: FP4Weight("nvfp4", data, scale, gs, 0.5)),
        (ValueError, r"input_scale must have shape \(\), got \(2,\)", lambda: FP4Weight("nvfp4", data, scale, gs, torch.ones(2))),
    ]
    for exc, match, make in cases:
        with pytest.raises(exc, match=match):
            make()


def test_stacked_global_scale_shape(gen):
    data, scale, gs = nv_tensors(gen, (3,))
    with pytest.raises(ValueError, match=r"global_scale must be one per expert \(shape \(3,\)\), got shape \(\)"):
        FP4Weight("nvfp4", data, scale, gs[0])
    with pytest.raises(ValueError, match=r"global_scale must be one per expert \(shape \(3,\)\), got shape \(2,\)"):
        FP4Weight("nvfp4", data, scale, gs[:2])
    with pytest.raises(ValueError, match=r"input_scale must have shape \(\) or \(3,\), got \(2,\)"):
        FP4Weight("nvfp4", data, scale, gs, torch.ones(2))
    # input scale: one shared value or one per expert
    assert FP4Weight("nvfp4", data, scale, gs, torch.tensor(0.5)).input_scale.shape == ()
    assert FP4Weight("nvfp4", data, scale, gs, torch.rand(3) + 0.1).input_scale.shape == (3,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_global_scale_must_be_finite_and_positive(gen, bad):
    data, scale, gs = nv_tensors(gen, (3,))
    gs[1] = bad
    with pytest.raises(ValueError, match=r"global_scale that is not finite and positive"):
        FP4Weight("nvfp4", data, scale, gs)
    # explicit opt-out for trusted tensors
    assert FP4Weight("nvfp4", data, scale, gs, check_values=False).experts == 3


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -2.0])
def test_input_scale_must_be_finite_and_positive(gen, bad):
    data, scale, gs = nv_tensors(gen)
    with pytest.raises(ValueError, match=r"input_scale that is not finite and positive"):
        FP4Weight("nvfp4", data, scale, gs, torch.tensor(bad))


def test_bad_block_scales(gen):
    data, scale, gs = nv_tensors(gen)
    for byte, what in ((0x7F, "NaN"), (0xFF, "NaN"), (0x88, "negative")):
        s = scale.clone()
        s.view(torch.uint8)[3, 1] = byte
        with pytest.raises(ValueError, match=r"negative or NaN E4M3 block scale"):
            FP4Weight("nvfp4", data, s, gs)
    mdata, mscale = mx_tensors(gen)
    mscale[2, 0] = 255
    with pytest.raises(ValueError, match=r"E8M0 scale of 255 \(NaN\)"):
        FP4Weight("mxfp4", mdata, mscale)


# ------------------------------------------------------------------ views
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_expert_matches_the_stacked_weight(gen, fmt):
    x = torch.randn(4, 16, 64, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 3.0]).reshape(4, 1, 1)
    w = quantize(x, fmt)
    full = w.dequantize()
    for e in range(4):
        we = w.expert(e)
        assert we.experts == 0 and we.shape == (16, 64) and we.fmt == fmt
        assert torch.equal(we.dequantize(), full[e])
        assert torch.equal(we.dequantize(), decode64(we).float())
        if fmt == "nvfp4":
            assert we.global_scale.shape == () and we.global_scale.item() == w.global_scale[e].item()
        assert we.data.data_ptr() == w.data[e].data_ptr()  # a view
    with pytest.raises(IndexError, match=r"expert index must be an int in \[0, 4\), got 4"):
        w.expert(4)
    with pytest.raises(IndexError, match=r"got -1"):
        w.expert(-1)
    with pytest.raises(IndexError, match=r"got 1.0"):
        w.expert(1.0)
    assert torch.equal(w.expert(torch.tensor(2)).data, w.data[2])
    with pytest.raises(ValueError, match=r"expert\(\) needs a stacked \[E, N, K\] weight"):
        w.expert(0).expert(0)


def test_expert_input_scale(gen):
    data, scale, gs = nv_tensors(gen, (3,))
    ins = torch.tensor([0.1, 0.2, 0.3])
    w = FP4Weight("nvfp4", data, scale, gs, ins)
    assert w.expert(2).input_scale.item() == pytest.approx(0.3)
    w = FP4Weight("nvfp4", data, scale, gs, torch.tensor(0.7))
    assert w.expert(1).input_scale.item() == pytest.approx(0.7)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_slice_rows(gen, fmt, lead):
    w = quantize(torch.randn(*lead, 48, 64, generator=gen), fmt)
    full = w.dequantize()
    s = w.slice_rows(16, 40)
    assert s.shape == (*lead, 24, 64) and s.n == 24
    assert torch.equal(s.dequantize(), full[..., 16:40, :])
    for start, end in ((0, 0), (10, 5), (-1, 4), (0, 49)):
        with pytest.raises(IndexError, match=rf"0 <= start < end <= N=48, got start={start}, end={end}"):
            w.slice_rows(start, end)


# ------------------------------------------------------------------ device moves + cache
def test_packed_cache(gen):
    w = quantize(torch.randn(32, 64, generator=gen), "nvfp4")
    calls = []

    def factory(x):
        calls.append(x)
        return ("prepacked", x.n)

    a = w.packed("backend_a", factory)
    b = w.packed("backend_a", factory)
    assert a is b and calls == [w]
    c = w.packed("backend_b", lambda x: object())
    assert c is not a and len(calls) == 1
    w.clear_packed()
    w.packed("backend_a", factory)
    assert len(calls) == 2


def test_to_does_not_carry_the_cache(gen):
    w = quantize(torch.randn(2, 32, 64, generator=gen), "nvfp4")
    w.packed("x", lambda x: 1)
    assert w.to("cpu") is w  # already there
    m = w.to("meta")
    assert m is not w and m.device.type == "meta" and m.shape == w.shape
    assert m.global_scale.device.type == "meta"
    calls = []
    m.packed("x", lambda x: calls.append(1) or 2)
    assert calls == [1]  # built again: the moved weight starts with an empty cache


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_round_trip(gen, fmt):
    w = quantize(torch.randn(3, 32, 64, generator=gen), fmt)
    w.packed("x", lambda x: "cpu form")
    c = w.to("cuda")
    assert c.device.type == "cuda" and c is not w
    assert c.packed("x", lambda x: "cuda form") == "cuda form"
    assert torch.equal(c.dequantize().cpu(), w.dequantize())
    assert torch.equal(c.expert(1).to("cpu").data, w.expert(1).data)


# ------------------------------------------------------------------ freeing the loaded tensors
def _tensor_fields(packed) -> dict:
    """The tensors of a packed layout (a dataclass), by field."""
    return {k: v for k, v in vars(packed).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_free_loaded_keeps_the_built_layouts_and_refuses_every_later_read(gen, fmt):
    import copy

    from autofp4.backends import get_backend
    from autofp4.ops import _weight_from_tensors, free_loaded
    from autofp4.weights import LoadedTensorsFreed

    b = get_backend("sm90_w4a16")
    w = quantize(torch.randn(256, 512, generator=gen, dtype=torch.bfloat16), fmt)
    assert free_loaded(w, torch.bfloat16) == 0  # nothing packed yet: nothing to run from
    twin = copy.deepcopy(w)
    want = b.prepare(twin)
    want_decode, want_gemm = _tensor_fields(want.decode), _tensor_fields(want.gemm)
    prep = w.packed(b.name, b.prepare)
    assert prep._gemm is None  # built lazily: free_loaded builds what is missing
    loaded = w.data.numel() + w.scale.numel() * w.scale.element_size()
    assert free_loaded(w, torch.bfloat16, why="served by X") == loaded
    assert w.freed and w.shape == twin.shape and w.data.dtype == torch.uint8 and w.scale.dtype == twin.scale.dtype
    assert w.data.untyped_storage().nbytes() == 1 and w.scale.untyped_storage().nbytes() == w.scale.element_size()
    for got, ref in ((_tensor_fields(prep.decode), want_decode), (_tensor_fields(prep.gemm), want_gemm)):
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert _weight_from_tensors(w.data, w.scale, w.global_scale, fmt) is w  # what a compiled graph finds
    assert w.to("cpu") is w and w.packed(b.name, b.prepare) is prep
    for read in (w.dequantize, lambda: copy.deepcopy(w), lambda: w.slice_rows(0, 8), lambda: w.to("meta"),
                 lambda: w.packed("reference", lambda x: x.dequantize()), w.clear_packed):
        with pytest.raises(LoadedTensorsFreed, match="freed after packing \\(served by X\\)"):
            read()
    assert free_loaded(w, torch.bfloat16) == 0  # once


def test_free_loaded_keeps_what_a_call_would_still_read(gen):
    from autofp4.backends import get_backend
    from autofp4.ops import free_loaded

    ref = quantize(torch.randn(64, 128, generator=gen), "nvfp4")
    ref.packed("reference", get_backend("reference").prepare)
    assert free_loaded(ref, torch.bfloat16) == 0 and not ref.freed  # the reference backend reads them on every call
    # MXFP4 block exponents 60 binades apart: fp16 activations fall back to the reference backend
    t = torch.randn(64, 128, generator=gen)
    t[:, :32] *= 2.0**-60
    mx = quantize(t, "mxfp4")
    sm90 = get_backend("sm90_w4a16")
    mx.packed(sm90.name, sm90.prepare)
    assert free_loaded(mx, torch.float16) == 0 and not mx.freed
    assert free_loaded(mx, torch.bfloat16) > 0
    # experts: both MoE kernels' layouts of the weight's role, built
    ex = quantize(torch.randn(4, 64, 128, generator=gen), "nvfp4")
    prep = ex.packed(sm90.name, sm90.prepare)
    assert free_loaded(ex, torch.bfloat16, gate_up=False) > 0
    assert {k for k in prep._moe if len(k) == 2} == {("moe_decode", False), ("moe_gemm", False)}
