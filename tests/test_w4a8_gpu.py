"""GPU tests of the Hopper W4A8 path: the FP8 activation quantizer bit for bit against its torch
reference, the W4A8 GEMM against float64 math on the same E4M3 operands, and the
``autofp4.linear(..., act_dtype="fp8")`` path (CUDA graph capture included)."""
from __future__ import annotations

import pytest
import torch

from autofp4.kernels import fp8_act_quant as aq
from autofp4.kernels import sm90_w4a16_gemm as g16
from autofp4.kernels import sm90_w4a8_gemm as g8
from autofp4.weights import quantize

pytestmark = pytest.mark.gpu


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm_90) GPU")


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte tensors equal, every E4M3 NaN pattern (0x7F, 0xFF) counted as one."""
    na, nb = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return bool(torch.equal(na, nb) and torch.equal(torch.where(na, 0, a), torch.where(nb, 0, b)))


@needs_sm90
@pytest.mark.parametrize("m,k,dtype", [(1, 4096, torch.bfloat16), (37, 200, torch.float16),
                                       (1000, 14336, torch.bfloat16), (5, 8, torch.bfloat16),
                                       # rows shared by 2 warps (two rows a CTA, the last one half empty),
                                       # 4 and 8 warps, K32 past K
                                       (5, 1040, torch.bfloat16), (3, 2056, torch.float16),
                                       (9, 28680, torch.bfloat16)])
def test_quantizer_matches_reference_bits(m, k, dtype):
    torch.manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-4, 4, m, device="cuda").unsqueeze(1)).to(dtype)
    quant = aq.compile_quantizer(k, "bfloat16" if dtype == torch.bfloat16 else "float16")
    xq, sx = quant(x)
    rq, rsx = aq.reference_quantize(x)
    assert xq.shape == rq.shape
    assert _nan_equal(xq, rq)
    torch.testing.assert_close(sx, rsx, rtol=0, atol=0)


@needs_sm90
def test_quantizer_zero_nan_inf_rows():
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    x[0] = 0
    x[1, 17] = float("nan")
    x[2, 100] = float("-inf")
    xq, sx = aq.compile_quantizer(256, "bfloat16")(x)
    rq, rsx = aq.reference_quantize(x)
    assert _nan_equal(xq, rq)
    assert sx[0] == 0 and (xq[0] == 0).all()
    assert torch.isinf(sx[2]) and torch.isfinite(sx[1])
    torch.testing.assert_close(sx, rsx, rtol=0, atol=0, equal_nan=True)


def _exact(x, w, bias):
    """float64 result on the operands the kernel multiplies (before rounding to x's dtype), and
    the sum of the magnitudes of its terms (for the fp32 accumulation bound)."""
    xq, sx = aq.reference_quantize(x, permute=False)
    k = x.shape[1]
    xv = xq[:, :k].view(torch.float8_e4m3fn).double() * sx.double()[:, None]
    q, f = g8.reference_weight(w)
    ref = xv @ q.double().T * f
    mag = xv.abs() @ q.double().abs().T * f
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    return ref, mag


def _fast_accum_error(x, w):
    """Relative error (Frobenius) of cuBLAS's FP8 GEMM with fast accumulation (no promotion of
    the MMA's partial sums: what vLLM's FP8 GEMMs run on Hopper) on the kernel's own E4M3 operands,
    against float64. ``torch._scaled_mm`` takes only multiples of 16: the operands are padded with
    zeros (which add nothing to any sum)."""
    n, k = w.shape
    m = x.shape[0]
    pm, pn, pk = (-m) % 16, (-n) % 16, (-k) % 16
    xq, sx = aq.reference_quantize(x, permute=False)
    q, f = g8.reference_weight(w)
    a = torch.nn.functional.pad(xq[:, :k].view(torch.float8_e4m3fn).float(), (0, pk, 0, pm))
    b = torch.nn.functional.pad(q.float(), (0, pk, 0, pn))
    sa = torch.nn.functional.pad(sx.float().reshape(-1, 1), (0, 0, 0, pm), value=1.0)
    sb = torch.full((1, n + pn), float(f), device=x.device, dtype=torch.float32)
    got = torch._scaled_mm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T,  # exact: E4M3 values
                           scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
    ref, _ = _exact(x, w, None)
    return float((got[:m, :n].double() - ref).norm() / ref.norm())


def _check(out, ref, mag, dtype, fast=None):
    """Every element within the rounding of the output plus an fp32 accumulation bound; where
    that fails (Hopper's FP8 MMA accumulates with fewer bits than fp32), the relative error
    must still be within 1.5x that of cuBLAS's fast-accumulating FP8 GEMM on the same operands
    (``fast``, from :func:`_fast_accum_error`) plus the output's rounding."""
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-10
    tol = ulp * ref.abs() + 2e-6 * mag + 1e-30
    err = (out.double() - ref).abs()
    bad = err > tol
    if not bad.any():
        return
    rel = float((out.double() - ref).norm() / ref.norm())
    rounding = float((ref.to(dtype).double() - ref).norm() / ref.norm())
    if fast is not None and rel <= 1.5 * fast + rounding:
        return
    idx = int((err / tol).argmax())
    row, col = divmod(idx, err.shape[1])
    raise AssertionError(f"{int(bad.sum())} of {bad.numel()} elements off; worst err/tol "
                         f"{float((err / tol).max()):.3g} at [{row}, {col}]: {float(out[row, col])} vs "
                         f"{float(ref[row, col])}; relative error {rel:.3g}, cuBLAS FP8 fast accumulation "
                         f"{fast if fast is None else f'{fast:.3g}'}, output rounding {rounding:.3g}")


CASES = [
    (g8.Sm90W4A8Config(), 513, 4096, 4096, "nvfp4", torch.bfloat16),
    (g8.Sm90W4A8Config(), 300, 1000, 320, "mxfp4", torch.float16),
    (g8.Sm90W4A8Config(tile_n=256, tile_m=128, stages=3, raster="m", swizzle=4), 700, 1536, 2048, "mxfp4",
     torch.bfloat16),
    (g8.Sm90W4A8Config(tile_n=64, tile_m=64, tile_k=256, producer=True, pdl=True), 3, 96, 96, "nvfp4",
     torch.bfloat16),
    (g8.Sm90W4A8Config(tile_m=192, stages=4), 4096, 512, 14336, "nvfp4", torch.float16),
]


@needs_sm90
@pytest.mark.parametrize("cfg,m,n,k,fmt,dtype", CASES)
def test_w4a8_gemm_against_float64(cfg, m, n, k, fmt, dtype):
    torch.manual_seed(n + k + m)
    w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), fmt)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    run = g8.compile_kernel(cfg, n, k, fmt, "bfloat16" if dtype == torch.bfloat16 else "float16")
    packed = g16.pack_weight(w)
    fast = _fast_accum_error(x, w)
    for b in (bias, None):
        out = run(x, packed, b)
        ref, mag = _exact(x, w, b)
        _check(out, ref, mag, dtype, fast)


@needs_sm90
def test_w4a8_gemm_rounds_a_wide_mxfp4_weight_as_the_reference_and_refuses_other_weights():
    w = quantize((torch.randn(64, 256) * torch.exp(torch.randn(64, 1) * 4)).to(torch.bfloat16).cuda(), "mxfp4")
    packed = g16.pack_weight(w)
    assert not packed.fp16_ok
    run = g8.compile_kernel(g8.Sm90W4A8Config(tile_m=64), 64, 256, "mxfp4", "bfloat16")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    ref, mag = _exact(x, w, None)
    _check(run(x, packed), ref, mag, torch.bfloat16, _fast_accum_error(x, w))
    other = g16.pack_weight(quantize(torch.randn(128, 256, device="cuda", dtype=torch.bfloat16), "mxfp4"))
    with pytest.raises(ValueError, match="compiled for n=64"):
        run(x, other)


@needs_sm90
def test_linear_act_fp8_runs_the_kernel_and_replays_in_a_graph():
    import autofp4

    torch.manual_seed(5)
    w = quantize(torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16), "nvfp4")
    x = torch.randn(2, 300, 2048, device="cuda", dtype=torch.bfloat16)
    out = autofp4.linear(x, w, act_dtype="fp8")
    ref, mag = _exact(x.reshape(-1, 2048), w, None)
    _check(out.reshape(-1, 1024), ref, mag, torch.bfloat16, _fast_accum_error(x.reshape(-1, 2048), w))
    # the bf16-activation result differs by about the FP8 rounding of x
    plain = autofp4.linear(x, w)
    rel = float((out.double() - plain.double()).norm() / plain.double().norm())
    assert 1e-3 < rel < 0.05
    # a wide-spread MXFP4 weight: its smallest blocks rounded (as the reference), warned about
    wide = quantize((torch.randn(64, 256) * torch.exp(torch.randn(64, 1) * 4)).to(torch.bfloat16).cuda(), "mxfp4")
    xs = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="14 binades"):
        got = autofp4.linear(xs, wide, act_dtype="fp8")
    ref, mag = _exact(xs, wide, None)
    _check(got, ref, mag, torch.bfloat16, _fast_accum_error(xs, wide))
    # CUDA graph: replays with new inputs
    xg = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    autofp4.linear(xg, w, act_dtype="fp8")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = autofp4.linear(xg, w, act_dtype="fp8")
    xg.copy_(torch.randn_like(xg))
    graph.replay()
    torch.cuda.synchronize()
    ref, mag = _exact(xg, w, None)
    _check(og, ref, mag, torch.bfloat16, _fast_accum_error(xg, w))


CUBLAS_CASES = [  # (chunk_n, m, n, k, fmt, dtype)
    (0, 513, 4096, 4096, "nvfp4", torch.bfloat16),
    (1024, 700, 3072, 2048, "mxfp4", torch.bfloat16),
    (2048, 300, 4112, 144, "nvfp4", torch.float16),  # K32 > K: zero-padded; a last chunk of 16 rows
    (0, 5, 1008, 2880, "mxfp4", torch.float16),
]


@needs_sm90
@pytest.mark.parametrize("chunk,m,n,k,fmt,dtype", CUBLAS_CASES)
def test_cublas_path_against_float64(chunk, m, n, k, fmt, dtype):
    """The cuBLAS path (FP4 -> E4M3 pass, cuBLAS FP8 GEMM) through the backend's runner: the same
    numbers as the in-kernel GEMM, against float64 math on them, with and without a bias."""
    from autofp4.backends import get_backend
    from autofp4.kernels import w4a8_cublas as cb
    from autofp4.problem import ProblemKey

    torch.manual_seed(n + k + m + chunk)
    w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), fmt)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    be = get_backend("sm90_w4a8")
    dt = "bfloat16" if dtype == torch.bfloat16 else "float16"
    key = ProblemKey("linear_fp8", fmt, dt, n, k)
    cfg = cb.W4A8CublasConfig(chunk_n=chunk)
    assert be.is_valid(cfg, key) is None and cfg in be.candidates(key, 4096)
    run = be.compile(cfg, key)
    prep = be.prepare(w)
    fast = _fast_accum_error(x, w)
    for b in (bias, None):
        out = run(x, prep, b)
        assert out.shape == (m, n) and out.dtype == dtype
        ref, mag = _exact(x, w, b)
        _check(out, ref, mag, dtype, fast)
    assert run(x[:0], prep, None).shape == (0, n)


@needs_sm90
def test_cublas_path_replays_in_a_graph_and_keeps_the_stored_weight():
    from autofp4.backends import get_backend
    from autofp4.kernels import w4a8_cublas as cb
    from autofp4.problem import ProblemKey

    torch.manual_seed(9)
    n, k = 2048, 1024
    w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), "nvfp4")
    be = get_backend("sm90_w4a8")
    key = ProblemKey("linear_fp8", "nvfp4", "bfloat16", n, k)
    run = be.compile(cb.W4A8CublasConfig(chunk_n=1024), key)
    prep = be.prepare(w)
    assert not be.pack_all(prep, "bfloat16", None)  # a dense weight's stored tensors are read on every call
    xg = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    run(xg, prep, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = run(xg, prep, None)
    for _ in range(2):
        xg.copy_(torch.randn_like(xg))
        graph.replay()
        torch.cuda.synchronize()
        ref, mag = _exact(xg, w, None)
        _check(og, ref, mag, torch.bfloat16, _fast_accum_error(xg, w))


@needs_sm90
def test_linear_act_fp8_at_prefill_runs_the_cublas_path_by_default_and_in_a_graph():
    """From 1024 tokens an untuned ``autofp4.linear(..., act_dtype="fp8")`` runs the cuBLAS path:
    the same numbers as the reference; its first call builds the weight's state, later calls
    replay in a CUDA graph with new inputs."""
    import autofp4
    from autofp4.dispatch import get_dispatcher
    from autofp4.problem import ProblemKey

    torch.manual_seed(12)
    n, k = 3072, 2048
    w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), "mxfp4")
    key = ProblemKey("linear_fp8", "mxfp4", "bfloat16", n, k)
    backend, cfg, _ = get_dispatcher().resolve(key, 1500)[:3]
    assert backend.name == "sm90_w4a8" and type(cfg).kernel == "cublas_fp8", (backend.name, cfg)
    x = torch.randn(1500, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = autofp4.linear(x, w, bias, act_dtype="fp8")
    ref, mag = _exact(x, w, bias)
    _check(out, ref, mag, torch.bfloat16, _fast_accum_error(x, w))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = autofp4.linear(x, w, bias, act_dtype="fp8")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref, mag = _exact(x, w, bias)
    _check(og, ref, mag, torch.bfloat16, _fast_accum_error(x, w))


MOE_CASES = [  # (fmt, E, I, H, T, top_k, activation, config)
    ("nvfp4", 8, 768, 2048, 300, 4, "silu", g8.Sm90W4A8Config(tile_m=64, stages=8)),
    ("mxfp4", 4, 2880, 2880, 1024, 2, "swigluoai", g8.Sm90W4A8Config(tile_m=256)),
    ("nvfp4", 16, 1024, 1024, 64, 8, "gelu", g8.Sm90W4A8Config(tile_m=128, raster="m", stages=6)),
]


def _moe_close(out, ref):
    """The W4A8 layer against its reference on the same E4M3 operands. The kernels' up product
    accumulates with fewer bits than fp32 and their activation is approximate, so h's bf16 and
    E4M3 roundings flip on a few elements against the float64 reference (each a whole E4M3 step
    of that element): about 1% of the layer's norm. A wrong token, expert or scale block is a
    whole row or block off, so every token's row is checked as well."""
    d = (out.double() - ref.double())
    rel = float(d.norm() / ref.double().norm())
    rows = d.norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-30)
    worst = int(rows.argmax())
    assert rel < 2e-2 and float(rows.max()) < 0.1, (
        f"relative error {rel:.3g}; worst token {worst}: {float(rows[worst]):.3g}")


@needs_sm90
@pytest.mark.parametrize("fmt,e,inter,h,t,top_k,act,cfg", MOE_CASES)
def test_w4a8_moe_against_reference(fmt, e, inter, h, t, top_k, act, cfg):
    from autofp4.kernels import sm90_moe_gemm as mg
    from autofp4.w4a8 import reference_moe

    torch.manual_seed(e + inter + t)
    w13 = quantize((torch.randn(e, 2 * inter, h, device="cuda") * 0.05).to(torch.bfloat16), fmt)
    w2 = quantize((torch.randn(e, h, inter, device="cuda") * 0.05).to(torch.bfloat16), fmt)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, e, device="cuda")
    logits[:, 0] += 3  # skewed: one expert takes most tokens
    tw, ids = torch.topk(logits.softmax(-1), top_k)
    bias13 = torch.randn(e, 2 * inter, device="cuda") * 0.1 if act == "swigluoai" else None
    bias2 = torch.randn(e, h, device="cuda") * 0.1 if act == "swigluoai" else None
    run = g8.compile_moe(cfg, 2 * inter, h, fmt, "bfloat16")
    out = run(x, mg.pack_experts(w13, True), mg.pack_experts(w2, False), tw, ids, act, None, bias13, bias2)
    ref = reference_moe(x, w13, w2, tw, ids, act, None, bias13, bias2)
    _moe_close(out, ref)
    plain = __import__("autofp4").moe(x, w13, w2, tw, ids, act, w13_bias=bias13, w2_bias=bias2)
    assert 1e-3 < float((out.double() - plain.double()).norm() / plain.double().norm()) < 0.08


@needs_sm90
def test_moe_act_fp8_api_expert_map_and_graph():
    import autofp4
    from autofp4.w4a8 import reference_moe

    torch.manual_seed(9)
    e, inter, h = 8, 512, 1024
    w13 = quantize((torch.randn(e, 2 * inter, h, device="cuda") * 0.05).to(torch.bfloat16), "nvfp4")
    w2 = quantize((torch.randn(e, h, inter, device="cuda") * 0.05).to(torch.bfloat16), "nvfp4")
    x = torch.randn(256, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(256, 16, device="cuda")
    emap = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    emap[4:12] = torch.arange(8, dtype=torch.int32, device="cuda")
    out = autofp4.moe(x, w13, w2, router_logits=logits, top_k=2, expert_map=emap, act_dtype="fp8")
    tw, ids = autofp4.route(logits, 2)
    ref = reference_moe(x, w13, w2, tw, ids, "silu", emap)
    _moe_close(out, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = autofp4.moe(x, w13, w2, router_logits=logits, top_k=2, expert_map=emap, act_dtype="fp8")
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    tw, ids = autofp4.route(logits, 2)
    ref = reference_moe(x, w13, w2, tw, ids, "silu", emap)
    _moe_close(og, ref)


@needs_sm90
def test_w4a8_moe_in_runs_of_experts_and_tokens(monkeypatch):
    """A layer forced into runs of experts (packed weights past a small offset limit) and runs
    of tokens, with an expert map and biases, is the layer's W4A8 reference."""
    import autofp4
    from autofp4.backends import sm90_w4a16 as B
    from autofp4.w4a8 import reference_moe

    torch.manual_seed(17)
    e, h, i, t, k = 12, 256, 128, 40, 3
    w13 = quantize(torch.randn(e, 2 * i, h, device="cuda"), "nvfp4")
    w2 = quantize(torch.randn(e, h, i, device="cuda"), "nvfp4")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    emap = torch.tensor([-1] * 4 + list(range(e)) + [-1] * 4, dtype=torch.int32, device="cuda")
    tw, ti = autofp4.route(torch.randn(t, e + 8, device="cuda"), k)
    b13 = torch.randn(e, 2 * i, device="cuda")
    b2 = torch.randn(e, h, device="cuda")
    ref = reference_moe(x, w13, w2, tw, ti, "silu", emap, b13, b2).double()
    one = w13.packed("sm90_w4a16", B.SM90W4A16Backend().prepare).moe("moe_gemm", True)
    monkeypatch.setattr(B, "MAX_ARG_BYTES", one.data.numel() // e * 5)  # runs of 5 experts
    assert len(B.expert_groups(one)) == 3
    got = autofp4.moe(x, w13, w2, tw, ti, expert_map=emap, w13_bias=b13, w2_bias=b2, act_dtype="fp8")
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3
    monkeypatch.setattr(B, "MAX_ARG_BYTES", (e * 256 + 7 * k) * h)  # and runs of 7 tokens
    assert len(B._token_runs(t, k, e, h)) == 6
    got = autofp4.moe(x, w13, w2, tw, ti, expert_map=emap, w13_bias=b13, w2_bias=b2, act_dtype="fp8")
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


@needs_sm90
@pytest.mark.parametrize("act_dtype", [None, "fp8"])
def test_gradients_through_the_kernels(act_dtype):
    """On the GPU kernels (eager and in a captured forward), x's gradient through a linear and a
    MoE layer is the layer's on the dequantized weights (straight through the FP8 roundings), and
    the forward is the kernels' (the same output as without gradients)."""
    import autofp4

    torch.manual_seed(31)
    w = quantize((torch.randn(512, 256, device="cuda") * 0.05).to(torch.bfloat16), "nvfp4")
    x0 = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    x = x0.clone().requires_grad_(True)
    y = autofp4.linear(x, w, act_dtype=act_dtype)
    with torch.no_grad():
        assert torch.equal(y, autofp4.linear(x0, w, act_dtype=act_dtype))
    y.backward(gy)
    want = gy.double() @ w.dequantize(torch.float64)
    assert float((x.grad.double() - want).norm() / want.norm()) < 1e-2
    e, inter, h, t = 8, 256, 256, 64
    w13 = quantize((torch.randn(e, 2 * inter, h, device="cuda") * 0.05).to(torch.bfloat16), "nvfp4")
    w2 = quantize((torch.randn(e, h, inter, device="cuda") * 0.05).to(torch.bfloat16), "nvfp4")
    xm0 = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = autofp4.route(torch.randn(t, e, device="cuda"), 2)
    xm = xm0.clone().requires_grad_(True)
    out = autofp4.moe(xm, w13, w2, tw, ti, act_dtype=act_dtype)
    with torch.no_grad():
        assert torch.equal(out, autofp4.moe(xm0, w13, w2, tw, ti, act_dtype=act_dtype))
    g = torch.randn_like(out)
    out.backward(g)
    x64 = xm0.double().requires_grad_(True)
    d13, d2 = w13.dequantize(torch.float64), w2.dequantize(torch.float64)
    ref = torch.zeros(t, h, dtype=torch.float64, device="cuda")
    for j in range(2):
        up = torch.einsum("th,tnh->tn", x64, d13[ti[:, j].long()])
        act = torch.nn.functional.silu(up[:, :inter]) * up[:, inter:]
        ref = ref + tw[:, j, None].double() * torch.einsum("ti,thi->th", act, d2[ti[:, j].long()])
    (want_m,) = torch.autograd.grad(ref, x64, g.double())
    assert float((xm.grad.double() - want_m).norm() / want_m.norm()) < 1e-2
