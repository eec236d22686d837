"""autofp4.linear / moe / route against float64 math written here, on fresh random data."""
import pytest
import torch

import autofp4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# relative Frobenius error of the op's output vs float64 math on the same dequantized weight
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def dense64(w: autofp4.FP4Weight) -> torch.Tensor:
    return w.dequantize(torch.float32).double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_matches_float64(device, fmt, dtype, gen):
    n, k = 96, 256
    w = autofp4.quantize(torch.randn(n, k, generator=gen).to(device), fmt)
    x = torch.randn(3, 5, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    y = autofp4.linear(x, w, bias)
    assert y.shape == (3, 5, n) and y.dtype == dtype and y.device.type == device
    ref = x.double() @ dense64(w).T + bias.double()
    assert rel_err(y, ref) < TOL[dtype]
    # the bound is meaningful: another weight of the same distribution is far off
    w_other = autofp4.quantize(torch.randn(n, k, generator=gen).to(device), fmt)
    assert rel_err(autofp4.linear(x, w_other, bias), ref) > 0.3


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_linear_known_values(fmt):
    # weights exactly on the E2M1 grid with amax 6 in every block: quantization is lossless
    k = 64
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = torch.stack([grid.repeat(k // 8), -grid.flip(0).repeat(k // 8)])
    w[:, :: (16 if fmt == "nvfp4" else 32)] = 6.0
    q = autofp4.quantize(w, fmt)
    x = torch.ones(1, k, dtype=torch.float16)
    y = autofp4.linear(x, q)
    assert torch.equal(y.double(), (x.double() @ w.double().T).to(torch.float16).double())


def test_linear_rejects_bad_input(gen):
    w = autofp4.quantize(torch.randn(32, 64, generator=gen), "nvfp4")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        autofp4.linear(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match="last dimension K=64"):
        autofp4.linear(torch.randn(2, 48, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        autofp4.linear(torch.randn(2, 64, dtype=torch.bfloat16), w, torch.randn(31, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="FP4Weight"):
        autofp4.linear(torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(32, 64))
    stacked = autofp4.quantize(torch.randn(2, 32, 64, generator=gen), "nvfp4")
    with pytest.raises(ValueError, match="2-D weight"):
        autofp4.linear(torch.randn(2, 64, dtype=torch.bfloat16), stacked)


def test_linear_empty_batch(gen):
    w = autofp4.quantize(torch.randn(32, 64, generator=gen), "mxfp4")
    y = autofp4.linear(torch.randn(0, 64, dtype=torch.bfloat16), w)
    assert y.shape == (0, 32)


def act64(act, g, u, limit=7.0):
    """The gated activation ``act(gate, up)`` in float64, from its formula (``limit``: swigluoai's clamp)."""
    if act == "silu":
        return g / (1 + torch.exp(-g)) * u
    if act == "gelu":
        return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
    assert act == "swigluoai"
    g, u = torch.minimum(g, torch.tensor(limit, dtype=g.dtype)), torch.clamp(u, -limit, limit)
    return (u + 1) * g / (1 + torch.exp(-1.702 * g))


def moe_float64(x, w13, w2, topk_w, topk_ids, act, b13=None, b2=None, limit=7.0):
    """Token by token, expert by expert, in float64 (``b13 [E, 2I]``, ``b2 [E, H]``: biases), on x's device."""
    a13, a2 = dense64(w13).cpu(), dense64(w2).cpu()
    e_, inter = a2.shape[0], a2.shape[-1]
    b13 = torch.zeros(e_, 2 * inter, dtype=torch.float64) if b13 is None else b13.cpu().double()
    b2 = torch.zeros(e_, a2.shape[1], dtype=torch.float64) if b2 is None else b2.cpu().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].cpu().double()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gu = a13[e] @ xt + b13[e]
            out[t] += float(topk_w[t, j]) * (a2[e] @ act64(act, gu[:inter], gu[inter:], limit) + b2[e])
    return out.to(x.device)


def _moe_case(gen, device, fmt, e=6, h=128, inter=64, t=9, top_k=2, dtype=torch.bfloat16, scale=4.0):
    """Random experts (gate and up of about ``scale`` standard deviations), x, routing and biases."""
    w13 = autofp4.quantize(torch.randn(e, 2 * inter, h, generator=gen).mul(scale / h**0.5).to(device), fmt)
    w2 = autofp4.quantize(torch.randn(e, h, inter, generator=gen).mul(inter**-0.5).to(device), fmt)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    topk_w, topk_ids = autofp4.route(torch.randn(t, e, generator=gen).to(device), top_k)
    b13 = (2 * torch.randn(e, 2 * inter, generator=gen)).to(device)
    b2 = torch.randn(e, h, generator=gen).to(device, torch.bfloat16)
    return w13, w2, x, topk_w, topk_ids, b13, b2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("act", autofp4.ops.ACTIVATIONS)
@pytest.mark.parametrize("biased", [False, True])
def test_moe_matches_float64(device, fmt, act, biased, gen):
    w13, w2, x, topk_w, topk_ids, b13, b2 = _moe_case(gen, device, fmt)
    if not biased:
        b13 = b2 = None
    y = autofp4.moe(x, w13, w2, topk_w, topk_ids, activation=act, w13_bias=b13, w2_bias=b2)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = moe_float64(x, w13, w2, topk_w, topk_ids, act, b13, b2)
    assert rel_err(y, ref) < 2e-2
    if biased:  # the biases count
        assert rel_err(autofp4.moe(x, w13, w2, topk_w, topk_ids, activation=act), ref) > 0.1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_moe_swigluoai_with_biases_matches_a_token_loop(fmt, gen):
    """In float32 the reference backend's expert loop is float64 math up to fp32 rounding; the
    data clamp some gates (above 7) and some ups (both sides), and leave the rest in the range."""
    from autofp4.backends.reference import reference_moe

    e, inter = 6, 64
    w13, w2, x, topk_w, topk_ids, b13, b2 = _moe_case(gen, "cpu", fmt, e=e, inter=inter, t=13, top_k=3)
    x = x.float()
    gu = torch.einsum("enh,th->ten", dense64(w13), x.double()) + b13.double()
    g, u = gu[..., :inter], gu[..., inter:]
    for clamped in ((g > 7).double().mean(), (u.abs() > 7).double().mean()):
        assert 0.01 < float(clamped) < 0.5, float(clamped)
    y = reference_moe(x, w13, w2, topk_w, topk_ids, "swigluoai", w13_bias=b13, w2_bias=b2)
    assert y.dtype == torch.float32
    ref = moe_float64(x, w13, w2, topk_w, topk_ids, "swigluoai", b13, b2)
    assert rel_err(y, ref) < 1e-5
    # the clamps count: the same layer without them is far off
    unclamped = moe_float64(x, w13, w2, topk_w, topk_ids, "swigluoai", b13, b2, limit=float("inf"))
    assert rel_err(unclamped, ref) > 0.1


def test_route_matches_softmax_topk(gen):
    logits = torch.randn(7, 10, generator=gen)
    w, ids = autofp4.route(logits, 3)
    p = torch.softmax(logits.double(), -1)
    for t in range(7):
        top = sorted(range(10), key=lambda i: -float(p[t, i]))[:3]
        assert sorted(ids[t].tolist()) == sorted(top)
        expect = p[t, ids[t].long()] / p[t, ids[t].long()].sum()
        assert torch.allclose(w[t].double(), expect, atol=1e-6)
    w_raw, _ = autofp4.route(logits, 3, renormalize=False)
    assert torch.allclose(w_raw.double(), p.gather(1, ids.long()), atol=1e-6)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    with pytest.raises(ValueError, match="top_k must be in"):
        autofp4.route(logits, 11)


def test_moe_rejects_bad_input(gen):
    e, h, inter = 4, 64, 32
    w13 = autofp4.quantize(torch.randn(e, 2 * inter, h, generator=gen), "nvfp4")
    w2 = autofp4.quantize(torch.randn(e, h, inter, generator=gen), "nvfp4")
    x = torch.randn(3, h, dtype=torch.bfloat16)
    tw = torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        autofp4.moe(x, w13, w2, tw, torch.tensor([[0, 1], [2, 4], [1, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        autofp4.moe(x, w13, w2, tw, torch.tensor([[0, -1], [2, 3], [1, 1]]))
    with pytest.raises(ValueError, match="topk_ids must be int32/int64"):
        autofp4.moe(x, w13, w2, tw, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="topk_weights must be a float tensor"):
        autofp4.moe(x, w13, w2, torch.rand(3, 3), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\]"):
        autofp4.moe(x, w13, w13, tw, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation must be one of"):
        autofp4.moe(x, w13, w2, tw, torch.zeros(3, 2, dtype=torch.int32), activation="relu")


def test_moe_rejects_bad_biases(gen):
    e, h, inter = 4, 64, 32
    w13, w2, x, tw, ti, b13, b2 = _moe_case(gen, "cpu", "nvfp4", e=e, h=h, inter=inter, t=3)
    good = {"w13_bias": b13, "w2_bias": b2}
    bad = {
        "w13_bias": [(TypeError, r"w13_bias must be a torch.Tensor \[E, 2I\] or None", b13.tolist()),
                     (ValueError, r"w13_bias must be \[E, 2I\] = \(4, 64\), got \(4, 32\)", b13[:, :inter]),
                     (ValueError, r"w13_bias must be \[E, 2I\]", b13[0]),
                     (ValueError, r"w13_bias must be \[E, 2I\]", b13.T),
                     (ValueError, "w13_bias must be a floating-point tensor, got torch.int32", b13.int()),
                     (ValueError, "w13_bias is on meta but x is on cpu", b13.to("meta"))],
        "w2_bias": [(TypeError, r"w2_bias must be a torch.Tensor \[E, H\] or None", 1.0),
                    (ValueError, r"w2_bias must be \[E, H\] = \(4, 64\), got \(5, 64\)", torch.cat([b2, b2[:1]])),
                    (ValueError, "w2_bias must be a floating-point tensor, got torch.bool", b2 > 0),
                    (ValueError, "w2_bias is on meta but x is on cpu", b2.to("meta"))],
    }
    for name, cases in bad.items():
        for exc, match, v in cases:
            with pytest.raises(exc, match=match):
                autofp4.moe(x, w13, w2, tw, ti, **{**good, name: v})
    # any float dtype is taken, and the same values give the same layer
    y = autofp4.moe(x, w13, w2, tw, ti, "swigluoai", **good)
    y64 = autofp4.moe(x, w13, w2, tw, ti, "swigluoai", w13_bias=b13.double(), w2_bias=b2.double())
    assert rel_err(y64, y) < 1e-2 and rel_err(y, moe_float64(x, w13, w2, tw, ti, "swigluoai", b13, b2)) < 2e-2


def test_moe_with_biases_under_torch_compile_fullgraph(gen):
    w13, w2, x, tw, ti, b13, b2 = _moe_case(gen, "cpu", "mxfp4")
    torch._dynamo.reset()

    def layer(x, b13, b2):
        return autofp4.moe(x, w13, w2, tw, ti, "swigluoai", w13_bias=b13, w2_bias=b2) + autofp4.moe(x, w13, w2, tw, ti)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager = layer(x, b13, b2)
    assert torch.equal(compiled(x, b13, b2), eager)
    assert rel_err(eager, moe_float64(x, w13, w2, tw, ti, "swigluoai", b13, b2)
                   + moe_float64(x, w13, w2, tw, ti, "silu")) < 2e-2
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"w2_bias must be a torch.Tensor or None"):
        torch.compile(lambda z: autofp4.moe(z, w13, w2, tw, ti, w2_bias=[1.0]), fullgraph=True, backend="aot_eager")(x)


class _Block(torch.nn.Module):
    def __init__(self, fmt, gen):
        super().__init__()
        self.proj = autofp4.FP4Linear(autofp4.quantize(torch.randn(128, 64, generator=gen), fmt))
        self.w13 = autofp4.quantize(torch.randn(4, 64, 128, generator=gen), fmt)
        self.w2 = autofp4.quantize(torch.randn(4, 128, 32, generator=gen), fmt)
        self.router = torch.nn.Linear(128, 4, dtype=torch.bfloat16)

    def forward(self, x):
        h = self.proj(x)
        tw, ti = autofp4.route(self.router(h), 2)
        return autofp4.moe(h, self.w13, self.w2, tw, ti) + autofp4.linear(x, self.proj.fp4_weight()).float().mean()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_torch_compile_fullgraph(fmt, gen):
    torch._dynamo.reset()
    block = _Block(fmt, gen)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = block(x)
        out = compiled(x)
    assert torch.equal(out, eager)


def test_custom_op_reuses_the_registered_weight(gen):
    """The tensor-only custom op finds the FP4Weight (and its prepacked cache) it was built from."""
    from autofp4.ops import _weight_from_tensors

    w = autofp4.quantize(torch.randn(64, 64, generator=gen), "nvfp4")
    half = w.slice_rows(0, 32)  # same storage pointers, other shape: must not be confused with w
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    autofp4.linear(x, w)
    autofp4.linear(x, half)
    assert _weight_from_tensors(w.data, w.scale, w.global_scale, "nvfp4") is w
    assert _weight_from_tensors(half.data, half.scale, half.global_scale, "nvfp4") is half
    y = torch.ops.autofp4.linear(x, w.data, w.scale, w.global_scale, None, "nvfp4")
    assert torch.equal(y, autofp4.linear(x, w))


# ----------------------------------------------------------------------------- activations of any rank
LEADING = [(), (3,), (2, 3), (2, 1, 3), (1, 1)]


@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_any_rank(lead, dtype, with_bias, gen):
    n, k = 48, 128
    w = autofp4.quantize(torch.randn(n, k, generator=gen), "nvfp4")
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    ref = x.double() @ dense64(w).T + (bias.double() if with_bias else 0)
    first = autofp4.linear(x, w, bias)  # the full path, which keeps the entry
    again = autofp4.linear(x, w, bias)  # the kept entry
    assert first.shape == again.shape == (*lead, n) and again.dtype == dtype
    assert rel_err(first, ref) < TOL[dtype]
    assert torch.equal(again, first)
    # the same rows as a 2-D batch: the same runner, the same numbers
    flat = autofp4.linear(x.reshape(-1, k), w, bias)
    assert torch.equal(again.reshape(-1, n), flat)
    other = autofp4.quantize(torch.randn(n, k, generator=gen), "nvfp4")
    assert rel_err(autofp4.linear(x, other, bias), ref) > 0.3


@pytest.mark.parametrize("make", [
    lambda r, k: r(3, 2, k).transpose(0, 1),  # [2, 3, K], rows strided
    lambda r, k: r(2, 3, 2 * k)[..., ::2],  # a strided last dimension
    lambda r, k: r(2, 3, k + 16)[..., 16:],  # padded rows
    lambda r, k: r(4, 2, 3, k)[::2],  # every other batch
])
def test_linear_non_contiguous_any_rank(make, gen):
    n, k = 32, 64
    w = autofp4.quantize(torch.randn(n, k, generator=gen), "mxfp4")
    x = make(lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16), k)
    assert not x.is_contiguous()
    autofp4.linear(x.contiguous(), w)  # an entry for this M exists: the strided x must not use it as is
    for _ in range(2):
        y = autofp4.linear(x, w)
        assert y.shape == (*x.shape[:-1], n)
        assert torch.equal(y, autofp4.linear(x.contiguous(), w))
        assert rel_err(y, x.double() @ dense64(w).T) < TOL[torch.bfloat16]


def test_linear_nd_takes_the_fast_path(monkeypatch, gen):
    """After one call, 3-D and 4-D contiguous x of the same rows skip the dispatcher, and the
    backend gets a view of x (no copy)."""
    from autofp4.backends import reference
    from autofp4.dispatch import Dispatcher, get_dispatcher

    n, k = 64, 96
    w = autofp4.quantize(torch.randn(n, k, generator=gen), "nvfp4")
    x = torch.randn(2, 5, k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ dense64(w).T
    calls = {"resolve": 0}
    seen = []
    for name in ("resolve", "resolve_entry"):
        orig = getattr(Dispatcher, name)

        def counted(self, *a, _orig=orig, **kw):
            calls["resolve"] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(Dispatcher, name, counted)
    real = reference.reference_linear

    def recording(xx, *a, **kw):
        seen.append((xx.data_ptr(), tuple(xx.shape)))
        return real(xx, *a, **kw)

    monkeypatch.setattr(reference, "reference_linear", recording)
    y0 = autofp4.linear(x, w)  # warm-up: resolves once
    assert calls["resolve"] == 1
    key = next(iter(w.__dict__["_linear_fast"]))
    assert key == (torch.bfloat16, x.device, 10)
    misses = dict(((kk, b), c) for kk, b, c in get_dispatcher(x.device).misses())
    for _ in range(5):
        assert torch.equal(autofp4.linear(x, w), y0)
    assert torch.equal(autofp4.linear(x.view(10, k), w).view(2, 5, n), y0)  # 2-D of the same rows
    y4 = autofp4.linear(x.view(1, 2, 5, k), w)
    assert torch.equal(y4, y0.view(1, 2, 5, n))
    assert calls["resolve"] == 1  # none of these went to the dispatcher
    assert all(p == (x.data_ptr(), (10, k)) for p in seen)  # views of x, never a copy
    after = dict(((kk, b), c) for kk, b, c in get_dispatcher(x.device).misses())
    (mk,) = [m for m in after if after[m] != misses.get(m, 0)]
    assert after[mk] - misses.get(mk, 0) == 7  # an untuned call counts as a miss on the fast path too
    assert rel_err(y0, ref) < TOL[torch.bfloat16]
    autofp4.linear(x[:1], w)  # other rows: the dispatcher again
    assert calls["resolve"] == 2


class _Proj3D(torch.nn.Module):
    def __init__(self, fmt, gen):
        super().__init__()
        self.a = autofp4.FP4Linear(autofp4.quantize(torch.randn(96, 64, generator=gen), fmt))
        self.b = autofp4.quantize(torch.randn(32, 96, generator=gen), fmt)

    def forward(self, x):  # x [batch, seq, 64]
        return autofp4.linear(torch.nn.functional.silu(self.a(x)), self.b)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_torch_compile_fullgraph_3d(fmt, gen):
    torch._dynamo.reset()
    mod = _Proj3D(fmt, gen)
    x = torch.randn(2, 7, 64, generator=gen).to(torch.bfloat16)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = mod(x)
        out = compiled(x)
        out2 = compiled(x)
    assert out.shape == (2, 7, 32)
    assert torch.equal(out, eager) and torch.equal(out2, eager)
